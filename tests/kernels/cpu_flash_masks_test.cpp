// cpu_flash's masks at kernel level: bool masks and segment ids whose tiles
// the kernel classifies (empty, full, partial) and runs in any order, and the
// one mask definition (common/attention_mask.h) against the reference rules.
#include <gtest/gtest.h>

#include "cpu_flash_check.h"

namespace dimattn::kernels {
namespace {

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

}  // namespace
}  // namespace dimattn::kernels
