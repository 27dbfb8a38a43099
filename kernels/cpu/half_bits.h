#pragma once
// IEEE binary16 (float16) <-> float32 on bit patterns, without F16C: the
// portable path of cpu_flash converts with these, and they round as F16C's
// vcvtps2ph with round-to-nearest-even does (NaN stays a quiet NaN with the
// payload's top bits, overflow gives inf, subnormals are kept), so that both
// code paths store the same bits.
#include <cstdint>
#include <cstring>

namespace dimattn::kernels {

// Exact: every float16 value is a float32 value.
inline float half_bits_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  uint32_t bits;
  if (e == 0x1f) {
    bits = sign | 0x7f800000u | (m << 13) | (m ? 0x400000u : 0u);  // inf, or NaN made quiet
  } else if (e == 0) {
    const float f = static_cast<float>(m) * 5.9604644775390625e-8f;  // m * 2^-24: zero or subnormal, exact
    std::memcpy(&bits, &f, 4);
    bits |= sign;
  } else {
    bits = sign | ((e + 112) << 23) | (m << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// v >> s rounded to nearest, ties to even. pre: 1 <= s <= 31.
inline uint32_t shift_right_rne(uint32_t v, int s) {
  const uint32_t q = v >> s, rem = v & ((1u << s) - 1), half = 1u << (s - 1);
  return q + ((rem > half || (rem == half && (q & 1u))) ? 1u : 0u);
}

// Round to nearest even.
inline uint16_t float_to_half_bits(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  x &= 0x7fffffffu;
  const uint32_t e = x >> 23;  // biased float32 exponent
  if (x > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u | ((x >> 13) & 0x3ffu));
  if (e >= 143) return static_cast<uint16_t>(sign | 0x7c00u);  // >= 2^16 (or inf): inf
  if (e >= 113) {
    // Normal: rebias the exponent, round the mantissa's low 13 bits away;
    // a carry moves into the exponent (up to inf), as it should.
    const uint32_t h = ((e - 112) << 10 << 13) | (x & 0x7fffffu);
    return static_cast<uint16_t>(sign | shift_right_rne(h, 13));
  }
  if (e < 102) return sign;  // below 2^-25: rounds to 0
  // Subnormal (or rounding up to the smallest normal): m * 2^-24 with
  // m = mantissa (implicit bit included) * 2^(e - 126).
  return static_cast<uint16_t>(sign | shift_right_rne((x & 0x7fffffu) | 0x800000u, static_cast<int>(126 - e)));
}

}  // namespace dimattn::kernels
