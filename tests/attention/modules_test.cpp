// Attention modules: the three modes of CausalSelfAttention agree, cross
// attention with a beam never tiles the encoder, the fused qkv weight is
// head-major.
#include "dimattn/modules.h"
#include "dimattn/trace.h"
#include "support/test_util.h"

namespace dimattn {
namespace {
using testing::max_abs_diff;
using testing::same_dims;

class Modules : public ::testing::TestWithParam<std::string> {
 protected:
  TensorOptions opts() const { return {.backend = GetParam()}; }
  Tensor lengths(const Dim& batch, const std::vector<double>& lens) const {
    return from_host({batch}, lens, {.dtype = DType::int64, .backend = GetParam()});
  }
  AttentionConfig config(const Dim& in, const Dim& out) const {
    return {.in_dim = in, .proj_dim = out, .key_dim_total = Dim("key_total", 8),
            .value_dim_total = Dim("value_total", 12), .num_heads = 2, .seed = 42, .opts = opts()};
  }
};

// Position t of x along `time` as a tensor without that dim.
Tensor at(const Tensor& x, const Dim& time, int64_t t) {
  Dim one("one", 1);
  return squeeze(slice(x, time, t, t + 1, one).first, one);
}

TEST_P(Modules, CausalFullEqualsStepwiseEqualsChunks) {
  Dim batch("batch", 2), in("in", 6), out("out", 5);
  const std::vector<double> lens = {5, 3};
  Dim time = Dim::dynamic("time", lengths(batch, lens));
  CausalSelfAttention att(config(in, out));
  Tensor x = random_normal({batch, time, in}, 3, opts());
  Tensor full = att(x, time);
  EXPECT_TRUE(same_dims(full.dims(), {batch, time, out}));

  // Step by step. Entries shorter than the step see padding input, so only
  // positions within each entry's length are compared.
  auto state = att.initial_state({batch});
  for (int64_t t = 0; t < time.extent(); ++t) {
    auto [y, next] = att.step(at(x, time, t), state);
    state = next;
    EXPECT_TRUE(same_dims(y.dims(), {batch, out}));
    std::vector<double> got = to_host(y, Dims{batch, out}), want = to_host(at(full, time, t), Dims{batch, out});
    for (int b = 0; b < 2; ++b) {
      if (t >= lens[b]) continue;
      for (int f = 0; f < 5; ++f) EXPECT_NEAR(got[b * 5 + f], want[b * 5 + f], 1e-5) << "t " << t << " b " << b;
    }
  }

  // Two chunks: positions [0, 2) then [2, 5) with per-entry chunk lengths.
  Dim c1("c1", 2);
  Dim c2 = Dim::dynamic("c2", lengths(batch, {3, 1}), 3);
  Tensor x1 = slice(x, time, 0, 2, c1).first, x2 = slice(x, time, 2, 5, c2).first;
  auto [y1, s1] = att.chunk(x1, c1, att.initial_state({batch}));
  auto [y2, s2] = att.chunk(x2, c2, s1);
  EXPECT_LT(max_abs_diff(y1, slice(full, time, 0, 2, c1).first, {batch, c1, out}), 1e-5);
  std::vector<double> got = to_host(y2, Dims{batch, c2, out});
  std::vector<double> want = to_host(slice(full, time, 2, 5, c2).first, Dims{batch, c2, out});
  for (int b = 0; b < 2; ++b)
    for (int t = 0; t < 3; ++t) {
      if (2 + t >= lens[b]) continue;
      for (int f = 0; f < 5; ++f) EXPECT_NEAR(got[(b * 3 + t) * 5 + f], want[(b * 3 + t) * 5 + f], 1e-5);
    }
  EXPECT_EQ(to_host(s2.axis.lengths()), (std::vector<double>{5, 3}));
}

TEST_P(Modules, CrossAttentionWithBeamNeverTilesTheEncoder) {
  Dim batch("batch", 2), beam("beam", 3), in("in", 6), enc_feat("enc_feat", 7), out("out", 4);
  Dim enc = Dim::dynamic("enc", lengths(batch, {4, 6}));
  CrossAttention att(config(in, out), enc_feat);
  Tensor encoder = random_normal({batch, enc, enc_feat}, 1, opts());
  auto state = att.transform_encoder(encoder, enc);
  EXPECT_FALSE(state.keys.has(beam));
  Tensor x = random_normal({batch, beam, in}, 2, opts());
  TraceScope trace(false);
  Tensor y = att(x, state);
  EXPECT_TRUE(same_dims(y.dims(), {batch, beam, out}));
  int64_t kernel_keys = 1;
  for (int64_t s : trace.records().at(0).keys_shape) kernel_keys *= s;
  EXPECT_EQ(kernel_keys, state.keys.numel()) << "keys reached the kernel without a beam dim";
  for (int64_t b = 0; b < 3; ++b) EXPECT_LT(max_abs_diff(at(y, beam, b), att(at(x, beam, b), state), {batch, out}), 1e-5);
}

TEST_P(Modules, FusedQkvWeightIsHeadMajor) {
  Dim time("time", 3), in("in", 4), out("out", 2);
  SelfAttention att(config(in, out));
  Tensor x = random_normal({time, in}, 5, opts());
  TraceScope trace;
  att(x, time);
  const Tensor& energy = *trace.records().at(0).energy;  // {heads, time, time'}
  // Recompute q and k of head h from the weight's columns: head h owns
  // columns [h*(2K+V), (h+1)*(2K+V)): q first, then k, then v.
  const int K = 4, V = 6, W = 2 * K + V;
  std::vector<double> xw = to_host(x, Dims{time, in}), w = to_host(att.qkv.weight, Dims{in, att.qkv.out_dim});
  std::vector<double> bias = to_host(*att.qkv.bias);
  auto proj = [&](int t, int col) {
    double s = bias[col];
    for (int i = 0; i < 4; ++i) s += xw[t * 4 + i] * w[i * 2 * W + col];
    return s;
  };
  Dims rest = energy.dims();
  std::erase(rest, att.heads);
  std::erase(rest, time);
  ASSERT_EQ(rest.size(), 1u);
  const Dim kv = rest[0];  // the relabelled kv side of self-attention
  std::vector<double> e = to_host(energy, Dims{att.heads, time, kv});
  for (int h = 0; h < 2; ++h)
    for (int i = 0; i < 3; ++i)
      for (int j = 0; j < 3; ++j) {
        double s = 0;
        for (int d = 0; d < K; ++d) s += proj(i, h * W + d) * proj(j, h * W + K + d);
        EXPECT_NEAR(e[(h * 3 + i) * 3 + j], s / 2.0, 1e-4) << "head " << h;  // scale 1/sqrt(4)
      }
}

TEST_P(Modules, SameSeedSameParameters) {
  Dim in("in", 4), out("out", 3);
  Linear a(in, out, 9, opts()), b(in, out, 9, opts()), c(in, out, 10, opts());
  EXPECT_EQ(to_host(a.weight), to_host(b.weight));
  EXPECT_NE(to_host(a.weight), to_host(c.weight));
}

INSTANTIATE_TEST_SUITE_P(AllBackends, Modules, ::testing::ValuesIn(backend_names()), testing::backend_param_name);

}  // namespace
}  // namespace dimattn
