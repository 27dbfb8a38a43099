#pragma once
// AttentionCall: one dot_attention call with names turned into roles, as a
// backend's attention hook receives it. Backends read roles, never names.
//
// Invariants (established by dot_attention):
//   query  dims = batch ∪ query_groups ∪ {query_spatial, key_dim}
//   keys   dims ⊆ batch ∪ keys_only ∪ {kv_spatial, key_dim}, ⊇ {kv_spatial, key_dim}
//   values dims ⊆ batch ∪ keys_only ∪ {kv_spatial} ∪ value_feature, ⊇ {kv_spatial}
//   output dims = batch ∪ keys_only ∪ query_groups ∪ {query_spatial} ∪ value_feature
// The query's own dims (those keys/values lack) are query_spatial plus
// query_groups (e.g. beam, or the query heads sharing one kv head in GQA).
// Keys and values never carry them: a kernel treats groups as more query rows
// or as GQA heads, as views where strides allow, and never tiles keys/values.
// Causal masks use the query_spatial position and broadcast over groups.
// kv_spatial never appears in the query. A dynamic kv_spatial's lengths vary
// over a subset of batch ∪ keys_only ∪ query_groups ∪ {query_spatial}: each
// query row attends the kv positions below its own length.
#include <cstdint>
#include <optional>

#include "dimattn/dim.h"
#include "dimattn/selection.h"
#include "dimattn/tensor.h"
#include "dimattn/variants.h"

namespace dimattn {

struct AttentionCall {
  Tensor query, keys, values;
  Dims batch;          // in the query's order: the canonical order of the flat batch index
  Dims keys_only;      // in keys/values, not in the query: broadcast over
  Dims query_groups;   // the query's own dims besides query_spatial
  Dim query_spatial;
  Dim kv_spatial;
  Dim key_dim;
  Dims value_feature;
  double scale = 1.0;
  bool causal = false;
  std::optional<Tensor> causal_offset;  // int, over a subset of batch dims; absent = 0
  double dropout = 0.0;                 // effective: 0 unless the train flag is on
  bool dropout_broadcast = false;
  uint64_t dropout_seed = 0;
  uint64_t dropout_offset = 0;
  // Dropout keys query_spatial position i as dropout_q_position + i and kv
  // position j as dropout_kv_position + j (AttentionOptions::positions; the
  // causal offset already holds their difference).
  int64_t dropout_q_position = 0, dropout_kv_position = 0;
  // Variants (AttentionOptions::variants, checked; order in docs/numerics.md).
  // With a window or ALiBi, query_spatial is the query's positional dim. The
  // slopes and sinks are over a subset of batch ∪ keys_only ∪ query_groups;
  // the off-by-one sink is a zero scalar in `sinks` here. A bias or mask is
  // over a subset of batch ∪ keys_only ∪ query_groups ∪ {query_spatial,
  // kv_spatial}.
  AttentionVariants variants;
  // With variants.pos_emb: how its rows are indexed (variants.h).
  std::optional<RelPosForm> rel_pos;

  bool positional() const { return causal || variants.positional(); }
  // The kv axis's lengths: none (static), per batch entry, or per query row
  // (they vary over query_spatial or query_groups).
  Padding padding() const;
};

// Attention over a paged kv cache (kv_cache_attention, dimattn/kv_cache.h)
// as a kernel receives it: every tensor aligned to its dims' fixed order
// (views of the caller's memory; the pools never copied):
//   query        {batch..., kv_heads..., groups..., query_spatial, key_dim}
//   keys, values {block, slot, kv_heads..., key_dim / value_feature}
//   block_table  {batch..., table} (int32), lengths {batch...} (int64)
// Sequence e's kv position j lies in block block_table[e, j / |slot|] at
// slot j % |slot|; it has lengths[e] positions, its query_lengths[e] (all
// of query_spatial when absent) query rows the last of them: causal row i
// attends j <= i + lengths[e] - query_lengths[e]. The output is over
// {batch..., kv_heads..., groups..., query_spatial, value_feature}.
struct PagedAttentionCall {
  Tensor query, keys, values, block_table, lengths;
  std::optional<Tensor> query_lengths;
  Dims batch, kv_heads, groups;
  Dim query_spatial, key_dim, value_feature, block, slot, table;
  double scale = 1.0;
  bool causal = true;
  std::optional<AttentionWindow> window;
  std::optional<double> softcap;
  // Per-head values over a subset of batch ∪ kv_heads ∪ groups (ALiBi's
  // distance is measured from each row's diagonal i + lengths[e] - query length).
  std::optional<Tensor> alibi_slopes, sinks;
};

// The roles of a call as AttentionParams, with the given layout class (the
// backend detects it) and the current forcing and determinism settings.
// (Calls under a capturing TraceScope never get here: dot_attention runs the
// reference path for them itself.)
AttentionParams attention_params(const AttentionCall& call, LayoutClass layout, bool requires_grad);

// The keep mask of the call's attention dropout, drawn from the shared Philox
// stream (kernels/common/philox.h): a bool tensor beside `like` (same backend
// and device) over {kv_spatial} for broadcast dropout, else over batch,
// keys_only, query_groups, query_spatial and kv_spatial. Every path that
// applies attention dropout uses this mask or the same Philox function.
// pre: call.dropout > 0.
Tensor attention_dropout_keep_mask(const AttentionCall& call, const Tensor& like);

// One call computed as a block of a longer attention (Backend::attention_block):
// its output (over the call's output dims) and the log-sum-exp of each query
// row's energies (natural log; over the output's dims without value_feature;
// float32, float64 for float64 calls; -inf for a row that attends nothing).
// Blocks over disjoint kv ranges merge exactly through the lse
// (docs/distributed.md).
struct AttentionBlockResult {
  Tensor output, lse;
};

// Gradients of one call's output with respect to its query, keys and values
// (Backend::attention_backward): each over the dims of the role tensor it
// belongs to, in any order (keys/values may carry broadcast dims they lack).
struct AttentionCallGrads {
  Tensor query, keys, values;
  // The gradients of the call's learnable variant tensors
  // (AttentionVariants::learnable), each in the field of its tensor, over
  // its dims; the other fields unset.
  AttentionVariants variants;
};

}  // namespace dimattn
