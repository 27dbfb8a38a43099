// dot_attention: names -> roles, the call to the backend's hook, roles -> names.
#include "dimattn/attention.h"

#include <cmath>

#include "dimattn/ext/backend.h"
#include "dimattn/forcing.h"
#include "dimattn/run_context.h"
#include "dimattn/trace.h"
#include "dimattn/internal/check.h"
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

// When `x` lacks `d` but has another dim of the same name: Dims made
// separately never compare equal, which the bare "not in" message hides
// (both sides print as feat[4]). Empty otherwise.
std::string same_name_hint(const Tensor& x, const Dim& d, const char* which) {
  for (const Dim& e : x.dims())
    if (e != d && e.name() == d.name())
      return std::string("; ") + which + " " + e.repr() + " is another Dim with the same name: Dims made " +
             "separately never compare equal, so make both tensors with one Dim object";
  return "";
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
  if (o.axis.is_dynamic())
    for (const Dim& d : o.axis.lengths().dims()) {
      DIMATTN_CHECK(keys.has(d), kOp, "the lengths of axis ", o.axis.repr(), " vary over ", d.repr(),
                    ", which keys ", repr(keys.dims()), " lack; give keys that dim or use a static axis");
      // Else the mask would vary over the reduced dim: the reference path
      // failed deep inside [align], the fused paths would mask per feature.
      DIMATTN_CHECK(d != o.key_dim, kOp, "the lengths of axis ", o.axis.repr(), " vary over key_dim ", d.repr(),
                    "; lengths may vary over batch dims only");
    }
  DIMATTN_CHECK(o.att_dropout >= 0 && o.att_dropout < 1, kOp, "att_dropout must be in [0, 1), got ", o.att_dropout);
  if (o.scale)
    DIMATTN_CHECK(std::isfinite(*o.scale), kOp, "scale must be finite, got ", *o.scale,
                  "; leave it unset for 1/sqrt(extent(key_dim))");
}

}  // namespace

Prepared detail::prepare(const Tensor& query, const Tensor& keys, const Tensor& values, const AttentionOptions& o,
                         std::optional<uint64_t> dropout_seed) {
  validate(query, keys, values, o);
  DIMATTN_CHECK(!o.context_parallel, kOp, "context_parallel is taken by dot_attention alone; explain_attention, the ",
                "blocks and dot_attention_backward run on one process (leave it unset)");
  Tensor q = query, k = keys, v = values;

  // Rule 5: axis in the query means self-attention; relabel the kv side.
  Dim kv_axis = o.axis;
  if (query.has(o.axis)) {
    kv_axis = fresh_like(o.axis);
    k = replace_dim(k, o.axis, kv_axis);
    v = replace_dim(v, o.axis, kv_axis);
  }

  // Roles (rule 2): shared dims are batch dims; the query's own dims are its
  // spatial dims; keys/values' own dims are broadcast or value features.
  const Dims all_kv = union_dims(k.dims(), v.dims());
  Dims batch, query_only, value_feature, keys_only;
  for (const Dim& d : q.dims()) {
    if (d == o.key_dim) continue;
    (contains(all_kv, d) ? batch : query_only).push_back(d);
  }
  for (const Dim& d : v.dims())
    if (d == o.key_dim || (d != kv_axis && !k.has(d) && !q.has(d))) value_feature.push_back(d);
  for (const Dim& d : all_kv)
    if (d != kv_axis && d != o.key_dim && !q.has(d) && !contains(value_feature, d)) keys_only.push_back(d);
  // Without one, the result silently loses the feature axis (a weighted sum
  // of scalars), which is almost always a values tensor with dims mixed up.
  DIMATTN_CHECK(!value_feature.empty(), kOp, "values ", repr(values.dims()), " have no feature dim: every dim but axis ",
                o.axis.repr(), " is also in query or keys; give values a feature dim (expand_dim(values, Dim(\"v\", 1)) ",
                "for scalar values)");

  // Rule 6: causal.
  const bool causal = o.causal_query_spatial_dim.has_value();
  if (causal) {
    const Dim& cq = *o.causal_query_spatial_dim;
    DIMATTN_CHECK(q.has(cq), kOp, "causal_query_spatial_dim ", cq.repr(), " is not in query ", repr(query.dims()));
    DIMATTN_CHECK(contains(query_only, cq), kOp, "causal_query_spatial_dim ", cq.repr(), " is shared with keys/values ",
                  repr(all_kv), "; for causal self-attention pass axis = causal_query_spatial_dim");
    if (o.causal_offset) {
      const Tensor& off = *o.causal_offset;
      common_backend(kOp, {&query, &off});
      DIMATTN_CHECK(off.dtype() == DType::int32 || off.dtype() == DType::int64, kOp, "causal_offset must be int32 or int64, got ",
                    off.repr());
      DIMATTN_CHECK(without(off.dims(), batch).empty(), kOp, "causal_offset dims ", repr(off.dims()),
                    " must be batch dims of the call ", repr(batch));
    } else if (!o.positions) {
      DIMATTN_CHECK(cq.extent() == kv_axis.extent(), kOp, "causal attention without causal_offset needs equal query and kv ",
                    "extents; query ", cq.repr(), " vs kv ", o.axis.repr(),
                    ". For a chunk appended to a history pass causal_offset = history length");
    }
  } else if (o.causal_offset) {
    DIMATTN_CHECK(o.query_position_dim.has_value(), kOp,
                  "causal_offset is set but neither causal_query_spatial_dim nor query_position_dim is: the offset ",
                  "shifts the diagonal of causal masks, windows and ALiBi");
    const Tensor& off = *o.causal_offset;
    common_backend(kOp, {&query, &off});
    DIMATTN_CHECK(off.dtype() == DType::int32 || off.dtype() == DType::int64, kOp,
                  "causal_offset must be int32 or int64, got ", off.repr());
    DIMATTN_CHECK(without(off.dims(), batch).empty(), kOp, "causal_offset dims ", repr(off.dims()),
                  " must be batch dims of the call ", repr(batch));
  }

  // Variants: windows and ALiBi measure distance along the query's
  // positional dim, which the caller names (causal: the causal dim).
  std::optional<Dim> position = o.causal_query_spatial_dim;
  if (o.query_position_dim) {
    const Dim& pd = *o.query_position_dim;
    DIMATTN_CHECK(!causal || pd == *o.causal_query_spatial_dim, kOp, "query_position_dim ", pd.repr(),
                  " differs from causal_query_spatial_dim ", o.causal_query_spatial_dim->repr(),
                  "; for causal attention they are one dim (leave query_position_dim unset)");
    DIMATTN_CHECK(contains(query_only, pd), kOp, "query_position_dim ", pd.repr(), " must be a dim of the query ",
                  repr(query.dims()), " that keys/values lack", same_name_hint(query, pd, "query's"),
                  "; for self-attention pass axis");
    position = pd;
  }
  DIMATTN_CHECK(position || (!o.window && !o.alibi_slopes), kOp, o.window ? "a window" : "ALiBi",
                " measures distance along the query's positional dim: pass query_position_dim (for causal attention, ",
                "causal_query_spatial_dim); it is never guessed");
  // A block of a longer sequence: its positions shift the diagonal (the
  // causal offset gains query - kv) and key the dropout mask.
  std::optional<Tensor> causal_offset = o.causal_offset;
  if (o.positions) {
    const AttentionPositions& ps = *o.positions;
    DIMATTN_CHECK(position.has_value(), kOp, "positions (query ", ps.query, ", kv ", ps.kv,
                  ") place the query's positional dim in a longer sequence, but the call names none: pass ",
                  "causal_query_spatial_dim or query_position_dim");
    DIMATTN_CHECK(ps.query >= 0 && ps.kv >= 0, kOp, "positions must be >= 0, got query ", ps.query, ", kv ", ps.kv);
    if (ps.query != ps.kv) {
      const Tensor delta = scalar(static_cast<double>(ps.query - ps.kv), options_like(query, DType::int64));
      causal_offset = causal_offset ? add(cast(*causal_offset, DType::int64), delta) : delta;
    }
  }
  int64_t window_left = -1, window_right = -1;
  if (o.window) {
    const AttentionWindow& w = *o.window;
    DIMATTN_CHECK(w.left || w.right, kOp, "window has neither left nor right set; leave window unset for none");
    DIMATTN_CHECK(!w.left || *w.left >= 0, kOp, "window.left must be >= 0 kv positions, got ", w.left.value_or(0));
    DIMATTN_CHECK(!w.right || *w.right >= 0, kOp, "window.right must be >= 0 kv positions, got ",
                  w.right.value_or(0));
    DIMATTN_CHECK(!causal || !w.right || *w.right == 0, kOp, "window.right is ", w.right.value_or(0),
                  " but causal attention sees no kv position right of the diagonal; leave it unset or 0");
    window_left = w.left.value_or(-1);
    window_right = w.right.value_or(-1);
  }
  if (o.softcap)
    DIMATTN_CHECK(std::isfinite(*o.softcap) && *o.softcap > 0, kOp, "softcap must be finite and > 0, got ",
                  *o.softcap, "; leave it unset for no soft-capping");
  // Slopes and sinks live on the call's per-(batch, head) dims.
  Dims per_head;  // only for the options that need it (a plain call makes no more vectors than it must)
  if (o.alibi_slopes || o.sinks || o.bias || o.mask) per_head = union_dims(batch, union_dims(keys_only, query_only));
  auto check_per_head = [&](const Tensor& t, const char* what) {
    common_backend(kOp, {&query, &t});
    DIMATTN_CHECK(is_floating(t.dtype()), kOp, what, " must be a floating tensor, got ", t.repr());
    for (const Dim& d : t.dims())
      DIMATTN_CHECK(contains(per_head, d) && (!position || d != *position), kOp, what, " ", repr(t.dims()),
                    " has dim ", d.repr(), " which is not a batch dim of the call ", repr(batch),
                    " (nor a keys-only or query group dim); ", what, " vary over heads and batch dims only");
  };
  if (o.alibi_slopes) check_per_head(*o.alibi_slopes, "alibi_slopes");
  if (o.sinks) check_per_head(*o.sinks, "sinks");
  // Bias and mask: over the call's dims but features; `axis` is the kv
  // position (relabelled with the kv side in self-attention).
  auto check_scores = [&](const Tensor& t, const char* what) {
    common_backend(kOp, {&query, &t});
    for (const Dim& d : t.dims())
      DIMATTN_CHECK(d == o.axis || contains(per_head, d), kOp, what, " ", repr(t.dims()), " has dim ",
                    d.repr(), ", which is not a dim it may vary over: batch dims ", repr(batch), ", the query's own ",
                    "dims ", repr(query_only), ", keys-only dims ", repr(keys_only), " and axis ", o.axis.repr(),
                    same_name_hint(query, d, "query's"), "; feature dims never carry a ", what);
    return query.has(o.axis) && t.has(o.axis) ? replace_dim(t, o.axis, kv_axis) : t;
  };
  std::optional<Tensor> bias, mask;
  if (o.bias) {
    DIMATTN_CHECK(is_floating(o.bias->dtype()), kOp, "bias must be a floating tensor, got ", o.bias->repr(),
                  "; for a boolean mask pass mask");
    bias = check_scores(*o.bias, "bias");
  }
  if (o.mask) {
    DIMATTN_CHECK(o.mask->dtype() == DType::boolean, kOp, "mask must be a bool tensor (true = may attend), got ",
                  o.mask->repr(), "; for an additive float mask pass bias");
    mask = check_scores(*o.mask, "mask");
  }
  DIMATTN_CHECK(!(o.sinks && o.sink_off_by_one), kOp, "sinks and sink_off_by_one are both set; the off-by-one ",
                "sink is the fixed logit 0, learnable sinks are a tensor: choose one");

  // Rules 3 and 4: the query's own dims are its spatial dim (the causal dim,
  // else the longest) and groups; none means one decoding step, given a
  // size-1 dim. Keys and values are never tiled over any of them.
  const bool dummy = query_only.empty();
  // Without causal the choice does not change the result; the longest dim
  // (innermost on ties) gives kernels long rows and short groups.
  auto longest = [&] {
    Dim best = query_only.back();
    for (const Dim& d : query_only)
      if (d.extent() > best.extent()) best = d;
    return best;
  };
  Dim query_spatial = dummy ? Dim("query_step", 1) : position ? *position : longest();
  if (dummy) q = expand_dim(q, query_spatial);
  Dims query_groups = without(query_only, {query_spatial});

  const bool dropout_on = train_flag() && o.att_dropout > 0;
  // Moved, not copied: each Tensor and Dims copy is an allocation, per call.
  AttentionCall call{.query = std::move(q),
                     .keys = std::move(k),
                     .values = std::move(v),
                     .batch = std::move(batch),
                     .keys_only = std::move(keys_only),
                     .query_groups = std::move(query_groups),
                     .query_spatial = query_spatial,
                     .kv_spatial = kv_axis,
                     .key_dim = o.key_dim,
                     .value_feature = std::move(value_feature),
                     .scale = o.scale.value_or(1.0 / std::sqrt(static_cast<double>(o.key_dim.extent()))),
                     .causal = causal,
                     .causal_offset = causal_offset,
                     .dropout = dropout_on ? o.att_dropout : 0.0,
                     .dropout_broadcast = o.att_dropout_broadcast,
                     .dropout_seed = !dropout_on ? 0 : dropout_seed ? *dropout_seed : next_random_seed(),
                     .dropout_offset = 0,
                     .dropout_q_position = o.positions ? o.positions->query : 0,
                     .dropout_kv_position = o.positions ? o.positions->kv : 0,
                     .window_left = window_left,
                     .window_right = window_right,
                     .softcap = o.softcap.value_or(0.0),
                     .alibi_slopes = o.alibi_slopes,
                     .sinks = o.sink_off_by_one ? std::optional<Tensor>(scalar(0.0, options_like(query))) : o.sinks,
                     .bias = std::move(bias),
                     .mask = std::move(mask)};

  return {std::move(call), dummy};
}

Decision explain_attention(const Tensor& query, const Tensor& keys, const Tensor& values,
                           const AttentionOptions& opts) {
  const AttentionCall call = prepare(query, keys, values, opts).call;
  return query.backend().decide_attention(call);
}

Tensor dot_attention(const Tensor& query, const Tensor& keys, const Tensor& values, const AttentionOptions& o) {
  if (o.context_parallel) return context_parallel_attention(query, keys, values, o);
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
    query.backend().plan_attention(call);
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
  const AttentionPlanPtr plan = be.plan_attention(call);
  const std::string& kernel = plan->decision.kernel;
  Tensor out = restore(kernel == kReferenceKernel ? reference_attention(call).output : be.run_attention(call, *plan));
  if (TraceScope::active())
    TraceScope::record({kernel, out, std::nullopt, std::nullopt, q.shape(), k.shape(), v.shape(), plan->decision.isa});
  return out;
}

}  // namespace dimattn
