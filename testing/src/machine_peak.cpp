// Register-only FMA and bfloat16-dot loops and a streaming sum: the limits of
// dimattn/testing/machine_peak.h.
#include "dimattn/testing/machine_peak.h"

#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <map>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

namespace dimattn::testing {
namespace {

using Clock = std::chrono::steady_clock;
constexpr int kAcc = 12;  // DIMATTN_ACCS: covers the FMA latency (4 cycles x 2 pipes = 8)
constexpr int64_t kIters = 40'000'000;

// Seconds until the last of `threads` threads running body(thread index) is done.
template <class F>
double per_thread(F&& body, int threads) {
  std::vector<double> seconds(static_cast<size_t>(threads));
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t)
    pool.emplace_back([&, t] {
      const auto t0 = Clock::now();
      body(t);
      seconds[t] = std::chrono::duration<double>(Clock::now() - t0).count();
    });
  for (std::thread& th : pool) th.join();
  return *std::max_element(seconds.begin(), seconds.end());
}

volatile float sink;

// Twelve named accumulators (an array would live in memory at -O2), kept
// alive by empty asm statements so that no chain is folded away.
#define DIMATTN_ACCS(init) V a0 = init, a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0, a8 = a0, \
                               a9 = a0, a10 = a0, a11 = a0
#define DIMATTN_STEP(op)                                                                                      \
  a0 = op(a0), a1 = op(a1), a2 = op(a2), a3 = op(a3), a4 = op(a4), a5 = op(a5), a6 = op(a6), a7 = op(a7),      \
  a8 = op(a8), a9 = op(a9), a10 = op(a10), a11 = op(a11);                                                     \
  __asm__ volatile("" : "+v"(a0), "+v"(a1), "+v"(a2), "+v"(a3), "+v"(a4), "+v"(a5));                          \
  __asm__ volatile("" : "+v"(a6), "+v"(a7), "+v"(a8), "+v"(a9), "+v"(a10), "+v"(a11))

__attribute__((target("avx2,fma"))) void fma_avx2(int64_t iters) {
  using V = __m256;
  const V x = _mm256_set1_ps(0.999999f), y = _mm256_set1_ps(1e-7f);
  DIMATTN_ACCS(_mm256_set1_ps(1.0f));
  auto f = [&](V a) __attribute__((target("avx2,fma"))) { return _mm256_fmadd_ps(a, x, y); };
  for (int64_t n = 0; n < iters; ++n) {
    DIMATTN_STEP(f);
  }
  sink = _mm256_cvtss_f32(a0) + _mm256_cvtss_f32(a11);
}

__attribute__((target("avx512f"))) void fma_avx512(int64_t iters) {
  using V = __m512;
  const V x = _mm512_set1_ps(0.999999f), y = _mm512_set1_ps(1e-7f);
  DIMATTN_ACCS(_mm512_set1_ps(1.0f));
  auto f = [&](V a) __attribute__((target("avx512f"))) { return _mm512_fmadd_ps(a, x, y); };
  for (int64_t n = 0; n < iters; ++n) {
    DIMATTN_STEP(f);
  }
  sink = _mm512_cvtss_f32(a0) + _mm512_cvtss_f32(a11);
}

// vdpbf16ps: 32 bfloat16 products summed pairwise into 16 floats = 64 FLOP.
__attribute__((target("avx512f,avx512bf16"))) void dot_bf16(int64_t iters) {
  using V = __m512;
  const __m512bh x = (__m512bh)_mm512_set1_epi16(0x3f80), y = (__m512bh)_mm512_set1_epi16(0x3380);
  DIMATTN_ACCS(_mm512_setzero_ps());
  auto f = [&](V a) __attribute__((target("avx512f,avx512bf16"))) { return _mm512_dpbf16_ps(a, x, y); };
  for (int64_t n = 0; n < iters; ++n) {
    DIMATTN_STEP(f);
  }
  sink = _mm512_cvtss_f32(a0) + _mm512_cvtss_f32(a11);
}

#undef DIMATTN_ACCS
#undef DIMATTN_STEP

// Best of 3 (the first run may pay for the clock ramping up), in GFLOP/s.
double best_rate(void (*loop)(int64_t), double flop_per_op, int threads, double work) {
  const int64_t iters = std::max<int64_t>(1000, static_cast<int64_t>(kIters * work));
  double t = 1e300;
  for (int r = 0; r < 3; ++r) t = std::min(t, per_thread([&](int) { loop(iters); }, threads));
  return static_cast<double>(iters) * kAcc * flop_per_op * threads / t / 1e9;
}

// The sum of n floats (n a multiple of 32), four accumulators.
__attribute__((target("avx2"))) float sum(const float* p, size_t n) {
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  for (size_t i = 0; i < n; i += 32)
    for (int u = 0; u < 4; ++u) acc[u] = _mm256_add_ps(acc[u], _mm256_loadu_ps(p + i + 8 * u));
  return _mm256_cvtss_f32(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
}

// cpu_flash multiplies bfloat16 in pairs through vdpbf16ps; float16 it widens to float32.
bool bf16_dot(const std::string& dtype) { return dtype == "bfloat16" && __builtin_cpu_supports("avx512bf16"); }

}  // namespace

double fma_f32_gflops(const std::string& isa, int threads, double work) {
  if (isa == "avx2") {
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) return 0;
    return best_rate(fma_avx2, 16, threads, work);
  }
  if (isa == "avx512") return __builtin_cpu_supports("avx512f") ? best_rate(fma_avx512, 32, threads, work) : 0;
  return 0;
}

double dot_bf16_gflops(int threads, double work) {
  return __builtin_cpu_supports("avx512bf16") ? best_rate(dot_bf16, 64, threads, work) : 0;
}

double read_gbps(int threads, size_t bytes_per_thread, int rounds) {
  if (!__builtin_cpu_supports("avx2")) return 0;
  const size_t per = bytes_per_thread / sizeof(float) / 32 * 32;
  std::vector<float> buf(per * static_cast<size_t>(threads), 1.0f);
  double best = 0;
  for (int round = 0; round < rounds; ++round) {
    const double s = per_thread([&](int t) { sink = sum(buf.data() + static_cast<size_t>(t) * per, per); }, threads);
    best = std::max(best, static_cast<double>(per * sizeof(float)) * threads / s / 1e9);
  }
  return best;
}

double arithmetic_peak_gflops(const std::string& dtype, int threads) {
  static std::mutex mu;
  static std::map<std::pair<bool, int>, double> measured;
  const bool bf16 = bf16_dot(dtype);
  std::lock_guard<std::mutex> lock(mu);
  auto [it, fresh] = measured.try_emplace({bf16, threads}, 0.0);
  if (fresh)
    it->second = bf16 ? dot_bf16_gflops(threads, 0.25)
                      : std::max(fma_f32_gflops("avx2", threads, 0.25), fma_f32_gflops("avx512", threads, 0.25));
  return it->second;
}

std::string arithmetic_peak_name(const std::string& dtype) {
  return bf16_dot(dtype) ? "bfloat16 dot, vdpbf16ps" : "float32 FMA";
}

}  // namespace dimattn::testing
