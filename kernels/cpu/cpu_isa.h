#pragma once
// The instruction sets cpu_flash has code paths for, which of them this CPU
// runs (cpuid, read once), and the cap DIMATTN_CPU_ISA puts on them.
//
// The library is built for the baseline ISA; each path lives in its own
// translation unit compiled for its target (flash_attention_{avx2,avx512,
// avx512_bf16}.cpp) and is called only after the CPU was found to have it,
// so that the library still runs on a CPU with none of them.
#include <string>

#include "common/attention_params.h"

namespace dimattn::kernels {

// In increasing order: each needs what the ones before it need.
//   generic      portable 16-byte vector code, any 64-bit CPU
//   avx2         AVX2 + FMA + F16C, 8 float lanes
//   avx512       AVX-512 F/BW/DQ/VL, 16 float lanes, 12 x 2-vector micro-kernel
//   avx512_bf16  avx512 plus AVX512-BF16: bfloat16 calls multiply through
//                vdpbf16ps (pairs of bfloat16 products, float32 sums), with
//                the weights P (and dS) rounded to bfloat16 (docs/numerics.md);
//                other dtypes run avx512's code
// `best` resolves to the cap (DIMATTN_CPU_ISA) when set, else to the best the
// CPU has.
enum class CpuIsa { best, generic, avx2, avx512, avx512_bf16 };
inline constexpr CpuIsa kCpuIsas[] = {CpuIsa::generic, CpuIsa::avx2, CpuIsa::avx512, CpuIsa::avx512_bf16};

const char* cpu_isa_name(CpuIsa isa);

// What a CPU offers, as the flags /proc/cpuinfo names (OS support for the
// wider registers included).
struct CpuFeatures {
  bool avx2 = false, fma = false, f16c = false;
  bool avx512f = false, avx512bw = false, avx512dq = false, avx512vl = false, avx512_bf16 = false;
  // The vendor is AMD ("AuthenticAMD"): for the choices whose best differs
  // between AMD's and Intel's cores as measured (flash_impl/direct.h).
  bool amd = false;
};
CpuFeatures cpu_features();  // this CPU, read once

// The flags `isa` needs that `have` lacks, space-separated; "" when it can run.
std::string missing_cpu_flags(CpuIsa isa, const CpuFeatures& have);

// The best ISA `have` allows.
CpuIsa best_cpu_isa(const CpuFeatures& have);

// The ISA named `name` ("generic", "avx2", "avx512", "avx512_bf16"), checked
// against `have`. Throws std::invalid_argument naming `what` (the variable or
// option that gave it) for an unknown name, and the missing flags for an ISA
// `have` cannot run.
CpuIsa cpu_isa_from_name(const std::string& name, const CpuFeatures& have, const char* what);

// The ISA `best` resolves to in this process: DIMATTN_CPU_ISA (read once)
// when set and non-empty, else best_cpu_isa(cpu_features()). Throws
// std::invalid_argument when DIMATTN_CPU_ISA is unknown or this CPU lacks it.
CpuIsa cpu_flash_best_isa();

// The code path that runs a call of `dtype` asked to run on `requested`:
// `best` resolved as above; avx512_bf16 runs only bfloat16 itself (other
// dtypes run avx512's code). Throws std::invalid_argument when the CPU lacks
// `requested`.
CpuIsa cpu_flash_isa(ElementType dtype, CpuIsa requested = CpuIsa::best);

}  // namespace dimattn::kernels
