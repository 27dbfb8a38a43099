#pragma once
// Helpers shared by the test suites.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "dimattn/error.h"
#include "dimattn/ops.h"
#include "dimattn/registry.h"

namespace dimattn::testing {

// Test-name suffix for a backend parameter.
inline std::string backend_param_name(const ::testing::TestParamInfo<std::string>& info) { return info.param; }

// Largest |a - b| after bringing both to `order`; NaN anywhere gives +inf.
inline double max_abs_diff(const Tensor& a, const Tensor& b, const Dims& order) {
  std::vector<double> x = to_host(a, order), y = to_host(b, order);
  EXPECT_EQ(x.size(), y.size());
  double m = 0;
  for (size_t i = 0; i < std::min(x.size(), y.size()); ++i) {
    if (std::isnan(x[i]) || std::isnan(y[i])) return INFINITY;
    m = std::max(m, std::abs(x[i] - y[i]));
  }
  return m;
}

inline bool any_nan(const Tensor& t) {
  for (double v : to_host(t))
    if (std::isnan(v)) return true;
  return false;
}

// Same set of dims, any order.
inline bool same_dims(const Dims& a, const Dims& b) {
  if (a.size() != b.size()) return false;
  for (const Dim& d : a)
    if (!contains(b, d)) return false;
  return true;
}

// The message of the dimattn::Error that f throws ("" if none is thrown).
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const dimattn::Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace dimattn::testing
