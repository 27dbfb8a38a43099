#include "adapters/cpu_flash_path.h"
#include "adapters/plan_cache.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <map>
#include <mutex>
#include <stdexcept>
#include <thread>

#include "cpu/flash_attention.h"
#include "dimattn/cpu_threads.h"
#include "dimattn/internal/check.h"

namespace dimattn::detail {
namespace {

constexpr const char* kOp = "dot_attention";

HostView host(Backend& be, const RawPtr& x) { return host_memory(be)(x); }

template <class F>
void run_kernel(F&& f) {
  try {
    f();
  } catch (const std::invalid_argument& e) {
    fail(kOp, "cpu_flash: ", e.what());
  }
}

}  // namespace

KernelEntry cpu_flash_entry() {
  return {"cpu_flash", DeviceType::cpu, cpu_flash_gate, {.last_dim_unit_stride = true},
          [](Backend& be, const AttentionCall& c, const AttentionPlan& plan) {
            const KernelForm* form = form_in(plan);
            return cpu_flash_attention(be, c, form ? *form : host_kernel_form(be, c), default_parallel_for());
          },
          cpu_flash_isa};
}

std::string cpu_flash_isa(const AttentionParams& p) {
  std::string isa;
  run_kernel([&] { isa = kernels::cpu_isa_name(kernels::cpu_flash_isa(kernel_element_type(p.dtype))); });
  return isa;
}

GateResult cpu_flash_gate(const AttentionParams& p) {
  if (p.device != DeviceType::cpu) return GateResult::fail("runs on CPU only");
  if (p.dtype != DType::float32 && p.dtype != DType::bfloat16 && p.dtype != DType::float16 && p.dtype != DType::float64)
    return GateResult::fail(std::string("does not take ") + dtype_name(p.dtype) +
                            "; float32, bfloat16, float16 or float64");
  return GateResult::pass();
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
  const ScoreOperands so = score_operands(be, c, pr, host_memory(be));
  set_forward_outputs(pr.p, out, lse);
  run_kernel([&] { kernels::flash_attention_forward_cpu(pr.p, pf); });
  return f;
}

FlashGrads flash_backward(Backend& be, const AttentionCall& c, const FlashLayout& l, const FlashInputs& in,
                          const FlashForward& fwd, const RawPtr& dout, const kernels::ParallelFor& pf) {
  const HostView q = host(be, in.q), k = host(be, in.k), v = host(be, in.v);
  const RawPtr dout_c = be.contiguous(dout);
  FlashInputs g{be.full(q.sizes, 0.0, q.dtype, kCPU), be.full(k.sizes, 0.0, k.dtype, kCPU),
                be.full(v.sizes, 0.0, v.dtype, kCPU)};
  const HostView out = host(be, fwd.out), lse = host(be, fwd.lse), d = host(be, dout_c);
  const HostView dq = host(be, g.q), dk = host(be, g.k), dv = host(be, g.v);
  FlashParams pr;
  flash_params(pr, c, l, q, k, v);
  const bool want_dbias = c.bias && (!be.has_autograd() || c.bias->requires_grad());
  const ScoreOperands so = score_operands(be, c, pr, host_memory(be), want_dbias);
  set_forward_outputs(pr.p, out, lse);
  set_backward_tensors(pr.p, d, dq, dk, dv);
  RawPtr dbias;
  if (want_dbias) dbias = bias_gradient_buffer(be, pr, c, host_memory(be), kCPU);
  run_kernel([&] { kernels::flash_attention_backward_cpu(pr.p, pf); });
  return {g, std::move(pr.dsinks), dbias};
}

Tensor cpu_flash_attention(Backend& be, const AttentionCall& c, const KernelForm& form, const kernels::ParallelFor& pf) {
  const FlashForward fwd = flash_forward(be, c, form.layout, flash_inputs(be, c, form), pf);
  return flash_output(be, c, fwd.out);
}

namespace {

// What cpu_flash needs of a call outside the kernel table: host memory and
// its gate.
void check_host_call(Backend& be, const AttentionCall& c, const char* op) {
  DIMATTN_CHECK(c.query.device().type == DeviceType::cpu && be.host_view(c.query.raw()).has_value(), op,
                "runs dimattn's CPU kernel and needs CPU tensors whose backend exposes host memory; got ",
                c.query.repr(), " (the torch backend runs CUDA tensors on cuda_flash)");
  const GateResult gate = cpu_flash_gate(attention_params(c, LayoutClass::separate, false));
  DIMATTN_CHECK(gate.ok, op, "cpu_flash cannot run this call: ", gate.reason);
}

}  // namespace

AttentionBlockResult cpu_flash_attention_block(Backend& be, const AttentionCall& c, const kernels::ParallelFor& pf) {
  check_host_call(be, c, "dot_attention_block");
  const KernelForm form = host_kernel_form(be, c);
  const FlashForward fwd = flash_forward(be, c, form.layout, flash_inputs(be, c, form), pf);
  return block_result(be, c, fwd.out, fwd.lse);
}

AttentionCallGrads cpu_flash_attention_backward(Backend& be, const AttentionCall& c, const Tensor& grad_output,
                                                const AttentionBlockResult* merged, const kernels::ParallelFor& pf) {
  const char* op = merged ? "dot_attention_block_backward" : "dot_attention_backward";
  check_host_call(be, c, op);
  const KernelForm form = host_kernel_form(be, c);
  const FlashLayout& l = form.layout;
  const FlashInputs in = flash_inputs(be, c, form);
  const FlashForward fwd =
      merged ? FlashForward{in_kernel_form(be, c, l, merged->output, "the merged output", true, c.query.dtype(), op),
                            in_kernel_form(be, c, l, merged->lse, "the merged lse", false, lse_dtype_of(c), op)}
             : flash_forward(be, c, l, in, pf);
  const RawPtr dout4 = in_kernel_form(be, c, l, grad_output, "grad_output", true, c.query.dtype(), op);
  const FlashGrads grads = flash_backward(be, c, l, in, fwd, dout4, pf);
  return call_grads(be, c, grads.inputs, grads.dsinks, grads.dbias);
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
