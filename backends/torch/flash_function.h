#pragma once
// dimattn's fused kernels as one autograd function over the kernel form
// (adapters/kernel_form.h), for each kernel that has a forward and a backward
// pass: cpu_flash (torch_attention.cpp) and cuda_flash (cuda_flash_path.cpp).
// `Kernel` gives the two passes:
//   static FlashSaved forward(const FlashCall&, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v);
//   static detail::FlashGrads backward(const FlashCall&, const FlashSaved&, const at::Tensor& grad_out);
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/autograd/custom_function.h>

#include <utility>

#include "adapters/kernel_form.h"
#include "torch_backend.h"
#include "torch_raw.h"

namespace dimattn::torch_backend {

// What the backward pass needs besides tensors, kept in the autograd context.
struct FlashCall : torch::CustomClassHolder {
  FlashCall(TorchBackend* b, AttentionCall c, detail::FlashLayout l) : be(b), call(std::move(c)), layout(l) {}
  TorchBackend* be;
  AttentionCall call;
  detail::FlashLayout layout;
};

// What a forward pass leaves its backward: q, k, v as the kernel read them,
// out [B, H, Tq, Dv] and lse [B, H, Tq].
struct FlashSaved {
  at::Tensor q, k, v, out, lse;
};

template <class Kernel>
class FlashFunction : public torch::autograd::Function<FlashFunction<Kernel>> {
 public:
  // learnable: the call's learnable variant tensors present, in field order
  // (learnable_inputs), inputs so that autograd routes their gradients to
  // them; the kernels read their values through the call.
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v, at::TensorList /*learnable*/, c10::intrusive_ptr<FlashCall> info) {
    const FlashSaved s = Kernel::forward(*info, q, k, v);
    ctx->save_for_backward({s.q, s.k, s.v, s.out, s.lse});
    ctx->saved_data["info"] = at::IValue::make_capsule(std::move(info));
    return s.out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto info = c10::static_intrusive_pointer_cast<FlashCall>(ctx->saved_data["info"].toCapsule());
    const AttentionCall& call = info->call;
    const detail::FlashGrads g =
        Kernel::backward(*info, FlashSaved{saved[0], saved[1], saved[2], saved[3], saved[4]}, grads[0]);
    torch::autograd::variable_list out{as_aten(g.inputs.q), as_aten(g.inputs.k), as_aten(g.inputs.v)};
    const AttentionVariants dvar = detail::variant_grads(*info->be, call, g);
    AttentionVariants::for_each_learnable(call.variants, [&](const char* name, const std::optional<Tensor>& t) {
      if (!t) return;
      const std::optional<Tensor>& d = *dvar.tensor_field(name);
      // Over the tensor's dims in its own order (the table's gradient comes in the kernel's).
      out.push_back(d ? as_aten(raw_in_order("dot_attention", *d, t->dims(), false)) : at::Tensor());
    });
    out.push_back(at::Tensor());  // info
    return out;
  }
};

// The call's learnable variant tensors present, in field order: FlashFunction's inputs.
inline std::vector<at::Tensor> learnable_inputs(const AttentionCall& c) {
  std::vector<at::Tensor> out;
  AttentionVariants::for_each_learnable(c.variants, [&](const char*, const std::optional<Tensor>& t) {
    if (t) out.push_back(as_aten(t->raw()));
  });
  return out;
}

// The call's output through FlashFunction<Kernel> on `in`, q, k and v in the
// kernel's 4-d form.
template <class Kernel>
Tensor flash_function_output(TorchBackend& be, const AttentionCall& c, const detail::FlashLayout& l,
                             const detail::FlashInputs& in) {
  // A TensorList, not the vector: autograd counts each tensor of a list as an input.
  const std::vector<at::Tensor> learnable = learnable_inputs(c);
  const at::Tensor out = FlashFunction<Kernel>::apply(as_aten(in.q), as_aten(in.k), as_aten(in.v),
                                                      at::TensorList(learnable), c10::make_intrusive<FlashCall>(&be, c, l));
  return detail::flash_output(be, c, wrap(out));
}

}  // namespace dimattn::torch_backend
