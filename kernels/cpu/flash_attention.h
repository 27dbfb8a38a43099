#pragma once
// dimattn's fused CPU attention ("cpu_flash"): FlashAttention-2-style tiled
// online softmax, forward and backward, over AttentionKernelParams.
//
// Numerics: float32, bfloat16 and float16 compute in float32 (16-bit values
// converted on load, rounded to nearest even on store; F16C on the x86 paths), float64 in float64. Softmax
// statistics and all sums are in the accumulation type. On the avx512_bf16
// path bfloat16 products multiply bfloat16 pairs exactly and sum in float32,
// with the weights P and dS rounded to bfloat16 first (docs/numerics.md).
//
// Determinism: every output element is computed by one task in a fixed order
// that depends only on the problem's shape, never on the ParallelFor's split
// or thread count, so results are bitwise reproducible across runs and pools.
// (The code paths round differently: FMA vs mul + add, vector widths, bfloat16 P.)
#include <string>

#include "common/attention_params.h"
#include "cpu/cpu_isa.h"
#include "cpu/thread_pool.h"

namespace dimattn::kernels {

// Writes out (and lse when non-null), on the code path cpu_flash_isa(p.dtype,
// isa) names (cpu_isa.h).
// pre: p.validate(false) and p.validate_host_arrays() are empty, and the CPU
//      has `isa`; else std::invalid_argument saying why is thrown.
void flash_attention_forward_cpu(const AttentionKernelParams& p, const ParallelFor& parallel_for,
                                 CpuIsa isa = CpuIsa::best);

// Writes dq, dk, dv from q, k, v, out, lse and dout; recomputes the weights
// (and the same dropout mask) from lse. Gradients of GQA query heads are
// summed into their kv head's dk, dv. Padding rows and positions get 0.
// pre: p.validate(true) and p.validate_host_arrays() are empty (else throws).
void flash_attention_backward_cpu(const AttentionKernelParams& p, const ParallelFor& parallel_for,
                                  CpuIsa isa = CpuIsa::best);

}  // namespace dimattn::kernels
