#pragma once
// One attention case at kernel level, for every kernel test: cpu_flash's
// (tests/kernels/cpu_flash_*.cpp) and cuda_flash's on a GPU and in the host
// emulation (tests/kernels/cuda_flash_cases.cpp). A case is data (Case:
// shapes, lengths, layout, dropout, the variants); it builds its operands
// (make_inputs: values exactly representable in its dtype; prepare: buffers
// in its layout, NaN where nothing is written, and the AttentionKernelParams
// over them), names its tolerance (fwd_tol, bwd_tol; the 16-bit CUDA check
// derives per-element bounds from the oracle's magnitudes instead), and has
// one float64 oracle (oracle: the contract of common/attention_params.h as
// loops, forward and analytic backward). Needs only the kernel sources.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "common/attention_mask.h"
#include "common/attention_params.h"
#include "common/philox.h"
#include "dimattn/tolerance.h"
#include "support/bf16_bits.h"

namespace dimattn::kernels::test {

constexpr double kInf = std::numeric_limits<double>::infinity();

// ---------------------------------------------------------------------------
// Elements of a dtype in a byte buffer.

inline size_t elem_size(ElementType t) { return t == ElementType::float64 ? 8 : t == ElementType::float32 ? 4 : 2; }

// The value a double has once stored in the dtype.
inline double representable(ElementType t, double x) {
  switch (t) {
    case ElementType::float64: return x;
    case ElementType::float32: return static_cast<float>(x);
    case ElementType::bfloat16: return bf16_value(bf16_round(static_cast<float>(x)));
    case ElementType::float16: return f16_value(f16_round(static_cast<float>(x)));
  }
  return x;
}

struct Buffer {
  ElementType dtype;
  std::vector<unsigned char> bytes;
  Buffer(ElementType t, int64_t n) : dtype(t), bytes(static_cast<size_t>(n) * elem_size(t)) {
    // NaN everywhere: an element the kernel should have written and did not shows up.
    for (int64_t i = 0; i < n; ++i) set(i, std::numeric_limits<double>::quiet_NaN());
  }
  void* data() { return bytes.data(); }
  void set(int64_t i, double x) {
    unsigned char* p = bytes.data() + i * elem_size(dtype);
    if (dtype == ElementType::float64) {
      std::memcpy(p, &x, 8);
    } else if (dtype == ElementType::float32) {
      const float f = static_cast<float>(x);
      std::memcpy(p, &f, 4);
    } else if (dtype == ElementType::float16) {
      const uint16_t h = std::isnan(x) ? uint16_t{0x7e00} : f16_round(static_cast<float>(x));
      std::memcpy(p, &h, 2);
    } else {
      const uint16_t h = std::isnan(x) ? uint16_t{0x7fc0} : bf16_round(static_cast<float>(x));
      std::memcpy(p, &h, 2);
    }
  }
  double get(int64_t i) const {
    const unsigned char* p = bytes.data() + i * elem_size(dtype);
    if (dtype == ElementType::float64) {
      double d;
      std::memcpy(&d, p, 8);
      return d;
    }
    if (dtype == ElementType::float32) {
      float f;
      std::memcpy(&f, p, 4);
      return f;
    }
    uint16_t h;
    std::memcpy(&h, p, 2);
    return dtype == ElementType::float16 ? f16_value(h) : bf16_value(h);
  }
};

// A 4-d view [n0, n1, n2, n3] into a buffer.
struct View {
  Buffer* buf = nullptr;
  int64_t base = 0;
  ElementStrides st;
  int64_t at(int64_t a, int64_t b, int64_t c, int64_t d) const {
    return base + a * st.batch + b * st.head + c * st.row + d * st.last;
  }
  void* ptr() const { return buf->bytes.data() + base * elem_size(buf->dtype); }
};

// Logical [n0][n1][n2][n3] float64 array.
struct Array4 {
  int64_t n[4] = {0, 0, 0, 0};
  std::vector<double> v;
  Array4() = default;
  Array4(int64_t a, int64_t b, int64_t c, int64_t d, double fillv = 0.0)
      : n{a, b, c, d}, v(static_cast<size_t>(a * b * c * d), fillv) {}
  double& operator()(int64_t a, int64_t b, int64_t c, int64_t d) { return v[((a * n[1] + b) * n[2] + c) * n[3] + d]; }
  double operator()(int64_t a, int64_t b, int64_t c, int64_t d) const {
    return v[((a * n[1] + b) * n[2] + c) * n[3] + d];
  }
};

// ---------------------------------------------------------------------------
// A test case, written as data.

enum class Layout {
  contiguous,  // [B, H, T, D]
  bthd,        // [B, T, H, D]: permuted view
  padded,      // [B, H, T, D + 3] with a gap between heads: rows not dense
  packed,      // q, k, v as views into one [T, B, H + 2 Hkv, D] buffer (zero-copy; Tq = Tk, D = Dv)
};

struct Case {
  std::string name;
  int64_t B = 1, H = 1, Hkv = 1, Tq = 1, Tk = 1, D = 4, Dv = 4;
  bool causal = false;
  std::vector<int64_t> offsets;  // per batch entry; empty = nullptr
  std::vector<int64_t> kv_lens;  // empty = full
  std::vector<int64_t> q_lens;   // empty = full
  // Per-row kv lengths (AttentionKernelParams::kv_row_lengths): row i of
  // (b, h) has row_lens[row_offsets[b * H + h] + i * row_stride]; empty =
  // each row its entry's. kv_lens then holds each entry's maximum (with_row_lengths).
  std::vector<int64_t> row_lens, row_offsets;
  int64_t row_stride = 1;
  double p = 0.0;
  bool broadcast = false;
  ElementType dtype = ElementType::float32;
  Layout layout = Layout::contiguous;
  double scale = 0.0;  // 0 = 1 / sqrt(D)
  uint64_t seed = 1234;
  uint32_t rng_offset = 7;
  // The call as a block of a longer sequence (context parallelism): dropout
  // keys row q_position + i and kv position kv_position + j.
  int64_t q_position = 0, kv_position = 0;
  bool zero_queries = false;  // q = 0: every allowed weight equal (dropout's float16 overflow case)
  // --- the variants (ScoreParams, RowBounds), as data: the with_* helpers below fill them.
  int64_t window_left = -1, window_right = -1;  // RowBounds; < 0 = unbounded
  double softcap = 0;                           // 0 = none
  std::vector<double> alibi_slopes;             // per head, shared by the batch; empty = none
  std::vector<double> sinks;                    // per head, shared by the batch; empty = none
  // A bias: planes of [Tq][Tk], (b, h) reading plane bias_plane[b * H + h],
  // given to the kernels in the accumulation type (values float32 holds); empty = none.
  std::vector<double> bias;
  std::vector<int64_t> bias_plane;
  // A bool mask (ScoreParams::mask): planes of [Tq][Tk] bytes, (b, h) reading
  // plane mask_plane[b * H + h]; empty = none.
  std::vector<uint8_t> mask;
  std::vector<int64_t> mask_plane;
  // Segment ids (ScoreParams::query_segments, kv_segments) per batch entry,
  // shared by its heads: [B][Tq] and [B][Tk]; empty = none.
  std::vector<int64_t> qseg, kseg;
  // A paged kv cache (AttentionKernelParams::pages) when page_size > 0: k and
  // v live in pools of blocks of page_size positions, [blocks, page_size,
  // Hkv, D] or (heads_outer) [blocks, Hkv, page_size, D], reached through a
  // shuffled block table with a spare column (entries past each sequence's
  // blocks -1). Blocks and positions no sequence uses hold NaN, so reading
  // them shows. Entries b >= 1 share entry 0's blocks for their first
  // shared_prefix positions (a multiple of page_size; make_inputs makes
  // their k and v equal there). Forward only.
  int64_t page_size = 0;
  bool heads_outer = false;
  int64_t shared_prefix = 0;

  double scale_value() const { return scale != 0 ? scale : 1.0 / std::sqrt(static_cast<double>(D)); }
  // Whether the mask and the segments let row i of (b, h) attend kv position j.
  bool mask_allows(int64_t b, int64_t h, int64_t i, int64_t j) const {
    return (mask.empty() || mask[static_cast<size_t>((mask_plane[b * H + h] * Tq + i) * Tk + j)] != 0) &&
           (qseg.empty() || qseg[static_cast<size_t>(b * Tq + i)] == kseg[static_cast<size_t>(b * Tk + j)]);
  }
  // Whether row i of (b, h) attends kv position j: the lengths, causality
  // with the entry's offset, the window, the mask and the segments.
  bool allowed(int64_t b, int64_t h, int64_t i, int64_t j) const {
    const int64_t q_len = q_lens.empty() ? Tq : q_lens[b];
    if (i >= q_len) return false;
    const int64_t kv_len = !row_lens.empty() ? row_lens[row_offsets[b * H + h] + i * row_stride]
                           : kv_lens.empty() ? Tk
                                             : kv_lens[b];
    const int64_t diag = i + (offsets.empty() ? 0 : offsets[b]);
    return j < kv_len && (!causal || j <= diag) && (window_left < 0 || j >= diag - window_left) &&
           (window_right < 0 || j <= diag + window_right) && mask_allows(b, h, i, j);
  }
  // Dropout's multiplier of element (b, h, i, j): 0 or 1 / (1 - p).
  double keep_scale(int64_t b, int64_t h, int64_t i, int64_t j) const {
    if (p <= 0) return 1.0;
    const auto qi = static_cast<uint32_t>(q_position + i), kj = static_cast<uint32_t>(kv_position + j);
    const float u = broadcast ? dropout_uniform_broadcast(seed, rng_offset, kj)
                              : dropout_uniform(seed, rng_offset, static_cast<uint32_t>(b * H + h), qi, kj);
    return u >= p ? dropout_rule(p).keep_scale : 0.0;
  }
};

// The frontend's name of a kernel element type.
inline DType dtype_of(ElementType t) {
  switch (t) {
    case ElementType::float64: return DType::float64;
    case ElementType::float32: return DType::float32;
    case ElementType::bfloat16: return DType::bfloat16;
    case ElementType::float16: return DType::float16;
  }
  return DType::float32;
}

// The one table of how far a fused kernel may be from the reference
// (dimattn/tolerance.h, docs/numerics.md); gradients get twice this.
inline double fwd_tol(ElementType t) { return reference_tolerance(dtype_of(t)); }
inline double bwd_tol(ElementType t) { return 2 * fwd_tol(t); }

// ---------------------------------------------------------------------------
// Variants and masks as data (each draws from the case's seed).

// ALiBi with the standard slopes 2^(-8 (h + 1) / H), shared by the batch.
inline void with_alibi(Case& c) {
  c.alibi_slopes.resize(static_cast<size_t>(c.H));
  for (int64_t h = 0; h < c.H; ++h) c.alibi_slopes[h] = std::exp2(-8.0 * static_cast<double>(h + 1) / c.H);
}

// A unit-normal sink logit per head, shared by the batch.
inline void with_sinks(Case& c) {
  std::mt19937_64 rng(c.seed + 11);
  std::normal_distribution<double> normal;
  c.sinks.resize(static_cast<size_t>(c.H));
  for (double& s : c.sinks) s = normal(rng);
}

// A unit-normal bias plane per head, shared by the batch (so that d(bias)
// sums over it: dbias_shared).
inline void with_bias(Case& c) {
  std::mt19937_64 rng(c.seed + 13);
  std::normal_distribution<float> normal;
  c.bias.resize(static_cast<size_t>(c.H * c.Tq * c.Tk));
  for (double& x : c.bias) x = normal(rng);
  c.bias_plane.clear();
  for (int64_t x = 0; x < c.B * c.H; ++x) c.bias_plane.push_back(x % c.H);
}

// A mask plane per batch entry, shared by its heads: true with probability
// 3/4, and every 7th row of entry 0 all false (rows that attend nothing).
inline void with_random_mask(Case& c) {
  std::mt19937_64 rng(c.seed + 17);
  std::uniform_real_distribution<double> uniform;
  c.mask.resize(static_cast<size_t>(c.B * c.Tq * c.Tk));
  for (uint8_t& x : c.mask) x = uniform(rng) >= 0.25;
  for (int64_t i = 3; i < c.Tq; i += 7) std::fill_n(c.mask.begin() + i * c.Tk, c.Tk, uint8_t{0});
  c.mask_plane.clear();
  for (int64_t x = 0; x < c.B * c.H; ++x) c.mask_plane.push_back(x / c.H);
}

// Documents of n positions as a mask per batch entry (shifted by 13 b):
// (i, j) allowed iff (i + 13 b) / n == (j + 13 b) / n, so that the kernels'
// blocks of it forbid everything, allow everything or some.
inline void with_document_mask(Case& c, int64_t n) {
  c.mask.resize(static_cast<size_t>(c.B * c.Tq * c.Tk));
  for (int64_t b = 0; b < c.B; ++b)
    for (int64_t i = 0; i < c.Tq; ++i)
      for (int64_t j = 0; j < c.Tk; ++j) c.mask[(b * c.Tq + i) * c.Tk + j] = (i + 13 * b) / n == (j + 13 * b) / n;
  c.mask_plane.clear();
  for (int64_t x = 0; x < c.B * c.H; ++x) c.mask_plane.push_back(x / c.H);
}

// Segment ids per batch entry: documents of irregular lengths (document d of
// entry b has 20 + (37 d + 29 b) % 40 positions), or with `packed` packed
// sequences of those lengths in turn on both sides, where every fifth (d % 5
// == 2) has no kv positions (its rows attend nothing).
inline void with_segments(Case& c, const std::vector<int64_t>& packed = {}) {
  auto doc_len = [&](int64_t d, int64_t b, bool kv) {
    if (packed.empty()) return 20 + (37 * d + 29 * b) % 40;
    return kv && d % 5 == 2 ? int64_t{0} : packed[static_cast<size_t>(d) % packed.size()];
  };
  c.qseg.clear();
  c.kseg.clear();
  for (int64_t b = 0; b < c.B; ++b)
    for (auto [ids, T, kv] : {std::tuple{&c.qseg, c.Tq, false}, std::tuple{&c.kseg, c.Tk, true}})
      for (int64_t d = 0, x = 0; x < T; ++d)
        for (int64_t y = 0; y < doc_len(d, b, kv) && x < T; ++y, ++x) ids->push_back(d);
}

// Per-row kv lengths drawn in [0, kv length] (about one row in six 0, one in
// six the full length): per (b, h) row when per_row, else one per (b, h)
// plane (row stride 0); every head's plane its own, or (shared_heads) one per
// batch entry that the heads' offsets repeat. Bounded by the case's kv_lens
// where it has them; kv_lens become the entries' maxima.
inline void with_row_lengths(Case& c, bool per_row, bool shared_heads = false) {
  std::mt19937_64 rng(c.seed + 77);
  const int64_t planes = shared_heads ? c.B : c.B * c.H, rows = per_row ? c.Tq : 1;
  c.row_lens.assign(static_cast<size_t>(planes * rows), 0);
  for (size_t x = 0; x < c.row_lens.size(); ++x) {
    const int64_t b = static_cast<int64_t>(x) / rows / (shared_heads ? 1 : c.H);
    const int64_t most = c.kv_lens.empty() ? c.Tk : c.kv_lens[b];
    const int64_t r = static_cast<int64_t>(rng() % 6);
    c.row_lens[x] = r == 0 ? 0 : r == 1 ? most : static_cast<int64_t>(rng() % static_cast<uint64_t>(most + 1));
  }
  c.row_stride = per_row ? 1 : 0;
  c.row_offsets.clear();
  for (int64_t b = 0; b < c.B; ++b)
    for (int64_t h = 0; h < c.H; ++h) c.row_offsets.push_back((shared_heads ? b : b * c.H + h) * rows);
  c.kv_lens.assign(static_cast<size_t>(c.B), 0);
  for (int64_t b = 0; b < c.B; ++b)
    for (int64_t h = 0; h < c.H; ++h)
      for (int64_t i = 0; i < rows; ++i)
        c.kv_lens[b] = std::max(c.kv_lens[b], c.row_lens[c.row_offsets[b * c.H + h] + i * c.row_stride]);
}

inline Case base(const std::string& name, ElementType t = ElementType::float32) {
  Case c;
  c.name = name;
  c.dtype = t;
  return c;
}

constexpr ElementType kAllTypes[] = {ElementType::float32, ElementType::float64, ElementType::bfloat16,
                                     ElementType::float16};

// ---------------------------------------------------------------------------
// Operands.

struct Inputs {
  Array4 q, k, v, dout;  // exactly representable in the case's dtype
};

inline Inputs make_inputs(const Case& c) {
  std::mt19937_64 rng(c.seed * 7919 + static_cast<uint64_t>(c.Tq * 131 + c.Tk));
  std::normal_distribution<double> normal(0.0, 1.0);
  Inputs in;
  auto fill = [&](Array4& a, int64_t n0, int64_t n1, int64_t n2, int64_t n3, bool zero = false) {
    a = Array4(n0, n1, n2, n3);
    for (double& x : a.v) x = zero ? 0.0 : representable(c.dtype, normal(rng));
  };
  fill(in.q, c.B, c.H, c.Tq, c.D, c.zero_queries);
  fill(in.k, c.B, c.Hkv, c.Tk, c.D);
  fill(in.v, c.B, c.Hkv, c.Tk, c.Dv);
  fill(in.dout, c.B, c.H, c.Tq, c.Dv);
  for (int64_t b = 1; b < c.B; ++b)  // shared prefix blocks: the same keys and values
    for (int64_t h = 0; h < c.Hkv; ++h)
      for (int64_t j = 0; j < c.shared_prefix; ++j) {
        for (int64_t d = 0; d < c.D; ++d) in.k(b, h, j, d) = in.k(0, h, j, d);
        for (int64_t e = 0; e < c.Dv; ++e) in.v(b, h, j, e) = in.v(0, h, j, e);
      }
  return in;
}

// ---------------------------------------------------------------------------
// The float64 oracle: the contract of attention_params.h written as loops.
// Row i of (b, h): scores s_j = scale q_i . k_j, soft-capped, plus the bias,
// minus ALiBi's slope * |i + offset - j|, over the allowed j; softmax with the
// sink's logit in the denominator; dropout; P Z V. Backward: dP = (dO v_j) Z,
// D_i = dO . out_i, dS = P (dP - D_i) cap', the gradients from dS; d(sink) =
// -P(sink) D_i; d(bias) = P (dP - D_i) summed over the (b, h) of its plane.

struct Oracle {
  Array4 out, lse, dq, dk, dv;  // lse as [B, H, Tq, 1]; -inf where a row attends nothing
  // For the 16-bit kernels' error bounds: per element, the sum of the
  // magnitudes of the terms they round to 16 bits before summing them (m_*)
  // and of the factors such terms are multiplied by (a_*: float16 subnormals).
  Array4 m_out, m_dq, m_dk, m_dv, a_out, a_dq, a_dk, a_dv;
  std::vector<double> dsinks, m_dsinks;  // [B * H]
  std::vector<double> dbias, m_dbias;    // as Case::bias
  int64_t kept_overflowing = 0;          // kept exp(s - max) / (1 - p) above float16's max
};

inline Oracle oracle(const Case& c, const Inputs& in) {
  const int64_t B = c.B, H = c.H, G = c.H / c.Hkv, Tq = c.Tq, Tk = c.Tk, D = c.D, Dv = c.Dv;
  Oracle o;
  o.out = o.m_out = o.a_out = Array4(B, H, Tq, Dv);
  o.dq = o.m_dq = o.a_dq = Array4(B, H, Tq, D);
  o.dk = o.m_dk = o.a_dk = Array4(B, c.Hkv, Tk, D);
  o.dv = o.m_dv = o.a_dv = Array4(B, c.Hkv, Tk, Dv);
  o.lse = Array4(B, H, Tq, 1, -kInf);
  o.dsinks.assign(static_cast<size_t>(B * H), 0);
  o.m_dsinks = o.dsinks;
  o.dbias.assign(c.bias.size(), 0);
  o.m_dbias = o.dbias;
  const double scale = c.scale_value();
  std::vector<double> s(Tk), P(Tk), Z(Tk), cap(Tk), dP(Tk);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      const int64_t hk = h / G, bh = b * H + h, off = c.offsets.empty() ? 0 : c.offsets[b];
      const double sink = c.sinks.empty() ? -kInf : c.sinks[h];
      const int64_t bias_at = c.bias.empty() ? 0 : c.bias_plane[bh] * Tq * Tk;
      const int64_t q_len = c.q_lens.empty() ? Tq : c.q_lens[b];
      for (int64_t i = 0; i < q_len; ++i) {  // padding rows: out, dq 0, lse -inf, no sink
        double mx = sink;
        bool any = false;
        for (int64_t j = 0; j < Tk; ++j) {
          s[j] = -kInf;
          cap[j] = 1;
          if (!c.allowed(b, h, i, j)) continue;
          double dot = 0;
          for (int64_t d = 0; d < D; ++d) dot += in.q(b, h, i, d) * in.k(b, hk, j, d);
          s[j] = scale * dot;
          if (c.softcap > 0) {
            const double t = std::tanh(s[j] / c.softcap);
            s[j] = c.softcap * t;
            cap[j] = 1 - t * t;
          }
          if (!c.bias.empty()) s[j] += c.bias[bias_at + i * Tk + j];
          if (!c.alibi_slopes.empty()) s[j] -= c.alibi_slopes[h] * std::abs(static_cast<double>(i + off - j));
          mx = std::max(mx, s[j]);
          any = true;
        }
        if (!any && c.sinks.empty()) continue;  // nothing attended: out 0, lse -inf, no gradient
        double l = c.sinks.empty() ? 0 : std::exp(sink - mx);
        for (int64_t j = 0; j < Tk; ++j) l += s[j] == -kInf ? 0 : std::exp(s[j] - mx);
        const double lse = mx + std::log(l);
        o.lse(b, h, i, 0) = lse;
        const double p_sink = c.sinks.empty() ? 0 : std::exp(sink - lse);
        for (int64_t j = 0; j < Tk; ++j) {
          P[j] = s[j] == -kInf ? 0 : std::exp(s[j] - mx) / l;
          Z[j] = s[j] == -kInf ? 0 : c.keep_scale(b, h, i, j);
          // The kernels' weights before normalisation are exp(s - max).
          if (c.p > 0 && s[j] != -kInf && std::exp(s[j] - mx) * Z[j] > 65504) ++o.kept_overflowing;
        }
        for (int64_t j = 0; j < Tk; ++j)
          for (int64_t e = 0; e < Dv; ++e) {
            const double vj = in.v(b, hk, j, e);
            o.out(b, h, i, e) += P[j] * Z[j] * vj;
            o.m_out(b, h, i, e) += std::abs(P[j] * Z[j] * vj);
            o.a_out(b, h, i, e) += Z[j] * std::abs(vj);
          }
        // E_i bounds what rounding out to 16 bits does to D_i (in units of u).
        double Di = 0, Ei = 0;
        for (int64_t e = 0; e < Dv; ++e) {
          Di += in.dout(b, h, i, e) * o.out(b, h, i, e);
          Ei += std::abs(in.dout(b, h, i, e) * o.out(b, h, i, e));
        }
        for (int64_t j = 0; j < Tk; ++j) {
          if (s[j] == -kInf) continue;
          double dx = 0;
          for (int64_t e = 0; e < Dv; ++e) dx += in.dout(b, h, i, e) * in.v(b, hk, j, e);
          dP[j] = dx * Z[j];
          const double dS = P[j] * (dP[j] - Di) * cap[j], mS = (std::abs(dS) + P[j] * Ei) * cap[j];
          if (!c.bias.empty()) {  // d(bias): before the cap's derivative, summed over the plane's (b, h)
            o.dbias[bias_at + i * Tk + j] += P[j] * (dP[j] - Di);
            o.m_dbias[bias_at + i * Tk + j] += std::abs(P[j] * (dP[j] - Di)) + P[j] * Ei;
          }
          for (int64_t e = 0; e < Dv; ++e) {
            const double g = in.dout(b, h, i, e);
            o.dv(b, hk, j, e) += P[j] * Z[j] * g;
            o.m_dv(b, hk, j, e) += std::abs(P[j] * Z[j] * g);
            o.a_dv(b, hk, j, e) += Z[j] * std::abs(g);
          }
          for (int64_t d = 0; d < D; ++d) {
            const double qi = in.q(b, h, i, d), kj = in.k(b, hk, j, d);
            o.dk(b, hk, j, d) += scale * dS * qi;
            o.m_dk(b, hk, j, d) += scale * mS * std::abs(qi);
            o.a_dk(b, hk, j, d) += scale * std::abs(qi);
            o.dq(b, h, i, d) += scale * dS * kj;
            o.m_dq(b, h, i, d) += scale * mS * std::abs(kj);
            o.a_dq(b, h, i, d) += scale * std::abs(kj);
          }
        }
        o.dsinks[bh] -= p_sink * Di;
        o.m_dsinks[bh] += p_sink * (std::abs(Di) + Ei);
      }
    }
  return o;
}

// ---------------------------------------------------------------------------
// The case's operands in memory, and the kernel parameters over them.

struct KernelRun {
  std::vector<Buffer> buffers;  // owns every tensor
  View q, k, v, out, dout, dq, dk, dv;
  std::vector<unsigned char> lse;  // [B, H, Tq] in the accumulation type
  std::vector<int64_t> mask_offsets, bias_offsets, qseg_offsets, kseg_offsets;
  std::vector<double> dsinks;  // [B * H], with sinks
  // The bias and d(bias) (zeros: the kernels add to it) in the accumulation
  // type: float64 for float64 cases, else float32.
  std::vector<float> bias32, dbias32;
  std::vector<double> bias64, dbias64;
  double dbias(size_t x) const { return dbias64.empty() ? dbias32[x] : dbias64[x]; }
  size_t dbias_bytes() const { return dbias32.size() * sizeof(float) + dbias64.size() * sizeof(double); }
  std::vector<int32_t> block_table;  // Case::page_size > 0
  AttentionKernelParams p;
};

// k and v of the case as paged pools (Case::page_size): r's buffers gain the
// two pools, p.k, p.v, their strides and p.pages point at them.
inline void page_kv(const Case& c, const Inputs& in, KernelRun& r) {
  const int64_t ps = c.page_size, cap = (c.Tk + ps - 1) / ps + 1, shared = c.shared_prefix / ps;
  std::vector<int64_t> lens(static_cast<size_t>(c.B), c.Tk);
  if (!c.kv_lens.empty()) lens = c.kv_lens;
  // Logical blocks in order of first use, then shuffled onto physical ones.
  r.block_table.assign(static_cast<size_t>(c.B * cap), -1);
  int64_t used = 0;
  for (int64_t b = 0; b < c.B; ++b)
    for (int64_t t = 0; t < (lens[b] + ps - 1) / ps; ++t)
      r.block_table[b * cap + t] = b > 0 && t < shared ? r.block_table[t] : static_cast<int32_t>(used++);
  const int64_t blocks = used + 3;  // spare blocks nobody reads
  std::vector<int32_t> perm(static_cast<size_t>(blocks));
  for (int64_t i = 0; i < blocks; ++i) perm[i] = static_cast<int32_t>(i);
  std::shuffle(perm.begin(), perm.end(), std::mt19937_64(c.seed + 5));
  for (int32_t& e : r.block_table)
    if (e >= 0) e = perm[e];
  auto pool = [&](const Array4& a, int64_t Dm, int64_t& block_stride) {
    const ElementStrides st = c.heads_outer ? ElementStrides{0, ps * Dm, Dm, 1} : ElementStrides{0, Dm, c.Hkv * Dm, 1};
    block_stride = ps * c.Hkv * Dm;
    r.buffers.emplace_back(c.dtype, blocks * block_stride);
    Buffer& buf = r.buffers.back();
    for (int64_t b = 0; b < c.B; ++b)
      for (int64_t h = 0; h < c.Hkv; ++h)
        for (int64_t j = 0; j < lens[b]; ++j)
          for (int64_t d = 0; d < Dm; ++d)
            buf.set(r.block_table[b * cap + j / ps] * block_stride + h * st.head + j % ps * st.row + d, a(b, h, j, d));
    return st;
  };
  KvPages& pg = r.p.pages;
  r.p.k_strides = pool(in.k, c.D, pg.k_block_stride);
  r.p.v_strides = pool(in.v, c.Dv, pg.v_block_stride);
  r.p.k = r.buffers[r.buffers.size() - 2].data();
  r.p.v = r.buffers.back().data();
  pg.block_table = r.block_table.data();
  pg.table_stride = cap;
  pg.block_size = ps;
  pg.num_blocks = blocks;
}

// Views of q (or dq), k (dk), v (dv) for the case's layout, in fresh buffers.
inline void make_qkv(const Case& c, std::vector<Buffer>& bufs, View& q, View& k, View& v) {
  const ElementType t = c.dtype;
  auto dense = [&](View& view, int64_t n1, int64_t T, int64_t Dm) {
    bufs.emplace_back(t, c.B * n1 * (T * (Dm + 3) + 5));
    view.base = 0;
    switch (c.layout) {
      case Layout::bthd: view.st = {T * n1 * Dm, Dm, n1 * Dm, 1}; break;
      case Layout::padded: view.st = {n1 * (T * (Dm + 3) + 5), T * (Dm + 3) + 5, Dm + 3, 1}; break;
      default: view.st = {n1 * T * Dm, T * Dm, Dm, 1}; break;
    }
  };
  if (c.layout == Layout::packed) {
    // [T, B, H + 2 Hkv, D]: q heads, then k heads, then v heads.
    const int64_t heads = c.H + 2 * c.Hkv;
    bufs.emplace_back(t, c.Tq * c.B * heads * c.D);
    const ElementStrides st{heads * c.D, c.D, c.B * heads * c.D, 1};
    q = View{nullptr, 0, st};
    k = View{nullptr, c.H * c.D, st};
    v = View{nullptr, (c.H + c.Hkv) * c.D, st};
    return;
  }
  dense(q, c.H, c.Tq, c.D);
  dense(k, c.Hkv, c.Tk, c.D);
  dense(v, c.Hkv, c.Tk, c.Dv);
}

inline KernelRun prepare(const Case& c, const Inputs& in) {
  KernelRun r;
  r.buffers.reserve(18);
  const size_t first = r.buffers.size();
  make_qkv(c, r.buffers, r.q, r.k, r.v);
  // Point views at their buffers now that the vector no longer grows.
  auto bind = [&](size_t start, View& q, View& k, View& v) {
    if (c.layout == Layout::packed) {
      q.buf = k.buf = v.buf = &r.buffers[start];
    } else {
      q.buf = &r.buffers[start];
      k.buf = &r.buffers[start + 1];
      v.buf = &r.buffers[start + 2];
    }
  };
  bind(first, r.q, r.k, r.v);
  const size_t grads = r.buffers.size();
  make_qkv(c, r.buffers, r.dq, r.dk, r.dv);
  bind(grads, r.dq, r.dk, r.dv);
  // out and dout: [B, H, Tq, Dv], laid out like q (packed: [Tq, B, H, Dv]).
  const ElementType t = c.dtype;
  auto qlike = [&](View& view) {
    r.buffers.emplace_back(t, c.B * c.H * (c.Tq * (c.Dv + 3) + 5));
    view.buf = &r.buffers.back();
    switch (c.layout) {
      case Layout::bthd: view.st = {c.Tq * c.H * c.Dv, c.Dv, c.H * c.Dv, 1}; break;
      case Layout::padded: view.st = {c.H * (c.Tq * (c.Dv + 3) + 5), c.Tq * (c.Dv + 3) + 5, c.Dv + 3, 1}; break;
      case Layout::packed: view.st = {c.H * c.Dv, c.Dv, c.B * c.H * c.Dv, 1}; break;
      default: view.st = {c.H * c.Tq * c.Dv, c.Tq * c.Dv, c.Dv, 1}; break;
    }
  };
  qlike(r.out);
  qlike(r.dout);
  // qlike's emplace_back may have moved earlier buffers: rebind everything.
  bind(first, r.q, r.k, r.v);
  bind(grads, r.dq, r.dk, r.dv);
  r.out.buf = &r.buffers[r.buffers.size() - 2];
  r.dout.buf = &r.buffers[r.buffers.size() - 1];

  auto store = [](View& view, const Array4& a) {
    for (int64_t i0 = 0; i0 < a.n[0]; ++i0)
      for (int64_t i1 = 0; i1 < a.n[1]; ++i1)
        for (int64_t i2 = 0; i2 < a.n[2]; ++i2)
          for (int64_t i3 = 0; i3 < a.n[3]; ++i3) view.buf->set(view.at(i0, i1, i2, i3), a(i0, i1, i2, i3));
  };
  store(r.q, in.q);
  store(r.k, in.k);
  store(r.v, in.v);
  store(r.dout, in.dout);

  const size_t acc = c.dtype == ElementType::float64 ? 8 : 4;
  r.lse.assign(static_cast<size_t>(std::max<int64_t>(c.B * c.H * c.Tq, 1)) * acc, 0xff);  // NaN pattern

  AttentionKernelParams& p = r.p;
  p.dtype = c.dtype;
  p.q = r.q.ptr();
  p.k = r.k.ptr();
  p.v = r.v.ptr();
  p.out = r.out.ptr();
  p.lse = r.lse.data();
  p.dout = r.dout.ptr();
  p.dq = r.dq.ptr();
  p.dk = r.dk.ptr();
  p.dv = r.dv.ptr();
  p.batch = c.B;
  p.heads = c.H;
  p.kv_heads = c.Hkv;
  p.seqlen_q = c.Tq;
  p.seqlen_k = c.Tk;
  p.head_dim = c.D;
  p.head_dim_v = c.Dv;
  p.q_strides = r.q.st;
  p.k_strides = r.k.st;
  p.v_strides = r.v.st;
  p.out_strides = r.out.st;
  p.dout_strides = r.dout.st;
  p.dq_strides = r.dq.st;
  p.dk_strides = r.dk.st;
  p.dv_strides = r.dv.st;
  p.lse_head_stride = c.Tq;
  p.lse_batch_stride = c.H * c.Tq;
  p.q_lengths = c.q_lens.empty() ? nullptr : c.q_lens.data();
  p.kv_lengths = c.kv_lens.empty() ? nullptr : c.kv_lens.data();
  if (!c.row_lens.empty()) p.kv_row_lengths = {c.row_lens.data(), c.row_offsets.data(), c.row_stride, 0};
  p.causal = c.causal;
  p.causal_offset = c.offsets.empty() ? nullptr : c.offsets.data();
  p.scale = c.scale_value();
  p.dropout_p = c.p;
  p.dropout_broadcast = c.broadcast;
  p.seed = c.seed;
  p.rng_offset = c.rng_offset;
  p.dropout_q_position = c.q_position;
  p.dropout_kv_position = c.kv_position;
  p.bounds = {c.window_left, c.window_right};
  p.score.softcap = c.softcap;
  if (!c.alibi_slopes.empty()) p.score.alibi = {c.alibi_slopes.data(), 0, 1};
  if (!c.sinks.empty()) {
    r.dsinks.assign(static_cast<size_t>(c.B * c.H), std::numeric_limits<double>::quiet_NaN());
    p.score.sinks = {c.sinks.data(), 0, 1};
    p.score.dsinks = r.dsinks.data();
  }
  if (!c.bias.empty()) {
    for (int64_t plane : c.bias_plane) r.bias_offsets.push_back(plane * c.Tq * c.Tk);
    if (c.dtype == ElementType::float64) {
      r.bias64 = c.bias;
      r.dbias64.assign(c.bias.size(), 0.0);
      p.score.bias = {r.bias64.data(), r.bias_offsets.data(), c.Tk, 1};
      p.score.dbias = r.dbias64.data();
    } else {
      r.bias32.assign(c.bias.begin(), c.bias.end());
      r.dbias32.assign(c.bias.size(), 0.f);
      p.score.bias = {r.bias32.data(), r.bias_offsets.data(), c.Tk, 1};
      p.score.dbias = r.dbias32.data();
    }
    p.score.dbias_shared = static_cast<int64_t>(c.bias.size()) < c.B * c.H * c.Tq * c.Tk;
  }
  if (!c.mask.empty()) {
    for (int64_t plane : c.mask_plane) r.mask_offsets.push_back(plane * c.Tq * c.Tk);
    p.score.mask = {c.mask.data(), r.mask_offsets.data(), c.Tk, 1};
  }
  if (!c.qseg.empty()) {
    for (int64_t bh = 0; bh < c.B * c.H; ++bh) {
      r.qseg_offsets.push_back(bh / c.H * c.Tq);
      r.kseg_offsets.push_back(bh / c.H * c.Tk);
    }
    p.score.query_segments = {c.qseg.data(), r.qseg_offsets.data(), 1, 0};
    p.score.kv_segments = {c.kseg.data(), r.kseg_offsets.data(), 0, 1};
  }
  if (c.page_size > 0) page_kv(c, in, r);
  return r;
}

inline double lse_at(const KernelRun& r, const Case& c, int64_t i) {
  if (c.dtype == ElementType::float64) {
    double d;
    std::memcpy(&d, r.lse.data() + i * 8, 8);
    return d;
  }
  float f;
  std::memcpy(&f, r.lse.data() + i * 4, 4);
  return f;
}

}  // namespace dimattn::kernels::test
