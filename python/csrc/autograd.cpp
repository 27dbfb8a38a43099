// The ops' autograd and autocast kernels (torch_ops.cpp says which ops and
// how a traced call records its backward pass): on the Autograd key, eager
// calls go through the torch backend's own autograd node, traced ones through
// DotAttentionFunction or DotAttentionLseFunction; on the Autocast keys the
// floating inputs are cast as torch's own SDPA casts them.
#include <ATen/autocast_mode.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "call.h"
#include "dimattn/forcing.h"
#include "dimattn/run_context.h"
#include "op_args.h"

namespace dimattn::python {
namespace {

// Calls dimattn::`name`.`overload` below autograd with these arguments;
// returns its outputs.
std::vector<c10::IValue> call_below_autograd(const char* name, const char* overload, std::vector<c10::IValue> args) {
  const at::AutoDispatchBelowADInplaceOrView below;
  c10::Dispatcher::singleton().findSchemaOrThrow(name, overload).callBoxed(args);
  return args;
}

// Query, keys, values and the call's learnable tensors are the autograd
// inputs; the call's arguments (with its variants) travel in saved_data.
class DotAttentionFunction : public torch::autograd::Function<DotAttentionFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, at::TensorList /*inputs: in args*/,
                            const c10::IValue& args) {
    ctx->saved_data["args"] = args;
    return call_below_autograd("dimattn::dot_attention", "full", args.toListRef().vec())[0].toTensor();
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    std::vector<c10::IValue> args = ctx->saved_data["args"].toListRef().vec();
    args.insert(args.begin(), grads[0]);
    const std::vector<c10::IValue> out = call_below_autograd("dimattn::dot_attention_backward", "", std::move(args));
    torch::autograd::variable_list g{out[0].toTensor(), out[1].toTensor(), out[2].toTensor()};
    for (const at::Tensor& t : out[3].toTensorList().vec()) g.push_back(t);
    g.emplace_back();  // args: no gradient
    return g;
  }
};

// The traced call's autograd when its kernel gives each row's lse: the
// forward op returns the output and the lse, the backward op takes them and
// runs the kernel's backward pass alone (as the eager path's node does).
class DotAttentionLseFunction : public torch::autograd::Function<DotAttentionLseFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, at::TensorList /*inputs: in args*/,
                            const c10::IValue& args) {
    const std::vector<c10::IValue> r = call_below_autograd("dimattn::dot_attention_lse", "", args.toListRef().vec());
    ctx->saved_data["args"] = args;
    ctx->save_for_backward({r[0].toTensor(), r[1].toTensor()});
    return r[0].toTensor();
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    std::vector<c10::IValue> args = ctx->saved_data["args"].toListRef().vec();
    args.insert(args.begin(), {grads[0], saved[0], saved[1]});
    const std::vector<c10::IValue> out = call_below_autograd("dimattn::dot_attention_backward", "lse", std::move(args));
    torch::autograd::variable_list g{out[0].toTensor(), out[1].toTensor(), out[2].toTensor()};
    for (const at::Tensor& t : out[3].toTensorList().vec()) g.push_back(t);
    g.emplace_back();  // args: no gradient
    return g;
  }
};

// Whether a traced call can take DotAttentionLseFunction: its kernel is
// cpu_flash (the CPU, cpu_flash not forced away, not a relative-position
// gradient in deterministic mode, which cpu_flash's gate refuses), the call
// has no sinks (a block's lse would count them) and no empty operand. Else the
// backward op computes the forward pass again. (cuda_flash gives the lse too,
// but has not run on a GPU: CUDA calls keep the recomputing path.)
bool lse_route(const OpArgs& a) {
  for (const Arg x : {Arg::query, Arg::keys, Arg::values}) {
    const at::Tensor& t = a[x].toTensor();
    // Symbolic sizes (dynamic shapes) are taken as not empty.
    const std::optional<int64_t> numel = t.sym_numel().maybe_as_int();
    if (t.device().type() != c10::DeviceType::CPU || numel == 0) return false;
  }
  const KernelForce env = current_kernel_force();
  const Names forced = names_of(a[Arg::force]);
  const bool allowed = forced.empty() ? env.allows("cpu_flash")
                                      : std::find(forced.begin(), forced.end(), "cpu_flash") != forced.end() ||
                                            std::find(forced.begin(), forced.end(), "auto") != forced.end();
  if (!allowed) return false;
  bool sinks = false, rel_pos = false;
  a.for_each_variant([&](const std::string& name, const c10::IValue& v) {
    if ((name == "sinks" || name == "sink_off_by_one") && !v.isNone() && !(v.isBool() && !v.toBool())) sinks = true;
    if (name == "pos_emb" && !v.isNone()) rel_pos = true;
  });
  return !sinks && !(rel_pos && deterministic_algorithms());
}

// Whether t is a tracing wrapper rather than data: torch.compile's fake and
// functional tensors, torch.func's transforms.
bool traced(const at::Tensor& t) {
  static const c10::DispatchKeySet wrappers({c10::DispatchKey::Python, c10::DispatchKey::Functionalize,
                                             c10::DispatchKey::FuncTorchGradWrapper, c10::DispatchKey::FuncTorchBatched});
  return t.key_set().has_any(wrappers);
}

// dot_attention and dot_attention.full on the Autograd key.
template <Parts parts>
void dot_attention_autograd(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  // Nothing to record (inference): straight to the device kernel.
  auto below = [&] { op.redispatchBoxed(keys & c10::after_autograd_keyset, stack); };
  if (!at::GradMode::is_enabled()) return below();
  const size_t n = OpArgs::count(parts);
  const OpArgs a = call_on(stack, parts);
  std::vector<at::Tensor> inputs;
  for (const Arg t : {Arg::query, Arg::keys, Arg::values}) inputs.push_back(a[t].toTensor());
  for (const size_t i : learnable_args(a)) inputs.push_back((&a[Arg::query])[i].toTensor());
  if (std::none_of(inputs.begin(), inputs.end(), [](const at::Tensor& t) { return t.requires_grad(); })) return below();
  if (std::none_of(inputs.begin(), inputs.end(), traced)) {
    // Eager: the torch backend's own autograd records the call (its kernel's
    // node saves the output and the lse), so backward runs the kernel's
    // backward pass alone, without computing the forward pass again.
    at::Tensor out = run(a);
    torch::jit::drop(*stack, n);
    stack->emplace_back(std::move(out));
    return;
  }
  // Traced (torch.compile's fake and functional tensors, torch.func's
  // wrappers): the graph holds the forward and backward passes as ops: the
  // forward op returning the output and each row's lse and the backward op
  // that takes them (DotAttentionLseFunction), or, for calls whose kernel
  // gives no lse, the op and the backward op that computes the forward pass
  // again. The saved call holds every variant argument (None where an op has
  // none), as the .full ops take them.
  c10::impl::GenericList args(c10::AnyType::get());
  for (size_t i = 0; i < n; ++i) args.push_back((&a[Arg::query])[i]);
  for (size_t i = n; i < OpArgs::count(Parts::full); ++i) args.push_back(c10::IValue());
  at::Tensor out = lse_route(a)
                       ? DotAttentionLseFunction::apply(at::TensorList(inputs), c10::IValue(args))
                       : DotAttentionFunction::apply(at::TensorList(inputs), c10::IValue(args));
  torch::jit::drop(*stack, n);
  stack->emplace_back(std::move(out));
}

// The ops on the Autocast keys: torch's rule for its own
// scaled_dot_product_attention (lower precision): every floating tensor
// argument on the autocast device but float64 ones is cast to the autocast
// dtype (differentiably), and the op runs below autocast. So a call inside
// torch.autocast runs dimattn's kernels in bfloat16 (CPU) or float16/bfloat16
// (CUDA), as torch's SDPA would.
template <c10::DeviceType kDevice>
void autocast_op(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const at::ScalarType to = at::autocast::get_autocast_dtype(kDevice);
  const size_t n = op.schema().arguments().size();
  for (auto it = stack->end() - static_cast<std::ptrdiff_t>(n); it != stack->end(); ++it) {
    if (!it->isTensor()) continue;
    const at::Tensor& t = it->toTensor();
    if (t.defined() && t.is_floating_point() && t.scalar_type() != at::kDouble && t.scalar_type() != to &&
        t.device().type() == kDevice)
      *it = t.to(to);
  }
  const c10::impl::ExcludeDispatchKeyGuard below(at::autocast::get_autocast_dispatch_key_from_device_type(kDevice));
  op.callBoxed(stack);
}

// context_parallel_attention on the Autograd key: the ring records its own
// autograd node (forward and backward over the group, no recomputation).
void context_parallel_autograd(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  const at::Tensor out = run(call_on(stack, Parts::context_parallel));
  torch::jit::drop(*stack, OpArgs::count(Parts::context_parallel));
  stack->emplace_back(out);
}

}  // namespace
}  // namespace dimattn::python

namespace {
template <c10::DeviceType kDevice>
void register_autocast_kernels(torch::Library& m) {
  for (const char* op : {"dot_attention", "dot_attention.full", "context_parallel_attention", "dot_attention_trace",
                         "explain"})
    m.impl(op, torch::CppFunction::makeFromBoxedFunction<&dimattn::python::autocast_op<kDevice>>());
}
}  // namespace

TORCH_LIBRARY_IMPL(dimattn, AutocastCPU, m) { register_autocast_kernels<c10::DeviceType::CPU>(m); }
TORCH_LIBRARY_IMPL(dimattn, AutocastCUDA, m) { register_autocast_kernels<c10::DeviceType::CUDA>(m); }
TORCH_LIBRARY_IMPL(dimattn, Autograd, m) {
  using namespace dimattn::python;
  m.impl("dot_attention", torch::CppFunction::makeFromBoxedFunction<&dot_attention_autograd<Parts::call>>());
  m.impl("dot_attention.full", torch::CppFunction::makeFromBoxedFunction<&dot_attention_autograd<Parts::full>>());
  m.impl("context_parallel_attention", torch::CppFunction::makeFromBoxedFunction<&context_parallel_autograd>());
}
