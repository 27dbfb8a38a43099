#pragma once
// The one definition of which attention elements exist and which dropout
// keeps: every fused kernel (CPU forward and backward, CUDA forward and
// backward) and their gates take it from here, host and device alike.
//
// Masks. Per batch entry b and query head h, query row i attends the
// half-open kv range [lo(i), hi(i)):
//   lo(i) = max(0, i + offset - left)            with a window's left bound
//           0                                    otherwise
//   hi(i) = 0                                    if i >= q_len (padding row)
//           min(len(i), i + offset + 1)          if causal
//           min(len(i), i + offset + right + 1)  with a window's right bound
//           len(i)                               otherwise   (clamped to >= 0;
//                                                 causal and a right bound: the smaller)
// with q_len the entry's query length (AttentionKernelParams::q_lengths; the
// full extent when absent), len(i) row i's kv length, offset the entry's
// causal offset and left/right the window (RowBounds,
// AttentionKernelParams::bounds; negative = unbounded). len(i) is the entry's
// kv length kv_len (AttentionKernelParams::kv_lengths; the full extent when
// absent), unless the lengths vary over the query's own dims: then each row
// of each head has its own (AttentionKernelParams::kv_row_lengths, the plane
// of (b, h)), and kv_len is their maximum over the entry, an upper bound.
// lo is nondecreasing in i; so is hi over the rows i < q_len when every row
// has the entry's length, and a block of rows [r0, r1) attends
// [lo_min(r0, r1), hi_max(r0, r1)) either way (lo(r0) and hi(r1 - 1) then,
// a loop over the rows with per-row lengths). A kernel may narrow each row
// further to the kv run of its segment id (EntryMask::run_lo, run_hi: the
// segments variant below, where each id's kv positions are contiguous); lo
// and hi then take it in, and lose their order. A kv position is attended by
// at most the contiguous run of rows rows_reaching() gives, which ignores
// lengths and runs (a superset then: kernels mask each element by its row's
// lo and hi). Kernels skip the blocks outside a window's band and past every
// row's length.
//
// How the reference path (frontend/src/attention_reference.cpp) maps onto it:
// causal there allows kv j iff j <= i + offset, i.e. j < i + offset + 1 = the
// causal hi; padding allows j iff j < length (the row's: the lengths tensor
// broadcasts by name over the query's dims), i.e. j < len(i); a row whose
// range is empty (hi <= lo) gives output 0 and weights 0 (the reference
// zeroes masked weights after the softmax; the kernels write 0 and lse = -inf).
// Values at kv positions no row reaches (past every row's length) are never
// read by the kernels and zeroed by the reference before its product.
//
// Dropout. Element (bh, q, k) (or k alone under broadcast dropout) draws the
// uniform number of philox.h's generator under the keying below, is kept iff
// uniform >= p, and a kept weight is scaled by 1 / (1 - p) (0 when p = 1);
// the softmax normaliser is that of the weights before dropout.
//   per element:  key = seed, counter = {k / 4, q, bh, offset}, lane k % 4
//   broadcast:    key = seed ^ kBroadcastSalt, counter = {k / 4, 0, 0, offset}, lane k % 4
// where bh is the flat index over the call's batch dims, then keys-only dims,
// then query groups (row-major, each in the call's order), q the query
// spatial position, k the kv position.
#include <cmath>
#include <cstdint>

#include "common/philox.h"

namespace dimattn::kernels {

// ---------------------------------------------------------------------------
// Masks.

// A half-open index range (kv positions of a row, or rows of a position).
struct Range {
  int64_t lo, hi;  // [lo, hi); empty when hi <= lo
  DIMATTN_HD bool empty() const { return hi <= lo; }
  DIMATTN_HD bool contains(int64_t j) const { return lo <= j && j < hi; }
};

// A tensor over any subset of a call's dims, never expanded to [batch,
// heads, seqlen_q, seqlen_k]: the plane of flat index bh = b * heads + h
// starts at element offsets[bh] of data, and element (i, j) of a plane is
// + i * row_stride + j * col_stride (a stride or offset repeats where the
// tensor is broadcast). Score-sized tensors (bias, mask) and the per-row kv
// lengths (int64, over no kv position: col_stride 0).
struct ScorePlanes {
  const void* data = nullptr;        // nullptr = off
  const int64_t* offsets = nullptr;  // [batch * heads]
  int64_t row_stride = 0, col_stride = 0;

  DIMATTN_HD bool on() const { return data != nullptr; }
  template <class T>
  DIMATTN_HD const T* plane(int64_t bh) const {
    return static_cast<const T*>(data) + offsets[bh];
  }
};

// The positional mask variants, which bound each row's kv range beyond its
// lengths and causal masking: the sliding window. It is data the kernels
// carry as a whole (AttentionKernelParams::bounds, the CUDA kernel's
// DeviceParams::bounds) and read only through EntryMask's lo, hi and
// rows_reaching below, so a new positional variant is a field here, its
// clamp, and its terms in those three functions.
struct RowBounds {
  int64_t window_left = -1, window_right = -1;  // < 0 = unbounded on that side

  // Bounds clamped to 2^61, so that i + offset + bound + 1 cannot overflow
  // (see entry_mask).
  DIMATTN_HD RowBounds clamped() const {
    constexpr int64_t kFar = int64_t{1} << 61;
    return {window_left > kFar ? kFar : window_left, window_right > kFar ? kFar : window_right};
  }
};

// The mask of one batch entry, or of one (batch entry, head) plane when the
// rows have their own kv lengths.
struct EntryMask {
  int64_t q_len, kv_len;  // kv_len: with per-row lengths, their maximum over the entry
  int64_t offset;         // causal offset, clamped to [-2^61, 2^61]
  bool causal;
  RowBounds bounds;  // clamped
  // Row i's kv length is row_kv_len[i * row_kv_stride] (<= kv_len), or
  // kv_len when row_kv_len is null. A stride of 0: one length per plane.
  const int64_t* row_kv_len = nullptr;
  int64_t row_kv_stride = 0;
  // Segment runs (a kernel's own narrowing, never set by entry_mask): row i
  // attends only kv positions [run_lo[i], run_hi[i]), the run of its
  // segment id where each id's kv positions are one contiguous run
  // (cpu/flash_impl/mask_tiles.h finds them). Null = no such bound.
  const int64_t* run_lo = nullptr;
  const int64_t* run_hi = nullptr;

  DIMATTN_HD int64_t lo(int64_t i) const {
    const int64_t left = bounds.window_left;
    int64_t l = left < 0 ? 0 : i + offset - left;
    if (run_lo && run_lo[i] > l) l = run_lo[i];
    return l > 0 ? l : 0;
  }
  DIMATTN_HD int64_t hi(int64_t i) const {
    if (i >= q_len) return 0;  // padding rows attend nothing (and have no row length to read)
    const int64_t right = bounds.window_right;
    int64_t h = row_kv_len ? row_kv_len[i * row_kv_stride] : kv_len;
    if (causal && i + offset + 1 < h) h = i + offset + 1;
    if (right >= 0 && i + offset + right + 1 < h) h = i + offset + right + 1;
    if (run_hi && run_hi[i] < h) h = run_hi[i];
    return h > 0 ? h : 0;
  }
  DIMATTN_HD Range row(int64_t i) const { return {lo(i), hi(i)}; }
  DIMATTN_HD bool allowed(int64_t i, int64_t j) const { return row(i).contains(j); }

  // Whether hi is nondecreasing over the rows i < q_len (every row has the
  // plane's one length, no segment runs); lo always is without runs.
  DIMATTN_HD bool monotone() const { return (row_kv_len == nullptr || row_kv_stride == 0) && run_hi == nullptr; }
  // The smallest and largest lo(i) over rows [r0, r1): where a block of
  // rows starts reading, and from where all of them do. pre: r0 < r1.
  DIMATTN_HD int64_t lo_min(int64_t r0, int64_t r1) const {
    return run_lo == nullptr ? lo(r0) : fold(r0, r1, false, [this](int64_t i) { return lo(i); });
  }
  DIMATTN_HD int64_t lo_max(int64_t r0, int64_t r1) const {
    return run_lo == nullptr ? lo(r1 - 1) : fold(r0, r1, true, [this](int64_t i) { return lo(i); });
  }
  // Whether every row of [r0, r1) attends all of kv positions [j0, j1) (a
  // tile then needs no per-row bounds). pre: r0 < r1.
  DIMATTN_HD bool covers(int64_t r0, int64_t r1, int64_t j0, int64_t j1) const {
    return hi_min(r0, r1) >= j1 && lo_max(r0, r1) <= j0;
  }
  // The largest and smallest hi(i) over rows [r0, r1): where a block of rows
  // stops reading kv positions, and up to where all of them read (a tile
  // that ends there needs no per-row masking). pre: 0 <= r0 < r1 <= q_len.
  DIMATTN_HD int64_t hi_max(int64_t r0, int64_t r1) const {
    return monotone() ? hi(r1 - 1) : fold(r0, r1, true, [this](int64_t i) { return hi(i); });
  }
  DIMATTN_HD int64_t hi_min(int64_t r0, int64_t r1) const {
    return monotone() ? hi(r0) : fold(r0, r1, false, [this](int64_t i) { return hi(i); });
  }

  // The largest (most) or smallest of x(i) over rows [r0, r1). pre: r0 < r1.
  template <class X>
  DIMATTN_HD static int64_t fold(int64_t r0, int64_t r1, bool most, X x) {
    int64_t e = x(r0);
    for (int64_t i = r0 + 1; i < r1; ++i) {
      const int64_t v = x(i);
      e = (most ? v > e : v < e) ? v : e;
    }
    return e;
  }

  // The rows [first, end) that may attend kv position j, clamped to [0,
  // q_len] (first >= end when none): exactly those that do, unless rows
  // have their own lengths or segment runs, which it ignores (then a
  // superset: some of its rows may end before j or start after it).
  // pre: 0 <= j < kv_len.
  DIMATTN_HD Range rows_reaching(int64_t j) const {
    const int64_t left = bounds.window_left, right = bounds.window_right;
    // hi(i) > j  <=>  i + offset + 1 > j (causal) and i + offset + right + 1 > j.
    int64_t first = 0;
    if (causal) first = j - offset;
    if (right >= 0 && j - offset - right > first) first = j - offset - right;
    // lo(i) <= j  <=>  i + offset - left <= j.
    int64_t end = left >= 0 ? j - offset + left + 1 : q_len;
    first = first < 0 ? 0 : first > q_len ? q_len : first;
    end = end < first ? first : end > q_len ? q_len : end;
    return {first, end};
  }
};

// The mask of batch entry b from a params struct's per-entry arrays (nullptr
// = full length, offset 0) and bounds, and with per-row kv lengths
// (`kv_rows` on: int64 planes, AttentionKernelParams::kv_row_lengths) the
// rows of plane bh = b * heads + h. Without bh (or with kv_rows off) it is
// the entry's mask, whose kv_len bounds every row's. Clamping the offset to
// +-2^61 and the bounds to 2^61 keeps i + offset + right + 1 from
// overflowing; neither is clamped to the call's extents, because windows and
// ALiBi measure from the true diagonal (a block of a longer sequence has
// offsets far beyond its own seqlen_k, and a window bound past seqlen_q +
// seqlen_k may still bound it).
DIMATTN_HD EntryMask entry_mask(const int64_t* q_lengths, const int64_t* kv_lengths, const int64_t* causal_offset,
                                bool causal, int64_t seqlen_q, int64_t seqlen_k, int64_t b, RowBounds bounds = {},
                                ScorePlanes kv_rows = {}, int64_t bh = -1) {
  EntryMask m;
  m.q_len = q_lengths ? q_lengths[b] : seqlen_q;
  m.kv_len = kv_lengths ? kv_lengths[b] : seqlen_k;
  m.causal = causal;
  const int64_t off = causal_offset ? causal_offset[b] : 0;
  constexpr int64_t kFar = int64_t{1} << 61;
  m.offset = off < -kFar ? -kFar : off > kFar ? kFar : off;
  m.bounds = bounds.clamped();
  if (kv_rows.on() && bh >= 0) {
    m.row_kv_len = kv_rows.plane<int64_t>(bh);
    m.row_kv_stride = kv_rows.row_stride;
  }
  return m;
}

// What the bool mask and segments allow of a block of (row, kv) cells:
// nothing (kernels skip it), everything (no per-element test), or some.
enum class TileClass { empty, full, partial };

// ---------------------------------------------------------------------------
// Scores: soft-capping, bias, ALiBi, the boolean mask and segments, and the sink logit.
// The kernels carry them as one value (ScoreParams: AttentionKernelParams::score,
// the CUDA kernel's DeviceParams::score) and read it only through score_mod_of
// and sink_log2_of below, in the log2 units the kernels use (x = s * log2(e)),
// in the order of AttentionKernelParams.

inline constexpr double kScoreLog2e = 1.4426950408889634;

// One float64 value per (batch entry b, head h) at data[b * batch_stride +
// h * head_stride] (a stride of 0 broadcasts): ALiBi slopes, sink logits.
struct HeadValues {
  const double* data = nullptr;  // nullptr = off
  int64_t batch_stride = 0, head_stride = 0;

  DIMATTN_HD bool on() const { return data != nullptr; }
  DIMATTN_HD double at(int64_t b, int64_t h) const { return data[b * batch_stride + h * head_stride]; }
};

// Relative positions (Transformer-XL; attention_params.h): the raw score
// q_i . k_j gains u . k_j + (q_i + v) . table[center + j - step * i] (the
// call's scale applies to the sum). CPU kernel only: cuda_flash's gate
// rejects the variant.
struct RelPosParams {
  // Planes of `rows` relative positions (row_stride apart) by head_dim
  // (col_stride 1), of the call's element type, per (b, h) at offsets[bh].
  // pre: 0 <= center + j - step * i < rows for every i < seqlen_q, j < seqlen_k.
  ScorePlanes table;
  int64_t rows = 0, center = 0, step = 1;  // step: 1 (row i shifts) or 0 (row j for every query row)
  // [batch * heads][head_dim] dense, nullptr = 0.
  const double* u = nullptr;
  const double* v = nullptr;
  // Backward outputs, zeroed by the caller, each element added to
  // atomically: d(table) in the accumulation type laid out as `table`
  // (offsets and strides; nullptr = not asked), d(u) and d(v) as u and v
  // (nullptr = not asked).
  void* dtable = nullptr;
  double* du = nullptr;
  double* dv = nullptr;

  DIMATTN_HD bool on() const { return table.on(); }
};

// The score variants of a call and the gradients the backward pass writes
// for the learnable ones (attention_params.h says what each means).
struct ScoreParams {
  double softcap = 0;  // s becomes softcap * tanh(s / softcap); 0 = off
  HeadValues alibi;    // slopes: s(i, j) -= slope(b, h) * |i + offset - j|
  HeadValues sinks;    // logits joining each row's softmax denominator
  ScorePlanes bias;    // additive, in the accumulation type
  ScorePlanes mask;    // bytes, nonzero = may attend
  // Segment ids (int64): row i may attend kv j iff query_segments' (i) ==
  // kv_segments' (j); the query side has col_stride 0, the kv side
  // row_stride 0 (both on or both off).
  ScorePlanes query_segments, kv_segments;
  // Backward outputs: d(sink) per (b, h) ([batch, heads] dense, float64),
  // and d(bias) laid out as `bias` (its offsets and strides, accumulation
  // type), zeroed by the caller; dbias_shared: some of its elements receive
  // several (b, h, i, j), which kernels then add atomically.
  double* dsinks = nullptr;
  void* dbias = nullptr;
  bool dbias_shared = false;
  RelPosParams rel_pos;

  DIMATTN_HD bool capped() const { return softcap > 0; }
  // d(bias) of plane bh, nullptr when not asked for.
  template <class F>
  DIMATTN_HD F* dbias_plane(int64_t bh) const {
    return dbias ? static_cast<F*>(dbias) + bias.offsets[bh] : nullptr;
  }
};

DIMATTN_HD float tanh_of(float x) { return ::tanhf(x); }
DIMATTN_HD double tanh_of(double x) { return ::tanh(x); }

// The score variants of one (b, h), in log2 units. F: the kernel's
// accumulation type (float, or double for float64).
template <class F>
struct ScoreMod {
  F cap = 0;    // softcap * log2(e); 0 = off
  F slope = 0;  // ALiBi slope * log2(e) of this (b, h); 0 = off
  int64_t offset = 0;
  const F* bias = nullptr;  // this (b, h)'s plane, natural units
  int64_t bias_row = 0, bias_col = 0;
  const uint8_t* mask = nullptr;  // this (b, h)'s plane
  int64_t mask_row = 0, mask_col = 0;
  const int64_t* qseg = nullptr;   // this (b, h)'s query segment ids (row i at i * qseg_row)
  const int64_t* kvseg = nullptr;  // and kv segment ids (kv j at j * kvseg_col); both or neither
  int64_t qseg_row = 0, kvseg_col = 0;

  DIMATTN_HD bool on() const {
    return cap > 0 || slope != 0 || bias != nullptr || mask != nullptr || qseg != nullptr;
  }
  // Whether segments allow (i, j). pre: qseg set.
  DIMATTN_HD bool same_segment(int64_t i, int64_t j) const { return qseg[i * qseg_row] == kvseg[j * kvseg_col]; }
  // Whether the bool mask and segments allow (i, j). pre: (i, j) is inside the call.
  DIMATTN_HD bool permits(int64_t i, int64_t j) const {
    return (mask == nullptr || mask[i * mask_row + j * mask_col] != 0) && (qseg == nullptr || same_segment(i, j));
  }
  // Without segments: where a kernel bounds each row by its segment's kv run instead.
  DIMATTN_HD ScoreMod without_segments() const {
    ScoreMod m = *this;
    m.qseg = m.kvseg = nullptr;
    return m;
  }
  // Without the bool mask and segments: the class of a block they allow entirely.
  DIMATTN_HD ScoreMod unmasked() const {
    ScoreMod m = without_segments();
    m.mask = nullptr;
    return m;
  }
  DIMATTN_HD bool capped() const { return cap > 0; }
  // The modified score of raw x at (i, j), -inf where the mask forbids it;
  // the CPU kernel applies the same steps in the same order a vector of
  // columns at a time (cpu/flash_impl/score_mods.h, with its own vtanh2);
  // t receives tanh(x / cap) (for the backward pass: dcapped(t)), 0 without
  // soft-capping. pre: (i, j) is inside the call (the bias and mask are read
  // there).
  DIMATTN_HD F apply(F x, int64_t i, int64_t j, F& t) const {
    t = 0;
    if (cap > 0) {
      t = tanh_of(x / cap);
      x = cap * t;
    }
    if (bias != nullptr) x += static_cast<F>(kScoreLog2e) * bias[i * bias_row + j * bias_col];
    if (slope != 0) {
      const int64_t d = i + offset - j;
      x -= slope * static_cast<F>(d < 0 ? -d : d);
    }
    if (!permits(i, j)) x = -static_cast<F>(INFINITY);
    return x;
  }
  // d(capped score) / d(raw score) at an element whose apply() gave t:
  // 1 - t^2 (1 without soft-capping, where t = 0). The backward passes
  // multiply dS by it.
  DIMATTN_HD F dcapped(F t) const { return F(1) - t * t; }
};

// The score variants of (b, h) of a call with `heads` query heads, whose
// batch entry's mask is m (its causal offset is ALiBi's diagonal).
template <class F>
DIMATTN_HD ScoreMod<F> score_mod_of(const ScoreParams& s, const EntryMask& m, int64_t b, int64_t h, int64_t heads) {
  ScoreMod<F> mod;
  mod.cap = static_cast<F>(s.softcap * kScoreLog2e);
  if (s.alibi.on()) mod.slope = static_cast<F>(s.alibi.at(b, h) * kScoreLog2e);
  mod.offset = m.offset;
  const int64_t bh = b * heads + h;
  if (s.bias.on()) mod.bias = s.bias.plane<F>(bh), mod.bias_row = s.bias.row_stride, mod.bias_col = s.bias.col_stride;
  if (s.mask.on())
    mod.mask = s.mask.plane<uint8_t>(bh), mod.mask_row = s.mask.row_stride, mod.mask_col = s.mask.col_stride;
  if (s.query_segments.on()) {
    mod.qseg = s.query_segments.plane<int64_t>(bh), mod.qseg_row = s.query_segments.row_stride;
    mod.kvseg = s.kv_segments.plane<int64_t>(bh), mod.kvseg_col = s.kv_segments.col_stride;
  }
  return mod;
}

// The sink logit of (b, h) in log2 units, or -inf without sinks.
template <class F>
DIMATTN_HD F sink_log2_of(const ScoreParams& s, int64_t b, int64_t h) {
  return s.sinks.on() ? static_cast<F>(s.sinks.at(b, h) * kScoreLog2e) : -static_cast<F>(INFINITY);
}

// ---------------------------------------------------------------------------
// Dropout: the keep rule and its keying.

inline constexpr uint64_t kBroadcastSalt = 0xB40ADCA57D0F0F0Full;

// The counters of one attention row: the random words of kv positions
// 4 g .. 4 g + 3 are philox4x32_10({g, c1, c2, c3}, key), lane k % 4 being
// position k's. Kernels that draw many positions at once start from this.
struct DropoutStream {
  uint64_t key;
  uint32_t c1, c2, c3;
  DIMATTN_HD Philox4 words(uint32_t k) const { return philox4x32_10(Philox4{{k >> 2, c1, c2, c3}}, key); }
};

// Row (bh, q) under per-element dropout.
DIMATTN_HD DropoutStream dropout_stream(uint64_t seed, uint32_t offset, uint32_t bh, uint32_t q) {
  return {seed, q, bh, offset};
}

// Every row under broadcast dropout (shared by every batch entry, head and
// query position).
DIMATTN_HD DropoutStream dropout_stream_broadcast(uint64_t seed, uint32_t offset) {
  return {seed ^ kBroadcastSalt, 0, 0, offset};
}

// The random words of kv positions 4 * (k / 4) .. + 3 of attention row
// (bh, q): lane k % 4 is position k's. One call serves four positions.
DIMATTN_HD Philox4 dropout_words(uint64_t seed, uint32_t offset, uint32_t bh, uint32_t q, uint32_t k) {
  return dropout_stream(seed, offset, bh, q).words(k);
}

// The same under broadcast dropout.
DIMATTN_HD Philox4 dropout_words_broadcast(uint64_t seed, uint32_t offset, uint32_t k) {
  return dropout_stream_broadcast(seed, offset).words(k);
}

// Uniform number of attention element (bh, q, k).
DIMATTN_HD float dropout_uniform(uint64_t seed, uint32_t offset, uint32_t bh, uint32_t q, uint32_t k) {
  return uniform_from_bits(dropout_words(seed, offset, bh, q, k).v[k & 3]);
}

// Uniform number of kv position k under broadcast dropout.
DIMATTN_HD float dropout_uniform_broadcast(uint64_t seed, uint32_t offset, uint32_t k) {
  return uniform_from_bits(dropout_words_broadcast(seed, offset, k).v[k & 3]);
}

// The keep rule as kernels apply it to raw Philox words: the uniform is
// (bits >> 8) / 2^24, so "uniform >= p" is exactly "(bits >> 8) >=
// ceil(p * 2^24)" (p * 2^24 is exact in double).
struct DropoutRule {
  uint32_t threshold = 0;   // keep iff (bits >> 8) >= threshold
  double keep_scale = 1.0;  // what a kept weight is multiplied by

  DIMATTN_HD bool keeps(uint32_t bits) const { return (bits >> 8) >= threshold; }
};

// pre: 0 <= p <= 1.
inline DropoutRule dropout_rule(double p) {
  DropoutRule r;
  r.threshold = p >= 1 ? (1u << 24) : static_cast<uint32_t>(std::ceil(p * 16777216.0));
  r.keep_scale = p >= 1 ? 0.0 : 1.0 / (1.0 - p);
  return r;
}

}  // namespace dimattn::kernels
