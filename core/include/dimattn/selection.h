#pragma once
// Kernel selection for dot_attention (DESIGN.md §4).
//
// AttentionParams holds exactly the fields that can change which kernel runs:
// never batch sizes, sequence lengths, pointers or RNG seeds, which change
// every step and would make every step select anew. Each backend lists its
// candidate kernels in priority order; each candidate's gate returns
// {ok, reason} as a value; the first candidate whose gate passes (and that
// forcing allows) wins. Decisions are cached per params, thread-safely, with
// counters; DIMATTN_DEBUG=1 logs each new decision once with every rejection.
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "dimattn/dtype.h"
#include "dimattn/variants.h"

namespace dimattn {

// How q, k and v sit in memory, detected from strides (layout.h).
enum class LayoutClass {
  separate,     // three tensors, each in [batch.., spatial, feature] order
  permuted,     // three tensors, at least one a permuted view (e.g. [B, T, H, D] read as [B, H, T, D])
  packed_qkv,   // q, k and v are views of one buffer
  packed_kv,    // k and v are views of one buffer, q is separate
  strided,      // any other: last-dim stride != 1, broadcast (zero) strides, overlapping views
};
const char* layout_name(LayoutClass);

enum class OffsetKind { none, nonzero };  // causal offset: none/0, or a history length

// The kv padding a call masks: none (a static kv axis), lengths per batch
// entry (they vary over batch dims and keys-only dims only), or per query
// row (they vary over the query's own dims too: each row its own kv length).
enum class Padding { none, per_entry, per_row };
const char* padding_name(Padding);

struct AttentionParams {
  DeviceType device = DeviceType::cpu;
  DType dtype = DType::float32;
  int64_t head_dim_qk = 0;
  int64_t head_dim_v = 0;
  bool causal = false;
  OffsetKind offset = OffsetKind::none;
  bool dropout = false;
  bool dropout_broadcast = false;
  Padding padding = Padding::none;  // dynamic kv lengths to mask
  int64_t gqa_ratio = 1;     // query rows per kv head from query groups (GQA, beam); 1 without groups
  bool keys_only = false;    // keys/values carry dims the query lacks (broadcast)
  // Variants present (AttentionCall::variants.set(); their sizes and values never
  // matter to the choice; sinks_grad and bias_grad matter to autograd backends).
  VariantSet variants;
  LayoutClass layout = LayoutClass::separate;
  bool requires_grad = false;
  bool deterministic = false;  // deterministic_algorithms() (forcing.h)
  std::string forced;        // the forcing spec in effect ("auto", "reference", "a,b")

  bool operator==(const AttentionParams&) const = default;
  std::string describe() const;  // one line, every field
};

struct AttentionParamsHash {
  size_t operator()(const AttentionParams& p) const;
};

struct GateResult {
  bool ok = true;
  std::string reason;  // why not, when !ok
  static GateResult pass() { return {}; }
  static GateResult fail(std::string why) { return {false, std::move(why)}; }
};

// The name of dot_attention's reference path among the kernel names.
inline constexpr const char* kReferenceKernel = "reference";

struct Rejection {
  std::string kernel;
  std::string reason;
};

struct Decision {
  std::string kernel;               // the chosen kernel
  std::string isa;                  // its code path where it has several (cpu_flash: the instruction set), else ""
  std::vector<Rejection> rejected;  // every candidate tried before it, with the reason
  AttentionParams params;           // what it was decided for
  std::string explain() const;      // multi-line, for logs, `dimattn explain` and errors
};

struct SelectionStats {
  uint64_t lookups = 0;        // select_kernel calls
  uint64_t selections = 0;     // cache misses: gates actually evaluated
  uint64_t entries = 0;        // distinct keys cached
  uint64_t layout_copies = 0;  // q/k/v/mask copies made because a kernel could not take a view
};
SelectionStats selection_stats();
void reset_selection_cache();  // clears entries and counters (tests, benchmarks)

}  // namespace dimattn
