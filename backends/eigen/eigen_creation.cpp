// Creation primitives of the Eigen backend: full and seeded random tensors.
#include <algorithm>
#include <cmath>
#include <random>
#include <type_traits>
#include <vector>

#include "eigen_ops.h"
#include "eigen_strided.h"

namespace dimattn::eigen {

RawPtr full_impl(const Shape& shape, double value, DType dtype) {
  auto out = empty_raw(dtype, shape);
  visit_dtype(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    std::fill_n(out->data<T>(), out->numel(), convert<T>(value));
  });
  return out;
}

namespace {

// Uniform in [0, 1) with 53 random bits.
inline double unit_uniform(std::mt19937_64& gen) { return static_cast<double>(gen() >> 11) * 0x1.0p-53; }

}  // namespace

RawPtr random_impl(const Shape& shape, RandomKind kind, double a, double b, uint64_t seed, DType dtype) {
  const char* kOp = "eigen.random";
  if (kind == RandomKind::normal)
    DIMATTN_CHECK(b >= 0, kOp, "normal needs stddev >= 0, got ", b);
  else
    DIMATTN_CHECK(a <= b, kOp, "uniform needs low <= high, got [", a, ", ", b, ")");
  auto out = empty_raw(dtype, shape);
  const int64_t n = out->numel();
  // Drawn as doubles, then converted: the same seed gives the same values
  // for every dtype, up to rounding.
  std::vector<double> v(static_cast<size_t>(n));
  std::mt19937_64 gen(seed);
  if (kind == RandomKind::normal) {
    // Box-Muller by hand: std::normal_distribution differs between standard libraries.
    constexpr double kTwoPi = 6.283185307179586476925286766559;
    for (int64_t i = 0; i < n; i += 2) {
      const double u1 = 1.0 - unit_uniform(gen);  // (0, 1]: log(u1) is finite
      const double u2 = unit_uniform(gen);
      const double r = std::sqrt(-2.0 * std::log(u1));
      v[i] = a + b * r * std::cos(kTwoPi * u2);
      if (i + 1 < n) v[i + 1] = a + b * r * std::sin(kTwoPi * u2);
    }
  } else {
    for (int64_t i = 0; i < n; ++i) v[i] = a + (b - a) * unit_uniform(gen);
  }
  visit_dtype(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    T* o = out->data<T>();
    for (int64_t i = 0; i < n; ++i) {
      double x = v[i];
      if constexpr (std::is_integral_v<T> && !std::is_same_v<T, bool>)
        if (kind == RandomKind::uniform) x = std::floor(x);
      T t = convert<T>(x);
      // Rounding to the dtype may reach the excluded upper bound.
      if (kind == RandomKind::uniform && b > a && convert<double>(t) >= b) t = convert<T>(a);
      o[i] = t;
    }
  });
  return out;
}

}  // namespace dimattn::eigen
