// The AVX-512 copy of the CPU flash attention kernel (F, BW, DQ, VL: 16 float lanes).
#define DIMATTN_X86_TARGET "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c"
#define DIMATTN_X86_NAMESPACE cpu_flash_avx512
#define DIMATTN_X86_BYTES 64
#define DIMATTN_X86_MICRO_ROWS 12  // 24 accumulators of AVX-512's 32 registers
#include "cpu/flash_attention_x86.h"

namespace dimattn::kernels {
#if DIMATTN_X86
const CpuFlashPath kCpuFlashAvx512 = {cpu_flash_avx512::run_forward, cpu_flash_avx512::run_backward};
#else
const CpuFlashPath kCpuFlashAvx512 = {nullptr, nullptr};
#endif
}  // namespace dimattn::kernels
