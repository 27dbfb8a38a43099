#pragma once
// The one description of an attention case, shared by the dual harness
// (tests/dual), `dimattn check`, `dimattn explain` and `dimattn bench`,
// bench/ and the fuzz targets: a case as data (sizes, roles, masks,
// dropout, dtype, device), its named operands, running it with a forced
// kernel, and comparing results. Not installed: a tool for dimattn's own
// tests and programs (docs/architecture.md, "Shared test code").
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "dimattn/attention.h"
#include "dimattn/dtype.h"
#include "dimattn/tensor.h"

namespace dimattn::testing {

enum class Kind {
  self,   // q, k, v over one time dim (axis in the query): seq_q == seq_k
  cross,  // query time vs a separate kv dim
  step,   // one decoding step: a query without a spatial dim (seq_q unused)
};
const char* kind_name(Kind);

// How q, k and v sit in memory (the layout classes of dimattn/selection.h).
enum class Layout {
  separate,    // each its own tensor, spatial dim after the heads: [batch, heads, (group), time, feat]
  permuted,    // each its own tensor, spatial dim right after batch: [batch, time, heads, (group), feat]
  packed_qkv,  // views of one [batch, time, 3, heads, feat] buffer (self-attention, no groups)
};
const char* layout_name(Layout);

// The attention variants of a case (AttentionOptions); the positional dim is
// the query's time dim. ALiBi slopes 2^-(h+1) and sink logits (h % 3) - 1 per
// kv head.
struct CaseVariants {
  // The scalar variants (window, soft-capping, the off-by-one sink), passed
  // on whole; no tensors here (those below are made per case).
  AttentionVariants scalars;
  bool alibi = false, sinks = false;
  // An additive bias and a bool mask over the dims their letters name: b
  // batch, h heads, g the group dim, t the query's time dim, k the kv dim
  // (in self-attention the shared time dim, as the kv position); "": none.
  // Bias unit-normal (seed + 3), mask true with probability 3/4 (seed + 4).
  std::string bias, mask;
  // > 0: the mask is documents of this many positions instead, over its t
  // and k dims (query i may attend kv j iff (i + s) / n == (j + s) / n), with
  // a shift s = 13 h + 29 b + 7 g from the mask's other dims' indices: whole
  // blocks of it forbid or allow everything, and a mask over h differs per head.
  int64_t mask_docs = 0;
  // > 0: segment ids (query_segments, kv_segments) of documents of
  // irregular lengths around this many positions (document d has
  // n / 2 + (37 d + s) mod n positions, s = 29 b + 13 h from the indices of
  // segments_over's dims), over the query's time dim and the kv dim; in
  // self-attention one [.., time] tensor serves as both sides.
  int64_t segment_docs = 0;
  std::string segments_over = "b";  // letters of "bh": the dims the ids vary over besides positions
  // Relative positions (pos_emb): set, a unit-normal table (seed + 5) over
  // feat, the dims of these letters of "bhg" ("": one table for every head)
  // and a relative-position dim of seq_q + seq_k - 1 rows; a decoding step
  // (kind step) reads it over the kv dim itself (no shift). With
  // rel_pos_biases, pos_bias_u and pos_bias_v over [heads, feat] (seeds + 6, + 7).
  std::optional<std::string> rel_pos;
  bool rel_pos_biases = false;

  bool any() const {
    return scalars.any() || alibi || sinks || !bias.empty() || !mask.empty() || segment_docs > 0 || rel_pos;
  }
  // Whether the call needs the query's positional dim (a step's table has no shift).
  bool positional(Kind kind) const { return scalars.positional() || alibi || (rel_pos && kind != Kind::step); }
  std::string describe() const;  // " window=[4,-] bias=htk", "" for none
};

struct AttentionCase {
  std::string name;     // for test names and reports; may be empty
  std::string backend;  // "": the default backend
  Device device = kCPU;
  DType dtype = DType::float32;
  Kind kind = Kind::cross;
  int64_t batch = 2, heads = 2;  // heads: kv heads
  // Query rows per kv head from a dim only the query has: GQA query heads
  // ("group"), or beam hypotheses ("beam"). 1: no such dim.
  int64_t groups = 1;
  std::string group_name = "group";
  // Entries of a dim only keys and values have ("extra", after heads), which
  // the query broadcasts over and the output keeps. 1: no such dim.
  int64_t keys_only = 1;
  Layout layout = Layout::separate;
  int64_t seq_q = 5, seq_k = 7;
  int64_t head_dim = 8, head_dim_v = 8;
  bool causal = false;
  std::vector<int64_t> lengths;  // kv lengths per batch entry; empty: a static kv dim
  // The dims the kv lengths vary over, letters of "bhgte": b batch (always
  // among them), h heads, g the group dim, t the query's time dim (kind
  // cross), e the keys-only dim. "b": `lengths` as they are. With more
  // letters, entry b's lengths are lengths[b] - (s·x + b) mod (lengths[b] + 1),
  // x the flat index over the other letters' dims (row-major, in the order
  // given) and s the first of 3, 5, 7, ... coprime to lengths[b] + 1: per
  // query row ("bt"), per beam ("bg"), per kv head ("bh", "be"), in a
  // scrambled order, each length of [0, lengths[b]] (0 among them) appearing
  // once there are enough rows.
  std::string lengths_over = "b";
  // Causal offset (a chunk appended to a history): one value is a rank-0
  // offset, else one per batch entry; empty: none.
  std::vector<int64_t> offsets;
  double dropout = 0;  // acts where the run's train flag is on
  bool broadcast_dropout = false;
  std::optional<double> scale;  // default 1/sqrt(head_dim)
  uint64_t seed = 1;            // q, k, v from seed, seed + 1, seed + 2
  CaseVariants variants;

  // The scale dot_attention applies.
  double softmax_scale() const;
  // |q·k·scale| of unit-normal q, k: softmax_scale() · sqrt(head_dim) (1
  // with the default scale; extreme-logit cases make it ~1e4).
  double logit_scale() const;
  // Whether the kv lengths vary over the query's own dims (g, t): each query
  // row its own kv length.
  bool per_row_lengths() const {
    return !lengths.empty() && lengths_over.find_first_of("gt") != std::string::npos;
  }
  // Query rows attending each kv row: groups x query positions.
  int64_t query_rows() const { return groups * (kind == Kind::step ? 1 : seq_q); }
  // Forward FLOPs, 4·B·extra·H·rows·Tk·D, halved for causal (DESIGN.md §9).
  double flops() const;
  std::string describe() const;  // one line, for reports
};

// Why the sizes and flags do not make one call, or nullopt when they do.
std::optional<std::string> invalid_reason(const AttentionCase& c);

struct Operands {
  Tensor q, k, v;
  AttentionOptions opts;
  Dims out_order;  // the output's dims in a fixed order, for comparisons
  // Layout::packed_qkv: the [batch, time, qkv, heads, feat] buffer q, k and v
  // are views of (packed_parts), so that a copy or a new leaf keeps them packed.
  std::optional<Tensor> buffer;
};

// q, k and v as views of a packed [batch, time, qkv (3), heads, feat] buffer.
struct PackedParts {
  Tensor q, k, v;
};
PackedParts packed_parts(const Tensor& buffer);

// Unit-normal q, k, v of [batch, heads, (group), (time), feat] and
// [batch, heads, (extra), kv, feat|vfeat] on the case's backend and device; with
// requires_grad on backends with autograd.
Operands make_operands(const AttentionCase& c, bool requires_grad = false);

// An upstream gradient over ops.out_order (seed: the case's + 98), 0 on
// padded query rows, which carry no meaning (docs/numerics.md).
Tensor upstream_gradient(const AttentionCase& c, const Operands& ops);

// A unit-normal tensor of any dtype: integer dtypes are drawn as float32
// and cast (random_normal draws floats only).
Tensor random_operand(const Dims& dims, uint64_t seed, DType dtype, const std::string& backend,
                      Device device = kCPU);

// Why `kernel` cannot run these operands (its gate's reason), or nullopt when
// it can. "reference" always can.
std::optional<std::string> rejection(const Operands& ops, const std::string& kernel);

// dot_attention with kernels forced to `spec` ("auto", "reference", a kernel name).
Tensor run_forced(const Operands& ops, const std::string& spec);

// Largest |a - b| after bringing both to `order`; NaN anywhere, or a
// different number of elements, gives +inf.
double max_abs_diff(const Tensor& a, const Tensor& b, const Dims& order);
double max_abs(const Tensor& a);  // over finite values; 0 for none

// Same set of dims, any order.
bool same_dims(const Dims& a, const Dims& b);

}  // namespace dimattn::testing
