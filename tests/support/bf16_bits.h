#pragma once
// bfloat16 (and float16) as the kernels store it (its uint16_t bit pattern), for the kernel
// tests: round-to-nearest-even from float32, and back.
#include <cstdint>
#include <cstring>
#include <immintrin.h>

namespace dimattn::kernels::test {

inline uint16_t bf16_round(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

inline float bf16_value(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// float16 likewise, through the CPU's own conversion instructions (F16C, on
// every x86-64 CPU this project runs on), not the kernel's software one, so
// that the tests check it. Neither g++ nor clang 14 (the sanitized build)
// offers one portable 16-bit float type, hence the intrinsics.
__attribute__((target("f16c"))) inline uint16_t f16_round(float x) {
  return static_cast<uint16_t>(_cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT));
}

__attribute__((target("f16c"))) inline float f16_value(uint16_t bits) { return _cvtsh_ss(bits); }

}  // namespace dimattn::kernels::test
