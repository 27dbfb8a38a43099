#pragma once
// Helpers shared by the test suites.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "dimattn/error.h"
#include "dimattn/tolerance.h"
#include "dimattn/ops.h"
#include "dimattn/ext/backend.h"
#include "dimattn/registry.h"

namespace dimattn::testing {

// The one tolerance rule for a fused kernel against the reference path:
// reference_tolerance (dimattn/tolerance.h, docs/numerics.md), max abs error
// at unit-normal inputs, for outputs; gradients get twice that.
// Where values are large the rule is relative to their scale (DESIGN.md §6):
// tol · max(1, max |want|).
inline double gradient_tolerance(DType d) { return 2 * reference_tolerance(d); }
inline double tolerance_at_scale(double tol, const Tensor& want) {
  double m = 1;
  for (double x : to_host(want, want.dims()))
    if (std::isfinite(x)) m = std::max(m, std::abs(x));
  return tol * m;
}

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

// Runs f, expects a dimattn::Error whose message starts with "[op]" (any
// message when op is empty) and contains every string of `parts`.
template <class F>
void expect_error(F&& f, const std::string& op, std::initializer_list<std::string> parts) {
  const std::string want = op.empty() ? std::string("a dimattn::Error") : "a dimattn::Error starting with [" + op + "]";
  try {
    f();
    ADD_FAILURE() << "expected " << want;
  } catch (const Error& e) {
    const std::string msg = e.what();
    if (!op.empty())
      EXPECT_EQ(msg.rfind("[" + op + "]", 0), 0u) << "message does not start with [" << op << "]: " << msg;
    for (const std::string& p : parts) EXPECT_NE(msg.find(p), std::string::npos) << "missing '" << p << "' in: " << msg;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected " << want << ", got another exception: " << e.what();
  }
}

// The same without a check of the op prefix (raw Backend calls have none).
template <class F>
void expect_error(F&& f, std::initializer_list<std::string> parts) {
  expect_error(std::forward<F>(f), "", parts);
}

}  // namespace dimattn::testing
