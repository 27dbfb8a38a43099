#pragma once
// AttentionCall: one dot_attention call with names turned into roles, as a
// backend's attention hook receives it. Backends read roles, never names.
//
// Invariants (established by dot_attention):
//   query  dims = batch ∪ query_groups ∪ {query_spatial, key_dim}
//   keys   dims ⊆ batch ∪ keys_only ∪ {kv_spatial, key_dim}, ⊇ {kv_spatial, key_dim}
//   values dims ⊆ batch ∪ keys_only ∪ {kv_spatial} ∪ value_feature, ⊇ {kv_spatial}
//   output dims = batch ∪ keys_only ∪ query_groups ∪ {query_spatial} ∪ value_feature
// The query's own dims (those keys/values lack) are query_spatial plus
// query_groups (e.g. beam, or the query heads sharing one kv head in GQA).
// Keys and values never carry them: a kernel treats groups as more query rows
// or as GQA heads, as views where strides allow, and never tiles keys/values.
// Causal masks use the query_spatial position and broadcast over groups.
// kv_spatial never appears in the query.
#include <cstdint>
#include <iterator>
#include <optional>
#include <string>
#include <utility>

#include "dimattn/dim.h"
#include "dimattn/tensor.h"

namespace dimattn {

// The variants of a call as kernel selection sees them: which are on, never
// their sizes or values (AttentionParams::variants, the plan cache's key,
// each gate's rejection by name). A new variant is an entry here, its names
// below, and its line in AttentionCall::variants().
enum class VariantKind : uint8_t { window, softcap, alibi, sinks, sinks_grad, bias, bias_grad, mask, count_ };

// Its short name (describe(), `dimattn explain`) and what it is in words (errors).
inline const std::pair<const char*, const char*>& variant_names(VariantKind v) {
  static const std::pair<const char*, const char*> kNames[] = {
      {"window", "a sliding window"},          {"softcap", "soft-capping"},
      {"alibi", "ALiBi"},                      {"sinks", "attention sinks"},
      {"sinks_grad", "a gradient of sinks"},   {"bias", "an additive bias"},
      {"bias_grad", "a gradient of a bias"},   {"mask", "a boolean mask"}};
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
  std::string names(bool long_names = false) const {
    std::string s;
    for_each([&](VariantKind v) {
      if (!s.empty()) s += long_names ? ", " : ",";  // appended piecewise: GCC 12 warns (-Wrestrict) on "," + string
      s += long_names ? variant_names(v).second : variant_names(v).first;
    });
    return s.empty() ? "none" : s;
  }
  bool operator==(const VariantSet&) const = default;
};

struct AttentionCall {
  Tensor query, keys, values;
  Dims batch;          // in the query's order: the canonical order of the flat batch index
  Dims keys_only;      // in keys/values, not in the query: broadcast over
  Dims query_groups;   // the query's own dims besides query_spatial
  Dim query_spatial;
  Dim kv_spatial;
  Dim key_dim;
  Dims value_feature;
  double scale = 1.0;
  bool causal = false;
  std::optional<Tensor> causal_offset;  // int, over a subset of batch dims; absent = 0
  double dropout = 0.0;                 // effective: 0 unless the train flag is on
  bool dropout_broadcast = false;
  uint64_t dropout_seed = 0;
  uint64_t dropout_offset = 0;
  // Dropout keys query_spatial position i as dropout_q_position + i and kv
  // position j as dropout_kv_position + j (AttentionOptions::positions; the
  // causal offset already holds their difference).
  int64_t dropout_q_position = 0, dropout_kv_position = 0;
  // Variants (AttentionOptions; order in docs/numerics.md). With a window or
  // ALiBi, query_spatial is the query's positional dim. Negative window
  // bounds are unbounded. alibi_slopes and sinks are float tensors over a
  // subset of batch ∪ keys_only ∪ query_groups.
  int64_t window_left = -1, window_right = -1;
  double softcap = 0.0;  // 0 = off
  std::optional<Tensor> alibi_slopes;
  std::optional<Tensor> sinks;  // the off-by-one sink is a zero scalar here
  // Additive float bias and bool mask (true = may attend), each over a subset
  // of batch ∪ keys_only ∪ query_groups ∪ {query_spatial, kv_spatial}.
  std::optional<Tensor> bias, mask;

  bool has_window() const { return window_left >= 0 || window_right >= 0; }
  bool positional() const { return causal || has_window() || alibi_slopes.has_value(); }

  VariantSet variants() const {
    using V = VariantKind;
    VariantSet s;
    s.set(V::window, has_window()).set(V::softcap, softcap > 0).set(V::alibi, alibi_slopes.has_value());
    s.set(V::sinks, sinks.has_value()).set(V::sinks_grad, sinks && sinks->requires_grad());
    s.set(V::bias, bias.has_value()).set(V::bias_grad, bias && bias->requires_grad());
    return s.set(V::mask, mask.has_value());
  }
};

// The keep mask of the call's attention dropout, drawn from the shared Philox
// stream (kernels/common/philox.h): a bool tensor beside `like` (same backend
// and device) over {kv_spatial} for broadcast dropout, else over batch,
// keys_only, query_groups, query_spatial and kv_spatial. Every path that
// applies attention dropout uses this mask or the same Philox function.
// pre: call.dropout > 0.
Tensor attention_dropout_keep_mask(const AttentionCall& call, const Tensor& like);

// One call computed as a block of a longer attention (Backend::attention_block):
// its output (over the call's output dims) and the log-sum-exp of each query
// row's energies (natural log; over the output's dims without value_feature;
// float32, float64 for float64 calls; -inf for a row that attends nothing).
// Blocks over disjoint kv ranges merge exactly through the lse
// (docs/distributed.md).
struct AttentionBlockResult {
  Tensor output, lse;
};

// Gradients of one call's output with respect to its query, keys and values
// (Backend::attention_backward): each over the dims of the role tensor it
// belongs to, in any order (keys/values may carry broadcast dims they lack).
struct AttentionCallGrads {
  Tensor query, keys, values;
  std::optional<Tensor> sinks;  // over the call's sinks dims, when it has sinks
  std::optional<Tensor> bias;   // over the call's bias dims, when it has a bias
};

}  // namespace dimattn
