// The shared dropout RNG: Philox4x32-10 known answers (Random123's KAT
// vectors, counter / key / result) and the dropout keying contract.
#include <gtest/gtest.h>

#include <cmath>
#include <set>

#include "common/philox.h"

namespace dimattn::kernels {
namespace {

TEST(Philox, KnownAnswers) {
  struct Kat {
    Philox4 ctr;
    uint32_t k0, k1;
    Philox4 want;
  };
  const Kat kats[] = {
      {{{0, 0, 0, 0}}, 0, 0, {{0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}}},
      {{{0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff}}, 0xffffffff, 0xffffffff,
       {{0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}}},
      {{{0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344}}, 0xa4093822, 0x299f31d0,
       {{0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}}},
  };
  for (const Kat& k : kats) {
    const Philox4 got = philox4x32_10(k.ctr, static_cast<uint64_t>(k.k1) << 32 | k.k0);
    for (int i = 0; i < 4; ++i) EXPECT_EQ(got.v[i], k.want.v[i]) << "word " << i;
  }
}

TEST(Philox, DropoutUniformsAreInUnitIntervalAndDistinctPerElement) {
  std::set<float> seen;
  double sum = 0;
  const int n = 4096;
  for (uint32_t k = 0; k < 64; ++k)
    for (uint32_t q = 0; q < 64; ++q) {
      const float u = dropout_uniform(42, 0, 3, q, k);
      ASSERT_GE(u, 0.0f);
      ASSERT_LT(u, 1.0f);
      seen.insert(u);
      sum += u;
    }
  EXPECT_GT(seen.size(), n * 0.99);
  EXPECT_NEAR(sum / n, 0.5, 4 * std::sqrt(1.0 / 12 / n));
  EXPECT_NE(dropout_uniform(42, 0, 3, 1, 2), dropout_uniform(42, 0, 4, 1, 2)) << "heads differ";
  EXPECT_NE(dropout_uniform(42, 0, 3, 1, 2), dropout_uniform(43, 0, 3, 1, 2)) << "seeds differ";
  EXPECT_NE(dropout_uniform(42, 0, 3, 1, 2), dropout_uniform(42, 1, 3, 1, 2)) << "offsets differ";
  EXPECT_NE(dropout_uniform_broadcast(42, 0, 5), dropout_uniform(42, 0, 0, 0, 5)) << "broadcast stream is separate";
}

}  // namespace
}  // namespace dimattn::kernels
