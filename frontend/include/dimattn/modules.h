#pragma once
// Attention modules in the style of RETURNN's rf.SelfAttention family.
// Parameters are named Tensors initialised deterministically from a seed.
// The fused qkv weight is head-major: per head, its q, then k, then v columns.
#include <cstdint>
#include <optional>
#include <tuple>

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
};

class SelfAttention {
 public:
  explicit SelfAttention(const AttentionConfig& config);
  // x {..., axis, in_dim} -> {..., axis, proj_dim}: full (non-causal) self-attention.
  Tensor operator()(const Tensor& x, const Dim& axis) const;

  AttentionConfig config;
  Dim heads, key_dim_per_head, value_dim_per_head, qkv_dim_per_head;
  Linear qkv, proj;

 protected:
  // q, k {..., heads, key_dim_per_head}, v {..., heads, value_dim_per_head}.
  std::tuple<Tensor, Tensor, Tensor> project_qkv(const Tensor& x) const;
  // attention output {..., heads, value_dim_per_head} -> {..., proj_dim}
  Tensor merge_heads(const Tensor& att) const;
  AttentionOptions attention_options(const Dim& axis) const;
};

class CausalSelfAttention : public SelfAttention {
 public:
  // Keys and values of the history, {batch..., heads, axis, per-head dim};
  // axis is dynamic with per-entry history lengths.
  struct State {
    Tensor keys, values;
    Dim axis;
  };

  using SelfAttention::SelfAttention;
  // Full sequence: x {..., axis, in_dim}, each position attending to itself and before.
  Tensor operator()(const Tensor& x, const Dim& axis) const;
  // An empty history over `batch` dims.
  State initial_state(const Dims& batch) const;
  // One step: x {batch..., in_dim} without a spatial dim.
  std::pair<Tensor, State> step(const Tensor& x, const State& state) const;
  // A chunk appended to the history: x {batch..., axis, in_dim}; position i of
  // entry b attends the history and chunk positions <= i.
  std::pair<Tensor, State> chunk(const Tensor& x, const Dim& axis, const State& state) const;

 private:
  std::pair<Tensor, State> extend(const Tensor& q, const Tensor& k, const Tensor& v, const Dim& axis,
                                  const State& state, bool causal) const;
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
};

}  // namespace dimattn
