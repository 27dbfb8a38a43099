#pragma once
// The adapter between roles and dimattn's own CPU kernel ("cpu_flash",
// kernels/cpu): any backend whose tensors expose host memory
// (Backend::host_view) runs it through these functions, on the kernel form of
// kernel_form.h; the torch backend wraps them in an autograd function.

#include "dimattn/ext/backend.h"
#include "dimattn/ext/kernel_table.h"
#include "dimattn/selection.h"
#include "adapters/kernel_form.h"
#include "common/attention_params.h"
#include "cpu/thread_pool.h"

namespace dimattn::detail {

GateResult cpu_flash_gate(const AttentionParams& p);
// The instruction set cpu_flash runs p on (KernelEntry::isa; kernels/cpu/cpu_isa.h):
// DIMATTN_CPU_ISA's cap or the CPU's best, avx512 for other dtypes than
// bfloat16 under avx512_bf16. An unknown cap, or one this CPU lacks, is a
// dimattn::Error.
std::string cpu_flash_isa(const AttentionParams& p);
// cpu_flash's kernel-table entry for a backend with no other fast path: runs
// on dimattn's own CPU pool (default_parallel_for).
KernelEntry cpu_flash_entry();

struct FlashForward {
  RawPtr out, lse;  // out [B, H, Tq, Dv] in the input dtype; lse [B, H, Tq] float32 (float64 for float64)
};
FlashForward flash_forward(Backend& be, const AttentionCall& c, const FlashLayout& l, const FlashInputs& in,
                           const kernels::ParallelFor& pf);
// dout [B, H, Tq, Dv] -> dq, dk, dv in the shapes of the inputs; with sinks
// d(sinks) per (b, h) (kernel_form.h's sinks_gradient names it); with a bias
// that needs one (backends without autograd: always), d(bias) as
// kernel_form.h's bias_gradient_buffer lays it out.
struct FlashGrads {
  FlashInputs inputs;
  std::vector<double> dsinks;
  RawPtr dbias;
};
FlashGrads flash_backward(Backend& be, const AttentionCall& c, const FlashLayout& l, const FlashInputs& in,
                          const FlashForward& fwd, const RawPtr& dout, const kernels::ParallelFor& pf);

// The whole forward pass for a backend's run_attention: the call's output,
// on the call's kernel form (from its plan).
Tensor cpu_flash_attention(Backend& be, const AttentionCall& c, const KernelForm& form, const kernels::ParallelFor& pf);
// The call as a block of a longer attention (Backend::attention_block).
AttentionBlockResult cpu_flash_attention_block(Backend& be, const AttentionCall& c, const kernels::ParallelFor& pf);
// The whole backward pass for a backend's attention_backward: recomputes the
// forward pass unless `merged` gives it; grad_output over the call's output dims.
AttentionCallGrads cpu_flash_attention_backward(Backend& be, const AttentionCall& c, const Tensor& grad_output,
                                                const AttentionBlockResult* merged, const kernels::ParallelFor& pf);

// dimattn's CPU pool (set_cpu_threads), for backends without their own.
kernels::ParallelFor default_parallel_for();

}  // namespace dimattn::detail
