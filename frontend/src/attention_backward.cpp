// dot_attention_backward: gradients through the backend's fused backward
// (Backend::attention_backward) for backends without autograd (Eigen).
#include "dimattn/attention.h"
#include "dimattn/ext/backend.h"
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

}  // namespace

AttentionGrads dot_attention_backward(const Tensor& query, const Tensor& keys, const Tensor& values,
                                      const AttentionOptions& opts, const Tensor& grad_output) {
  const char* op = "dot_attention_backward";
  const auto [c, dummy] = prepare(query, keys, values, opts);
  common_backend(op, {&query, &grad_output});
  const Tensor dout = dummy ? expand_dim(grad_output, c.query_spatial) : grad_output;
  AttentionCallGrads g = query.backend().attention_backward(c, dout);
  if (dummy) g.query = squeeze(g.query, c.query_spatial);
  AttentionGrads out{to_input_dims(g.query, query, c, opts.axis), to_input_dims(g.keys, keys, c, opts.axis),
                     to_input_dims(g.values, values, c, opts.axis), std::nullopt};
  if (opts.sinks && g.sinks) out.sinks = copy_transpose(*g.sinks, opts.sinks->dims());  // not for the off-by-one sink
  if (opts.bias && g.bias) out.bias = to_input_dims(*g.bias, *opts.bias, c, opts.axis);
  return out;
}

}  // namespace dimattn
