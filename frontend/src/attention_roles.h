#pragma once
// Names -> roles for one dot_attention call (frontend/src/attention.cpp),
// shared by dot_attention, explain_attention and dot_attention_backward.
#include "dimattn/attention.h"
#include "dimattn/ext/attention_call.h"

namespace dimattn::detail {

// A call with names turned into roles; `dummy` when the query got a size-1
// spatial dim that the result must lose again. Validates like dot_attention
// and, when dropout is on, takes opts.dropout_seed or draws the seed from
// the run context.
struct Prepared {
  AttentionCall call;
  bool dummy;
};
Prepared prepare(const Tensor& query, const Tensor& keys, const Tensor& values, const AttentionOptions& opts);

}  // namespace dimattn::detail
