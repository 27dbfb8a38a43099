#include "dimattn/variants.h"

#include <algorithm>
#include <cmath>
#include <sstream>

#include "dimattn/internal/check.h"
#include "dimattn/internal/operand_checks.h"

namespace dimattn {

namespace {

// t with dim `from` named `to` (the same memory).
Tensor relabelled(const Tensor& t, const Dim& from, const Dim& to) {
  Dims dims = t.dims();
  for (Dim& d : dims)
    if (d == from) d = to;
  return Tensor(std::move(dims), t.dtype(), t.device(), t.raw(), &t.backend());
}

}  // namespace

std::string VariantSet::names(bool long_names) const {
  std::string s;
  for_each([&](VariantKind v) {
    if (!s.empty()) s += long_names ? ", " : ",";  // appended piecewise: GCC 12 warns (-Wrestrict) on "," + string
    s += long_names ? variant_names(v).second : variant_names(v).first;
  });
  return s.empty() ? "none" : s;
}

VariantSet AttentionVariants::set() const {
  using V = VariantKind;
  VariantSet s;
  s.set(V::window, window.has_value()).set(V::softcap, softcap.has_value()).set(V::alibi, alibi_slopes.has_value());
  s.set(V::sinks, sinks.has_value() || sink_off_by_one).set(V::sinks_grad, sinks && sinks->requires_grad());
  s.set(V::bias, bias.has_value()).set(V::bias_grad, bias && bias->requires_grad());
  s.set(V::mask, mask.has_value()).set(V::segments, query_segments.has_value() || kv_segments.has_value());
  s.set(V::rel_pos, pos_emb.has_value());
  return s.set(V::rel_pos_grad, (pos_emb && pos_emb->requires_grad()) || (pos_bias_u && pos_bias_u->requires_grad()) ||
                                    (pos_bias_v && pos_bias_v->requires_grad()));
}

std::optional<Tensor>* AttentionVariants::tensor_field(std::string_view name) {
  std::optional<Tensor>* out = nullptr;
  for_each_field(*this, [&](const char* n, auto& field) {
    if constexpr (std::is_same_v<std::remove_cvref_t<decltype(field)>, std::optional<Tensor>>)
      if (name == n) out = &field;
  });
  return out;
}

void AttentionVariants::check_values(const char* op, bool causal) const {
  if (window) {
    const AttentionWindow& w = *window;
    DIMATTN_CHECK(w.left || w.right, op, "window has neither left nor right set; leave window unset for none");
    DIMATTN_CHECK(!w.left || *w.left >= 0, op, "window.left must be >= 0 kv positions, got ", w.left.value_or(0));
    DIMATTN_CHECK(!w.right || *w.right >= 0, op, "window.right must be >= 0 kv positions, got ", w.right.value_or(0));
    DIMATTN_CHECK(!causal || !w.right || *w.right == 0, op, "window.right is ", w.right.value_or(0),
                  " but causal attention sees no kv position right of the diagonal; leave it unset or 0");
  }
  if (softcap)
    DIMATTN_CHECK(std::isfinite(*softcap) && *softcap > 0, op, "softcap must be finite and > 0, got ", *softcap,
                  "; leave it unset for no soft-capping");
  DIMATTN_CHECK(!(sinks && sink_off_by_one), op, "sinks and sink_off_by_one are both set; the off-by-one ",
                "sink is the fixed logit 0, learnable sinks are a tensor: choose one");
  DIMATTN_CHECK(query_segments.has_value() == kv_segments.has_value(), op, query_segments ? "query_segments" : "kv_segments",
                " is set but ", query_segments ? "kv_segments" : "query_segments", " is not: a query row attends the kv ",
                "positions whose segment id equals its own, so both sides need ids; in self-attention pass the ",
                "same [batch, axis] tensor as both, else leave both unset");
  DIMATTN_CHECK(pos_emb || (!pos_bias_u && !pos_bias_v), op, pos_bias_u ? "pos_bias_u" : "pos_bias_v",
                " is set but pos_emb is not: the biases of relative positions add to the query of their terms ",
                "(Transformer-XL's u and v); pass pos_emb, or add the bias to the query yourself");
}

namespace {

// Appends a field's numbers: a scalar by value, a tensor by presence.
void add_numbers(std::vector<double>& out, const std::optional<AttentionWindow>& w) {
  out.push_back(w ? 1 : 0);
  out.push_back(w && w->left ? static_cast<double>(*w->left) : -1);
  out.push_back(w && w->right ? static_cast<double>(*w->right) : -1);
}
void add_numbers(std::vector<double>& out, const std::optional<double>& x) {
  out.push_back(x ? 1 : 0);
  out.push_back(x.value_or(0));
}
void add_numbers(std::vector<double>& out, const std::optional<Tensor>& t) { out.push_back(t ? 1 : 0); }
void add_numbers(std::vector<double>& out, bool on) { out.push_back(on ? 1 : 0); }

}  // namespace

std::vector<double> AttentionVariants::fingerprint() const {
  std::vector<double> out;
  for_each_field(*this, [&](const char*, const auto& field) { add_numbers(out, field); });
  return out;
}

namespace {

std::string side(const std::optional<int64_t>& x) { return x ? std::to_string(*x) : "-"; }

// " name=value" of a field that is on, "" otherwise.
std::string describe_field(const char* name, const std::optional<AttentionWindow>& w) {
  return w ? std::string(" ") + name + "=[" + side(w->left) + "," + side(w->right) + "]" : "";
}
std::string describe_field(const char* name, const std::optional<double>& x) {
  if (!x) return "";
  std::ostringstream os;
  os << ' ' << name << '=' << *x;
  return os.str();
}
std::string describe_field(const char* name, const std::optional<Tensor>& t) {
  return t ? std::string(" ") + name + "=" + repr(t->dims()) : "";
}
std::string describe_field(const char* name, bool on) { return on ? std::string(" ") + name : ""; }

}  // namespace

std::string AttentionVariants::describe() const {
  std::string s;
  for_each_field(*this, [&](const char* name, const auto& field) { s += describe_field(name, field); });
  return s;
}

AttentionVariants checked_variants(const char* op, const AttentionVariants& v, const VariantRoles& r) {
  using detail::same_name_hint;
  v.check_values(op, r.causal);
  const Tensor& query = *r.query;
  DIMATTN_CHECK(r.position || !v.positional(), op, v.window ? "a window" : "ALiBi",
                " measures distance along the query's positional dim: pass query_position_dim (for causal attention, ",
                "causal_query_spatial_dim); it is never guessed");
  if (!v.alibi_slopes && !v.sinks && !v.bias && !v.mask && !v.query_segments && !v.pos_emb)
    return v;  // a plain call makes no more vectors than it must

  // Slopes and sinks live on the call's per-(batch, head) dims.
  Dims per_head = *r.batch;
  for (const Dims* more : {r.keys_only, r.query_only})
    for (const Dim& d : *more)
      if (!contains(per_head, d)) per_head.push_back(d);
  auto check_per_head = [&](const Tensor& t, const char* what) {
    detail::common_backend(op, {&query, &t});
    DIMATTN_CHECK(is_floating(t.dtype()), op, what, " must be a floating tensor, got ", t.repr());
    for (const Dim& d : t.dims())
      DIMATTN_CHECK(contains(per_head, d) && (!r.position || d != *r.position), op, what, " ", repr(t.dims()),
                    " has dim ", d.repr(), " which is not a batch dim of the call ", repr(*r.batch),
                    " (nor a keys-only or query group dim); ", what, " vary over heads and batch dims only");
  };
  if (v.alibi_slopes) check_per_head(*v.alibi_slopes, "alibi_slopes");
  if (v.sinks) check_per_head(*v.sinks, "sinks");

  // Bias and mask: over the call's dims but features; `axis` is the kv
  // position (relabelled with the kv side in self-attention).
  AttentionVariants out = v;
  auto check_scores = [&](std::optional<Tensor>& t, const char* what) {
    detail::common_backend(op, {&query, &*t});
    for (const Dim& d : t->dims())
      DIMATTN_CHECK(d == r.axis || contains(per_head, d), op, what, " ", repr(t->dims()), " has dim ", d.repr(),
                    ", which is not a dim it may vary over: batch dims ", repr(*r.batch), ", the query's own dims ",
                    repr(*r.query_only), ", keys-only dims ", repr(*r.keys_only), " and axis ", r.axis.repr(),
                    same_name_hint(query, d, "query's"), "; feature dims never carry a ", what);
    if (r.kv_axis != r.axis && t->has(r.axis)) t = relabelled(*t, r.axis, r.kv_axis);
  };
  if (v.bias) {
    DIMATTN_CHECK(is_floating(v.bias->dtype()), op, "bias must be a floating tensor, got ", v.bias->repr(),
                  "; for a boolean mask pass mask");
    check_scores(out.bias, "bias");
  }
  if (v.mask) {
    DIMATTN_CHECK(v.mask->dtype() == DType::boolean, op, "mask must be a bool tensor (true = may attend), got ",
                  v.mask->repr(), "; for an additive float mask pass bias");
    check_scores(out.mask, "mask");
  }
  if (v.query_segments) {
    // Each side over its own dims: the query's (batch dims and its own), the
    // keys' (batch dims, keys-only dims and axis, the kv position).
    auto check_segments = [&](std::optional<Tensor>& t, const char* what, bool kv_side) {
      detail::common_backend(op, {&query, &*t});
      DIMATTN_CHECK(t->dtype() == DType::int32 || t->dtype() == DType::int64, op, what,
                    " must be an int32 or int64 tensor of segment ids, got ", t->repr(),
                    "; for a boolean mask over both positions pass mask");
      for (const Dim& d : t->dims()) {
        const bool ok = contains(*r.batch, d) ||
                        (kv_side ? d == r.axis || contains(*r.keys_only, d) : contains(*r.query_only, d));
        DIMATTN_CHECK(ok, op, what, " ", repr(t->dims()), " has dim ", d.repr(), ", which is not a dim it may vary over: ",
                      "batch dims ", repr(*r.batch), kv_side ? ", keys-only dims " : ", the query's own dims ",
                      kv_side ? repr(*r.keys_only) : repr(*r.query_only), kv_side ? " and axis " : "",
                      kv_side ? r.axis.repr() : "", same_name_hint(query, d, "query's"),
                      kv_side ? "; the query's ids go in query_segments" : "; the kv positions' ids go in kv_segments");
      }
      if (kv_side && r.kv_axis != r.axis && t->has(r.axis)) t = relabelled(*t, r.axis, r.kv_axis);
    };
    check_segments(out.query_segments, "query_segments", false);
    check_segments(out.kv_segments, "kv_segments", true);
  }
  if (v.pos_emb) {
    // The table: key_dim, per-head dims and one dim R of its own.
    const Tensor& t = *v.pos_emb;
    detail::common_backend(op, {&query, &t});
    DIMATTN_CHECK(is_floating(t.dtype()), op, "pos_emb must be a floating tensor, got ", t.repr());
    DIMATTN_CHECK(t.has(r.key_dim), op, "pos_emb ", repr(t.dims()), " lacks key_dim ", r.key_dim.repr(),
                  ": each relative position's row is a vector over key_dim, as the keys' are");
    DIMATTN_CHECK(!t.has(r.axis) || r.kv_axis == r.axis, op, "pos_emb is over axis ", r.axis.repr(),
                  " in self-attention, where axis is both the query and the kv position; give it a relative-position ",
                  "dim of extent 2T - 1");
    Dims own;
    for (const Dim& d : t.dims())
      if (d != r.key_dim && (!contains(per_head, d) || (r.position && d == *r.position))) own.push_back(d);
    DIMATTN_CHECK(own.size() == 1, op, "pos_emb ", repr(t.dims()), " needs exactly one relative-position dim besides ",
                  "key_dim ", r.key_dim.repr(), " and per-head dims ", repr(per_head), ", found ", repr(own),
                  "; its rows are the relative positions (extent Tq + Tk - 1), or the kv axis ", r.axis.repr(),
                  " itself for one query position");
    const Dim& rd = own[0];
    if (rd != r.axis) {
      DIMATTN_CHECK(!query.has(rd) && !(r.position && rd == *r.position), op, "pos_emb's relative-position dim ",
                    rd.repr(), " is a dim of the query ", repr(query.dims()), "; it must be a dim of its own");
      DIMATTN_CHECK(r.position.has_value(), op, "pos_emb indexes its rows by j - i along the query's positional ",
                    "dim: pass query_position_dim (for causal attention, causal_query_spatial_dim); it is never guessed");
      const int64_t want = r.position->extent() + r.kv_axis.extent() - 1;
      DIMATTN_CHECK(rd.extent() == want, op, "pos_emb's relative-position dim ", rd.repr(), " has extent ",
                    rd.extent(), " but the query's positional dim ", r.position->repr(), " and the kv axis ",
                    r.axis.repr(), " need Tq + Tk - 1 = ", want, " rows (row r is the relative position r - (Tq - 1))");
    }
    auto check_bias = [&](const std::optional<Tensor>& b, const char* what) {
      if (!b) return;
      detail::common_backend(op, {&query, &*b});
      DIMATTN_CHECK(is_floating(b->dtype()), op, what, " must be a floating tensor, got ", b->repr());
      for (const Dim& d : b->dims())
        DIMATTN_CHECK(d == r.key_dim || (contains(per_head, d) && (!r.position || d != *r.position)), op, what, " ",
                      repr(b->dims()), " has dim ", d.repr(), "; it varies over key_dim ", r.key_dim.repr(),
                      " and per-head dims ", repr(per_head), " only (it is added to every query row)");
    };
    check_bias(v.pos_bias_u, "pos_bias_u");
    check_bias(v.pos_bias_v, "pos_bias_v");
  }
  return out;
}

std::optional<RelPosForm> rel_pos_form(const AttentionVariants& v, const VariantRoles& r) {
  if (!v.pos_emb) return std::nullopt;
  for (const Dim& d : v.pos_emb->dims()) {
    if (d == r.key_dim) continue;
    if (d == r.kv_axis) return RelPosForm{d, 0, 0};
    if (d == r.axis || contains(*r.batch, d) || contains(*r.keys_only, d) || contains(*r.query_only, d)) continue;
    return RelPosForm{d, r.position->extent() - 1, 1};
  }
  detail::fail("dot_attention", "internal error: pos_emb ", repr(v.pos_emb->dims()), " has no relative-position dim");
}

}  // namespace dimattn
