// dot_attention_backward: gradients through dimattn's CPU kernel for
// backends without autograd (Eigen).
#include "backends/src/cpu_flash_path.h"
#include "dimattn/attention.h"
#include "dimattn/backend.h"
#include "frontend/src/attention_roles.h"
#include "frontend/src/op_util.h"

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
  Backend& be = query.backend();
  check(query.device().type == DeviceType::cpu && be.host_view(query.raw()).has_value(), op,
        "needs CPU tensors whose backend exposes host memory; got ", query.repr(),
        ". On the torch backend use Tensor::backward");
  const GateResult gate = cpu_flash_gate(attention_params(c, LayoutClass::separate, false));
  check(gate.ok, op, "cpu_flash cannot run this call: ", gate.reason);
  common_backend(op, {&query, &grad_output});
  check_same_dtype(op, {&query, &grad_output});

  const FlashLayout l = flash_layout(c);
  const FlashInputs in = flash_inputs(be, c, l);
  const kernels::ParallelFor pf = default_parallel_for();
  const FlashForward fwd = flash_forward(be, c, l, in, pf);
  // The upstream gradient in the kernel's output order.
  Dims out_order = l.outer;
  for (const Dims* ds : {&l.head, &c.query_groups}) out_order.insert(out_order.end(), ds->begin(), ds->end());
  out_order.push_back(c.query_spatial);
  out_order.insert(out_order.end(), c.value_feature.begin(), c.value_feature.end());
  Tensor dout = grad_output;
  if (dummy) dout = expand_dim(dout, c.query_spatial);
  check(without(dout.dims(), out_order).empty() && without(out_order, dout.dims()).empty(), op,
        "grad_output has dims ", repr(grad_output.dims()), "; the output of this call has ",
        repr(without(out_order, dummy ? Dims{c.query_spatial} : Dims{})));
  const RawPtr dout4 = be.reshape(align(dout, out_order).raw(), {l.B, l.Hkv * l.G, l.Tq, l.Dv});
  const FlashInputs g = flash_backward(be, c, l, in, fwd, dout4, pf);

  auto named = [&](const RawPtr& raw, Dims dims) {
    Shape shape;
    for (const Dim& d : dims) shape.push_back(d.extent());
    return Tensor(dims, query.dtype(), kCPU, be.reshape(raw, shape), &be);
  };
  Dims qd = l.outer, kd = l.outer;
  for (const Dims* ds : {&l.head, &c.query_groups}) qd.insert(qd.end(), ds->begin(), ds->end());
  qd.insert(qd.end(), {c.query_spatial, c.key_dim});
  kd.insert(kd.end(), l.head.begin(), l.head.end());
  Dims vd = kd;
  kd.insert(kd.end(), {c.kv_spatial, c.key_dim});
  vd.push_back(c.kv_spatial);
  vd.insert(vd.end(), c.value_feature.begin(), c.value_feature.end());
  Tensor dq = named(g.q, qd);
  if (dummy) dq = squeeze(dq, c.query_spatial);
  return {to_input_dims(dq, query, c, opts.axis), to_input_dims(named(g.k, kd), keys, c, opts.axis),
          to_input_dims(named(g.v, vd), values, c, opts.axis)};
}

}  // namespace dimattn
