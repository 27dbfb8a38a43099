#pragma once
// dimattn's fused CPU attention ("cpu_flash"): FlashAttention-2-style tiled
// online softmax, forward and backward, over AttentionKernelParams.
//
// Numerics: float32, bfloat16 and float16 compute in float32 (16-bit values
// converted on load, rounded to nearest even on store; F16C on the AVX2 path), float64 in float64. Softmax
// statistics and all sums are in the accumulation type.
//
// Determinism: every output element is computed by one task in a fixed order
// that depends only on the problem's shape, never on the ParallelFor's split
// or thread count, so results are bitwise reproducible across runs and pools.
// (The generic and the AVX2 code paths round differently: FMA vs mul + add.)
#include <string>

#include "common/attention_params.h"
#include "cpu/thread_pool.h"

namespace dimattn::kernels {

// Instruction set of the inner loops. `best` picks AVX2+FMA when the CPU has
// it (checked at run time: the library is built for the baseline ISA), else
// the portable code, which the compiler vectorizes for the baseline.
enum class CpuIsa { best, generic, avx2 };

// The ISA `best` resolves to on this CPU.
CpuIsa cpu_flash_best_isa();
const char* cpu_isa_name(CpuIsa isa);

// Writes out (and lse when non-null).
// pre: p.validate(false) and p.validate_host_arrays() are empty, else
//      std::invalid_argument with that message is thrown.
void flash_attention_forward_cpu(const AttentionKernelParams& p, const ParallelFor& parallel_for,
                                 CpuIsa isa = CpuIsa::best);

// Writes dq, dk, dv from q, k, v, out, lse and dout; recomputes the weights
// (and the same dropout mask) from lse. Gradients of GQA query heads are
// summed into their kv head's dk, dv. Padding rows and positions get 0.
// pre: p.validate(true) and p.validate_host_arrays() are empty (else throws).
void flash_attention_backward_cpu(const AttentionKernelParams& p, const ParallelFor& parallel_for,
                                  CpuIsa isa = CpuIsa::best);

}  // namespace dimattn::kernels
