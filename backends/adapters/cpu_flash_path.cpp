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
  if (p.requires_grad && p.deterministic && p.variants.has(VariantKind::rel_pos))
    return GateResult::fail("the gradients of relative positions are summed with atomics (not deterministic)");
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
  const bool want_dbias = c.variants.bias && (!be.has_autograd() || c.variants.bias->requires_grad());
  const ScoreOperands so = score_operands(be, c, pr, host_memory(be), want_dbias);
  set_forward_outputs(pr.p, out, lse);
  set_backward_tensors(pr.p, d, dq, dk, dv);
  RawPtr dbias, dtable;
  if (want_dbias) dbias = bias_gradient_buffer(be, pr, c, host_memory(be), kCPU);
  if (c.rel_pos && (!be.has_autograd() || c.variants.pos_emb->requires_grad()))
    dtable = rel_pos_gradient_buffer(be, pr, c, host_memory(be), kCPU);
  run_kernel([&] { kernels::flash_attention_backward_cpu(pr.p, pf); });
  return {g, std::move(pr.dsinks), dbias, dtable, std::move(pr.dpos_u), std::move(pr.dpos_v)};
}

namespace {

// The call's kernel form: its plan's (the Eigen and torch backends' plans
// carry one), else derived from host memory.
KernelForm form_of(Backend& be, const AttentionCall& c, const AttentionPlan& plan) {
  const KernelForm* form = form_in(plan);
  return form ? *form : host_kernel_form(be, c);
}

// The gradients of a call (merged null) or of a block (merged: the whole
// attention's output and lse for its rows); grad_output over the call's
// output dims.
AttentionCallGrads backward_of(Backend& be, const AttentionCall& c, const KernelForm& form, const Tensor& grad_output,
                               const AttentionBlockResult* merged, const kernels::ParallelFor& pf) {
  const char* op = kernel_use_op(merged ? KernelUse::block_backward : KernelUse::backward);
  const FlashLayout& l = form.layout;
  const FlashInputs in = flash_inputs(be, c, form);
  const FlashForward fwd =
      merged ? FlashForward{in_kernel_form(be, c, l, merged->output, "the merged output", true, c.query.dtype(), op),
                            in_kernel_form(be, c, l, merged->lse, "the merged lse", false, lse_dtype_of(c), op)}
             : flash_forward(be, c, l, in, pf);
  const RawPtr dout4 = in_kernel_form(be, c, l, grad_output, "grad_output", true, c.query.dtype(), op);
  return call_grads(be, c, flash_backward(be, c, l, in, fwd, dout4, pf));
}

}  // namespace

KernelEntry cpu_flash_entry(kernels::ParallelFor (*pool)()) {
  KernelEntry e{.name = "cpu_flash", .device = DeviceType::cpu, .gate = cpu_flash_gate,
                .layout = {.last_dim_unit_stride = true}, .isa = cpu_flash_isa};
  e.run = [pool](Backend& be, const AttentionCall& c, const AttentionPlan& plan) {
    const KernelForm form = form_of(be, c, plan);
    return flash_output(be, c, flash_forward(be, c, form.layout, flash_inputs(be, c, form), pool()).out);
  };
  e.block = [pool](Backend& be, const AttentionCall& c, const AttentionPlan& plan) {
    const KernelForm form = form_of(be, c, plan);
    const FlashForward fwd = flash_forward(be, c, form.layout, flash_inputs(be, c, form), pool());
    return block_result(be, c, fwd.out, fwd.lse);
  };
  e.backward = [pool](Backend& be, const AttentionCall& c, const AttentionPlan& plan, const Tensor& grad_output,
                      const AttentionBlockResult* merged) {
    return backward_of(be, c, form_of(be, c, plan), grad_output, merged, pool());
  };
  e.paged = [pool](Backend& be, const PagedAttentionCall& c) { return cpu_flash_paged(be, c, pool()); };
  return e;
}

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
