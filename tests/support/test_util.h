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
#include "dimattn/testing/cases.h"

namespace dimattn::testing {

// The one tolerance rule for a fused kernel against the reference path:
// reference_tolerance (dimattn/tolerance.h, docs/numerics.md), max abs error
// at unit-normal inputs, for outputs; gradients get twice that.
// Where values are large the rule is relative to their scale (DESIGN.md §6):
// tol · max(1, max |want|).
inline double gradient_tolerance(DType d) { return 2 * reference_tolerance(d); }
inline double tolerance_at_scale(double tol, const Tensor& want) { return tol * std::max(1.0, max_abs(want)); }

// Test-name suffix for a backend parameter.
inline std::string backend_param_name(const ::testing::TestParamInfo<std::string>& info) { return info.param; }

// max_abs_diff, max_abs, same_dims: dimattn/testing/cases.h (the case library).

inline bool any_nan(const Tensor& t) {
  for (double v : to_host(t))
    if (std::isnan(v)) return true;
  return false;
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
