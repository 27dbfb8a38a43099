// cpu_flash's decode path (few query rows over a kv cache: the query heads
// of a kv head folded into one block, long caches split into chunks whose
// softmax states merge) and paged kv caches (pools of blocks through a block
// table), against the naive float64 reference of cpu_flash_check.h.
#include <gtest/gtest.h>

#include "cpu_flash_check.h"

namespace dimattn::kernels {
namespace {

// The fewest chunks forward_decode splits a case's kv positions into on
// any instruction set (cpu_flash::decode_chunk_tiles; its tiles depend on the
// vector width: 8 float lanes for AVX2, 16 for AVX-512; one block per batch
// entry and kv head when a kv head's query heads fit one block, or per batch
// entry over every kv head where the layout interleaves them).
int64_t decode_chunks(const Case& c, bool interleaved = false) {
  int64_t fewest = INT64_MAX;
  for (int lanes : {4, 8, 16}) {
    const int64_t bk = cpu_flash::fwd_block_k(c.D, lanes), tiles = (c.Tk + bk - 1) / bk;
    const int64_t per = interleaved ? cpu_flash::decode_chunk_tiles(c.B, tiles, bk, c.Hkv)
                                    : cpu_flash::decode_chunk_tiles(c.B * c.Hkv, tiles, bk);
    fewest = std::min(fewest, (tiles + per - 1) / per);
  }
  return fewest;
}

TEST(CpuFlashDecode, QueryHeadsOfAKvHeadShareItsTiles) {
  // 1 to 16 query rows (the decode path's range), GQA and multi-query,
  // causal with each entry's own offset, kv lengths, dropout; forward and
  // backward (training with short queries).
  // Both kv layouts: a head's rows apart ([B, H, T, D]: a block per kv
  // head), and heads interleaved in each row ([B, T, H, D]: a task per
  // chunk over every kv head, tile by tile).
  int ran = 0;
  for (ElementType t : kAllTypes)
    for (int64_t tq : {1, 3, 16})
      for (int64_t hkv : {2, 1}) {
        Case c = base("decode Tq=" + std::to_string(tq) + " Hkv=" + std::to_string(hkv), t);
        c.layout = tq == 3 ? Layout::contiguous : Layout::bthd;
        c.B = 2, c.H = 8, c.Hkv = hkv, c.Tq = tq, c.Tk = 300, c.D = c.Dv = 32, c.causal = true;
        c.offsets = {300 - tq, 120};
        c.kv_lens = {300, 140};
        c.p = tq == 3 ? 0.2 : 0.0;
        check_case(c);
        ++ran;
      }
  EXPECT_EQ(ran, 24);
}

TEST(CpuFlashDecode, DirectProductsOverOddShapes) {
  // The direct products (at most 16 rows, k and v read in place; bfloat16 on
  // avx512_bf16 as pairs of elements and of positions): head dims past whole
  // vectors (D = 40 and 24: a scalar tail; Dv = 16 and 48: half a block of
  // pairs), 3 rows (run as four), 6 (four and two), 14, 15 and 16 (passes of
  // four over the tile, the last one short), odd kv lengths (a position
  // without a partner), rows bounded inside a tile (a window).
  int ran = 0;
  for (ElementType t : kAllTypes)
    for (const auto& [d, dv] : {std::pair<int64_t, int64_t>{40, 16}, {24, 48}})
      for (const auto& [tq, h] : {std::pair<int64_t, int64_t>{1, 3}, {3, 2}, {7, 2}, {5, 3}, {8, 2}}) {
        Case c = base("direct D=" + std::to_string(d) + " Dv=" + std::to_string(dv) + " Tq=" + std::to_string(tq) +
                          " rows=" + std::to_string(tq * h),
                      t);
        c.B = 2, c.H = h, c.Hkv = 1, c.Tq = tq, c.Tk = 301, c.D = d, c.Dv = dv, c.causal = true;
        c.kv_lens = {301, 77};
        c.offsets = {301 - tq, 77 - tq};
        if (tq > 1) c.window_left = 50;
        ASSERT_LE(tq * h, cpu_flash::decode_direct_rows()) << c.name;
        check_case(c);
        ++ran;
      }
  EXPECT_EQ(ran, 40);
}

TEST(CpuFlashDecode, SplitCacheMergesToTheUnsplitResult) {
  // One sequence over one kv head: too few blocks for the threads, so the
  // cache splits into chunks and their states merge. Lengths that end
  // inside a chunk, and a row that sees only the first chunk (causal).
  int ran = 0;
  for (ElementType t : {ElementType::float32, ElementType::bfloat16, ElementType::float16, ElementType::float64})
    for (int64_t tq : {1, 5}) {
      Case c = base("split cache Tq=" + std::to_string(tq), t);
      c.B = 1, c.H = 4, c.Hkv = 1, c.Tq = tq, c.Tk = 4700, c.D = c.Dv = 64, c.causal = true;
      c.offsets = {tq == 1 ? 4699 : 1000};
      ASSERT_GE(decode_chunks(c), 2) << "the case must split its cache";
      check_case(c, false);
      c.name += " short", c.kv_lens = {2500};
      check_case(c, false);
      c.name += " interleaved heads", c.Hkv = 2, c.layout = Layout::bthd, c.p = 0.1;
      check_case(c, false);
      ran += 3;
    }
  EXPECT_EQ(ran, 24);
}

TEST(CpuFlashDecode, InterleavedHeadsSplitShortCaches) {
  // A cache whose layout interleaves the kv heads (rows of every head, or
  // pools of small heads-outer blocks) runs one task per chunk over all of
  // them, so its chunks may be Hkv times shorter: caches too short to split
  // per kv head still split, and the tasks' next-tile prefetch crosses into
  // the next chunk and the next entry (one thread: a range of every task).
  // Entry 1 ends inside a chunk.
  int ran = 0;
  for (ElementType t : {ElementType::float32, ElementType::bfloat16, ElementType::float16})
    for (int64_t ps : {0, 16})
      for (bool heads_outer : {false, true}) {
        if (ps == 0 && heads_outer) continue;  // contiguous heads-outer: a block per kv head
        Case c = base("interleaved short cache ps=" + std::to_string(ps) + (heads_outer ? " heads-outer" : ""), t);
        c.B = 2, c.H = 8, c.Hkv = 4, c.Tq = 1, c.Tk = 1100, c.D = c.Dv = 64, c.causal = true;
        c.layout = Layout::bthd, c.page_size = ps, c.heads_outer = heads_outer;
        c.kv_lens = {1100, 700};
        c.offsets = {1099, 699};
        ASSERT_EQ(decode_chunks(c), 1) << "per kv head the cache would not split";
        ASSERT_GE(decode_chunks(c, true), 2) << "the case must split its cache";
        for (int threads : {1, 2}) {
          check_case(c, false, isas(), threads);
          ++ran;
        }
      }
  EXPECT_EQ(ran, 18);
}

TEST(CpuFlashDecode, ChunkingDependsOnTheShapeOnly) {
  // Many blocks: one chunk each; few: the cache splits, never below
  // decode_min_chunk_positions a chunk.
  const int64_t bk = cpu_flash::fwd_block_k(128, 16), tiles = 32768 / bk;
  EXPECT_EQ(cpu_flash::decode_chunk_tiles(cpu_flash::decode_min_tasks(), tiles, bk), tiles);
  const int64_t one = cpu_flash::decode_chunk_tiles(1, tiles, bk);
  EXPECT_LT(one, tiles);
  EXPECT_GE(one * bk, cpu_flash::decode_min_chunk_positions());
  // A block over 8 interleaved kv heads: shorter chunks, as many positions of all heads.
  const int64_t all = cpu_flash::decode_chunk_tiles(1, tiles, bk, 8);
  EXPECT_LT(all, one);
  EXPECT_GE(all * bk * 8, cpu_flash::decode_min_chunk_positions());
  // A lone block over a short cache still splits in two (one task would idle
  // every other thread); two blocks do not.
  const int64_t short_tiles = cpu_flash::decode_min_chunk_positions() / bk;
  ASSERT_GE(short_tiles, 2);
  EXPECT_EQ(cpu_flash::decode_chunk_tiles(1, short_tiles, bk), (short_tiles + 1) / 2);
  EXPECT_EQ(cpu_flash::decode_chunk_tiles(1, 1, bk), 1);
  EXPECT_EQ(cpu_flash::decode_chunk_tiles(2, short_tiles, bk), short_tiles);
}

// Paged caches: forward only (the kernel reads pools; gradients go to tensors).
void check_paged(Case c, int& ran) {
  check_case(c, false);
  ++ran;
}

TEST(CpuFlashPaged, BlockSizesLayoutsAndLengths) {
  // Block sizes 1, 16 and odd; both pool layouts; sequences of length 0, 1,
  // one block and many; decode (1-16 rows) and longer chunks (the tiled path).
  int ran = 0;
  for (int64_t ps : {1, 16, 7})
    for (bool heads_outer : {false, true})
      for (int64_t tq : {1, 4, 40}) {
        Case c = base("paged ps=" + std::to_string(ps) + (heads_outer ? " heads-outer" : "") +
                      " Tq=" + std::to_string(tq));
        c.B = 4, c.H = 4, c.Hkv = 2, c.Tq = tq, c.Tk = 200, c.D = c.Dv = 32, c.causal = true;
        c.page_size = ps, c.heads_outer = heads_outer;
        c.kv_lens = {200, 0, 1, ps};
        c.offsets = {200 - tq, -tq, 1 - tq, ps - tq};  // the new rows are each sequence's last
        check_paged(c, ran);
      }
  EXPECT_EQ(ran, 18);
}

TEST(CpuFlashPaged, HalfPrecisionPoolsSharedPrefixAndSplitCache) {
  int ran = 0;
  for (ElementType t : kAllTypes) {
    Case c = base("paged shared prefix", t);
    c.B = 3, c.H = 8, c.Hkv = 2, c.Tq = 2, c.Tk = 260, c.D = c.Dv = 64, c.causal = true;
    c.page_size = 16, c.shared_prefix = 128;
    c.kv_lens = {260, 130, 200};
    c.offsets = {258, 128, 198};
    check_paged(c, ran);
    Case s = base("paged split cache", t);  // one sequence: its chunks' merge over pages
    s.B = 1, s.H = 4, s.Hkv = 1, s.Tq = 1, s.Tk = 4700, s.D = s.Dv = 64, s.causal = true;
    s.offsets = {4699};
    s.page_size = 128, s.heads_outer = true;
    ASSERT_GE(decode_chunks(s), 2);
    check_paged(s, ran);
  }
  EXPECT_EQ(ran, 8);
}

TEST(CpuFlashPaged, RowProductsReadRunsOfBlocks) {
  // Decoding blocks of more rows than the direct products take (16 query
  // heads of a kv head, 2 query positions: 32 rows) multiply each tile as
  // rows (products.h's row products): read where they lie, run by run over
  // a pool's blocks (sizes 1, 7 and 16 end runs inside a tile, 512 holds
  // whole tiles), or converted first (bfloat16, float16). Rows bounded
  // inside a tile (causal, a window), lengths that end inside a block,
  // heads-outer pools of small blocks (one task over both kv heads), a split
  // cache; Dv = 40 is no whole number of AVX-512 vectors (packed there); 20
  // rows per block.
  int ran = 0;
  for (ElementType t : kAllTypes) {
    for (int64_t ps : {0, 1, 7, 16, 512})
      for (bool heads_outer : {false, true}) {
        if (ps == 0 && heads_outer) continue;
        Case c = base("row products ps=" + std::to_string(ps) + (heads_outer ? " heads-outer" : ""), t);
        c.B = 3, c.H = 32, c.Hkv = 2, c.Tq = 2, c.Tk = 600, c.D = 32, c.Dv = 64, c.causal = true;
        c.kv_lens = {600, 301, 17};
        c.offsets = {598, 299, 15};
        c.window_left = 250;
        c.page_size = ps, c.heads_outer = heads_outer;
        check_paged(c, ran);
      }
    Case s = base("row products split cache", t);
    s.B = 1, s.H = 32, s.Hkv = 1, s.Tq = 1, s.Tk = 4700, s.D = s.Dv = 32, s.causal = true;
    s.offsets = {4699};
    s.page_size = 16;
    ASSERT_GE(decode_chunks(s), 2);
    check_paged(s, ran);
    s.name = "row products Dv=40", s.Dv = 40, s.page_size = 0, s.Tk = 700, s.offsets = {699};
    check_paged(s, ran);
    // 20 rows per block: on the generic path (4 lanes) their scores transpose in no whole 8 x 8 blocks.
    s.name = "row products 20 rows", s.H = 10, s.Tq = 2, s.Dv = 32, s.Tk = 300, s.offsets = {298};
    s.page_size = 16;
    check_paged(s, ran);
  }
  EXPECT_EQ(ran, 48);
}

TEST(CpuFlashPaged, RejectsBadTablesAndPools) {
  Case c = base("paged errors");
  c.B = 2, c.H = 2, c.Hkv = 1, c.Tq = 1, c.Tk = 40, c.D = c.Dv = 8, c.page_size = 16;
  c.kv_lens = {40, 17};
  const Inputs in = make_inputs(c);
  KernelRun r = prepare(c, in);
  ASSERT_EQ(r.p.validate(false), "");
  ASSERT_EQ(r.p.validate_host_arrays(), "");
  const int64_t cap = r.p.pages.table_stride;
  r.block_table[cap + 1] = static_cast<int32_t>(r.p.pages.num_blocks);  // entry 1's second block
  EXPECT_EQ(r.p.validate_host_arrays(),
            "[attention] block_table[1][1] = " + std::to_string(r.p.pages.num_blocks) + " is outside the pool's [0, " +
                std::to_string(r.p.pages.num_blocks) + ") blocks (entry 1 has 17 positions)");
  r.block_table[cap + 1] = -1;
  EXPECT_NE(r.p.validate_host_arrays().find("block_table[1][1] = -1"), std::string::npos);
  r.block_table[cap + 1] = 0;
  r.block_table[cap + 2] = 99;  // past entry 1's length: never read, not checked
  EXPECT_EQ(r.p.validate_host_arrays(), "");
  r.p.seqlen_k = cap * 16 + 1;
  EXPECT_NE(r.p.validate(false).find("past the block table's capacity"), std::string::npos);
  r.p.seqlen_k = 40;
  EXPECT_NE(r.p.validate(true).find("forward pass only"), std::string::npos);
  r.p.pages.block_size = 0;
  EXPECT_NE(r.p.validate(false).find("block_size must be >= 1"), std::string::npos);
}

}  // namespace
}  // namespace dimattn::kernels
