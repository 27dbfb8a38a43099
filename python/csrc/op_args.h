#pragma once
// The arguments of the dot_attention ops: typed torch schema arguments in
// three groups, the second's variants part made from the C++ variants type
// (AttentionVariants::for_each_field), so that a new variant reaches Python
// without a change here. Dims cross as names (a framework maps its own dim
// objects onto them); names are unique within a call.
//
//   call:  Tensor query, Tensor keys, Tensor values, str[] dims, str key_dim,
//          str axis, str[]? force, bool? train, float? dropout, Tensor[]? lengths,
//          str[]? lengths_of, str[]? lengths_dims, Tensor? seed, str? causal,
//          Tensor? causal_offset, str[]? causal_offset_dims, float? scale
//   full:  the rarer options: bool? dropout_broadcast, str? query_position,
//          str[]? size_names, int[]? sizes; then the variants, per field of
//          AttentionVariants by its kind: a number `float? NAME`, a flag
//          `bool? NAME`, the window `int?[]? NAME` ([left, right], None =
//          unbounded), a tensor `Tensor? NAME, str[]? NAME_dims`
//   context parallelism: str? cp_group (the c10d group's name), str? cp_sharding
//          (contiguous), str? cp_strategy (ring), float? cp_timeout,
//          Tensor? cp_lengths, str[]? cp_lengths_dims
//
// dot_attention takes the call's group, dot_attention.full the call's and the
// full group, context_parallel_attention all three; the backward, trace and
// explain ops the call's and the full group. Every argument after axis is
// optional with the default None (= unset, false, 0), so that a caller passes
// a call positionally up to its last set argument: each argument of an op,
// passed or defaulted, costs its Python caller about a thousand instructions
// per call (docs/perf-log.md), keywords more, so the common call takes the op with
// the fewest arguments. argument_names() gives each group's names in order.
// - dims: the names of the query's dims, then the keys', the values' and the
//   result's, in their orders (split by the operands' ranks; the result's are
//   the rest);
// - dynamic dims: lengths[i] are the lengths of dim lengths_of[i]; the names
//   of each lengths tensor's dims follow one another in lengths_dims (each
//   tensor's rank of them, in order);
// - seed: the dropout seed, an int64 scalar tensor (a graph input under
//   torch.compile, drawn per call);
// - size_names/sizes: dims in no operand (so that an error can name them
//   with their size).
#include <ATen/core/ivalue.h>

#include <cstddef>
#include <functional>
#include <string>
#include <vector>

namespace dimattn::python {

// The arguments before the variants, in schema order (kFixedArguments in
// op_args.cpp names them).
enum class Arg : size_t {
  query, keys, values, dims, key_dim, axis, force, train, dropout, lengths, lengths_of, lengths_dims, seed, causal,
  causal_offset, causal_offset_dims, scale, count_
};
// The full group's options, before its variants.
enum class MoreArg : size_t { dropout_broadcast, query_position, size_names, sizes, count_ };
// Context parallelism's, after the variants.
enum class CpArg : size_t { group, sharding, strategy, timeout, lengths, lengths_dims, count_ };

// Which argument groups an op takes after the call's own: the full group
// (the rarer options and the variants: dot_attention.full, and the ops that
// must see every call), and context parallelism's (context_parallel_attention).
enum class Parts { call, full, context_parallel };

// "Tensor query, ...": the arguments of the groups up to `parts` as a
// schema's argument list, after `leading` (e.g. "Tensor grad_output, ") and
// before `trailing` (e.g. ", str[] energy_dims").
std::string call_schema_arguments(Parts parts, const std::string& leading = "", const std::string& trailing = "");

// The argument names of each group (the call's after query, keys and
// values), in order.
struct ArgumentNames {
  std::vector<std::string> call, full, context_parallel;
};
ArgumentNames argument_names();

// The variant fields as "name:kind" (kind: number, flag, window, tensor, or
// learnable: a tensor that gets a gradient), in order: what the Python
// package's Variants are made from.
std::vector<std::string> variant_fields();

// One call's arguments on a boxed kernel's stack (or any IValue array); the
// groups an op lacks read as None.
class OpArgs {
 public:
  // pre: `first` points at the query argument, followed by the groups up to `parts`.
  OpArgs(const c10::IValue* first, Parts parts) : first_(first), parts_(parts) {}

  const c10::IValue& operator[](Arg a) const { return first_[static_cast<size_t>(a)]; }
  const c10::IValue& operator[](MoreArg a) const;
  const c10::IValue& operator[](CpArg a) const;
  // The first variant argument (they follow in for_each_field's order), or
  // nullptr for an op without them.
  const c10::IValue* variants() const {
    return parts_ == Parts::call ? nullptr : first_ + static_cast<size_t>(Arg::count_) + static_cast<size_t>(MoreArg::count_);
  }
  // The names of the query's, keys', values' and result's dims (split from dims).
  struct OperandNames {
    std::vector<std::string> query, keys, values, out;
  };
  OperandNames operand_names() const;
  // The name of the argument at position i after the query (0: query).
  std::string argument_name(size_t i) const;
  // fn(field name, its value argument) for each variant field (none for an op without them).
  void for_each_variant(const std::function<void(const std::string&, const c10::IValue&)>& fn) const;
  // The first argument after the groups (the trace op's energy_dims).
  const c10::IValue& after() const { return first_[count(parts_)]; }
  // How many IValues the groups up to `parts` take.
  static size_t count(Parts parts);

  // Everything but the per-call tensors' data: the names, the options' values,
  // each tensor's presence, rank and sizes. Equal keys make equal Dims.
  std::string structure_key() const;

 private:
  const c10::IValue* first_;
  Parts parts_;
};

// The names of a str[]? argument (empty for None).
std::vector<std::string> names_of(const c10::IValue& v);
// An optional argument's value, `unset` for None.
bool flag_of(const c10::IValue& v);
double number_of(const c10::IValue& v, double unset);

}  // namespace dimattn::python
