// dot_attention: names -> roles, the call to the backend's hook, roles -> names.
#include "dimattn/attention.h"

#include <cmath>

#include "dimattn/ext/backend.h"
#include "dimattn/forcing.h"
#include "dimattn/run_context.h"
#include "dimattn/trace.h"
#include "dimattn/internal/check.h"
#include "dimattn/internal/operand_checks.h"
#include "attention_reference.h"
#include "attention_roles.h"
#include "op_util.h"

namespace dimattn {
using namespace detail;

namespace {
constexpr const char* kOp = "dot_attention";

// A new dim like `d` (same extent, same lengths if dynamic) for the kv side of
// self-attention.
Dim fresh_like(const Dim& d) {
  if (d.is_dynamic()) return Dim::dynamic(d.name() + "'", d.lengths(), d.extent());
  return Dim(d.name() + "'", d.extent());
}

void validate(const Tensor& query, const Tensor& keys, const Tensor& values, const AttentionOptions& o) {
  common_backend(kOp, {&query, &keys, &values});
  check_same_dtype(kOp, {&query, &keys, &values});
  DIMATTN_CHECK(is_floating(query.dtype()), kOp, "needs floating query, keys and values; got ", query.repr());
  DIMATTN_CHECK(o.key_dim != o.axis, kOp, "key_dim and axis are the same dim ", o.axis.repr());
  DIMATTN_CHECK(query.has(o.key_dim), kOp, "key_dim ", o.key_dim.repr(), " is not in query ", repr(query.dims()),
                "; pass the query's feature dim as key_dim", same_name_hint(query, o.key_dim, "query's"));
  DIMATTN_CHECK(keys.has(o.key_dim), kOp, "key_dim ", o.key_dim.repr(), " is not in keys ", repr(keys.dims()),
                "; query and keys must share key_dim", same_name_hint(keys, o.key_dim, "keys'"));
  DIMATTN_CHECK(!o.key_dim.is_dynamic(), kOp, "key_dim ", o.key_dim.repr(), " must be static");
  DIMATTN_CHECK(o.key_dim.extent() > 0, kOp, "key_dim ", o.key_dim.repr(), " is empty; the default scale 1/sqrt(0) ",
                "is undefined");
  DIMATTN_CHECK(keys.has(o.axis), kOp, "axis ", o.axis.repr(), " is not in keys ", repr(keys.dims()),
                "; pass the keys' spatial dim as axis", same_name_hint(keys, o.axis, "keys'"));
  DIMATTN_CHECK(values.has(o.axis), kOp, "axis ", o.axis.repr(), " is not in values ", repr(values.dims()),
                "; keys and values must share axis", same_name_hint(values, o.axis, "values'"));
  DIMATTN_CHECK(o.att_dropout >= 0 && o.att_dropout < 1, kOp, "att_dropout must be in [0, 1), got ", o.att_dropout);
  if (o.scale)
    DIMATTN_CHECK(std::isfinite(*o.scale), kOp, "scale must be finite, got ", *o.scale,
                  "; leave it unset for 1/sqrt(extent(key_dim))");
}

}  // namespace

namespace {

// Rules 2 and 5: the operands with the kv side relabelled in self-attention
// (axis in the query), and each dim's role: shared dims are batch dims, the
// query's own dims its spatial dims and groups, keys/values' own dims are
// broadcast or value features.
struct Roles {
  Tensor k, v;
  Dim kv_axis;
  Dims batch, query_only, keys_only, value_feature;
};

Roles roles_of(const Tensor& q, const Tensor& keys, const Tensor& values, const AttentionOptions& o) {
  Roles r{keys, values, o.axis, {}, {}, {}, {}};
  if (q.has(o.axis)) {
    r.kv_axis = fresh_like(o.axis);
    r.k = replace_dim(keys, o.axis, r.kv_axis);
    r.v = replace_dim(values, o.axis, r.kv_axis);
  }
  const Dims all_kv = union_dims(r.k.dims(), r.v.dims());
  for (const Dim& d : q.dims()) {
    if (d == o.key_dim) continue;
    (contains(all_kv, d) ? r.batch : r.query_only).push_back(d);
  }
  for (const Dim& d : r.v.dims())
    if (d == o.key_dim || (d != r.kv_axis && !r.k.has(d) && !q.has(d))) r.value_feature.push_back(d);
  for (const Dim& d : all_kv)
    if (d != r.kv_axis && d != o.key_dim && !q.has(d) && !contains(r.value_feature, d)) r.keys_only.push_back(d);
  // Without one, the result silently loses the feature axis (a weighted sum
  // of scalars), which is almost always a values tensor with dims mixed up.
  DIMATTN_CHECK(!r.value_feature.empty(), kOp, "values ", repr(values.dims()), " have no feature dim: every dim but ",
                "axis ", o.axis.repr(), " is also in query or keys; give values a feature dim ",
                "(expand_dim(values, Dim(\"v\", 1)) for scalar values)");
  // The axis's lengths vary over batch dims, the query's own dims (each
  // query row its own kv length) or keys-only dims: dims of the mask, never
  // of a reduced or value feature dim.
  if (o.axis.is_dynamic())
    for (const Dim& d : o.axis.lengths().dims()) {
      // Else the mask would vary over the reduced dim: the reference path
      // failed deep inside [align], the fused paths would mask per feature.
      DIMATTN_CHECK(d != o.key_dim, kOp, "the lengths of axis ", o.axis.repr(), " vary over key_dim ", d.repr(),
                    "; lengths may vary over batch dims, the query's own dims and keys-only dims");
      DIMATTN_CHECK(contains(r.batch, d) || contains(r.query_only, d) || contains(r.keys_only, d), kOp,
                    "the lengths of axis ", o.axis.repr(), " vary over ", d.repr(),
                    ", which is not a dim they may vary over: batch dims ", repr(r.batch), ", keys-only dims ",
                    repr(r.keys_only), " and the query's own dims ", repr(r.query_only),
                    " (each query row its own kv length); give the query or keys that dim, or use a static axis");
    }
  // Any other dim's lengths may not vary over key_dim or a value feature dim
  // either: the products sum over those, so padding that differs along them
  // has no place in the result (and the gradients, summing over the dim,
  // failed in [copy_transpose]: found by fuzz_dot_attention).
  for (const Tensor* t : {&q, &keys, &values})
    for (const Dim& d : t->dims()) {
      if (!d.is_dynamic() || d == o.axis) continue;
      for (const Dim& x : d.lengths().dims()) {
        const bool key = x == o.key_dim;
        DIMATTN_CHECK(!key && !contains(r.value_feature, x), kOp, "the lengths of ", d.repr(), " vary over ",
                      key ? "key_dim " : "value feature dim ", x.repr(),
                      key ? ", which the scores sum over" : ", which the gradients sum over",
                      "; lengths may vary over batch dims, the query's own dims and keys-only dims (pad the dim to a "
                      "static extent, or give it lengths per batch entry)");
      }
    }
  if (o.causal_query_spatial_dim) {
    const Dim& cq = *o.causal_query_spatial_dim;
    DIMATTN_CHECK(q.has(cq), kOp, "causal_query_spatial_dim ", cq.repr(), " is not in query ", repr(q.dims()));
    DIMATTN_CHECK(contains(r.query_only, cq), kOp, "causal_query_spatial_dim ", cq.repr(), " is shared with ",
                  "keys/values ", repr(all_kv), "; for causal self-attention pass axis = causal_query_spatial_dim");
  }
  return r;
}

// Rule 6 and the variants' positions: the query's positional dim (the causal
// dim, else query_position_dim), and the causal offset with a block's place
// in a longer sequence (positions: the offset gains query - kv).
struct Positional {
  std::optional<Dim> position;
  std::optional<Tensor> causal_offset;
};

Positional positional_of(const Tensor& query, const AttentionOptions& o, const Roles& r) {
  const bool causal = o.causal_query_spatial_dim.has_value();
  Positional p{o.causal_query_spatial_dim, o.causal_offset};
  if (o.query_position_dim) {
    const Dim& pd = *o.query_position_dim;
    DIMATTN_CHECK(!causal || pd == *o.causal_query_spatial_dim, kOp, "query_position_dim ", pd.repr(),
                  " differs from causal_query_spatial_dim ", o.causal_query_spatial_dim->repr(),
                  "; for causal attention they are one dim (leave query_position_dim unset)");
    DIMATTN_CHECK(contains(r.query_only, pd), kOp, "query_position_dim ", pd.repr(), " must be a dim of the query ",
                  repr(query.dims()), " that keys/values lack", same_name_hint(query, pd, "query's"),
                  "; for self-attention pass axis");
    p.position = pd;
  }
  if (o.causal_offset) {
    DIMATTN_CHECK(p.position.has_value(), kOp,
                  "causal_offset is set but neither causal_query_spatial_dim nor query_position_dim is: the offset ",
                  "shifts the diagonal of causal masks, windows and ALiBi");
    const Tensor& off = *o.causal_offset;
    common_backend(kOp, {&query, &off});
    DIMATTN_CHECK(off.dtype() == DType::int32 || off.dtype() == DType::int64, kOp,
                  "causal_offset must be int32 or int64, got ", off.repr());
    DIMATTN_CHECK(without(off.dims(), r.batch).empty(), kOp, "causal_offset dims ", repr(off.dims()),
                  " must be batch dims of the call ", repr(r.batch));
  } else if (causal && !o.positions) {
    const Dim& cq = *o.causal_query_spatial_dim;
    DIMATTN_CHECK(cq.extent() == r.kv_axis.extent(), kOp, "causal attention without causal_offset needs equal query ",
                  "and kv extents; query ", cq.repr(), " vs kv ", o.axis.repr(),
                  ". For a chunk appended to a history pass causal_offset = history length");
  }
  if (o.positions) {
    const AttentionPositions& ps = *o.positions;
    DIMATTN_CHECK(p.position.has_value(), kOp, "positions (query ", ps.query, ", kv ", ps.kv,
                  ") place the query's positional dim in a longer sequence, but the call names none: pass ",
                  "causal_query_spatial_dim or query_position_dim");
    DIMATTN_CHECK(ps.query >= 0 && ps.kv >= 0, kOp, "positions must be >= 0, got query ", ps.query, ", kv ", ps.kv);
    if (ps.query != ps.kv) {
      const Tensor delta = scalar(static_cast<double>(ps.query - ps.kv), options_like(query, DType::int64));
      p.causal_offset = p.causal_offset ? add(cast(*p.causal_offset, DType::int64), delta) : delta;
    }
  }
  return p;
}

}  // namespace

Prepared detail::prepare(const Tensor& query, const Tensor& keys, const Tensor& values, const AttentionOptions& o) {
  validate(query, keys, values, o);
  Roles r = roles_of(query, keys, values, o);
  Positional p = positional_of(query, o, r);
  const bool causal = o.causal_query_spatial_dim.has_value();
  const VariantRoles roles{.query = &query, .key_dim = o.key_dim, .batch = &r.batch, .query_only = &r.query_only,
                           .keys_only = &r.keys_only, .axis = o.axis, .kv_axis = r.kv_axis,
                           .position = p.position, .causal = causal};
  AttentionVariants variants = checked_variants(kOp, o.variants, roles);
  std::optional<RelPosForm> rel_pos = rel_pos_form(variants, roles);
  DIMATTN_CHECK(!rel_pos || !o.positions, kOp, "pos_emb with positions (a block of a longer sequence, context ",
                "parallelism) is not supported: the table's rows count from the call's own first query row; run ",
                "the whole sequence in one call");
  if (variants.sink_off_by_one) {  // the kernels and the reference path see one kind of sink
    variants.sinks = scalar(0.0, options_like(query));
    variants.sink_off_by_one = false;
  }

  // Rules 3 and 4: the query's own dims are its spatial dim (the positional
  // dim, else the longest) and groups; none means one decoding step, given a
  // size-1 dim. Keys and values are never tiled over any of them.
  // Without causal the choice does not change the result; the longest dim
  // (innermost on ties) gives kernels long rows and short groups. Not a dim
  // that ALiBi's slopes or the sinks vary over: those are per-head values,
  // so such a dim must stay a group (GQA heads: a decoding step's one query
  // position is shorter than its query groups); where every dim is one, the
  // call is one decoding step over them.
  Dims candidates;
  for (const Dim& d : r.query_only) {
    bool per_head = false;
    for (const std::optional<Tensor>* t : {&variants.alibi_slopes, &variants.sinks})
      per_head = per_head || (*t && (*t)->has(d));
    if (!per_head) candidates.push_back(d);
  }
  const bool dummy = r.query_only.empty() || (!p.position && candidates.empty());
  auto longest = [&] {
    Dim best = candidates.back();
    for (const Dim& d : candidates)
      if (d.extent() > best.extent()) best = d;
    return best;
  };
  const Dim query_spatial = dummy ? Dim("query_step", 1) : p.position ? *p.position : longest();
  Dims query_groups = without(r.query_only, {query_spatial});

  const bool dropout_on = train_flag() && o.att_dropout > 0;
  // Moved, not copied: each Tensor and Dims copy is an allocation, per call.
  AttentionCall call{.query = dummy ? expand_dim(query, query_spatial) : query,
                     .keys = std::move(r.k),
                     .values = std::move(r.v),
                     .batch = std::move(r.batch),
                     .keys_only = std::move(r.keys_only),
                     .query_groups = std::move(query_groups),
                     .query_spatial = query_spatial,
                     .kv_spatial = r.kv_axis,
                     .key_dim = o.key_dim,
                     .value_feature = std::move(r.value_feature),
                     .scale = o.scale.value_or(1.0 / std::sqrt(static_cast<double>(o.key_dim.extent()))),
                     .causal = causal,
                     .causal_offset = std::move(p.causal_offset),
                     .dropout = dropout_on ? o.att_dropout : 0.0,
                     .dropout_broadcast = o.att_dropout_broadcast,
                     .dropout_seed = !dropout_on ? 0 : o.dropout_seed ? *o.dropout_seed : next_random_seed(),
                     .dropout_offset = 0,
                     .dropout_q_position = o.positions ? o.positions->query : 0,
                     .dropout_kv_position = o.positions ? o.positions->kv : 0,
                     .variants = std::move(variants),
                     .rel_pos = std::move(rel_pos)};
  return {std::move(call), dummy};
}

Decision explain_attention(const Tensor& query, const Tensor& keys, const Tensor& values,
                           const AttentionOptions& opts) {
  const AttentionCall call = prepare(query, keys, values, opts).call;
  return query.backend().decide_attention(call);
}

Tensor dot_attention(const Tensor& query, const Tensor& keys, const Tensor& values, const AttentionOptions& o) {
  // Not a structured binding: clang 14 (the fuzz build) cannot capture one in a lambda.
  const Prepared prepared = prepare(query, keys, values, o);
  const AttentionCall& call = prepared.call;
  const bool dummy = prepared.dummy;
  const Tensor &q = call.query, &k = call.keys, &v = call.values;
  auto restore = [&](const Tensor& t) { return dummy ? squeeze(t, call.query_spatial) : t; };

  if (TraceScope::capturing()) {
    const KernelForce force = current_kernel_force();
    DIMATTN_CHECK(force.allows(kReferenceKernel), kOp, "a TraceScope capturing energies needs the reference path, but kernels are ",
                  "forced to '", force.describe(), "'; use TraceScope(false) to trace only kernel names");
    ReferenceAttention ref = reference_attention(call);
    Tensor out = restore(ref.output);
    TraceScope::record({kReferenceKernel, out, restore(ref.energy), restore(ref.att_weights), q.shape(), k.shape(),
                        v.shape()});
    return out;
  }
  if (q.numel() == 0 || k.numel() == 0 || v.numel() == 0) {
    // An empty call (B = 0, T = 0, a zero-size feature or keys-only dim) has
    // a defined result and nothing to compute, but fused kernels divide by
    // these extents (ATen's CPU flash kernel dies of SIGFPE on B = 0 or
    // T = 0). It runs the reference path, which every backend has and which
    // keeps autograd connected; selection still runs first, so that forcing
    // a kernel that cannot take the call fails as it would for any size.
    query.backend().plan_attention(call, KernelUse::run);
    Tensor out = restore(reference_attention(call).output);
    if (TraceScope::active())
      TraceScope::record({kReferenceKernel, out, std::nullopt, std::nullopt, q.shape(), k.shape(), v.shape()});
    return out;
  }
  // dot_attention owns the choice: the backend decides, the reference path
  // runs here, a fused kernel in the backend.
  // The plan is made once per call: what the backend derived to decide is
  // what it runs.
  Backend& be = query.backend();
  const AttentionPlanPtr plan = be.plan_attention(call, KernelUse::run);
  const std::string& kernel = plan->decision.kernel;
  Tensor out = restore(kernel == kReferenceKernel ? reference_attention(call).output : be.run_attention(call, *plan));
  if (TraceScope::active())
    TraceScope::record({kernel, out, std::nullopt, std::nullopt, q.shape(), k.shape(), v.shape(), plan->decision.isa});
  return out;
}

}  // namespace dimattn
