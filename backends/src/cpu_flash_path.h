#pragma once
// The adapter between roles and dimattn's own CPU kernel ("cpu_flash",
// kernels/cpu): any backend whose tensors expose host memory
// (Backend::host_view) runs it through these functions; the torch backend
// wraps them in an autograd function. The layout, the views and the kernel
// params are shared with the CUDA kernel's adapter (cuda_flash, in the torch
// backend), which passes a MemoryView of device memory instead.
//
// Kernel form: B = the batch dims but the last (all of them when the last is
// one that kv lengths or the causal offset vary over), kv heads = the last
// batch dim and the keys-only dims, query heads = kv heads × query groups
// (GQA: one kv head serves its groups without a copy). The flat index b·H + h
// is then philox.h's canonical index (batch dims, keys-only dims, groups), so
// dropout masks match the reference path exactly.
#include <functional>

#include "dimattn/backend.h"
#include "dimattn/selection.h"
#include "kernels/common/attention_params.h"
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

// A tensor's memory as a kernel reads it (pointer, sizes, strides, dtype):
// Backend::host_view for cpu_flash, the device pointer for cuda_flash.
using MemoryView = std::function<HostView(const RawPtr&)>;
MemoryView host_memory(Backend& be);  // throws when be exposes no host memory

// q [B, Hkv·G, Tq, D], k [B, Hkv, Tk, D], v [B, Hkv, Tk, Dv]: views where
// strides allow (unit last stride), else counted copies.
struct FlashInputs {
  RawPtr q, k, v;
};
FlashInputs flash_inputs(Backend& be, const AttentionCall& c, const FlashLayout& l);
FlashInputs flash_inputs(Backend& be, const AttentionCall& c, const FlashLayout& l, const MemoryView& mem);
LayoutClass flash_layout_class(Backend& be, const FlashInputs& in);
LayoutClass flash_layout_class(const FlashInputs& in, const MemoryView& mem);

// The kernel params both kernels take, without outputs; the per-entry arrays
// (kv lengths, causal offsets) are host vectors here, which p points at: a
// device kernel's adapter copies them and repoints p. Not copyable: p points
// into this object.
struct FlashParams {
  kernels::AttentionKernelParams p;
  std::vector<int64_t> kv_len, offset;
  FlashParams() = default;
  FlashParams(const FlashParams&) = delete;
  FlashParams& operator=(const FlashParams&) = delete;
};
// pre: q, k, v are the memory of flash_inputs' q, k, v.
void flash_params(FlashParams& out, const AttentionCall& c, const FlashLayout& l, const HostView& q,
                  const HostView& k, const HostView& v);
// out [B, H, Tq, Dv] and lse [B, H, Tq]: written by the forward pass, read by the backward pass.
void set_forward_outputs(kernels::AttentionKernelParams& p, const HostView& out, const HostView& lse);
void set_backward_tensors(kernels::AttentionKernelParams& p, const HostView& dout, const HostView& dq,
                          const HostView& dk, const HostView& dv);
kernels::ElementType kernel_element_type(DType d);  // throws for non-floating dtypes
kernels::ElementStrides strides4(const HostView& v);  // pre: v is 4-d

struct FlashForward {
  RawPtr out, lse;  // out [B, H, Tq, Dv] in the input dtype; lse [B, H, Tq] float32 (float64 for float64)
};
FlashForward flash_forward(Backend& be, const AttentionCall& c, const FlashLayout& l, const FlashInputs& in,
                           const kernels::ParallelFor& pf);
// dout [B, H, Tq, Dv] -> dq, dk, dv in the shapes of the inputs.
FlashInputs flash_backward(Backend& be, const AttentionCall& c, const FlashLayout& l, const FlashInputs& in,
                           const FlashForward& fwd, const RawPtr& dout, const kernels::ParallelFor& pf);

// out [B, H, Tq, Dv] as the call's output tensor (on the query's device).
Tensor flash_output(Backend& be, const AttentionCall& c, const FlashLayout& l, const RawPtr& out4);

// dimattn's CPU pool (set_cpu_threads), for backends without their own.
kernels::ParallelFor default_parallel_for();

}  // namespace dimattn::detail
