// dimattn's dot_attention as torch custom ops (TORCH_LIBRARY "dimattn"),
// loaded by the Python package with torch.ops.load_library; no Python C-API.
//
//   dimattn::dot_attention(query, keys, values, aux, spec) -> out
//   dimattn::dot_attention_backward(grad_out, query, keys, values, aux, spec) -> (gq, gk, gv, gsinks, gbias)
//   dimattn::dot_attention_trace(query, keys, values, aux, spec) -> (energy, att_weights)
//   dimattn::explain(query, keys, values, aux, spec) -> str
//   dimattn::kernel_names() -> str[]
//   dimattn::dot_attention_block(query, keys, values, aux, spec) -> (out, lse)
//   dimattn::dot_attention_block_backward(grad_out, query, keys, values, out, lse, aux, spec) -> (gq, gk, gv)
// The block ops compute one block of a longer attention (context
// parallelism, python/dimattn/_context_parallel.py) outside autograd.
//
// Dims and options cross as the call spec (call_spec.h). Each op rebuilds the
// call's Dims from it per call (cheap; names are unique per call, so one name
// is one Dim) and runs the frontend's dot_attention on the torch backend over
// the same memory (torch_interop.h), with dimattn's selection and kernels.
//
// Autograd is a C++ kernel on the Autograd key, so that eager calls pay no
// Python autograd wrapper. Backward is its own op (CPU and CUDA keys, and a
// fake kernel in Python), so that torch.compile's AOTAutograd traces both
// passes without a graph break. It recomputes the forward pass with autograd
// on, through the torch backend's own autograd (every kernel of its table
// has one), from the same dropout seed, so the same mask is drawn. Of the
// auxiliary tensors only the sinks (learnable logits) and the bias get a
// gradient: the backward op's fourth and fifth outputs (size 0 for a call
// without them), each of its aux tensor's shape (summed over the dims it was
// broadcast along).
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/scalar_tensor.h>
#include <ATen/ops/zeros_like.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "call_spec.h"
#include "dimattn/attention.h"
#include "dimattn/error.h"
#include "dimattn/forcing.h"
#include "dimattn/run_context.h"
#include "dimattn/torch_interop.h"
#include "dimattn/trace.h"

namespace dimattn::python {
namespace {

[[noreturn]] void fail(const std::string& msg) { throw Error("[dot_attention] " + msg); }

std::string join(const std::vector<std::string>& names) {
  std::string s;
  for (const std::string& n : names) s += (s.empty() ? "" : ", ") + n;
  return "(" + s + ")";
}

const at::Tensor& aux_at(at::TensorList aux, int i) {
  if (i < 0 || i >= static_cast<int>(aux.size()))
    fail("call spec refers to auxiliary tensor " + std::to_string(i) + " of " + std::to_string(aux.size()));
  return aux[i];
}

// One call's Dims by name, built from the spec and the operands' shapes.
class DimTable {
 public:
  DimTable(const CallSpec& s, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
           at::TensorList aux) {
    take_sizes("query", s.q, q);
    take_sizes("keys", s.k, k);
    take_sizes("values", s.v, v);
    for (const DynamicDimSpec& d : s.dynamic) take_sizes("lengths of " + d.name, d.over, aux_at(aux, d.lengths));
    if (s.causal_offset) take_sizes("causal_offset", s.causal_offset_dims, aux_at(aux, *s.causal_offset));
    if (s.alibi) take_sizes("alibi_slopes", s.alibi->over, aux_at(aux, s.alibi->index));
    if (s.sinks) take_sizes("sinks", s.sinks->over, aux_at(aux, s.sinks->index));
    if (s.bias) take_sizes("bias", s.bias->over, aux_at(aux, s.bias->index));
    if (s.mask) take_sizes("mask", s.mask->over, aux_at(aux, s.mask->index));
    for (const auto& [name, size] : s.sizes) sizes_.try_emplace(name, size);

    for (const auto& [name, size] : sizes_)
      if (!is_dynamic(s, name)) dims_.emplace(name, Dim(name, size));
    // Dynamic dims once the dims of their lengths exist (a history dim's
    // lengths may vary over another dynamic dim).
    std::vector<const DynamicDimSpec*> pending;
    for (const DynamicDimSpec& d : s.dynamic) pending.push_back(&d);
    while (!pending.empty()) {
      std::vector<const DynamicDimSpec*> later;
      for (const DynamicDimSpec* d : pending) {
        bool ready = true;
        for (const std::string& n : d->over) ready = ready && (dims_.count(n) || !is_dynamic(s, n));
        if (!ready) {
          later.push_back(d);
          continue;
        }
        const Tensor lengths = from_aten(aux_at(aux, d->lengths), dims(d->over));
        const auto size = sizes_.find(d->name);
        dims_.insert_or_assign(d->name, Dim::dynamic(d->name, lengths, size == sizes_.end()
                                                                          ? std::nullopt
                                                                          : std::optional<int64_t>(size->second)));
      }
      if (later.size() == pending.size()) fail("the lengths of dynamic dim '" + later[0]->name + "' depend on each other");
      pending = std::move(later);
    }
  }

  const Dim& operator[](const std::string& name) const {
    const auto it = dims_.find(name);
    if (it == dims_.end()) fail("dim '" + name + "' is in no operand and has no size");
    return it->second;
  }
  Dims dims(const std::vector<std::string>& names) const {
    Dims out;
    for (const std::string& n : names) out.push_back((*this)[n]);
    return out;
  }
  bool has(const Dim& d) const {
    const auto it = dims_.find(d.name());
    return it != dims_.end() && it->second == d;
  }

 private:
  static bool is_dynamic(const CallSpec& s, const std::string& name) {
    for (const DynamicDimSpec& d : s.dynamic)
      if (d.name == name) return true;
    return false;
  }
  void take_sizes(const std::string& what, const std::vector<std::string>& names, const at::Tensor& t) {
    if (t.dim() != static_cast<int64_t>(names.size()))
      fail(what + " has rank " + std::to_string(t.dim()) + " but " + std::to_string(names.size()) + " dims " +
           join(names));
    for (size_t i = 0; i < names.size(); ++i) {
      const int64_t size = t.size(static_cast<int64_t>(i));
      const auto [it, added] = sizes_.try_emplace(names[i], size);
      if (!added && it->second != size)
        fail("dim '" + names[i] + "' has size " + std::to_string(size) + " in " + what + " but " +
             std::to_string(it->second) + " elsewhere in the call");
    }
  }

  std::map<std::string, int64_t> sizes_;
  std::map<std::string, Dim> dims_;
};

struct Call {
  CallSpec spec;
  std::optional<DimTable> table;
  std::optional<Tensor> q, k, v;
  AttentionOptions opts{Dim("unset", 0), Dim("unset", 0)};
};

// A model makes the same few calls every step: their specs are parsed once
// per thread.
const CallSpec& parsed(c10::string_view text) {
  thread_local std::map<std::string, CallSpec, std::less<>> specs;
  const auto it = specs.find(text);
  if (it != specs.end()) return it->second;
  if (specs.size() >= 256) specs.clear();
  return specs.emplace(std::string(text), parse_call_spec(text)).first->second;
}

Call make_call(c10::string_view spec_text, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
               at::TensorList aux) {
  Call c;
  c.spec = parsed(spec_text);
  const CallSpec& s = c.spec;
  c.table.emplace(s, q, k, v, aux);
  const DimTable& t = *c.table;
  c.q = from_aten(q, t.dims(s.q));
  c.k = from_aten(k, t.dims(s.k));
  c.v = from_aten(v, t.dims(s.v));
  c.opts.key_dim = t[s.key_dim];
  c.opts.axis = t[s.axis];
  c.opts.att_dropout = s.dropout;
  c.opts.att_dropout_broadcast = s.broadcast;
  if (s.causal) c.opts.causal_query_spatial_dim = t[*s.causal];
  if (s.causal_offset) c.opts.causal_offset = from_aten(aux[*s.causal_offset], t.dims(s.causal_offset_dims));
  if (s.causal_offset_int) {
    const at::Tensor off = at::scalar_tensor(*s.causal_offset_int, at::TensorOptions().dtype(at::kLong));
    c.opts.causal_offset = from_aten(off, {});
  }
  c.opts.scale = s.scale;
  if (s.query_position) c.opts.query_position_dim = t[*s.query_position];
  if (s.window) c.opts.window = AttentionWindow{s.window->left, s.window->right};
  c.opts.softcap = s.softcap;
  if (s.alibi) c.opts.alibi_slopes = from_aten(aux[s.alibi->index], t.dims(s.alibi->over));
  if (s.sinks) c.opts.sinks = from_aten(aux[s.sinks->index], t.dims(s.sinks->over));
  c.opts.sink_off_by_one = s.sink_off_by_one;
  if (s.bias) c.opts.bias = from_aten(aux[s.bias->index], t.dims(s.bias->over));
  if (s.mask) c.opts.mask = from_aten(aux[s.mask->index], t.dims(s.mask->over));
  if (s.positions) c.opts.positions = AttentionPositions{s.positions->first, s.positions->second};
  return c;
}

// The run context a call asks for: forcing (else DIMATTN_SDPA), the train
// flag, and the seed its dropout draws from.
class RunScope {
 public:
  RunScope(const CallSpec& s, at::TensorList aux) : train_(s.train) {
    if (s.force) force_.emplace(*s.force);
    if (s.seed) set_random_seed(static_cast<uint64_t>(aux.at(*s.seed).item<int64_t>()));
  }

 private:
  std::optional<ForceKernels> force_;
  TrainFlagScope train_;
};

// x's data with its dims in the order `names` gives, as a new contiguous
// tensor that aliases no input (a custom op's output must not).
at::Tensor in_order(const Tensor& x, const std::vector<std::string>& names, const DimTable& t, const char* what,
                    const std::vector<const at::Tensor*>& inputs) {
  std::vector<int64_t> perm;
  for (const std::string& n : names) {
    const int axis = x.axis_of(t[n]);
    if (axis < 0) fail(std::string(what) + " has dims " + repr(x.dims()) + ", not " + join(names));
    perm.push_back(axis);
  }
  if (static_cast<int>(perm.size()) != x.rank())
    fail(std::string(what) + " has dims " + repr(x.dims()) + ", not " + join(names));
  at::Tensor out = to_aten(x).permute(perm).contiguous();
  for (const at::Tensor* in : inputs)
    if (out.is_alias_of(*in)) return out.clone();
  return out;
}

at::Tensor dot_attention_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            at::TensorList aux, c10::string_view spec) {
  const Call c = make_call(spec, q, k, v, aux);
  const RunScope scope(c.spec, aux);
  at::NoGradGuard no_grad;
  const Tensor out = dot_attention(*c.q, *c.k, *c.v, c.opts);
  return in_order(out, c.spec.out, *c.table, "the output", {&q, &k, &v});
}

// The aux tensors that learn, in the order of the backward op's outputs after
// gq, gk, gv: the sinks, then the bias.
std::array<std::optional<AuxTensorSpec>, 2> learnable(const CallSpec& s) { return {s.sinks, s.bias}; }

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> dot_attention_backward_op(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::TensorList aux,
    c10::string_view spec) {
  // Below the Autograd key the dispatcher excludes autograd; the recomputed
  // forward needs it back, with grad mode on.
  c10::impl::LocalDispatchKeySet keys = c10::impl::tls_local_dispatch_key_set();
  keys.excluded_ = keys.excluded_ - c10::autograd_dispatch_keyset_with_ADInplaceOrView;
  const c10::impl::ForceDispatchKeyGuard with_autograd(keys);
  const at::AutoGradMode grad_on(true);

  const at::Tensor qd = q.detach().requires_grad_(true), kd = k.detach().requires_grad_(true),
                   vd = v.detach().requires_grad_(true);
  std::vector<at::Tensor> inputs{qd, kd, vd}, aux_d(aux.begin(), aux.end());
  // Each learnable aux tensor as an input of its own (its position in
  // `inputs`, or none).
  const auto learning = learnable(parsed(spec));
  std::array<std::optional<size_t>, 2> at_input;
  for (size_t i = 0; i < learning.size(); ++i) {
    if (!learning[i]) continue;
    const at::Tensor d = aux_at(aux, learning[i]->index).detach().requires_grad_(true);
    aux_d[learning[i]->index] = d;
    at_input[i] = inputs.size();
    inputs.push_back(d);
  }
  const Call c = make_call(spec, qd, kd, vd, aux_d);
  const RunScope scope(c.spec, aux);
  const Tensor out = dot_attention(*c.q, *c.k, *c.v, c.opts);
  const at::Tensor o = to_aten(out).permute([&] {
    std::vector<int64_t> perm;
    for (const std::string& n : c.spec.out) perm.push_back(out.axis_of((*c.table)[n]));
    return perm;
  }());
  const torch::autograd::variable_list g = torch::autograd::grad(
      {o}, inputs, {grad_out}, /*retain_graph=*/false, /*create_graph=*/false, /*allow_unused=*/true);
  auto or_zeros = [](const at::Tensor& grad, const at::Tensor& like) {
    return grad.defined() ? grad.contiguous() : at::zeros_like(like, at::MemoryFormat::Contiguous);
  };
  auto learned = [&](size_t i) {
    return at_input[i] ? or_zeros(g[*at_input[i]], inputs[*at_input[i]]) : at::empty({0}, q.options());
  };
  return {or_zeros(g[0], q), or_zeros(g[1], k), or_zeros(g[2], v), learned(0), learned(1)};
}

std::tuple<at::Tensor, at::Tensor> dot_attention_trace_op(const at::Tensor& q, const at::Tensor& k,
                                                          const at::Tensor& v, at::TensorList aux,
                                                          c10::string_view spec) {
  const Call c = make_call(spec, q, k, v, aux);
  const RunScope scope(c.spec, aux);
  at::NoGradGuard no_grad;
  TraceScope trace(/*capture_tensors=*/true);
  dot_attention(*c.q, *c.k, *c.v, c.opts);
  const AttentionTrace& r = trace.records().at(0);
  // The energy's dims by the spec's names; "'" is the one dim the call made
  // itself (the kv side of self-attention).
  auto ordered = [&](const Tensor& x) {
    std::vector<int64_t> perm;
    for (const std::string& n : c.spec.energy) {
      int axis = -1;
      if (n == "'") {
        for (int i = 0; i < x.rank(); ++i)
          if (!c.table->has(x.dims()[i])) axis = i;
      } else {
        axis = x.axis_of((*c.table)[n]);
      }
      if (axis < 0) fail("the traced energy has dims " + repr(x.dims()) + ", not " + join(c.spec.energy));
      perm.push_back(axis);
    }
    if (static_cast<int>(perm.size()) != x.rank())
      fail("the traced energy has dims " + repr(x.dims()) + ", not " + join(c.spec.energy));
    return to_aten(x).permute(perm).contiguous().clone();
  };
  return {ordered(*r.energy), ordered(*r.att_weights)};
}

// "kernel" then, per rejected candidate, "\x1e" name "\x1f" reason; then
// "\x1d" and the C++ explain() text.
std::string explain_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::TensorList aux,
                       c10::string_view spec) {
  const Call c = make_call(spec, q, k, v, aux);
  const RunScope scope(c.spec, aux);
  const Decision d = explain_attention(*c.q, *c.k, *c.v, c.opts);
  std::string s = d.kernel;
  for (const Rejection& r : d.rejected) s += "\x1e" + r.kernel + "\x1f" + r.reason;
  return s + "\x1d" + d.explain();
}

std::vector<std::string> kernel_names_op() { return all_kernel_names(); }

// --- blocks of a longer attention (context parallelism) ---

// The lse's dims: the output's but the value features (dimattn's roles:
// values' dims that are key_dim or in neither query nor keys, but axis).
std::vector<std::string> lse_names(const CallSpec& s) {
  auto has = [](const std::vector<std::string>& names, const std::string& n) {
    return std::find(names.begin(), names.end(), n) != names.end();
  };
  std::vector<std::string> out;
  for (const std::string& n : s.out) {
    const bool feature = has(s.v, n) && (n == s.key_dim || (n != s.axis && !has(s.q, n) && !has(s.k, n)));
    if (!feature) out.push_back(n);
  }
  return out;
}

std::tuple<at::Tensor, at::Tensor> dot_attention_block_op(const at::Tensor& q, const at::Tensor& k,
                                                          const at::Tensor& v, at::TensorList aux,
                                                          c10::string_view spec) {
  const Call c = make_call(spec, q, k, v, aux);
  const RunScope scope(c.spec, aux);
  at::NoGradGuard no_grad;
  const AttentionBlock b = dot_attention_block(*c.q, *c.k, *c.v, c.opts);
  return {in_order(b.output, c.spec.out, *c.table, "the output", {&q, &k, &v}),
          in_order(b.lse, lse_names(c.spec), *c.table, "the lse", {&q, &k, &v})};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> dot_attention_block_backward_op(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, at::TensorList aux, c10::string_view spec) {
  const Call c = make_call(spec, q, k, v, aux);
  const RunScope scope(c.spec, aux);
  at::NoGradGuard no_grad;
  const DimTable& t = *c.table;
  const Dims out_dims = t.dims(c.spec.out);
  const AttentionBlock merged{from_aten(out, out_dims), from_aten(lse, t.dims(lse_names(c.spec)))};
  const AttentionGrads g =
      dot_attention_block_backward(*c.q, *c.k, *c.v, c.opts, merged, from_aten(grad_out, out_dims));
  const std::vector<const at::Tensor*> inputs{&grad_out, &q, &k, &v, &out, &lse};
  return {in_order(g.query, c.spec.q, t, "d(query)", inputs), in_order(g.keys, c.spec.k, t, "d(keys)", inputs),
          in_order(g.values, c.spec.v, t, "d(values)", inputs)};
}

// --- autograd ---

const auto& dot_attention_op_handle() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("dimattn::dot_attention", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                               at::TensorList, c10::string_view)>();
  return op;
}

// The sinks and the bias (aux tensors) are inputs of their own too, so that
// autograd gives them a gradient; the other aux tensors get none.
class DotAttentionFunction : public torch::autograd::Function<DotAttentionFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v, const std::optional<at::Tensor>& /*sinks: in aux*/,
                            const std::optional<at::Tensor>& /*bias: in aux*/, const std::vector<at::Tensor>& aux,
                            const std::string& spec) {
    const at::AutoDispatchBelowADInplaceOrView below;
    std::vector<at::Tensor> saved{q, k, v};
    saved.insert(saved.end(), aux.begin(), aux.end());
    ctx->save_for_backward(saved);
    ctx->saved_data["spec"] = spec;
    return dot_attention_op_handle().call(q, k, v, aux, spec);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    static const auto op =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("dimattn::dot_attention_backward", "")
            .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
                const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, at::TensorList,
                c10::string_view)>();
    const auto saved = ctx->get_saved_variables();
    const std::vector<at::Tensor> aux(saved.begin() + 3, saved.end());
    const std::string spec = ctx->saved_data["spec"].toStringRef();
    auto [gq, gk, gv, gsinks, gbias] = op.call(grads[0], saved[0], saved[1], saved[2], aux, spec);
    // No gradient for the sinks or bias input where the call has none (it
    // was no input then).
    const CallSpec& s = parsed(spec);
    return {gq, gk, gv, s.sinks ? gsinks : at::Tensor(), s.bias ? gbias : at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor dot_attention_autograd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  at::TensorList aux, c10::string_view spec) {
  const auto learning = learnable(parsed(spec));
  std::array<std::optional<at::Tensor>, 2> learned;  // sinks, bias
  bool any_grad = q.requires_grad() || k.requires_grad() || v.requires_grad();
  for (size_t i = 0; i < learning.size(); ++i)
    if (learning[i]) {
      learned[i] = aux_at(aux, learning[i]->index);
      any_grad = any_grad || learned[i]->requires_grad();
    }
  if (!at::GradMode::is_enabled() || !any_grad) {
    // Nothing to record (inference): straight to the device kernel.
    const at::AutoDispatchBelowADInplaceOrView below;
    return dot_attention_op_handle().call(q, k, v, aux, spec);
  }
  return DotAttentionFunction::apply(q, k, v, learned[0], learned[1], aux.vec(), std::string(spec));
}

}  // namespace
}  // namespace dimattn::python

TORCH_LIBRARY(dimattn, m) {
  m.def("dot_attention(Tensor query, Tensor keys, Tensor values, Tensor[] aux, str spec) -> Tensor");
  m.def(
      "dot_attention_backward(Tensor grad_output, Tensor query, Tensor keys, Tensor values, Tensor[] aux, str spec) "
      "-> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("dot_attention_trace(Tensor query, Tensor keys, Tensor values, Tensor[] aux, str spec) -> (Tensor, Tensor)");
  m.def("explain(Tensor query, Tensor keys, Tensor values, Tensor[] aux, str spec) -> str");
  m.def("kernel_names() -> str[]", &dimattn::python::kernel_names_op);
  m.def("dot_attention_block(Tensor query, Tensor keys, Tensor values, Tensor[] aux, str spec) -> (Tensor, Tensor)");
  m.def(
      "dot_attention_block_backward(Tensor grad_output, Tensor query, Tensor keys, Tensor values, Tensor output, "
      "Tensor lse, Tensor[] aux, str spec) -> (Tensor, Tensor, Tensor)");
}

namespace {
void register_device_kernels(torch::Library& m) {
  using namespace dimattn::python;
  m.impl("dot_attention", &dot_attention_op);
  m.impl("dot_attention_backward", &dot_attention_backward_op);
  m.impl("dot_attention_trace", &dot_attention_trace_op);
  m.impl("explain", &explain_op);
  m.impl("dot_attention_block", &dot_attention_block_op);
  m.impl("dot_attention_block_backward", &dot_attention_block_backward_op);
}
}  // namespace

TORCH_LIBRARY_IMPL(dimattn, CPU, m) { register_device_kernels(m); }
TORCH_LIBRARY_IMPL(dimattn, CUDA, m) { register_device_kernels(m); }
TORCH_LIBRARY_IMPL(dimattn, Autograd, m) { m.impl("dot_attention", &dimattn::python::dot_attention_autograd); }
