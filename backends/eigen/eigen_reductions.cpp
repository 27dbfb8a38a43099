// Reductions (sum, max, min, mean, logsumexp over any set of axes) and
// softmax of the Eigen backend, computed in float32 for 16-bit floats.
#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include "eigen_ops.h"
#include "eigen_strided.h"

namespace dimattn::eigen {
namespace {

template <class C>
C row_sum(const C* p, int64_t n) {
  if constexpr (std::is_floating_point_v<C>) {
    return n == 0 ? C(0) : Eigen::Map<const RowArray<C>>(p, n).sum();
  } else {
    wrap_t<C> s = 0;
    for (int64_t i = 0; i < n; ++i) s += static_cast<wrap_t<C>>(p[i]);
    return static_cast<C>(s);
  }
}

// An empty row's max is the identity of max (-inf, or the lowest integer).
template <class C>
C row_max(const C* p, int64_t n) {
  if constexpr (std::is_floating_point_v<C>) {
    if (n == 0) return -std::numeric_limits<C>::infinity();
    return Eigen::Map<const RowArray<C>>(p, n).template maxCoeff<Eigen::PropagateNaN>();
  } else {
    C m = std::numeric_limits<C>::lowest();
    for (int64_t i = 0; i < n; ++i) m = std::max(m, p[i]);
    return m;
  }
}

template <class C>
C row_min(const C* p, int64_t n) {
  if constexpr (std::is_floating_point_v<C>) {
    if (n == 0) return std::numeric_limits<C>::infinity();
    return Eigen::Map<const RowArray<C>>(p, n).template minCoeff<Eigen::PropagateNaN>();
  } else {
    C m = std::numeric_limits<C>::max();
    for (int64_t i = 0; i < n; ++i) m = std::min(m, p[i]);
    return m;
  }
}

// Stable: subtracts the max. An all -inf (or empty) row gives -inf, not NaN.
template <class C>
C row_logsumexp(const C* p, int64_t n) {
  const C m = row_max(p, n);
  if (!std::isfinite(m)) return m;
  return m + std::log((Eigen::Map<const RowArray<C>>(p, n) - m).exp().sum());
}

std::vector<int> checked_axes(const std::vector<int>& axes, const EigenRaw& x, const char* op) {
  std::vector<int> out;
  for (int a : axes) out.push_back(normalize_axis(a, x.rank(), op, x.shape));
  std::sort(out.begin(), out.end());
  DIMATTN_CHECK(std::adjacent_find(out.begin(), out.end()) == out.end(), op, "axes repeat an axis, for shape ",
        shape_str(x.shape));
  return out;
}

// Identity of the reduction (the value of an empty reduction) for max/min.
template <class C>
C lowest_value() {
  if constexpr (std::is_floating_point_v<C>) return -std::numeric_limits<C>::infinity();
  else return std::numeric_limits<C>::lowest();
}
template <class C>
C highest_value() {
  if constexpr (std::is_floating_point_v<C>) return std::numeric_limits<C>::infinity();
  else return std::numeric_limits<C>::max();
}

// Reduction by accumulating into the output (numpy's way): x is walked in
// its own order with the accumulator's stride 0 on reduced axes. Chosen when
// the innermost axis is kept, so that the inner loop runs over contiguous
// accumulators and no transposing copy of x is needed.
template <class T, class C, class F>
std::unique_ptr<C[]> reduce_accumulate(const EigenRaw& x, const std::vector<int>& axes, C init, F f) {
  std::vector<int64_t> acc_strides(x.rank(), 0);
  int64_t s = 1;
  for (int d = x.rank() - 1; d >= 0; --d)
    if (!std::binary_search(axes.begin(), axes.end(), d)) {
      acc_strides[d] = s;
      s *= x.shape[d];
    }
  auto acc = std::make_unique<C[]>(static_cast<size_t>(s));  // not vector: vector<bool> has no data()
  std::fill_n(acc.get(), s, init);
  const T* px = x.data<T>();
  C* pa = acc.get();
  for_each_run<2>(x.shape, {&x.strides, &acc_strides}, [&](auto off, int64_t n, auto step) {
    const T* v = px + off[0];
    C* a = pa + off[1];
    if (step[0] == 1 && step[1] == 1) {
      for (int64_t i = 0; i < n; ++i) a[i] = f(a[i], convert<C>(v[i]));
    } else {
      for (int64_t i = 0; i < n; ++i) a[i * step[1]] = f(a[i * step[1]], convert<C>(v[i * step[0]]));
    }
  });
  return acc;
}

}  // namespace

RawPtr reduce_impl(ReduceOp op, const EigenRaw& x, const std::vector<int>& axes_in) {
  const char* kOp = "eigen.reduce";
  const std::vector<int> axes = checked_axes(axes_in, x, kOp);
  const bool needs_float = op == ReduceOp::mean || op == ReduceOp::logsumexp;
  DIMATTN_CHECK(!needs_float || is_floating(x.dtype), kOp, op_name(op), " of ", dtype_name(x.dtype), " ",
        shape_str(x.shape), " is not supported; cast to a floating dtype first");
  DIMATTN_CHECK(x.dtype != DType::boolean || op == ReduceOp::max || op == ReduceOp::min, kOp, op_name(op), " of bool ",
        shape_str(x.shape), " is not supported; cast to an integer dtype first (max/min are any/all)");

  auto reduced = [&](int d) { return std::binary_search(axes.begin(), axes.end(), d); };
  std::vector<int> perm;  // kept axes first, reduced axes last
  Shape out_shape;
  for (int d = 0; d < x.rank(); ++d)
    if (!reduced(d)) {
      perm.push_back(d);
      out_shape.push_back(x.shape[d]);
    }
  int64_t inner = 1;
  for (int d : axes) {
    perm.push_back(d);
    inner *= x.shape[d];
  }
  const int64_t outer = numel_of(out_shape);
  auto out = empty_raw(x.dtype, out_shape);
  if (outer == 0) return out;

  int innermost = x.rank() - 1;  // the innermost axis that is iterated at all
  while (innermost >= 0 && x.shape[innermost] == 1) --innermost;
  const bool accumulate = op != ReduceOp::logsumexp && inner > 0 && innermost >= 0 && !reduced(innermost);

  visit_dtype(x.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    using C = compute_t<T>;
    T* o = out->data<T>();
    if (accumulate) {
      std::unique_ptr<C[]> acc;
      if (op == ReduceOp::max)
        acc = reduce_accumulate<T>(x, axes, lowest_value<C>(), scalar_binary<BinaryOp::maximum, C>);
      else if (op == ReduceOp::min)
        acc = reduce_accumulate<T>(x, axes, highest_value<C>(), scalar_binary<BinaryOp::minimum, C>);
      else if constexpr (!std::is_same_v<C, bool>)
        acc = reduce_accumulate<T>(x, axes, C(0), scalar_binary<BinaryOp::add, C>);
      const C scale = op == ReduceOp::mean ? C(inner) : C(1);
      for (int64_t i = 0; i < outer; ++i) o[i] = convert<T>(op == ReduceOp::mean ? C(acc[i] / scale) : acc[i]);
      return;
    }
    // Each output element reduces one dense row of the permuted x. C is
    // never a 16-bit float, so for those DenseAs<C> holds a float32 copy.
    const DenseAs<C> rows(permuted(x, perm));
    auto each_row = [&](auto&& f) {
      for (int64_t i = 0; i < outer; ++i) o[i] = convert<T>(f(rows.data() + i * inner, inner));
    };
    switch (op) {
      case ReduceOp::sum:
        if constexpr (!std::is_same_v<C, bool>) each_row([](const C* p, int64_t n) { return row_sum(p, n); });
        break;
      case ReduceOp::max: each_row([](const C* p, int64_t n) { return row_max(p, n); }); break;
      case ReduceOp::min: each_row([](const C* p, int64_t n) { return row_min(p, n); }); break;
      case ReduceOp::mean:
        if constexpr (std::is_floating_point_v<C>)
          each_row([](const C* p, int64_t n) {
            return n == 0 ? std::numeric_limits<C>::quiet_NaN() : row_sum(p, n) / C(n);
          });
        break;
      case ReduceOp::logsumexp:
        if constexpr (std::is_floating_point_v<C>) each_row([](const C* p, int64_t n) { return row_logsumexp(p, n); });
        break;
    }
  });
  return out;
}

RawPtr softmax_impl(const EigenRaw& x, int axis_in, bool log) {
  const char* kOp = "eigen.softmax";
  const int axis = normalize_axis(axis_in, x.rank(), kOp, x.shape);
  DIMATTN_CHECK(is_floating(x.dtype), kOp, (log ? "log_softmax" : "softmax"), " of ", dtype_name(x.dtype), " ",
        shape_str(x.shape), " is not supported; cast to a floating dtype first");

  // Computed with `axis` moved last so that rows are dense; the result is
  // that dense tensor viewed back in x's axis order.
  std::vector<int> perm;
  for (int d = 0; d < x.rank(); ++d)
    if (d != axis) perm.push_back(d);
  perm.push_back(axis);
  const EigenRaw xp = permuted(x, perm);
  auto out = empty_raw(x.dtype, xp.shape);
  const int64_t n = x.shape[axis];
  const int64_t outer = n == 0 ? 0 : x.numel() / n;

  visit_dtype(x.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    using C = compute_t<T>;
    if constexpr (std::is_floating_point_v<C>) {
      // In place on y; an all -inf row gives NaN (-inf - -inf), which the
      // frontend masks.
      auto softmax_row = [log](Eigen::Map<RowArray<C>> y) {
        const C m = y.template maxCoeff<Eigen::PropagateNaN>();
        if (log) {
          y -= m;
          y -= std::log(y.exp().sum());
        } else {
          y = (y - m).exp();
          y /= y.sum();
        }
      };
      // Rows of S (x's own dense memory, or a float copy), computed in the
      // output when that is float32/64, else in a row buffer and rounded.
      auto run = [&](const auto* src) {
        using S = std::remove_cv_t<std::remove_pointer_t<decltype(src)>>;
        T* dst = out->data<T>();
        RowArray<C> row(std::is_same_v<T, C> ? 0 : n);
        for (int64_t i = 0; i < outer; ++i) {
          Eigen::Map<const RowArray<S>> in(src + i * n, n);
          if constexpr (std::is_same_v<T, C>) {
            Eigen::Map<RowArray<C>> y(dst + i * n, n);
            y = in.template cast<C>();
            softmax_row(y);
          } else {
            Eigen::Map<RowArray<C>> y(row.data(), n);
            y = in.template cast<C>();
            softmax_row(y);
            Eigen::Map<RowArray<T>>(dst + i * n, n) = y.template cast<T>();
          }
        }
      };
      if (xp.is_contiguous()) {
        run(xp.data<T>());
      } else {
        const DenseAs<C> dense_rows(xp);
        run(dense_rows.data());
      }
    }
  });
  EigenRaw result = permuted(*out, inverse_permutation(perm));
  return std::make_shared<EigenRaw>(std::move(result));
}

}  // namespace dimattn::eigen
