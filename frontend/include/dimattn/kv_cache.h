#pragma once
// Attention over a paged kv cache, the form of serving stacks (vLLM's
// block_table and seq_lens, FlashAttention's flash_attn_with_kvcache): keys
// and values live in pools of fixed-size blocks, and each sequence's kv
// positions are addressed through its row of a block table
// (docs/api.md, "KV caches").
//
//   query        {batch..., [query_spatial], kv heads..., groups..., key_dim}
//   keys pool    {block, slot, kv heads..., key_dim}           any order
//   values pool  {block, slot, kv heads..., value feature}     any order
//   block_table  {batch..., table}, integer
//   -> {batch..., [query_spatial], kv heads..., groups..., value feature}
//
// Sequence e's kv position j lies in block block_table[e, j / |slot|], at
// slot j % |slot|; it has lengths[e] positions. The query's new positions
// are the last of their sequence: causal row i attends j <= i + lengths[e] -
// (its query length), the query length being query_spatial's (per sequence
// where query_spatial is dynamic: continuous batching's ragged queries,
// whose padding rows give 0). Query dims besides the batch, kv-head and
// feature dims are groups (GQA heads, beams) sharing their kv head.
//
// On the CPU, dimattn's kernel reads the pools in place (cpu_flash's decode
// path: each kv tile once per kv head, long caches split over the threads);
// anywhere else, with a gradient asked, or with variants the kernel does not
// take here (bias, mask, segments, relative positions, ALiBi slopes or sinks
// with a gradient), the pages are gathered into keys and values
// (kv_cache_gather) and dot_attention runs on them: the same result, at the
// cost of the copy. ALiBi slopes and sinks vary over the batch, kv-head and
// group dims only.
#include <optional>
#include <utility>

#include "dimattn/dim.h"
#include "dimattn/tensor.h"
#include "dimattn/variants.h"

namespace dimattn {

struct PagedKvCache {
  Tensor keys, values;  // the pools
  Dim block, slot;      // the pools' block index and position in a block (the block size)
  Tensor block_table;   // integer over {batch..., table}; entries past a sequence's blocks are not read
  Dim table;
};

struct KvCacheAttentionOptions {
  Dim key_dim;
  // Each sequence's cached positions, the query's new ones included:
  // integer over (a subset of) the batch dims, at most |table| * |slot|.
  Tensor lengths;
  // The query's new positions per sequence (dynamic: a length per
  // sequence); absent: one step, the query has no such dim.
  std::optional<Dim> query_spatial;
  bool causal = true;
  std::optional<double> scale;  // default 1/sqrt(|key_dim|)
  // As dot_attention's (window and ALiBi measure from each row's diagonal
  // i + lengths[e] - query length).
  AttentionVariants variants;
};

Tensor kv_cache_attention(const Tensor& query, const PagedKvCache& cache, const KvCacheAttentionOptions& opts);

// The cache's positions as plain keys and values over {batch..., axis, kv
// heads..., features} (a copy), with `axis` the dynamic dim of `lengths`
// (extent |table| * |slot|): what the reference path attends over.
std::pair<Tensor, Tensor> kv_cache_gather(const PagedKvCache& cache, const Tensor& lengths, Dim* axis);

// Writes keys {tokens..., kv heads..., key_dim} and values {tokens..., kv
// heads..., value feature} into the pools in place, token t at slot
// slots[t] = block * |slot| + position in the block (vLLM's slot_mapping; a
// negative slot skips its token, as vLLM's padding). The pools must expose
// host memory (CPU tensors) and need no gradient.
void kv_cache_append(const PagedKvCache& cache, const Tensor& keys, const Tensor& values, const Tensor& slots);

}  // namespace dimattn
