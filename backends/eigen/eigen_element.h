#pragma once
// Element types of the Eigen backend: the storage type of each dtype, the
// type arithmetic runs in, conversions between them, and the scalar binary
// ops that elementwise ops and reductions share.
#include <Eigen/Core>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "dimattn/dtype.h"
#include "dimattn/internal/check.h"
#include "dimattn/ext/backend.h"

namespace dimattn::eigen {

template <class T>
struct Tag {
  using type = T;
};

// The one dtype switch: calls f(Tag<T>{}) with T the storage type of d.
template <class F>
decltype(auto) visit_dtype(DType d, F&& f) {
  switch (d) {
    case DType::float32: return f(Tag<float>{});
    case DType::float64: return f(Tag<double>{});
    case DType::bfloat16: return f(Tag<Eigen::bfloat16>{});
    case DType::float16: return f(Tag<Eigen::half>{});
    case DType::int32: return f(Tag<int32_t>{});
    case DType::int64: return f(Tag<int64_t>{});
    case DType::boolean: return f(Tag<bool>{});
  }
  detail::fail("eigen", "unknown dtype value ", static_cast<int>(d));
}

template <class T>
inline constexpr bool is_reduced_v = std::is_same_v<T, Eigen::bfloat16> || std::is_same_v<T, Eigen::half>;

// The type arithmetic runs in: float for the 16-bit floats, else T itself.
template <class T>
using compute_t = std::conditional_t<is_reduced_v<T>, float, T>;

template <class T>
inline constexpr bool is_float_v = std::is_floating_point_v<compute_t<T>>;

// double -> float rounding to odd. Rounding that result to a 16-bit float
// then gives the correctly rounded value (plain double -> float -> 16-bit
// would round twice and can be off by one ulp on ties).
inline float round_to_odd_float(double v) {
  float f = static_cast<float>(v);
  if (std::isfinite(f) && static_cast<double>(f) != v) {
    auto bits = std::bit_cast<uint32_t>(f);
    if (std::fabs(static_cast<double>(f)) > std::fabs(v)) bits -= 1;  // back toward zero
    f = std::bit_cast<float>(bits | 1u);
  }
  return f;
}

// Value conversion between storage types: float -> int truncates toward
// zero, anything -> bool is != 0, 16-bit floats round to nearest even.
template <class D, class S>
inline D convert(S v) {
  if constexpr (std::is_same_v<D, S>) {
    return v;
  } else if constexpr (is_reduced_v<S>) {
    return convert<D>(static_cast<float>(v));
  } else if constexpr (std::is_same_v<D, bool>) {
    return v != S(0);
  } else if constexpr (std::is_integral_v<D> && std::is_floating_point_v<S>) {
    // Saturating, NaN -> 0: a plain cast of an out-of-range value (e.g. a
    // -inf mask) would be undefined behaviour.
    constexpr S lo = static_cast<S>(std::numeric_limits<D>::lowest());
    constexpr S hi = static_cast<S>(std::numeric_limits<D>::max());
    if (!(v == v)) return D(0);
    if (v <= lo) return std::numeric_limits<D>::lowest();
    if (v >= hi) return std::numeric_limits<D>::max();
    return static_cast<D>(v);
  } else if constexpr (is_reduced_v<D>) {
    if constexpr (std::is_same_v<S, float>)
      return D(v);
    else
      return D(round_to_odd_float(static_cast<double>(v)));
  } else {
    return static_cast<D>(v);
  }
}

// A dense run of C as an Eigen array (rows of reductions, softmax, GEMM output).
template <class C>
using RowArray = Eigen::Array<C, Eigen::Dynamic, 1>;

template <class C>
inline bool is_nan(C x) {
  if constexpr (std::is_floating_point_v<C>) return std::isnan(x);
  else return false;
}

// Integer add/sub/mul/neg wrap around (as in torch and numpy) instead of
// overflowing, which would be undefined for signed types.
template <class C>
struct Wrap {
  using type = C;
};
template <class C>
  requires(std::is_integral_v<C> && !std::is_same_v<C, bool>)
struct Wrap<C> {
  using type = std::make_unsigned_t<C>;
};
template <class C>
using wrap_t = typename Wrap<C>::type;

template <BinaryOp Op, class C>
inline auto scalar_binary(C x, C y) {
  using B = BinaryOp;
  using W = wrap_t<C>;
  if constexpr (Op == B::add) return static_cast<C>(static_cast<W>(x) + static_cast<W>(y));
  else if constexpr (Op == B::sub) return static_cast<C>(static_cast<W>(x) - static_cast<W>(y));
  else if constexpr (Op == B::mul) return static_cast<C>(static_cast<W>(x) * static_cast<W>(y));
  else if constexpr (Op == B::div) return static_cast<C>(x / y);
  // NaN propagates through maximum and minimum, as in numpy and torch.
  else if constexpr (Op == B::maximum) return (is_nan(x) || x > y) ? x : y;
  else if constexpr (Op == B::minimum) return (is_nan(x) || x < y) ? x : y;
  else if constexpr (Op == B::eq) return x == y;
  else if constexpr (Op == B::ne) return x != y;
  else if constexpr (Op == B::lt) return x < y;
  else if constexpr (Op == B::le) return x <= y;
  else if constexpr (Op == B::gt) return x > y;
  else if constexpr (Op == B::ge) return x >= y;
  else if constexpr (Op == B::logical_and) return x != C(0) && y != C(0);
  else return x != C(0) || y != C(0);
}

}  // namespace dimattn::eigen
