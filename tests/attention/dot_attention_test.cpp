// dot_attention's contract (DESIGN.md §3) on every backend.
#include <algorithm>
#include <cmath>

#include "dimattn/attention.h"
#include "dimattn/forcing.h"
#include "dimattn/run_context.h"
#include "dimattn/trace.h"
#include "support/test_util.h"

namespace dimattn {
namespace {
using testing::any_nan;
using testing::error_of;
using testing::max_abs_diff;
using testing::same_dims;

class DotAttention : public ::testing::TestWithParam<std::string> {
 protected:
  TensorOptions opts(DType dtype = DType::float32) const { return {.dtype = dtype, .backend = GetParam()}; }
  Tensor randn(const Dims& dims, uint64_t seed, DType dtype = DType::float32) const {
    return random_normal(dims, seed, opts(dtype));
  }
  Tensor lengths(const Dim& batch, const std::vector<double>& lens) const {
    return from_host({batch}, lens, {.dtype = DType::int64, .backend = GetParam()});
  }
};

// --- an independent dense computation in plain loops, float64 ---
struct Dense {
  int B, Tq, Tk, D, Dv;
  std::vector<double> q, k, v;  // [B][Tq][D], [B][Tk][D], [B][Tk][Dv]
  std::vector<int> kv_len;      // per entry
  bool causal = false;
  std::vector<int> offset;  // per entry
  double scale;

  std::vector<double> run() const {
    std::vector<double> out(static_cast<size_t>(B) * Tq * Dv, 0.0);
    for (int b = 0; b < B; ++b)
      for (int i = 0; i < Tq; ++i) {
        std::vector<double> e(Tk);
        double mx = -INFINITY;
        for (int j = 0; j < Tk; ++j) {
          bool ok = j < kv_len[b] && (!causal || j <= i + offset[b]);
          double s = 0;
          for (int d = 0; d < D; ++d) s += q[(b * Tq + i) * D + d] * k[(b * Tk + j) * D + d];
          e[j] = ok ? s * scale : -INFINITY;
          mx = std::max(mx, e[j]);
        }
        if (mx == -INFINITY) continue;  // no valid position: output 0
        double z = 0;
        for (int j = 0; j < Tk; ++j) z += e[j] == -INFINITY ? 0 : std::exp(e[j] - mx);
        for (int j = 0; j < Tk; ++j) {
          if (e[j] == -INFINITY) continue;
          double w = std::exp(e[j] - mx) / z;
          for (int d = 0; d < Dv; ++d) out[(b * Tq + i) * Dv + d] += w * v[(b * Tk + j) * Dv + d];
        }
      }
    return out;
  }
};

TEST_P(DotAttention, MatchesDenseLoopsWithLengthsAndCausalOffsets) {
  for (int c = 0; c < 6; ++c) {
    const bool causal = c % 2 == 1;
    const int B = 3, Tq = causal ? 4 : 3 + c, Tk = 6, D = 5, Dv = 3;
    Dense ref{B, Tq, Tk, D, Dv};
    ref.kv_len = {6, c == 4 ? 0 : 2, 5};
    ref.causal = causal;
    ref.offset = {2, 0, 1};
    ref.scale = 0.37;
    Dim batch("batch", B), tq("tq", Tq), feat("feat", D), vfeat("vfeat", Dv);
    Dim tk = Dim::dynamic("tk", lengths(batch, {6, c == 4 ? 0.0 : 2.0, 5}), Tk);
    Tensor q = randn({batch, tq, feat}, 10 + c, DType::float64);
    Tensor k = randn({batch, tk, feat}, 20 + c, DType::float64);
    Tensor v = randn({batch, tk, vfeat}, 30 + c, DType::float64);
    ref.q = to_host(q);
    ref.k = to_host(k);
    ref.v = to_host(v);
    AttentionOptions o{.key_dim = feat, .axis = tk, .scale = 0.37};
    if (causal) {
      o.causal_query_spatial_dim = tq;
      o.causal_offset = lengths(batch, {2, 0, 1});
    }
    Tensor out = dot_attention(q, k, v, o);
    std::vector<double> got = to_host(out, Dims{batch, tq, vfeat}), want = ref.run();
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], want[i], 1e-10) << "case " << c << " at " << i;
  }
}

TEST_P(DotAttention, OutputDimsFollowTheContract) {
  Dim batch("batch", 2), heads("heads", 2), time("time", 3), enc("enc", 4), beam("beam", 3), feat("feat", 4),
      vfeat("vfeat", 5), extra("extra", 2);
  struct Case {
    Dims q, k, v, expected;
    Dim axis;
  };
  std::vector<Case> cases = {
      {{batch, heads, time, feat}, {batch, heads, enc, feat}, {batch, heads, enc, vfeat},
       {batch, heads, time, vfeat}, enc},
      {{batch, heads, beam, time, feat}, {batch, heads, enc, feat}, {batch, heads, enc, vfeat},
       {batch, heads, beam, time, vfeat}, enc},
      {{batch, feat}, {batch, enc, feat}, {batch, enc, vfeat}, {batch, vfeat}, enc},  // single step
      {{batch, time, feat}, {batch, time, feat}, {batch, time, vfeat}, {batch, time, vfeat}, time},  // self
      {{batch, time, feat}, {batch, extra, enc, feat}, {batch, extra, enc, vfeat},
       {batch, extra, time, vfeat}, enc},  // keys-only dim broadcast
  };
  for (const Case& c : cases) {
    Tensor out = dot_attention(randn(c.q, 1), randn(c.k, 2), randn(c.v, 3), {.key_dim = feat, .axis = c.axis});
    EXPECT_TRUE(same_dims(out.dims(), c.expected)) << repr(out.dims()) << " vs " << repr(c.expected);
  }
}

TEST_P(DotAttention, BatchEntryAloneEqualsBatched) {
  Dim batch("batch", 3), feat("feat", 8), vfeat("vfeat", 4);
  const std::vector<double> lens = {5, 2, 7};
  Dim time = Dim::dynamic("time", lengths(batch, lens));
  Tensor x = randn({batch, time, feat}, 7);
  Tensor v = randn({batch, time, vfeat}, 8);
  for (bool causal : {false, true}) {
    AttentionOptions o{.key_dim = feat, .axis = time};
    if (causal) o.causal_query_spatial_dim = time;
    Tensor out = dot_attention(x, x, v, o);
    for (int b = 0; b < 3; ++b) {
      Dim one("one", 1), t_b("t_b", static_cast<int64_t>(lens[b]));
      auto entry = [&](const Tensor& t) {
        Tensor e = squeeze(slice(t, batch, b, b + 1, one).first, one);
        return slice(e, time, 0, t_b.extent(), t_b).first;
      };
      AttentionOptions ob{.key_dim = feat, .axis = t_b};
      if (causal) ob.causal_query_spatial_dim = t_b;
      Tensor alone = dot_attention(entry(x), entry(x), entry(v), ob);
      EXPECT_LT(max_abs_diff(entry(out), alone, {t_b, vfeat}), 1e-5) << "entry " << b << " causal " << causal;
    }
  }
}

TEST_P(DotAttention, CrossAttentionWithBeamEqualsLoopOverBeams) {
  Dim batch("batch", 2), beam("beam", 3), time("time", 2), feat("feat", 4), vfeat("vfeat", 3);
  Dim enc = Dim::dynamic("enc", lengths(batch, {5, 3}));
  Tensor q = randn({batch, beam, time, feat}, 1);
  Tensor k = randn({batch, enc, feat}, 2), v = randn({batch, enc, vfeat}, 3);
  TraceScope trace(false);
  Tensor out = dot_attention(q, k, v, {.key_dim = feat, .axis = enc});
  // Keys and values reached the kernel without a beam dim: their element
  // counts are those of the encoder alone.
  ASSERT_EQ(trace.records().size(), 1u);
  int64_t keys_elems = 1;
  for (int64_t s : trace.records()[0].keys_shape) keys_elems *= s;
  EXPECT_EQ(keys_elems, k.numel());
  for (int64_t be = 0; be < 3; ++be) {
    Dim one("one", 1);
    Tensor qb = squeeze(slice(q, beam, be, be + 1, one).first, one);
    Tensor ob = dot_attention(qb, k, v, {.key_dim = feat, .axis = enc});
    Tensor out_b = squeeze(slice(out, beam, be, be + 1, one).first, one);
    EXPECT_LT(max_abs_diff(out_b, ob, {batch, time, vfeat}), 1e-6);
  }
}

TEST_P(DotAttention, KeysOnlyDimsBroadcastLikeAnExplicitLoop) {
  Dim batch("batch", 2), extra("extra", 3), time("time", 4), enc("enc", 5), feat("feat", 4), vfeat("vfeat", 3);
  Tensor q = randn({batch, time, feat}, 1);
  Tensor k = randn({batch, extra, enc, feat}, 2), v = randn({batch, extra, enc, vfeat}, 3);
  Tensor out = dot_attention(q, k, v, {.key_dim = feat, .axis = enc});
  for (int64_t e = 0; e < 3; ++e) {
    Dim one("one", 1);
    auto pick = [&](const Tensor& t) { return squeeze(slice(t, extra, e, e + 1, one).first, one); };
    Tensor oe = dot_attention(q, pick(k), pick(v), {.key_dim = feat, .axis = enc});
    EXPECT_LT(max_abs_diff(pick(out), oe, {batch, time, vfeat}), 1e-6);
  }
}

TEST_P(DotAttention, AxisInQueryEqualsExplicitRelabel) {
  Dim batch("batch", 2), feat("feat", 4), vfeat("vfeat", 3);
  Dim time = Dim::dynamic("time", lengths(batch, {4, 2}));
  Tensor x = randn({batch, time, feat}, 4), v = randn({batch, time, vfeat}, 5);
  Tensor self = dot_attention(x, x, v, {.key_dim = feat, .axis = time});
  Dim kv = Dim::dynamic("kv", time.lengths(), time.extent());
  Tensor explicit_kv = dot_attention(x, replace_dim(x, time, kv), replace_dim(v, time, kv), {.key_dim = feat, .axis = kv});
  EXPECT_LT(max_abs_diff(self, explicit_kv, {batch, time, vfeat}), 1e-6);
}

TEST_P(DotAttention, SingleStepQueryGetsDummySpatialDim) {
  Dim batch("batch", 2), enc("enc", 5), feat("feat", 4), vfeat("vfeat", 3), one("one", 1);
  Tensor q = randn({batch, feat}, 1), k = randn({batch, enc, feat}, 2), v = randn({batch, enc, vfeat}, 3);
  Tensor step = dot_attention(q, k, v, {.key_dim = feat, .axis = enc});
  EXPECT_TRUE(same_dims(step.dims(), {batch, vfeat}));
  Tensor with_dim = dot_attention(expand_dim(q, one), k, v, {.key_dim = feat, .axis = enc});
  EXPECT_LT(max_abs_diff(step, squeeze(with_dim, one), {batch, vfeat}), 1e-6);
}

TEST_P(DotAttention, FullyMaskedRowsGiveZeroNotNaN) {
  Dim batch("batch", 3), time("time", 4), feat("feat", 4), vfeat("vfeat", 2);
  Dim enc = Dim::dynamic("enc", lengths(batch, {3, 0, 1}), 3);
  Tensor q = randn({batch, time, feat}, 1), k = randn({batch, enc, feat}, 2), v = randn({batch, enc, vfeat}, 3);
  TraceScope trace;
  Tensor out = dot_attention(q, k, v, {.key_dim = feat, .axis = enc});
  EXPECT_FALSE(any_nan(out));
  EXPECT_FALSE(any_nan(*trace.records()[0].att_weights));
  std::vector<double> host = to_host(out, Dims{batch, time, vfeat});
  for (int i = 8; i < 16; ++i) EXPECT_EQ(host[i], 0.0) << "entry 1 has no keys";
  // Causal with a negative effective offset: query 0 sees nothing.
  Dim t2("t2", 3);
  Tensor q2 = randn({batch, t2, feat}, 4);
  AttentionOptions o{.key_dim = feat, .axis = enc, .causal_query_spatial_dim = t2,
                     .causal_offset = scalar(-1, {.dtype = DType::int64, .backend = GetParam()})};
  Tensor out2 = dot_attention(q2, k, v, o);
  EXPECT_FALSE(any_nan(out2));
  std::vector<double> h2 = to_host(out2, Dims{batch, t2, vfeat});
  EXPECT_EQ(h2[0], 0.0);
  EXPECT_EQ(h2[1], 0.0);
}

TEST_P(DotAttention, TraceRecordsEnergyAndWeights) {
  Dim batch("batch", 2), time("time", 3), feat("feat", 4), vfeat("vfeat", 2);
  Dim enc = Dim::dynamic("enc", lengths(batch, {4, 2}));
  Tensor q = randn({batch, time, feat}, 1), k = randn({batch, enc, feat}, 2), v = randn({batch, enc, vfeat}, 3);
  TraceScope outer;
  {
    TraceScope inner;
    dot_attention(q, k, v, {.key_dim = feat, .axis = enc, .scale = 0.25});
    ASSERT_EQ(inner.records().size(), 1u);
  }
  ASSERT_EQ(outer.records().size(), 1u);
  const AttentionTrace& t = outer.records()[0];
  EXPECT_EQ(t.kernel, "reference");
  Tensor expected_energy = mul(matmul(q, k, {feat}), 0.25);
  EXPECT_TRUE(same_dims(t.energy->dims(), {batch, time, enc}));
  EXPECT_LT(max_abs_diff(*t.energy, expected_energy, {batch, time, enc}), 1e-5);
  std::vector<double> w = to_host(*t.att_weights, Dims{batch, time, enc});
  const int lens[] = {4, 2};
  for (int b = 0; b < 2; ++b)
    for (int i = 0; i < 3; ++i) {
      double sum = 0;
      for (int j = 0; j < 4; ++j) {
        double x = w[(b * 3 + i) * 4 + j];
        if (j >= lens[b]) EXPECT_EQ(x, 0.0);
        sum += x;
      }
      EXPECT_NEAR(sum, 1.0, 1e-5);
    }
}

TEST_P(DotAttention, ForcingIsRecordedOrRejectedWithReasons) {
  Dim time("time", 3), feat("feat", 4);
  Tensor x = randn({time, feat}, 1);
  {
    ForceKernels force("reference");
    TraceScope trace(false);
    dot_attention(x, x, x, {.key_dim = feat, .axis = time});
    EXPECT_EQ(trace.records().at(0).kernel, "reference");
  }
  const std::vector<std::string> known = all_kernel_names();
  if (std::find(known.begin(), known.end(), "cuda_flash") != known.end()) {
    ForceKernels force("cuda_flash");
    std::string msg = error_of([&] { dot_attention(x, x, x, {.key_dim = feat, .axis = time}); });
    EXPECT_NE(msg.find("[dot_attention]"), std::string::npos) << msg;
    EXPECT_NE(msg.find("cuda_flash"), std::string::npos) << msg;
  } else {  // a build whose backends have no cuda_flash: forcing it names the kernels there are
    EXPECT_NE(error_of([] { ForceKernels f("cuda_flash"); }).find("unknown kernel 'cuda_flash'"), std::string::npos);
  }
  {
    ForceKernels force("cpu_flash");
    TraceScope trace;  // capturing needs the reference path
    std::string msg = error_of([&] { dot_attention(x, x, x, {.key_dim = feat, .axis = time}); });
    EXPECT_NE(msg.find("TraceScope"), std::string::npos) << msg;
  }
  EXPECT_NE(error_of([] { ForceKernels f("warp_drive"); }).find("unknown kernel 'warp_drive'"), std::string::npos);
}

TEST_P(DotAttention, DropoutOnlyWithTrainFlagAndRescales) {
  Dim batch("batch", 2), heads("heads", 2), time("time", 32), feat("feat", 4), vfeat("vfeat", 2);
  Dim enc("enc", 64);
  Tensor q = randn({batch, heads, time, feat}, 1), k = randn({batch, heads, enc, feat}, 2);
  Tensor v = randn({batch, heads, enc, vfeat}, 3);
  AttentionOptions o{.key_dim = feat, .axis = enc, .att_dropout = 0.3};
  Tensor no_drop = dot_attention(q, k, v, {.key_dim = feat, .axis = enc});
  EXPECT_LT(max_abs_diff(dot_attention(q, k, v, o), no_drop, {batch, heads, time, vfeat}), 1e-6)
      << "no train flag: identity";
  TraceScope trace;
  dot_attention(q, k, v, {.key_dim = feat, .axis = enc});
  TrainFlagScope train(true);
  dot_attention(q, k, v, o);
  const Dims order{batch, heads, time, enc};
  std::vector<double> w0 = to_host(*trace.records()[0].att_weights, order);
  std::vector<double> w1 = to_host(*trace.records()[1].att_weights, order);
  int64_t kept = 0;
  for (size_t i = 0; i < w0.size(); ++i) {
    if (w1[i] == 0) continue;
    ++kept;
    EXPECT_NEAR(w1[i], w0[i] / 0.7, 1e-6);
  }
  const double n = static_cast<double>(w0.size()), p_keep = 0.7;
  EXPECT_LT(std::abs(kept - n * p_keep), 4 * std::sqrt(n * p_keep * (1 - p_keep))) << kept << " of " << n;
}

TEST_P(DotAttention, BroadcastDropoutVariesOnlyAlongAxis) {
  Dim batch("batch", 3), heads("heads", 2), time("time", 5), feat("feat", 4), vfeat("vfeat", 2), enc("enc", 200);
  Tensor q = randn({batch, heads, time, feat}, 1), k = randn({batch, heads, enc, feat}, 2);
  Tensor v = randn({batch, heads, enc, vfeat}, 3);
  TraceScope trace;
  TrainFlagScope train(true);
  dot_attention(q, k, v, {.key_dim = feat, .axis = enc, .att_dropout = 0.5, .att_dropout_broadcast = true});
  std::vector<double> w = to_host(*trace.records()[0].att_weights, Dims{batch, heads, time, enc});
  const size_t rows = w.size() / 200;
  int kept = 0;
  for (size_t j = 0; j < 200; ++j) {
    const bool keep0 = w[j] != 0;
    kept += keep0;
    for (size_t r = 1; r < rows; ++r) ASSERT_EQ(w[r * 200 + j] != 0, keep0) << "row " << r << " kv " << j;
  }
  EXPECT_LT(std::abs(kept - 100), 4 * std::sqrt(200 * 0.25));
}

TEST_P(DotAttention, BadInputsNameTheDims) {
  Dim batch("batch", 2), time("time", 3), enc("enc", 5), feat("feat", 4), other("other", 4);
  Tensor q = randn({batch, time, feat}, 1), k = randn({batch, enc, feat}, 2), v = randn({batch, enc, feat}, 3);
  auto expect = [](const std::string& msg, const std::string& part) {
    EXPECT_EQ(msg.rfind("[dot_attention]", 0), 0u) << msg;
    EXPECT_NE(msg.find(part), std::string::npos) << "'" << part << "' not in: " << msg;
  };
  expect(error_of([&] { dot_attention(q, k, v, {.key_dim = other, .axis = enc}); }), "other[4]");
  expect(error_of([&] { dot_attention(q, k, v, {.key_dim = feat, .axis = time}); }), "time[3]");
  expect(error_of([&] { dot_attention(q, k, v, {.key_dim = feat, .axis = enc, .att_dropout = 1.0}); }), "[0, 1)");
  expect(error_of([&] { dot_attention(q, k, v, {.key_dim = feat, .axis = enc, .scale = NAN}); }), "scale");
  expect(error_of([&] { dot_attention(q, k, v, {.key_dim = feat, .axis = enc, .causal_query_spatial_dim = time}); }),
         "enc[5]");
  expect(error_of([&] { dot_attention(q, k, cast(v, DType::float64), {.key_dim = feat, .axis = enc}); }), "float64");
}

INSTANTIATE_TEST_SUITE_P(AllBackends, DotAttention, ::testing::ValuesIn(backend_names()),
                         testing::backend_param_name);

}  // namespace
}  // namespace dimattn

namespace dimattn {
namespace {

TEST(DotAttentionLimits, ReferenceEnergyOverTheLimitIsAClearError) {
  const int64_t saved = reference_memory_limit();
  set_reference_memory_limit(1 << 20);
  Dim batch("batch", 4), time("time", 512), feat("feat", 8);
  Tensor x = random_normal({batch, time, feat}, 1);
  ForceKernels force("reference");
  const std::string msg = testing::error_of([&] { dot_attention(x, x, x, {.key_dim = feat, .axis = time}); });
  set_reference_memory_limit(saved);
  EXPECT_EQ(msg.rfind("[dot_attention] the reference path would hold an energy tensor", 0), 0u) << msg;
  EXPECT_NE(msg.find("time[512]"), std::string::npos) << msg;
  EXPECT_NE(msg.find("fused kernel"), std::string::npos) << msg;
}

}  // namespace
}  // namespace dimattn
