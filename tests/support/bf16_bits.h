#pragma once
// bfloat16 (and float16) as the kernels store it (its uint16_t bit pattern), for the kernel
// tests: round-to-nearest-even from float32, and back.
#include <cstdint>
#include <cstring>

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

// float16 likewise, through the compiler's _Float16 (not the kernel's own
// conversion, so that the tests check it).
inline uint16_t f16_round(float x) {
  const _Float16 h = static_cast<_Float16>(x);
  uint16_t bits;
  std::memcpy(&bits, &h, 2);
  return bits;
}

inline float f16_value(uint16_t bits) {
  _Float16 h;
  std::memcpy(&h, &bits, 2);
  return static_cast<float>(h);
}

}  // namespace dimattn::kernels::test
