// Elementwise ops, matmul, reductions, softmax and dropout.
#include <cmath>
#include <limits>

#include "dimattn/run_context.h"
#include "dimattn/internal/check.h"
#include "op_util.h"

namespace dimattn {
using namespace detail;

namespace {

Tensor binary(const char* op, BinaryOp kind, const Tensor& a, const Tensor& b, bool boolean_result) {
  Backend& be = common_backend(op, {&a, &b});
  check_same_dtype(op, {&a, &b});
  Dims out = union_dims(a.dims(), b.dims());
  RawPtr r = be.binary(kind, raw_in_order(op, a, out, false), raw_in_order(op, b, out, false));
  return Tensor(out, boolean_result ? DType::boolean : a.dtype(), a.device(), std::move(r), &be);
}

Tensor unary(UnaryOp kind, const Tensor& x) {
  return Tensor(x.dims(), x.dtype(), x.device(), x.backend().unary(kind, x.raw()), &x.backend());
}

void check_floating(const char* op, const Tensor& x) {
  DIMATTN_CHECK(is_floating(x.dtype()), op, "needs a floating tensor, got ", x.repr(), "; cast it first");
}

void check_bool(const char* op, const Tensor& x) {
  DIMATTN_CHECK(x.dtype() == DType::boolean, op, "needs a bool tensor, got ", x.repr());
}

}  // namespace

Tensor add(const Tensor& a, const Tensor& b) { return binary("add", BinaryOp::add, a, b, false); }
Tensor sub(const Tensor& a, const Tensor& b) { return binary("sub", BinaryOp::sub, a, b, false); }
Tensor mul(const Tensor& a, const Tensor& b) { return binary("mul", BinaryOp::mul, a, b, false); }
Tensor div(const Tensor& a, const Tensor& b) {
  // Integer division rounds differently across backends (and can trap on 0).
  DIMATTN_CHECK(is_floating(a.dtype()), "div", "needs floating operands, got ", a.repr(), "; cast to a float dtype first");
  return binary("div", BinaryOp::div, a, b, false);
}
Tensor maximum(const Tensor& a, const Tensor& b) { return binary("maximum", BinaryOp::maximum, a, b, false); }
Tensor minimum(const Tensor& a, const Tensor& b) { return binary("minimum", BinaryOp::minimum, a, b, false); }

Tensor compare(const Tensor& a, Compare op, const Tensor& b) {
  constexpr BinaryOp kinds[] = {BinaryOp::eq, BinaryOp::ne, BinaryOp::lt, BinaryOp::le, BinaryOp::gt, BinaryOp::ge};
  return binary("compare", kinds[static_cast<int>(op)], a, b, true);
}
Tensor logical_and(const Tensor& a, const Tensor& b) {
  check_bool("logical_and", a);
  check_bool("logical_and", b);
  return binary("logical_and", BinaryOp::logical_and, a, b, true);
}
Tensor logical_or(const Tensor& a, const Tensor& b) {
  check_bool("logical_or", a);
  check_bool("logical_or", b);
  return binary("logical_or", BinaryOp::logical_or, a, b, true);
}
Tensor logical_not(const Tensor& x) {
  check_bool("logical_not", x);
  return unary(UnaryOp::logical_not, x);
}

// Bool is rejected here: the backends disagreed (torch's abs passed bool
// through, eigen's refused) and their errors did not name the op.
Tensor neg(const Tensor& x) {
  DIMATTN_CHECK(x.dtype() != DType::boolean, "neg", "needs a numeric tensor, got ", x.repr(), "; use logical_not");
  return unary(UnaryOp::neg, x);
}
Tensor abs(const Tensor& x) {
  DIMATTN_CHECK(x.dtype() != DType::boolean, "abs", "needs a numeric tensor, got ", x.repr(), "; cast it first");
  return unary(UnaryOp::abs, x);
}
Tensor exp(const Tensor& x) {
  check_floating("exp", x);
  return unary(UnaryOp::exp, x);
}
Tensor log(const Tensor& x) {
  check_floating("log", x);
  return unary(UnaryOp::log, x);
}
Tensor sqrt(const Tensor& x) {
  check_floating("sqrt", x);
  return unary(UnaryOp::sqrt, x);
}
Tensor tanh(const Tensor& x) {
  check_floating("tanh", x);
  return unary(UnaryOp::tanh, x);
}

Tensor where(const Tensor& cond, const Tensor& a, const Tensor& b) {
  Backend& be = common_backend("where", {&cond, &a, &b});
  check_bool("where", cond);
  check_same_dtype("where", {&a, &b});
  // The values' dim order first: a mask is usually the smaller operand, and
  // putting its dims first would leave large results in a transposed layout
  // that later contractions (ATen's bmm) handle slowly.
  Dims out = union_dims(union_dims(a.dims(), b.dims()), cond.dims());
  RawPtr r = be.where(raw_in_order("where", cond, out, false), raw_in_order("where", a, out, false),
                      raw_in_order("where", b, out, false));
  return Tensor(out, a.dtype(), a.device(), std::move(r), &be);
}

Tensor add(const Tensor& a, double b) { return add(a, scalar_like(a, b)); }
Tensor mul(const Tensor& a, double b) { return mul(a, scalar_like(a, b)); }
Tensor where(const Tensor& cond, const Tensor& a, double b) { return where(cond, a, scalar_like(a, b)); }
Tensor compare(const Tensor& a, Compare op, double b) { return compare(a, op, scalar_like(a, b)); }

Tensor operator+(const Tensor& a, const Tensor& b) { return add(a, b); }
Tensor operator-(const Tensor& a, const Tensor& b) { return sub(a, b); }
Tensor operator*(const Tensor& a, const Tensor& b) { return mul(a, b); }
Tensor operator/(const Tensor& a, const Tensor& b) { return div(a, b); }
Tensor operator-(const Tensor& x) { return neg(x); }
Tensor operator*(const Tensor& a, double b) { return mul(a, b); }
Tensor operator+(const Tensor& a, double b) { return add(a, b); }

Tensor matmul(const Tensor& a, const Tensor& b, const Dims& reduce) {
  Backend& be = common_backend("matmul", {&a, &b});
  check_same_dtype("matmul", {&a, &b});
  check_floating("matmul", a);
  // A repeated reduce dim used to reach the backend's permute as a bad permutation.
  for (size_t i = 0; i < reduce.size(); ++i)
    for (size_t j = i + 1; j < reduce.size(); ++j)
      DIMATTN_CHECK(reduce[i] != reduce[j], "matmul", "reduce dim ", reduce[i].repr(), " appears twice in ", repr(reduce));
  for (const Dim& d : reduce) {
    DIMATTN_CHECK(a.has(d) && b.has(d), "matmul", "reduce dim ", d.repr(), " must be in both operands; a has ",
          repr(a.dims()), ", b has ", repr(b.dims()));
  }
  Dims common, a_only, b_only;
  for (const Dim& d : a.dims()) {
    if (contains(reduce, d)) continue;
    (b.has(d) ? common : a_only).push_back(d);
  }
  for (const Dim& d : b.dims())
    if (!contains(reduce, d) && !a.has(d)) b_only.push_back(d);
  auto concat3 = [](Dims x, const Dims& y, const Dims& z) {
    x.insert(x.end(), y.begin(), y.end());
    x.insert(x.end(), z.begin(), z.end());
    return x;
  };
  const int64_t nb = product(common), m = product(a_only), k = product(reduce), n = product(b_only);
  RawPtr ra = be.reshape(raw_in_order("matmul", a, concat3(common, a_only, reduce), false), {nb, m, k});
  RawPtr rb = be.reshape(raw_in_order("matmul", b, concat3(common, reduce, b_only), false), {nb, k, n});
  Dims out = concat3(common, a_only, b_only);
  Shape out_shape;
  for (const Dim& d : out) out_shape.push_back(d.extent());
  return Tensor(out, a.dtype(), a.device(), be.reshape(be.bmm(ra, rb), out_shape), &be);
}

namespace {

// The value that leaves a reduction unchanged, used to fill padding.
double neutral(Reduce kind, DType dtype) {
  const bool fp = is_floating(dtype);
  const double inf = std::numeric_limits<double>::infinity();
  const double big = dtype == DType::int32 ? 2147483647.0 : 9.2e18;
  switch (kind) {
    case Reduce::max:
    case Reduce::logsumexp:
      return fp ? -inf : -big;
    case Reduce::min:
      return fp ? inf : big;
    default:
      return 0.0;
  }
}

}  // namespace

Tensor reduce(const Tensor& x, Reduce kind, const Dims& axes) {
  const char* op = "reduce";
  for (const Dim& d : axes) check_has(op, x, d, "reduce axis");
  if (kind == Reduce::mean || kind == Reduce::logsumexp) check_floating(op, x);
  // A bool sum means "any" on some backends and is an error on others.
  DIMATTN_CHECK(x.dtype() != DType::boolean || kind == Reduce::max || kind == Reduce::min, op,
        "cannot sum a bool tensor ", repr(x.dims()), "; cast it to int64 first, or use max/min for any/all");
  Dims dynamic;
  for (const Dim& d : axes)
    if (d.is_dynamic()) dynamic.push_back(d);
  Tensor src = x;
  if (!dynamic.empty()) src = where(sequence_mask(dynamic, options_like(x)), x, neutral(kind, x.dtype()));
  std::vector<int> axis_ids;
  for (int i = 0; i < src.rank(); ++i)
    if (contains(axes, src.dims()[i])) axis_ids.push_back(i);
  constexpr ReduceOp kinds[] = {ReduceOp::sum, ReduceOp::max, ReduceOp::min, ReduceOp::mean, ReduceOp::logsumexp};
  const bool masked_mean = kind == Reduce::mean && !dynamic.empty();
  ReduceOp rop = masked_mean ? ReduceOp::sum : kinds[static_cast<int>(kind)];
  Tensor out(without(src.dims(), axes), x.dtype(), x.device(), x.backend().reduce(rop, src.raw(), axis_ids),
             &x.backend());
  if (!masked_mean) return out;
  // Mean over valid positions: divide by the number of them (at least 1, so
  // an empty entry gives 0 rather than NaN).
  Tensor count = scalar_like(x, 1.0);
  for (const Dim& d : axes)
    count = d.is_dynamic() ? mul(count, cast(to_backend(d.lengths(), x.backend().name()), x.dtype()))
                           : mul(count, static_cast<double>(d.extent()));
  count = to_device(count, x.device());
  return div(out, maximum(count, scalar_like(count, 1.0)));
}

Tensor reduce_sum(const Tensor& x, const Dims& axes) { return reduce(x, Reduce::sum, axes); }
Tensor reduce_max(const Tensor& x, const Dims& axes) { return reduce(x, Reduce::max, axes); }
Tensor reduce_mean(const Tensor& x, const Dims& axes) { return reduce(x, Reduce::mean, axes); }
Tensor reduce_logsumexp(const Tensor& x, const Dims& axes) { return reduce(x, Reduce::logsumexp, axes); }

namespace {

Tensor softmax_impl(const char* op, const Tensor& x, const Dim& axis, bool log) {
  check_has(op, x, axis, "softmax axis");
  check_floating(op, x);
  const double fill = log ? -std::numeric_limits<double>::infinity() : 0.0;
  if (!axis.is_dynamic()) {
    return Tensor(x.dims(), x.dtype(), x.device(), x.backend().softmax(x.raw(), x.axis_of(axis), log), &x.backend());
  }
  Tensor mask = sequence_mask(axis, options_like(x));
  Tensor masked = where(mask, x, -std::numeric_limits<double>::infinity());
  Tensor y(masked.dims(), x.dtype(), x.device(), x.backend().softmax(masked.raw(), masked.axis_of(axis), log),
           &x.backend());
  // Rows without any valid position came out NaN; padding gets `fill`.
  return where(mask, y, fill);
}

}  // namespace

Tensor softmax(const Tensor& x, const Dim& axis) { return softmax_impl("softmax", x, axis, false); }
Tensor log_softmax(const Tensor& x, const Dim& axis) { return softmax_impl("log_softmax", x, axis, true); }

Tensor dropout(const Tensor& x, double p, const Dims& vary_over) {
  DIMATTN_CHECK(p >= 0 && p < 1, "dropout", "probability must be in [0, 1), got ", p, " for ", x.repr());
  for (const Dim& d : vary_over) check_has("dropout", x, d, "vary_over dim");
  check_floating("dropout", x);
  if (!train_flag() || p == 0) return x;
  Tensor u = random_uniform(vary_over, next_random_seed(), options_like(x, DType::float32));
  Tensor keep = compare(u, Compare::ge, p);
  return where(keep, mul(x, 1.0 / (1.0 - p)), 0.0);
}

}  // namespace dimattn
