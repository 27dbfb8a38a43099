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
// is one Dim), once per structure and shapes on each thread (CallPlan;
// dynamic dims per call), and runs the frontend's dot_attention on the torch
// backend over the same memory (torch_interop.h), with dimattn's selection
// and kernels.
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
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/zeros_like.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <algorithm>
#include <initializer_list>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dimattn/attention.h"
#include "dimattn/context_parallel.h"
#include "dimattn/error.h"
#include "dimattn/forcing.h"
#include "dimattn/run_context.h"
#include "dimattn/torch_interop.h"
#include "dimattn/trace.h"
#include "op_args.h"

namespace dimattn::python {
namespace {

using Names = std::vector<std::string>;

[[noreturn]] void fail(const std::string& msg) { throw Error("[dot_attention] " + msg); }

std::string join(const Names& names) {
  std::string s;
  for (const std::string& n : names) s += (s.empty() ? "" : ", ") + n;
  return "(" + s + ")";
}

// A tensor argument of a call besides query, keys and values, with the names
// of its dims: lengths, the causal offset, the variants' tensors, context
// parallelism's lengths.
struct NamedArg {
  std::string what;
  at::Tensor tensor;
  Names dims;
};

std::vector<at::Tensor> lengths_of(const OpArgs& a) {
  return a[Arg::lengths].isNone() ? std::vector<at::Tensor>{} : a[Arg::lengths].toTensorVector();
}

std::optional<std::string> opt_string(const c10::IValue& v) {
  if (v.isNone()) return std::nullopt;
  return v.toStringRef();
}

std::optional<int64_t> side(const c10::IValue& v) {
  if (v.isNone()) return std::nullopt;
  return v.toInt();
}

// One variant field from its arguments (at `v`, advanced past them; the
// layout of op_args.h), `named` making a Tensor of an argument and its names.
template <class Named>
void read_field(const c10::IValue*& v, const char*, std::optional<double>& out, Named&) {
  if (!v->isNone()) out = v->toDouble();
  ++v;
}
template <class Named>
void read_field(const c10::IValue*& v, const char*, bool& out, Named&) {
  out = flag_of(*v);
  ++v;
}
template <class Named>
void read_field(const c10::IValue*& v, const char* name, std::optional<AttentionWindow>& out, Named&) {
  if (!v->isNone()) {
    const auto sides = v->toListRef();
    if (sides.size() != 2) fail(std::string(name) + " needs [left, right], got " + std::to_string(sides.size()) + " values");
    out = AttentionWindow{side(sides[0]), side(sides[1])};
  }
  ++v;
}
template <class Named>
void read_field(const c10::IValue*& v, const char* name, std::optional<Tensor>& out, Named& named) {
  if (!v[0].isNone()) out = named(name, v[0].toTensor(), names_of(v[1]));
  v += 2;
}

// Every NamedArg of a call.
std::vector<NamedArg> named_args(const OpArgs& a) {
  std::vector<NamedArg> out;
  const Names of = names_of(a[Arg::lengths_of]), dims = names_of(a[Arg::lengths_dims]);
  const std::vector<at::Tensor> lengths = lengths_of(a);
  if (lengths.size() != of.size())
    fail(std::to_string(lengths.size()) + " lengths tensors for " + std::to_string(of.size()) + " dynamic dims " +
         join(of));
  size_t next = 0;  // into dims
  for (size_t i = 0; i < of.size(); ++i) {
    const at::Tensor t = lengths[i];
    const size_t rank = static_cast<size_t>(t.dim());
    if (next + rank > dims.size()) fail("lengths_dims has " + std::to_string(dims.size()) + " names, too few for the lengths");
    out.push_back({"lengths of " + of[i], t, Names(dims.begin() + next, dims.begin() + next + rank)});
    next += rank;
  }
  if (next != dims.size()) fail("lengths_dims has " + std::to_string(dims.size() - next) + " names more than the lengths' dims");
  if (!a[Arg::causal_offset].isNone())
    out.push_back({"causal_offset", a[Arg::causal_offset].toTensor(), names_of(a[Arg::causal_offset_dims])});
  if (const c10::IValue* v = a.variants()) {
    AttentionVariants none;
    auto collect = [&](const char* name, const at::Tensor& t, Names names) {
      out.push_back({name, t, std::move(names)});
      return std::optional<Tensor>();
    };
    AttentionVariants::for_each_field(none, [&](const char* name, auto& field) { read_field(v, name, field, collect); });
  }
  if (!a[CpArg::lengths].isNone())
    out.push_back({"cp_lengths", a[CpArg::lengths].toTensor(), names_of(a[CpArg::lengths_dims])});
  return out;
}

// What a call's Dims are, from its names and its tensors' shapes alone: each
// dim's name, the static Dims, and how the dynamic ones are made. Checking
// the shapes against the names and making the Dims is most of the op's own
// work on a small call, and a model makes the same few calls every step, so
// plans are kept per thread (plan_for) and a repeated call reuses its Dims.
// Only structure is kept: a dynamic dim's lengths are that call's tensor and
// change per step, so dynamic Dims (and the operands' Dims that hold one) are
// made per call (DimTable), never kept.
struct CallPlan {
  Names names;  // slot -> name
  Dims dims;    // slot -> Dim; a placeholder in a dynamic dim's slot
  struct Dynamic {
    size_t slot;
    size_t lengths;            // index into the lengths argument
    std::vector<size_t> over;  // the lengths' dims
    std::optional<int64_t> extent;
  };
  std::vector<Dynamic> dynamic;  // in an order that makes the dims of a dim's lengths first
  Names q_names, k_names, v_names, out_names;
  Names lse_names;  // out_names without the value features: each row's lse (dot_attention_lse)
  Dims q, k, v;  // the operands' Dims, for a call without dynamic dims

  explicit CallPlan(const OpArgs& a) : CallPlan(a, a.operand_names()) {}
  CallPlan(const OpArgs& a, OpArgs::OperandNames n)
      : q_names(std::move(n.query)), k_names(std::move(n.keys)), v_names(std::move(n.values)), out_names(std::move(n.out)) {
    std::map<std::string, int64_t> sizes;
    take_sizes(sizes, "query", q_names, a[Arg::query].toTensor());
    take_sizes(sizes, "keys", k_names, a[Arg::keys].toTensor());
    take_sizes(sizes, "values", v_names, a[Arg::values].toTensor());
    for (const NamedArg& n : named_args(a)) take_sizes(sizes, n.what, n.dims, n.tensor);
    const Names size_names = names_of(a[MoreArg::size_names]);
    const std::vector<int64_t> given = a[MoreArg::sizes].isNone() ? std::vector<int64_t>{} : a[MoreArg::sizes].toIntVector();
    if (given.size() != size_names.size())
      fail(std::to_string(given.size()) + " sizes for " + std::to_string(size_names.size()) + " size_names");
    for (size_t i = 0; i < given.size(); ++i) sizes.try_emplace(size_names[i], given[i]);

    const Names lengths_of = names_of(a[Arg::lengths_of]);
    static const Dim placeholder("dynamic", 0);
    for (const auto& [name, size] : sizes) {
      names.push_back(name);
      dims.push_back(std::count(lengths_of.begin(), lengths_of.end(), name) ? placeholder : Dim(name, size));
    }
    // A dynamic dim in no tensor (an axis the keys lack): its extent comes
    // from its lengths, and dot_attention's checks name it.
    for (const std::string& d : lengths_of)
      if (!sizes.count(d)) {
        names.push_back(d);
        dims.push_back(placeholder);
      }
    // Dynamic dims once the dims of their lengths exist (a history dim's
    // lengths may vary over another dynamic dim).
    const std::vector<NamedArg> named = named_args(a);
    std::vector<bool> ready(names.size(), true);
    for (const std::string& d : lengths_of) ready[slot(d)] = false;
    std::vector<size_t> pending(lengths_of.size());
    for (size_t i = 0; i < pending.size(); ++i) pending[i] = i;
    while (!pending.empty()) {
      std::vector<size_t> later;
      for (const size_t i : pending) {
        Dynamic dyn{slot(lengths_of[i]), i, {}, std::nullopt};
        bool all = true;
        for (const std::string& n : named[i].dims) {
          const size_t s = slot(n);
          all = all && ready[s];
          dyn.over.push_back(s);
        }
        if (!all) {
          later.push_back(i);
          continue;
        }
        if (const auto size = sizes.find(lengths_of[i]); size != sizes.end()) dyn.extent = size->second;
        ready[dyn.slot] = true;
        dynamic.push_back(std::move(dyn));
      }
      if (later.size() == pending.size())
        fail("the lengths of dynamic dim '" + lengths_of[later[0]] + "' depend on each other");
      pending = std::move(later);
    }
    if (dynamic.empty()) {
      q = of(q_names);
      k = of(k_names);
      v = of(v_names);
    }
    // The value features as dot_attention's roles make them: key_dim, or dims
    // neither the query nor the keys have.
    const std::string key_dim = a[Arg::key_dim].toStringRef();
    auto has = [](const Names& ns, const std::string& n) { return std::find(ns.begin(), ns.end(), n) != ns.end(); };
    for (const std::string& n : out_names)
      if (!(has(v_names, n) && (n == key_dim || (!has(k_names, n) && !has(q_names, n))))) lse_names.push_back(n);
  }

  // The slot of a dim of the call; fails naming it otherwise.
  size_t slot(const std::string& name) const {
    for (size_t i = 0; i < names.size(); ++i)
      if (names[i] == name) return i;
    fail("dim '" + name + "' is in no operand and has no size");
  }

 private:
  Dims of(const Names& ns) const {
    Dims out;
    for (const std::string& n : ns) out.push_back(dims[slot(n)]);
    return out;
  }
  static void take_sizes(std::map<std::string, int64_t>& sizes, const std::string& what, const Names& names,
                         const at::Tensor& t) {
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

// The plans of this thread by structure key (OpArgs::structure_key: the
// names, options and shapes; not the data), the most recent 256.
std::shared_ptr<const CallPlan> plan_for(const OpArgs& a) {
  thread_local std::map<std::string, std::shared_ptr<const CallPlan>, std::less<>> plans;
  std::string key = a.structure_key();
  if (const auto it = plans.find(key); it != plans.end()) return it->second;
  auto plan = std::make_shared<const CallPlan>(a);  // throws for a bad call: nothing kept
  if (plans.size() >= 256) plans.clear();  // calls hold their plan, so this frees only what none uses
  plans.emplace(std::move(key), plan);
  return plan;
}

// One call's Dims by name: the plan's, with this call's dynamic dims.
class DimTable {
 public:
  DimTable(std::shared_ptr<const CallPlan> plan, const OpArgs& a) : plan_(std::move(plan)) {
    if (plan_->dynamic.empty()) return;
    bound_ = plan_->dims;
    Dims& dims = *bound_;
    const std::vector<at::Tensor> lengths = lengths_of(a);
    for (const CallPlan::Dynamic& d : plan_->dynamic) {
      Dims over;
      for (const size_t i : d.over) over.push_back(dims[i]);
      dims[d.slot] = Dim::dynamic(plan_->names[d.slot], from_aten(lengths[d.lengths], over), d.extent);
    }
  }

  const Dim& operator[](const std::string& name) const { return all()[plan_->slot(name)]; }
  Dims dims(const Names& names) const {
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
  Dims operand(const Dims& planned, const Names& names) const { return bound_ ? dims(names) : planned; }

 private:
  const Dims& all() const { return bound_ ? *bound_ : plan_->dims; }

  std::shared_ptr<const CallPlan> plan_;
  std::optional<Dims> bound_;  // with this call's dynamic dims, for a call that has some
};

struct Call {
  Call(std::shared_ptr<const CallPlan> p, const OpArgs& a)
      : plan(std::move(p)), table(plan, a), opts{table[a[Arg::key_dim].toStringRef()], table[a[Arg::axis].toStringRef()]} {}

  std::shared_ptr<const CallPlan> plan;
  DimTable table;
  AttentionOptions opts;
  std::optional<Tensor> q, k, v;
  std::optional<ContextParallel> cp;  // with cp_group

  // dot_attention, or context_parallel_attention with cp_group.
  Tensor attend() const {
    return cp ? context_parallel_attention(*q, *k, *v, opts, *cp) : dot_attention(*q, *k, *v, opts);
  }
};

Call make_call(const OpArgs& a) {
  Call c(plan_for(a), a);
  const DimTable& t = c.table;
  const CallPlan& p = *c.plan;
  c.q = from_aten(a[Arg::query].toTensor(), t.operand(p.q, p.q_names));
  c.k = from_aten(a[Arg::keys].toTensor(), t.operand(p.k, p.k_names));
  c.v = from_aten(a[Arg::values].toTensor(), t.operand(p.v, p.v_names));
  AttentionOptions& o = c.opts;
  o.att_dropout = number_of(a[Arg::dropout], 0.0);
  o.att_dropout_broadcast = flag_of(a[MoreArg::dropout_broadcast]);
  if (const auto causal = opt_string(a[Arg::causal])) o.causal_query_spatial_dim = t[*causal];
  if (!a[Arg::causal_offset].isNone())
    o.causal_offset = from_aten(a[Arg::causal_offset].toTensor(), t.dims(names_of(a[Arg::causal_offset_dims])));
  if (!a[Arg::scale].isNone()) o.scale = a[Arg::scale].toDouble();
  if (const auto pos = opt_string(a[MoreArg::query_position])) o.query_position_dim = t[*pos];
  if (const c10::IValue* v = a.variants()) {
    auto named = [&](const char*, const at::Tensor& x, const Names& names) {
      return std::optional<Tensor>(from_aten(x, t.dims(names)));
    };
    AttentionVariants::for_each_field(o.variants, [&](const char* name, auto& field) { read_field(v, name, field, named); });
  }
  if (const auto group = opt_string(a[CpArg::group])) {
    ContextParallel& cp = c.cp.emplace();
    cp.group = *group;
    const std::string sharding = opt_string(a[CpArg::sharding]).value_or("contiguous"),
                      strategy = opt_string(a[CpArg::strategy]).value_or("ring");
    if (sharding == "load_balanced") cp.sharding = ContextSharding::load_balanced;
    else if (sharding != "contiguous") fail("context_parallel sharding '" + sharding + "': contiguous or load_balanced");
    if (strategy == "all_gather") cp.strategy = ContextStrategy::all_gather;
    else if (strategy != "ring") fail("context_parallel strategy '" + strategy + "': ring or all_gather");
    if (!a[CpArg::timeout].isNone()) cp.timeout_seconds = a[CpArg::timeout].toDouble();
    if (!a[CpArg::lengths].isNone())
      cp.lengths = from_aten(a[CpArg::lengths].toTensor(), t.dims(names_of(a[CpArg::lengths_dims])));
  }
  return c;
}

// The run context a call asks for: forcing (else DIMATTN_SDPA), the train
// flag, and the seed its dropout draws from.
class RunScope {
 public:
  explicit RunScope(const OpArgs& a) : train_(flag_of(a[Arg::train])) {
    const Names force = names_of(a[Arg::force]);
    if (!force.empty()) {
      std::string spec;
      for (const std::string& k : force) spec += (spec.empty() ? "" : ",") + k;
      force_.emplace(spec);
    }
    if (!a[Arg::seed].isNone()) set_random_seed(static_cast<uint64_t>(a[Arg::seed].toTensor().item<int64_t>()));
  }

 private:
  std::optional<ForceKernels> force_;
  TrainFlagScope train_;
};

// x's data with its dims in the order `names` gives, as a new contiguous
// tensor that aliases no input (a custom op's output must not).
at::Tensor in_order(const Tensor& x, const Names& names, const DimTable& t, const char* what, const OpArgs& a) {
  std::vector<int64_t> perm;
  bool in_place = true;  // already in that order (usual: the kernel's output is laid out as asked)
  for (const std::string& n : names) {
    const int axis = x.axis_of(t[n]);
    if (axis < 0) fail(std::string(what) + " has dims " + repr(x.dims()) + ", not " + join(names));
    in_place = in_place && axis == static_cast<int>(perm.size());
    perm.push_back(axis);
  }
  if (static_cast<int>(perm.size()) != x.rank()) fail(std::string(what) + " has dims " + repr(x.dims()) + ", not " + join(names));
  at::Tensor out = (in_place ? to_aten(x) : to_aten(x).permute(perm)).contiguous();
  for (const Arg input : {Arg::query, Arg::keys, Arg::values})
    if (out.is_alias_of(a[input].toTensor())) return out.clone();
  return out;
}

// The call's result, in out_dims' order.
at::Tensor run(const OpArgs& a) {
  const Call c = make_call(a);
  const RunScope scope(a);
  return in_order(c.attend(), c.plan->out_names, c.table, "the output", a);
}

// The learnable tensors of a call (AttentionVariants::learnable), in field
// order: their argument positions (relative to the query).
std::vector<size_t> learnable_args(const OpArgs& a) {
  std::vector<size_t> out;
  const c10::IValue* v = a.variants();
  if (v == nullptr) return out;
  auto at = static_cast<size_t>(v - &a[Arg::query]);
  AttentionVariants none;
  AttentionVariants::for_each_field(none, [&](const char* name, const auto& field) {
    using T = std::decay_t<decltype(field)>;
    if constexpr (std::is_same_v<T, std::optional<Tensor>>) {
      if (AttentionVariants::learnable(name) && !v->isNone()) out.push_back(at);
      v += 2, at += 2;
    } else {
      ++v, ++at;
    }
  });
  return out;
}

// --- the ops' kernels (boxed: the arguments are the call's typed list) ---

// A boxed kernel's call: its arguments, the last `extra` of which follow the
// groups up to `parts`.
OpArgs call_on(torch::jit::Stack* stack, Parts parts, size_t extra = 0) {
  return OpArgs(&*(stack->end() - static_cast<std::ptrdiff_t>(OpArgs::count(parts) + extra)), parts);
}

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

// --- autograd ---

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
