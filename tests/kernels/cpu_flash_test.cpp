// The CPU flash attention kernel against a naive float64 reference: forward
// (out, lse) and backward (dq, dk, dv from the analytic gradient), over masks,
// GQA, odd head dims, dropout, strided views, dtypes and thread counts.
// Needs only the kernel sources: no frontend, no backend.
#include "cpu_flash_case.h"

#include <gtest/gtest.h>

namespace dimattn::kernels {
namespace {

// ---------------------------------------------------------------------------

TEST(CpuFlash, SelfAttention) {
  for (ElementType t : kAllTypes) {
    Case c = base("self", t);
    c.B = 2, c.H = 3, c.Hkv = 3, c.Tq = c.Tk = 37, c.D = c.Dv = 16;
    check_case(c);
  }
}

TEST(CpuFlash, CrossAttention) {
  for (ElementType t : kAllTypes) {
    Case c = base("cross", t);
    c.B = 2, c.H = 2, c.Hkv = 2, c.Tq = 19, c.Tk = 147, c.D = 24, c.Dv = 40;
    check_case(c);
  }
}

TEST(CpuFlash, CausalSelfAcrossTiles) {
  for (int64_t d : {64, 128}) {
    Case c = base("causal D=" + std::to_string(d));  // several kv tiles at every width (fwd_block_k)
    c.B = 1, c.H = 2, c.Hkv = 2, c.Tq = c.Tk = 300, c.D = c.Dv = d, c.causal = true;
    check_case(c);
  }
}

TEST(CpuFlash, CausalWithOffsets) {
  for (ElementType t : kAllTypes) {
    // Chunks appended to a kv history of 70, 5 and -3 positions: the negative
    // offset leaves the first three rows with nothing to attend.
    Case c = base("causal offsets", t);
    c.B = 3, c.H = 2, c.Hkv = 1, c.Tq = 20, c.Tk = 90, c.D = c.Dv = 8, c.causal = true;
    c.offsets = {70, 5, -3};
    check_case(c);
  }
}

TEST(CpuFlash, CausalOffsetsEmptyRowsAndHugeOffsets) {
  Case c = base("causal offsets empty rows");
  c.B = 4, c.H = 1, c.Tq = 70, c.Tk = 70, c.D = c.Dv = 8, c.causal = true;
  c.offsets = {-10, -1000, 1000, std::numeric_limits<int64_t>::min() / 2};
  check_case(c);
}

TEST(CpuFlash, KvLengthsIncludingZeroAndOne) {
  for (bool causal : {false, true}) {
    Case c = base(std::string("kv lengths") + (causal ? " causal" : ""));
    c.B = 4, c.H = 2, c.Hkv = 2, c.Tq = 33, c.Tk = 200, c.D = c.Dv = 16, c.causal = causal;
    c.kv_lens = {0, 1, 50, 200};
    if (causal) c.offsets = {0, 0, 30, 167};
    check_case(c);
  }
}

TEST(CpuFlash, PerRowKvLengths) {
  // Each query row of each head its own kv length, rows of length 0 among
  // them (out 0, lse -inf): across kv tiles, with GQA, causal offsets,
  // dropout, query padding, and the few-rows path that reads kv in place.
  for (ElementType t : kAllTypes)
    for (bool causal : {false, true}) {
      Case c = base(std::string("per-row kv lengths") + (causal ? " causal" : ""), t);
      c.B = 2, c.H = 4, c.Hkv = 2, c.Tq = 70, c.Tk = 150, c.D = c.Dv = 16, c.causal = causal;
      if (causal) c.offsets = {80, 10};
      with_row_lengths(c, true);
      check_case(c);
    }
  for (int64_t d : {64, 128}) {
    Case c = base("per-row kv lengths causal D=" + std::to_string(d));
    c.B = 1, c.H = 2, c.Hkv = 1, c.Tq = c.Tk = 300, c.D = c.Dv = d, c.causal = true;
    with_row_lengths(c, true);
    check_case(c);
  }
  {
    Case c = base("per-row kv lengths, shared by the heads, dropout, q lengths");
    c.B = 3, c.H = 3, c.Hkv = 3, c.Tq = 37, c.Tk = 150, c.D = c.Dv = 16, c.p = 0.3, c.q_lens = {37, 20, 0};
    with_row_lengths(c, true, true);
    check_case(c);
  }
  for (int64_t tq : {1, 3}) {
    Case c = base("per-row kv lengths, few rows Tq=" + std::to_string(tq));
    c.B = 2, c.H = 2, c.Hkv = 2, c.Tq = tq, c.Tk = 301, c.D = 12, c.Dv = 16;
    with_row_lengths(c, true);
    check_case(c);
  }
}

TEST(CpuFlash, PerHeadKvLengths) {
  // One kv length per (b, h) plane (row stride 0): beams or GQA heads with
  // histories of their own.
  for (ElementType t : {ElementType::float32, ElementType::bfloat16}) {
    Case c = base("per-head kv lengths", t);
    c.B = 2, c.H = 6, c.Hkv = 2, c.Tq = 40, c.Tk = 133, c.D = c.Dv = 16, c.causal = true, c.offsets = {93, 20};
    with_row_lengths(c, false);
    check_case(c);
  }
}

TEST(CpuFlash, QueryLengths) {
  Case c = base("q lengths");
  c.B = 3, c.H = 2, c.Tq = 40, c.Tk = 40, c.D = c.Dv = 8, c.causal = true;
  c.q_lens = {3, 0, 40};
  c.kv_lens = {40, 10, 25};
  check_case(c);
}

TEST(CpuFlash, GroupedQueryAttention) {
  for (ElementType t : kAllTypes) {
    Case c = base("gqa", t);
    c.B = 2, c.H = 8, c.Hkv = 2, c.Tq = c.Tk = 45, c.D = c.Dv = 16, c.causal = true;
    check_case(c);
  }
}

TEST(CpuFlash, MultiQueryAttention) {
  Case c = base("mqa");
  c.B = 2, c.H = 4, c.Hkv = 1, c.Tq = 30, c.Tk = 70, c.D = 32, c.Dv = 16;
  c.kv_lens = {70, 33};
  check_case(c);
}

TEST(CpuFlash, OddHeadDims) {
  for (ElementType t : kAllTypes) {
    Case c = base("D=5 Dv=3", t);
    c.B = 2, c.H = 2, c.Hkv = 1, c.Tq = 13, c.Tk = 29, c.D = 5, c.Dv = 3, c.causal = true, c.offsets = {16, 2};
    check_case(c);
  }
}

TEST(CpuFlash, HeadDims64And128) {
  for (ElementType t : kAllTypes)
    for (int64_t d : {64, 128}) {
      Case c = base("D=" + std::to_string(d), t);
      c.B = 1, c.H = 2, c.Hkv = 2, c.Tq = 70, c.Tk = 150, c.D = c.Dv = d;
      check_case(c);
    }
}

TEST(CpuFlash, SingleStep) {
  for (ElementType t : kAllTypes) {
    Case c = base("T=1", t);
    c.B = 2, c.H = 2, c.Hkv = 2, c.Tq = 1, c.Tk = 1, c.D = c.Dv = 8;
    check_case(c);
    c.name = "decode";  // one query against a long history
    c.Tk = 300, c.causal = true, c.offsets = {299, 150};
    check_case(c);
  }
}

TEST(CpuFlash, FewQueryRowsReadKvInPlace) {
  // <= 4 float32 query rows take the path that reads k and v rows in place
  // (no packing); a head dim that is not a whole number of vectors exercises
  // its scalar tail.
  for (int64_t tq : {1, 3, 4, 5}) {
    Case c = base("few rows Tq=" + std::to_string(tq));
    c.B = 2, c.H = 2, c.Hkv = 2, c.Tq = tq, c.Tk = 301, c.D = 12, c.Dv = 16, c.causal = true;
    c.offsets = {290, 100};
    c.kv_lens = {301, 77};
    c.p = 0.2;
    check_case(c);
  }
}

TEST(CpuFlash, Dropout) {
  // float64 at 1e-10: a single mask bit differing from the naive reference's
  // (same Philox function) would be off by a whole weight.
  for (ElementType t : kAllTypes) {
    Case c = base("dropout", t);
    c.B = 2, c.H = 3, c.Hkv = 1, c.Tq = 37, c.Tk = 150, c.D = c.Dv = 16, c.causal = true, c.offsets = {113, 50};
    c.p = 0.3;
    check_case(c);
  }
}

// Documents of `len` positions, shifted by 13 per plane: planes[p] is
// [Tq][Tk] with (i, j) allowed iff (i + 13 p) / len == (j + 13 p) / len.
std::vector<uint8_t> documents_mask(int64_t planes, int64_t Tq, int64_t Tk, int64_t len) {
  std::vector<uint8_t> m;
  for (int64_t p = 0; p < planes; ++p)
    for (int64_t i = 0; i < Tq; ++i)
      for (int64_t j = 0; j < Tk; ++j) m.push_back((i + 13 * p) / len == (j + 13 * p) / len ? 1 : 0);
  return m;
}

// How many (rows, kv tile) blocks of a case's mask, at a pass's tile sizes,
// the mask forbids entirely, allows entirely, or allows in part, over the
// blocks a causal pass visits (kv tiles starting at or before the block's
// last row): {empty, full, partial}.
std::array<int64_t, 3> mask_blocks(const Case& c, int64_t bq, int64_t bk) {
  std::array<int64_t, 3> n{};
  for (int64_t b = 0; b < c.B; ++b)
    for (int64_t h = 0; h < c.H; ++h)
      for (int64_t i0 = 0; i0 < c.Tq; i0 += bq)
        for (int64_t j0 = 0; j0 < c.Tk && (!c.causal || j0 <= std::min(i0 + bq, c.Tq) - 1); j0 += bk) {
          bool allows = false, forbids = false;
          for (int64_t i = i0; i < std::min(i0 + bq, c.Tq); ++i)
            for (int64_t j = j0; j < std::min(j0 + bk, c.Tk); ++j)
              (c.mask_allows(b, h, i, j) ? allows : forbids) = true;
          ++n[allows && forbids ? 2 : allows ? 1 : 0];
        }
  return n;
}

// Some blocks of every class at the forward's tile sizes (both vector widths)
// and the backward's, so that the kernel's empty, full and partial branches all run.
void expect_blocks_of_every_class(const Case& c) {
  for (const auto& [bq, bk] : {std::pair{cpu_flash::fwd_block_q(c.D), cpu_flash::fwd_block_k(c.D, 8)},
                               std::pair{cpu_flash::fwd_block_q(c.D), cpu_flash::fwd_block_k(c.D, 16)},
                               std::pair{cpu_flash::bwd_block_q(c.D), cpu_flash::bwd_block_k(c.D)}}) {
    const std::array<int64_t, 3> n = mask_blocks(c, bq, bk);
    EXPECT_GT(n[0], 0) << c.name << ": no empty block at " << bq << " x " << bk;
    EXPECT_GT(n[1], 0) << c.name << ": no full block at " << bq << " x " << bk;
    EXPECT_GT(n[2], 0) << c.name << ": no partial block at " << bq << " x " << bk;
  }
}

// The bool mask's block classification (flash_impl/mask_tiles.h): masks
// whose blocks, at the forward's tile sizes (both vector widths) and the
// backward's, include some of every class (asserted here, so that the
// kernel's empty, full and partial branches all run), one plane shared by
// every head and one per head, with causal, GQA, kv lengths and dropout.
TEST(CpuFlash, MaskTilesOfEveryClass) {
  const int64_t D = 64;
  for (ElementType t : {ElementType::float32, ElementType::bfloat16, ElementType::float64}) {
    for (bool per_head : {false, true}) {
      Case c = base(std::string("documents mask ") + (per_head ? "per head" : "shared"), t);
      c.B = 2, c.H = 4, c.Hkv = per_head ? 2 : 4, c.Tq = c.Tk = 640, c.D = c.Dv = D, c.causal = true;
      if (per_head) c.kv_lens = {640, 520}, c.p = 0.1;
      const int64_t planes = per_head ? c.H : 1;
      c.mask = documents_mask(planes, c.Tq, c.Tk, 300);
      for (int64_t b = 0; b < c.B; ++b)
        for (int64_t h = 0; h < c.H; ++h) c.mask_plane.push_back(per_head ? h : 0);
      expect_blocks_of_every_class(c);
      check_case(c);
    }
  }
}

// Causal calls scan only the mask tiles some row of a 16-row group reaches
// (MaskTiles' reach, the largest causal offset): a block whose first rows'
// groups see a forbidden cell in the diagonal tile and whose later rows see
// none must stay partial. Rows 0..19 may not attend kv 0 (nor row 200 kv
// 150, with an offset of 30 in entry 1), every other cell is allowed.
TEST(CpuFlash, MaskTilesCausalReach) {
  int ran = 0;
  for (ElementType t : {ElementType::float32, ElementType::float64}) {
    for (bool offsets : {false, true}) {
      Case c = base(std::string("causal mask reach") + (offsets ? " offsets" : ""), t);
      c.B = 2, c.H = 2, c.Hkv = 2, c.Tq = 300, c.Tk = offsets ? 330 : 300, c.D = c.Dv = 16, c.causal = true;
      if (offsets) c.offsets = {0, 30};
      c.mask.assign(static_cast<size_t>(c.Tq * c.Tk), 1);
      for (int64_t i = 0; i < 20; ++i) c.mask[static_cast<size_t>(i * c.Tk)] = 0;
      c.mask[static_cast<size_t>(200 * c.Tk + 150)] = 0;
      c.mask_plane.assign(static_cast<size_t>(c.B * c.H), 0);
      check_case(c);
      ++ran;
    }
  }
  EXPECT_EQ(ran, 4);
}

// Ids of documents of irregular lengths around `len` (document d has
// len / 2 + (37 d + shift) % len positions), over n positions.
std::vector<int64_t> document_ids(int64_t n, int64_t len, int64_t shift) {
  std::vector<int64_t> ids;
  for (int64_t d = 0; static_cast<int64_t>(ids.size()) < n; ++d)
    for (int64_t x = 0; x < len / 2 + (37 * d + shift) % len && static_cast<int64_t>(ids.size()) < n; ++x)
      ids.push_back(d);
  return ids;
}

// Segment ids' block classification (flash_impl/mask_tiles.h, from the
// ids' [min, max] per row group and kv tile): documents per batch entry
// whose blocks include some of every class at each pass's tile sizes
// (asserted), with causal, GQA, kv lengths and dropout, and without causal
// a cross-attention whose kv side is longer (documents past every query's).
TEST(CpuFlash, SegmentTilesOfEveryClass) {
  const int64_t D = 64;
  int ran = 0;
  for (ElementType t : {ElementType::float32, ElementType::bfloat16, ElementType::float64}) {
    for (bool causal : {true, false}) {
      Case c = base(std::string("segments ") + (causal ? "causal" : "cross"), t);
      c.B = 2, c.H = 4, c.Hkv = 2, c.Tq = 640, c.Tk = causal ? 640 : 700, c.D = c.Dv = D, c.causal = causal;
      if (causal) c.kv_lens = {640, 520}, c.p = 0.1;
      for (int64_t b = 0; b < c.B; ++b) {
        const int64_t len = causal ? 300 : 500;  // cross: whole 128 x 256 blocks inside one document too
        const std::vector<int64_t> q = document_ids(c.Tq, len, 29 * b);
        const std::vector<int64_t> k = document_ids(c.Tk, len, 29 * b);
        c.qseg.insert(c.qseg.end(), q.begin(), q.end());
        c.kseg.insert(c.kseg.end(), k.begin(), k.end());
      }
      expect_blocks_of_every_class(c);
      check_case(c);
      ++ran;
    }
  }
  EXPECT_EQ(ran, 6);
}

// Segment ids need not be sorted or contiguous: scrambled ids (a few
// values in no order, some runs, a row whose id no kv position has) over
// many tiles, where a block's id ranges overlap without any equal pair or
// with one; the classification from ranges must stay exact in the result.
TEST(CpuFlash, SegmentsScrambled) {
  int ran = 0;
  for (ElementType t : {ElementType::float32, ElementType::float64}) {
    for (bool causal : {true, false}) {
      Case c = base(std::string("scrambled segments ") + (causal ? "causal" : "cross"), t);
      c.B = 2, c.H = 4, c.Hkv = 2, c.Tq = 300, c.Tk = causal ? 300 : 533, c.D = c.Dv = 32, c.causal = causal;
      c.kv_lens = {c.Tk, c.Tk - 61};
      for (int64_t b = 0; b < c.B; ++b) {
        for (int64_t i = 0; i < c.Tq; ++i) c.qseg.push_back(i == 17 ? 99 : i < 100 ? (i * 7 + b) % 5 : (i / 40) % 3);
        for (int64_t j = 0; j < c.Tk; ++j) c.kseg.push_back(j < 100 ? (j * 3 + b) % 5 : (j / 50) % 3);
      }
      check_case(c);
      ++ran;
    }
  }
  EXPECT_EQ(ran, 4);
}

// Segment ids in runs (each id's kv positions contiguous) bound each row to
// its id's kv run (mask_tiles.h: MaskTiles::bounded) instead of a test per
// element: runs in no order of their ids, of lengths 1, odd and long,
// unequal between the query and kv sides, ids that the kv side lacks (rows
// attending nothing) and runs that start and end inside tiles of both passes,
// with GQA, kv lengths and dropout (the dual cases segments_* add windows
// and every variant).
TEST(CpuFlash, SegmentRunsInAnyOrder) {
  int ran = 0;
  for (ElementType t : {ElementType::float32, ElementType::bfloat16, ElementType::float64}) {
    for (bool causal : {true, false}) {
      Case c = base(std::string("segment runs ") + (causal ? "causal" : "cross"), t);
      c.B = 2, c.H = 4, c.Hkv = 2, c.Tq = 333, c.Tk = causal ? 333 : 410, c.D = c.Dv = 32, c.causal = causal;
      c.kv_lens = {c.Tk, c.Tk - 70};
      if (causal) c.p = 0.1;
      // Run d of a side: id first + (5 d + 3 b) mod count over 1 + (mul d)
      // mod 97 positions, the last of its `count` runs to the end. Cross: the
      // kv side holds ids 3..15 in another order and length, so that rows of
      // ids 0..2 attend nothing.
      auto runs = [&](int64_t n, int64_t b, int64_t first, int64_t count, int64_t mul) {
        std::vector<int64_t> ids;
        for (int64_t d = 0; static_cast<int64_t>(ids.size()) < n; ++d)
          for (int64_t x = 0; (d == count - 1 || x < 1 + (mul * d) % 97) && static_cast<int64_t>(ids.size()) < n; ++x)
            ids.push_back(first + (5 * d + 3 * b) % count);
        return ids;
      };
      for (int64_t b = 0; b < c.B; ++b) {
        const std::vector<int64_t> q = runs(c.Tq, b, 0, 11, 41);
        const std::vector<int64_t> k = causal ? q : runs(c.Tk, b, 3, 13, 23);
        c.qseg.insert(c.qseg.end(), q.begin(), q.end());
        c.kseg.insert(c.kseg.end(), k.begin(), k.end());
      }
      check_case(c);
      ++ran;
    }
  }
  EXPECT_EQ(ran, 6);
}

TEST(CpuFlash, BroadcastDropout) {
  for (ElementType t : {ElementType::float32, ElementType::float64}) {
    Case c = base("broadcast dropout", t);
    c.B = 2, c.H = 2, c.Hkv = 2, c.Tq = 21, c.Tk = 133, c.D = c.Dv = 8, c.p = 0.4, c.broadcast = true;
    c.kv_lens = {133, 90};
    check_case(c);
  }
}

TEST(CpuFlash, DropoutOneDropsEverything) {
  Case c = base("p=1", ElementType::float64);
  c.B = 1, c.H = 2, c.Tq = 9, c.Tk = 17, c.D = c.Dv = 4, c.p = 1.0;
  check_case(c);
}

TEST(CpuFlash, DropoutMaskIsPhiloxContract) {
  // The kept fraction matches p, and the kernel's output equals the naive
  // reference built from dropout_uniform element by element (check_case).
  Case c = base("dropout contract", ElementType::float64);
  c.B = 1, c.H = 1, c.Tq = 64, c.Tk = 256, c.D = c.Dv = 4, c.p = 0.25;
  int64_t kept = 0;
  for (int64_t i = 0; i < c.Tq; ++i)
    for (int64_t j = 0; j < c.Tk; ++j) kept += keep(c, 0, 0, i, j);
  EXPECT_NEAR(static_cast<double>(kept) / (c.Tq * c.Tk), 0.75, 0.02);
  check_case(c);
}

TEST(CpuFlash, StridedViews) {
  for (Layout layout : {Layout::bthd, Layout::padded, Layout::packed}) {
    for (ElementType t : kAllTypes) {
      Case c = base("layout " + std::to_string(static_cast<int>(layout)), t);
      c.B = 2, c.H = 4, c.Hkv = 2, c.Tq = c.Tk = 41, c.D = c.Dv = 16, c.causal = true;
      c.layout = layout;
      check_case(c);
    }
  }
}

TEST(CpuFlash, PackedQkvIsZeroCopy) {
  // q, k and v point into one buffer: the kernel reads them in place.
  Case c = base("packed");
  c.B = 2, c.H = 8, c.Hkv = 2, c.Tq = c.Tk = 20, c.D = c.Dv = 8, c.layout = Layout::packed;
  const Inputs in = make_inputs(c);
  KernelRun r = prepare(c, in);
  EXPECT_EQ(r.q.buf, r.k.buf);
  EXPECT_EQ(static_cast<const unsigned char*>(r.p.k) - static_cast<const unsigned char*>(r.p.q),
            static_cast<ptrdiff_t>(c.H * c.D * 4));
  check_case(c);
}

TEST(CpuFlash, MultiChunkBackward) {
  // Few (batch, kv head) groups and a long kv axis: the backward pass splits
  // the kv axis into chunks and sums their dQ shares in a second pass.
  for (bool causal : {false, true}) {
    Case c = base(std::string("kv chunks") + (causal ? " causal" : ""));
    c.B = 1, c.H = 2, c.Hkv = 1, c.Tq = 90, c.Tk = 700, c.D = c.Dv = 16, c.causal = causal, c.offsets = {610};
    c.p = 0.1;
    check_case(c);
  }
}

TEST(CpuFlash, ExplicitScale) {
  Case c = base("scale", ElementType::float64);
  c.B = 1, c.H = 1, c.Tq = 10, c.Tk = 12, c.D = c.Dv = 6, c.scale = 0.77;
  check_case(c);
}

TEST(CpuFlash, EmptySizes) {
  {
    Case c = base("B=0");
    c.B = 0, c.Tq = c.Tk = 5;
    check_case(c);
  }
  {
    Case c = base("Tq=0");
    c.B = 2, c.Tq = 0, c.Tk = 5;
    check_case(c);
  }
  {
    // No kv positions: every row attends nothing.
    Case c = base("Tk=0");
    c.B = 2, c.H = 2, c.Tq = 5, c.Tk = 0;
    check_case(c);
  }
}

TEST(CpuFlash, NanInputPropagatesToItsRowOnly) {
  // A NaN score must not be mistaken for a masked one (0 weight): the row's
  // output is NaN, as the reference path's softmax gives; other rows are intact.
  for (ElementType t : {ElementType::float32, ElementType::bfloat16, ElementType::float16}) {
    Case c = base("nan", t);
    c.B = 1, c.H = 1, c.Tq = 4, c.Tk = 20, c.D = c.Dv = 8;
    const Inputs in = make_inputs(c);
    for (CpuIsa isa : isas()) {
      SCOPED_TRACE(cpu_isa_name(isa));
      KernelRun r = prepare(c, in);
      r.q.buf->set(r.q.at(0, 0, 2, 3), std::numeric_limits<double>::quiet_NaN());
      flash_attention_forward_cpu(r.p, serial_parallel_for(), isa);
      for (int64_t i = 0; i < c.Tq; ++i)
        for (int64_t e = 0; e < c.Dv; ++e)
          EXPECT_EQ(std::isnan(r.out.buf->get(r.out.at(0, 0, i, e))), i == 2) << "row " << i << " col " << e;
    }
  }
}

// The avx512_bf16 path packs bfloat16 as pairs along each product's k (head
// dim, kv positions, query rows) and starts backward blocks at even rows:
// odd head dims, lengths and row counts, every layout, GQA, causal offsets,
// dropout and the multi-chunk backward reach its pair boundaries. Run on
// every path this CPU has, like every case here.
TEST(CpuFlash, Bf16OddSizesLayoutsAndChunks) {
  std::vector<Case> cases;
  {
    Case c = base("odd dims", ElementType::bfloat16);
    c.B = 2, c.H = 4, c.Hkv = 2, c.Tq = 13, c.Tk = 29, c.D = 7, c.Dv = 5, c.causal = true, c.offsets = {16, -2};
    c.kv_lens = {29, 11};
    cases.push_back(c);
  }
  {
    Case c = base("odd rows, permuted, dropout", ElementType::bfloat16);
    c.B = 1, c.H = 2, c.Hkv = 2, c.Tq = 71, c.Tk = 131, c.D = c.Dv = 33, c.layout = Layout::bthd, c.p = 0.2;
    c.q_lens = {69};
    cases.push_back(c);
  }
  {
    Case c = base("packed gqa causal", ElementType::bfloat16);
    c.B = 2, c.H = 4, c.Hkv = 2, c.Tq = c.Tk = 50, c.D = c.Dv = 16, c.causal = true, c.layout = Layout::packed;
    cases.push_back(c);
  }
  {
    Case c = base("padded rows D=64", ElementType::bfloat16);
    c.B = 1, c.H = 2, c.Hkv = 1, c.Tq = c.Tk = 150, c.D = c.Dv = 64, c.causal = true, c.layout = Layout::padded;
    c.p = 0.1, c.broadcast = true;
    cases.push_back(c);
  }
  {
    Case c = base("kv chunks", ElementType::bfloat16);
    c.B = 1, c.H = 2, c.Hkv = 1, c.Tq = 91, c.Tk = 700, c.D = c.Dv = 16, c.causal = true, c.offsets = {609};
    c.p = 0.1;
    cases.push_back(c);
  }
  for (const Case& c : cases) check_case(c);
}

// docs/numerics.md: rounding the weights P to bfloat16 for P V moves each
// output element by at most 2^-8 max_j |v_j| (P >= 0 and sum_j P_j = l), and
// storing it in bfloat16 by 2^-8 |o|; the float32 sums add orders of
// magnitude less. Checked against the float64 reference on the same
// bfloat16 inputs, element by element.
TEST(CpuFlash, Bf16PairsOutputWithinTheDerivedBound) {
  const std::string missing = missing_cpu_flags(CpuIsa::avx512_bf16, cpu_features());
  if (!missing.empty()) GTEST_SKIP() << "avx512_bf16: this CPU lacks " << missing;
  Case c = base("bound", ElementType::bfloat16);
  c.B = 1, c.H = 2, c.Hkv = 2, c.Tq = 150, c.Tk = 300, c.D = c.Dv = 64;
  const Inputs in = make_inputs(c);
  const Reference ref = reference(c, in);
  KernelRun r = prepare(c, in);
  flash_attention_forward_cpu(r.p, serial_parallel_for(), CpuIsa::avx512_bf16);
  constexpr double u = 1.0 / 256;  // bfloat16's unit roundoff
  double worst = 0;                // the largest error as a share of its bound
  for (int64_t h = 0; h < c.H; ++h) {
    double vmax = 0;
    for (int64_t j = 0; j < c.Tk; ++j)
      for (int64_t e = 0; e < c.Dv; ++e) vmax = std::max(vmax, std::abs(in.v(0, h, j, e)));
    for (int64_t i = 0; i < c.Tq; ++i)
      for (int64_t e = 0; e < c.Dv; ++e) {
        const double want = ref.out(0, h, i, e), got = r.out.buf->get(r.out.at(0, h, i, e));
        const double bound = u * (vmax + std::abs(want)) + 1e-5 * vmax;
        ASSERT_LE(std::abs(got - want), bound) << "out[" << h << ", " << i << ", " << e << "]";
        worst = std::max(worst, std::abs(got - want) / bound);
      }
  }
  std::cout << "[ bf16 pairs ] largest output error: " << worst << " of the bound\n";
}

// ---------------------------------------------------------------------------
// Instruction sets (cpu_isa.h).

TEST(CpuIsa, CapNamesWhatIsMissing) {
  CpuFeatures avx2;  // an AVX2-only CPU
  avx2.avx2 = avx2.fma = avx2.f16c = true;
  CpuFeatures avx512 = avx2;  // AVX-512 without BF16 (Skylake-SP, Ice Lake)
  avx512.avx512f = avx512.avx512bw = avx512.avx512dq = avx512.avx512vl = true;
  CpuFeatures bf16 = avx512;
  bf16.avx512_bf16 = true;
  EXPECT_EQ(best_cpu_isa(CpuFeatures{}), CpuIsa::generic);
  EXPECT_EQ(best_cpu_isa(avx2), CpuIsa::avx2);
  EXPECT_EQ(best_cpu_isa(avx512), CpuIsa::avx512);
  EXPECT_EQ(best_cpu_isa(bf16), CpuIsa::avx512_bf16);
  EXPECT_EQ(cpu_isa_from_name("generic", CpuFeatures{}, "DIMATTN_CPU_ISA"), CpuIsa::generic);
  EXPECT_EQ(cpu_isa_from_name("avx2", bf16, "DIMATTN_CPU_ISA"), CpuIsa::avx2);
  EXPECT_EQ(cpu_isa_from_name("avx512_bf16", bf16, "DIMATTN_CPU_ISA"), CpuIsa::avx512_bf16);
  auto error = [](const std::string& name, const CpuFeatures& f) {
    try {
      cpu_isa_from_name(name, f, "DIMATTN_CPU_ISA");
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_EQ(error("avx512", avx2),
            "DIMATTN_CPU_ISA=avx512 needs CPU flags this CPU lacks: avx512f avx512bw avx512dq avx512vl; use avx2 or "
            "lower (generic, avx2, avx512, avx512_bf16 in increasing order), or unset it");
  EXPECT_NE(error("avx512_bf16", avx512).find("lacks: avx512_bf16;"), std::string::npos) << error("avx512_bf16", avx512);
  EXPECT_NE(error("avx2", CpuFeatures{}).find("lacks: avx2 fma f16c;"), std::string::npos);
  EXPECT_NE(error("AVX2", bf16).find("DIMATTN_CPU_ISA=AVX2 names no instruction set of cpu_flash; use generic, avx2, "
                                     "avx512 or avx512_bf16"),
            std::string::npos)
      << error("AVX2", bf16);
}

TEST(CpuIsa, Bf16PathRunsBfloat16Only) {
  const std::string missing = missing_cpu_flags(CpuIsa::avx512_bf16, cpu_features());
  if (!missing.empty()) GTEST_SKIP() << "avx512_bf16: this CPU lacks " << missing;
  EXPECT_EQ(cpu_flash_isa(ElementType::bfloat16, CpuIsa::avx512_bf16), CpuIsa::avx512_bf16);
  for (ElementType t : {ElementType::float32, ElementType::float64, ElementType::float16})
    EXPECT_EQ(cpu_flash_isa(t, CpuIsa::avx512_bf16), CpuIsa::avx512) << element_type_name(t);
  EXPECT_EQ(cpu_flash_isa(ElementType::bfloat16, CpuIsa::avx2), CpuIsa::avx2);
}

// Each code path on its own: a small case of every dtype through it, or, on
// a CPU without it, a skip naming the flags it lacks, after checking that
// asking for it is a clear error.
class CpuIsaPaths : public ::testing::TestWithParam<CpuIsa> {};

TEST_P(CpuIsaPaths, RunHereOrSkipNamingTheMissingFlags) {
  const CpuIsa isa = GetParam();
  const std::string missing = missing_cpu_flags(isa, cpu_features());
  if (!missing.empty()) {
    Case c = base("missing");
    c.Tq = c.Tk = 4;
    const Inputs in = make_inputs(c);
    KernelRun r = prepare(c, in);
    try {
      flash_attention_forward_cpu(r.p, serial_parallel_for(), isa);
      ADD_FAILURE() << cpu_isa_name(isa) << " ran on a CPU that lacks " << missing;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(missing), std::string::npos) << e.what();
    }
    GTEST_SKIP() << cpu_isa_name(isa) << ": this CPU lacks " << missing;
  }
  for (ElementType t : kAllTypes) {
    Case c = base(std::string("path ") + cpu_isa_name(isa), t);
    c.B = 2, c.H = 4, c.Hkv = 2, c.Tq = 45, c.Tk = 77, c.D = c.Dv = 24, c.causal = true, c.offsets = {32, 5};
    c.p = 0.1;
    check_case(c, true, {isa});
  }
}

INSTANTIATE_TEST_SUITE_P(Isa, CpuIsaPaths, ::testing::ValuesIn(kCpuIsas),
                         [](const ::testing::TestParamInfo<CpuIsa>& i) { return std::string(cpu_isa_name(i.param)); });

// Bitwise equal results with 1, 2 and 3 threads and the serial loop, for the
// forward pass and both backward schedules (one chunk, several chunks).
TEST(CpuFlash, DeterministicAcrossThreadCounts) {
  std::vector<Case> cases;
  {
    Case c = base("det one chunk");
    c.B = 2, c.H = 8, c.Hkv = 8, c.Tq = 150, c.Tk = 150, c.D = c.Dv = 32, c.causal = true, c.p = 0.2;
    cases.push_back(c);
  }
  {
    Case c = base("det chunks gqa");
    c.B = 1, c.H = 4, c.Hkv = 2, c.Tq = 100, c.Tk = 640, c.D = c.Dv = 16, c.causal = true, c.offsets = {540};
    c.p = 0.1;
    cases.push_back(c);
  }
  {
    Case c = base("det bf16", ElementType::bfloat16);
    c.B = 3, c.H = 2, c.Hkv = 1, c.Tq = 77, c.Tk = 300, c.D = c.Dv = 64, c.kv_lens = {300, 10, 170};
    cases.push_back(c);
  }
  for (const Case& c : cases) {
    const Inputs in = make_inputs(c);
    for (CpuIsa isa : isas()) {
      SCOPED_TRACE(c.name + " isa=" + cpu_isa_name(isa));
      std::vector<KernelRun> runs;
      for (int threads : {0, 1, 2, 3}) {
        KernelRun r = prepare(c, in);
        ThreadPool pool(std::max(threads, 1));
        const ParallelFor pf = threads == 0 ? serial_parallel_for() : pool.as_parallel_for();
        flash_attention_forward_cpu(r.p, pf, isa);
        flash_attention_backward_cpu(r.p, pf, isa);
        runs.push_back(std::move(r));
      }
      for (size_t i = 1; i < runs.size(); ++i) {
        EXPECT_EQ(runs[i].lse, runs[0].lse) << "lse, run " << i;
        for (size_t b = 0; b < runs[0].buffers.size(); ++b)
          EXPECT_TRUE(runs[i].buffers[b].bytes == runs[0].buffers[b].bytes) << "buffer " << b << ", run " << i;
      }
    }
  }
}

// The backward kernel is the gradient of the forward kernel: central finite
// differences of L = sum(dout * out) in float64, dropout and masks included.
TEST(CpuFlash, FiniteDifferences) {
  Case c = base("finite differences", ElementType::float64);
  c.B = 2, c.H = 2, c.Hkv = 1, c.Tq = 5, c.Tk = 7, c.D = 3, c.Dv = 2, c.causal = true, c.offsets = {2, -1};
  c.kv_lens = {7, 4};
  c.p = 0.2;
  const Inputs in = make_inputs(c);
  for (CpuIsa isa : isas()) {
    SCOPED_TRACE(cpu_isa_name(isa));
    const ParallelFor pf = serial_parallel_for();
    KernelRun r = prepare(c, in);
    flash_attention_forward_cpu(r.p, pf, isa);
    flash_attention_backward_cpu(r.p, pf, isa);
    auto loss = [&](const Inputs& x) {
      KernelRun t = prepare(c, x);
      flash_attention_forward_cpu(t.p, pf, isa);
      double l = 0;
      for (int64_t b = 0; b < c.B; ++b)
        for (int64_t h = 0; h < c.H; ++h)
          for (int64_t i = 0; i < c.Tq; ++i)
            for (int64_t e = 0; e < c.Dv; ++e) l += x.dout(b, h, i, e) * t.out.buf->get(t.out.at(b, h, i, e));
      return l;
    };
    const double eps = 1e-6;
    auto check_grad = [&](const char* name, Array4 Inputs::*member, const View& grad) {
      Inputs x = in;
      Array4& a = x.*member;
      double worst = 0;
      for (size_t idx = 0; idx < a.v.size(); ++idx) {
        const double orig = a.v[idx];
        a.v[idx] = orig + eps;
        const double up = loss(x);
        a.v[idx] = orig - eps;
        const double down = loss(x);
        a.v[idx] = orig;
        const double numeric = (up - down) / (2 * eps);
        int64_t rem = static_cast<int64_t>(idx);
        const int64_t d3 = rem % a.n[3];
        rem /= a.n[3];
        const int64_t d2 = rem % a.n[2];
        rem /= a.n[2];
        const int64_t d1 = rem % a.n[1];
        const int64_t d0 = rem / a.n[1];
        worst = std::max(worst, std::abs(numeric - grad.buf->get(grad.at(d0, d1, d2, d3))));
      }
      EXPECT_LT(worst, 1e-7) << name;
    };
    check_grad("dq", &Inputs::q, r.dq);
    check_grad("dk", &Inputs::k, r.dk);
    check_grad("dv", &Inputs::v, r.dv);
  }
}

// ---------------------------------------------------------------------------
// The one mask definition (common/attention_mask.h) against the reference
// path's rules, written out here independently of it.

TEST(AttentionMask, RowRangesAreTheReferenceRules) {
  // Reference: row i attends j iff i < q_len, j < kv_len, (causal => j <= i + offset)
  // and (a window's left bound => j >= i + offset - left). Offsets and bounds
  // far beyond the extents occur in blocks of a longer sequence.
  constexpr int64_t Tq = 9, Tk = 11;
  const int64_t offsets[] = {0,  3,  -2, -9, -10, -11, 10, 11, 500, -500, std::numeric_limits<int64_t>::max(),
                             std::numeric_limits<int64_t>::min()};
  int64_t checked = 0;
  for (bool causal : {false, true})
    for (int64_t left : {int64_t{-1}, int64_t{2}, int64_t{30}, int64_t{495}, std::numeric_limits<int64_t>::max()})
    for (int64_t q_len : {int64_t{0}, int64_t{4}, Tq})
      for (int64_t kv_len : {int64_t{0}, int64_t{1}, int64_t{6}, Tk})
        for (int64_t off : offsets) {
          const int64_t ql[1] = {q_len}, kl[1] = {kv_len}, of[1] = {off};
          const EntryMask m = entry_mask(ql, kl, of, causal, Tq, Tk, 0, RowBounds{left});
          for (int64_t i = 0; i < Tq + 2; ++i) {
            for (int64_t j = 0; j < Tk; ++j) {
              const __int128 diag = static_cast<__int128>(i) + off;
              const bool want = i < q_len && j < kv_len && (!causal || j <= diag) && (left < 0 || j >= diag - left);
              ASSERT_EQ(m.allowed(i, j), want) << "causal=" << causal << " q_len=" << q_len << " kv_len=" << kv_len
                                               << " offset=" << off << " left=" << left << " i=" << i << " j=" << j;
              // The rows attending j are exactly rows_reaching(j) (pre: j < kv_len).
              if (j < kv_len) ASSERT_EQ(m.rows_reaching(j).contains(i), want) << "rows_reaching, i=" << i << " j=" << j;
              ++checked;
            }
            // Without a window lo is 0; with one an empty row may have lo > hi.
            if (left < 0) ASSERT_LE(m.row(i).lo, std::max<int64_t>(m.row(i).hi, 0));
          }
        }
  EXPECT_GT(checked, 10000);
  // Absent arrays: full lengths and offset 0.
  const EntryMask full = entry_mask(nullptr, nullptr, nullptr, true, 5, 7, 3);
  EXPECT_EQ(full.q_len, 5);
  EXPECT_EQ(full.kv_len, 7);
  EXPECT_EQ(full.hi(0), 1);
  EXPECT_EQ(full.hi(4), 5);
  EXPECT_EQ(full.hi(5), 0) << "padding row";
}

TEST(AttentionMask, PerRowKvLengths) {
  // Row i of the plane ends at its own length; rows_reaching stays a
  // contiguous superset of the rows attending j; hi_max and hi_min are the
  // extremes of hi over any block of rows, with and without per-row lengths.
  constexpr int64_t Tq = 9, Tk = 11;
  const int64_t rows[Tq] = {3, 0, 11, 7, 7, 1, 0, 11, 5};
  for (bool causal : {false, true})
    for (int64_t left : {int64_t{-1}, int64_t{3}})
      for (int64_t off : {int64_t{-2}, int64_t{0}, int64_t{4}})
        for (int64_t stride : {int64_t{0}, int64_t{1}})
          for (int64_t q_len : {int64_t{5}, Tq}) {
            const int64_t ql[1] = {q_len}, kl[1] = {11}, of[1] = {off}, plane[1] = {0};
            const ScorePlanes per_row{rows, plane, stride, 0};
            const EntryMask m = entry_mask(ql, kl, of, causal, Tq, Tk, 0, RowBounds{left}, per_row, 0);
            for (int64_t i = 0; i < Tq; ++i)
              for (int64_t j = 0; j < Tk; ++j) {
                const int64_t len = rows[i * stride];
                const bool want =
                    i < q_len && j < len && (!causal || j <= i + off) && (left < 0 || j >= i + off - left);
                ASSERT_EQ(m.allowed(i, j), want) << "causal=" << causal << " left=" << left << " offset=" << off
                                                 << " stride=" << stride << " i=" << i << " j=" << j;
                if (want) ASSERT_TRUE(m.rows_reaching(j).contains(i)) << "rows_reaching, i=" << i << " j=" << j;
              }
            for (int64_t r0 = 0; r0 < q_len; ++r0)
              for (int64_t r1 = r0 + 1; r1 <= q_len; ++r1) {
                int64_t most = 0, least = Tk;
                for (int64_t i = r0; i < r1; ++i) most = std::max(most, m.hi(i)), least = std::min(least, m.hi(i));
                ASSERT_EQ(m.hi_max(r0, r1), most) << r0 << ", " << r1;
                ASSERT_EQ(m.hi_min(r0, r1), least) << r0 << ", " << r1;
              }
          }
  // Without a plane index the entry's mask: every row its entry's length.
  const int64_t kl[1] = {6}, plane[1] = {0};
  const EntryMask entry = entry_mask(nullptr, kl, nullptr, false, Tq, Tk, 0, {}, {rows, plane, 1, 0});
  EXPECT_EQ(entry.hi(1), 6);
  EXPECT_TRUE(entry.monotone());
}

TEST(AttentionMask, DropoutRuleKeepsUniformAtLeastP) {
  // The kernels' integer test on raw Philox words equals the reference's
  // "uniform >= p" for every p, at and around each threshold.
  const double ps[] = {0.0, 1e-9, 0.1, 0.25, 0.3, 1.0 / 3, 0.5, 0.999999, 1.0 - 1.0 / 16777216, 1.0};
  for (double p : ps) {
    const DropoutRule r = dropout_rule(p);
    EXPECT_EQ(r.keep_scale, p >= 1 ? 0.0 : 1.0 / (1.0 - p)) << p;
    const int64_t t = r.threshold;
    for (int64_t u = std::max<int64_t>(t - 3, 0); u <= std::min<int64_t>(t + 3, (1 << 24) - 1); ++u)
      for (uint32_t low : {0u, 0xffu}) {
        const uint32_t bits = static_cast<uint32_t>(u) << 8 | low;
        EXPECT_EQ(r.keeps(bits), uniform_from_bits(bits) >= p) << "p=" << p << " u=" << u;
      }
  }
}

TEST(AttentionMask, DropoutKeyingIsPinned) {
  // Values of the keying as first shipped: changing it would silently change
  // every dropout mask users have seeded (the kernels and the reference
  // would still agree with each other).
  EXPECT_EQ(dropout_uniform(42, 7, 3, 11, 5), 0.619760692f);
  EXPECT_EQ(dropout_uniform(1234, 0, 0, 0, 6), 0.977164268f);
  EXPECT_EQ(dropout_uniform_broadcast(42, 7, 9), 0.735791087f);
  const Philox4 w = dropout_words(99, 1, 2, 3, 13), b = dropout_words_broadcast(99, 1, 13);
  const uint32_t want_w[4] = {0xf58a6f1du, 0x6baedb22u, 0xbee0eba1u, 0x4e6ac11fu};
  const uint32_t want_b[4] = {0xc7bf6686u, 0xe1d6b946u, 0xdd90955cu, 0xe44f2bf0u};
  for (int l = 0; l < 4; ++l) {
    EXPECT_EQ(w.v[l], want_w[l]) << l;
    EXPECT_EQ(b.v[l], want_b[l]) << l;
  }
}

// ---------------------------------------------------------------------------
// Contracts a caller can get wrong.

AttentionKernelParams valid_params(std::vector<float>& storage) {
  storage.assign(256, 0.5f);
  AttentionKernelParams p;
  p.dtype = ElementType::float32;
  p.batch = 1, p.heads = 2, p.kv_heads = 2, p.seqlen_q = 3, p.seqlen_k = 3, p.head_dim = 8, p.head_dim_v = 8;
  const ElementStrides st{2 * 3 * 8, 3 * 8, 8, 1};
  p.q = p.k = p.v = p.dout = storage.data();
  p.out = p.dq = storage.data() + 48;
  p.dk = storage.data() + 96;
  p.dv = storage.data() + 144;
  p.q_strides = p.k_strides = p.v_strides = p.out_strides = p.dout_strides = p.dq_strides = p.dk_strides =
      p.dv_strides = st;
  p.lse = storage.data() + 192;  // 6 floats
  p.lse_batch_stride = 6, p.lse_head_stride = 3;
  return p;
}

void expect_rejected(const AttentionKernelParams& p, bool backward, const std::string& fragment) {
  const std::string err = backward ? p.validate(true) : p.validate(false);
  const std::string host = p.validate_host_arrays();
  EXPECT_NE((err + host).find(fragment), std::string::npos) << "validate: '" << err << "' host: '" << host << "'";
  try {
    if (backward)
      flash_attention_backward_cpu(p, serial_parallel_for());
    else
      flash_attention_forward_cpu(p, serial_parallel_for());
    ADD_FAILURE() << "no exception for " << fragment;
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("[cpu_flash]"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
  }
}

TEST(CpuFlashParams, ValidParamsPass) {
  std::vector<float> s;
  const AttentionKernelParams p = valid_params(s);
  EXPECT_EQ(p.validate(false), "");
  EXPECT_EQ(p.validate(true), "");
  EXPECT_EQ(p.validate_host_arrays(), "");
}

TEST(CpuFlashParams, RejectsWhatCallersGetWrong) {
  std::vector<float> s;
  {
    AttentionKernelParams p = valid_params(s);
    p.heads = 3;
    expect_rejected(p, false, "not a multiple of kv_heads");
  }
  {
    AttentionKernelParams p = valid_params(s);
    p.kv_heads = 0;
    expect_rejected(p, false, "kv_heads must be >= 1");
  }
  {
    AttentionKernelParams p = valid_params(s);
    p.k_strides.last = 2;
    expect_rejected(p, false, "k needs a contiguous last dim");
  }
  {
    AttentionKernelParams p = valid_params(s);
    p.v = nullptr;
    expect_rejected(p, false, "v is null");
  }
  {
    AttentionKernelParams p = valid_params(s);
    p.dk = nullptr;
    expect_rejected(p, true, "dk is null");
  }
  {
    AttentionKernelParams p = valid_params(s);
    p.lse = nullptr;
    expect_rejected(p, true, "lse (from the forward pass) is required");
  }
  {
    AttentionKernelParams p = valid_params(s);
    p.seqlen_k = -1;
    expect_rejected(p, false, "sizes must be >= 0");
  }
  {
    AttentionKernelParams p = valid_params(s);
    p.dropout_p = 1.5;
    expect_rejected(p, false, "dropout_p must be in [0, 1]");
  }
  {
    AttentionKernelParams p = valid_params(s);
    p.dropout_p = std::nan("");
    expect_rejected(p, false, "dropout_p must be in [0, 1]");
  }
  {
    AttentionKernelParams p = valid_params(s);
    p.scale = kInf;
    expect_rejected(p, false, "scale must be finite");
  }
  {
    AttentionKernelParams p = valid_params(s);
    p.out_strides.row = 4;  // rows of 8 elements 4 apart: overlapping writes
    expect_rejected(p, false, "overlapping strides");
  }
  {
    AttentionKernelParams p = valid_params(s);
    p.q_strides.head = -24;
    expect_rejected(p, false, "negative stride");
  }
  {
    AttentionKernelParams p = valid_params(s);
    const int64_t lens[1] = {4};
    p.kv_lengths = lens;
    expect_rejected(p, false, "kv_lengths[0] = 4 is outside [0, seqlen_k=3]");
  }
  {
    AttentionKernelParams p = valid_params(s);
    const int64_t lens[1] = {-1};
    p.q_lengths = lens;
    expect_rejected(p, false, "q_lengths[0] = -1");
  }
  {
    AttentionKernelParams p = valid_params(s);
    const int64_t entry[1] = {2}, rows[3] = {2, 3, 1}, offsets[2] = {0, 0};
    p.kv_lengths = entry;
    p.kv_row_lengths = {rows, offsets, 1, 0};
    expect_rejected(p, false, "kv_row_lengths of batch entry 0, head 0, row 1 = 3 is outside [0, kv_lengths[b]=2]");
    p.kv_row_lengths.offsets = nullptr;
    expect_rejected(p, false, "kv_row_lengths needs offsets");
  }
  {
    AttentionKernelParams p = valid_params(s);
    p.dtype = static_cast<ElementType>(9);
    expect_rejected(p, false, "unsupported element type");
  }
}

TEST(CpuFlashParams, BroadcastInputsWithZeroStridesAreAccepted) {
  // MQA expressed as k, v expanded over heads (head stride 0) is a valid input.
  std::vector<float> s;
  AttentionKernelParams p = valid_params(s);
  p.k_strides.head = 0;
  p.v_strides.head = 0;
  EXPECT_EQ(p.validate(true), "");
}

TEST(CpuFlashThreadPool, CoversRangeOnceAndPropagatesExceptions) {
  ThreadPool pool(3);
  EXPECT_EQ(pool.num_threads(), 3);
  std::vector<int> hits(1000, 0);
  pool.parallel_for(0, 1000, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) ++hits[i];
  });
  EXPECT_EQ(std::count(hits.begin(), hits.end(), 1), 1000);
  EXPECT_THROW(pool.parallel_for(0, 100,
                                 [](int64_t b, int64_t) {
                                   if (b >= 50) throw std::runtime_error("boom");
                                 }),
               std::runtime_error);
  // Nested loops run serially instead of deadlocking.
  std::atomic<int> total{0};
  pool.parallel_for(0, 4, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) pool.parallel_for(0, 10, [&](int64_t x, int64_t y) { total += int(y - x); });
  });
  EXPECT_EQ(total.load(), 40);
}

}  // namespace
}  // namespace dimattn::kernels
