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
  return s.set(V::mask, mask.has_value()).set(V::segments, query_segments.has_value() || kv_segments.has_value());
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
  if (!v.alibi_slopes && !v.sinks && !v.bias && !v.mask && !v.query_segments) return v;  // a plain call makes no more vectors than it must

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
  return out;
}

}  // namespace dimattn
