// dimattn's dot_attention as torch custom ops (TORCH_LIBRARY "dimattn"),
// loaded by the Python package with torch.ops.load_library; no Python C-API.
// Their arguments are typed, in groups (op_args.h): <call>, <full> (the rarer
// options and the variants), <cp>.
//
//   dimattn::dot_attention(<call>) -> Tensor
//   dimattn::dot_attention.full(<call>, <full>) -> Tensor
//   dimattn::context_parallel_attention(<call>, <full>, <cp>) -> Tensor
//   dimattn::dot_attention_backward(Tensor grad_output, <call>, <full>) -> (Tensor, Tensor, Tensor, Tensor[])
//   dimattn::dot_attention_trace(<call>, <full>, str[] energy_dims) -> (Tensor energy, Tensor att_weights)
//   dimattn::explain(<call>, <full>) -> (str kernel, str[] rejected, str[] reasons, str text)
//   dimattn::kernel_names() -> str[]
//   dimattn::variant_fields() -> str[]        (name:kind of each variant field)
//   dimattn::argument_names() -> (str[], str[], str[])   (each group's names)
// context_parallel_attention runs a whole context-parallel call
// (docs/distributed.md) over the c10d group named cp_group.
//
// Each op makes the call's Dims from the names (unique per call, so one name
// is one Dim), once per structure and shapes on each thread (call.h's
// CallPlan; dynamic dims per call), and runs the frontend's dot_attention on
// the torch backend over the same memory (torch_interop.h), with dimattn's
// selection and kernels. This file: the schemas and the device kernels;
// autograd.cpp: the Autograd and Autocast kernels.
//
// Under torch.autocast the ops cast their inputs as torch's own SDPA does
// (autocast_op). Autograd is a C++ kernel on the Autograd key, so that
// eager calls pay no Python autograd wrapper (the torch backend's own node
// keeps the kernel's output and lse). Traced calls (torch.compile) record ops
// with fake kernels in Python, so that AOTAutograd traces both passes without
// a graph break: where the kernel gives each row's lse (cpu_flash, no sinks)
// the forward op dot_attention_lse returns the output and the lse and
// dot_attention_backward.lse takes them, so backward never computes the
// forward pass again; other calls record dot_attention.full and
// dot_attention_backward, which recomputes the forward pass with autograd on
// from the same dropout seed. The learnable variant tensors
// (AttentionVariants::learnable: the sinks, the bias, the relative positions'
// table and biases) get gradients: the backward ops' list output, one per
// such tensor the call has, in field order, each in its tensor's shape
// (summed over the dims it was broadcast along).
//
//   dimattn::dot_attention_lse(<call>, <full>) -> (Tensor output, Tensor lse)
//   dimattn::dot_attention_backward.lse(Tensor grad_output, Tensor output, Tensor lse, <call>, <full>)
//       -> (Tensor, Tensor, Tensor, Tensor[])
#include <ATen/autocast_mode.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/zeros_like.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/library.h>

#include <string>
#include <vector>

#include "call.h"
#include "dimattn/attention.h"
#include "dimattn/error.h"
#include "dimattn/forcing.h"
#include "dimattn/trace.h"
#include "op_args.h"

namespace dimattn::python {
namespace {

// --- the ops' kernels (boxed: the arguments are the call's typed list) ---

// dot_attention (Parts::call), dot_attention.full (Parts::full) and
// context_parallel_attention (Parts::context_parallel).
template <Parts parts>
void dot_attention_op(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  at::Tensor out;
  {
    const at::NoGradGuard no_grad;
    out = run(call_on(stack, parts));
  }
  torch::jit::drop(*stack, OpArgs::count(parts));
  stack->emplace_back(std::move(out));
}

void dot_attention_backward_op(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  const size_t n = OpArgs::count(Parts::full);
  const at::Tensor grad_out = (stack->end() - static_cast<std::ptrdiff_t>(n) - 1)->toTensor();
  // The call's arguments with autograd leaves for query, keys, values and the
  // learnable tensors, the inputs of the gradient.
  std::vector<c10::IValue> args(stack->end() - static_cast<std::ptrdiff_t>(n), stack->end());
  std::vector<at::Tensor> inputs;
  const std::vector<size_t> learning = learnable_args(OpArgs(args.data(), Parts::full));
  for (size_t i : {static_cast<size_t>(Arg::query), static_cast<size_t>(Arg::keys), static_cast<size_t>(Arg::values)}) {
    args[i] = args[i].toTensor().detach().requires_grad_(true);
    inputs.push_back(args[i].toTensor());
  }
  for (const size_t i : learning) {
    args[i] = args[i].toTensor().detach().requires_grad_(true);
    inputs.push_back(args[i].toTensor());
  }
  torch::autograd::variable_list g;
  {
    // Below the Autograd key the dispatcher excludes autograd; the recomputed
    // forward needs it back, with grad mode on.
    c10::impl::LocalDispatchKeySet keys = c10::impl::tls_local_dispatch_key_set();
    keys.excluded_ = keys.excluded_ - c10::autograd_dispatch_keyset_with_ADInplaceOrView;
    const c10::impl::ForceDispatchKeyGuard with_autograd(keys);
    const at::AutoGradMode grad_on(true);
    const OpArgs a(args.data(), Parts::full);
    const Call c = make_call(a);
    const RunScope scope(a);
    const Tensor out = dot_attention(*c.q, *c.k, *c.v, c.opts);
    std::vector<int64_t> perm;
    for (const std::string& name : c.plan->out_names) perm.push_back(out.axis_of(c.table[name]));
    g = torch::autograd::grad({to_aten(out).permute(perm)}, inputs, {grad_out}, /*retain_graph=*/false,
                              /*create_graph=*/false, /*allow_unused=*/true);
  }
  auto or_zeros = [&](size_t i) {
    return g[i].defined() ? g[i].contiguous() : at::zeros_like(inputs[i], at::MemoryFormat::Contiguous);
  };
  std::vector<at::Tensor> learned;
  for (size_t i = 3; i < inputs.size(); ++i) learned.push_back(or_zeros(i));
  torch::jit::drop(*stack, n + 1);
  stack->emplace_back(or_zeros(0));
  stack->emplace_back(or_zeros(1));
  stack->emplace_back(or_zeros(2));
  stack->emplace_back(c10::List<at::Tensor>(learned));
}

// dot_attention_lse: the call as one block (dot_attention_block): its output
// and each row's lse, what dot_attention_backward.lse needs.
void dot_attention_lse_op(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  const OpArgs a = call_on(stack, Parts::full);
  at::Tensor out, lse;
  {
    const at::NoGradGuard no_grad;
    const Call c = make_call(a);
    const RunScope scope(a);
    const AttentionBlock r = dot_attention_block(*c.q, *c.k, *c.v, c.opts);
    out = in_order(r.output, c.plan->out_names, c.table, "the output", a);
    lse = in_order(r.lse, c.plan->lse_names, c.table, "the lse", a);
  }
  torch::jit::drop(*stack, OpArgs::count(Parts::full));
  stack->emplace_back(std::move(out));
  stack->emplace_back(std::move(lse));
}

// dot_attention_backward.lse: the gradients from the forward's output and lse
// (dot_attention_block_backward of the call as its own one block), without
// computing the forward pass again.
void dot_attention_backward_lse_op(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  const size_t n = OpArgs::count(Parts::full);
  const at::Tensor grad_out = (stack->end() - static_cast<std::ptrdiff_t>(n) - 3)->toTensor();
  const at::Tensor out = (stack->end() - static_cast<std::ptrdiff_t>(n) - 2)->toTensor();
  const at::Tensor lse = (stack->end() - static_cast<std::ptrdiff_t>(n) - 1)->toTensor();
  // The learnable tensors as leaves that require grad: the kernels' adapters
  // write a gradient only for those (on a backend with autograd).
  std::vector<c10::IValue> args(stack->end() - static_cast<std::ptrdiff_t>(n), stack->end());
  const OpArgs a(args.data(), Parts::full);
  const std::vector<size_t> learning = learnable_args(a);
  for (const size_t i : learning) args[i] = args[i].toTensor().detach().requires_grad_(true);
  std::vector<at::Tensor> grads;
  {
    const at::NoGradGuard no_grad;
    const Call c = make_call(a);
    const RunScope scope(a);
    const DimTable& t = c.table;
    const CallPlan& p = *c.plan;
    const AttentionBlock merged{from_aten(out, t.dims(p.out_names)), from_aten(lse, t.dims(p.lse_names))};
    const AttentionGrads g =
        dot_attention_block_backward(*c.q, *c.k, *c.v, c.opts, merged, from_aten(grad_out, t.dims(p.out_names)));
    grads = {in_order(g.query, p.q_names, t, "d(query)", a), in_order(g.keys, p.k_names, t, "d(keys)", a),
             in_order(g.values, p.v_names, t, "d(values)", a)};
    // The learnable tensors' in field order, each over its argument's names.
    for (const size_t i : learning) {
      const std::string name = a.argument_name(i);
      const std::optional<Tensor>& d = *g.variants.tensor_field(name);
      const at::Tensor& like = (&a[Arg::query])[i].toTensor();
      grads.push_back(d ? in_order(*d, names_of((&a[Arg::query])[i + 1]), t, name.c_str(), a)
                        : at::zeros_like(like, at::MemoryFormat::Contiguous));
    }
  }
  torch::jit::drop(*stack, n + 3);
  for (size_t i = 0; i < 3; ++i) stack->emplace_back(grads[i]);
  stack->emplace_back(c10::List<at::Tensor>(std::vector<at::Tensor>(grads.begin() + 3, grads.end())));
}

void dot_attention_trace_op(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  const OpArgs a = call_on(stack, Parts::full, 1);  // and energy_dims
  const Names energy_names = names_of(a.after());
  const Call c = make_call(a);
  const RunScope scope(a);
  const at::NoGradGuard no_grad;
  TraceScope trace(/*capture_tensors=*/true);
  dot_attention(*c.q, *c.k, *c.v, c.opts);
  const AttentionTrace& r = trace.records().at(0);
  // The energy's dims by name; "'" is the one dim the call made itself (the
  // kv side of self-attention).
  auto ordered = [&](const Tensor& x) {
    std::vector<int64_t> perm;
    for (const std::string& name : energy_names) {
      int axis = -1;
      if (name == "'") {
        for (int i = 0; i < x.rank(); ++i)
          if (!c.table.has(x.dims()[i])) axis = i;
      } else {
        axis = x.axis_of(c.table[name]);
      }
      if (axis < 0) fail("the traced energy has dims " + repr(x.dims()) + ", not " + join(energy_names));
      perm.push_back(axis);
    }
    if (static_cast<int>(perm.size()) != x.rank())
      fail("the traced energy has dims " + repr(x.dims()) + ", not " + join(energy_names));
    return to_aten(x).permute(perm).contiguous().clone();
  };
  at::Tensor energy = ordered(*r.energy), weights = ordered(*r.att_weights);
  torch::jit::drop(*stack, OpArgs::count(Parts::full) + 1);
  stack->emplace_back(std::move(energy));
  stack->emplace_back(std::move(weights));
}

void explain_op(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  const OpArgs a = call_on(stack, Parts::full);
  const Call c = make_call(a);
  const RunScope scope(a);
  const Decision d = explain_attention(*c.q, *c.k, *c.v, c.opts);
  c10::List<std::string> kernels, reasons;
  for (const Rejection& r : d.rejected) {
    kernels.push_back(r.kernel);
    reasons.push_back(r.reason);
  }
  std::string text = d.explain();
  torch::jit::drop(*stack, OpArgs::count(Parts::full));
  stack->emplace_back(d.kernel);
  stack->emplace_back(std::move(kernels));
  stack->emplace_back(std::move(reasons));
  stack->emplace_back(std::move(text));
}

std::vector<std::string> kernel_names_op() { return all_kernel_names(); }
std::vector<std::string> variant_fields_op() { return variant_fields(); }
std::tuple<std::vector<std::string>, std::vector<std::string>, std::vector<std::string>> argument_names_op() {
  ArgumentNames n = argument_names();
  return {std::move(n.call), std::move(n.full), std::move(n.context_parallel)};
}

}  // namespace
}  // namespace dimattn::python

TORCH_LIBRARY(dimattn, m) {
  using dimattn::python::call_schema_arguments;
  using dimattn::python::Parts;
  for (const std::string& schema :
       {"dot_attention(" + call_schema_arguments(Parts::call) + ") -> Tensor",
        "dot_attention.full(" + call_schema_arguments(Parts::full) + ") -> Tensor",
        "context_parallel_attention(" + call_schema_arguments(Parts::context_parallel) + ") -> Tensor",
        "dot_attention_backward(" + call_schema_arguments(Parts::full, "Tensor grad_output, ") +
            ") -> (Tensor, Tensor, Tensor, Tensor[])",
        "dot_attention_lse(" + call_schema_arguments(Parts::full) + ") -> (Tensor, Tensor)",
        "dot_attention_backward.lse(" +
            call_schema_arguments(Parts::full, "Tensor grad_output, Tensor output, Tensor lse, ") +
            ") -> (Tensor, Tensor, Tensor, Tensor[])",
        "dot_attention_trace(" + call_schema_arguments(Parts::full, "", ", str[] energy_dims") + ") -> (Tensor, Tensor)",
        "explain(" + call_schema_arguments(Parts::full) + ") -> (str, str[], str[], str)"})
    m.def(schema.c_str());
  m.def("kernel_names() -> str[]", &dimattn::python::kernel_names_op);
  m.def("variant_fields() -> str[]", &dimattn::python::variant_fields_op);
  m.def("argument_names() -> (str[], str[], str[])", &dimattn::python::argument_names_op);
}

namespace {
void register_device_kernels(torch::Library& m) {
  using namespace dimattn::python;
  m.impl("dot_attention", torch::CppFunction::makeFromBoxedFunction<&dot_attention_op<Parts::call>>());
  m.impl("dot_attention.full", torch::CppFunction::makeFromBoxedFunction<&dot_attention_op<Parts::full>>());
  m.impl("context_parallel_attention",
         torch::CppFunction::makeFromBoxedFunction<&dot_attention_op<Parts::context_parallel>>());
  m.impl("dot_attention_backward", torch::CppFunction::makeFromBoxedFunction<&dot_attention_backward_op>());
  m.impl("dot_attention_lse", torch::CppFunction::makeFromBoxedFunction<&dot_attention_lse_op>());
  m.impl("dot_attention_backward.lse", torch::CppFunction::makeFromBoxedFunction<&dot_attention_backward_lse_op>());
  m.impl("dot_attention_trace", torch::CppFunction::makeFromBoxedFunction<&dot_attention_trace_op>());
  m.impl("explain", torch::CppFunction::makeFromBoxedFunction<&explain_op>());
}
}  // namespace

TORCH_LIBRARY_IMPL(dimattn, CPU, m) { register_device_kernels(m); }
TORCH_LIBRARY_IMPL(dimattn, CUDA, m) { register_device_kernels(m); }
