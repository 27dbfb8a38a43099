#pragma once
// The adapter between roles and dimattn's own CPU kernel ("cpu_flash",
// kernels/cpu): any backend whose tensors expose host memory
// (Backend::host_view) runs it through these functions; the torch backend
// wraps them in an autograd function.
//
// Kernel form: B = the batch dims but the last (all of them when the last is
// one that kv lengths or the causal offset vary over), kv heads = the last
// batch dim and the keys-only dims, query heads = kv heads × query groups
// (GQA: one kv head serves its groups without a copy). The flat index b·H + h
// is then philox.h's canonical index (batch dims, keys-only dims, groups), so
// dropout masks match the reference path exactly.
#include "dimattn/backend.h"
#include "dimattn/selection.h"
#include "kernels/cpu/thread_pool.h"

namespace dimattn::detail {

GateResult cpu_flash_gate(const AttentionParams& p);
// cpu_flash, then reference: the candidates of a backend with no other fast path.
const std::vector<KernelCandidate>& cpu_flash_candidates();

struct FlashLayout {
  Dims outer, head;  // dims of B and of the kv heads
  int64_t B, Hkv, G, Tq, Tk, D, Dv;
};
FlashLayout flash_layout(const AttentionCall& c);

// q [B, Hkv·G, Tq, D], k [B, Hkv, Tk, D], v [B, Hkv, Tk, Dv]: views where
// strides allow (unit last stride), else counted copies.
struct FlashInputs {
  RawPtr q, k, v;
};
FlashInputs flash_inputs(Backend& be, const AttentionCall& c, const FlashLayout& l);
LayoutClass flash_layout_class(Backend& be, const FlashInputs& in);

struct FlashForward {
  RawPtr out, lse;  // out [B, H, Tq, Dv] in the input dtype; lse [B, H, Tq] float32 (float64 for float64)
};
FlashForward flash_forward(Backend& be, const AttentionCall& c, const FlashLayout& l, const FlashInputs& in,
                           const kernels::ParallelFor& pf);
// dout [B, H, Tq, Dv] -> dq, dk, dv in the shapes of the inputs.
FlashInputs flash_backward(Backend& be, const AttentionCall& c, const FlashLayout& l, const FlashInputs& in,
                           const FlashForward& fwd, const RawPtr& dout, const kernels::ParallelFor& pf);

// out [B, H, Tq, Dv] as the call's output tensor.
Tensor flash_output(Backend& be, const AttentionCall& c, const FlashLayout& l, const RawPtr& out4);

// dimattn's CPU pool (set_cpu_threads), for backends without their own.
kernels::ParallelFor default_parallel_for();

}  // namespace dimattn::detail
