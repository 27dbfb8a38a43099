#include "kernels/cuda_flash_cases.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <iostream>
#include <limits>
#include <random>
#include <tuple>

#include "common/philox.h"
#include "cpu/flash_attention.h"
#include "cpu/thread_pool.h"
#include "cuda/flash_attention_cuda.h"
#include "kernels/bf16_bits.h"

namespace dimattn::kernels::test {

std::vector<CudaKernelCase> cuda_kernel_cases() {
  std::vector<CudaKernelCase> out;
  for (ElementType t : {ElementType::bfloat16, ElementType::float16})
    for (int64_t D : {64, 128}) {
      const std::string s = std::string("_") + element_type_name(t) + "_d" + std::to_string(D);
      auto add = [&](CudaKernelCase c) {
        c.name += s;
        c.dtype = t;
        c.D = D;
        out.push_back(std::move(c));
      };
      // The CUDA dual harness's cases (tests/dual/cuda_dual_test.cpp).
      add({.name = "cross"});
      add({.name = "causal_self", .Tq = 130, .causal = true});
      add({.name = "lengths", .kv_lens = {130, 41}});
      add({.name = "causal_offset", .causal = true, .offsets = {30, -3}});
      add({.name = "gqa_causal_lengths", .H = 8, .Hkv = 2, .Tq = 130, .causal = true, .kv_lens = {130, 77}});
      add({.name = "mqa", .H = 8, .Hkv = 1});
      add({.name = "dropout", .Tq = 130, .causal = true, .kv_lens = {130, 90}, .p = 0.3});
      add({.name = "dropout_gqa", .p = 0.2});
      add({.name = "broadcast_dropout", .kv_lens = {120, 9}, .p = 0.5, .broadcast = true});
      add({.name = "packed_qkv_causal", .Tq = 130, .causal = true, .packed_qkv = true});
      // Edge cases: an entry with no kv position, query lengths with a
      // negative offset (rows without a position), no query rows at all.
      add({.name = "mqa_empty_entry", .Hkv = 1, .kv_lens = {0, 65}});
      add({.name = "query_lengths_offsets", .causal = true, .q_lens = {100, 37}, .offsets = {-20, 5}});
      if (D == 64) add({.name = "no_query_rows", .Tq = 0});
      // Each query row its own kv length (a chunk attending a history whose
      // lengths vary per position, beams, GQA heads), rows of length 0 among them.
      add({.name = "row_lengths", .row_lengths = CudaKernelCase::RowLengths::per_head});
      add({.name = "row_lengths_gqa_causal_dropout", .H = 8, .Hkv = 2, .causal = true, .offsets = {30, 5},
           .row_lengths = CudaKernelCase::RowLengths::per_head, .p = 0.2});
      add({.name = "row_lengths_shared_sinks_bias", .kv_lens = {130, 60},
           .row_lengths = CudaKernelCase::RowLengths::shared_by_heads, .sinks = true, .bias = true});
      // Variants.
      add({.name = "all_variants_gqa_dropout", .H = 8, .Hkv = 2, .Tq = 130, .causal = true, .kv_lens = {130, 97},
           .offsets = {0, -9}, .p = 0.2, .window_left = 50, .softcap = 3.0, .alibi = true, .sinks = true,
           .bias = true, .mask = true, .segments = true});
      add({.name = "segments_gqa_causal_dropout", .H = 8, .Hkv = 2, .Tq = 130, .causal = true, .kv_lens = {130, 97},
           .p = 0.2, .segments = true});
      add({.name = "segments_cross_bias", .kv_lens = {130, 70}, .offsets = {30, -5}, .window_left = 60,
           .window_right = 10, .bias = true, .segments = true});
      // Packed sequences of lengths 1, odd and long, and of kv length 0.
      add({.name = "packed_sequences_causal_dropout", .H = 8, .Hkv = 2, .Tq = 300, .Tk = 300, .causal = true,
           .p = 0.2, .segments = true, .packed = {1, 37, 130, 1, 5, 64}});
      // A block of a longer sequence (context parallelism): its causal offset
      // beyond its own extents, an odd first kv position for dropout's keys
      // (a pair of columns straddles two Philox counters), windows and ALiBi
      // measured from the global diagonal.
      add({.name = "block_of_a_sequence", .causal = true, .offsets = {250, 251}, .p = 0.3, .window_left = 300,
           .alibi = true, .q_position = 387, .kv_position = 137});
      add({.name = "block_broadcast_dropout", .offsets = {-50, 0}, .p = 0.4, .broadcast = true, .window_left = 20,
           .window_right = 20, .q_position = 11, .kv_position = 61});
      add({.name = "bias_mask_gqa", .H = 8, .Hkv = 2, .causal = true, .kv_lens = {130, 61}, .offsets = {30, 2},
           .bias = true, .mask = true});
      if (D == 64) {
        add({.name = "window_causal", .Tq = 130, .causal = true, .window_left = 40});
        add({.name = "window_two_sided", .kv_lens = {130, 57}, .offsets = {30, -5}, .window_left = 20,
             .window_right = 10});
        add({.name = "softcap", .scale = 0.5, .softcap = 2.0});
        add({.name = "alibi_causal", .Tq = 130, .causal = true, .alibi = true});
        add({.name = "sinks_empty_entry", .kv_lens = {130, 0}, .sinks = true});
        add({.name = "bias_softcap_dropout", .p = 0.25, .softcap = 2.0, .bias = true});
        add({.name = "mask", .kv_lens = {130, 90}, .mask = true});
      }
      // Documents as a bool mask: its blocks classified (empty, full, partial).
      add({.name = "mask_docs_causal_gqa_dropout", .H = 8, .Hkv = 2, .Tq = 200, .Tk = 200, .causal = true,
           .kv_lens = {200, 170}, .p = 0.2, .mask = true, .mask_docs = 70});
      if (D == 64)
        add({.name = "mask_docs_cross_softcap", .Tq = 150, .Tk = 260, .softcap = 2.0, .mask = true, .mask_docs = 90});
    }
  // float16 with p near 1: 1 / (1 - p) = 1e5 times a weight near 1 overflows
  // float16 unless the rescale is applied in float32 at the end.
  out.push_back({.name = "dropout_near_one_float16_d64",
                 .dtype = ElementType::float16,
                 .Tq = 256,
                 .Tk = 256,
                 .p = 0.99999,
                 .zero_queries = true});
  return out;
}

namespace {

bool is_half(ElementType t) { return t == ElementType::float16; }
uint16_t round16(float x, bool half) { return half ? f16_round(x) : bf16_round(x); }
double value16(uint16_t b, bool half) { return half ? f16_value(b) : bf16_value(b); }

// A logical [B, heads, T, D] view of a buffer of 16-bit values.
struct View {
  int64_t offset = 0;
  ElementStrides st;
  int64_t at(int64_t b, int64_t h, int64_t t, int64_t c) const {
    return offset + b * st.batch + h * st.head + t * st.row + c;
  }
};

View dense(int64_t heads, int64_t T, int64_t D) { return {0, {heads * T * D, T * D, D, 1}}; }

// Device buffer, freed with the runner.
struct Buf {
  CudaFlashRunner& r;
  void* p = nullptr;
  size_t bytes;
  Buf(CudaFlashRunner& runner, size_t n) : r(runner), bytes(n) {
    if (n > 0) p = r.alloc(n);
  }
  ~Buf() {
    if (p) r.free(p);
  }
  Buf(const Buf&) = delete;
  Buf& operator=(const Buf&) = delete;
};

// The float64 oracle: the contract of attention_params.h written as loops.
struct Oracle {
  std::vector<double> out, lse, dq, dk, dv;          // results
  std::vector<double> m_out, m_dq, m_dk, m_dv;  // magnitudes of the rounded terms
  std::vector<double> a_out, a_dq, a_dk, a_dv;  // sums of the terms' other factors (float16 subnormals)
  std::vector<double> dsinks, m_dsinks;         // [B, H]
  std::vector<double> dbias, m_dbias;           // [H, Tq, Tk]
  int64_t kept_overflowing = 0;                 // kept exp(s - max) * 1/(1-p) above float16's max
};

Oracle oracle(const CudaKernelCase& c, const std::vector<double>& qkv, const std::vector<double>& kbuf,
              const std::vector<double>& vbuf, const View& qv, const View& kv, const View& vv,
              const std::vector<double>& dout, double scale, const std::vector<double>& slopes,
              const std::vector<double>& sinks, const std::vector<float>& bias, const std::vector<uint8_t>& mask,
              const std::vector<int64_t>& row_lens, const std::vector<int64_t>& row_offsets,
              const std::vector<int64_t>& qseg, const std::vector<int64_t>& kseg) {
  const int64_t B = c.B, H = c.H, G = c.H / c.Hkv, Tq = c.Tq, Tk = c.Tk, D = c.D;
  Oracle o;
  o.out.assign(B * H * Tq * D, 0);
  o.m_out = o.out;
  o.dq = o.m_dq = o.a_out = o.a_dq = o.out;
  o.lse.assign(B * H * Tq, -std::numeric_limits<double>::infinity());
  o.dk.assign(B * c.Hkv * Tk * D, 0);
  o.m_dk = o.dv = o.m_dv = o.a_dk = o.a_dv = o.dk;
  o.dsinks.assign(B * H, 0);
  o.m_dsinks = o.dsinks;
  o.dbias.assign(c.bias ? H * Tq * Tk : 0, 0);
  o.m_dbias = o.dbias;
  const DropoutRule rule = dropout_rule(c.p);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t q_len = c.q_lens.empty() ? Tq : c.q_lens[b], kv_len = c.kv_lens.empty() ? Tk : c.kv_lens[b];
    const int64_t off = c.offsets.empty() ? 0 : c.offsets[b];
    for (int64_t h = 0; h < H; ++h) {
      const int64_t hk = h / G, bh = b * H + h;
      auto allowed = [&](int64_t i, int64_t j) {
        const int64_t len = row_lens.empty() || i >= q_len ? kv_len : row_lens[row_offsets[bh] + i];
        return i < q_len && j < len && (!c.causal || j <= i + off) &&
               (c.window_left < 0 || j >= i + off - c.window_left) &&
               (c.window_right < 0 || j <= i + off + c.window_right) && (!c.mask || mask[(b * Tq + i) * Tk + j] != 0) &&
               (!c.segments || qseg[b * Tq + i] == kseg[b * Tk + j]);
      };
      auto q = [&](int64_t i, int64_t d) { return qkv[qv.at(b, h, i, d)]; };
      auto k = [&](int64_t j, int64_t d) { return kbuf[kv.at(b, hk, j, d)]; };
      auto v = [&](int64_t j, int64_t d) { return vbuf[vv.at(b, hk, j, d)]; };
      auto row = [&](int64_t i) { return (bh * Tq + i) * D; };
      auto kvrow = [&](int64_t j) { return ((b * c.Hkv + hk) * Tk + j) * D; };
      const double sink = c.sinks ? sinks[h] : -std::numeric_limits<double>::infinity();
      for (int64_t i = 0; i < q_len; ++i) {  // padding rows: out, dq = 0, lse = -inf
        // Scores: scale, cap, ALiBi; cap' = d(capped)/d(scaled).
        std::vector<double> s(Tk, -std::numeric_limits<double>::infinity()), P(Tk, 0), Z(Tk, 0), cap(Tk, 1);
        double mx = sink;
        bool any = false;
        for (int64_t j = 0; j < Tk; ++j)
          if (allowed(i, j)) {
            double dot = 0;
            for (int64_t d = 0; d < D; ++d) dot += q(i, d) * k(j, d);
            s[j] = scale * dot;
            if (c.softcap > 0) {
              const double t = std::tanh(s[j] / c.softcap);
              s[j] = c.softcap * t;
              cap[j] = 1 - t * t;
            }
            if (c.bias) s[j] += bias[(h * Tq + i) * Tk + j];
            if (c.alibi) s[j] -= slopes[h] * std::abs(static_cast<double>(i + off - j));
            mx = std::max(mx, s[j]);
            any = true;
          }
        if (!any && !c.sinks) continue;  // out, dq = 0; lse = -inf
        double l = c.sinks ? std::exp(sink - mx) : 0;
        for (int64_t j = 0; j < Tk; ++j) l += allowed(i, j) ? std::exp(s[j] - mx) : 0;
        o.lse[bh * Tq + i] = mx + std::log(l);
        const double p_sink = c.sinks ? std::exp(sink - o.lse[bh * Tq + i]) : 0;
        for (int64_t j = 0; j < Tk; ++j) {
          if (!allowed(i, j)) continue;
          P[j] = std::exp(s[j] - mx) / l;
          Z[j] = 1;
          if (c.p > 0) {
            // Keyed at the element's place in the sequence (q_position + i, kv_position + j).
            const auto qi = static_cast<uint32_t>(c.q_position + i), kj = static_cast<uint32_t>(c.kv_position + j);
            const double u = c.broadcast ? dropout_uniform_broadcast(7, 3, kj)
                                         : dropout_uniform(7, 3, static_cast<uint32_t>(bh), qi, kj);
            Z[j] = u >= c.p ? rule.keep_scale : 0;
            // The kernel's weights before normalisation are exp(s - max).
            if (std::exp(s[j] - mx) * Z[j] > 65504) ++o.kept_overflowing;
          }
        }
        // Forward.
        for (int64_t j = 0; j < Tk; ++j)
          for (int64_t d = 0; d < D; ++d) {
            o.out[row(i) + d] += P[j] * Z[j] * v(j, d);
            o.m_out[row(i) + d] += std::abs(P[j] * Z[j] * v(j, d));
            o.a_out[row(i) + d] += Z[j] * std::abs(v(j, d));
          }
        // Backward: dP = (dO v) Z, D_i = dO . out, dS = P (dP - D_i); E_i
        // bounds what rounding out to 16 bits does to D_i (in units of u).
        double Di = 0, Ei = 0;
        for (int64_t d = 0; d < D; ++d) {
          Di += dout[row(i) + d] * o.out[row(i) + d];
          Ei += std::abs(dout[row(i) + d] * o.out[row(i) + d]);
        }
        for (int64_t j = 0; j < Tk; ++j) {
          if (!allowed(i, j)) continue;
          double dx = 0;
          for (int64_t d = 0; d < D; ++d) dx += dout[row(i) + d] * v(j, d);
          const double dS = P[j] * (dx * Z[j] - Di) * cap[j], mS = (std::abs(dS) + P[j] * Ei) * cap[j];
          if (c.bias) {  // d(bias) = dS before the cap's derivative, summed over the batch
            o.dbias[(h * Tq + i) * Tk + j] += P[j] * (dx * Z[j] - Di);
            o.m_dbias[(h * Tq + i) * Tk + j] += std::abs(P[j] * (dx * Z[j] - Di)) + P[j] * Ei;
          }
          for (int64_t d = 0; d < D; ++d) {
            o.dv[kvrow(j) + d] += P[j] * Z[j] * dout[row(i) + d];
            o.m_dv[kvrow(j) + d] += std::abs(P[j] * Z[j] * dout[row(i) + d]);
            o.a_dv[kvrow(j) + d] += Z[j] * std::abs(dout[row(i) + d]);
            o.dk[kvrow(j) + d] += scale * dS * q(i, d);
            o.m_dk[kvrow(j) + d] += scale * mS * std::abs(q(i, d));
            o.a_dk[kvrow(j) + d] += scale * std::abs(q(i, d));
            o.dq[row(i) + d] += scale * dS * k(j, d);
            o.m_dq[row(i) + d] += scale * mS * std::abs(k(j, d));
            o.a_dq[row(i) + d] += scale * std::abs(k(j, d));
          }
        }
        if (i < q_len) {
          o.dsinks[bh] -= p_sink * Di;
          o.m_dsinks[bh] += p_sink * (std::abs(Di) + Ei);
        }
      }
    }
  }
  return o;
}

// err <= 2 (u (|ref| + M) + s (1 + A)) per element: twice the first-order
// bound of the 16-bit roundings (the float32 sums add far less), where s is
// float16's absolute rounding error below its normal range (2^-25: weights
// and dS values that small round to subnormals) and A the sum of the factors
// such rounded terms are multiplied by.
void compare(const CudaKernelCase& c, const char* what, const std::vector<double>& ref,
             const std::vector<double>& mag, const std::vector<double>& sub, const std::vector<uint16_t>& cuda,
             const std::vector<uint16_t>& cpu) {
  const bool half = is_half(c.dtype);
  const double u = half ? std::ldexp(1.0, -11) : std::ldexp(1.0, -8);
  const double s = half ? std::ldexp(1.0, -25) : 0.0;  // bfloat16 has float32's exponent range
  double worst_cuda = 0, worst_cpu = 0, worst_pair = 0;
  int64_t bad = 0;
  for (size_t x = 0; x < ref.size(); ++x) {
    const double tol = 2 * (u * (std::abs(ref[x]) + mag[x]) + s * (1 + sub[x])) + 1e-30;
    const double g = value16(cuda[x], half), h = value16(cpu[x], half);
    if (std::isnan(g) || std::isinf(g)) {
      if (bad++ < 3) ADD_FAILURE() << c.name << " " << what << "[" << x << "] is " << g << " (unwritten, overflowed)";
      continue;
    }
    worst_cuda = std::max(worst_cuda, std::abs(g - ref[x]) / tol);
    worst_cpu = std::max(worst_cpu, std::abs(h - ref[x]) / tol);
    worst_pair = std::max(worst_pair, std::abs(g - h) / (2 * tol));
  }
  std::cout << "[ cuda_flash ] " << c.name << " " << what << ": error / tolerance " << worst_cuda
            << " (cpu_flash " << worst_cpu << ", cuda vs cpu " << worst_pair << ")\n";
  EXPECT_LE(worst_cuda, 1.0) << c.name << " " << what << ": cuda_flash vs the float64 oracle";
  EXPECT_LE(worst_cpu, 1.0) << c.name << " " << what << ": cpu_flash vs the float64 oracle";
  EXPECT_LE(worst_pair, 1.0) << c.name << " " << what << ": cuda_flash vs cpu_flash";
}

}  // namespace

void check_cuda_flash_case(const CudaKernelCase& c, CudaFlashRunner& runner) {
  SCOPED_TRACE(c.name);
  const bool half = is_half(c.dtype);
  const int64_t B = c.B, H = c.H, Hkv = c.Hkv, Tq = c.Tq, Tk = c.Tk, D = c.D;
  const int64_t nq = B * H * Tq * D, nkv = B * Hkv * Tk * D, rows = B * H * Tq;
  const double scale = c.scale > 0 ? c.scale : 1.0 / std::sqrt(static_cast<double>(D));

  // Inputs: 16-bit bits and their exact values. Packed: q, k, v are views of
  // one [B, T, H + 2 Hkv, D] buffer.
  std::mt19937_64 rng(42);
  std::normal_distribution<float> normal;
  auto fill = [&](int64_t n, std::vector<uint16_t>& bits, std::vector<double>& vals, bool zero) {
    bits.resize(n);
    vals.resize(n);
    for (int64_t x = 0; x < n; ++x) {
      bits[x] = round16(zero ? 0.f : normal(rng), half);
      vals[x] = value16(bits[x], half);
    }
  };
  std::vector<uint16_t> qb, kb, vb, db;
  std::vector<double> qf, kf, vf, df;
  View qv = dense(H, Tq, D), kv = dense(Hkv, Tk, D), vv = kv;
  if (c.packed_qkv) {
    const int64_t heads = H + 2 * Hkv, rs = heads * D;
    fill(B * Tq * rs, qb, qf, false);
    if (c.zero_queries) ADD_FAILURE() << "zero_queries is not combined with packed_qkv";
    qv = {0, {Tq * rs, D, rs, 1}};
    kv = {H * D, {Tq * rs, D, rs, 1}};
    vv = {(H + Hkv) * D, {Tq * rs, D, rs, 1}};
  } else {
    fill(nq, qb, qf, c.zero_queries);
    fill(nkv, kb, kf, false);
    fill(nkv, vb, vf, false);
  }
  fill(nq, db, df, false);
  const std::vector<double>& kvals = c.packed_qkv ? qf : kf;
  const std::vector<double>& vvals = c.packed_qkv ? qf : vf;
  std::vector<double> slopes(H), sinks(H);
  for (int64_t h = 0; h < H; ++h) {
    slopes[h] = std::exp2(-8.0 * static_cast<double>(h + 1) / static_cast<double>(H));
    sinks[h] = normal(rng);
  }
  // Bias [H, Tq, Tk] and mask [B, Tq, Tk], and each (b, h) plane's offset.
  std::vector<float> bias(c.bias ? H * Tq * Tk : 0);
  for (float& x : bias) x = normal(rng);
  std::vector<uint8_t> mask(c.mask ? B * Tq * Tk : 0);
  std::uniform_real_distribution<double> uniform;
  for (uint8_t& x : mask) x = uniform(rng) >= 0.25;
  for (int64_t i = 3; i < (c.mask && c.mask_docs == 0 ? Tq : 0); i += 7)  // rows the mask leaves no position (batch entry 0)
    std::fill(mask.begin() + i * Tk, mask.begin() + (i + 1) * Tk, uint8_t{0});
  if (c.mask_docs > 0)
    for (int64_t b = 0; b < B; ++b)
      for (int64_t i = 0; i < Tq; ++i)
        for (int64_t j = 0; j < Tk; ++j)
          mask[(b * Tq + i) * Tk + j] = (i + 13 * b) / c.mask_docs == (j + 13 * b) / c.mask_docs;
  // Segment ids [B, Tq] and [B, Tk]: document d of entry b has 20 + (37 d + 29 b) % 40 positions
  // (or the case's packed lengths).
  std::vector<int64_t> qseg, kseg, qseg_offsets(B * H), kseg_offsets(B * H);
  auto doc_len = [&](int64_t d, int64_t b, bool kv) {
    if (c.packed.empty()) return 20 + (37 * d + 29 * b) % 40;
    return kv && d % 5 == 2 ? int64_t{0} : c.packed[static_cast<size_t>(d) % c.packed.size()];
  };
  for (int64_t b = 0; b < (c.segments ? B : 0); ++b)
    for (auto [ids, T, kv] : {std::tuple{&qseg, Tq, false}, std::tuple{&kseg, Tk, true}})
      for (int64_t d = 0, x = 0; x < T; ++d)
        for (int64_t y = 0; y < doc_len(d, b, kv) && x < T; ++y, ++x) ids->push_back(d);
  for (int64_t x = 0; x < B * H; ++x) qseg_offsets[x] = (x / H) * Tq, kseg_offsets[x] = (x / H) * Tk;
  std::vector<int64_t> bias_offsets(B * H), mask_offsets(B * H);
  for (int64_t x = 0; x < B * H; ++x) bias_offsets[x] = (x % H) * Tq * Tk, mask_offsets[x] = (x / H) * Tq * Tk;
  // Per-row kv lengths: planes of Tq rows, per (b, h) or per b; the
  // entries' maxima as kv lengths when the case gives none.
  std::vector<int64_t> row_lens, row_offsets, kv_lens = c.kv_lens;
  if (c.row_lengths != CudaKernelCase::RowLengths::off) {
    const bool shared = c.row_lengths == CudaKernelCase::RowLengths::shared_by_heads;
    for (int64_t x = 0; x < B * H; ++x) row_offsets.push_back((shared ? x / H : x) * Tq);
    row_lens.resize((shared ? B : B * H) * Tq);
    for (size_t x = 0; x < row_lens.size(); ++x) {
      const int64_t most = c.kv_lens.empty() ? Tk : c.kv_lens[x / ((shared ? 1 : H) * Tq)];
      row_lens[x] = rng() % 6 == 0 ? 0 : static_cast<int64_t>(rng() % static_cast<uint64_t>(most + 1));
    }
    if (kv_lens.empty()) {
      kv_lens.assign(B, 0);
      for (int64_t x = 0; x < B * H; ++x)
        for (int64_t i = 0; i < Tq; ++i) kv_lens[x / H] = std::max(kv_lens[x / H], row_lens[row_offsets[x] + i]);
    }
  }
  const Oracle o = oracle(c, qf, kvals, vvals, qv, kv, vv, df, scale, slopes, sinks, bias, mask, row_lens, row_offsets, qseg, kseg);
  if (c.zero_queries) {
    EXPECT_GT(o.kept_overflowing, 0) << "the case keeps no weight that 1/(1-p) pushes past float16's range";
  }

  AttentionKernelParams p;
  p.dtype = c.dtype;
  p.batch = B;
  p.heads = H;
  p.kv_heads = Hkv;
  p.seqlen_q = Tq;
  p.seqlen_k = Tk;
  p.head_dim = p.head_dim_v = D;
  p.q_strides = qv.st;
  p.k_strides = kv.st;
  p.v_strides = vv.st;
  p.out_strides = p.dout_strides = p.dq_strides = dense(H, Tq, D).st;
  p.dk_strides = p.dv_strides = dense(Hkv, Tk, D).st;
  p.lse_batch_stride = H * Tq;
  p.lse_head_stride = Tq;
  p.causal = c.causal;
  p.scale = scale;
  p.dropout_p = c.p;
  p.dropout_broadcast = c.broadcast;
  p.seed = 7;
  p.rng_offset = 3;
  p.dropout_q_position = c.q_position;
  p.dropout_kv_position = c.kv_position;
  p.bounds = {c.window_left, c.window_right};
  p.score.softcap = c.softcap;
  p.score.bias.row_stride = p.score.mask.row_stride = Tk;
  p.score.bias.col_stride = p.score.mask.col_stride = 1;
  p.score.dbias_shared = B > 1;

  // cpu_flash on the same bits.
  AttentionKernelParams cp = p;
  std::vector<uint16_t> cpu_out(nq), cpu_dq(nq), cpu_dk(nkv), cpu_dv(nkv);
  std::vector<float> cpu_lse(rows);
  cp.q = qb.data() + qv.offset;
  cp.k = (c.packed_qkv ? qb.data() : kb.data()) + kv.offset;
  cp.v = (c.packed_qkv ? qb.data() : vb.data()) + vv.offset;
  cp.dout = db.data();
  cp.out = cpu_out.data(), cp.lse = cpu_lse.data(), cp.dq = cpu_dq.data(), cp.dk = cpu_dk.data(),
  cp.dv = cpu_dv.data();
  cp.q_lengths = c.q_lens.empty() ? nullptr : c.q_lens.data();
  cp.kv_lengths = kv_lens.empty() ? nullptr : kv_lens.data();
  if (!row_lens.empty()) cp.kv_row_lengths = {row_lens.data(), row_offsets.data(), 1, 0};
  cp.causal_offset = c.offsets.empty() ? nullptr : c.offsets.data();
  std::vector<double> cpu_dsinks(B * H, NAN);
  if (c.alibi) cp.score.alibi = {slopes.data(), 0, 1};
  if (c.sinks) cp.score.sinks = {sinks.data(), 0, 1}, cp.score.dsinks = cpu_dsinks.data();
  std::vector<float> cpu_dbias(bias.size(), 0.f);
  if (c.bias) {
    cp.score.bias.data = bias.data(), cp.score.bias.offsets = bias_offsets.data();
    cp.score.dbias = cpu_dbias.data();
  }
  if (c.mask) cp.score.mask.data = mask.data(), cp.score.mask.offsets = mask_offsets.data();
  if (c.segments) {
    cp.score.query_segments = {qseg.data(), qseg_offsets.data(), 1, 0};
    cp.score.kv_segments = {kseg.data(), kseg_offsets.data(), 0, 1};
  }
  ThreadPool pool(2);
  flash_attention_forward_cpu(cp, pool.as_parallel_for());
  flash_attention_backward_cpu(cp, pool.as_parallel_for());

  // cuda_flash on the runner.
  const size_t in_bytes = (c.packed_qkv ? qb.size() : nq) * 2;
  Buf q(runner, in_bytes), k(runner, c.packed_qkv ? 0 : nkv * 2), v(runner, c.packed_qkv ? 0 : nkv * 2),
      dout(runner, nq * 2), out(runner, nq * 2), lse(runner, rows * 4), dq(runner, nq * 2), dk(runner, nkv * 2),
      dv(runner, nkv * 2), q_lens(runner, 8 * c.q_lens.size()), kv_lens_d(runner, 8 * kv_lens.size()),
      row_lens_d(runner, 8 * row_lens.size()), row_offsets_d(runner, 8 * row_offsets.size()),
      offsets(runner, 8 * c.offsets.size()), slopes_d(runner, c.alibi ? 8 * H : 0),
      sinks_d(runner, c.sinks ? 8 * H : 0), dsinks_d(runner, c.sinks ? 8 * B * H : 0),
      bias_d(runner, 4 * bias.size()), dbias_d(runner, 4 * bias.size()), mask_d(runner, mask.size()),
      bias_offsets_d(runner, c.bias ? 8 * B * H : 0), mask_offsets_d(runner, c.mask ? 8 * B * H : 0),
      qseg_d(runner, 8 * qseg.size()), kseg_d(runner, 8 * kseg.size()),
      qseg_offsets_d(runner, c.segments ? 8 * B * H : 0), kseg_offsets_d(runner, c.segments ? 8 * B * H : 0);
  auto put = [&](const Buf& dst, const void* src) {
    if (dst.bytes > 0) runner.upload(dst.p, src, dst.bytes);
  };
  put(q, qb.data());
  put(k, kb.data());
  put(v, vb.data());
  put(dout, db.data());
  put(q_lens, c.q_lens.data());
  put(kv_lens_d, kv_lens.data());
  put(row_lens_d, row_lens.data());
  put(row_offsets_d, row_offsets.data());
  if (!row_lens.empty())
    p.kv_row_lengths = {row_lens_d.p, static_cast<const int64_t*>(row_offsets_d.p), 1, 0};
  put(offsets, c.offsets.data());
  put(slopes_d, slopes.data());
  put(sinks_d, sinks.data());
  if (c.alibi) p.score.alibi = {static_cast<const double*>(slopes_d.p), 0, 1};
  if (c.sinks) p.score.sinks = {static_cast<const double*>(sinks_d.p), 0, 1};
  p.score.dsinks = static_cast<double*>(dsinks_d.p);
  put(bias_d, bias.data());
  const std::vector<float> zeros(bias.size(), 0.f);
  put(dbias_d, zeros.data());  // the kernel adds to it
  put(mask_d, mask.data());
  put(bias_offsets_d, bias_offsets.data());
  put(mask_offsets_d, mask_offsets.data());
  if (c.bias) {
    p.score.bias.data = bias_d.p, p.score.dbias = dbias_d.p;
    p.score.bias.offsets = static_cast<const int64_t*>(bias_offsets_d.p);
  }
  if (c.mask) {
    p.score.mask.data = mask_d.p;
    p.score.mask.offsets = static_cast<const int64_t*>(mask_offsets_d.p);
  }
  put(qseg_d, qseg.data());
  put(kseg_d, kseg.data());
  put(qseg_offsets_d, qseg_offsets.data());
  put(kseg_offsets_d, kseg_offsets.data());
  if (c.segments) {
    p.score.query_segments = {qseg_d.p, static_cast<const int64_t*>(qseg_offsets_d.p), 1, 0};
    p.score.kv_segments = {kseg_d.p, static_cast<const int64_t*>(kseg_offsets_d.p), 0, 1};
  }
  auto* base = static_cast<uint16_t*>(q.p);
  p.q = base ? base + qv.offset : nullptr;
  p.k = c.packed_qkv ? (base ? base + kv.offset : nullptr) : k.p;
  p.v = c.packed_qkv ? (base ? base + vv.offset : nullptr) : v.p;
  p.dout = dout.p, p.out = out.p, p.lse = lse.p, p.dq = dq.p, p.dk = dk.p, p.dv = dv.p;
  p.q_lengths = static_cast<const int64_t*>(q_lens.p);
  p.kv_lengths = static_cast<const int64_t*>(kv_lens_d.p);
  p.causal_offset = static_cast<const int64_t*>(offsets.p);
  ASSERT_EQ(cuda_flash_gate(p, true), "");
  // A workspace of 0 bytes (no query rows) is passed as null.
  Buf ws(runner, cuda_flash_backward_workspace_bytes(p));
  runner.forward(p);
  runner.backward(p, ws.p);
  std::vector<uint16_t> g_out(nq), g_dq(nq), g_dk(nkv), g_dv(nkv);
  std::vector<float> g_lse(rows);
  auto get = [&](void* dst, const Buf& src) {
    if (src.bytes > 0) runner.download(dst, src.p, src.bytes);
  };
  get(g_out.data(), out);
  get(g_dq.data(), dq);
  get(g_dk.data(), dk);
  get(g_dv.data(), dv);
  get(g_lse.data(), lse);
  std::vector<double> g_dsinks(B * H);
  get(g_dsinks.data(), dsinks_d);
  std::vector<float> g_dbias(bias.size());
  get(g_dbias.data(), dbias_d);

  compare(c, "out", o.out, o.m_out, o.a_out, g_out, cpu_out);
  compare(c, "dq", o.dq, o.m_dq, o.a_dq, g_dq, cpu_dq);
  compare(c, "dk", o.dk, o.m_dk, o.a_dk, g_dk, cpu_dk);
  compare(c, "dv", o.dv, o.m_dv, o.a_dv, g_dv, cpu_dv);
  if (c.sinks) {
    const double u = is_half(c.dtype) ? std::ldexp(1.0, -11) : std::ldexp(1.0, -8);
    for (int64_t x = 0; x < B * H; ++x) {
      const double tol = 2 * u * (std::abs(o.dsinks[x]) + o.m_dsinks[x]) + 1e-6;
      EXPECT_NEAR(g_dsinks[x], o.dsinks[x], tol) << c.name << " dsinks[" << x << "], cuda_flash";
      EXPECT_NEAR(cpu_dsinks[x], o.dsinks[x], tol) << c.name << " dsinks[" << x << "], cpu_flash";
    }
  }
  if (c.bias) {
    const double u = is_half(c.dtype) ? std::ldexp(1.0, -11) : std::ldexp(1.0, -8);
    double worst_cuda = 0, worst_cpu = 0;
    for (size_t x = 0; x < o.dbias.size(); ++x) {
      const double tol = 2 * u * (std::abs(o.dbias[x]) + o.m_dbias[x]) + 1e-6;
      worst_cuda = std::max(worst_cuda, std::abs(g_dbias[x] - o.dbias[x]) / tol);
      worst_cpu = std::max(worst_cpu, std::abs(cpu_dbias[x] - o.dbias[x]) / tol);
    }
    std::cout << "[ cuda_flash ] " << c.name << " dbias: error / tolerance " << worst_cuda << " (cpu_flash "
              << worst_cpu << ")\n";
    EXPECT_LE(worst_cuda, 1.0) << c.name << " dbias: cuda_flash vs the float64 oracle";
    EXPECT_LE(worst_cpu, 1.0) << c.name << " dbias: cpu_flash vs the float64 oracle";
  }
  int64_t lse_bad = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const bool none = std::isinf(o.lse[r]);
    const bool ok = none ? std::isinf(g_lse[r]) && g_lse[r] < 0
                         : std::abs(g_lse[r] - o.lse[r]) <= 1e-4 * std::max(1.0, std::abs(o.lse[r]));
    if (!ok && lse_bad++ < 3) ADD_FAILURE() << c.name << " lse row " << r << ": " << g_lse[r] << " vs " << o.lse[r];
  }
}

}  // namespace dimattn::kernels::test
