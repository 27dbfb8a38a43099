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
// dimattn's CPU pool (set_cpu_threads), for backends without their own.
kernels::ParallelFor default_parallel_for();
// cpu_flash's kernel-table entry: its run, its block (output and lse) and
// its backward, on the threads of `pool()`, outside any autograd. A backend
// with autograd gives it its own run (the torch backend's autograd function).
KernelEntry cpu_flash_entry(kernels::ParallelFor (*pool)() = default_parallel_for);
// The instruction set cpu_flash runs p on (KernelEntry::isa; kernels/cpu/cpu_isa.h):
// DIMATTN_CPU_ISA's cap or the CPU's best, avx512 for other dtypes than
// bfloat16 under avx512_bf16. An unknown cap, or one this CPU lacks, is a
// dimattn::Error.
std::string cpu_flash_isa(const AttentionParams& p);

struct FlashForward {
  RawPtr out, lse;  // out [B, H, Tq, Dv] in the input dtype; lse [B, H, Tq] float32 (float64 for float64)
};
FlashForward flash_forward(Backend& be, const AttentionCall& c, const FlashLayout& l, const FlashInputs& in,
                           const kernels::ParallelFor& pf);
// Attention over a paged kv cache, the pools read in place (cpu_flash_paged.cpp):
// KernelEntry::paged of cpu_flash.
Tensor cpu_flash_paged(Backend& be, const PagedAttentionCall& c, const kernels::ParallelFor& pf);
// dout [B, H, Tq, Dv] -> the gradients (kernel_form.h's FlashGrads), d(bias)
// where the bias needs one (backends without autograd: always).
FlashGrads flash_backward(Backend& be, const AttentionCall& c, const FlashLayout& l, const FlashInputs& in,
                          const FlashForward& fwd, const RawPtr& dout, const kernels::ParallelFor& pf);


}  // namespace dimattn::detail
