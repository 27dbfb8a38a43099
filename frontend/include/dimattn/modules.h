#pragma once
// Attention modules in the style of RETURNN's rf.SelfAttention family.
// Parameters are named Tensors initialised deterministically from a seed.
// The fused qkv weight is head-major: per head, its q, then k, then v columns.
#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

#include "dimattn/attention.h"
#include "dimattn/ops.h"

namespace dimattn {

class Linear {
 public:
  // weight ~ U(-1/sqrt(in), 1/sqrt(in)) from seed; bias likewise from seed + 1.
  Linear(Dim in_dim, Dim out_dim, uint64_t seed, const TensorOptions& opts = {}, bool with_bias = true);
  Tensor operator()(const Tensor& x) const;  // x {..., in_dim} -> {..., out_dim}

  Dim in_dim, out_dim;
  Tensor weight;                // {in_dim, out_dim}
  std::optional<Tensor> bias;   // {out_dim}
};

// T5's bucketing of relative positions (Raffel et al., "Exploring the Limits
// of Transfer Learning", section 2.1): `num_buckets` buckets, exact ones for
// small distances, then logarithmically wider ones up to `max_distance`,
// beyond which all distances share the last bucket.
struct RelativePositionBuckets {
  int64_t num_buckets = 32;
  int64_t max_distance = 128;
};

// The bucket of a kv position `relative` positions after the query (relative
// = kv position - query position; negative: before the query). Bidirectional:
// half the buckets for kv positions at or before the query, half (from
// num_buckets / 2 on) for those after it; causal: all buckets for distances
// back, positions after the query share bucket 0. Within a half of n buckets
// (causal: all n) a distance d < n/2 is its own bucket d; a larger one goes to
// n/2 + floor(log(d / (n/2)) / log(max_distance / (n/2)) * (n - n/2)), at most
// n - 1 (bucket boundaries included exactly). Throws for a bidirectional odd
// or < 4 num_buckets, a causal one < 2, or max_distance <= n/2.
int64_t relative_position_bucket(int64_t relative, const RelativePositionBuckets& buckets, bool bidirectional);

// A learnable T5 relative position bias: a scalar per (bucket, head), added
// to the energies by bucket of the kv position relative to the query's. T5
// shares one over all layers: copies share the table.
class RelativePositionBias {
 public:
  // table ~ U(-1, 1) from seed.
  RelativePositionBias(Dim heads, const RelativePositionBuckets& buckets, bool bidirectional, uint64_t seed,
                       const TensorOptions& opts = {});
  // The bias {heads, query_dim, kv_dim} (plus query_offset's dims) for
  // dot_attention's `bias`: entry (h, i, j) = table[bucket(j - (i + offset)),
  // h], with query row i at kv position i + offset (offset: integer, over
  // batch dims, e.g. a chunk's history lengths; default 0). Built with named
  // ops (the table's rows gathered by bucket), so that on the torch backend
  // the gradient reaches the table.
  Tensor operator()(const Dim& query_dim, const Dim& kv_dim,
                    const std::optional<Tensor>& query_offset = std::nullopt) const;

  Dim heads, buckets;
  RelativePositionBuckets config;
  bool bidirectional;
  Tensor table;  // {buckets, heads}; requires_grad(true) on the torch backend to learn it
};

struct AttentionConfig {
  Dim in_dim;
  Dim proj_dim;         // output feature dim
  Dim key_dim_total;    // heads * key dim per head
  Dim value_dim_total;  // heads * value dim per head
  int64_t num_heads = 1;
  double att_dropout = 0.0;
  bool att_dropout_broadcast = false;
  uint64_t seed = 0;
  TensorOptions opts = {};

  // --- variants (docs/api.md, "Variants"), passed to dot_attention ---
  // Its scalar variants, passed on whole. A window is in kv positions:
  // CausalSelfAttention takes `left` positions before each query (`right`
  // unset or 0), and its step and chunk states keep only the last `left`
  // positions; SelfAttention either side; not for CrossAttention (encoder and
  // decoder positions are unrelated). Tensors are the module's own (the
  // flags below), not set here.
  AttentionVariants variants;
  // ALiBi with standard_alibi_slopes(num_heads) over the heads dim. Not for
  // CrossAttention.
  bool alibi = false;
  // A learnable sink logit per head: the module's `sinks` parameter, U(-1, 1)
  // from seed + 6. Exclusive with variants.sink_off_by_one (the fixed logit 0).
  bool sinks = false;
  // T5's relative position bias (RelativePositionBias above): the module's
  // `relative_position_bias` with this many buckets, bidirectional for
  // SelfAttention, causal for CausalSelfAttention; table from seed + 7. Not
  // for CrossAttention.
  std::optional<RelativePositionBuckets> relative_position;
  // Biases of the input and output projections (RETURNN's with_bias).
  bool with_bias = true;
};

// ALiBi's slopes for `num_heads` heads (Press et al., "Train Short, Test
// Long", and BLOOM): for n a power of two, the geometric sequence
// 2^(-8(k+1)/n), k = 0 .. n-1. Otherwise, with p the largest power of two
// below n, the p slopes for p heads, then the first n - p of the slopes for
// 2p heads that lie between those, 2^(-8(2j+1)/(2p)), j = 0, 1, ...
std::vector<double> standard_alibi_slopes(int64_t num_heads);

class SelfAttention {
 public:
  explicit SelfAttention(const AttentionConfig& config);
  // x {..., axis, in_dim} -> {..., axis, proj_dim}: full (non-causal) self-attention.
  Tensor operator()(const Tensor& x, const Dim& axis) const;

  AttentionConfig config;
  Dim heads, key_dim_per_head, value_dim_per_head, qkv_dim_per_head;
  Linear qkv, proj;
  std::optional<Tensor> sinks;         // {heads}, with config.sinks (requires_grad(true) to learn it)
  std::optional<Tensor> alibi_slopes;  // {heads}, with config.alibi
  // With config.relative_position; may be replaced by one shared with other
  // layers (its heads must be this module's).
  std::optional<RelativePositionBias> relative_position_bias;

 protected:
  // `module` names the module in errors; causal: its window may look back only.
  SelfAttention(const AttentionConfig& config, const char* module, bool causal);
  // q, k {..., heads, key_dim_per_head}, v {..., heads, value_dim_per_head}.
  std::tuple<Tensor, Tensor, Tensor> project_qkv(const Tensor& x) const;
  // attention output {..., heads, value_dim_per_head} -> {..., proj_dim}
  Tensor merge_heads(const Tensor& att) const;
  // key_dim, axis, dropout and variants() (positions are the caller's).
  AttentionOptions attention_options(const Dim& axis) const;
  // config.variants with the module's ALiBi slopes and sinks.
  AttentionVariants variants() const;
  // With a relative position bias, sets o.bias over {heads, query_dim, o.axis}
  // (query row i at kv position i + offset). In self-attention (o.axis ==
  // query_dim) keys and values first get a kv dim of their own, which becomes
  // o.axis, so that the bias can name both positions.
  void add_relative_position_bias(AttentionOptions& o, Tensor& keys, Tensor& values, const Dim& query_dim,
                                  const std::optional<Tensor>& offset = std::nullopt) const;
};

class CausalSelfAttention : public SelfAttention {
 public:
  // Keys and values of the history, {batch..., heads, axis, per-head dim};
  // axis is dynamic with per-entry history lengths. With a window, only each
  // entry's last window.left positions: the axis never exceeds that extent.
  struct State {
    Tensor keys, values;
    Dim axis;
  };

  explicit CausalSelfAttention(const AttentionConfig& config);
  // Full sequence: x {..., axis, in_dim}, each position attending to itself and before.
  Tensor operator()(const Tensor& x, const Dim& axis) const;
  // An empty history over `batch` dims.
  State initial_state(const Dims& batch) const;
  // One step: x {batch..., in_dim} without a spatial dim.
  std::pair<Tensor, State> step(const Tensor& x, const State& state) const;
  // A chunk appended to the history: x {batch..., axis, in_dim}; position i of
  // entry b attends the history and chunk positions <= i (a dynamic axis: the
  // first lengths[b] positions are entry b's chunk).
  std::pair<Tensor, State> chunk(const Tensor& x, const Dim& axis, const State& state) const;
};

// Transformer-XL's sinusoidal table over {rel, feat} (rel of query_extent +
// kv_extent - 1 rows, feat even): row r encodes the relative position j - i =
// r - (query_extent - 1), its first half sin(pos / 10000^(2c / feat)), its
// second half the cosines (RETURNN's rf.relative_positional_encoding).
Tensor relative_positional_encoding(int64_t query_extent, int64_t kv_extent, const Dim& rel, const Dim& feat,
                                    const TensorOptions& opts = {});

// RETURNN's rf.RelPosSelfAttention options; the defaults are Transformer-XL's.
struct RelPosConfig {
  bool with_linear_pos = true;  // the table projected by linear_pos (in_dim -> key_dim_total or per head)
  bool with_pos_bias = true;    // pos_bias_u and pos_bias_v
  bool learnable_pos_emb = false;        // a learned table instead of the sinusoidal one
  int64_t learnable_pos_emb_clipping = 16;  // its relative positions clipped to +-this
  bool separate_pos_emb_per_head = true;    // a table per head, else one shared by all heads
  double pos_emb_dropout = 0.0;             // on the table, while the train flag is on
};

// Self-attention with relative positions, Transformer-XL style (the
// Conformer's; RETURNN's rf.RelPosSelfAttention, its parameters and
// layouts): x {..., axis, in_dim} -> {..., axis, proj_dim}; the energy of
// positions i and j is scale * ((q_i + u) . k_j + (q_i + v) . p[j - i]),
// computed in the kernels from the table p (dot_attention's pos_emb, never a
// [T, T] tensor). Parameters: qkv and proj (SelfAttention's), linear_pos (seed
// + 8), learned_pos_emb {2 clipping + 1, in_dim or the per-head dim} (U(-1, 1),
// seed + 9), pos_bias_u and pos_bias_v {heads, key_dim_per_head}
// (Glorot-uniform, seeds + 10, + 11).
class RelPosSelfAttention : public SelfAttention {
 public:
  explicit RelPosSelfAttention(const AttentionConfig& config, const RelPosConfig& rel = {});
  Tensor operator()(const Tensor& x, const Dim& axis) const;
  // The table of a sequence of `extent` positions over {rel (2 extent - 1),
  // key_dim_per_head} and, per head, {heads}: what dot_attention gets as pos_emb.
  Tensor position_table(int64_t extent, const Dim& rel) const;

  RelPosConfig rel;
  Dim pos_emb_feat_dim, clipped;
  std::optional<Linear> linear_pos;
  std::optional<Tensor> learned_pos_emb;  // {clipped, pos_emb_feat_dim}
  std::optional<Tensor> pos_bias_u, pos_bias_v;  // {heads, key_dim_per_head}
};

class CrossAttention {
 public:
  struct State {
    Tensor keys, values;  // {batch..., heads, axis, per-head dim}
    Dim axis;
  };

  CrossAttention(const AttentionConfig& config, Dim encoder_dim);
  // Keys and values of the encoder, computed once per sequence.
  State transform_encoder(const Tensor& encoder, const Dim& axis) const;
  // x {..., in_dim} may carry dims the encoder lacks (beam, time): the encoder
  // state is never tiled over them.
  Tensor operator()(const Tensor& x, const State& state) const;

  AttentionConfig config;
  Dim encoder_dim, heads, key_dim_per_head, value_dim_per_head, kv_dim_per_head;
  Linear query, kv, proj;
  std::optional<Tensor> sinks;  // {heads}, with config.sinks
};

}  // namespace dimattn
