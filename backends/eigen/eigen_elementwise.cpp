// Elementwise primitives of the Eigen backend: binary, unary and where, with
// numpy broadcasting. Float arithmetic runs as Eigen array expressions over
// contiguous runs (packet math); everything else as a plain strided loop.
#include <cmath>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "eigen_ops.h"
#include "eigen_strided.h"

namespace dimattn::eigen {
namespace {

template <class F>
decltype(auto) visit_binary_op(BinaryOp op, F&& f) {
  using B = BinaryOp;
  switch (op) {
#define DIMATTN_CASE(name) \
  case B::name:            \
    return f(std::integral_constant<B, B::name>{});
    DIMATTN_CASE(add)
    DIMATTN_CASE(sub)
    DIMATTN_CASE(mul)
    DIMATTN_CASE(div)
    DIMATTN_CASE(maximum)
    DIMATTN_CASE(minimum)
    DIMATTN_CASE(eq)
    DIMATTN_CASE(ne)
    DIMATTN_CASE(lt)
    DIMATTN_CASE(le)
    DIMATTN_CASE(gt)
    DIMATTN_CASE(ge)
    DIMATTN_CASE(logical_and)
    DIMATTN_CASE(logical_or)
#undef DIMATTN_CASE
  }
  detail::fail("eigen.binary", "unknown op value ", static_cast<int>(op));
}

template <class F>
decltype(auto) visit_unary_op(UnaryOp op, F&& f) {
  using U = UnaryOp;
  switch (op) {
    case U::neg: return f(std::integral_constant<U, U::neg>{});
    case U::exp: return f(std::integral_constant<U, U::exp>{});
    case U::log: return f(std::integral_constant<U, U::log>{});
    case U::sqrt: return f(std::integral_constant<U, U::sqrt>{});
    case U::abs: return f(std::integral_constant<U, U::abs>{});
    case U::logical_not: return f(std::integral_constant<U, U::logical_not>{});
    case U::tanh: return f(std::integral_constant<U, U::tanh>{});
  }
  detail::fail("eigen.unary", "unknown op value ", static_cast<int>(op));
}

constexpr bool returns_bool(BinaryOp op) { return op >= BinaryOp::eq; }
constexpr bool arithmetic(BinaryOp op) {
  return op == BinaryOp::add || op == BinaryOp::sub || op == BinaryOp::mul || op == BinaryOp::div;
}

// Operand of an Eigen expression over a run of n elements: the run itself
// (step 1) or its single, broadcast element (step 0).
template <class T, class K>
void with_run_operand(const T* p, int64_t step, int64_t n, K&& k) {
  using C = compute_t<T>;
  if (step == 1)
    k(Eigen::Map<const Eigen::Array<T, Eigen::Dynamic, 1>>(p, n).template cast<C>());
  else
    k(Eigen::Array<C, Eigen::Dynamic, 1>::Constant(n, convert<C>(*p)));
}

template <BinaryOp Op, class T>
void binary_kernel(const EigenRaw& a, const EigenRaw& b, EigenRaw& out) {
  using C = compute_t<T>;
  using O = std::conditional_t<returns_bool(Op), bool, T>;
  const auto sa = broadcast_strides(a, out.shape), sb = broadcast_strides(b, out.shape);
  const T* pa = a.data<T>();
  const T* pb = b.data<T>();
  O* po = out.data<O>();
  for_each_run<3>(out.shape, {&sa, &sb, &out.strides}, [&](auto off, int64_t n, auto step) {
    const T* x = pa + off[0];
    const T* y = pb + off[1];
    O* o = po + off[2];
    if constexpr (is_float_v<T> && arithmetic(Op)) {
      // One Eigen expression per run, so that Eigen's packet math applies.
      if (step[2] == 1 && (step[0] == 0 || step[0] == 1) && (step[1] == 0 || step[1] == 1)) {
        Eigen::Map<Eigen::Array<T, Eigen::Dynamic, 1>> dst(o, n);
        with_run_operand(x, step[0], n, [&](const auto& vx) {
          with_run_operand(y, step[1], n, [&](const auto& vy) {
            if constexpr (Op == BinaryOp::add) dst = (vx + vy).template cast<T>();
            else if constexpr (Op == BinaryOp::sub) dst = (vx - vy).template cast<T>();
            else if constexpr (Op == BinaryOp::mul) dst = (vx * vy).template cast<T>();
            else dst = (vx / vy).template cast<T>();
          });
        });
        return;
      }
    }
    if (step[0] == 1 && step[1] == 1 && step[2] == 1) {
      for (int64_t i = 0; i < n; ++i) o[i] = convert<O>(scalar_binary<Op>(convert<C>(x[i]), convert<C>(y[i])));
    } else {
      for (int64_t i = 0; i < n; ++i)
        o[i * step[2]] = convert<O>(scalar_binary<Op>(convert<C>(x[i * step[0]]), convert<C>(y[i * step[1]])));
    }
  });
}

// The numpy broadcast of equal-rank shapes; `what` names the operands in the error.
Shape broadcast_shape(const std::vector<const Shape*>& shapes, const char* op, const std::string& what) {
  const Shape& first = *shapes.front();
  auto all_shapes = [&] {
    std::string s;
    for (size_t i = 0; i < shapes.size(); ++i) s += (i ? " and " : "") + shape_string(*shapes[i]);
    return s;
  };
  for (const Shape* s : shapes)
    if (s->size() != first.size())
      detail::fail(op, what, ": operands must have equal rank, got shapes ", all_shapes(),
                   "; add size-1 axes (reshape) to broadcast");
  Shape out(first.size());
  for (size_t d = 0; d < first.size(); ++d) {
    int64_t size = 1;
    for (const Shape* s : shapes) {
      const int64_t e = (*s)[d];
      if (e == 1) continue;
      if (size != 1 && size != e)
        detail::fail(op, what, ": cannot broadcast shapes ", all_shapes(), " (axis ", d, " has sizes ", size, " and ",
                     e, ")");
      size = e;
    }
    out[d] = size;
  }
  return out;
}

}  // namespace

RawPtr binary_impl(BinaryOp op, const EigenRaw& a, const EigenRaw& b) {
  const char* kOp = "eigen.binary";
  check_same_dtype(a, b, kOp, op_name(op));
  const Shape shape = broadcast_shape({&a.shape, &b.shape}, kOp, op_name(op));
  const bool floating = is_floating(a.dtype);
  DIMATTN_CHECK(floating || op != BinaryOp::div, kOp, "div on ", dtype_name(a.dtype), " operands ", shape_str(a.shape),
        " and ", shape_str(b.shape), " is not supported; cast them to a floating dtype first");
  DIMATTN_CHECK(a.dtype != DType::boolean || op != BinaryOp::sub, kOp,
        "sub on bool operands is not supported; use logical ops, or cast to an integer dtype first");
  auto out = empty_raw(returns_bool(op) ? DType::boolean : a.dtype, shape);
  visit_dtype(a.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    visit_binary_op(op, [&](auto op_tag) { binary_kernel<decltype(op_tag)::value, T>(a, b, *out); });
  });
  return out;
}

namespace {

template <UnaryOp Op, class C>
inline auto scalar_unary(C x) {
  using U = UnaryOp;
  if constexpr (Op == U::logical_not) return x == C(0);
  else if constexpr (std::is_same_v<C, bool>) return x;  // excluded before dispatch
  else if constexpr (Op == U::neg) return static_cast<C>(-static_cast<wrap_t<C>>(x));
  else if constexpr (Op == U::abs && !std::is_floating_point_v<C>)
    return static_cast<C>(x < C(0) ? -static_cast<wrap_t<C>>(x) : x);
  else if constexpr (!std::is_floating_point_v<C>) return x;  // excluded before dispatch
  else if constexpr (Op == U::abs) return std::abs(x);
  else if constexpr (Op == U::exp) return std::exp(x);
  else if constexpr (Op == U::log) return std::log(x);
  else if constexpr (Op == U::tanh) return std::tanh(x);
  else return std::sqrt(x);
}

template <UnaryOp Op, class T>
void unary_kernel(const EigenRaw& x, EigenRaw& out) {
  using C = compute_t<T>;
  using O = std::conditional_t<Op == UnaryOp::logical_not, bool, T>;
  const T* px = x.data<T>();
  O* po = out.data<O>();
  for_each_run<2>(x.shape, {&x.strides, &out.strides}, [&](auto off, int64_t n, auto step) {
    const T* s = px + off[0];
    O* o = po + off[1];
    if constexpr (is_float_v<T> && Op != UnaryOp::logical_not) {
      // Eigen vectorizes exp/log/sqrt; std:: calls in a loop would not be.
      if (step[0] == 1 && step[1] == 1) {
        Eigen::Map<Eigen::Array<T, Eigen::Dynamic, 1>> dst(o, n);
        auto v = Eigen::Map<const Eigen::Array<T, Eigen::Dynamic, 1>>(s, n).template cast<C>();
        if constexpr (Op == UnaryOp::neg) dst = (-v).template cast<T>();
        // Eigen's vectorized exp clamps its argument, so exp(-inf) would be
        // ~2e-39 instead of 0 (a masked weight that is not 0): results below
        // the smallest normal number are 0, as std::exp gives for -inf.
        else if constexpr (Op == UnaryOp::exp)
          dst = (v < std::log(std::numeric_limits<C>::min())).select(C(0), v.exp()).template cast<T>();
        else if constexpr (Op == UnaryOp::log) dst = v.log().template cast<T>();
        else if constexpr (Op == UnaryOp::sqrt) dst = v.sqrt().template cast<T>();
        else if constexpr (Op == UnaryOp::tanh) dst = v.tanh().template cast<T>();
        else dst = v.abs().template cast<T>();
        return;
      }
    }
    for (int64_t i = 0; i < n; ++i) o[i * step[1]] = convert<O>(scalar_unary<Op>(convert<C>(s[i * step[0]])));
  });
}

}  // namespace

RawPtr unary_impl(UnaryOp op, const EigenRaw& x) {
  const char* kOp = "eigen.unary";
  const bool transcendental =
      op == UnaryOp::exp || op == UnaryOp::log || op == UnaryOp::sqrt || op == UnaryOp::tanh;
  DIMATTN_CHECK(!transcendental || is_floating(x.dtype), kOp, op_name(op), " of ", dtype_name(x.dtype), " ",
        shape_str(x.shape), " is not supported; cast to a floating dtype first");
  DIMATTN_CHECK(x.dtype != DType::boolean || op == UnaryOp::logical_not, kOp, op_name(op), " of bool ", shape_str(x.shape),
        " is not supported; use logical_not, or cast to an integer dtype first");
  auto out = empty_raw(op == UnaryOp::logical_not ? DType::boolean : x.dtype, x.shape);
  visit_dtype(x.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    visit_unary_op(op, [&](auto op_tag) { unary_kernel<decltype(op_tag)::value, T>(x, *out); });
  });
  return out;
}

RawPtr where_impl(const EigenRaw& cond, const EigenRaw& a, const EigenRaw& b) {
  const char* kOp = "eigen.where";
  DIMATTN_CHECK(cond.dtype == DType::boolean, kOp, "cond must be bool, got ", dtype_name(cond.dtype), " ",
        shape_str(cond.shape), "; compare it (ne 0) first");
  check_same_dtype(a, b, kOp, "where");
  const Shape shape = broadcast_shape({&cond.shape, &a.shape, &b.shape}, kOp, "cond, a, b");
  auto out = empty_raw(a.dtype, shape);
  const auto sc = broadcast_strides(cond, shape), sa = broadcast_strides(a, shape), sb = broadcast_strides(b, shape);
  visit_dtype(a.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const bool* pc = cond.data<bool>();
    const T* pa = a.data<T>();
    const T* pb = b.data<T>();
    T* po = out->data<T>();
    for_each_run<4>(shape, {&sc, &sa, &sb, &out->strides}, [&](auto off, int64_t n, auto step) {
      for (int64_t i = 0; i < n; ++i)
        po[off[3] + i * step[3]] = pc[off[0] + i * step[0]] ? pa[off[1] + i * step[1]] : pb[off[2] + i * step[2]];
    });
  });
  return out;
}

}  // namespace dimattn::eigen
