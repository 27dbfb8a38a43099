#pragma once
// bfloat16 as the kernels store it (its uint16_t bit pattern), for the kernel
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

}  // namespace dimattn::kernels::test
