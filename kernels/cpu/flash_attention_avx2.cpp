// The AVX2 + FMA copy of the CPU flash attention kernel (8 float lanes).
#define DIMATTN_X86_TARGET "avx2,fma,f16c"
#define DIMATTN_X86_NAMESPACE cpu_flash_avx2
#define DIMATTN_X86_BYTES 32
#define DIMATTN_X86_MICRO_ROWS 6  // 12 accumulators of AVX2's 16 registers
#include "cpu/flash_attention_x86.h"

namespace dimattn::kernels {
#if DIMATTN_X86
const CpuFlashPath kCpuFlashAvx2 = {cpu_flash_avx2::run_forward, cpu_flash_avx2::run_backward};
#else
const CpuFlashPath kCpuFlashAvx2 = {nullptr, nullptr};
#endif
}  // namespace dimattn::kernels
