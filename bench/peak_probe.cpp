// The machine's own limits, which the benchmarks' figures are set against
// (DESIGN.md §9): float32 FMA throughput (AVX2 and AVX-512 where the CPU has
// them), bfloat16 dot-product throughput (AVX512_BF16's vdpbf16ps), and read
// bandwidth (a vector sum over a buffer far larger than the caches), each on
// 1 thread and on every thread.
//
//   peak_probe [--threads=N] [--json=PATH]
//
// The FMA loops keep 12 independent accumulators per thread in registers,
// enough to cover the FMA latency on the CPUs this project meets (4 cycles x
// 2 pipes = 8).
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;
constexpr int kAcc = 12;  // DIMATTN_ACCS
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

__attribute__((target("avx2,fma"))) void fma_avx2() {
  using V = __m256;
  const V x = _mm256_set1_ps(0.999999f), y = _mm256_set1_ps(1e-7f);
  DIMATTN_ACCS(_mm256_set1_ps(1.0f));
  auto f = [&](V a) __attribute__((target("avx2,fma"))) { return _mm256_fmadd_ps(a, x, y); };
  for (int64_t n = 0; n < kIters; ++n) {
    DIMATTN_STEP(f);
  }
  sink = _mm256_cvtss_f32(a0) + _mm256_cvtss_f32(a11);
}

__attribute__((target("avx512f"))) void fma_avx512() {
  using V = __m512;
  const V x = _mm512_set1_ps(0.999999f), y = _mm512_set1_ps(1e-7f);
  DIMATTN_ACCS(_mm512_set1_ps(1.0f));
  auto f = [&](V a) __attribute__((target("avx512f"))) { return _mm512_fmadd_ps(a, x, y); };
  for (int64_t n = 0; n < kIters; ++n) {
    DIMATTN_STEP(f);
  }
  sink = _mm512_cvtss_f32(a0) + _mm512_cvtss_f32(a11);
}

// vdpbf16ps: 32 bfloat16 products summed pairwise into 16 floats = 64 FLOP.
__attribute__((target("avx512f,avx512bf16"))) void dot_bf16() {
  using V = __m512;
  const __m512bh x = (__m512bh)_mm512_set1_epi16(0x3f80), y = (__m512bh)_mm512_set1_epi16(0x3380);
  DIMATTN_ACCS(_mm512_setzero_ps());
  auto f = [&](V a) __attribute__((target("avx512f,avx512bf16"))) { return _mm512_dpbf16_ps(a, x, y); };
  for (int64_t n = 0; n < kIters; ++n) {
    DIMATTN_STEP(f);
  }
  sink = _mm512_cvtss_f32(a0) + _mm512_cvtss_f32(a11);
}

// The sum of n floats (n a multiple of 32), four accumulators.
__attribute__((target("avx2"))) float sum(const float* p, size_t n) {
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  for (size_t i = 0; i < n; i += 32)
    for (int u = 0; u < 4; ++u) acc[u] = _mm256_add_ps(acc[u], _mm256_loadu_ps(p + i + 8 * u));
  return _mm256_cvtss_f32(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
}

// GB/s of summing 512 MiB per thread (each its own part of one buffer), best of 5.
double read_bandwidth(int threads) {
  const size_t per = (size_t{512} << 20) / sizeof(float);  // far past any last-level cache
  std::vector<float> buf(per * static_cast<size_t>(threads), 1.0f);
  double best = 0;
  for (int round = 0; round < 5; ++round) {
    const double s = per_thread([&](int t) { sink = sum(buf.data() + static_cast<size_t>(t) * per, per); }, threads);
    best = std::max(best, static_cast<double>(per * sizeof(float)) * threads / s / 1e9);
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  int threads = static_cast<int>(std::thread::hardware_concurrency());
  std::string json;
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--threads=", 10) == 0) {
      threads = std::atoi(argv[i] + 10);
    } else if (std::strncmp(argv[i], "--json=", 7) == 0) {
      json = argv[i] + 7;
    } else {
      std::fprintf(stderr, "usage: peak_probe [--threads=N] [--json=PATH]\n");
      return 2;
    }
  }
  struct Row {
    std::string what, unit;
    double one, all;
  };
  std::vector<Row> rows;
  const double flop = static_cast<double>(kIters) * kAcc;
  auto probe = [&](const char* what, void (*f)(), double flop_per_op) {
    // Best of 3: the first run may pay for the clock ramping up.
    auto best = [&](int n) {
      double t = per_thread([f](int) { f(); }, n);
      for (int r = 0; r < 2; ++r) t = std::min(t, per_thread([f](int) { f(); }, n));
      return flop * flop_per_op * n / t / 1e9;
    };
    const double one = best(1), all = best(threads);
    rows.push_back({what, "GFLOP/s", one, all});
  };
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) probe("float32 FMA, AVX2 (ymm)", fma_avx2, 16);
  if (__builtin_cpu_supports("avx512f")) probe("float32 FMA, AVX-512 (zmm)", fma_avx512, 32);
  if (__builtin_cpu_supports("avx512bf16")) probe("bfloat16 dot, AVX512_BF16 (vdpbf16ps)", dot_bf16, 64);
  if (__builtin_cpu_supports("avx2")) rows.push_back({"read bandwidth (vector sum, 512 MiB per thread)", "GB/s", read_bandwidth(1),
                                   read_bandwidth(threads)});
  std::printf("| limit | 1 thread | %d threads | unit |\n|---|---|---|---|\n", threads);
  for (const Row& r : rows) std::printf("| %s | %.1f | %.1f | %s |\n", r.what.c_str(), r.one, r.all, r.unit.c_str());
  if (!json.empty()) {
    FILE* f = std::fopen(json.c_str(), "w");
    if (!f) {
      std::fprintf(stderr, "peak_probe: cannot write %s\n", json.c_str());
      return 1;
    }
    std::fprintf(f, "{\"threads\": %d, \"limits\": [", threads);
    for (size_t i = 0; i < rows.size(); ++i)
      std::fprintf(f, "%s{\"what\": \"%s\", \"unit\": \"%s\", \"one_thread\": %.3f, \"all_threads\": %.3f}",
                   i ? ", " : "", rows[i].what.c_str(), rows[i].unit.c_str(), rows[i].one, rows[i].all);
    std::fprintf(f, "]}\n");
    std::fclose(f);
  }
  return 0;
}
