#pragma once
// Tile sizes and work splits of the CPU flash attention kernel. Every choice
// here that can change a result depends only on the problem's shape (never on
// the thread count), which keeps results bitwise equal whatever pool runs the
// kernel; one prefetch choice depends on the CPU's vendor.
#include <algorithm>
#include <cstdint>

namespace dimattn::kernels::cpu_flash {

// Query rows per forward task: the block's scaled q rows and its O
// accumulator stay in L1/L2 while the kv tiles stream past. More rows read
// each kv tile fewer times; on a Zen 3 core, 128 rows at head_dim 128
// measured ~15% slower than 64 (q and O no longer fit beside a tile).
constexpr int64_t fwd_block_q(int64_t head_dim) { return head_dim <= 64 ? 128 : 64; }

// kv positions per tile: the width of the score tile S = Q K^T that the
// online softmax processes at once; `lanes`: float lanes of the ISA's vectors.
// A tile costs each row a fixed part (its max, sum and the rescale of its O
// row), which 16 lanes get through fast enough that twice the positions pay
// off: on a Zen 5 EPYC the AVX-512 paths run 5-8% faster with 256 / 128
// positions, AVX2 none (and 3-9% slower at T = 4096), so 8 lanes keep
// 128 / 64. 32 | tile keeps whole 2-vector column blocks in the
// micro-kernel at 16 lanes; 4 | tile keeps Philox's 4-lane groups aligned.
constexpr int64_t fwd_block_k(int64_t head_dim, int lanes) {
  return (head_dim <= 64 ? 128 : 64) * (lanes >= 16 ? 2 : 1);
}

// A forward task range keeps the packed kv tiles of its current kv head when
// they fit this budget (per thread), so that the query blocks of that head
// (and of the GQA heads sharing it) pack each tile once.
constexpr int64_t fwd_kv_cache_bytes() { return int64_t{16} << 20; }

// Decoding: calls of at most this many query rows per head run
// forward_decode (flash_impl/forward.h): the query heads sharing a kv head
// fold into one block that reads each kv tile once, and long caches split
// into chunks. Above it, query blocks of one head read each tile once per
// block anyway.
constexpr bool fwd_decode(int64_t seqlen_q) { return seqlen_q <= 16; }
// Blocks of at most this many rows (query rows x the query heads folded
// into the block) take the direct products (flash_impl/direct.h: k and v
// rows read in place, no packing); up to 16 (a GQA group of 4 with 4 query
// positions each) reread the tile from L2 in passes of 4 rows faster than
// packing it. B = 1, 32 query over 8 kv heads, 4 query positions (16 rows
// per block), 32k positions, against 8 (then packed; one process, AMD EPYC
// Zen 4, 2 threads): float32 0.88x the time (AVX2 0.88x), float16 0.66x,
// bfloat16 0.94x (AVX2 1.06x); 3 positions (12 rows) float32 0.80x.
// Larger blocks (multi-query: 32 rows) take the row products instead
// (ForwardOperands::kRowProducts, flash_impl/products.h): the tile's rows
// multiplied by the GEMM micro-kernel where they lie, as the direct
// products read them, but each k row's element broadcast to many query rows.
// Against the direct products there, float32 took 1.18x, bfloat16 1.08x.
constexpr int64_t decode_direct_rows() { return 16; }

// Whether the direct products also ask towards L1 for the float32 rows they
// read whole and back to back (flash_impl/direct.h's kReadWholeRows): not on
// AMD's cores, whose prefetchers follow such rows alone (Zen 4: 16 rows ahead
// took 1.13x the time); on Intel's they do not. B = 1, 32 query over 8 kv
// heads, a float32 heads-outer cache, 8 rows ahead against none (calls
// alternating in one process; Intel Xeon, family 6 model 207, 2 threads,
// five runs over an hour): 32k positions 0.86-0.96x the time, 4k 0.89-0.92x,
// 128k 0.89x, B = 8 0.94x; 4 query positions 0.83-1.10x (no clear gain).
// Per CPU vendor, not per shape: a prefetch changes no result. Defined in
// cpu/cpu_isa.cpp (cpuid).
bool decode_prefetch_whole_rows();

// Decoding splits each kv head's positions into chunks of whole tiles when
// its blocks (batch entries x kv heads x head groups) are fewer than
// decode_min_tasks(): one sequence over 8 kv heads (or one, multi-query)
// would otherwise leave most threads of a large machine idle. A chunk spans
// at least decode_min_chunk_positions() positions of one kv head, so that
// the merge (one pass over the rows' states) stays small next to reading
// the chunk -- except that a lone block (one sequence, multi-query) splits
// into two chunks from two tiles on: one task would leave every thread but
// one idle. B = 1, 32 query heads over one kv head, against one chunk
// (calls alternating in one process; Intel Xeon, family 6 model 207, 2
// threads): 1k positions float32 0.68-0.72x the time, bfloat16 0.65x; 2k
// float32 0.62x. Smaller chunks throughout (2048 positions / 8 for such
// blocks) took 1.05-1.21x the time at 4k and 32k: each chunk sets up its
// 32 rows and leaves their state. Depends on the shape only: any pool gets
// the same chunks and the same result.
constexpr int64_t decode_min_tasks() { return 64; }
constexpr int64_t decode_min_chunk_positions() { return 2048; }
// Tiles per chunk for `blocks` decoding blocks over `tiles` kv tiles of bk
// positions, each block reading `heads` kv heads (caches that interleave the
// kv heads: one block reads them all, so its chunks may be that much shorter).
constexpr int64_t decode_chunk_tiles(int64_t blocks, int64_t tiles, int64_t bk, int64_t heads = 1) {
  if (tiles <= 0 || blocks <= 0) return 1;
  const int64_t want = (decode_min_tasks() + blocks - 1) / blocks;
  const int64_t min_tiles = std::max<int64_t>(1, decode_min_chunk_positions() / (bk * std::max<int64_t>(heads, 1)));
  const int64_t fewest = blocks < 2 ? std::min<int64_t>(2, tiles) : 1;
  const int64_t chunks = std::clamp<int64_t>(want, 1, std::max(fewest, tiles / min_tiles));
  return (tiles + chunks - 1) / chunks;
}

// Backward: query rows and kv positions per (q block, kv tile) step. The
// step holds five tiles (S/P, dP, P with dropout, and the dK, dV accumulators).
constexpr int64_t bwd_block_q(int64_t /*head_dim*/) { return 64; }
constexpr int64_t bwd_block_k(int64_t /*head_dim*/) { return 64; }
// With relative positions a step's band of table rows is bk + bq - 1 wide for
// bk positions (rel_pos.h): wider kv tiles waste less of each band product.
constexpr int64_t bwd_block_k_rel_pos(int64_t /*head_dim*/) { return 128; }

// The backward pass runs one task per (batch, kv head, kv chunk): a task owns
// its chunk's dK, dV (so GQA heads sum race-free) and writes its dQ share into
// a buffer that a second pass sums in chunk order. One chunk (no buffer, no
// second pass) unless batch * kv_heads is below this many tasks.
constexpr int64_t bwd_min_tasks() { return 16; }
// A chunk spans at least this many kv tiles, so a task's repacking of its
// q and dO rows stays small next to its work...
constexpr int64_t bwd_min_tiles_per_chunk() { return 4; }
// ...and the dQ shares take at most this much memory.
constexpr int64_t bwd_max_partial_bytes() { return int64_t{128} << 20; }

static_assert(fwd_block_k(64, 8) % 16 == 0 && fwd_block_k(128, 8) % 16 == 0 && fwd_block_k(128, 16) % 32 == 0,
              "kv tiles hold whole column blocks");
static_assert(bwd_block_k(64) % 16 == 0 && bwd_block_k(128) % 16 == 0 && bwd_block_k_rel_pos(64) % 32 == 0,
              "kv tiles hold whole column blocks");

}  // namespace dimattn::kernels::cpu_flash
