#pragma once
// cpu_flash test cases as data (Case), their inputs, the naive float64
// reference (forward and analytic backward), running the kernel on a case
// (prepare, check_case) and comparing: shared by the kernel tests of
// tests/kernels/cpu_flash_*.cpp. Needs only the kernel sources.

#include <gtest/gtest.h>
#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>
#include "common/attention_mask.h"
#include "common/attention_params.h"
#include "common/philox.h"
#include "cpu/flash_attention.h"
#include "cpu/flash_attention_heuristics.h"
#include "cpu/thread_pool.h"
#include "bf16_bits.h"

namespace dimattn::kernels {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// ---------------------------------------------------------------------------
// Elements of a dtype in a byte buffer.

size_t elem_size(ElementType t) { return t == ElementType::float64 ? 8 : t == ElementType::float32 ? 4 : 2; }

using test::bf16_round;
using test::bf16_value;
using test::f16_round;
using test::f16_value;
// The value a double has once stored in the dtype.
double representable(ElementType t, double x) {
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
  packed,      // q, k, v as views into one [T, B, H + 2 Hkv, D] buffer (zero-copy)
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
  bool mask_allows(int64_t b, int64_t h, int64_t i, int64_t j) const {
    return (mask.empty() || mask[static_cast<size_t>((mask_plane[b * H + h] * Tq + i) * Tk + j)] != 0) &&
           (qseg.empty() || qseg[static_cast<size_t>(b * Tq + i)] == kseg[static_cast<size_t>(b * Tk + j)]);
  }
};

// docs/numerics.md's table (dimattn/tolerance.h's reference_tolerance).
double fwd_tol(ElementType t) {
  switch (t) {
    case ElementType::float64: return 1e-10;
    case ElementType::float32: return 1e-5;
    case ElementType::bfloat16: return 2e-2;
    case ElementType::float16: return 2e-3;
  }
  return 0;
}
double bwd_tol(ElementType t) { return 2 * fwd_tol(t); }

struct Inputs {
  Array4 q, k, v, dout;  // exactly representable in the case's dtype
};

Inputs make_inputs(const Case& c) {
  std::mt19937_64 rng(c.seed * 7919 + static_cast<uint64_t>(c.Tq * 131 + c.Tk));
  std::normal_distribution<double> normal(0.0, 1.0);
  Inputs in;
  auto fill = [&](Array4& a, int64_t n0, int64_t n1, int64_t n2, int64_t n3) {
    a = Array4(n0, n1, n2, n3);
    for (double& x : a.v) x = representable(c.dtype, normal(rng));
  };
  fill(in.q, c.B, c.H, c.Tq, c.D);
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
// The naive float64 reference: masked softmax, dropout, matmul; the backward
// pass from the analytic gradient.

struct Reference {
  Array4 out, lse, dq, dk, dv;  // lse as [B, H, Tq, 1]
};

bool keep(const Case& c, int64_t b, int64_t h, int64_t i, int64_t j) {
  if (c.p <= 0) return true;
  const float u = c.broadcast ? dropout_uniform_broadcast(c.seed, c.rng_offset, static_cast<uint32_t>(j))
                              : dropout_uniform(c.seed, c.rng_offset, static_cast<uint32_t>(b * c.H + h),
                                                static_cast<uint32_t>(i), static_cast<uint32_t>(j));
  return u >= c.p;
}

double scale_of(const Case& c) { return c.scale != 0 ? c.scale : 1.0 / std::sqrt(static_cast<double>(c.D)); }

bool attends(const Case& c, int64_t b, int64_t h, int64_t i, int64_t j) {
  const int64_t q_len = c.q_lens.empty() ? c.Tq : c.q_lens[b];
  const int64_t kv_len = !c.row_lens.empty() && i < q_len ? c.row_lens[c.row_offsets[b * c.H + h] + i * c.row_stride]
                         : c.kv_lens.empty()              ? c.Tk
                                                          : c.kv_lens[b];
  const int64_t off = c.offsets.empty() ? 0 : c.offsets[b];
  return i < q_len && j < kv_len && (!c.causal || j <= i + off);
}

Reference reference(const Case& c, const Inputs& in) {
  Reference r;
  r.out = Array4(c.B, c.H, c.Tq, c.Dv);
  r.lse = Array4(c.B, c.H, c.Tq, 1, -kInf);
  r.dq = Array4(c.B, c.H, c.Tq, c.D);
  r.dk = Array4(c.B, c.Hkv, c.Tk, c.D);
  r.dv = Array4(c.B, c.Hkv, c.Tk, c.Dv);
  const double scale = scale_of(c);
  const double zkeep = c.p < 1 ? 1.0 / (1.0 - c.p) : 0.0;
  const int64_t G = c.H / c.Hkv;
  std::vector<double> s(c.Tk), pr(c.Tk), z(c.Tk), dp(c.Tk);
  for (int64_t b = 0; b < c.B; ++b)
    for (int64_t h = 0; h < c.H; ++h)
      for (int64_t i = 0; i < c.Tq; ++i) {
        const int64_t hk = h / G;
        double m = -kInf;
        for (int64_t j = 0; j < c.Tk; ++j) {
          s[j] = -kInf;
          if (!attends(c, b, h, i, j) || !c.mask_allows(b, h, i, j)) continue;
          double acc = 0;
          for (int64_t d = 0; d < c.D; ++d) acc += in.q(b, h, i, d) * in.k(b, hk, j, d);
          s[j] = scale * acc;
          m = std::max(m, s[j]);
        }
        if (m == -kInf) continue;  // nothing attended: out 0, lse -inf, no gradient
        double sum = 0;
        for (int64_t j = 0; j < c.Tk; ++j) sum += s[j] == -kInf ? 0.0 : std::exp(s[j] - m);
        r.lse(b, h, i, 0) = m + std::log(sum);
        for (int64_t j = 0; j < c.Tk; ++j) {
          pr[j] = s[j] == -kInf ? 0.0 : std::exp(s[j] - m) / sum;
          z[j] = keep(c, b, h, i, j) ? zkeep : 0.0;
        }
        for (int64_t e = 0; e < c.Dv; ++e) {
          double acc = 0;
          for (int64_t j = 0; j < c.Tk; ++j) acc += pr[j] * z[j] * in.v(b, hk, j, e);
          r.out(b, h, i, e) = acc;
        }
        // Backward: dP = (dO . v_j) z_j, dS = P (dP - sum_j P dP).
        double di = 0;
        for (int64_t j = 0; j < c.Tk; ++j) {
          double acc = 0;
          for (int64_t e = 0; e < c.Dv; ++e) acc += in.dout(b, h, i, e) * in.v(b, hk, j, e);
          dp[j] = acc * z[j];
          di += pr[j] * dp[j];
        }
        for (int64_t j = 0; j < c.Tk; ++j) {
          if (pr[j] == 0) continue;
          const double ds = pr[j] * (dp[j] - di);
          for (int64_t d = 0; d < c.D; ++d) {
            r.dq(b, h, i, d) += scale * ds * in.k(b, hk, j, d);
            r.dk(b, hk, j, d) += scale * ds * in.q(b, h, i, d);
          }
          for (int64_t e = 0; e < c.Dv; ++e) r.dv(b, hk, j, e) += pr[j] * z[j] * in.dout(b, h, i, e);
        }
      }
  return r;
}

// ---------------------------------------------------------------------------
// Running the kernel on a case.

struct KernelRun {
  std::vector<Buffer> buffers;  // owns every tensor
  View q, k, v, out, dout, dq, dk, dv;
  std::vector<unsigned char> lse;  // [B, H, Tq] in the accumulation type
  std::vector<int64_t> mask_offsets, qseg_offsets, kseg_offsets;
  std::vector<int32_t> block_table;  // Case::page_size > 0
  AttentionKernelParams p;
};

// k and v of the case as paged pools (Case::page_size): r's buffers gain the
// two pools, p.k, p.v, their strides and p.pages point at them.
void page_kv(const Case& c, const Inputs& in, KernelRun& r) {
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
void make_qkv(const Case& c, std::vector<Buffer>& bufs, View& q, View& k, View& v) {
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

KernelRun prepare(const Case& c, const Inputs& in) {
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
  p.scale = scale_of(c);
  p.dropout_p = c.p;
  p.dropout_broadcast = c.broadcast;
  p.seed = c.seed;
  p.rng_offset = c.rng_offset;
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

double lse_at(const KernelRun& r, const Case& c, int64_t i) {
  if (c.dtype == ElementType::float64) {
    double d;
    std::memcpy(&d, r.lse.data() + i * 8, 8);
    return d;
  }
  float f;
  std::memcpy(&f, r.lse.data() + i * 4, 4);
  return f;
}

// Max abs error of a view against a reference array, relative to the
// reference's scale where values are large; NaN anywhere fails.
::testing::AssertionResult close(const char* what, const View& got, const Array4& want, double tol) {
  double scale = 1.0;
  for (double x : want.v) scale = std::max(scale, std::abs(x));
  double worst = 0;
  int64_t wi[4] = {0, 0, 0, 0};
  for (int64_t a = 0; a < want.n[0]; ++a)
    for (int64_t b = 0; b < want.n[1]; ++b)
      for (int64_t c = 0; c < want.n[2]; ++c)
        for (int64_t d = 0; d < want.n[3]; ++d) {
          const double g = got.buf->get(got.at(a, b, c, d));
          const double e = std::isnan(g) ? kInf : std::abs(g - want(a, b, c, d));
          if (e > worst) {
            worst = e;
            wi[0] = a, wi[1] = b, wi[2] = c, wi[3] = d;
          }
        }
  if (worst <= tol * scale) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << what << ": max abs error " << worst << " > " << tol << " * " << scale
                                       << " at [" << wi[0] << ", " << wi[1] << ", " << wi[2] << ", " << wi[3]
                                       << "]: got " << got.buf->get(got.at(wi[0], wi[1], wi[2], wi[3])) << ", want "
                                       << want(wi[0], wi[1], wi[2], wi[3]);
}

// Every code path this CPU runs (the ones it lacks are CpuIsaPaths' skips),
// or only DIMATTN_CPU_ISA's when that caps them.
std::vector<CpuIsa> isas() {
  const char* cap = std::getenv("DIMATTN_CPU_ISA");
  if (cap != nullptr && *cap != '\0') return {cpu_flash_best_isa()};
  std::vector<CpuIsa> r;
  for (CpuIsa isa : kCpuIsas)
    if (missing_cpu_flags(isa, cpu_features()).empty()) r.push_back(isa);
  return r;
}

void check_case(const Case& c, bool backward = true, const std::vector<CpuIsa>& on = isas()) {
  const Inputs in = make_inputs(c);
  const Reference ref = reference(c, in);
  ThreadPool pool(2);
  for (CpuIsa isa : on) {
    SCOPED_TRACE(c.name + " isa=" + cpu_isa_name(isa) + " dtype=" + element_type_name(c.dtype));
    KernelRun r = prepare(c, in);
    flash_attention_forward_cpu(r.p, pool.as_parallel_for(), isa);
    const double ft = fwd_tol(c.dtype);
    EXPECT_TRUE(close("out", r.out, ref.out, ft));
    for (int64_t i = 0; i < c.B * c.H * c.Tq; ++i) {
      const double want = ref.lse.v[i], got = lse_at(r, c, i);
      if (want == -kInf) {
        EXPECT_EQ(got, -kInf) << "lse row " << i;
      } else {
        EXPECT_NEAR(got, want, ft * std::max(1.0, std::abs(want))) << "lse row " << i;
      }
    }
    if (!backward) continue;
    // bfloat16's backward pass reads the forward's rounded output, as in
    // training; its gradients are still compared with the float64 reference.
    flash_attention_backward_cpu(r.p, pool.as_parallel_for(), isa);
    const double bt = bwd_tol(c.dtype);
    EXPECT_TRUE(close("dq", r.dq, ref.dq, bt));
    EXPECT_TRUE(close("dk", r.dk, ref.dk, bt));
    EXPECT_TRUE(close("dv", r.dv, ref.dv, bt));
  }
}

// Per-row kv lengths drawn in [0, Tk] (about one row in six 0, one in six
// Tk): per (b, h) row when per_row, else one per (b, h) plane (row stride 0);
// every head's plane its own, or (shared_heads) one per batch entry that the
// heads' offsets repeat. kv_lens become the entries' maxima.
void with_row_lengths(Case& c, bool per_row, bool shared_heads = false) {
  std::mt19937_64 rng(c.seed + 77);
  const int64_t planes = shared_heads ? c.B : c.B * c.H, rows = per_row ? c.Tq : 1;
  c.row_lens.assign(static_cast<size_t>(planes * rows), 0);
  for (int64_t& x : c.row_lens) {
    const int64_t r = static_cast<int64_t>(rng() % 6);
    x = r == 0 ? 0 : r == 1 ? c.Tk : static_cast<int64_t>(rng() % static_cast<uint64_t>(c.Tk + 1));
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

Case base(const std::string& name, ElementType t = ElementType::float32) {
  Case c;
  c.name = name;
  c.dtype = t;
  return c;
}

const ElementType kAllTypes[] = {ElementType::float32, ElementType::float64, ElementType::bfloat16,
                                 ElementType::float16};

}  // namespace
}  // namespace dimattn::kernels
