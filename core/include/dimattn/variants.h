#pragma once
// AttentionVariants: the variants of one dot_attention call (sliding window,
// soft-capping, ALiBi, sinks, bias, mask, segments; docs/api.md, "Variants"), as one
// value carried whole from every entry point (AttentionOptions, the modules'
// config, the Python op, context parallelism, the case library, the CLI) to
// the backend's AttentionCall and from there into the kernels' params.
//
// A new variant is a field here with its line in for_each_field, its
// VariantKind, its checks (core/src/variants.cpp), its meaning in the
// reference path and its term in the kernels (docs/architecture.md, "Where to
// make a change"). Everything that only passes variants on — the Python op's
// schema and decoding, context parallelism's agreement across ranks, the
// CLI's options — goes through for_each_field and needs no change.
#include <cstdint>
#include <iterator>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "dimattn/dim.h"
#include "dimattn/tensor.h"

namespace dimattn {

// A sliding window in kv positions around each query row's diagonal
// i + causal_offset: row i attends kv j with
// i + offset - left <= j <= i + offset + right. An unset side is unbounded;
// with causal attention `right` must be unset or 0.
struct AttentionWindow {
  std::optional<int64_t> left, right;
  bool operator==(const AttentionWindow&) const = default;
};

// The variants of a call as kernel selection sees them: which are on, never
// their sizes or values (AttentionParams::variants, the plan cache's key,
// each gate's rejection by name).
enum class VariantKind : uint8_t {
  window, softcap, alibi, sinks, sinks_grad, bias, bias_grad, mask, segments, rel_pos, rel_pos_grad, count_
};

// Its short name (describe(), `dimattn explain`) and what it is in words (errors).
inline const std::pair<const char*, const char*>& variant_names(VariantKind v) {
  static const std::pair<const char*, const char*> kNames[] = {
      {"window", "a sliding window"},          {"softcap", "soft-capping"},
      {"alibi", "ALiBi"},                      {"sinks", "attention sinks"},
      {"sinks_grad", "a gradient of sinks"},   {"bias", "an additive bias"},
      {"bias_grad", "a gradient of a bias"},   {"mask", "a boolean mask"},
      {"segments", "segment ids (document masking)"},
      {"rel_pos", "relative positions (pos_emb)"}, {"rel_pos_grad", "a gradient of relative positions"}};
  static_assert(std::size(kNames) == static_cast<size_t>(VariantKind::count_), "one name per VariantKind");
  return kNames[static_cast<size_t>(v)];
}

struct VariantSet {
  uint32_t bits = 0;

  bool has(VariantKind v) const { return (bits >> static_cast<unsigned>(v)) & 1u; }
  VariantSet& set(VariantKind v, bool on = true) {
    if (on) bits |= 1u << static_cast<unsigned>(v);
    return *this;
  }
  bool any() const { return bits != 0; }
  VariantSet without(VariantSet other) const { return {bits & ~other.bits}; }
  // The variants present, in VariantKind order.
  template <class F>
  void for_each(F fn) const {
    for (unsigned v = 0; v < static_cast<unsigned>(VariantKind::count_); ++v)
      if (has(static_cast<VariantKind>(v))) fn(static_cast<VariantKind>(v));
  }
  // Their short names joined by "," (long_names: their words, by ", "), "none" for none.
  std::string names(bool long_names = false) const;
  bool operator==(const VariantSet&) const = default;
};

struct AttentionVariants {
  std::optional<AttentionWindow> window;
  // Energies become softcap * tanh(energy / softcap) (Gemma 2). > 0.
  std::optional<double> softcap;
  // ALiBi: energies get -slope * |i + offset - j|; a float tensor over
  // (a subset of) the call's batch dims, usually heads (BLOOM, MPT). Constant.
  std::optional<Tensor> alibi_slopes;
  // Attention sinks: a float logit over (a subset of) the call's batch dims,
  // usually heads, that joins every row's softmax denominator and carries no
  // value (GPT-OSS); learnable (gradients flow to it).
  std::optional<Tensor> sinks;
  // The fixed "off-by-one" sink: logit 0 in every row's denominator.
  bool sink_off_by_one = false;
  // An additive float bias on the energies (after soft-capping, with ALiBi),
  // over any of the call's dims except features: batch dims, the query's own
  // dims (its positional dim, heads of GQA, beam), keys-only dims and `axis`
  // (the kv position). Broadcast by name over the dims it lacks, never
  // expanded by the fused kernels; gradients flow to it (T5's relative
  // position bias, document masks as -inf). In self-attention (`axis` in the
  // query) `axis` here is the kv position: for a bias that also varies with
  // the query position, give keys and values their own kv dim.
  std::optional<Tensor> bias;
  // A bool mask over dims as for `bias`: true = may attend. Combined with
  // every other mask; a row left without any position gives 0.
  std::optional<Tensor> mask;
  // Segments (document masking, packed sequences): integer ids (int32 or
  // int64) of the query positions and of the kv positions; query row i may
  // attend kv j iff their ids are equal. Combined with every other mask,
  // never materialised as a [t, kv] mask; constant. query_segments varies
  // over the query's dims (batch dims and its own: its positional dim,
  // heads of GQA), kv_segments over the keys' (batch dims, keys-only dims
  // and `axis`, the kv position). Both or neither. In self-attention (`axis`
  // in the query) one tensor over [batch, axis] serves as both: the query
  // side reads `axis` as the query position, the kv side as the kv position.
  std::optional<Tensor> query_segments, kv_segments;
  // Relative positions (Transformer-XL, RETURNN's rel_pos_self_attention;
  // docs/api.md, "Relative positions"): the energy of query row i and kv
  // position j gains (q_i + pos_bias_v) . pos_emb[c + j - i] inside the
  // scale, and pos_bias_u joins the content term:
  //   energy = scale * ((q_i + u) . k_j + (q_i + v) . pos_emb[c + j - i]).
  // pos_emb is over key_dim, one relative-position dim R and any of the
  // call's per-head dims (batch dims, keys-only dims, query groups: heads).
  // R of extent Tq + Tk - 1 (RETURNN's pos_emb_spatial_dim: row r is the
  // relative position r - (Tq - 1), so c = Tq - 1, Tq the extent of the
  // query's positional dim, which the call must name) or R == axis, the kv
  // dim itself: then row j serves every query row (no shift, RETURNN's
  // single step). pos_bias_u and pos_bias_v: over key_dim and per-head dims;
  // each needs pos_emb. All three learnable; 16-bit tables are read as the
  // call's dtype.
  std::optional<Tensor> pos_emb, pos_bias_u, pos_bias_v;

  // fn(name, field) for every field, in declaration order: how the Python
  // op's schema, its decoding, context parallelism's agreement and the CLI
  // see the variants without naming each (Self: AttentionVariants, const or not).
  template <class Self, class F>
  static void for_each_field(Self& v, F&& fn) {
    fn("window", v.window);
    fn("softcap", v.softcap);
    fn("alibi_slopes", v.alibi_slopes);
    fn("sinks", v.sinks);
    fn("sink_off_by_one", v.sink_off_by_one);
    fn("bias", v.bias);
    fn("mask", v.mask);
    fn("query_segments", v.query_segments);
    fn("kv_segments", v.kv_segments);
    fn("pos_emb", v.pos_emb);
    fn("pos_bias_u", v.pos_bias_u);
    fn("pos_bias_v", v.pos_bias_v);
  }

  // Whether the tensor field of this name gets a gradient (the sinks, the
  // bias, the relative positions' table and biases); the other tensors are
  // constants (ALiBi's slopes, the mask, segments).
  static bool learnable(std::string_view field) {
    return field == "sinks" || field == "bias" || field == "pos_emb" || field == "pos_bias_u" ||
           field == "pos_bias_v";
  }

  // fn(name, field) for each learnable tensor field, in field order.
  template <class Self, class F>
  static void for_each_learnable(Self& v, F&& fn) {
    for_each_field(v, [&](const char* name, auto& field) {
      if constexpr (std::is_same_v<std::remove_cvref_t<decltype(field)>, std::optional<Tensor>>)
        if (learnable(name)) fn(name, field);
    });
  }

  // The tensor field of this name, nullptr for a name of no tensor field.
  std::optional<Tensor>* tensor_field(std::string_view name);
  const std::optional<Tensor>* tensor_field(std::string_view name) const {
    return const_cast<AttentionVariants*>(this)->tensor_field(name);
  }

  // Which are on (a learnable tensor that requires grad adds its *_grad kind).
  VariantSet set() const;
  bool any() const { return set().any(); }
  // Windows and ALiBi measure distance along the query's positional dim.
  bool positional() const { return window.has_value() || alibi_slopes.has_value(); }

  // Throws dimattn::Error "[op] ..." for values no call can take: window
  // sides < 0 or neither set, a right side with causal attention, softcap
  // not finite and > 0, a sink tensor with the off-by-one sink, one side of
  // the segment ids without the other. The checks
  // that need no operands (the modules make them when constructed).
  void check_values(const char* op, bool causal) const;

  // The numbers every process making the same call computes alike: scalars by
  // value, tensors by their presence (context parallelism's agreement).
  std::vector<double> fingerprint() const;
  // " window=[4,-] softcap=30 sinks=(heads[4])": each variant that is on, by
  // its field's name; "" for none.
  std::string describe() const;
};

// What a call's variants are checked against: its roles, as dot_attention
// derives them from the operands' dims.
struct VariantRoles {
  const Tensor* query;     // for backends, devices and hints in messages
  Dim key_dim;
  const Dims* batch;       // dims shared by query and keys/values
  const Dims* query_only;  // the query's own dims
  const Dims* keys_only;   // keys'/values' own dims but value features
  Dim axis, kv_axis;       // the caller's axis; its relabelled kv side (== axis unless self-attention)
  std::optional<Dim> position;  // the query's positional dim, when the call names one
  bool causal = false;
};

// check_values, then each variant's tensor against the roles (backend, dtype,
// the dims it may vary over; windows and ALiBi need a positional dim).
// Returns the variants as the call's kernels see them: a bias, mask or
// kv_segments over `axis` relabelled to the kv side of self-attention.
AttentionVariants checked_variants(const char* op, const AttentionVariants& v, const VariantRoles& roles);

// How a call's relative positions index their table (pos_emb): query row i
// and kv position j read row center + j - step * i of `dim` (R).
struct RelPosForm {
  Dim dim;
  int64_t center = 0, step = 1;
};
// The form of checked variants' pos_emb (nullopt without one) for a call
// with these roles: R == the kv axis reads row j (center 0, step 0), else
// center = extent(position) - 1, step 1.
std::optional<RelPosForm> rel_pos_form(const AttentionVariants& checked, const VariantRoles& roles);

}  // namespace dimattn
