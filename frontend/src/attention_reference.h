#pragma once
// The reference path of dot_attention, written once on the named ops, run by
// every backend: scale query -> matmul -> masks -> softmax -> dropout -> matmul.
#include "dimattn/ext/attention_call.h"

namespace dimattn::detail {

struct ReferenceAttention {
  Tensor output;       // the call's output dims, in the query's dtype
  Tensor energy;       // q·k·scale before masking; float32 for 16-bit inputs
  Tensor att_weights;  // after masking, softmax and dropout
};

ReferenceAttention reference_attention(const AttentionCall& call);

}  // namespace dimattn::detail
