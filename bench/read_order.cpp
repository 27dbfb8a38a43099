// How fast a kv cache can be read in the orders a decoding kernel might read
// it: the question behind the heads-interleaved layouts' gap in docs/perf.md
// ("Decoding over KV caches"). No attention, only reads: K and V of float32
// caches, 8 kv heads of 128 features, 32k positions, each thread reading its
// half of the positions in tiles of 128, a tile's K rows before its V rows.
//   heads-outer  [heads, positions, D] (ATen's layout): head after head
//   address      [positions, heads, D] (FlashAttention's, vLLM's): row after
//                row, every head of a row before the next row
//   head-major   [positions, heads, D], each tile head after head (what
//                cpu_flash's decode path does: one block per kv head)
// Every order reads the same bytes; GB/s is their count over the best time
// of the rounds, the orders alternating round by round.
//
//   read_order [--threads=N] [--rounds=N]
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include "bench_util.h"

namespace b = dimattn::bench;

namespace {

constexpr int64_t kPositions = 32768, kHeads = 8, kD = 128, kTile = 128;
constexpr int64_t kWords = kD * 4 / 8;  // 64-bit words per head's row

enum class Order { heads_outer, address, head_major };

// The sum of a head's row (so that the reads cannot be dropped).
inline uint64_t row_sum(const uint64_t* p) {
  uint64_t s = 0;
  for (int64_t i = 0; i < kWords; ++i) s += p[i];
  return s;
}

// Positions [p0, p1) of k and v (rows of kWords per head) in `order`.
uint64_t read(Order order, const uint64_t* k, const uint64_t* v, int64_t p0, int64_t p1) {
  uint64_t s = 0;
  for (int64_t h0 = 0; h0 < (order == Order::heads_outer ? kHeads : 1); ++h0)
    for (int64_t j0 = p0; j0 < p1; j0 += kTile)
      for (const uint64_t* x : {k, v}) {
        if (order == Order::heads_outer) {
          const uint64_t* head = x + h0 * kPositions * kWords;
          for (int64_t j = j0; j < j0 + kTile; ++j) s += row_sum(head + j * kWords);
        } else if (order == Order::address) {
          for (int64_t j = j0; j < j0 + kTile; ++j)
            for (int64_t h = 0; h < kHeads; ++h) s += row_sum(x + (j * kHeads + h) * kWords);
        } else {
          for (int64_t h = 0; h < kHeads; ++h)
            for (int64_t j = j0; j < j0 + kTile; ++j) s += row_sum(x + (j * kHeads + h) * kWords);
        }
      }
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  int threads = 2, rounds = 7;
  if (!b::threads_and_rounds(argc, argv, "read_order", threads, rounds)) return 2;
  // Two copies of K and V (2 x 256 MiB): a round reads each once, the other
  // copy in between, so that no read comes from the caches.
  const int64_t words = kPositions * kHeads * kWords;
  std::vector<std::vector<uint64_t>> copies;
  for (int c = 0; c < 4; ++c) copies.emplace_back(static_cast<size_t>(words), static_cast<uint64_t>(c + 1));
  const int64_t per_thread = kPositions / threads / kTile * kTile;
  const double bytes = 2.0 * static_cast<double>(per_thread * threads * kHeads * kWords * 8);

  const Order orders[] = {Order::heads_outer, Order::address, Order::head_major};
  const char* names[] = {"heads-outer [H, S, D], head after head", "[S, H, D] in address order",
                         "[S, H, D], each tile head after head"};
  double best[3] = {1e30, 1e30, 1e30};
  uint64_t sink = 0;
  for (int r = 0; r < rounds; ++r)
    for (int o = 0; o < 3; ++o)
      for (int c = 0; c < 2; ++c) {
        const uint64_t* k = copies[2 * c].data();
        const uint64_t* v = copies[2 * c + 1].data();
        std::vector<uint64_t> sums(static_cast<size_t>(threads));
        best[o] = std::min(best[o], b::time_on_threads(threads, [&](int t) {
          sums[t] = read(orders[o], k, v, t * per_thread, (t + 1) * per_thread);
        }));
        for (uint64_t s : sums) sink += s;
      }
  b::print_run_line(threads, rounds);
  b::print_table_header({"order", "ms", "GB/s", "time / heads-outer"});
  for (int o = 0; o < 3; ++o)
    b::print_table_row({names[o], b::fmt("%.2f", best[o] * 1e3), b::fmt("%.1f", bytes / best[o] / 1e9),
                        b::fmt("%.2fx", best[o] / best[0])});
  return sink == 1 ? 1 : 0;  // never: keeps the sums
}
