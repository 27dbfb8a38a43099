// Attention variants (sliding windows, soft-capping, ALiBi, sinks, bias,
// mask and segment ids over named dims): the reference path against float64 loops, cpu_flash
// against the reference path (outputs, and gradients of q, k, v, the sinks
// and the bias), the selection's reasons.
// Bad options are rows of docs/errors.md (tests/reliability/bad_input_test.cpp).
#include <cmath>
#include <limits>

#include "dimattn/attention.h"
#include "dimattn/forcing.h"
#include "dimattn/registry.h"
#include "dimattn/run_context.h"
#include "support/test_util.h"

namespace dimattn {
namespace {
using testing::error_of;
using testing::max_abs_diff;

struct Variant {
  std::string name;
  bool causal = false;
  std::optional<int64_t> left, right;  // window
  double softcap = 0;
  bool alibi = false, sinks = false, off_by_one = false;
  std::vector<double> offsets;  // per batch entry (B = 2); empty = none
  std::vector<double> lengths;  // kv lengths per batch entry; empty = static
  double dropout = 0;
  bool bias = false;  // over {heads, tq, tk}: bias_value
  bool mask = false;  // over {batch, tq, tk}: mask_value (row 1 of entry 0 attends nothing)
  bool segments = false;  // ids over {batch, tq} and {batch, tk}: segment_q, segment_k (row 2 of entry 0 attends nothing)
};

double bias_value(int h, int i, int j) { return 0.3 * (h + 1) * std::sin(7.0 * i + 3.0 * j); }
bool mask_value(int b, int i, int j) { return !(b == 0 && i == 1) && (3 * i + 5 * j + b) % 4 != 0; }
int64_t segment_q(int b, int i) { return b == 0 && i == 2 ? 9 : (i + b) / 2; }
int64_t segment_k(int b, int j) { return (j + 2 * b) / 3; }

std::vector<Variant> variants() {
  return {
      {.name = "window_causal_offsets", .causal = true, .left = 3, .offsets = {2, 2}},
      {.name = "window_two_sided_offsets", .left = 2, .right = 1, .offsets = {3, -1}},
      {.name = "window_left_only_lengths", .left = 2, .lengths = {7, 3}},
      {.name = "softcap", .softcap = 0.7},
      {.name = "alibi_causal_offsets", .causal = true, .alibi = true, .offsets = {2, 0}},
      {.name = "sinks_lengths_empty_entry", .sinks = true, .lengths = {7, 0}},
      {.name = "off_by_one_causal", .causal = true, .off_by_one = true, .offsets = {1, 2}},
      {.name = "bias", .bias = true},
      {.name = "mask_empty_row_lengths", .lengths = {7, 4}, .mask = true},
      {.name = "segments_causal_lengths", .causal = true, .offsets = {2, 2}, .lengths = {7, 6}, .segments = true},
      {.name = "all_with_dropout", .causal = true, .left = 4, .softcap = 1.5, .alibi = true, .sinks = true,
       .offsets = {2, 1}, .lengths = {7, 5}, .dropout = 0.3, .bias = true, .mask = true, .segments = true},
  };
}

constexpr int B = 2, H = 3, Tq = 5, Tk = 7, D = 4, Dv = 3;

// The options' semantics as float64 loops over [B][H][Tq][Tk] (no dropout).
std::vector<double> loop_attention(const Variant& v, const std::vector<double>& q, const std::vector<double>& k,
                                   const std::vector<double>& val, const std::vector<double>& slopes,
                                   const std::vector<double>& sinks, double scale) {
  std::vector<double> out(B * H * Tq * Dv, 0.0);
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < H; ++h)
      for (int i = 0; i < Tq; ++i) {
        const double off = v.offsets.empty() ? 0 : v.offsets[b];
        const double len = v.lengths.empty() ? Tk : v.lengths[b];
        std::vector<double> e(Tk, -INFINITY);
        double mx = v.sinks ? sinks[h] : v.off_by_one ? 0.0 : -INFINITY;
        for (int j = 0; j < Tk; ++j) {
          const double d = i + off - j;  // distance to the diagonal
          const bool ok = j < len && (!v.causal || d >= 0) && (!v.left || d <= static_cast<double>(*v.left)) &&
                          (!v.right || d >= -static_cast<double>(*v.right)) && (!v.mask || mask_value(b, i, j)) &&
                          (!v.segments || segment_q(b, i) == segment_k(b, j));
          if (!ok) continue;
          double s = 0;
          for (int c = 0; c < D; ++c) s += q[((b * H + h) * Tq + i) * D + c] * k[((b * H + h) * Tk + j) * D + c];
          s *= scale;
          if (v.softcap > 0) s = v.softcap * std::tanh(s / v.softcap);
          if (v.bias) s += bias_value(h, i, j);
          if (v.alibi) s -= slopes[h] * std::abs(d);
          e[j] = s;
          mx = std::max(mx, s);
        }
        if (mx == -INFINITY) continue;
        double z = v.sinks ? std::exp(sinks[h] - mx) : v.off_by_one ? std::exp(-mx) : 0.0;
        for (int j = 0; j < Tk; ++j) z += std::exp(e[j] - mx);
        for (int j = 0; j < Tk; ++j)
          for (int c = 0; c < Dv; ++c)
            out[((b * H + h) * Tq + i) * Dv + c] += std::exp(e[j] - mx) / z * val[((b * H + h) * Tk + j) * Dv + c];
      }
  return out;
}

// One call's operands and options for a variant, on a backend.
struct Call {
  Dim batch{"batch", B}, heads{"heads", H}, tq{"tq", Tq}, feat{"feat", D}, vfeat{"vfeat", Dv};
  Dim tk;
  Tensor q, k, v;
  std::optional<Tensor> slopes, sinks, bias;
  AttentionOptions opts;

  Call(const Variant& var, DType dtype, const std::string& backend)
      : tk(var.lengths.empty()
               ? Dim("tk", Tk)
               : Dim::dynamic("tk", from_host({batch}, var.lengths, {.dtype = DType::int64, .backend = backend}), Tk)),
        q(random_normal({batch, heads, tq, feat}, 1, {.dtype = dtype, .backend = backend})),
        k(random_normal({batch, heads, tk, feat}, 2, {.dtype = dtype, .backend = backend})),
        v(random_normal({batch, heads, tk, vfeat}, 3, {.dtype = dtype, .backend = backend})),
        opts{.key_dim = feat, .axis = tk} {
    const TensorOptions o{.dtype = dtype, .backend = backend};
    if (var.causal)
      opts.causal_query_spatial_dim = tq;
    else if (var.left || var.right || var.alibi)
      opts.query_position_dim = tq;
    if (!var.offsets.empty())
      opts.causal_offset = from_host({batch}, var.offsets, {.dtype = DType::int64, .backend = backend});
    if (var.left || var.right) opts.variants.window = AttentionWindow{var.left, var.right};
    if (var.softcap > 0) opts.variants.softcap = var.softcap;
    if (var.alibi) opts.variants.alibi_slopes = slopes = from_host({heads}, {0.5, 0.25, 0.125}, o);
    if (var.sinks) opts.variants.sinks = sinks = from_host({heads}, {0.3, -1.0, 2.0}, o);
    opts.variants.sink_off_by_one = var.off_by_one;
    opts.att_dropout = var.dropout;
    std::vector<double> bv, mv;
    for (int b = 0; b < B; ++b)
      for (int i = 0; i < Tq; ++i)
        for (int j = 0; j < Tk; ++j) mv.push_back(mask_value(b, i, j));
    for (int h = 0; h < H; ++h)
      for (int i = 0; i < Tq; ++i)
        for (int j = 0; j < Tk; ++j) bv.push_back(bias_value(h, i, j));
    if (var.bias) opts.variants.bias = bias = from_host({heads, tq, tk}, bv, o);
    if (var.mask) opts.variants.mask = from_host({batch, tq, tk}, mv, {.dtype = DType::boolean, .backend = backend});
    if (var.segments) {  // int32 on the query side, int64 on the kv side: either dtype is taken
      std::vector<double> sq, sk;
      for (int b = 0; b < B; ++b) {
        for (int i = 0; i < Tq; ++i) sq.push_back(static_cast<double>(segment_q(b, i)));
        for (int j = 0; j < Tk; ++j) sk.push_back(static_cast<double>(segment_k(b, j)));
      }
      opts.variants.query_segments = from_host({batch, tq}, sq, {.dtype = DType::int32, .backend = backend});
      opts.variants.kv_segments = from_host({batch, tk}, sk, {.dtype = DType::int64, .backend = backend});
    }
  }
};

using AttentionVariants = ::testing::TestWithParam<std::string>;

TEST_P(AttentionVariants, ReferenceMatchesFloat64Loops) {
  int ran = 0;
  for (const Variant& var : variants()) {
    if (var.dropout > 0) continue;
    SCOPED_TRACE(var.name);
    Call c(var, DType::float64, GetParam());
    const std::vector<double> slopes = {0.5, 0.25, 0.125}, sinks = {0.3, -1.0, 2.0};
    ForceKernels force("reference");
    const Tensor out = dot_attention(c.q, c.k, c.v, c.opts);
    const std::vector<double> want = loop_attention(var, to_host(c.q, Dims{c.batch, c.heads, c.tq, c.feat}),
                                                    to_host(c.k, Dims{c.batch, c.heads, c.tk, c.feat}),
                                                    to_host(c.v, Dims{c.batch, c.heads, c.tk, c.vfeat}), slopes, sinks,
                                                    1.0 / std::sqrt(static_cast<double>(D)));
    const std::vector<double> got = to_host(out, Dims{c.batch, c.heads, c.tq, c.vfeat});
    double worst = 0;
    for (size_t x = 0; x < want.size(); ++x) worst = std::max(worst, std::abs(got[x] - want[x]));
    EXPECT_LT(worst, 1e-12);
    ++ran;
  }
  EXPECT_EQ(ran, 10);
}

// cpu_flash computes every variant; with dropout too (the shared Philox mask).
TEST_P(AttentionVariants, CpuFlashMatchesTheReferencePath) {
  int ran = 0;
  for (DType dtype : {DType::float64, DType::float32})
    for (const Variant& var : variants()) {
      SCOPED_TRACE(var.name + " " + dtype_name(dtype));
      Call c(var, dtype, GetParam());
      TrainFlagScope train(true);
      set_random_seed(11);
      auto run = [&](const char* kernel) {
        set_random_seed(11);
        ForceKernels force(kernel);
        return dot_attention(c.q, c.k, c.v, c.opts);
      };
      const Tensor ref = run("reference"), fused = run("cpu_flash");
      EXPECT_LT(max_abs_diff(fused, ref, ref.dims()), reference_tolerance(dtype));
      ++ran;
    }
  EXPECT_EQ(ran, 22);
}

// Gradients of q, k, v, the sinks and the bias: cpu_flash's backward (torch: its
// autograd function; Eigen: dot_attention_backward) against the reference
// path's autograd on the torch backend.
TEST_P(AttentionVariants, CpuFlashGradientsMatchTheReferencePath) {
  if (!has_backend("torch")) GTEST_SKIP() << "the reference gradients come from the torch backend's autograd";
  int ran = 0;
  for (const Variant& var : variants()) {
    SCOPED_TRACE(var.name);
    const double tol = 2 * reference_tolerance(DType::float64);
    Call c(var, DType::float64, GetParam());
    const Tensor dout = random_normal({c.batch, c.heads, c.tq, c.vfeat}, 9, {.dtype = DType::float64,
                                                                             .backend = GetParam()});
    TrainFlagScope train(true);
    // The reference path's autograd on torch, the same operands.
    Call r = c;
    // A fresh leaf each time: on the torch backend to_backend returns x
    // itself, and the reference's and cpu_flash's gradients would otherwise
    // accumulate into the same .grad (and compare equal whatever they are).
    auto leaf = [](const Tensor& x) { return mul(to_backend(x, "torch"), 1.0).requires_grad(true); };
    r.q = leaf(c.q), r.k = leaf(c.k), r.v = leaf(c.v);
    if (c.sinks) r.opts.variants.sinks = leaf(*c.sinks);
    if (c.bias) r.opts.variants.bias = leaf(*c.bias);
    if (c.opts.variants.mask) r.opts.variants.mask = to_backend(*c.opts.variants.mask, "torch");
    for (std::optional<Tensor>* ids : {&r.opts.variants.query_segments, &r.opts.variants.kv_segments})
      if (*ids) *ids = to_backend(**ids, "torch");
    if (c.slopes) r.opts.variants.alibi_slopes = to_backend(*c.slopes, "torch");
    if (c.opts.causal_offset) r.opts.causal_offset = to_backend(*c.opts.causal_offset, "torch");
    set_random_seed(5);
    {
      ForceKernels force("reference");
      reduce_sum(mul(dot_attention(r.q, r.k, r.v, r.opts), to_backend(dout, "torch")), dout.dims()).backward();
    }
    // cpu_flash's gradients on this test's backend.
    set_random_seed(5);
    ForceKernels force("cpu_flash");
    auto fused_grads = [&]() -> AttentionGrads {
      if (GetParam() != "torch") return dot_attention_backward(c.q, c.k, c.v, c.opts, dout);
      Call f = c;
      f.q = leaf(c.q), f.k = leaf(c.k), f.v = leaf(c.v);
      if (c.sinks) f.opts.variants.sinks = leaf(*c.sinks);
      if (c.bias) f.opts.variants.bias = leaf(*c.bias);
      reduce_sum(mul(dot_attention(f.q, f.k, f.v, f.opts), dout), dout.dims()).backward();
      AttentionGrads g{*f.q.grad(), *f.k.grad(), *f.v.grad(), {}};
      if (c.sinks) g.variants.sinks = f.opts.variants.sinks->grad();
      if (c.bias) g.variants.bias = f.opts.variants.bias->grad();
      return g;
    };
    const AttentionGrads g = fused_grads();
    EXPECT_LT(max_abs_diff(g.query, *r.q.grad(), c.q.dims()), tol) << "dq";
    EXPECT_LT(max_abs_diff(g.keys, *r.k.grad(), c.k.dims()), tol) << "dk";
    EXPECT_LT(max_abs_diff(g.values, *r.v.grad(), c.v.dims()), tol) << "dv";
    if (c.sinks) {
      ASSERT_TRUE(g.variants.sinks.has_value()) << "no sinks gradient";
      EXPECT_LT(max_abs_diff(*g.variants.sinks, *r.opts.variants.sinks->grad(), c.sinks->dims()), tol) << "dsinks";
    }
    if (c.bias) {
      ASSERT_TRUE(g.variants.bias.has_value()) << "no bias gradient";
      EXPECT_LT(max_abs_diff(*g.variants.bias, *r.opts.variants.bias->grad(), c.bias->dims()), tol) << "dbias";
    }
    ++ran;
  }
  EXPECT_EQ(ran, 11);
}

TEST_P(AttentionVariants, FusedKernelsOfAtenNameTheVariantTheyLack) {
  if (GetParam() != "torch") GTEST_SKIP() << "ATen's kernels are the torch backend's";
  const Variant var{.name = "window", .causal = true, .left = 3, .offsets = {2, 2}};
  Call c(var, DType::float32, GetParam());
  const Decision d = explain_attention(c.q, c.k, c.v, c.opts);
  EXPECT_EQ(d.kernel, "cpu_flash") << d.explain();
  ForceKernels force("aten_flash_cpu");
  EXPECT_NE(error_of([&] { dot_attention(c.q, c.k, c.v, c.opts); }).find("does not take a sliding window"),
            std::string::npos);
}

// A mask that leaves a row nothing gives 0 there on every path, never NaN;
// the same mask as a -inf bias gives the same result.
TEST_P(AttentionVariants, MaskedRowIsZeroAndBiasOfMinusInfinityMasksAlike) {
  const Variant var{.name = "mask", .mask = true};
  Call c(var, DType::float32, GetParam());
  AttentionOptions as_bias = c.opts;
  as_bias.variants.mask.reset();
  const Tensor zeros = mul(cast(*c.opts.variants.mask, DType::float32), 0.0);
  as_bias.variants.bias = where(*c.opts.variants.mask, zeros, -std::numeric_limits<double>::infinity());
  int ran = 0;
  for (const char* kernel : {"reference", "cpu_flash"}) {
    ForceKernels force(kernel);
    const Tensor out = dot_attention(c.q, c.k, c.v, c.opts);
    const std::vector<double> x = to_host(out, Dims{c.batch, c.heads, c.tq, c.vfeat});
    for (int h = 0; h < H; ++h)
      for (int e = 0; e < Dv; ++e) EXPECT_EQ(x[((0 * H + h) * Tq + 1) * Dv + e], 0.0) << kernel;
    for (double y : x) EXPECT_TRUE(std::isfinite(y)) << kernel;
    EXPECT_LT(max_abs_diff(dot_attention(c.q, c.k, c.v, as_bias), out, out.dims()), 1e-6) << kernel;
    ++ran;
  }
  EXPECT_EQ(ran, 2);
}

// A bias given as a broadcast view (stride 0 over heads) and one over the
// same values in another dim order are read as they are, with the same result.
TEST_P(AttentionVariants, BroadcastAndPermutedBiasGiveTheSameResult) {
  const Variant var{.name = "bias", .bias = true};
  Call c(var, DType::float32, GetParam());
  const Tensor plane = random_normal({c.tq, c.tk}, 21, {.backend = GetParam()});
  AttentionOptions broadcast = c.opts, permuted = c.opts, plain = c.opts;
  broadcast.variants.bias = expand_dim(plane, c.heads);
  permuted.variants.bias = copy_transpose(plane, {c.tk, c.tq});
  plain.variants.bias = plane;
  int ran = 0;
  for (const char* kernel : {"reference", "cpu_flash"}) {
    ForceKernels force(kernel);
    const Tensor want = dot_attention(c.q, c.k, c.v, plain);
    EXPECT_LT(max_abs_diff(dot_attention(c.q, c.k, c.v, broadcast), want, want.dims()), 1e-6) << kernel;
    EXPECT_LT(max_abs_diff(dot_attention(c.q, c.k, c.v, permuted), want, want.dims()), 1e-6) << kernel;
    ++ran;
  }
  EXPECT_EQ(ran, 2);
}

// Causal self-attention with one [batch, t] tensor of segment ids as both
// sides (the query side reads t as the query position, the kv side as the
// kv position) equals the same call with keys and values over their own kv
// dim and a bool mask [batch, t, kv] of equal ids; on every CPU path.
TEST_P(AttentionVariants, SelfAttentionSegmentsFromOneTensorEqualABoolMask) {
  const Dim batch("batch", 2), t("t", 37), kv("kv", 37), feat("feat", 8);
  const TensorOptions o{.backend = GetParam()};
  const Tensor x = random_normal({batch, t, feat}, 31, o);
  std::vector<double> ids;
  for (int b = 0; b < 2; ++b)
    for (int i = 0; i < 37; ++i) ids.push_back(b == 0 ? i / 10 : (i < 5 ? 0 : i < 6 ? 1 : 2));
  const Tensor seg = from_host({batch, t}, ids, {.dtype = DType::int64, .backend = GetParam()});
  AttentionOptions segmented{.key_dim = feat, .axis = t, .causal_query_spatial_dim = t,
                             .variants = {.query_segments = seg, .kv_segments = seg}};
  AttentionOptions masked{.key_dim = feat, .axis = kv, .causal_query_spatial_dim = t};
  masked.variants.mask = compare(seg, Compare::eq, replace_dim(seg, t, kv));
  const Tensor xk = replace_dim(x, t, kv);
  int ran = 0;
  for (const char* kernel : {"reference", "cpu_flash"}) {
    ForceKernels force(kernel);
    const Tensor want = dot_attention(x, xk, xk, masked);
    EXPECT_LT(max_abs_diff(dot_attention(x, x, x, segmented), want, want.dims()), 1e-6) << kernel;
    ++ran;
  }
  EXPECT_EQ(ran, 2);
}

// Sinks per GQA query head in one decoding step: the group dim (2) is longer
// than the query's one position, but sinks vary over it, so it stays a
// group (it was taken for the query's spatial dim, and the sinks then had no
// per-head plane: an internal error). Equal to the same call with the step
// named as the position.
TEST_P(AttentionVariants, SinksOverGqaGroupsInADecodingStep) {
  const Dim batch("batch", 2), heads("heads", 2), group("group", 2), step("step", 1), kv("kv", 7), feat("feat", 8);
  const TensorOptions o{.backend = GetParam()};
  const Tensor q = random_normal({batch, heads, group, step, feat}, 41, o);
  const Tensor k = random_normal({batch, heads, kv, feat}, 42, o), v = random_normal({batch, heads, kv, feat}, 43, o);
  const Tensor sinks = from_host({heads, group}, {0.5, -1, 2, 0}, o);
  AttentionOptions opts{.key_dim = feat, .axis = kv, .variants = {.sinks = sinks}};
  const Tensor got = dot_attention(q, k, v, opts);
  opts.query_position_dim = step;
  const Tensor want = dot_attention(q, k, v, opts);
  EXPECT_LT(max_abs_diff(got, want, want.dims()), 1e-6);
}

// The same without a step dim: every dim of the query's own (the GQA group)
// carries sinks or ALiBi slopes, so none can be its positions, and the call
// is one decoding step over them (the group was taken for the positions
// before, and the sinks again had no per-head plane). Found by
// KvCache.RandomCasesMatchThePlainCache. Equal to the call with a size-1
// step dim added.
TEST_P(AttentionVariants, PerHeadValuesOverEveryQueryDimMakeADecodingStep) {
  const Dim batch("batch", 2), heads("heads", 2), group("group", 3), step("step", 1), kv("kv", 7), feat("feat", 8);
  const TensorOptions o{.backend = GetParam()};
  const Tensor q = random_normal({batch, heads, group, feat}, 44, o);
  const Tensor k = random_normal({batch, heads, kv, feat}, 45, o), v = random_normal({batch, heads, kv, feat}, 46, o);
  int ran = 0;
  for (bool alibi : {false, true}) {
    SCOPED_TRACE(alibi ? "alibi" : "sinks");
    const Tensor per_head = from_host({heads, group}, {0.5, -1, 2, 0, 0.25, 1}, o);
    AttentionOptions opts{.key_dim = feat, .axis = kv};
    if (alibi) {
      // ALiBi measures distances along positions: only the step's own.
      opts.variants.alibi_slopes = per_head;
      EXPECT_NE(error_of([&] { dot_attention(q, k, v, opts); }).find("query_position_dim"), std::string::npos);
      ++ran;
      continue;
    }
    opts.variants.sinks = per_head;
    const Tensor got = dot_attention(q, k, v, opts);
    AttentionOptions stepped = opts;
    stepped.query_position_dim = step;
    const Tensor want = squeeze(dot_attention(expand_dim(q, step), k, v, stepped), step);
    EXPECT_EQ(got.dims(), want.dims());
    EXPECT_LT(max_abs_diff(got, want, want.dims()), 1e-6);
    ++ran;
  }
  EXPECT_EQ(ran, 2);
}

INSTANTIATE_TEST_SUITE_P(Backends, AttentionVariants, ::testing::ValuesIn(backend_names()),
                         testing::backend_param_name);

}  // namespace
}  // namespace dimattn
