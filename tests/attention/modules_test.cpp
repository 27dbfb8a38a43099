// Attention modules: the three modes of CausalSelfAttention agree (with a
// window too, whose step and chunk states stay bounded), cross attention with
// a beam never tiles the encoder, the fused qkv weight is head-major, the
// variants reach dot_attention as a manual call passes them, sinks learn; T5's
// relative position buckets, the bias module (its table learns) and the
// modules that use it; Transformer-XL's relative positions (RelPosSelfAttention).
#include <cmath>

#include "dimattn/forcing.h"
#include "dimattn/modules.h"
#include "dimattn/registry.h"
#include "dimattn/trace.h"
#include "support/test_util.h"

namespace dimattn {
namespace {
using testing::expect_error;
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

// --- variants ---

// The slopes written out from the paper's definition: powers of two get
// 2^(-8k/n), k = 1..n; others add the in-between slopes of the next power.
TEST(ModuleVariants, StandardAlibiSlopes) {
  const std::vector<std::pair<int64_t, std::vector<double>>> cases = {
      {1, {-8}},
      {2, {-4, -8}},
      {3, {-4, -8, -2}},
      {4, {-2, -4, -6, -8}},
      {6, {-2, -4, -6, -8, -1, -3}},
      {8, {-1, -2, -3, -4, -5, -6, -7, -8}},
      {12, {-1, -2, -3, -4, -5, -6, -7, -8, -0.5, -1.5, -2.5, -3.5}},
  };
  int ran = 0;
  for (const auto& [n, exponents] : cases) {
    const std::vector<double> got = standard_alibi_slopes(n);
    ASSERT_EQ(got.size(), exponents.size()) << n << " heads";
    for (size_t k = 0; k < got.size(); ++k) EXPECT_DOUBLE_EQ(got[k], std::exp2(exponents[k])) << n << " heads, head " << k;
    ++ran;
  }
  EXPECT_EQ(ran, 7);
  expect_error([] { standard_alibi_slopes(0); }, "standard_alibi_slopes", {"num_heads"});
}

// The protected projections, for building the manual call.
template <class M>
struct Open : M {
  using M::M;
  using M::merge_heads;
  using M::project_qkv;
};

struct VariantCase {
  std::string name;
  bool causal;
  void (*set)(AttentionConfig&);  // the variants of the case
};

// Four heads (per head: key 2, value 3), so that ALiBi's slopes differ in scale.
AttentionConfig four_heads(const Dim& in, const Dim& out, const TensorOptions& opts) {
  return {.in_dim = in, .proj_dim = out, .key_dim_total = Dim("key_total", 8),
          .value_dim_total = Dim("value_total", 12), .num_heads = 4, .seed = 42, .opts = opts};
}

TEST_P(Modules, VariantsEqualAManualDotAttentionCall) {
  const std::vector<VariantCase> cases = {
      {"alibi", false, [](AttentionConfig& c) { c.alibi = true; }},
      {"softcap", false, [](AttentionConfig& c) { c.variants.softcap = 0.5; }},
      {"sinks", false, [](AttentionConfig& c) { c.sinks = true; }},
      {"off_by_one", false, [](AttentionConfig& c) { c.variants.sink_off_by_one = true; }},
      {"window_two_sided", false, [](AttentionConfig& c) { c.variants.window = AttentionWindow{1, 2}; }},
      {"causal_alibi", true, [](AttentionConfig& c) { c.alibi = true; }},
      {"causal_softcap_sinks", true, [](AttentionConfig& c) { c.variants.softcap = 0.5; c.sinks = true; }},
      {"causal_window", true, [](AttentionConfig& c) { c.variants.window = AttentionWindow{2, std::nullopt}; }},
  };
  Dim batch("batch", 2), in("in", 6), out("out", 5);
  Dim time = Dim::dynamic("time", lengths(batch, {6, 4}));
  const Tensor x = random_normal({batch, time, in}, 3, opts());
  const std::vector<double> slopes = {0.25, 0.0625, 0.015625, 0.00390625};  // 2^-2, 2^-4, 2^-6, 2^-8
  int ran = 0;
  for (const VariantCase& v : cases) {
    SCOPED_TRACE(v.name);
    AttentionConfig c = four_heads(in, out, opts());
    v.set(c);
    // Only the module of the case: a two-sided window is no causal config.
    std::optional<Open<CausalSelfAttention>> causal;
    std::optional<Open<SelfAttention>> full;
    if (v.causal)
      causal.emplace(c);
    else
      full.emplace(c);
    const SelfAttention& att = v.causal ? static_cast<const SelfAttention&>(*causal) : *full;
    ASSERT_EQ(att.sinks.has_value(), c.sinks);
    ASSERT_EQ(att.alibi_slopes.has_value(), c.alibi);
    const Tensor got = v.causal ? (*causal)(x, time) : (*full)(x, time);

    auto [q, k, vals] = v.causal ? causal->project_qkv(x) : full->project_qkv(x);
    AttentionOptions o{.key_dim = att.key_dim_per_head, .axis = time, .variants = {.window = c.variants.window, .softcap = c.variants.softcap}};
    if (v.causal)
      o.causal_query_spatial_dim = time;
    else if (c.variants.window || c.alibi)
      o.query_position_dim = time;
    if (c.alibi) o.variants.alibi_slopes = from_host({att.heads}, slopes, opts());
    if (c.sinks) o.variants.sinks = *att.sinks;
    o.variants.sink_off_by_one = c.variants.sink_off_by_one;
    const Tensor att_out = dot_attention(q, k, vals, o);
    const Tensor want = v.causal ? causal->merge_heads(att_out) : full->merge_heads(att_out);
    EXPECT_LT(max_abs_diff(got, want, {batch, time, out}), 1e-6);

    // The variant changed the result: it was not dropped on the way.
    const AttentionConfig plain_config = four_heads(in, out, opts());
    const Tensor plain = v.causal ? CausalSelfAttention(plain_config)(x, time) : SelfAttention(plain_config)(x, time);
    EXPECT_GT(max_abs_diff(got, plain, {batch, time, out}), 1e-4);
    ++ran;
  }
  EXPECT_EQ(ran, 8);
}

TEST_P(Modules, SinksAreDeterministicFromTheSeed) {
  Dim in("in", 4), out("out", 3);
  AttentionConfig c = four_heads(in, out, opts());
  c.sinks = true;
  const SelfAttention a(c), b(c);
  c.seed = 43;
  const SelfAttention other(c);
  EXPECT_EQ(to_host(*a.sinks), to_host(*b.sinks));
  EXPECT_NE(to_host(*a.sinks), to_host(*other.sinks));
  for (double s : to_host(*a.sinks)) EXPECT_TRUE(s >= -1 && s <= 1) << s;
}

TEST_P(Modules, CrossAttentionTakesSoftcapAndSinks) {
  Dim batch("batch", 2), in("in", 6), enc_feat("enc_feat", 7), out("out", 4);
  Dim enc = Dim::dynamic("enc", lengths(batch, {4, 6}));
  AttentionConfig c = config(in, out);
  c.variants.softcap = 0.5;
  c.sinks = true;
  CrossAttention att(c, enc_feat);
  ASSERT_TRUE(att.sinks.has_value());
  const auto state = att.transform_encoder(random_normal({batch, enc, enc_feat}, 1, opts()), enc);
  const Tensor x = random_normal({batch, in}, 2, opts());
  const Tensor q = split_dims(att.query(x), c.key_dim_total, {att.heads, att.key_dim_per_head});
  const Tensor manual = dot_attention(q, state.keys, state.values,
                                     {.key_dim = att.key_dim_per_head, .axis = enc, .variants = {.softcap = 0.5, .sinks = att.sinks}});
  const Tensor want = att.proj(merge_dims(manual, {att.heads, att.value_dim_per_head}, c.value_dim_total).first);
  EXPECT_LT(max_abs_diff(att(x, state), want, {batch, out}), 1e-6);
}

TEST_P(Modules, BadVariantConfigsAreErrors) {
  Dim in("in", 6), out("out", 5);
  AttentionConfig c = config(in, out);
  c.variants.window = AttentionWindow{2, 1};
  expect_error([&] { CausalSelfAttention att(c); }, "CausalSelfAttention", {"window.right is 1"});
  c.variants.window = AttentionWindow{-1, std::nullopt};
  expect_error([&] { CausalSelfAttention att(c); }, "CausalSelfAttention", {"window.left", "-1"});
  expect_error([&] { SelfAttention att(c); }, "SelfAttention", {"window.left", "-1"});
  c.variants.window = AttentionWindow{2, std::nullopt};
  expect_error([&] { CrossAttention att(c, Dim("enc_feat", 3)); }, "CrossAttention", {"a window"});
  c.variants.window.reset();
  c.alibi = true;
  expect_error([&] { CrossAttention att(c, Dim("enc_feat", 3)); }, "CrossAttention", {"ALiBi"});
  // The config carries the scalar variants; tensors are the module's own.
  c.alibi = false;
  c.variants.mask = compare(random_uniform({Dim("kv", 4)}, 1, opts()), Compare::ge, 0.5);
  expect_error([&] { SelfAttention att(c); }, "SelfAttention", {"config.variants holds the tensor(s) mask"});
  c.variants.mask.reset();
  c.variants.sink_off_by_one = true;
  c.sinks = true;
  expect_error([&] { SelfAttention att(c); }, "SelfAttention", {"sinks and sink_off_by_one are both set"});
  expect_error([&] { CrossAttention att(c, Dim("enc_feat", 3)); }, "CrossAttention",
               {"sinks and sink_off_by_one are both set"});
}

// Feeds x to a causal module in chunks: entry b's k-th chunk is its next
// sizes[b][k] positions (a dynamic chunk dim; the entries' boundaries need not
// agree). Checks each chunk's valid positions against `full`, and, with a
// window, that the state keeps min(seen, left) positions per entry on an axis
// of extent <= left. Returns the number of positions compared.
int check_chunks(const CausalSelfAttention& att, const Tensor& x, const Tensor& full, const Dim& batch,
                 const Dim& time, const std::vector<std::vector<int>>& sizes, const std::string& backend) {
  const Dim out = att.config.proj_dim;
  const std::vector<double> want = to_host(full, Dims{batch, time, out});
  const int64_t B = batch.extent(), T = time.extent(), F = out.extent();
  const std::optional<int64_t> left = att.config.variants.window ? att.config.variants.window->left : std::nullopt;
  auto state = att.initial_state({batch});
  std::vector<int64_t> start(B, 0);
  int compared = 0;
  for (size_t chunk_index = 0; chunk_index < sizes[0].size(); ++chunk_index) {
    std::vector<double> lens(B);
    int64_t extent = 0;
    for (int64_t b = 0; b < B; ++b) {
      lens[b] = sizes[b].at(chunk_index);
      extent = std::max<int64_t>(extent, sizes[b][chunk_index]);
    }
    Dim c = Dim::dynamic("chunk", from_host({batch}, lens, {.dtype = DType::int64, .backend = backend}), extent);
    std::vector<double> idx;
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0; t < extent; ++t) idx.push_back(static_cast<double>(std::min(start[b] + t, T - 1)));
    const Tensor xc = gather(x, time, from_host({batch, c}, idx, {.dtype = DType::int64, .backend = backend}));
    auto [y, next] = att.chunk(xc, c, state);
    state = next;
    const std::vector<double> got = to_host(y, Dims{batch, c, out});
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t t = 0; t < lens[b]; ++t, ++compared)
        for (int64_t f = 0; f < F; ++f)
          EXPECT_NEAR(got[(b * extent + t) * F + f], want[(b * T + start[b] + t) * F + f], 1e-5)
              << "chunk " << chunk_index << " entry " << b << " position " << start[b] + t;
      start[b] += static_cast<int64_t>(lens[b]);
    }
    if (left) {
      EXPECT_LE(state.axis.extent(), *left);
      EXPECT_EQ(state.keys.shape().at(state.keys.axis_of(state.axis)), state.axis.extent());
      const std::vector<double> kept = to_host(state.axis.lengths(), Dims{batch});
      for (int64_t b = 0; b < B; ++b) EXPECT_EQ(kept[b], static_cast<double>(std::min(start[b], *left))) << "entry " << b;
    }
  }
  return compared;
}

// Chunk sizes per entry: chunks of `size` over each entry's length (the
// last ones shorter, then empty).
std::vector<std::vector<int>> even_chunks(const std::vector<int>& lens, int size) {
  const int longest = *std::max_element(lens.begin(), lens.end());
  std::vector<std::vector<int>> sizes(lens.size());
  for (size_t b = 0; b < lens.size(); ++b)
    for (int s = 0; s < longest; s += size) sizes[b].push_back(std::clamp(lens[b] - s, 0, size));
  return sizes;
}

TEST_P(Modules, WindowedCausalStepsAndChunksEqualTheFullSequence) {
  const std::vector<VariantCase> cases = {
      {"window3", true, [](AttentionConfig& c) { c.variants.window = AttentionWindow{3, std::nullopt}; }},
      {"window0", true, [](AttentionConfig& c) { c.variants.window = AttentionWindow{0, 0}; }},
      {"window2_alibi_softcap_sinks", true,
       [](AttentionConfig& c) {
         c.variants.window = AttentionWindow{2, std::nullopt};
         c.variants.softcap = 0.8; c.alibi = true; c.sinks = true;
       }},
      {"alibi_off_by_one", true, [](AttentionConfig& c) { c.alibi = true; c.variants.sink_off_by_one = true; }},
      // Distances up to 8 beyond max_distance 6: the clamp acts too.
      {"relative_position", true, [](AttentionConfig& c) { c.relative_position = RelativePositionBuckets{8, 6}; }},
      {"window3_relative_position_sinks", true,
       [](AttentionConfig& c) {
         c.variants.window = AttentionWindow{3, std::nullopt};
         c.relative_position = RelativePositionBuckets{8, 6}; c.sinks = true;
       }},
  };
  Dim batch("batch", 2), in("in", 6), out("out", 5);
  const std::vector<int> lens = {9, 6};
  Dim time = Dim::dynamic("time", lengths(batch, {9, 6}));
  const Tensor x = random_normal({batch, time, in}, 3, opts());
  int ran = 0;
  for (const VariantCase& v : cases) {
    SCOPED_TRACE(v.name);
    AttentionConfig c = four_heads(in, out, opts());
    v.set(c);
    const CausalSelfAttention att(c);
    const Tensor full = att(x, time);
    const std::vector<double> want = to_host(full, Dims{batch, time, out});
    const std::optional<int64_t> left = c.variants.window ? c.variants.window->left : std::nullopt;

    // Step by step: every entry takes a position each step (the shorter one
    // padding input past its length, compared only within it).
    auto state = att.initial_state({batch});
    int compared = 0;
    for (int64_t t = 0; t < time.extent(); ++t) {
      auto [y, next] = att.step(at(x, time, t), state);
      state = next;
      const std::vector<double> got = to_host(y, Dims{batch, out});
      for (int b = 0; b < 2; ++b) {
        if (t >= lens[b]) continue;
        ++compared;
        for (int f = 0; f < 5; ++f) EXPECT_NEAR(got[b * 5 + f], want[(b * 9 + t) * 5 + f], 1e-5) << "t " << t << " b " << b;
      }
      if (left) EXPECT_EQ(state.axis.extent(), std::min<int64_t>(t + 1, *left)) << "t " << t;
    }
    EXPECT_EQ(compared, 15);

    // Chunks of several sizes, and chunks whose boundaries differ per entry.
    int chunkings = 0;
    for (int size : {1, 2, 3, 4, 9}) {
      SCOPED_TRACE("chunks of " + std::to_string(size));
      EXPECT_EQ(check_chunks(att, x, full, batch, time, even_chunks(lens, size), GetParam()), 15);
      ++chunkings;
    }
    EXPECT_EQ(check_chunks(att, x, full, batch, time, {{2, 3, 0, 4}, {3, 1, 2, 0}}, GetParam()), 15);
    EXPECT_EQ(chunkings, 5);
    ++ran;
  }
  EXPECT_EQ(ran, 6);
}

TEST_P(Modules, WindowedStateStaysBoundedOverManySteps) {
  Dim batch("batch", 3), in("in", 6), out("out", 5), time("time", 40);
  AttentionConfig c = config(in, out);
  c.variants.window = AttentionWindow{4, std::nullopt};
  const CausalSelfAttention att(c);
  const Tensor x = random_normal({batch, time, in}, 7, opts());
  auto state = att.initial_state({batch});
  Tensor last = scalar(0.0, opts());
  int steps = 0;
  for (int64_t t = 0; t < time.extent(); ++t, ++steps) {
    std::tie(last, state) = att.step(at(x, time, t), state);
    ASSERT_LE(state.axis.extent(), 4) << "step " << t;
    ASSERT_EQ(state.keys.shape().at(state.keys.axis_of(state.axis)), state.axis.extent());
    ASSERT_EQ(state.values.shape().at(state.values.axis_of(state.axis)), state.axis.extent());
    EXPECT_EQ(to_host(state.axis.lengths()), std::vector<double>(3, static_cast<double>(std::min<int64_t>(t + 1, 4))));
  }
  EXPECT_EQ(steps, 40);
  // Still exact after 40 steps: the last position against the full sequence.
  EXPECT_LT(max_abs_diff(last, at(att(x, time), time, 39), {batch, out}), 1e-5);

  // Chunks of 7: the state holds 4 positions between chunks.
  state = att.initial_state({batch});
  int chunks = 0;
  for (int64_t s = 0; s < 40; s += 7, ++chunks) {
    Dim cd("chunk", std::min<int64_t>(7, 40 - s));
    state = att.chunk(slice(x, time, s, s + cd.extent(), cd).first, cd, state).second;
    ASSERT_EQ(state.axis.extent(), 4) << "chunk at " << s;
  }
  EXPECT_EQ(chunks, 6);
}

// A parameter learns: its gradient through the module (torch's autograd)
// against central differences of a loss over the output, in float64, for
// SelfAttention (causal false) and CausalSelfAttention made from four_heads
// and `set`. `param` picks the parameter. Returns per module the number of
// the parameter's entries with a gradient (|g| > 1e-6).
std::vector<int> check_parameter_gradient(void (*set)(AttentionConfig&, bool causal),
                                          Tensor& (*param)(SelfAttention&), const std::vector<double>& lens) {
  const TensorOptions o{.dtype = DType::float64, .backend = "torch"};
  Dim batch("batch", 2), in("in", 6), out("out", 5);
  Dim time = Dim::dynamic("time", from_host({batch}, lens, {.dtype = DType::int64, .backend = "torch"}));
  const Tensor x = random_normal({batch, time, in}, 3, o);
  const Tensor w = random_normal({batch, time, out}, 4, o);
  std::vector<int> learning;
  for (bool causal : {false, true}) {
    SCOPED_TRACE(causal ? "causal" : "full");
    AttentionConfig c = four_heads(in, out, o);
    set(c, causal);
    std::optional<CausalSelfAttention> causal_att;
    std::optional<SelfAttention> full_att;
    if (causal)
      causal_att.emplace(c);
    else
      full_att.emplace(c);
    Tensor& p = param(causal ? static_cast<SelfAttention&>(*causal_att) : *full_att);
    auto loss = [&] {
      const Tensor y = causal ? (*causal_att)(x, time) : (*full_att)(x, time);
      return reduce_sum(mul(y, w), {batch, time, out});
    };
    const Dims dims = p.dims();
    const std::vector<double> p0 = to_host(p);
    p.requires_grad(true);
    loss().backward();
    EXPECT_TRUE(p.grad().has_value()) << "no gradient reached the parameter";
    if (!p.grad()) return {};
    const std::vector<double> grad = to_host(*p.grad(), dims);
    const double eps = 1e-6;
    int nonzero = 0;
    for (size_t e = 0; e < p0.size(); ++e) {
      auto at_value = [&](double value) {
        std::vector<double> changed = p0;
        changed[e] = value;
        p = from_host(dims, changed, o);
        return item(loss());
      };
      const double numeric = (at_value(p0[e] + eps) - at_value(p0[e] - eps)) / (2 * eps);
      EXPECT_NEAR(grad[e], numeric, 1e-6) << "entry " << e << " of " << repr(dims);
      nonzero += std::abs(grad[e]) > 1e-6;
    }
    learning.push_back(nonzero);
  }
  return learning;
}

TEST_P(Modules, SinksGetAGradient) {
  if (GetParam() != "torch") GTEST_SKIP() << "gradients through autograd are the torch backend's";
  const std::vector<int> learning = check_parameter_gradient(
      [](AttentionConfig& c, bool causal) {
        c.sinks = true;
        c.variants.window = AttentionWindow{2, causal ? std::nullopt : std::optional<int64_t>(1)};
      },
      [](SelfAttention& att) -> Tensor& { return *att.sinks; }, {5, 3});
  EXPECT_EQ(learning, (std::vector<int>{4, 4}));  // every head's sink, both modules
}

// --- T5 relative position bias ---

// Hand-computed from the bucketing's definition. Bidirectional, 32 buckets,
// max_distance 128: 16 per direction, distances 0..7 exact, then 8 log-spaced
// buckets over [8, 128) with lower bounds 8 * 16^(k/8) = 8 * 2^(k/2): 8,
// 11.3, 16, 22.6, 32, 45.3, 64, 90.5 (bucket 8 + k), 128 and beyond in 15;
// kv positions after the query from bucket 16 on. Causal, 32 buckets,
// max_distance 128: 16 exact, 16 log-spaced over [16, 128), lower bounds
// 16 * 8^(k/16) = 16 * 2^(3k/16): 18.3, 20.7, 23.6, 26.9, 30.4 (k = 5: bucket
// 21), .., 58.7 (k = 10: bucket 26); kv positions after the query in bucket 0.
TEST(ModuleVariants, RelativePositionBuckets) {
  struct Case {
    int64_t relative, want;
  };
  const RelativePositionBuckets t5{32, 128};
  const std::vector<Case> bidirectional = {
      {0, 0},   {-1, 1},   {-7, 7},   {-8, 8},   {-11, 8},   {-12, 9},   {-15, 9},   {-16, 10},  {-22, 10},
      {-23, 11}, {-31, 11}, {-32, 12}, {-45, 12}, {-46, 13},  {-63, 13},  {-64, 14},  {-90, 14},  {-91, 15},
      {-127, 15}, {-128, 15}, {-5000, 15}, {1, 17}, {7, 23}, {8, 24}, {12, 25}, {16, 26}, {127, 31}, {200, 31}};
  const std::vector<Case> causal = {{5, 0},    {1, 0},    {0, 0},    {-1, 1},   {-15, 15},  {-16, 16},  {-18, 16},
                                    {-19, 17}, {-20, 17}, {-21, 18}, {-23, 18}, {-24, 19},  {-30, 20},  {-31, 21},
                                    {-32, 21}, {-58, 25}, {-59, 26}, {-64, 26}, {-127, 31}, {-128, 31}, {-1000, 31}};
  // Small: 4 buckets both ways, max_distance 2: per direction bucket 0
  // (distance 0), then one log bucket for everything else.
  const std::vector<Case> small = {{0, 0}, {-1, 1}, {-2, 1}, {-9, 1}, {1, 3}, {2, 3}, {9, 3}};
  int ran = 0;
  for (const auto& [cases, buckets, bidi] :
       {std::tuple{&bidirectional, t5, true}, std::tuple{&causal, t5, false},
        std::tuple{&small, RelativePositionBuckets{4, 2}, true}}) {
    for (const Case& c : *cases) {
      EXPECT_EQ(relative_position_bucket(c.relative, buckets, bidi), c.want)
          << "relative " << c.relative << (bidi ? " bidirectional" : " causal") << " " << buckets.num_buckets;
      ++ran;
    }
  }
  EXPECT_EQ(ran, 56);
  expect_error([] { relative_position_bucket(0, {31, 128}, true); }, "relative_position_bucket",
               {"num_buckets must be even and >= 4", "31"});
  expect_error([] { relative_position_bucket(0, {1, 128}, false); }, "relative_position_bucket",
               {"num_buckets must be >= 2", "1"});
  expect_error([] { relative_position_bucket(0, {32, 8}, true); }, "relative_position_bucket",
               {"max_distance must be > 8", "got 8"});
  expect_error([] { RelativePositionBias(Dim("heads", 2), {6, 1}, false, 0); }, "RelativePositionBias",
               {"max_distance"});
}

// The bias of `rpb` written out on the host: (h, i, j) = table[bucket(j - i
// - offset[b]), h], in the order {batch, heads, query, kv}.
std::vector<double> host_bias(const RelativePositionBias& rpb, int64_t batch, int64_t tq, int64_t tk,
                              const std::vector<int64_t>& offsets) {
  const int64_t H = rpb.heads.extent();
  const std::vector<double> table = to_host(rpb.table, Dims{rpb.buckets, rpb.heads});
  std::vector<double> out;
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < tq; ++i)
        for (int64_t j = 0; j < tk; ++j)
          out.push_back(table[relative_position_bucket(j - i - offsets.at(b), rpb.config, rpb.bidirectional) * H + h]);
  return out;
}

TEST_P(Modules, RelativePositionBiasIsTheGatheredTable) {
  Dim batch("batch", 2), heads("heads", 3), chunk("chunk", 4), kv("kv", 9);
  const std::vector<int64_t> offsets = {5, 0};
  int ran = 0;
  for (bool bidi : {true, false}) {
    SCOPED_TRACE(bidi ? "bidirectional" : "causal");
    const RelativePositionBias rpb(heads, {8, 6}, bidi, 11, opts());
    const Tensor offset = from_host({batch}, {5, 0}, {.dtype = DType::int64, .backend = GetParam()});
    const Tensor got = rpb(chunk, kv, offset);
    EXPECT_TRUE(same_dims(got.dims(), {heads, chunk, kv, batch})) << repr(got.dims());
    EXPECT_EQ(to_host(got, Dims{batch, heads, chunk, kv}), host_bias(rpb, 2, 4, 9, offsets));
    const Tensor plain = rpb(chunk, kv);
    EXPECT_TRUE(same_dims(plain.dims(), {heads, chunk, kv}));
    EXPECT_EQ(to_host(plain, Dims{heads, chunk, kv}), host_bias(rpb, 1, 4, 9, {0}));
    ++ran;
  }
  EXPECT_EQ(ran, 2);
  const RelativePositionBias rpb(heads, {8, 6}, true, 11, opts());
  expect_error([&] { rpb(kv, kv); }, "RelativePositionBias", {"one dim kv[9]", "a kv dim of their own"});
  // Deterministic from the seed.
  EXPECT_EQ(to_host(rpb.table), to_host(RelativePositionBias(heads, {8, 6}, true, 11, opts()).table));
  EXPECT_NE(to_host(rpb.table), to_host(RelativePositionBias(heads, {8, 6}, true, 12, opts()).table));
}

TEST_P(Modules, RelativePositionBiasEqualsAManualDotAttentionCall) {
  Dim batch("batch", 2), in("in", 6), out("out", 5);
  const std::vector<double> lens = {7, 4};
  Dim time = Dim::dynamic("time", lengths(batch, lens));
  const Tensor x = random_normal({batch, time, in}, 3, opts());
  int ran = 0;
  for (bool causal : {false, true}) {
    SCOPED_TRACE(causal ? "causal" : "full");
    AttentionConfig c = four_heads(in, out, opts());
    c.relative_position = RelativePositionBuckets{8, 5};
    std::optional<Open<CausalSelfAttention>> causal_att;
    std::optional<Open<SelfAttention>> full_att;
    if (causal)
      causal_att.emplace(c);
    else
      full_att.emplace(c);
    const SelfAttention& att = causal ? static_cast<const SelfAttention&>(*causal_att) : *full_att;
    ASSERT_TRUE(att.relative_position_bias.has_value());
    EXPECT_EQ(att.relative_position_bias->bidirectional, !causal);
    EXPECT_EQ(att.relative_position_bias->buckets.extent(), 8);
    const Tensor got = causal ? (*causal_att)(x, time) : (*full_att)(x, time);

    // By hand: keys and values on a kv dim of their own, the bias from the
    // host over {heads, time, kv}.
    auto [q, k, v] = causal ? causal_att->project_qkv(x) : full_att->project_qkv(x);
    Dim kv = Dim::dynamic("kv", time.lengths(), time.extent());
    const Tensor bias = from_host({att.heads, time, kv}, host_bias(*att.relative_position_bias, 1, 7, 7, {0}), opts());
    AttentionOptions o{.key_dim = att.key_dim_per_head, .axis = kv, .variants = {.bias = bias}};
    if (causal) o.causal_query_spatial_dim = time;
    const Tensor att_out = dot_attention(q, replace_dim(k, time, kv), replace_dim(v, time, kv), o);
    const Tensor want = causal ? causal_att->merge_heads(att_out) : full_att->merge_heads(att_out);
    EXPECT_LT(max_abs_diff(got, want, {batch, time, out}), 1e-6);

    // The bias acts.
    const AttentionConfig plain_config = four_heads(in, out, opts());
    const Tensor plain = causal ? CausalSelfAttention(plain_config)(x, time) : SelfAttention(plain_config)(x, time);
    EXPECT_GT(max_abs_diff(got, plain, {batch, time, out}), 1e-4);
    ++ran;
  }
  EXPECT_EQ(ran, 2);

  AttentionConfig c = config(in, out);
  c.relative_position = RelativePositionBuckets{8, 5};
  expect_error([&] { CrossAttention att(c, Dim("enc_feat", 3)); }, "CrossAttention", {"a relative position bias"});
  c.relative_position = RelativePositionBuckets{7, 5};
  expect_error([&] { SelfAttention att(c); }, "RelativePositionBias", {"num_buckets must be even", "7"});
  c.relative_position = RelativePositionBuckets{8, 5};
  SelfAttention shared(c);
  shared.relative_position_bias.emplace(Dim("other_heads", 2), RelativePositionBuckets{8, 5}, true, 1, opts());
  expect_error([&] { shared(x, time); }, "SelfAttention", {"relative_position_bias has heads other_heads[2]"});
}

// The table learns (check_parameter_gradient). Lengths 6 and 3 reach
// distances 0..5. Full (bidirectional, 4 buckets per direction,
// max_distance 6): 0, 1 exact, then 2 (distances 2, 3) and 3 (4, 5), but
// distance 0 is always the first half's, so bucket 4 never serves: 7 of 8
// buckets learn. Causal (8 buckets): 0..3 exact, 4 (distance 4), 6 (distance
// 5; log bounds 4 * 1.5^(k/4): 4, 4.4, 4.9, 5.4): 6 of 8.
TEST_P(Modules, RelativePositionTableGetsAGradient) {
  if (GetParam() != "torch") GTEST_SKIP() << "gradients through autograd are the torch backend's";
  const std::vector<int> learning = check_parameter_gradient(
      [](AttentionConfig& c, bool) { c.relative_position = RelativePositionBuckets{8, 6}; },
      [](SelfAttention& att) -> Tensor& { return att.relative_position_bias->table; }, {6, 3});
  EXPECT_EQ(learning, (std::vector<int>{7 * 4, 6 * 4}));
}

// Transformer-XL's table: row r is relative position r - (Tq - 1); sines, then cosines.
TEST(ModuleVariants, RelativePositionalEncoding) {
  Dim rel("rel", 3 + 5 - 1), feat("feat", 6);
  const std::vector<double> t = to_host(relative_positional_encoding(3, 5, rel, feat), Dims{rel, feat});
  for (int64_t r = 0; r < 7; ++r)
    for (int64_t c = 0; c < 3; ++c) {
      const double a = static_cast<double>(r - 2) * std::pow(1e4, -2.0 * static_cast<double>(c) / 6.0);
      EXPECT_NEAR(t[static_cast<size_t>(r * 6 + c)], std::sin(a), 1e-6) << r << " " << c;
      EXPECT_NEAR(t[static_cast<size_t>(r * 6 + 3 + c)], std::cos(a), 1e-6) << r << " " << c;
    }
  expect_error([&] { relative_positional_encoding(3, 5, Dim("rel", 6), feat); }, "relative_positional_encoding",
               {"needs 7 rows"});
  expect_error([&] { relative_positional_encoding(3, 5, rel, Dim("odd", 5)); }, "relative_positional_encoding",
               {"must be even"});
}

// RelPosSelfAttention (RETURNN's options): its call is dot_attention with its
// table, u and v; cpu_flash and the reference path agree on it; a learned
// table clips; the options reach the parameters.
TEST_P(Modules, RelPosSelfAttentionIsADotAttentionCallWithItsTable) {
  Dim batch("batch", 2), in("in", 8), out("out", 5);
  Dim time = Dim::dynamic("time", lengths(batch, {7, 4}));
  const Tensor x = random_normal({batch, time, in}, 3, opts());
  struct Case {
    const char* name;
    RelPosConfig rel;
    bool with_bias;
  };
  const std::vector<Case> cases = {
      {"transformer_xl", {}, true},
      {"learned_clipped", {.with_linear_pos = false, .learnable_pos_emb = true, .learnable_pos_emb_clipping = 2}, true},
      {"shaw", {.with_linear_pos = false, .with_pos_bias = false, .learnable_pos_emb = true,
                .separate_pos_emb_per_head = false}, false},
      {"shared_linear_no_pos_bias", {.with_pos_bias = false, .separate_pos_emb_per_head = false}, true}};
  int ran = 0;
  for (const Case& k : cases) {
    SCOPED_TRACE(k.name);
    AttentionConfig c = four_heads(in, out, opts());
    c.with_bias = k.with_bias;
    Open<RelPosSelfAttention> att(c, k.rel);
    EXPECT_EQ(att.linear_pos.has_value(), k.rel.with_linear_pos);
    EXPECT_EQ(att.pos_bias_u.has_value(), k.rel.with_pos_bias);
    EXPECT_EQ(att.learned_pos_emb.has_value(), k.rel.learnable_pos_emb);
    EXPECT_EQ(att.qkv.bias.has_value(), k.with_bias);
    const Tensor got = att(x, time);
    const Tensor got_ref = [&] {
      ForceKernels force("reference");
      return att(x, time);
    }();
    EXPECT_LT(max_abs_diff(got, got_ref, {batch, time, out}), 1e-5);

    auto [q, kk, v] = att.project_qkv(x);
    Dim kv = Dim::dynamic("kv", time.lengths(), time.extent()), rel("rel", 13);
    const Tensor table = att.position_table(7, rel);
    EXPECT_TRUE(same_dims(table.dims(), k.rel.separate_pos_emb_per_head ? Dims{att.heads, rel, att.key_dim_per_head}
                                                                        : Dims{rel, att.key_dim_per_head}));
    AttentionOptions o{.key_dim = att.key_dim_per_head, .axis = kv, .query_position_dim = time,
                       .variants = {.pos_emb = table, .pos_bias_u = att.pos_bias_u, .pos_bias_v = att.pos_bias_v}};
    const Tensor want = att.merge_heads(dot_attention(q, replace_dim(kk, time, kv), replace_dim(v, time, kv), o));
    EXPECT_LT(max_abs_diff(got, want, {batch, time, out}), 1e-6);
    if (att.learned_pos_emb && !att.linear_pos && !k.rel.separate_pos_emb_per_head) {
      // The table's rows are the learned rows of their clipped positions.
      const Tensor lp = *att.learned_pos_emb;
      const Dims order{rel, att.pos_emb_feat_dim};
      const std::vector<double> tv = to_host(att.position_table(7, rel), order);
      const std::vector<double> lv = to_host(lp, Dims{att.clipped, att.pos_emb_feat_dim});
      const int64_t f = att.pos_emb_feat_dim.extent(), clip = k.rel.learnable_pos_emb_clipping;
      for (int64_t r = 0; r < 13; ++r) {
        const int64_t row = std::clamp<int64_t>(r - 6, -clip, clip) + clip;
        for (int64_t d = 0; d < f; ++d) EXPECT_EQ(tv[static_cast<size_t>(r * f + d)], lv[static_cast<size_t>(row * f + d)]);
      }
    }
    ++ran;
  }
  EXPECT_EQ(ran, 4);
  AttentionConfig c = four_heads(in, out, opts());
  c.relative_position = RelativePositionBuckets{8, 5};
  expect_error([&] { RelPosSelfAttention att(c); }, "RelPosSelfAttention", {"config.relative_position"});
  expect_error([&] { RelPosSelfAttention att(four_heads(in, out, opts()), {.learnable_pos_emb_clipping = -1}); },
               "RelPosSelfAttention", {"learnable_pos_emb_clipping must be >= 0"});
}

INSTANTIATE_TEST_SUITE_P(AllBackends, Modules, ::testing::ValuesIn(backend_names()), testing::backend_param_name);

}  // namespace
}  // namespace dimattn
