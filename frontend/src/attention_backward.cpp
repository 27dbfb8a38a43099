// dot_attention_backward: gradients through the backend's fused backward
// (Backend::attention_backward) for backends without autograd (Eigen); and
// the blocks of a longer attention with their gradients (dot_attention_block).
#include "dimattn/attention.h"
#include "dimattn/ext/backend.h"
#include "dimattn/internal/check.h"
#include "attention_roles.h"
#include "op_util.h"

namespace dimattn {
using namespace detail;

namespace {

// g, a gradient over the kernel's dims, brought to the dims of `like`:
// summed over dims `like` was broadcast along, kv relabelled back to axis.
Tensor to_input_dims(const Tensor& g, const Tensor& like, const AttentionCall& c, const Dim& axis) {
  Tensor out = g;
  if (!like.has(c.kv_spatial) && out.has(c.kv_spatial)) out = replace_dim(out, c.kv_spatial, axis);
  Dims extra = without(out.dims(), like.dims());
  if (!extra.empty()) out = reduce_sum(out, extra);
  return copy_transpose(out, like.dims());
}

// The one backward of dot_attention_backward and dot_attention_block_backward.
AttentionGrads backward(const char* op, const Tensor& query, const Tensor& keys, const Tensor& values,
                        const AttentionOptions& opts, const AttentionBlock* merged, const Tensor& grad_output) {
  // Not a structured binding: clang 14 (the fuzz build) cannot capture one in a lambda.
  const Prepared prepared = prepare(query, keys, values, opts);
  const AttentionCall& c = prepared.call;
  const bool dummy = prepared.dummy;
  common_backend(op, {&query, &grad_output});
  // A dim whose lengths vary over the kv axis, kept in the result that sums
  // over the axis: which of its entries are padding depends on a position
  // the result no longer has, so its gradients are not defined.
  for (const Tensor* t : {&keys, &values})
    for (const Dim& d : t->dims())
      DIMATTN_CHECK(!d.is_dynamic() || d == opts.axis || !d.lengths().has(opts.axis), op, "dim ", d.repr(),
                    " is dynamic over the kv axis ", opts.axis.repr(),
                    ", which the result sums over: its padding in the result is not defined, nor are gradients "
                    "through it; make its lengths independent of the axis (or pad it to a static dim)");
  auto with_step = [&](const Tensor& t) { return dummy ? expand_dim(t, c.query_spatial) : t; };
  std::optional<AttentionBlockResult> m;
  if (merged) {
    DIMATTN_CHECK(!c.variants.sinks, op, "blocks of a longer attention cannot have sinks (each block's lse would count them)");
    common_backend(op, {&query, &merged->output, &merged->lse});
    m = AttentionBlockResult{with_step(merged->output), with_step(merged->lse)};
  }
  AttentionCallGrads g = query.backend().attention_backward(c, with_step(grad_output), m ? &*m : nullptr);
  if (dummy) g.query = squeeze(g.query, c.query_spatial);
  AttentionGrads out{to_input_dims(g.query, query, c, opts.axis), to_input_dims(g.keys, keys, c, opts.axis),
                     to_input_dims(g.values, values, c, opts.axis), {}};
  // The caller's learnable tensors (not the off-by-one sink, which the call made a tensor).
  AttentionVariants::for_each_learnable(g.variants, [&](const char* name, const std::optional<Tensor>& grad) {
    const std::optional<Tensor>& given = *opts.variants.tensor_field(name);
    if (grad && given) *out.variants.tensor_field(name) = to_input_dims(*grad, *given, c, opts.axis);
  });
  return out;
}

}  // namespace

AttentionGrads dot_attention_backward(const Tensor& query, const Tensor& keys, const Tensor& values,
                                      const AttentionOptions& opts, const Tensor& grad_output) {
  return backward("dot_attention_backward", query, keys, values, opts, nullptr, grad_output);
}

AttentionGrads dot_attention_block_backward(const Tensor& query, const Tensor& keys, const Tensor& values,
                                            const AttentionOptions& opts, const AttentionBlock& merged,
                                            const Tensor& grad_output) {
  return backward("dot_attention_block_backward", query, keys, values, opts, &merged, grad_output);
}

AttentionBlock dot_attention_block(const Tensor& query, const Tensor& keys, const Tensor& values,
                                   const AttentionOptions& opts) {
  const char* op = "dot_attention_block";
  const auto [c, dummy] = prepare(query, keys, values, opts);
  DIMATTN_CHECK(!c.variants.sinks, op, "blocks of a longer attention cannot have sinks (each block's lse would count them)");
  AttentionBlockResult r = query.backend().attention_block(c);
  if (dummy) return {squeeze(r.output, c.query_spatial), squeeze(r.lse, c.query_spatial)};
  return {r.output, r.lse};
}

}  // namespace dimattn
