// The AVX512-BF16 copy of the CPU flash attention kernel: bfloat16 calls only
// (other dtypes run flash_attention_avx512.cpp's), their products as pairs of
// bfloat16 through vdpbf16ps (flash_impl/pairs.h).
#define DIMATTN_X86_TARGET "avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,avx2,fma,f16c"
#define DIMATTN_X86_NAMESPACE cpu_flash_avx512_bf16
#define DIMATTN_X86_BYTES 64
#define DIMATTN_X86_MICRO_ROWS 12  // 24 accumulators of AVX-512's 32 registers
#define DIMATTN_X86_PAIRS
#include "cpu/flash_attention_x86.h"

namespace dimattn::kernels {
#if DIMATTN_X86
const CpuFlashPath kCpuFlashAvx512Bf16 = {cpu_flash_avx512_bf16::forward<uint16_t, float>,
                                          cpu_flash_avx512_bf16::backward<uint16_t, float>};
#else
const CpuFlashPath kCpuFlashAvx512Bf16 = {nullptr, nullptr};
#endif
}  // namespace dimattn::kernels
