#include "dimattn/modules.h"

#include <cmath>

#include "dimattn/error.h"
#include "dimattn/internal/check.h"

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

}  // namespace

Linear::Linear(Dim in, Dim out, uint64_t seed, const TensorOptions& opts, bool with_bias)
    : in_dim(in), out_dim(out), weight(init_uniform({in, out}, in.extent(), seed, opts)) {
  if (with_bias) bias = init_uniform({out}, in.extent(), seed + 1, opts);
}

Tensor Linear::operator()(const Tensor& x) const {
  DIMATTN_CHECK(x.has(in_dim), "Linear", "input ", repr(x.dims()), " lacks the in dim ", in_dim.repr());
  Tensor y = matmul(x, weight, {in_dim});
  return bias ? add(y, *bias) : y;
}

SelfAttention::SelfAttention(const AttentionConfig& c)
    : config(c),
      heads(heads_dim(c)),
      key_dim_per_head(per_head("SelfAttention", c.key_dim_total, heads)),
      value_dim_per_head(per_head("SelfAttention", c.value_dim_total, heads)),
      qkv_dim_per_head("qkv_per_head", 2 * key_dim_per_head.extent() + value_dim_per_head.extent()),
      qkv(c.in_dim, heads * qkv_dim_per_head, c.seed, c.opts),
      proj(c.value_dim_total, c.proj_dim, c.seed + 2, c.opts) {}

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
          .att_dropout_broadcast = config.att_dropout_broadcast};
}

Tensor SelfAttention::operator()(const Tensor& x, const Dim& axis) const {
  auto [q, k, v] = project_qkv(x);
  return merge_heads(dot_attention(q, k, v, attention_options(axis)));
}

Tensor CausalSelfAttention::operator()(const Tensor& x, const Dim& axis) const {
  auto [q, k, v] = project_qkv(x);
  AttentionOptions o = attention_options(axis);
  o.causal_query_spatial_dim = axis;
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

std::pair<Tensor, CausalSelfAttention::State> CausalSelfAttention::extend(const Tensor& q, const Tensor& k,
                                                                          const Tensor& v, const Dim& axis,
                                                                          const State& state, bool causal) const {
  auto [k_all, v_all, kv_axis] = append(state.keys, state.values, state.axis, k, v, axis);
  AttentionOptions o = attention_options(kv_axis);
  if (causal) {
    o.causal_query_spatial_dim = axis;
    o.causal_offset = state.axis.lengths();
  }
  return {merge_heads(dot_attention(q, k_all, v_all, o)), State{k_all, v_all, kv_axis}};
}

std::pair<Tensor, CausalSelfAttention::State> CausalSelfAttention::step(const Tensor& x, const State& state) const {
  auto [q, k, v] = project_qkv(x);
  // The new position attends the whole history and itself: no causal mask needed.
  Dim one("step", 1);
  return extend(q, expand_dim(k, one), expand_dim(v, one), one, state, false);
}

std::pair<Tensor, CausalSelfAttention::State> CausalSelfAttention::chunk(const Tensor& x, const Dim& axis,
                                                                         const State& state) const {
  DIMATTN_CHECK(x.has(axis), "CausalSelfAttention", "chunk axis ", axis.repr(), " is not in ", repr(x.dims()));
  auto [q, k, v] = project_qkv(x);
  return extend(q, k, v, axis, state, true);
}

CrossAttention::CrossAttention(const AttentionConfig& c, Dim enc)
    : config(c),
      encoder_dim(enc),
      heads(heads_dim(c)),
      key_dim_per_head(per_head("CrossAttention", c.key_dim_total, heads)),
      value_dim_per_head(per_head("CrossAttention", c.value_dim_total, heads)),
      kv_dim_per_head("kv_per_head", key_dim_per_head.extent() + value_dim_per_head.extent()),
      query(c.in_dim, c.key_dim_total, c.seed, c.opts),
      kv(enc, heads * kv_dim_per_head, c.seed + 4, c.opts),
      proj(c.value_dim_total, c.proj_dim, c.seed + 2, c.opts) {}

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
                     .att_dropout_broadcast = config.att_dropout_broadcast};
  Tensor att = dot_attention(q, state.keys, state.values, o);
  return proj(merge_dims(att, {heads, value_dim_per_head}, config.value_dim_total).first);
}

}  // namespace dimattn
