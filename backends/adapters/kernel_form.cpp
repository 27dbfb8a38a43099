#include "adapters/kernel_form.h"

#include <algorithm>

#include "dimattn/ext/layout.h"
#include "dimattn/internal/check.h"
#include "dimattn/internal/counters.h"

namespace dimattn::detail {

Dims join(std::initializer_list<Dims> parts) {
  Dims out;
  for (const Dims& p : parts) out.insert(out.end(), p.begin(), p.end());
  return out;
}

namespace {

constexpr const char* kOp = "dot_attention";

int64_t product(const Dims& dims) {
  int64_t n = 1;
  for (const Dim& d : dims) n *= d.extent();
  return n;
}

HostView host(Backend& be, const RawPtr& x) {
  std::optional<HostView> v = be.host_view(x);
  DIMATTN_CHECK(v.has_value(), kOp, "backend '", be.name(), "' does not expose host memory for cpu_flash");
  return *v;
}

// An aligned input reshaped to `shape`: a view where strides allow, with a
// unit last stride (kernels load rows as vectors); each copy is counted.
RawPtr kernel_view(Backend& be, const MemoryView& mem, const RawPtr& aligned, const Shape& shape) {
  const HostView before = mem(aligned);
  if (before.sizes == shape && (shape.back() <= 1 || before.strides.back() == 1)) return aligned;  // the common case
  RawPtr r = be.reshape(aligned, shape);
  const HostView after = mem(r);
  if (after.data != before.data) count_layout_copy();
  if (!after.strides.empty() && after.sizes.back() > 1 && after.strides.back() != 1) {
    r = be.contiguous(r);
    count_layout_copy();
  }
  return r;
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
    pr.kv_len = host_ints(c.kv_spatial.lengths(), l.outer);
    p.kv_lengths = pr.kv_len.data();
  }
  p.causal = c.causal;
  if (c.causal_offset) {
    pr.offset = host_ints(*c.causal_offset, l.outer);
    p.causal_offset = pr.offset.data();
  }
  p.scale = c.scale;
  p.dropout_p = c.dropout;
  p.dropout_broadcast = c.dropout_broadcast;
  p.seed = c.dropout_seed;
  p.rng_offset = static_cast<uint32_t>(c.dropout_offset);
  p.window_left = c.window_left;
  p.window_right = c.window_right;
  p.softcap = c.softcap;
  const int64_t H = l.Hkv * l.G;
  auto per_head = [&](const Tensor& t, std::vector<double>& out) { out = host_values(t, per_head_dims(c, l)); };
  if (c.alibi_slopes) {
    per_head(*c.alibi_slopes, pr.slopes);
    p.alibi_slopes = pr.slopes.data();
    p.alibi_batch_stride = H;
    p.alibi_head_stride = 1;
  }
  if (c.sinks) {
    per_head(*c.sinks, pr.sinks);
    p.sinks = pr.sinks.data();
    p.sinks_batch_stride = H;
    p.sinks_head_stride = 1;
    pr.dsinks.assign(static_cast<size_t>(l.B * H), 0.0);
    p.dsinks = pr.dsinks.data();
  }
}

Dims per_head_dims(const AttentionCall& c, const FlashLayout& l) { return join({l.outer, l.head, c.query_groups}); }

Tensor sinks_gradient(Backend& be, const AttentionCall& c, const FlashLayout& l, const std::vector<double>& dsinks) {
  const Tensor& sinks = *c.sinks;
  const Dims flat = per_head_dims(c, l);
  // Each flat index's position in the sinks' own row-major order.
  std::vector<int64_t> stride_of(flat.size(), 0);
  int64_t n = 1;
  for (size_t a = sinks.dims().size(); a-- > 0;) {
    const auto it = std::find(flat.begin(), flat.end(), sinks.dims()[a]);
    stride_of[static_cast<size_t>(it - flat.begin())] = n;
    n *= sinks.dims()[a].extent();
  }
  std::vector<double> grad(static_cast<size_t>(n), 0.0);
  for (int64_t x = 0; x < static_cast<int64_t>(dsinks.size()); ++x) {
    int64_t rest = x, at = 0;
    for (size_t a = flat.size(); a-- > 0;) {
      at += (rest % flat[a].extent()) * stride_of[a];
      rest /= flat[a].extent();
    }
    grad[static_cast<size_t>(at)] += dsinks[static_cast<size_t>(x)];
  }
  Shape shape;
  for (const Dim& d : sinks.dims()) shape.push_back(d.extent());
  return Tensor(sinks.dims(), sinks.dtype(), sinks.device(),
                be.from_host(shape, grad, sinks.dtype(), sinks.device()), &be);
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

FlashLayout flash_layout(const AttentionCall& c) {
  FlashLayout l;
  Dims mask_dims;
  if (c.kv_spatial.is_dynamic()) mask_dims = c.kv_spatial.lengths().dims();
  if (c.causal_offset) mask_dims = join({mask_dims, c.causal_offset->dims()});
  // The batch dims, then the keys-only dims (more kv heads; the query is
  // broadcast over them, a copy of the query, never of keys or values): the
  // canonical order of the flat batch index of philox.h. B takes a prefix,
  // the kv heads the rest: the last batch dim and the keys-only dims, unless
  // kv lengths or offsets vary over them (the kernels' per-entry arrays are
  // indexed by B alone), so that [B, H, T, D] buffers keep B and H as they are.
  const Dims all = join({c.batch, c.keys_only});
  size_t split = c.batch.empty() ? 0 : c.batch.size() - 1;
  for (size_t i = 0; i < all.size(); ++i)
    if (contains(mask_dims, all[i])) split = std::max(split, i + 1);
  l.outer.assign(all.begin(), all.begin() + static_cast<std::ptrdiff_t>(split));
  l.head.assign(all.begin() + static_cast<std::ptrdiff_t>(split), all.end());
  l.B = product(l.outer);
  l.Hkv = product(l.head);
  l.G = product(c.query_groups);
  l.Tq = c.query_spatial.extent();
  l.Tk = c.kv_spatial.extent();
  l.D = c.key_dim.extent();
  l.Dv = product(c.value_feature);
  return l;
}

FlashInputs aligned_inputs(const AttentionCall& c, const FlashLayout& l) {
  const Dims bh = join({l.outer, l.head});
  return {raw_in_order(kOp, c.query, join({bh, c.query_groups, {c.query_spatial, c.key_dim}}), true),
          raw_in_order(kOp, c.keys, join({bh, {c.kv_spatial, c.key_dim}}), true),
          raw_in_order(kOp, c.values, join({bh, {c.kv_spatial}, c.value_feature}), true)};
}

FlashInputs flash_inputs(Backend& be, const AttentionCall& c, const FlashLayout& l) {
  return flash_inputs(be, l, aligned_inputs(c, l), host_memory(be));
}

FlashInputs flash_inputs(Backend& be, const FlashLayout& l, const FlashInputs& aligned, const MemoryView& mem,
                         QueryForm form) {
  const Shape q_shape = form == QueryForm::heads ? Shape{l.B, l.Hkv * l.G, l.Tq, l.D} : Shape{l.B, l.Hkv, l.G * l.Tq, l.D};
  return {kernel_view(be, mem, aligned.q, q_shape), kernel_view(be, mem, aligned.k, {l.B, l.Hkv, l.Tk, l.D}),
          kernel_view(be, mem, aligned.v, {l.B, l.Hkv, l.Tk, l.Dv})};
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

Tensor flash_output(Backend& be, const AttentionCall& c, const FlashLayout& l, const RawPtr& out4) {
  const Dims dims = join({l.outer, l.head, c.query_groups, {c.query_spatial}, c.value_feature});
  Shape shape;
  for (const Dim& d : dims) shape.push_back(d.extent());
  const bool same = be.shape(out4) == shape;  // [B, H, Tq, Dv] with one dim each: no reshape
  return Tensor(dims, c.query.dtype(), c.query.device(), same ? out4 : be.reshape(out4, shape), &be);
}

}  // namespace dimattn::detail
