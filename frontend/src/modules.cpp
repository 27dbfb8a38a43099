#include "dimattn/modules.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <type_traits>

#include "dimattn/error.h"
#include "dimattn/internal/check.h"
#include "op_util.h"

namespace dimattn {

namespace {

Tensor init_uniform(const Dims& dims, int64_t fan_in, uint64_t seed, const TensorOptions& opts) {
  const double bound = 1.0 / std::sqrt(static_cast<double>(std::max<int64_t>(fan_in, 1)));
  return random_uniform(dims, seed, opts, -bound, bound);
}

Dim per_head(const char* module, const Dim& total, const Dim& heads) {
  DIMATTN_CHECK(total.extent() % heads.extent() == 0, module, "dim ", total.repr(), " is not divisible by ", heads.repr());
  return total.divide_by(heads);
}

Dim heads_dim(const AttentionConfig& c) {
  DIMATTN_CHECK(c.num_heads > 0, "SelfAttention", "num_heads must be positive, got ", c.num_heads);
  return Dim("num_heads", c.num_heads);
}

// Positions [start, start + extent(out)) of `axis` as dim `out`.
Tensor part(const Tensor& x, const Dim& axis, int64_t start, const Dim& out) {
  return slice(x, axis, start, start + out.extent(), out).first;
}

// Appends new keys/values along `new_axis` to a history state's per entry,
// giving the concatenated tensors and their dynamic axis.
std::tuple<Tensor, Tensor, Dim> append(const Tensor& keys, const Tensor& values, const Dim& hist, const Tensor& k,
                                       const Tensor& v, const Dim& new_axis) {
  auto [k_all, axis] = concat({{keys, hist}, {k, new_axis}});
  Tensor v_all = concat({{values, hist}, {v, new_axis}}, axis).first;
  return {k_all, v_all, axis};
}

// The last `left` positions of each entry's history (all of a shorter one):
// the next query, at position L, sees L - left .. L and nothing earlier ever
// again. The result's axis has extent <= left.
// pre: left >= 0; `axis` is dynamic.
std::tuple<Tensor, Tensor, Dim> keep_last(const Tensor& keys, const Tensor& values, const Dim& axis, int64_t left) {
  if (axis.extent() <= left) return {keys, values, axis};
  const Tensor len = cast(axis.lengths(), DType::int64);
  const TensorOptions int_opts = detail::options_like(len);
  const Tensor kept = minimum(len, full({}, static_cast<double>(left), int_opts));
  Dim hist = Dim::dynamic("history", kept, left);
  // Entry b keeps positions len - kept + t, t < left: within axis's extent,
  // as kept == left where len > left, and extent > left otherwise.
  const Tensor idx = add(sub(len, kept), range_over_dim(hist, int_opts));
  return {gather(keys, axis, idx), gather(values, axis, idx), hist};
}

// The module's own checks of config.variants; dot_attention checks the rest
// per call.
void check_variants(const char* module, const AttentionVariants& v, bool causal) {
  v.check_values(module, causal);
  std::string tensors;  // the tensor fields set
  AttentionVariants::for_each_field(v, [&](const char* name, const auto& field) {
    if constexpr (std::is_same_v<std::decay_t<decltype(field)>, std::optional<Tensor>>)
      if (field) tensors += (tensors.empty() ? "" : ", ") + std::string(name);
  });
  DIMATTN_CHECK(tensors.empty(), module, "config.variants holds the tensor(s) ", tensors, ", but a module makes its ",
                "own per call: set config.alibi, config.sinks or config.relative_position instead");
}

// The check of RelativePositionBuckets; `n` = buckets per direction.
int64_t buckets_per_direction(const char* op, const RelativePositionBuckets& b, bool bidirectional) {
  if (bidirectional)
    DIMATTN_CHECK(b.num_buckets >= 4 && b.num_buckets % 2 == 0, op, "num_buckets must be even and >= 4 for ",
                  "bidirectional buckets (half per direction), got ", b.num_buckets);
  else
    DIMATTN_CHECK(b.num_buckets >= 2, op, "num_buckets must be >= 2 for causal buckets, got ", b.num_buckets);
  const int64_t n = bidirectional ? b.num_buckets / 2 : b.num_buckets;
  DIMATTN_CHECK(b.max_distance > n / 2, op, "max_distance must be > ", n / 2, ", the distances with an exact ",
                "bucket (the log-spaced buckets lie between the two), got ", b.max_distance);
  return n;
}

// bucket(r) for r in [-max_distance, max_distance] (index r + max_distance):
// every distance beyond max_distance shares the bucket of max_distance.
std::vector<double> bucket_table(const RelativePositionBuckets& b, bool bidirectional) {
  std::vector<double> t;
  for (int64_t r = -b.max_distance; r <= b.max_distance; ++r)
    t.push_back(static_cast<double>(relative_position_bucket(r, b, bidirectional)));
  return t;
}

// A dim with axis's extent (and lengths, if dynamic), for the keys and
// values of self-attention.
Dim twin_of(const Dim& axis, const std::string& name) {
  return axis.is_dynamic() ? Dim::dynamic(name, axis.lengths(), axis.extent()) : Dim(name, axis.extent());
}

}  // namespace

int64_t relative_position_bucket(int64_t relative, const RelativePositionBuckets& b, bool bidirectional) {
  const int64_t n = buckets_per_direction("relative_position_bucket", b, bidirectional);
  int64_t first = 0, distance = 0;
  if (bidirectional) {
    first = relative > 0 ? n : 0;
    distance = relative < 0 ? -relative : relative;
  } else {
    distance = std::max<int64_t>(-relative, 0);
  }
  const int64_t exact = n / 2;
  if (distance < exact) return first + distance;
  // The n - exact log-spaced buckets split [exact, max_distance) evenly in
  // log(distance). The nudge puts a distance on a boundary (exact *
  // (max_distance / exact)^(k / (n - exact))) into the upper bucket, which
  // rounding in log() could miss.
  const double k = std::log(static_cast<double>(distance) / static_cast<double>(exact)) /
                   std::log(static_cast<double>(b.max_distance) / static_cast<double>(exact)) *
                   static_cast<double>(n - exact);
  return first + std::min(exact + static_cast<int64_t>(std::floor(k + 1e-9)), n - 1);
}

RelativePositionBias::RelativePositionBias(Dim h, const RelativePositionBuckets& b, bool bidi, uint64_t seed,
                                           const TensorOptions& opts)
    : heads(std::move(h)),
      buckets("buckets", buckets_per_direction("RelativePositionBias", b, bidi) * (bidi ? 2 : 1)),
      config(b),
      bidirectional(bidi),
      table(init_uniform({buckets, heads}, 1, seed, opts)) {}

Tensor RelativePositionBias::operator()(const Dim& query_dim, const Dim& kv_dim,
                                        const std::optional<Tensor>& query_offset) const {
  DIMATTN_CHECK(query_dim != kv_dim, "RelativePositionBias", "query and kv positions are one dim ",
                query_dim.repr(), "; give keys and values a kv dim of their own");
  const TensorOptions int_opts = detail::options_like(table, DType::int64);
  // kv position j relative to query row i: j - (i + offset), clamped to
  // [-max_distance, max_distance], where the buckets end.
  Tensor relative = add(neg(range_over_dim(query_dim, int_opts)), range_over_dim(kv_dim, int_opts));
  if (query_offset) {
    const DType t = query_offset->dtype();
    DIMATTN_CHECK(t == DType::int32 || t == DType::int64, "RelativePositionBias", "query_offset must be an int32 or ",
                  "int64 tensor, got ", query_offset->repr());
    relative = sub(relative, cast(*query_offset, DType::int64));
  }
  const double reach = static_cast<double>(config.max_distance);
  relative = minimum(maximum(relative, full({}, -reach, int_opts)), full({}, reach, int_opts));
  Dim offsets("relative_position", 2 * config.max_distance + 1);
  const Tensor bucket_of = from_host({offsets}, bucket_table(config, bidirectional), int_opts);
  const Tensor bucket = gather(bucket_of, offsets, add(relative, reach));
  // The table's rows gathered per (query, kv): {heads, query, kv}, no bigger
  // than the bias (gather's gradient reaches the table on the torch backend).
  return gather(table, buckets, bucket);
}

Linear::Linear(Dim in, Dim out, uint64_t seed, const TensorOptions& opts, bool with_bias)
    : in_dim(in), out_dim(out), weight(init_uniform({in, out}, in.extent(), seed, opts)) {
  if (with_bias) bias = init_uniform({out}, in.extent(), seed + 1, opts);
}

Tensor Linear::operator()(const Tensor& x) const {
  DIMATTN_CHECK(x.has(in_dim), "Linear", "input ", repr(x.dims()), " lacks the in dim ", in_dim.repr());
  Tensor y = matmul(x, weight, {in_dim});
  return bias ? add(y, *bias) : y;
}

SelfAttention::SelfAttention(const AttentionConfig& c) : SelfAttention(c, "SelfAttention", false) {}

SelfAttention::SelfAttention(const AttentionConfig& c, const char* module, bool causal)
    : config(c),
      heads(heads_dim(c)),
      key_dim_per_head(per_head(module, c.key_dim_total, heads)),
      value_dim_per_head(per_head(module, c.value_dim_total, heads)),
      qkv_dim_per_head("qkv_per_head", 2 * key_dim_per_head.extent() + value_dim_per_head.extent()),
      qkv(c.in_dim, heads * qkv_dim_per_head, c.seed, c.opts, c.with_bias),
      proj(c.value_dim_total, c.proj_dim, c.seed + 2, c.opts, c.with_bias) {
  check_variants(module, c.variants, causal);
  if (c.sinks) sinks = init_uniform({heads}, 1, c.seed + 6, c.opts);
  if (c.alibi) alibi_slopes = from_host({heads}, standard_alibi_slopes(c.num_heads), c.opts);
  if (c.relative_position) relative_position_bias.emplace(heads, *c.relative_position, !causal, c.seed + 7, c.opts);
  variants().check_values(module, causal);  // with the module's own tensors (its sinks and the off-by-one sink)
}

std::vector<double> standard_alibi_slopes(int64_t num_heads) {
  DIMATTN_CHECK(num_heads > 0, "standard_alibi_slopes", "num_heads must be positive, got ", num_heads);
  int64_t p = 1;  // the largest power of two <= num_heads
  while (2 * p <= num_heads) p *= 2;
  std::vector<double> slopes;
  for (int64_t k = 0; k < p; ++k) slopes.push_back(std::exp2(-8.0 * static_cast<double>(k + 1) / static_cast<double>(p)));
  for (int64_t j = 0; j < num_heads - p; ++j)
    slopes.push_back(std::exp2(-8.0 * static_cast<double>(2 * j + 1) / static_cast<double>(2 * p)));
  return slopes;
}

std::tuple<Tensor, Tensor, Tensor> SelfAttention::project_qkv(const Tensor& x) const {
  Tensor fused = split_dims(qkv(x), qkv.out_dim, {heads, qkv_dim_per_head});
  const int64_t kh = key_dim_per_head.extent();
  return {part(fused, qkv_dim_per_head, 0, key_dim_per_head), part(fused, qkv_dim_per_head, kh, key_dim_per_head),
          part(fused, qkv_dim_per_head, 2 * kh, value_dim_per_head)};
}

Tensor SelfAttention::merge_heads(const Tensor& att) const {
  return proj(merge_dims(att, {heads, value_dim_per_head}, config.value_dim_total).first);
}

AttentionOptions SelfAttention::attention_options(const Dim& axis) const {
  return {.key_dim = key_dim_per_head,
          .axis = axis,
          .att_dropout = config.att_dropout,
          .att_dropout_broadcast = config.att_dropout_broadcast,
          .variants = variants()};
}

AttentionVariants SelfAttention::variants() const {
  AttentionVariants v = config.variants;
  v.alibi_slopes = alibi_slopes;
  v.sinks = sinks;
  return v;
}

void SelfAttention::add_relative_position_bias(AttentionOptions& o, Tensor& keys, Tensor& values,
                                               const Dim& query_dim, const std::optional<Tensor>& offset) const {
  if (!relative_position_bias) return;
  DIMATTN_CHECK(relative_position_bias->heads == heads, "SelfAttention", "relative_position_bias has heads ",
                relative_position_bias->heads.repr(), ", not the module's ", heads.repr());
  if (o.axis == query_dim) {
    const Dim kv = twin_of(query_dim, query_dim.name() + "_kv");
    keys = replace_dim(keys, query_dim, kv);
    values = replace_dim(values, query_dim, kv);
    o.axis = kv;
  }
  o.variants.bias = (*relative_position_bias)(query_dim, o.axis, offset);
}

Tensor SelfAttention::operator()(const Tensor& x, const Dim& axis) const {
  auto [q, k, v] = project_qkv(x);
  AttentionOptions o = attention_options(axis);
  // Self-attention: the query's positions are `axis` (the kv side is relabelled).
  if (o.variants.positional()) o.query_position_dim = axis;
  add_relative_position_bias(o, k, v, axis);
  return merge_heads(dot_attention(q, k, v, o));
}

CausalSelfAttention::CausalSelfAttention(const AttentionConfig& c) : SelfAttention(c, "CausalSelfAttention", true) {}

Tensor CausalSelfAttention::operator()(const Tensor& x, const Dim& axis) const {
  auto [q, k, v] = project_qkv(x);
  AttentionOptions o = attention_options(axis);
  o.causal_query_spatial_dim = axis;
  add_relative_position_bias(o, k, v, axis);
  return merge_heads(dot_attention(q, k, v, o));
}

CausalSelfAttention::State CausalSelfAttention::initial_state(const Dims& batch) const {
  TensorOptions int_opts = config.opts;
  int_opts.dtype = DType::int64;
  Dim hist = Dim::dynamic("history", zeros(batch, int_opts), 0);
  Dims kdims = batch, vdims = batch;
  kdims.insert(kdims.end(), {heads, hist, key_dim_per_head});
  vdims.insert(vdims.end(), {heads, hist, value_dim_per_head});
  return {zeros(kdims, config.opts), zeros(vdims, config.opts), hist};
}

std::pair<Tensor, CausalSelfAttention::State> CausalSelfAttention::step(const Tensor& x, const State& state) const {
  // A chunk of one position: its causal offset (the history length) places
  // it for the window and ALiBi.
  Dim one("step", 1);
  auto [y, next] = chunk(expand_dim(x, one), one, state);
  return {squeeze(y, one), next};
}

std::pair<Tensor, CausalSelfAttention::State> CausalSelfAttention::chunk(const Tensor& x, const Dim& axis,
                                                                         const State& state) const {
  DIMATTN_CHECK(x.has(axis), "CausalSelfAttention", "chunk axis ", axis.repr(), " is not in ", repr(x.dims()));
  auto [q, k, v] = project_qkv(x);
  auto [k_all, v_all, kv_axis] = append(state.keys, state.values, state.axis, k, v, axis);
  AttentionOptions o = attention_options(kv_axis);
  o.causal_query_spatial_dim = axis;
  // Chunk row i of entry b is position lengths[b] + i of what the state
  // holds; a windowed state holds only the window, which is all row i sees.
  o.causal_offset = state.axis.lengths();
  // The chunk's rows sit after the history: the same offset places them.
  add_relative_position_bias(o, k_all, v_all, axis, o.causal_offset);
  Tensor y = merge_heads(dot_attention(q, k_all, v_all, o));
  if (const std::optional<AttentionWindow>& w = config.variants.window; w && w->left)
    std::tie(k_all, v_all, kv_axis) = keep_last(k_all, v_all, kv_axis, *w->left);
  return {y, State{k_all, v_all, kv_axis}};
}

Tensor relative_positional_encoding(int64_t query_extent, int64_t kv_extent, const Dim& rel, const Dim& feat,
                                    const TensorOptions& opts) {
  const int64_t f = feat.extent(), half = f / 2;
  DIMATTN_CHECK(f % 2 == 0, "relative_positional_encoding", "feat ", feat.repr(), " must be even (sines, then cosines)");
  DIMATTN_CHECK(rel.extent() == query_extent + kv_extent - 1, "relative_positional_encoding", "rel ", rel.repr(),
                " needs ", query_extent + kv_extent - 1, " rows (query_extent + kv_extent - 1)");
  std::vector<double> t(static_cast<size_t>(rel.extent() * f));
  for (int64_t r = 0; r < rel.extent(); ++r)
    for (int64_t c = 0; c < half; ++c) {
      const double a = static_cast<double>(r - (query_extent - 1)) *
                       std::exp(static_cast<double>(c) * (-2.0 * std::log(1e4) / static_cast<double>(f)));
      t[static_cast<size_t>(r * f + c)] = std::sin(a);
      t[static_cast<size_t>(r * f + half + c)] = std::cos(a);
    }
  return from_host({rel, feat}, t, opts);
}

RelPosSelfAttention::RelPosSelfAttention(const AttentionConfig& c, const RelPosConfig& r)
    : SelfAttention(c, "RelPosSelfAttention", false),
      rel(r),
      pos_emb_feat_dim(r.with_linear_pos ? c.in_dim : r.separate_pos_emb_per_head ? c.key_dim_total : key_dim_per_head),
      clipped("learned_rel_pos", 2 * std::max<int64_t>(r.learnable_pos_emb_clipping, 0) + 1) {
  DIMATTN_CHECK(r.learnable_pos_emb_clipping >= 0, "RelPosSelfAttention", "learnable_pos_emb_clipping must be >= 0, ",
                "got ", r.learnable_pos_emb_clipping);
  DIMATTN_CHECK(!relative_position_bias, "RelPosSelfAttention", "config.relative_position (T5's bias) and the ",
                "module's relative positions are two encodings of one thing; use one");
  if (r.with_linear_pos)
    linear_pos.emplace(c.in_dim, r.separate_pos_emb_per_head ? c.key_dim_total : key_dim_per_head, c.seed + 8, c.opts,
                       false);
  if (r.learnable_pos_emb) learned_pos_emb = random_uniform({clipped, pos_emb_feat_dim}, c.seed + 9, c.opts, -1, 1);
  if (r.with_pos_bias) {
    const double bound = std::sqrt(6.0 / static_cast<double>(heads.extent() + key_dim_per_head.extent()));
    pos_bias_u = random_uniform({heads, key_dim_per_head}, c.seed + 10, c.opts, -bound, bound);
    pos_bias_v = random_uniform({heads, key_dim_per_head}, c.seed + 11, c.opts, -bound, bound);
  }
}

Tensor RelPosSelfAttention::position_table(int64_t extent, const Dim& rel_dim) const {
  Tensor table = relative_positional_encoding(extent, extent, rel_dim, pos_emb_feat_dim, config.opts);
  if (learned_pos_emb) {
    // Row r (relative position r - (extent - 1)) reads the learned row of its clipped position.
    const TensorOptions int_opts = detail::options_like(*learned_pos_emb, DType::int64);
    const double c = static_cast<double>(rel.learnable_pos_emb_clipping);
    Tensor at = add(range_over_dim(rel_dim, int_opts), -static_cast<double>(extent - 1));
    at = add(minimum(maximum(at, full({}, -c, int_opts)), full({}, c, int_opts)), c);
    table = gather(*learned_pos_emb, clipped, at);
  }
  if (rel.pos_emb_dropout > 0) table = dropout(table, rel.pos_emb_dropout, table.dims());
  if (linear_pos) table = (*linear_pos)(table);
  return rel.separate_pos_emb_per_head ? split_dims(table, config.key_dim_total, {heads, key_dim_per_head}) : table;
}

Tensor RelPosSelfAttention::operator()(const Tensor& x, const Dim& axis) const {
  auto [q, k, v] = project_qkv(x);
  const Dim kv = twin_of(axis, axis.name() + "_kv"), rel_dim("rel_pos", 2 * axis.extent() - 1);
  AttentionOptions o = attention_options(kv);
  o.query_position_dim = axis;
  o.variants.pos_emb = position_table(axis.extent(), rel_dim);
  o.variants.pos_bias_u = pos_bias_u;
  o.variants.pos_bias_v = pos_bias_v;
  return merge_heads(dot_attention(q, replace_dim(k, axis, kv), replace_dim(v, axis, kv), o));
}

CrossAttention::CrossAttention(const AttentionConfig& c, Dim enc)
    : config(c),
      encoder_dim(enc),
      heads(heads_dim(c)),
      key_dim_per_head(per_head("CrossAttention", c.key_dim_total, heads)),
      value_dim_per_head(per_head("CrossAttention", c.value_dim_total, heads)),
      kv_dim_per_head("kv_per_head", key_dim_per_head.extent() + value_dim_per_head.extent()),
      query(c.in_dim, c.key_dim_total, c.seed, c.opts, c.with_bias),
      kv(enc, heads * kv_dim_per_head, c.seed + 4, c.opts, c.with_bias),
      proj(c.value_dim_total, c.proj_dim, c.seed + 2, c.opts, c.with_bias) {
  check_variants("CrossAttention", c.variants, false);
  const bool window = c.variants.window.has_value();
  DIMATTN_CHECK(!window && !c.alibi && !c.relative_position, "CrossAttention",
                window ? "a window" : c.alibi ? "ALiBi" : "a relative position bias",
                " measures the distance between query and key positions, which cross-attention does not relate ",
                "(decoder vs encoder); leave window, alibi and relative_position unset");
  if (c.sinks) sinks = init_uniform({heads}, 1, c.seed + 6, c.opts);
  AttentionVariants own = c.variants;
  own.sinks = sinks;
  own.check_values("CrossAttention", false);
}

CrossAttention::State CrossAttention::transform_encoder(const Tensor& encoder, const Dim& axis) const {
  DIMATTN_CHECK(encoder.has(axis), "CrossAttention", "encoder axis ", axis.repr(), " is not in ", repr(encoder.dims()));
  Tensor fused = split_dims(kv(encoder), kv.out_dim, {heads, kv_dim_per_head});
  return {part(fused, kv_dim_per_head, 0, key_dim_per_head),
          part(fused, kv_dim_per_head, key_dim_per_head.extent(), value_dim_per_head), axis};
}

Tensor CrossAttention::operator()(const Tensor& x, const State& state) const {
  Tensor q = split_dims(query(x), config.key_dim_total, {heads, key_dim_per_head});
  AttentionOptions o{.key_dim = key_dim_per_head,
                     .axis = state.axis,
                     .att_dropout = config.att_dropout,
                     .att_dropout_broadcast = config.att_dropout_broadcast,
                     .variants = config.variants};
  o.variants.sinks = sinks;
  Tensor att = dot_attention(q, state.keys, state.values, o);
  return proj(merge_dims(att, {heads, value_dim_per_head}, config.value_dim_total).first);
}

}  // namespace dimattn
