// The emulator's own checks: the warp collectives against plain loops, and
// each kind of finding on a small kernel that plants it (and its fixed
// version finding nothing).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "cuda/primitives.cuh"
#include "cuda_emu/emulator.h"
#include "support/bf16_bits.h"

namespace dimattn::kernels::cuda_flash {
namespace {

bool any_contains(const std::vector<std::string>& v, const std::string& part) {
  for (const std::string& s : v)
    if (s.find(part) != std::string::npos) return true;
  return false;
}

std::string joined(const std::vector<std::string>& v) {
  std::string s;
  for (const std::string& x : v) s += "\n  " + x;
  return s;
}

// --- mma and ldmatrix against loops ---

struct MmaParams {
  const uint16_t* a;  // 16 x 16 row-major
  const uint16_t* b;  // 16 x 8 row-major (k, n)
  float* d;           // 16 x 8 row-major
  bool trans_b;       // b's tile is loaded k-major through ldmatrix .trans
  bool f16;
};

// One warp: A and B into shared memory, fragments through ldmatrix as
// cuda_flash loads them, one mma, D out through the C fragment layout.
void mma_kernel(MmaParams p) {
  auto* sA = reinterpret_cast<uint16_t*>(dynamic_smem());
  uint16_t* sB = sA + 16 * 16;  // as [n][k] (n-major) or [k][n] (k-major), 16 elements a row
  const int lane = static_cast<int>(threadIdx.x), g = lane / 4, t = lane % 4;
  for (int x = lane; x < 256; x += 32) st_shared(sA + x, p.a[x]);
  for (int x = lane; x < 256; x += 32) {
    const int r = x / 16, c = x % 16;  // sB row r, column c
    const uint16_t v = p.trans_b ? (r < 16 && c < 8 ? p.b[r * 8 + c] : 0) : (c < 16 && r < 8 ? p.b[c * 8 + r] : 0);
    st_shared(sB + x, v);
  }
  block_sync();
  uint32_t a[4], b[4];
  ldmatrix_x4(a, sA + ((lane & 7) + ((lane >> 3) & 1) * 8) * 16 + (lane >> 4) * 8);
  if (p.trans_b)  // rows k of [k][n]: matrices (k 0-7, n 0-7), (k 8-15, n 0-7), n 8-15 unused
    ldmatrix_x4_trans(b, sB + ((lane & 7) + ((lane >> 3) & 1) * 8) * 16 + (lane >> 4) * 8);
  else  // rows n of [n][k]: matrices (n 0-7, k 0-7), (n 0-7, k 8-15)
    ldmatrix_x4(b, sB + ((lane & 7) + (lane >> 4) * 8) * 16 + ((lane >> 3) & 1) * 8);
  float c[4] = {0.f, 0.f, 0.f, 0.f};
  if (p.f16)
    mma_f16(c, a, b[0], b[1]);
  else
    mma_bf16(c, a, b[0], b[1]);
  p.d[g * 8 + 2 * t] = c[0];
  p.d[g * 8 + 2 * t + 1] = c[1];
  p.d[(g + 8) * 8 + 2 * t] = c[2];
  p.d[(g + 8) * 8 + 2 * t + 1] = c[3];
}

TEST(CudaEmulator, MmaThroughLdmatrixIsTheMatrixProduct) {
  std::mt19937 rng(1);
  std::normal_distribution<float> normal;
  int ran = 0;
  for (bool f16 : {false, true})
    for (bool trans_b : {false, true}) {
      std::vector<uint16_t> a(256), b(128);
      std::vector<double> av(256), bv(128);
      for (int x = 0; x < 256; ++x) {
        a[x] = f16 ? test::f16_round(normal(rng)) : test::bf16_round(normal(rng));
        av[x] = f16 ? test::f16_value(a[x]) : test::bf16_value(a[x]);
      }
      for (int x = 0; x < 128; ++x) {
        b[x] = f16 ? test::f16_round(normal(rng)) : test::bf16_round(normal(rng));
        bv[x] = f16 ? test::f16_value(b[x]) : test::bf16_value(b[x]);
      }
      std::vector<float> d(128, NAN);
      MmaParams p{a.data(), b.data(), d.data(), trans_b, f16};
      ASSERT_EQ(launch(mma_kernel, dim3(1), dim3(32), 2 * (256 + 256), nullptr, p), "");
      const auto found = cuda_emu::take_findings();
      EXPECT_TRUE(found.empty()) << joined(found);
      for (int m = 0; m < 16; ++m)
        for (int n = 0; n < 8; ++n) {
          double want = 0;
          for (int k = 0; k < 16; ++k) want += av[m * 16 + k] * bv[k * 8 + n];
          ASSERT_NEAR(d[m * 8 + n], want, 1e-5 * (1 + std::abs(want)))
              << "D[" << m << "][" << n << "] f16=" << f16 << " trans_b=" << trans_b;
        }
      ++ran;
    }
  EXPECT_EQ(ran, 4);
}

struct ShflParams {
  float* out;
  int mask;
};
void shfl_kernel(ShflParams p) {
  const unsigned i = threadIdx.x;
  p.out[i] = shfl_xor(static_cast<float>(i), p.mask);
}

TEST(CudaEmulator, ShflXorExchangesLanes) {
  for (int mask : {1, 2, 16}) {
    std::vector<float> out(64);
    ASSERT_EQ(launch(shfl_kernel, dim3(1), dim3(64), 0, nullptr, ShflParams{out.data(), mask}), "");
    for (int i = 0; i < 64; ++i) EXPECT_EQ(out[i], static_cast<float>((i & ~31) | ((i & 31) ^ mask))) << i;
  }
}

// --- planted bugs ---

struct Planted {
  int bug;
  float* out;
  const float* src;
};

enum Bug {
  kNone,
  kNoBarrier,        // thread 32 reads what thread 0 wrote, without a barrier
  kEarlyWait,        // reads a cp.async's destination before waiting for it
  kUninitialised,    // reads shared memory nobody wrote
  kOutOfBounds,      // writes past the dynamic shared memory
  kDivergentShfl,    // half a warp takes a shuffle
  kDivergentBarrier  // warps at two different barriers
};

void planted_kernel(Planted p) {
  auto* s = reinterpret_cast<float*>(dynamic_smem());
  const int i = static_cast<int>(threadIdx.x);
  switch (p.bug) {
    case kNone:
    case kNoBarrier:
      if (i == 0) st_shared(s, 1.f);
      if (p.bug == kNone) block_sync();
      if (i == 32) p.out[0] = ld_shared(s);
      break;
    case kEarlyWait:
      if (i == 0) {
        cp_async_16(s, p.src, true);
        cp_async_commit();
        p.out[0] = ld_shared(s);
        cp_async_wait<0>();
      }
      break;
    case kUninitialised: p.out[i] = ld_shared(s + i); break;
    case kOutOfBounds: st_shared(s + 64 + i, 1.f); break;
    case kDivergentShfl:
      if (i % 32 < 16) p.out[i] = shfl_xor(1.f, 1);
      break;
    case kDivergentBarrier:
      if (i < 32)
        block_sync();
      else
        block_sync();
      break;
  }
}

TEST(CudaEmulator, FindsEachPlantedBug) {
  struct Want {
    Bug bug;
    bool fatal;
    const char* finding;
  };
  const Want wants[] = {
      {kNoBarrier, false, "read-after-write race"},
      {kEarlyWait, false, "while a cp.async of thread 0 is still copying"},
      {kUninitialised, false, "uninitialised read"},
      {kOutOfBounds, true, "outside the block's dynamic shared memory"},
      {kDivergentShfl, true, "have exited"},
      {kDivergentBarrier, true, "threads at different barriers"},
  };
  alignas(16) float src[4] = {1, 2, 3, 4};
  std::vector<float> out(64);
  ASSERT_EQ(launch(planted_kernel, dim3(1), dim3(64), 256, nullptr, Planted{kNone, out.data(), src}), "");
  const auto clean = cuda_emu::take_findings();
  EXPECT_TRUE(clean.empty()) << "the fixed kernel:" << joined(clean);
  EXPECT_EQ(out[0], 1.f);
  for (const Want& w : wants) {
    const std::string err = launch(planted_kernel, dim3(1), dim3(64), 256, nullptr, Planted{w.bug, out.data(), src});
    const auto found = cuda_emu::take_findings();
    EXPECT_EQ(!err.empty(), w.fatal) << "bug " << w.bug << ": " << err;
    EXPECT_TRUE(any_contains(found, w.finding)) << "bug " << w.bug << " not found as '" << w.finding << "':"
                                                << joined(found);
  }
}

TEST(CudaEmulator, LaunchLimitsAreCudas) {
  Planted p{kNone, nullptr, nullptr};
  std::vector<float> out(64);
  p.out = out.data();
  EXPECT_NE(launch(planted_kernel, dim3(1), dim3(2048), 0, nullptr, p).find("cudaErrorInvalidConfiguration"),
            std::string::npos);
  const std::string big = launch(planted_kernel, dim3(1), dim3(64), 64 * 1024, nullptr, p);
  EXPECT_NE(big.find("without cudaFuncSetAttribute"), std::string::npos) << big;
  ASSERT_EQ(allow_dynamic_smem(planted_kernel, 64 * 1024), "");
  EXPECT_EQ(launch(planted_kernel, dim3(1), dim3(64), 64 * 1024, nullptr, p), "");
  cuda_emu::take_findings();
}

}  // namespace
}  // namespace dimattn::kernels::cuda_flash
