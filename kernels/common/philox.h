#pragma once
// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3",
// SC'11): a counter-based generator, so any element's random number is a pure
// function of (seed, counter) and needs no sequential state. Attention dropout
// uses it on every path, so the reference path and each fused kernel (CPU and
// CUDA) draw the same mask and can be compared exactly with dropout on.
//
// Attention's keying of the counter and its keep rule are in
// common/attention_mask.h, which this header includes at its end for the
// callers that include only this one.
#include <cstdint>

#if defined(__CUDACC__)
#define DIMATTN_HD __host__ __device__ __forceinline__
#else
#define DIMATTN_HD inline
#endif

namespace dimattn::kernels {

struct Philox4 {
  uint32_t v[4];
};

DIMATTN_HD void mulhilo32(uint32_t a, uint32_t b, uint32_t& hi, uint32_t& lo) {
  const uint64_t p = static_cast<uint64_t>(a) * b;
  hi = static_cast<uint32_t>(p >> 32);
  lo = static_cast<uint32_t>(p);
}

DIMATTN_HD Philox4 philox4x32_10(Philox4 ctr, uint64_t seed) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
  constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  for (int round = 0; round < 10; ++round) {
    uint32_t hi0, lo0, hi1, lo1;
    mulhilo32(kM0, ctr.v[0], hi0, lo0);
    mulhilo32(kM1, ctr.v[2], hi1, lo1);
    ctr = Philox4{{hi1 ^ ctr.v[1] ^ k0, lo1, hi0 ^ ctr.v[3] ^ k1, lo0}};
    k0 += kW0;
    k1 += kW1;
  }
  return ctr;
}

// 24 random bits as a float in [0, 1): exact in float32, bf16-safe compare.
DIMATTN_HD float uniform_from_bits(uint32_t bits) { return static_cast<float>(bits >> 8) * (1.0f / 16777216.0f); }

}  // namespace dimattn::kernels

// After the generator: attention_mask.h includes this header for it.
#include "common/attention_mask.h"  // IWYU pragma: export
