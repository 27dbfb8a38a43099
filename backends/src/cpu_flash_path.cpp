#include "backends/src/cpu_flash_path.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <map>
#include <mutex>
#include <thread>
#include <stdexcept>

#include "dimattn/cpu_threads.h"
#include "dimattn/error.h"
#include "dimattn/layout.h"
#include "dimattn/ops.h"
#include "kernels/cpu/flash_attention.h"

namespace dimattn::detail {
namespace {

constexpr const char* kOp = "dot_attention";

int64_t product(const Dims& dims) {
  int64_t n = 1;
  for (const Dim& d : dims) n *= d.extent();
  return n;
}

Dims join(std::initializer_list<Dims> parts) {
  Dims out;
  for (const Dims& p : parts) out.insert(out.end(), p.begin(), p.end());
  return out;
}

HostView host(Backend& be, const RawPtr& x) {
  std::optional<HostView> v = be.host_view(x);
  check(v.has_value(), kOp, "backend '", be.name(), "' does not expose host memory for cpu_flash");
  return *v;
}

// x in `order`, reshaped to `shape`: a view where strides allow, with a unit
// last stride (the kernel loads rows as vectors); each copy is counted.
RawPtr kernel_view(Backend& be, const MemoryView& mem, const Tensor& x, const Dims& order, const Shape& shape) {
  RawPtr aligned = align(x, order).raw();
  RawPtr r = be.reshape(aligned, shape);
  const HostView before = mem(aligned), after = mem(r);
  if (after.data != before.data) count_layout_copy();
  if (!after.strides.empty() && after.sizes.back() > 1 && after.strides.back() != 1) {
    r = be.contiguous(r);
    count_layout_copy();
  }
  return r;
}


// Per-entry values of an integer tensor over dims ⊆ outer, in outer's order.
std::vector<int64_t> per_entry(const Tensor& t, const Dims& outer) {
  std::vector<int64_t> out;
  for (double x : to_host(align(cast(t, DType::int64), outer))) out.push_back(static_cast<int64_t>(x));
  return out;
}

template <class F>
void run_kernel(F&& f) {
  try {
    f();
  } catch (const std::invalid_argument& e) {
    fail(kOp, "cpu_flash: ", e.what());
  }
}

}  // namespace

kernels::ElementStrides strides4(const HostView& v) {
  return {v.strides[0], v.strides[1], v.strides[2], v.sizes[3] > 1 ? v.strides[3] : 1};
}

kernels::ElementType kernel_element_type(DType d) {
  switch (d) {
    case DType::float32: return kernels::ElementType::float32;
    case DType::float64: return kernels::ElementType::float64;
    case DType::bfloat16: return kernels::ElementType::bfloat16;
    case DType::float16: return kernels::ElementType::float16;
    default: fail(kOp, "the fused attention kernels do not take ", dtype_name(d));
  }
}

MemoryView host_memory(Backend& be) {
  return [&be](const RawPtr& x) { return host(be, x); };
}

void flash_params(FlashParams& pr, const AttentionCall& c, const FlashLayout& l, const HostView& q, const HostView& k,
                  const HostView& v) {
  kernels::AttentionKernelParams& p = pr.p;
  p.dtype = kernel_element_type(q.dtype);
  p.q = q.data;
  p.k = k.data;
  p.v = v.data;
  p.batch = l.B;
  p.heads = l.Hkv * l.G;
  p.kv_heads = l.Hkv;
  p.seqlen_q = l.Tq;
  p.seqlen_k = l.Tk;
  p.head_dim = l.D;
  p.head_dim_v = l.Dv;
  p.q_strides = strides4(q);
  p.k_strides = strides4(k);
  p.v_strides = strides4(v);
  if (c.kv_spatial.is_dynamic()) {
    pr.kv_len = per_entry(c.kv_spatial.lengths(), l.outer);
    p.kv_lengths = pr.kv_len.data();
  }
  p.causal = c.causal;
  if (c.causal_offset) {
    pr.offset = per_entry(*c.causal_offset, l.outer);
    p.causal_offset = pr.offset.data();
  }
  p.scale = c.scale;
  p.dropout_p = c.dropout;
  p.dropout_broadcast = c.dropout_broadcast;
  p.seed = c.dropout_seed;
  p.rng_offset = static_cast<uint32_t>(c.dropout_offset);
}

void set_forward_outputs(kernels::AttentionKernelParams& p, const HostView& out, const HostView& lse) {
  p.out = out.data;
  p.out_strides = strides4(out);
  p.lse = lse.data;
  p.lse_batch_stride = lse.strides[0];
  p.lse_head_stride = lse.strides[1];
}

void set_backward_tensors(kernels::AttentionKernelParams& p, const HostView& dout, const HostView& dq,
                          const HostView& dk, const HostView& dv) {
  p.dout = dout.data;
  p.dout_strides = strides4(dout);
  p.dq = dq.data;
  p.dk = dk.data;
  p.dv = dv.data;
  p.dq_strides = strides4(dq);
  p.dk_strides = strides4(dk);
  p.dv_strides = strides4(dv);
}

const std::vector<KernelCandidate>& cpu_flash_candidates() {
  static const std::vector<KernelCandidate> c = {
      {"cpu_flash", cpu_flash_gate}, {"reference", [](const AttentionParams&) { return GateResult::pass(); }}};
  return c;
}

GateResult cpu_flash_gate(const AttentionParams& p) {
  if (p.device != DeviceType::cpu) return GateResult::fail("runs on CPU only");
  if (p.dtype != DType::float32 && p.dtype != DType::bfloat16 && p.dtype != DType::float64)
    return GateResult::fail(std::string("does not take ") + dtype_name(p.dtype) + "; float32, bfloat16 or float64");
  return GateResult::pass();
}

FlashLayout flash_layout(const AttentionCall& c) {
  FlashLayout l;
  Dims mask_dims;
  if (c.kv_spatial.is_dynamic()) mask_dims = c.kv_spatial.lengths().dims();
  if (c.causal_offset) mask_dims = join({mask_dims, c.causal_offset->dims()});
  l.outer = c.batch;
  if (!l.outer.empty() && !contains(mask_dims, l.outer.back())) {
    l.head = {l.outer.back()};
    l.outer.pop_back();
  }
  // Keys-only dims are more kv heads; the query is broadcast over them (a
  // copy of the query, never of keys or values). The kernel's per-entry
  // arrays are indexed by B alone, so masks must not vary over them.
  for (const Dim& d : c.keys_only) {
    check(!contains(mask_dims, d), kOp, "cpu_flash: kv lengths vary over ", d.repr(), ", a dim the query lacks");
    l.head.push_back(d);
  }
  l.B = product(l.outer);
  l.Hkv = product(l.head);
  l.G = product(c.query_groups);
  l.Tq = c.query_spatial.extent();
  l.Tk = c.kv_spatial.extent();
  l.D = c.key_dim.extent();
  l.Dv = product(c.value_feature);
  return l;
}

FlashInputs flash_inputs(Backend& be, const AttentionCall& c, const FlashLayout& l) {
  return flash_inputs(be, c, l, host_memory(be));
}

FlashInputs flash_inputs(Backend& be, const AttentionCall& c, const FlashLayout& l, const MemoryView& mem) {
  const Dims bh = join({l.outer, l.head});
  return {kernel_view(be, mem, c.query, join({bh, c.query_groups, {c.query_spatial, c.key_dim}}),
                      {l.B, l.Hkv * l.G, l.Tq, l.D}),
          kernel_view(be, mem, c.keys, join({bh, {c.kv_spatial, c.key_dim}}), {l.B, l.Hkv, l.Tk, l.D}),
          kernel_view(be, mem, c.values, join({bh, {c.kv_spatial}, c.value_feature}), {l.B, l.Hkv, l.Tk, l.Dv})};
}

LayoutClass flash_layout_class(Backend& be, const FlashInputs& in) { return flash_layout_class(in, host_memory(be)); }

LayoutClass flash_layout_class(const FlashInputs& in, const MemoryView& mem) {
  auto view = [&](const RawPtr& x) {
    const HostView h = mem(x);
    return ViewLayout{h.sizes, h.strides, nullptr, 0, dtype_size(h.dtype), reinterpret_cast<uintptr_t>(h.data)};
  };
  ViewLayout q = view(in.q), k = view(in.k), v = view(in.v);
  // Host views carry addresses, not storages: one buffer is one address range.
  // Offsets are measured from the lowest address so that classify_layout
  // sees views of one buffer as such.
  const uintptr_t base = std::min({q.data_address, k.data_address, v.data_address});
  for (ViewLayout* x : {&q, &k, &v}) x->offset = static_cast<int64_t>((x->data_address - base) / x->element_size);
  // Views that can touch each other's elements share storage; others do not.
  auto span_end = [](const ViewLayout& x) {
    int64_t hi = x.offset;
    for (size_t a = 0; a < x.sizes.size(); ++a) hi += (x.sizes[a] - 1) * x.strides[a];
    return hi;
  };
  static const int kStorage[3] = {0, 1, 2};
  ViewLayout* all[3] = {&q, &k, &v};
  for (int i = 0; i < 3; ++i) all[i]->storage = &kStorage[i];
  for (int i = 0; i < 3; ++i)
    for (int j = 0; j < i; ++j)
      if (all[i]->offset <= span_end(*all[j]) && all[j]->offset <= span_end(*all[i])) all[i]->storage = all[j]->storage;
  return classify_layout(q, k, v);
}

FlashForward flash_forward(Backend& be, const AttentionCall& c, const FlashLayout& l, const FlashInputs& in,
                           const kernels::ParallelFor& pf) {
  const HostView q = host(be, in.q), k = host(be, in.k), v = host(be, in.v);
  const DType lse_dtype = q.dtype == DType::float64 ? DType::float64 : DType::float32;
  const int64_t H = l.Hkv * l.G;
  FlashForward f{be.full({l.B, H, l.Tq, l.Dv}, 0.0, q.dtype, kCPU), be.full({l.B, H, l.Tq}, 0.0, lse_dtype, kCPU)};
  const HostView out = host(be, f.out), lse = host(be, f.lse);
  FlashParams pr;
  flash_params(pr, c, l, q, k, v);
  set_forward_outputs(pr.p, out, lse);
  run_kernel([&] { kernels::flash_attention_forward_cpu(pr.p, pf); });
  return f;
}

FlashInputs flash_backward(Backend& be, const AttentionCall& c, const FlashLayout& l, const FlashInputs& in,
                           const FlashForward& fwd, const RawPtr& dout, const kernels::ParallelFor& pf) {
  const HostView q = host(be, in.q), k = host(be, in.k), v = host(be, in.v);
  const RawPtr dout_c = be.contiguous(dout);
  FlashInputs g{be.full(q.sizes, 0.0, q.dtype, kCPU), be.full(k.sizes, 0.0, k.dtype, kCPU),
                be.full(v.sizes, 0.0, v.dtype, kCPU)};
  const HostView out = host(be, fwd.out), lse = host(be, fwd.lse), d = host(be, dout_c);
  const HostView dq = host(be, g.q), dk = host(be, g.k), dv = host(be, g.v);
  FlashParams pr;
  flash_params(pr, c, l, q, k, v);
  set_forward_outputs(pr.p, out, lse);
  set_backward_tensors(pr.p, d, dq, dk, dv);
  run_kernel([&] { kernels::flash_attention_backward_cpu(pr.p, pf); });
  return g;
}

Tensor flash_output(Backend& be, const AttentionCall& c, const FlashLayout& l, const RawPtr& out4) {
  const Dims dims = join({l.outer, l.head, c.query_groups, {c.query_spatial}, c.value_feature});
  Shape shape;
  for (const Dim& d : dims) shape.push_back(d.extent());
  return Tensor(dims, c.query.dtype(), c.query.device(), be.reshape(out4, shape), &be);
}

namespace {
std::atomic<int> g_threads{0};
}  // namespace

kernels::ParallelFor default_parallel_for() {
  // One pool per thread count, kept for the process: a call may still be
  // running on a pool when another thread changes the count.
  static std::mutex mu;
  static std::map<int, std::unique_ptr<kernels::ThreadPool>> pools;
  const int n = cpu_threads();
  std::lock_guard lock(mu);
  auto& pool = pools[n];
  if (!pool) pool = std::make_unique<kernels::ThreadPool>(n);
  return pool->as_parallel_for();
}

}  // namespace dimattn::detail

namespace dimattn {

void set_cpu_threads(int n) { detail::g_threads = n; }

int cpu_threads() {
  if (const int n = detail::g_threads; n > 0) return n;
  if (const char* env = std::getenv("DIMATTN_NUM_THREADS"); env && std::atoi(env) > 0) return std::atoi(env);
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

}  // namespace dimattn
