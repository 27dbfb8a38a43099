// dimattn's dot_attention as torch custom ops (TORCH_LIBRARY "dimattn"),
// loaded by the Python package with torch.ops.load_library; no Python C-API.
//
//   dimattn::dot_attention(query, keys, values, aux, spec) -> out
//   dimattn::dot_attention_backward(grad_out, query, keys, values, aux, spec) -> (gq, gk, gv, gsinks, gbias)
//   dimattn::dot_attention_trace(query, keys, values, aux, spec) -> (energy, att_weights)
//   dimattn::explain(query, keys, values, aux, spec) -> str
//   dimattn::kernel_names() -> str[]
// dot_attention with a "cp" entry runs a whole context-parallel call
// (context_parallel_attention, dimattn/context_parallel.h) over the c10d
// group of that name.
//
// Dims and options cross as the call spec (call_spec.h). Each op makes the
// call's Dims from it (names are unique per call, so one name is one Dim),
// once per spec and shapes on each thread (CallPlan; dynamic dims per call),
// and runs the frontend's dot_attention on the torch backend over the same
// memory (torch_interop.h), with dimattn's selection and kernels.
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
#include <initializer_list>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "call_spec.h"
#include "dimattn/attention.h"
#include "dimattn/context_parallel.h"
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

// What a call's Dims are, from its spec and its tensors' shapes alone: each
// dim's name, the static Dims, and how the dynamic ones are made. Checking
// the shapes against the spec and making the Dims is most of the op's own
// work on a small call, and a model makes the same few calls every step, so
// plans are kept per thread (plan_for) and a repeated call reuses its Dims.
// Only structure is kept: a dynamic dim's lengths are that call's aux tensor
// and change per step, so dynamic Dims (and the operands' Dims that hold
// one) are made per call (DimTable), never kept.
struct CallPlan {
  std::shared_ptr<const CallSpec> spec;
  std::vector<std::string> names;  // slot -> name
  Dims dims;                       // slot -> Dim; a placeholder in a dynamic dim's slot
  struct Dynamic {
    size_t slot;
    int lengths;               // index into aux
    std::vector<size_t> over;  // the lengths' dims
    std::optional<int64_t> extent;
  };
  std::vector<Dynamic> dynamic;  // in an order that makes the dims of a dim's lengths first
  Dims q, k, v;                  // the operands' Dims, for a call without dynamic dims

  CallPlan(std::shared_ptr<const CallSpec> s, const at::Tensor& qt, const at::Tensor& kt, const at::Tensor& vt,
           at::TensorList aux)
      : spec(std::move(s)) {
    const CallSpec& c = *spec;
    std::map<std::string, int64_t> sizes;
    take_sizes(sizes, "query", c.q, qt);
    take_sizes(sizes, "keys", c.k, kt);
    take_sizes(sizes, "values", c.v, vt);
    for (const DynamicDimSpec& d : c.dynamic)
      take_sizes(sizes, "lengths of " + d.name, d.over, aux_at(aux, d.lengths));
    if (c.causal_offset) take_sizes(sizes, "causal_offset", c.causal_offset_dims, aux_at(aux, *c.causal_offset));
    if (c.alibi) take_sizes(sizes, "alibi_slopes", c.alibi->over, aux_at(aux, c.alibi->index));
    if (c.sinks) take_sizes(sizes, "sinks", c.sinks->over, aux_at(aux, c.sinks->index));
    if (c.bias) take_sizes(sizes, "bias", c.bias->over, aux_at(aux, c.bias->index));
    if (c.mask) take_sizes(sizes, "mask", c.mask->over, aux_at(aux, c.mask->index));
    for (const auto& [name, size] : c.sizes) sizes.try_emplace(name, size);

    static const Dim placeholder("dynamic", 0);
    for (const auto& [name, size] : sizes) {
      names.push_back(name);
      dims.push_back(is_dynamic(c, name) ? placeholder : Dim(name, size));
    }
    // A dynamic dim in no tensor (an axis the keys lack): its extent comes
    // from its lengths, and dot_attention's checks name it.
    for (const DynamicDimSpec& d : c.dynamic)
      if (!sizes.count(d.name)) {
        names.push_back(d.name);
        dims.push_back(placeholder);
      }
    // Dynamic dims once the dims of their lengths exist (a history dim's
    // lengths may vary over another dynamic dim).
    std::vector<bool> ready(names.size(), true);
    for (const DynamicDimSpec& d : c.dynamic) ready[slot(d.name)] = false;
    std::vector<const DynamicDimSpec*> pending;
    for (const DynamicDimSpec& d : c.dynamic) pending.push_back(&d);
    while (!pending.empty()) {
      std::vector<const DynamicDimSpec*> later;
      for (const DynamicDimSpec* d : pending) {
        Dynamic dyn{slot(d->name), d->lengths, {}, std::nullopt};
        bool all = true;
        for (const std::string& n : d->over) {
          const size_t i = slot(n);
          all = all && ready[i];
          dyn.over.push_back(i);
        }
        if (!all) {
          later.push_back(d);
          continue;
        }
        if (const auto size = sizes.find(d->name); size != sizes.end()) dyn.extent = size->second;
        ready[dyn.slot] = true;
        dynamic.push_back(std::move(dyn));
      }
      if (later.size() == pending.size()) fail("the lengths of dynamic dim '" + later[0]->name + "' depend on each other");
      pending = std::move(later);
    }
    if (dynamic.empty()) {
      q = of(c.q);
      k = of(c.k);
      v = of(c.v);
    }
  }

  // The slot of a dim of the call; fails naming it otherwise.
  size_t slot(const std::string& name) const {
    for (size_t i = 0; i < names.size(); ++i)
      if (names[i] == name) return i;
    fail("dim '" + name + "' is in no operand and has no size");
  }

 private:
  Dims of(const std::vector<std::string>& ns) const {
    Dims out;
    for (const std::string& n : ns) out.push_back(dims[slot(n)]);
    return out;
  }
  static bool is_dynamic(const CallSpec& s, const std::string& name) {
    for (const DynamicDimSpec& d : s.dynamic)
      if (d.name == name) return true;
    return false;
  }
  static void take_sizes(std::map<std::string, int64_t>& sizes, const std::string& what,
                         const std::vector<std::string>& names, const at::Tensor& t) {
    if (t.dim() != static_cast<int64_t>(names.size()))
      fail(what + " has rank " + std::to_string(t.dim()) + " but " + std::to_string(names.size()) + " dims " +
           join(names));
    for (size_t i = 0; i < names.size(); ++i) {
      const int64_t size = t.size(static_cast<int64_t>(i));
      const auto [it, added] = sizes.try_emplace(names[i], size);
      if (!added && it->second != size)
        fail("dim '" + names[i] + "' has size " + std::to_string(size) + " in " + what + " but " +
             std::to_string(it->second) + " elsewhere in the call");
    }
  }
};

// Specs and the plans made from them, per thread: a spec is parsed once, and
// its plans are keyed by the shapes of the call's tensors (all a plan's
// checks and sizes depend on). Lookups copy nothing: the spec by its text,
// the shapes compared against a per-thread scratch key.
struct SpecEntry {
  std::shared_ptr<const CallSpec> spec;
  std::vector<std::pair<std::vector<int64_t>, std::shared_ptr<const CallPlan>>> plans;  // oldest first
};

SpecEntry& spec_entry(c10::string_view text) {
  thread_local std::map<std::string, SpecEntry, std::less<>> specs;
  const auto it = specs.find(std::string_view(text.data(), text.size()));
  if (it != specs.end()) return it->second;
  // Plans and Calls hold their spec, so dropping the table frees only what
  // no call uses.
  if (specs.size() >= 256) specs.clear();
  auto spec = std::make_shared<const CallSpec>(parse_call_spec(std::string_view(text.data(), text.size())));
  return specs.emplace(std::string(text), SpecEntry{std::move(spec), {}}).first->second;
}

// The parsed spec; valid until this thread's next spec lookup.
const CallSpec& parsed(c10::string_view text) { return *spec_entry(text).spec; }

std::shared_ptr<const CallPlan> plan_for(c10::string_view text, const at::Tensor& q, const at::Tensor& k,
                                         const at::Tensor& v, at::TensorList aux) {
  SpecEntry& entry = spec_entry(text);
  thread_local std::vector<int64_t> key;
  key.clear();
  auto add = [](const at::Tensor& t) {
    key.push_back(t.dim());
    for (const int64_t s : t.sizes()) key.push_back(s);
  };
  add(q);
  add(k);
  add(v);
  key.push_back(static_cast<int64_t>(aux.size()));
  for (const at::Tensor& t : aux) add(t);
  for (auto it = entry.plans.rbegin(); it != entry.plans.rend(); ++it)
    if (it->first == key) return it->second;
  auto plan = std::make_shared<const CallPlan>(entry.spec, q, k, v, aux);  // throws for a bad call: nothing kept
  if (entry.plans.size() >= 8) entry.plans.erase(entry.plans.begin());
  entry.plans.emplace_back(key, plan);
  return plan;
}

// One call's Dims by name: the plan's, with this call's dynamic dims.
class DimTable {
 public:
  DimTable(std::shared_ptr<const CallPlan> plan, at::TensorList aux) : plan_(std::move(plan)) {
    if (plan_->dynamic.empty()) return;
    bound_ = plan_->dims;
    Dims& dims = *bound_;
    for (const CallPlan::Dynamic& d : plan_->dynamic) {
      Dims over;
      for (const size_t i : d.over) over.push_back(dims[i]);
      dims[d.slot] = Dim::dynamic(plan_->names[d.slot], from_aten(aux_at(aux, d.lengths), over), d.extent);
    }
  }

  const Dim& operator[](const std::string& name) const { return all()[plan_->slot(name)]; }
  Dims dims(const std::vector<std::string>& names) const {
    Dims out;
    for (const std::string& n : names) out.push_back((*this)[n]);
    return out;
  }
  bool has(const Dim& d) const {
    for (const Dim& e : all())
      if (e == d) return true;
    return false;
  }
  // The operands' Dims: the plan's own when no dim is dynamic.
  Dims operand(const Dims& planned, const std::vector<std::string>& names) const {
    return bound_ ? dims(names) : planned;
  }

 private:
  const Dims& all() const { return bound_ ? *bound_ : plan_->dims; }

  std::shared_ptr<const CallPlan> plan_;
  std::optional<Dims> bound_;  // with this call's dynamic dims, for a call that has some
};

struct Call {
  Call(std::shared_ptr<const CallPlan> p, at::TensorList aux)
      : plan(std::move(p)), spec(*plan->spec), table(plan, aux), opts{table[spec.key_dim], table[spec.axis]} {}

  std::shared_ptr<const CallPlan> plan;  // holds the spec
  const CallSpec& spec;
  DimTable table;
  std::optional<Tensor> q, k, v;
  AttentionOptions opts;
  std::optional<ContextParallel> cp;  // the spec's "cp" entry

  // The call: dot_attention, or context_parallel_attention with a "cp" entry.
  Tensor attend() const {
    return cp ? context_parallel_attention(*q, *k, *v, opts, *cp) : dot_attention(*q, *k, *v, opts);
  }
};

Call make_call(c10::string_view spec_text, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
               at::TensorList aux) {
  Call c(plan_for(spec_text, q, k, v, aux), aux);
  const CallSpec& s = c.spec;
  const DimTable& t = c.table;
  c.q = from_aten(q, t.operand(c.plan->q, s.q));
  c.k = from_aten(k, t.operand(c.plan->k, s.k));
  c.v = from_aten(v, t.operand(c.plan->v, s.v));
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
  AttentionVariants& var = c.opts.variants;
  if (s.window) var.window = AttentionWindow{s.window->left, s.window->right};
  var.softcap = s.softcap;
  if (s.alibi) var.alibi_slopes = from_aten(aux[s.alibi->index], t.dims(s.alibi->over));
  if (s.sinks) var.sinks = from_aten(aux[s.sinks->index], t.dims(s.sinks->over));
  var.sink_off_by_one = s.sink_off_by_one;
  if (s.bias) var.bias = from_aten(aux[s.bias->index], t.dims(s.bias->over));
  if (s.mask) var.mask = from_aten(aux[s.mask->index], t.dims(s.mask->over));
  if (s.context_parallel) {
    const CallSpec::ContextParallelSpec& cp = *s.context_parallel;
    ContextParallel& o = c.cp.emplace();
    o.group = cp.group;
    if (cp.sharding == "load_balanced") o.sharding = ContextSharding::load_balanced;
    else if (cp.sharding != "contiguous") fail("context_parallel sharding '" + cp.sharding + "': contiguous or load_balanced");
    if (cp.strategy == "all_gather") o.strategy = ContextStrategy::all_gather;
    else if (cp.strategy != "ring") fail("context_parallel strategy '" + cp.strategy + "': ring or all_gather");
    o.timeout_seconds = cp.timeout;
    if (s.cp_lengths) o.lengths = from_aten(aux_at(aux, s.cp_lengths->index), t.dims(s.cp_lengths->over));
  }
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
                    std::initializer_list<const at::Tensor*> inputs) {
  std::vector<int64_t> perm;
  bool in_place = true;  // already in that order (usual: the kernel's output is laid out as asked)
  for (const std::string& n : names) {
    const int axis = x.axis_of(t[n]);
    if (axis < 0) fail(std::string(what) + " has dims " + repr(x.dims()) + ", not " + join(names));
    in_place = in_place && axis == static_cast<int>(perm.size());
    perm.push_back(axis);
  }
  if (static_cast<int>(perm.size()) != x.rank())
    fail(std::string(what) + " has dims " + repr(x.dims()) + ", not " + join(names));
  at::Tensor out = (in_place ? to_aten(x) : to_aten(x).permute(perm)).contiguous();
  for (const at::Tensor* in : inputs)
    if (out.is_alias_of(*in)) return out.clone();
  return out;
}

at::Tensor dot_attention_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            at::TensorList aux, c10::string_view spec) {
  const Call c = make_call(spec, q, k, v, aux);
  const RunScope scope(c.spec, aux);
  at::NoGradGuard no_grad;
  const Tensor out = c.attend();
  return in_order(out, c.spec.out, c.table, "the output", {&q, &k, &v});
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
  const Tensor out = c.attend();
  const at::Tensor o = to_aten(out).permute([&] {
    std::vector<int64_t> perm;
    for (const std::string& n : c.spec.out) perm.push_back(out.axis_of(c.table[n]));
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
  c.attend();
  const AttentionTrace& r = trace.records().at(0);
  // The energy's dims by the spec's names; "'" is the one dim the call made
  // itself (the kv side of self-attention).
  auto ordered = [&](const Tensor& x) {
    std::vector<int64_t> perm;
    for (const std::string& n : c.spec.energy) {
      int axis = -1;
      if (n == "'") {
        for (int i = 0; i < x.rank(); ++i)
          if (!c.table.has(x.dims()[i])) axis = i;
      } else {
        axis = x.axis_of(c.table[n]);
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
  if (c.cp) fail("explain takes no context_parallel: explain the call on one process");
  const Decision d = explain_attention(*c.q, *c.k, *c.v, c.opts);
  std::string s = d.kernel;
  for (const Rejection& r : d.rejected) s += "\x1e" + r.kernel + "\x1f" + r.reason;
  return s + "\x1d" + d.explain();
}

std::vector<std::string> kernel_names_op() { return all_kernel_names(); }

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
  // Nothing to record (inference): straight to the device kernel.
  auto device_kernel = [&] {
    const at::AutoDispatchBelowADInplaceOrView below;
    return dot_attention_op_handle().call(q, k, v, aux, spec);
  };
  if (!at::GradMode::is_enabled()) return device_kernel();
  const CallSpec& s = parsed(spec);
  if (s.context_parallel) {
    // The ring records its own autograd node (forward and backward over the
    // group, no recomputation); eager only.
    const Call c = make_call(spec, q, k, v, aux);
    const RunScope scope(c.spec, aux);
    const Tensor out = c.attend();
    return in_order(out, c.spec.out, c.table, "the output", {&q, &k, &v});
  }
  std::array<std::optional<at::Tensor>, 2> learned;  // sinks, bias
  bool any_grad = q.requires_grad() || k.requires_grad() || v.requires_grad();
  const std::optional<AuxTensorSpec>* learning[2] = {&s.sinks, &s.bias};  // as learnable() orders them
  for (size_t i = 0; i < learned.size(); ++i)
    if (*learning[i]) {
      learned[i] = aux_at(aux, (*learning[i])->index);
      any_grad = any_grad || learned[i]->requires_grad();
    }
  if (!any_grad) return device_kernel();
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
}

namespace {
void register_device_kernels(torch::Library& m) {
  using namespace dimattn::python;
  m.impl("dot_attention", &dot_attention_op);
  m.impl("dot_attention_backward", &dot_attention_backward_op);
  m.impl("dot_attention_trace", &dot_attention_trace_op);
  m.impl("explain", &explain_op);
}
}  // namespace

TORCH_LIBRARY_IMPL(dimattn, CPU, m) { register_device_kernels(m); }
TORCH_LIBRARY_IMPL(dimattn, CUDA, m) { register_device_kernels(m); }
TORCH_LIBRARY_IMPL(dimattn, Autograd, m) { m.impl("dot_attention", &dimattn::python::dot_attention_autograd); }
