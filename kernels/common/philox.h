#pragma once
// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3",
// SC'11): a counter-based generator, so any element's random number is a pure
// function of (seed, counter) and needs no sequential state. Attention dropout
// uses it on every path, so the reference path and each fused kernel (CPU and
// CUDA) draw the same mask and can be compared exactly with dropout on.
//
// Dropout keying (the contract every path follows):
//   per element:  key = seed, counter = {k / 4, q, bh, offset}, lane k % 4
//   broadcast:    key = seed ^ kBroadcastSalt, counter = {k / 4, 0, 0, offset}, lane k % 4
// where bh is the flat index over the call's batch dims, then keys-only dims,
// then query groups (row-major, each in the call's order), q the query
// spatial position, k the kv position. An element is kept when
// its uniform number is >= p.
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

inline constexpr uint64_t kBroadcastSalt = 0xB40ADCA57D0F0F0Full;

// The random words of kv positions 4 * (k / 4) .. + 3 of attention row
// (bh, q): lane k % 4 is position k's. One call serves four positions.
DIMATTN_HD Philox4 dropout_words(uint64_t seed, uint32_t offset, uint32_t bh, uint32_t q, uint32_t k) {
  return philox4x32_10(Philox4{{k >> 2, q, bh, offset}}, seed);
}

// The same under broadcast dropout (shared by every batch entry, head and
// query position).
DIMATTN_HD Philox4 dropout_words_broadcast(uint64_t seed, uint32_t offset, uint32_t k) {
  return philox4x32_10(Philox4{{k >> 2, 0, 0, offset}}, seed ^ kBroadcastSalt);
}

// Uniform number of attention element (bh, q, k).
DIMATTN_HD float dropout_uniform(uint64_t seed, uint32_t offset, uint32_t bh, uint32_t q, uint32_t k) {
  return uniform_from_bits(dropout_words(seed, offset, bh, q, k).v[k & 3]);
}

// Uniform number of kv position k under broadcast dropout.
DIMATTN_HD float dropout_uniform_broadcast(uint64_t seed, uint32_t offset, uint32_t k) {
  return uniform_from_bits(dropout_words_broadcast(seed, offset, k).v[k & 3]);
}

}  // namespace dimattn::kernels
