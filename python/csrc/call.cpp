// python/csrc/call.h: a call's names made into Dims, its options, its run.
#include "call.h"

#include <algorithm>
#include <type_traits>
#include <utility>

#include "dimattn/error.h"

namespace dimattn::python {
namespace {

// A tensor argument of a call besides query, keys and values, with the names
// of its dims: lengths, the causal offset, the variants' tensors, context
// parallelism's lengths.
struct NamedArg {
  std::string what;
  at::Tensor tensor;
  Names dims;
};

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

}  // namespace

[[noreturn]] void fail(const std::string& msg) { throw Error("[dot_attention] " + msg); }

std::string join(const Names& names) {
  std::string s;
  for (const std::string& n : names) s += (s.empty() ? "" : ", ") + n;
  return "(" + s + ")";
}

std::vector<at::Tensor> lengths_of(const OpArgs& a) {
  return a[Arg::lengths].isNone() ? std::vector<at::Tensor>{} : a[Arg::lengths].toTensorVector();
}

CallPlan::CallPlan(const OpArgs& a, OpArgs::OperandNames n)
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

size_t CallPlan::slot(const std::string& name) const {
  for (size_t i = 0; i < names.size(); ++i)
    if (names[i] == name) return i;
  fail("dim '" + name + "' is in no operand and has no size");
}

Dims CallPlan::of(const Names& ns) const {
  Dims out;
  for (const std::string& n : ns) out.push_back(dims[slot(n)]);
  return out;
}

void CallPlan::take_sizes(std::map<std::string, int64_t>& sizes, const std::string& what, const Names& names,
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

}  // namespace dimattn::python
