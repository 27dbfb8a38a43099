#pragma once
// What the named-op tests (tests/core/ops_*_test.cpp) share: value and error
// checks, and the Ops fixture, a TEST_P suite over every registered backend
// (instantiated once, in ops_creation_test.cpp). Every case checks against
// values computed by hand; bad input is checked by message: "[op] ..."
// naming the offending dim with its size.
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <functional>
#include <limits>
#include <memory>
#include <numeric>
#include <optional>
#include <string>
#include <vector>

#include "dimattn/dim.h"
#include "dimattn/error.h"
#include "dimattn/ext/backend.h"
#include "dimattn/ops.h"
#include "dimattn/registry.h"
#include "dimattn/run_context.h"
#include "dimattn/tensor.h"
#include "support/test_util.h"

// Not in an unnamed namespace: every file's TEST_P(Ops, ...) must derive from
// the one fixture type.
namespace dimattn::testing {

inline constexpr double kInf = std::numeric_limits<double>::infinity();
inline constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
using Values = std::vector<double>;

// --- helpers ---------------------------------------------------------------

// Equal up to tol; NaN matches NaN and an infinity only itself.
inline bool close(double got, double want, double tol) {
  if (std::isnan(want)) return std::isnan(got);
  if (std::isinf(want)) return got == want;
  return std::fabs(got - want) <= tol;
}

inline void expect_values(const Values& got, const Values& want, double tol, const std::string& what = "") {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i)
    EXPECT_TRUE(close(got[i], want[i], tol)) << what << " element " << i << ": got " << got[i] << ", want " << want[i];
}

inline bool same_dim_set(const Dims& a, const Dims& b) {
  if (a.size() != b.size()) return false;
  for (const Dim& d : a)
    if (!contains(b, d)) return false;
  return true;
}

// x has exactly the dims of `order` (in any order) and, read in `order`, the
// values `want`.
inline void expect_tensor(const Tensor& x, const Dims& order, const Values& want, double tol = 1e-6) {
  ASSERT_TRUE(same_dim_set(x.dims(), order)) << "dims " << repr(x.dims()) << ", want " << repr(order);
  expect_values(to_host(x, order), want, tol, x.repr());
}

inline std::string param_name(const ::testing::TestParamInfo<std::string>& info) {
  std::string s = info.param;
  for (char& c : s)
    if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
  return s;
}

inline double mean_of(const Values& v) { return std::accumulate(v.begin(), v.end(), 0.0) / static_cast<double>(v.size()); }
inline double std_of(const Values& v) {
  const double m = mean_of(v);
  double s = 0;
  for (double x : v) s += (x - m) * (x - m);
  return std::sqrt(s / static_cast<double>(v.size()));
}

class Ops : public ::testing::TestWithParam<std::string> {
 protected:
  TensorOptions opts(DType dtype = DType::float32) const { return {.dtype = dtype, .backend = GetParam()}; }
  Tensor T(const Dims& dims, const Values& v, DType dtype = DType::float32) const {
    return from_host(dims, v, opts(dtype));
  }
  // A dynamic dim over `batch` with the given lengths (made on this backend).
  Dim dyn(const std::string& name, const Dim& batch, const Values& lengths) const {
    return Dim::dynamic(name, T({batch}, lengths, DType::int64));
  }
  // Another registered backend, or "" when there is only one.
  std::string other_backend() const {
    for (const std::string& n : backend_names())
      if (n != GetParam()) return n;
    return "";
  }
};

}  // namespace dimattn::testing
