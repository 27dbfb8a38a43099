#pragma once
// dot_attention: scaled dot-product attention over named dims, with RETURNN's
// semantics (DESIGN.md §3).
//
//   query  {..., key_dim}            keys {..., axis, key_dim}
//   values {..., axis, v_feat...}    -> values' dims without axis, plus the
//                                       query's dims that keys/values lack
//
// - Dims shared by query and keys/values (other than axis) are batch dims.
// - Query dims absent from keys/values (e.g. beam, or the query heads that
//   share one kv head in GQA) reach the backend as roles, not merged: one is
//   the query spatial dim (causal_query_spatial_dim, else the longest), the
//   rest are query groups (dimattn/ext/attention_call.h). Kernels treat groups
//   as more query rows or as GQA heads, as views where strides allow; keys and
//   values are never tiled over them (docs/architecture.md, "Deviation").
// - A query without any such dim (one decoding step) is given a size-1 query
//   dim, removed again from the result. Keys dims absent from the query are
//   broadcast.
// - `axis` in the query means full self-attention (the kv side is relabelled).
// - Causal: query position i attends kv positions <= i + causal_offset.
// - A dynamic `axis` masks padding; a query row without any valid kv position
//   gives output 0 and weights 0, never NaN.
// - Dropout acts only while the train flag is on (run_context.h).
// - Variants (sliding window, soft-capping, ALiBi, sinks, bias, mask) follow a
//   fixed order (docs/numerics.md): scale -> soft-capping -> + bias + ALiBi -> masks
//   (padding, causal, window, mask) -> softmax with sinks -> dropout -> . values.
#include <cstdint>
#include <optional>

#include "dimattn/dim.h"
#include "dimattn/selection.h"
#include "dimattn/tensor.h"
#include "dimattn/variants.h"

namespace dimattn {

// Where a call lies in a longer sequence when it computes one block of it
// (context parallelism, docs/distributed.md): the query's positional row i is
// position query + i, kv position j is kv + j. Causal masks, windows and
// ALiBi compare these positions (the causal offset gains query - kv), and
// dropout keys its mask by them, so the blocks of a sequence draw exactly
// the mask of the one call over all of it.
struct AttentionPositions {
  int64_t query = 0, kv = 0;
};

struct AttentionOptions {
  Dim key_dim;  // feature dim shared by query and keys, reduced in q·k
  Dim axis;     // the keys/values spatial dim attended over
  double att_dropout = 0.0;
  // Draw one dropout mask over `axis` only, shared by every other dim.
  bool att_dropout_broadcast = false;
  // Set for causal attention: the query's spatial dim (== axis for causal
  // self-attention).
  std::optional<Dim> causal_query_spatial_dim;
  // For causal attention of a chunk appended to a history: the history
  // length, an integer tensor over (a subset of) the batch dims, or rank 0.
  // Absent: 0, and query and kv extents must then be equal.
  std::optional<Tensor> causal_offset;
  // Default: 1/sqrt(extent(key_dim)).
  std::optional<double> scale;

  // --- variants (docs/api.md) ---
  // The query's positional dim, along which windows and ALiBi measure
  // distance (row i of the diagonal i + causal_offset). For causal attention
  // it is causal_query_spatial_dim (set it to that or leave it unset);
  // windows and ALiBi without causal need it: it is never guessed.
  std::optional<Dim> query_position_dim;
  // Sliding window, soft-capping, ALiBi, sinks, bias and mask (variants.h).
  AttentionVariants variants;
  // This call as one block of a longer sequence (AttentionPositions).
  // Needs a positional query dim (causal_query_spatial_dim or
  // query_position_dim) or self-attention's axis.
  std::optional<AttentionPositions> positions;
  // The seed of this call's dropout mask; unset: drawn from the run context
  // (run_context.h). The blocks of one sequence share one (context
  // parallelism), and a backward call given the forward call's seed draws
  // its mask again.
  std::optional<uint64_t> dropout_seed;
};

Tensor dot_attention(const Tensor& query, const Tensor& keys, const Tensor& values, const AttentionOptions& opts);

// Gradients of dot_attention with respect to query, keys and values for an
// upstream gradient `grad_output` (over the output's dims), computed by
// dimattn's CPU kernel (cpu_flash; forcing applies): for backends without
// autograd (Eigen); on the torch backend use Tensor::backward. Recomputes the
// forward pass. With dropout, give both calls one opts.dropout_seed, or reset
// the run context's seed (set_random_seed) to its value before the forward
// call, so that the same mask is drawn.
struct AttentionGrads {
  Tensor query, keys, values;  // dims as the inputs
  // The gradients of opts.variants' learnable tensors (sinks, bias, pos_emb,
  // pos_bias_u, pos_bias_v; AttentionVariants::learnable), each in the field
  // of its tensor, over its dims; the other fields unset.
  AttentionVariants variants;
};
AttentionGrads dot_attention_backward(const Tensor& query, const Tensor& keys, const Tensor& values,
                                      const AttentionOptions& opts, const Tensor& grad_output);

// Context parallelism's building blocks (dimattn/context_parallel.h,
// docs/distributed.md): a call as one
// block of a longer attention — its kv positions a part of the sequence, its
// place given by opts.positions — computed by dimattn's CPU kernel on the
// Eigen and torch backends, and by cuda_flash for CUDA tensors on the torch
// backend (unverified on a GPU so far), outside autograd.
// `output` is dot_attention's result for the block; `lse` the log-sum-exp of
// each query row's energies after every mask (natural log, float32, float64
// for float64 calls; -inf for a row the block leaves empty) over the output's
// dims without the value features. Blocks over disjoint kv positions merge
// exactly: lse = log(sum_b exp(lse_b)), output = sum_b exp(lse_b - lse) output_b.
// Not with sinks (the sink would join every block's denominator).
struct AttentionBlock {
  Tensor output, lse;
};
AttentionBlock dot_attention_block(const Tensor& query, const Tensor& keys, const Tensor& values,
                                   const AttentionOptions& opts);
// The gradients of one block: `merged` holds the merged output and lse for
// the block's query rows (dims as dot_attention_block's), grad_output the
// gradient of the merged output. Summed over the blocks (each kv block's own
// keys and values) they are the merged attention's gradients. With dropout,
// reset the seed as for dot_attention_backward.
AttentionGrads dot_attention_block_backward(const Tensor& query, const Tensor& keys, const Tensor& values,
                                            const AttentionOptions& opts, const AttentionBlock& merged,
                                            const Tensor& grad_output);

// The reference path materialises energies and weights ([batch..., query
// rows, kv] in float32 or wider). A call whose energy tensor would exceed this
// many bytes fails with a clear error instead of exhausting memory. Default
// 4 GiB; the environment variable DIMATTN_REFERENCE_MAX_BYTES sets it at start.
void set_reference_memory_limit(int64_t bytes);
int64_t reference_memory_limit();

// Which kernel dot_attention would run for these operands on their backend,
// and why each candidate before it was rejected. Runs nothing; throws like
// dot_attention for bad input or a forced kernel that cannot run.
Decision explain_attention(const Tensor& query, const Tensor& keys, const Tensor& values,
                           const AttentionOptions& opts);

}  // namespace dimattn
