#include "op_args.h"

#include <ATen/core/Tensor.h>

#include <iterator>
#include <optional>
#include <utility>

#include "dimattn/error.h"
#include "dimattn/variants.h"

namespace dimattn::python {

namespace {

// Each variant field's arguments by the field's kind: their schema text, how
// many IValues they take, and their kind's name.
struct FieldArgs {
  std::string schema;
  size_t count;
  const char* kind;
};
FieldArgs field_args(const std::string& n, const std::optional<double>&) { return {"float? " + n + "=None", 1, "number"}; }
FieldArgs field_args(const std::string& n, bool) { return {"bool? " + n + "=None", 1, "flag"}; }
FieldArgs field_args(const std::string& n, const std::optional<AttentionWindow>&) {
  return {"int?[]? " + n + "=None", 1, "window"};
}
FieldArgs field_args(const std::string& n, const std::optional<Tensor>&) {
  return {"Tensor? " + n + "=None, str[]? " + n + "_dims=None", 2,
          AttentionVariants::learnable(n) ? "learnable" : "tensor"};
}

template <class F>
void for_each_variant_field(F fn) {
  const AttentionVariants none;
  AttentionVariants::for_each_field(none, [&](const char* name, const auto& field) { fn(name, field_args(name, field)); });
}

size_t variant_arg_count() {
  size_t n = 0;
  for_each_variant_field([&](const char*, const FieldArgs& a) { n += a.count; });
  return n;
}

// One argument's part of a structure key.
void add_key(std::string& key, const c10::IValue& v) {
  if (v.isNone()) {
    key += '\x01';
  } else if (v.isString()) {
    key += v.toStringRef();
    key += '\x02';
  } else if (v.isTensor()) {
    key += '\x03';
    for (const int64_t s : v.toTensor().sizes()) key.append(reinterpret_cast<const char*>(&s), sizeof s);
    key += static_cast<char>(v.toTensor().dim());
  } else if (v.isList()) {
    key += '\x04';
    for (const c10::IValue& e : v.toListRef()) add_key(key, e);
    key += '\x05';
  } else if (v.isDouble()) {
    const double d = v.toDouble();
    key.append(reinterpret_cast<const char*>(&d), sizeof d);
  } else if (v.isInt()) {
    const int64_t i = v.toInt();
    key.append(reinterpret_cast<const char*>(&i), sizeof i);
  } else if (v.isBool()) {
    key += v.toBool() ? 'T' : 'F';
  } else {
    key += '?';
  }
}

// The call's arguments (Arg), the full group's options (MoreArg) and context
// parallelism's (CpArg).
constexpr std::pair<const char*, const char*> kFixedArguments[] = {
    {"Tensor", "query"}, {"Tensor", "keys"}, {"Tensor", "values"}, {"str[]", "dims"}, {"str", "key_dim"},
    {"str", "axis"}, {"str[]?", "force"}, {"bool?", "train"}, {"float?", "dropout"}, {"Tensor[]?", "lengths"},
    {"str[]?", "lengths_of"}, {"str[]?", "lengths_dims"}, {"Tensor?", "seed"}, {"str?", "causal"},
    {"Tensor?", "causal_offset"}, {"str[]?", "causal_offset_dims"}, {"float?", "scale"}};
constexpr std::pair<const char*, const char*> kMoreArguments[] = {
    {"bool?", "dropout_broadcast"}, {"str?", "query_position"}, {"str[]?", "size_names"}, {"int[]?", "sizes"}};
static_assert(std::size(kMoreArguments) == static_cast<size_t>(MoreArg::count_), "one entry per MoreArg");
static_assert(std::size(kFixedArguments) == static_cast<size_t>(Arg::count_), "one entry per Arg");
constexpr std::pair<const char*, const char*> kCpArguments[] = {
    {"str?", "cp_group"}, {"str?", "cp_sharding"}, {"str?", "cp_strategy"}, {"float?", "cp_timeout"},
    {"Tensor?", "cp_lengths"}, {"str[]?", "cp_lengths_dims"}};
static_assert(std::size(kCpArguments) == static_cast<size_t>(CpArg::count_), "one entry per CpArg");

// fn(type_and_default, name) for each argument of the groups up to `parts`,
// in order ("" for the second argument of a variant tensor, whose schema text
// the first holds).
template <class F>
void for_each_argument(Parts parts, F fn) {
  auto fixed = [&](const std::pair<const char*, const char*>& a) {
    const std::string type = a.first;
    fn(type.back() == '?' ? type + " " + a.second + "=None" : type + " " + a.second, std::string(a.second));
  };
  for (const auto& a : kFixedArguments) fixed(a);
  if (parts == Parts::call) return;
  for (const auto& a : kMoreArguments) fixed(a);
  for_each_variant_field([&](const char* name, const FieldArgs& a) {
    fn(a.schema, std::string(name));
    if (a.count == 2) fn("", std::string(name) + "_dims");
  });
  if (parts == Parts::full) return;
  for (const auto& a : kCpArguments) fixed(a);
}

std::vector<std::string> names_in(Parts parts) {
  std::vector<std::string> out;
  for_each_argument(parts, [&](const std::string&, const std::string& name) { out.push_back(name); });
  return out;
}

}  // namespace

std::string call_schema_arguments(Parts parts, const std::string& leading, const std::string& trailing) {
  std::string s;
  for_each_argument(parts, [&](const std::string& schema, const std::string&) {
    if (!schema.empty()) s += (s.empty() ? "" : ", ") + schema;
  });
  return leading + s + trailing;
}

ArgumentNames argument_names() {
  const std::vector<std::string> call = names_in(Parts::call), full = names_in(Parts::full),
                                 all = names_in(Parts::context_parallel);
  return {{call.begin() + 3, call.end()},
          {full.begin() + static_cast<std::ptrdiff_t>(call.size()), full.end()},
          {all.begin() + static_cast<std::ptrdiff_t>(full.size()), all.end()}};
}

std::vector<std::string> variant_fields() {
  std::vector<std::string> out;
  for_each_variant_field([&](const char* name, const FieldArgs& a) { out.push_back(std::string(name) + ":" + a.kind); });
  return out;
}

size_t OpArgs::count(Parts parts) {
  static const size_t call = static_cast<size_t>(Arg::count_),
                      full = call + static_cast<size_t>(MoreArg::count_) + variant_arg_count(),
                      all = full + static_cast<size_t>(CpArg::count_);
  return parts == Parts::call ? call : parts == Parts::full ? full : all;
}

namespace {
const c10::IValue kNone;
}  // namespace

const c10::IValue& OpArgs::operator[](MoreArg a) const {
  if (parts_ == Parts::call) return kNone;
  return first_[static_cast<size_t>(Arg::count_) + static_cast<size_t>(a)];
}

const c10::IValue& OpArgs::operator[](CpArg a) const {
  if (parts_ != Parts::context_parallel) return kNone;
  return first_[count(Parts::full) + static_cast<size_t>(a)];
}

OpArgs::OperandNames OpArgs::operand_names() const {
  const std::vector<std::string> all = names_of((*this)[Arg::dims]);
  OperandNames n;
  size_t at = 0;
  for (auto [operand, names] : {std::pair{Arg::query, &n.query}, std::pair{Arg::keys, &n.keys},
                                std::pair{Arg::values, &n.values}}) {
    const auto rank = static_cast<size_t>((*this)[operand].toTensor().dim());
    if (at + rank > all.size())
      throw Error("[dot_attention] dims holds " + std::to_string(all.size()) + " names, too few for the ranks of " +
                  "query, keys and values");
    names->assign(all.begin() + static_cast<std::ptrdiff_t>(at), all.begin() + static_cast<std::ptrdiff_t>(at + rank));
    at += rank;
  }
  n.out.assign(all.begin() + static_cast<std::ptrdiff_t>(at), all.end());
  return n;
}

std::string OpArgs::argument_name(size_t i) const {
  static const std::vector<std::string> names = names_in(Parts::context_parallel);
  return names.at(i);
}

void OpArgs::for_each_variant(const std::function<void(const std::string&, const c10::IValue&)>& fn) const {
  const c10::IValue* v = variants();
  if (v == nullptr) return;
  for_each_variant_field([&](const char* name, const FieldArgs& f) {
    fn(name, *v);
    v += f.count;
  });
}

std::string OpArgs::structure_key() const {
  std::string key;
  key.reserve(512);
  for (size_t i = 0, n = count(parts_); i < n; ++i) add_key(key, first_[i]);
  return key;
}

bool flag_of(const c10::IValue& v) { return !v.isNone() && v.toBool(); }
double number_of(const c10::IValue& v, double unset) { return v.isNone() ? unset : v.toDouble(); }

std::vector<std::string> names_of(const c10::IValue& v) {
  std::vector<std::string> out;
  if (v.isNone()) return out;
  for (const c10::IValue& e : v.toListRef()) out.push_back(e.toStringRef());
  return out;
}

}  // namespace dimattn::python
