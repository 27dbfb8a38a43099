#pragma once
// Names -> roles for one dot_attention call (frontend/src/attention.cpp),
// shared by dot_attention, explain_attention and dot_attention_backward.
#include "dimattn/attention.h"
#include "dimattn/ext/attention_call.h"

namespace dimattn::detail {

// A call with names turned into roles; `dummy` when the query got a size-1
// spatial dim that the result must lose again. Validates like dot_attention
// and draws the dropout seed from the run context when dropout is on, unless
// `dropout_seed` gives it (the blocks of context parallelism share one).
struct Prepared {
  AttentionCall call;
  bool dummy;
};
Prepared prepare(const Tensor& query, const Tensor& keys, const Tensor& values, const AttentionOptions& opts,
                 std::optional<uint64_t> dropout_seed = std::nullopt);

// dot_attention_block and dot_attention_block_backward with the dropout seed
// given (frontend/src/attention_backward.cpp).
AttentionBlock attention_block(const Tensor& query, const Tensor& keys, const Tensor& values,
                               const AttentionOptions& opts, std::optional<uint64_t> dropout_seed);
AttentionGrads attention_block_backward(const Tensor& query, const Tensor& keys, const Tensor& values,
                                        const AttentionOptions& opts, const AttentionBlock& merged,
                                        const Tensor& grad_output, std::optional<uint64_t> dropout_seed);

// dot_attention(..., context_parallel) (frontend/src/context_parallel.cpp).
Tensor context_parallel_attention(const Tensor& query, const Tensor& keys, const Tensor& values,
                                  const AttentionOptions& opts);

}  // namespace dimattn::detail
