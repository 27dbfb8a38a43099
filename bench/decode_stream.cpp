// How fast the cores stream a float32 kv cache while doing what cpu_flash's
// decode products do with it: the question behind the order of
// flash_impl/direct.h (kReadWholeRows; docs/perf.md, "Decoding over KV
// caches"). K and V of 32k positions x 8 kv heads, 128 floats per row, a
// thread per half; tiles of 128 rows; 4 query rows: the scores q . k of
// each row, then o += p v (the softmax left out, p fixed). AVX-512 only.
//   interleaved  a vector of each of 4 k rows in turn; p v in two passes over
//                v's columns; every row asked towards L1 8 rows ahead, the
//                other stream towards L2 (the products before 0a4c193)
//   whole rows   each k row whole, then the next; p v two query rows at a
//                time over whole v rows; only the other stream asked towards
//                L2 (the products since: the hardware streams the rows)
//   sum only     the rows summed, nothing multiplied: what memory gives a loop
// Every order reads the same bytes; GB/s is their count over the best time of
// the rounds, the orders alternating round by round over three copies.
//
//   decode_stream [--threads=N] [--rounds=N]
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <type_traits>
#include <vector>

#include "bench_util.h"

namespace b = dimattn::bench;

namespace {

constexpr int64_t kRows = 32768 * 8, kD = 128, kTile = 128, kQ = 4;
constexpr int64_t kRowBytes = kD * 4;

enum class Order { interleaved, whole_rows, sum_only };

// The sum of x's lanes (through memory: GCC 12's _mm512_reduce_add_ps warns).
__attribute__((target("avx512f"))) inline float lane_sum(__m512 x) {
  alignas(64) float l[16];
  _mm512_store_ps(l, x);
  float s = 0;
  for (float y : l) s += y;
  return s;
}

__attribute__((target("avx512f"))) inline void lines(const float* row, int hint) {
  for (int64_t l = 0; l < kRowBytes; l += 64) {
    const char* p = reinterpret_cast<const char*>(row) + l;
    if (hint == 0)
      _mm_prefetch(p, _MM_HINT_T0);
    else
      _mm_prefetch(p, _MM_HINT_T1);
  }
}

// o[r][e0 : e0 + 16 COLS) += sum_c p[r][c] v(c) for ROWS query rows over a
// tile; ask(c) (if any) before position c.
template <int ROWS, int COLS, class Ask>
__attribute__((target("avx512f,fma"))) inline void pv_pass(const float* vt, const float (*p)[kTile],
                                                           float (*o)[kD], int e0, const Ask& ask) {
  __m512 acc[ROWS][COLS];
  for (int r = 0; r < ROWS; ++r)
    for (int u = 0; u < COLS; ++u) acc[r][u] = _mm512_load_ps(&o[r][e0 + 16 * u]);
  for (int c = 0; c < kTile; ++c) {
    if constexpr (!std::is_same_v<Ask, std::nullptr_t>) ask(c);
    for (int u = 0; u < COLS; ++u) {
      const __m512 vv = _mm512_loadu_ps(vt + c * kD + e0 + 16 * u);
      for (int r = 0; r < ROWS; ++r) acc[r][u] = _mm512_fmadd_ps(_mm512_set1_ps(p[r][c]), vv, acc[r][u]);
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int u = 0; u < COLS; ++u) _mm512_store_ps(&o[r][e0 + 16 * u], acc[r][u]);
}

// Rows [0, n) of k and v in `order`; returns a sum that keeps the work.
__attribute__((target("avx512f,fma"))) float stream(Order order, const float* k, const float* v, int64_t n) {
  alignas(64) float q[kQ][kD], o[kQ][kD] = {}, p[kQ][kTile];
  for (int r = 0; r < kQ; ++r) {
    for (int d = 0; d < kD; ++d) q[r][d] = 1.0f + 1e-3f * static_cast<float>(r + d);
    for (int c = 0; c < kTile; ++c) p[r][c] = 1e-3f;
  }
  __m512 total = _mm512_setzero_ps();
  if (order == Order::sum_only) {
    __m512 acc[4] = {};
    for (const float* x : {k, v})
      for (int64_t i = 0; i < n * kD; i += 64)
        for (int u = 0; u < 4; ++u) acc[u] = _mm512_add_ps(acc[u], _mm512_loadu_ps(x + i + 16 * u));
    for (const __m512& a : acc) total = _mm512_add_ps(total, a);
    return lane_sum(total);
  }
  const bool whole = order == Order::whole_rows;
  for (int64_t j0 = 0; j0 < n; j0 += kTile) {
    const float* kt = k + j0 * kD;
    const float* vt = v + j0 * kD;
    const bool next = j0 + kTile < n;
    for (int c = 0; c < kTile; c += 4) {  // scores: 4 positions x 4 rows
      for (int t = 0; t < 4; ++t) {
        if (!whole && c + t + 8 < kTile) lines(kt + (c + t + 8) * kD, 0);
        lines(vt + (c + t) * kD, 1);
      }
      __m512 acc[16];
      for (__m512& a : acc) a = _mm512_setzero_ps();
      if (whole) {
        for (int t = 0; t < 4; ++t)
          for (int d = 0; d < kD; d += 16) {
            const __m512 kv = _mm512_loadu_ps(kt + (c + t) * kD + d);
            for (int r = 0; r < kQ; ++r) acc[r * 4 + t] = _mm512_fmadd_ps(_mm512_load_ps(&q[r][d]), kv, acc[r * 4 + t]);
          }
      } else {
        for (int d = 0; d < kD; d += 16) {
          __m512 kv[4];
          for (int t = 0; t < 4; ++t) kv[t] = _mm512_loadu_ps(kt + (c + t) * kD + d);
          for (int r = 0; r < kQ; ++r) {
            const __m512 qv = _mm512_load_ps(&q[r][d]);
            for (int t = 0; t < 4; ++t) acc[r * 4 + t] = _mm512_fmadd_ps(qv, kv[t], acc[r * 4 + t]);
          }
        }
      }
      for (const __m512& a : acc) total = _mm512_add_ps(total, a);
    }
    // o += p v, asking for the next tile's k rows towards L2 on the first pass.
    auto ask = [&](int c) {
      if (!whole && c + 8 < kTile) lines(vt + (c + 8) * kD, 0);
      if (next) lines(kt + (kTile + c) * kD, 1);
    };
    if (whole) {  // rows {0, 1} then {2, 3}, whole v rows
      pv_pass<2, 8>(vt, p, o, 0, ask);
      pv_pass<2, 8>(vt, p + 2, o + 2, 0, nullptr);
    } else {  // every row, columns [0, 64) then [64, 128)
      pv_pass<4, 4>(vt, p, o, 0, ask);
      pv_pass<4, 4>(vt, p, o, 64, nullptr);
    }
  }
  float s = lane_sum(total);
  for (const auto& row : o)
    for (float x : row) s += x;
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  int threads = 2, rounds = 5;
  if (!b::threads_and_rounds(argc, argv, "decode_stream", threads, rounds)) return 2;
  if (!__builtin_cpu_supports("avx512f")) {
    std::printf("decode_stream: this CPU has no AVX-512 (the order it measures is cpu_flash's AVX-512 one)\n");
    return 0;
  }
  // Three copies of K and V (3 x 2 x 128 MiB), rotated round by round, so
  // that every read comes from memory.
  std::vector<std::vector<float>> copies;
  for (int c = 0; c < 6; ++c) copies.emplace_back(static_cast<size_t>(kRows * kD), 1.0f);
  const int64_t per_thread = kRows / threads / kTile * kTile;
  const double bytes = 2.0 * static_cast<double>(per_thread * threads * kRowBytes);

  const Order orders[] = {Order::interleaved, Order::whole_rows, Order::sum_only};
  const char* names[] = {"interleaved rows, prefetched (before 0a4c193)", "whole rows (since)",
                         "sum only (no products)"};
  double best[3] = {1e30, 1e30, 1e30};
  float sink = 0;
  for (int round = 0; round < rounds; ++round)
    for (int o = 0; o < 3; ++o) {
      const int c = (round + o) % 3;
      const float* k = copies[2 * c].data();
      const float* v = copies[2 * c + 1].data();
      std::vector<float> sums(static_cast<size_t>(threads));
      best[o] = std::min(best[o], b::time_on_threads(threads, [&](int t) {
        sums[t] = stream(orders[o], k + t * per_thread * kD, v + t * per_thread * kD, per_thread);
      }));
      for (float s : sums) sink += s;
    }
  b::print_run_line(threads, rounds);
  b::print_table_header({"order", "ms", "GB/s", "time / sum only"});
  for (int o = 0; o < 3; ++o)
    b::print_table_row({names[o], b::fmt("%.2f", best[o] * 1e3), b::fmt("%.1f", bytes / best[o] / 1e9),
                        b::fmt("%.2fx", best[o] / best[2])});
  return sink == 1.5f ? 1 : 0;  // never: keeps the sums
}
