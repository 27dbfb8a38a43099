// The cross-backend op harness. Every case is written once and runs on every
// registered backend (TEST_P over backend_names()), checked against values
// computed by hand; the CrossBackend tests run the same ops on random inputs
// on every backend and compare the backends with each other. Bad input is
// checked by message: "[op] ..." naming the offending dim with its size.
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
#include "dimattn/ops.h"
#include "dimattn/registry.h"
#include "dimattn/run_context.h"
#include "dimattn/tensor.h"

namespace dimattn {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
using Values = std::vector<double>;

// --- helpers ---------------------------------------------------------------

// Runs f, expects a dimattn::Error whose message starts with "[op]" and
// contains every string of `parts`.
template <class F>
void expect_error(F&& f, const std::string& op, std::initializer_list<std::string> parts) {
  try {
    f();
    ADD_FAILURE() << "expected a dimattn::Error starting with [" << op << "]";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_EQ(msg.rfind("[" + op + "]", 0), 0u) << "message does not start with [" << op << "]: " << msg;
    for (const std::string& p : parts)
      EXPECT_NE(msg.find(p), std::string::npos) << "missing '" << p << "' in: " << msg;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected a dimattn::Error starting with [" << op << "], got another exception: " << e.what();
  }
}

// Equal up to tol; NaN matches NaN and an infinity only itself.
bool close(double got, double want, double tol) {
  if (std::isnan(want)) return std::isnan(got);
  if (std::isinf(want)) return got == want;
  return std::fabs(got - want) <= tol;
}

void expect_values(const Values& got, const Values& want, double tol, const std::string& what = "") {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i)
    EXPECT_TRUE(close(got[i], want[i], tol)) << what << " element " << i << ": got " << got[i] << ", want " << want[i];
}

bool same_dim_set(const Dims& a, const Dims& b) {
  if (a.size() != b.size()) return false;
  for (const Dim& d : a)
    if (!contains(b, d)) return false;
  return true;
}

// x has exactly the dims of `order` (in any order) and, read in `order`, the
// values `want`.
void expect_tensor(const Tensor& x, const Dims& order, const Values& want, double tol = 1e-6) {
  ASSERT_TRUE(same_dim_set(x.dims(), order)) << "dims " << repr(x.dims()) << ", want " << repr(order);
  expect_values(to_host(x, order), want, tol, x.repr());
}

std::string param_name(const ::testing::TestParamInfo<std::string>& info) {
  std::string s = info.param;
  for (char& c : s)
    if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
  return s;
}

double mean_of(const Values& v) { return std::accumulate(v.begin(), v.end(), 0.0) / static_cast<double>(v.size()); }
double std_of(const Values& v) {
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

INSTANTIATE_TEST_SUITE_P(AllBackends, Ops, ::testing::ValuesIn(backend_names()), param_name);

// --- construction and transfer ---------------------------------------------

TEST(Registry, HasABackend) {
  ASSERT_FALSE(backend_names().empty());
  for (const std::string& n : backend_names()) {
    EXPECT_TRUE(has_backend(n));
    EXPECT_EQ(get_backend(n).name(), n);
  }
  EXPECT_FALSE(has_backend("no_such_backend"));
  expect_error([] { get_backend("no_such_backend"); }, "get_backend", {"no_such_backend", backend_names().front()});
}

TEST_P(Ops, ZerosFullScalar) {
  Dim a("a", 2), b("b", 3);
  Tensor z = zeros({a, b}, opts());
  EXPECT_EQ(z.dims(), (Dims{a, b}));
  EXPECT_EQ(z.dtype(), DType::float32);
  EXPECT_EQ(z.device(), kCPU);
  EXPECT_EQ(z.backend().name(), GetParam());
  EXPECT_EQ(z.shape(), (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(z.numel(), 6);
  expect_tensor(z, {a, b}, Values(6, 0.0));
  expect_tensor(full({a}, 2.5, opts(DType::float64)), {a}, {2.5, 2.5});
  Tensor fi = full({b}, 7, opts(DType::int32));
  EXPECT_EQ(fi.dtype(), DType::int32);
  expect_tensor(fi, {b}, {7, 7, 7});
  expect_tensor(full({b}, 1, opts(DType::boolean)), {b}, {1, 1, 1});
  expect_tensor(full({a}, -1.5, opts(DType::bfloat16)), {a}, {-1.5, -1.5});
  Tensor s = scalar(3.25, opts());
  EXPECT_EQ(s.rank(), 0);
  EXPECT_EQ(s.numel(), 1);
  EXPECT_EQ(item(s), 3.25);
  Dim empty("empty", 0);
  Tensor e = zeros({empty, a}, opts());
  EXPECT_EQ(e.numel(), 0);
  EXPECT_TRUE(to_host(e).empty());
}

TEST_P(Ops, FromHostToHostRoundTrip) {
  Dim a("a", 2), b("b", 3);
  const Values v = {1, -2, 3, 4, 5, -6};
  for (DType dt : {DType::float32, DType::float64, DType::bfloat16, DType::float16, DType::int32, DType::int64}) {
    Tensor x = T({a, b}, v, dt);
    EXPECT_EQ(x.dtype(), dt);
    expect_values(to_host(x), v, 0, dtype_name(dt));
  }
  Tensor p = T({a, b}, {1, 0, 1, 0, 0, 1}, DType::boolean);
  EXPECT_EQ(to_host(p), (Values{1, 0, 1, 0, 0, 1}));
  // Non-integers through float32 keep float32 precision.
  expect_values(to_host(T({a}, {0.1, 1e-3})), {0.1, 1e-3}, 1e-8);
  expect_values(to_host(T({a}, {0.1, 1e-3}, DType::float64)), {0.1, 1e-3}, 0);
}

TEST_P(Ops, ToHostWithDimOrder) {
  Dim a("a", 2), b("b", 3);
  Tensor x = T({a, b}, {0, 1, 2, 3, 4, 5});
  EXPECT_EQ(to_host(x, Dims{a, b}), (Values{0, 1, 2, 3, 4, 5}));
  EXPECT_EQ(to_host(x, Dims{b, a}), (Values{0, 3, 1, 4, 2, 5}));
  Dim c("c", 2);
  Values v(12);
  std::iota(v.begin(), v.end(), 0.0);
  Tensor y = T({a, b, c}, v);
  // (c, a, b) holds x[a][b][c] = a*6 + b*2 + c.
  Values want;
  for (int ci = 0; ci < 2; ++ci)
    for (int ai = 0; ai < 2; ++ai)
      for (int bi = 0; bi < 3; ++bi) want.push_back(ai * 6 + bi * 2 + ci);
  EXPECT_EQ(to_host(y, Dims{c, a, b}), want);
}

TEST_P(Ops, ItemOfScalar) {
  EXPECT_EQ(item(scalar(-4, opts(DType::int64))), -4);
  Dim a("a", 1);
  EXPECT_EQ(item(reduce_sum(T({a}, {2.5}), {a})), 2.5);
}

TEST_P(Ops, RandomNormalIsDeterministicWithRoughMoments) {
  Dim n("n", 20000);
  Tensor x = random_normal({n}, 42, opts());
  EXPECT_EQ(x.dtype(), DType::float32);
  EXPECT_EQ(x.backend().name(), GetParam());
  const Values v = to_host(x);
  EXPECT_EQ(to_host(random_normal({n}, 42, opts())), v);
  EXPECT_NE(to_host(random_normal({n}, 43, opts())), v);
  EXPECT_NEAR(mean_of(v), 0.0, 0.05);
  EXPECT_NEAR(std_of(v), 1.0, 0.05);
  for (double e : v) EXPECT_TRUE(std::isfinite(e));
  const Values w = to_host(random_normal({n}, 7, opts(DType::float64), 3.0, 2.0));
  EXPECT_NEAR(mean_of(w), 3.0, 0.1);
  EXPECT_NEAR(std_of(w), 2.0, 0.1);
  // Two dims: same count of values, still deterministic.
  Dim a("a", 4), b("b", 5);
  EXPECT_EQ(to_host(random_normal({a, b}, 1, opts())), to_host(random_normal({a, b}, 1, opts())));
}

TEST_P(Ops, RandomUniformRangeAndDeterminism) {
  Dim n("n", 20000);
  const Values v = to_host(random_uniform({n}, 5, opts(), -1.0, 3.0));
  EXPECT_EQ(to_host(random_uniform({n}, 5, opts(), -1.0, 3.0)), v);
  EXPECT_NE(to_host(random_uniform({n}, 6, opts(), -1.0, 3.0)), v);
  for (double e : v) {
    EXPECT_GE(e, -1.0);
    EXPECT_LT(e, 3.0);
  }
  EXPECT_NEAR(mean_of(v), 1.0, 0.05);
  EXPECT_NEAR(std_of(v), 4.0 / std::sqrt(12.0), 0.05);
  const Values u = to_host(random_uniform({n}, 9, opts()));
  EXPECT_NEAR(mean_of(u), 0.5, 0.02);
  for (double e : u) {
    EXPECT_GE(e, 0.0);
    EXPECT_LT(e, 1.0);
  }
  // Rounding to bfloat16 must not reach the excluded upper bound.
  for (double e : to_host(random_uniform({n}, 11, opts(DType::bfloat16), 0.0, 1.0))) {
    EXPECT_GE(e, 0.0);
    EXPECT_LT(e, 1.0);
  }
}

TEST_P(Ops, CastFloatToIntTruncatesTowardZero) {
  Dim a("a", 6);
  Tensor x = T({a}, {1.7, -1.7, 2.5, -0.5, 3.0, 0.2});
  for (DType dt : {DType::int32, DType::int64}) {
    Tensor y = cast(x, dt);
    EXPECT_EQ(y.dtype(), dt);
    EXPECT_EQ(y.dims(), x.dims());
    EXPECT_EQ(to_host(y), (Values{1, -1, 2, 0, 3, 0}));
  }
  Tensor i = T({a}, {1, -2, 3, 4, 5, 6}, DType::int64);
  Tensor f = cast(i, DType::float64);
  EXPECT_EQ(f.dtype(), DType::float64);
  EXPECT_EQ(to_host(f), (Values{1, -2, 3, 4, 5, 6}));
  EXPECT_EQ(to_host(cast(i, DType::int32)), (Values{1, -2, 3, 4, 5, 6}));
  // Casting to the same dtype keeps the values.
  EXPECT_EQ(cast(x, DType::float32).dtype(), DType::float32);
}

TEST_P(Ops, CastToAndFromBool) {
  Dim a("a", 5);
  Tensor x = T({a}, {0, 0.5, -2, 0, 1e-30});
  Tensor p = cast(x, DType::boolean);
  EXPECT_EQ(p.dtype(), DType::boolean);
  EXPECT_EQ(to_host(p), (Values{0, 1, 1, 0, 1}));
  EXPECT_EQ(to_host(cast(T({a}, {0, 3, -1, 0, 0}, DType::int64), DType::boolean)), (Values{0, 1, 1, 0, 0}));
  EXPECT_EQ(to_host(cast(p, DType::float32)), (Values{0, 1, 1, 0, 1}));
  EXPECT_EQ(to_host(cast(p, DType::int64)), (Values{0, 1, 1, 0, 1}));
}

TEST_P(Ops, CastToBfloat16RoundsToNearestEven) {
  Dim a("a", 8);
  // All exact in float32; bfloat16 keeps 8 significant bits.
  const Values in = {1.0 + 0x1p-8,        // tie -> even (1.0)
                     1.0 + 3 * 0x1p-8,    // tie -> even (1 + 2^-6)
                     1.0 + 0x1p-8 + 0x1p-9,  // above the tie -> up
                     1.0 + 0x1p-9,        // below the tie -> down
                     -(1.0 + 3 * 0x1p-8),  // sign is symmetric
                     257, 259, 0.1};
  const Values want = {1.0, 1.0 + 0x1p-6, 1.0 + 0x1p-7, 1.0, -(1.0 + 0x1p-6), 256, 260, 0.10009765625};
  for (DType from : {DType::float32, DType::float64}) {
    Tensor y = cast(T({a}, in, from), DType::bfloat16);
    EXPECT_EQ(y.dtype(), DType::bfloat16);
    expect_values(to_host(y), want, 0, std::string("from ") + dtype_name(from));
    expect_values(to_host(cast(y, DType::float32)), want, 0);
  }
  // from_host into bfloat16 rounds the same way.
  expect_values(to_host(T({a}, in, DType::bfloat16)), want, 0, "from_host");
}

TEST_P(Ops, CastFloat64To16BitFloatsRoundsOnce) {
  // 1 + 2^-8 + 2^-30 lies just above the tie between 1 and 1 + 2^-7. Going
  // through float32 first would round it onto the tie and then down to 1.
  Dim a("a", 2);
  Tensor x = T({a}, {1.0 + 0x1p-8 + 0x1p-30, -(1.0 + 0x1p-8 + 0x1p-30)}, DType::float64);
  expect_values(to_host(cast(x, DType::bfloat16)), {1.0 + 0x1p-7, -(1.0 + 0x1p-7)}, 0, "cast to bfloat16");
  expect_values(to_host(T({a}, {1.0 + 0x1p-8 + 0x1p-30, 1.0 - 0x1p-30}, DType::bfloat16)), {1.0 + 0x1p-7, 1.0}, 0,
                "from_host into bfloat16");
  // The same for float16 (11 significant bits).
  Tensor y = T({a}, {1.0 + 0x1p-11 + 0x1p-40, 2049 + 0x1p-20}, DType::float64);
  expect_values(to_host(cast(y, DType::float16)), {1.0 + 0x1p-10, 2050}, 0, "cast to float16");
}

TEST_P(Ops, CastToFloat16RoundsToNearestEven) {
  Dim a("a", 5);
  const Values in = {1.0 + 0x1p-11, 1.0 + 3 * 0x1p-11, 2049, 2051, 65504};
  const Values want = {1.0, 1.0 + 0x1p-9, 2048, 2052, 65504};
  expect_values(to_host(cast(T({a}, in), DType::float16)), want, 0);
}

TEST_P(Ops, CopyTranspose) {
  Dim a("a", 2), b("b", 3);
  Tensor x = T({a, b}, {0, 1, 2, 3, 4, 5});
  Tensor y = copy_transpose(x, {b, a});
  EXPECT_EQ(y.dims(), (Dims{b, a}));
  EXPECT_EQ(to_host(y), (Values{0, 3, 1, 4, 2, 5}));
  expect_tensor(y, {a, b}, {0, 1, 2, 3, 4, 5});
  Dim c("c", 2);
  Values v(12);
  std::iota(v.begin(), v.end(), 0.0);
  Tensor z = copy_transpose(T({a, b, c}, v), {c, b, a});
  EXPECT_EQ(z.dims(), (Dims{c, b, a}));
  expect_tensor(z, {a, b, c}, v);
  // Identity order.
  EXPECT_EQ(to_host(copy_transpose(x, {a, b})), (Values{0, 1, 2, 3, 4, 5}));
}

TEST_P(Ops, AlignBroadcastsAndPermutes) {
  Dim a("a", 2), b("b", 3), c("c", 2);
  Tensor x = T({b}, {1, 2, 3});
  Tensor y = align(x, {a, b});
  EXPECT_EQ(y.dims(), (Dims{a, b}));
  EXPECT_EQ(to_host(y), (Values{1, 2, 3, 1, 2, 3}));
  Tensor m = T({a, b}, {0, 1, 2, 3, 4, 5});
  Tensor z = align(m, {b, c, a});
  EXPECT_EQ(z.dims(), (Dims{b, c, a}));
  // (b, c, a) holds m[a][b].
  EXPECT_EQ(to_host(z), (Values{0, 3, 0, 3, 1, 4, 1, 4, 2, 5, 2, 5}));
  // Aligned views feed further ops correctly.
  expect_tensor(reduce_sum(z, {c}), {a, b}, {0, 2, 4, 6, 8, 10});
}

TEST_P(Ops, ToBackendRoundTrip) {
  Dim a("a", 2), b("b", 2);
  Tensor x = T({a, b}, {1, 2, 3, 4}, DType::float64);
  for (const std::string& name : backend_names()) {
    Tensor y = to_backend(x, name);
    EXPECT_EQ(y.backend().name(), name);
    EXPECT_EQ(y.dims(), x.dims());
    EXPECT_EQ(y.dtype(), DType::float64);
    EXPECT_EQ(to_host(y), (Values{1, 2, 3, 4}));
    Tensor back = to_backend(y, GetParam());
    EXPECT_EQ(back.backend().name(), GetParam());
    EXPECT_EQ(to_host(back), (Values{1, 2, 3, 4}));
  }
}

// --- matmul ------------------------------------------------------------------

TEST_P(Ops, MatmulPlain) {
  Dim i("i", 2), k("k", 3), j("j", 2);
  for (DType dt : {DType::float32, DType::float64, DType::bfloat16}) {
    Tensor a = T({i, k}, {1, 2, 3, 4, 5, 6}, dt);
    Tensor b = T({k, j}, {7, 8, 9, 10, 11, 12}, dt);
    Tensor c = matmul(a, b, {k});
    EXPECT_EQ(c.dims(), (Dims{i, j}));
    EXPECT_EQ(c.dtype(), dt);
    expect_values(to_host(c), {58, 64, 139, 154}, 0, dtype_name(dt));
    // The operands' storage order does not change the meaning.
    Tensor bt = copy_transpose(b, {j, k});
    Tensor at = copy_transpose(a, {k, i});
    expect_tensor(matmul(at, bt, {k}), {i, j}, {58, 64, 139, 154}, 0);
  }
}

TEST_P(Ops, MatmulCommonDimsAreBatchDims) {
  Dim batch("batch", 2), k("k", 2);
  Tensor a = T({batch, k}, {1, 2, 3, 4});
  Tensor b = T({k, batch}, {5, 6, 7, 8});  // b[batch 0] = (5, 7), b[batch 1] = (6, 8)
  Tensor c = matmul(a, b, {k});
  EXPECT_EQ(c.dims(), (Dims{batch}));
  EXPECT_EQ(to_host(c), (Values{19, 50}));

  Dim i("i", 2), j("j", 1);
  Tensor a2 = T({batch, i, k}, {1, 0, 0, 1, 1, 1, 2, 0});
  Tensor b2 = T({batch, k, j}, {3, 4, 5, 6});
  Tensor c2 = matmul(a2, b2, {k});
  EXPECT_EQ(c2.dims(), (Dims{batch, i, j}));
  EXPECT_EQ(to_host(c2), (Values{3, 4, 11, 10}));
}

TEST_P(Ops, MatmulResultDimOrderIsCommonThenAOnlyThenBOnly) {
  Dim c1("c1", 2), c2("c2", 3), a1("a1", 2), b1("b1", 2), k("k", 3);
  Tensor a = full({c1, a1, c2, k}, 1.0, opts());
  Tensor b = full({b1, c2, c1, k}, 2.0, opts());
  Tensor r = matmul(a, b, {k});
  // Common dims in a's order, then a-only, then b-only.
  EXPECT_EQ(r.dims(), (Dims{c1, c2, a1, b1}));
  expect_values(to_host(r), Values(2 * 3 * 2 * 2, 6.0), 0);
  Tensor r2 = matmul(b, a, {k});
  EXPECT_EQ(r2.dims(), (Dims{c2, c1, b1, a1}));
}

TEST_P(Ops, MatmulMultipleReduceDims) {
  Dim i("i", 2), k1("k1", 2), k2("k2", 2);
  Tensor a = T({i, k1, k2}, {0, 1, 2, 3, 4, 5, 6, 7});
  Tensor b = T({k2, k1}, {1, 2, 3, 4});  // B[k1][k2] = {{1, 3}, {2, 4}}
  Tensor c = matmul(a, b, {k1, k2});
  EXPECT_EQ(c.dims(), (Dims{i}));
  EXPECT_EQ(to_host(c), (Values{19, 59}));
  // The order of the reduce list does not matter.
  EXPECT_EQ(to_host(matmul(a, b, {k2, k1})), (Values{19, 59}));
}

TEST_P(Ops, MatmulWithoutReduceIsOuterProduct) {
  Dim i("i", 2), j("j", 3);
  Tensor c = matmul(T({i}, {1, 2}), T({j}, {1, 10, 100}), {});
  EXPECT_EQ(c.dims(), (Dims{i, j}));
  EXPECT_EQ(to_host(c), (Values{1, 10, 100, 2, 20, 200}));
}

TEST_P(Ops, MatmulFullReductionIsScalar) {
  Dim k("k", 3);
  Tensor c = matmul(T({k}, {1, 2, 3}, DType::float64), T({k}, {4, 5, 6}, DType::float64), {k});
  EXPECT_EQ(c.rank(), 0);
  EXPECT_EQ(item(c), 32);
}

// --- reductions --------------------------------------------------------------

TEST_P(Ops, ReduceStatic) {
  Dim a("a", 2), b("b", 3);
  Tensor x = T({a, b}, {1, 5, -2, 4, 0, 3}, DType::float64);
  expect_tensor(reduce_sum(x, {b}), {a}, {4, 7});
  expect_tensor(reduce_sum(x, {a}), {b}, {5, 5, 1});
  EXPECT_EQ(item(reduce_sum(x, {a, b})), 11);
  expect_tensor(reduce_max(x, {b}), {a}, {5, 4});
  expect_tensor(reduce_max(x, {a}), {b}, {4, 5, 3});
  expect_tensor(reduce(x, Reduce::min, {b}), {a}, {-2, 0});
  expect_tensor(reduce(x, Reduce::min, {a, b}), {}, {-2});
  expect_tensor(reduce_mean(x, {b}), {a}, {4.0 / 3, 7.0 / 3}, 1e-12);
  expect_tensor(reduce_mean(x, {a, b}), {}, {11.0 / 6}, 1e-12);
  expect_tensor(reduce_logsumexp(x, {b}), {a},
                {std::log(std::exp(1) + std::exp(5) + std::exp(-2)), std::log(std::exp(4) + 1 + std::exp(3))}, 1e-12);
  // No axes: the values stay.
  expect_tensor(reduce_sum(x, {}), {a, b}, {1, 5, -2, 4, 0, 3});
}

TEST_P(Ops, ReduceLogsumexpIsStable) {
  Dim a("a", 3);
  Tensor x = T({a}, {1000, 1000, 1000});
  expect_tensor(reduce_logsumexp(x, {a}), {}, {1000 + std::log(3.0)}, 1e-3);
  Tensor y = T({a}, {-1000, -1000, -kInf});
  expect_tensor(reduce_logsumexp(y, {a}), {}, {-1000 + std::log(2.0)}, 1e-3);
}

TEST_P(Ops, ReduceIntegers) {
  Dim a("a", 2), b("b", 3);
  for (DType dt : {DType::int32, DType::int64}) {
    Tensor x = T({a, b}, {3, -1, 4, 1, -5, 9}, dt);
    Tensor s = reduce_sum(x, {b});
    EXPECT_EQ(s.dtype(), dt);
    expect_tensor(s, {a}, {6, 5}, 0);
    expect_tensor(reduce_max(x, {b}), {a}, {4, 9}, 0);
    expect_tensor(reduce(x, Reduce::min, {b}), {a}, {-1, -5}, 0);
    expect_tensor(reduce_max(x, {a, b}), {}, {9}, 0);
  }
}

TEST_P(Ops, ReduceMasksDynamicPadding) {
  Dim batch("batch", 3);
  Dim time = dyn("time", batch, {2, 3, 0});
  // Padding holds large values that must not leak into any result.
  Tensor x = T({batch, time}, {1, 2, 100, 3, -4, 5, 100, 100, 100});
  expect_tensor(reduce_sum(x, {time}), {batch}, {3, 4, 0});
  expect_tensor(reduce_max(x, {time}), {batch}, {2, 5, -kInf});
  expect_tensor(reduce(x, Reduce::min, {time}), {batch}, {1, -4, kInf});
  // mean divides by the lengths; an empty entry gives 0, not NaN.
  expect_tensor(reduce_mean(x, {time}), {batch}, {1.5, 4.0 / 3, 0}, 1e-6);
  expect_tensor(reduce_logsumexp(x, {time}), {batch},
                {std::log(std::exp(1) + std::exp(2)), std::log(std::exp(3) + std::exp(-4) + std::exp(5)), -kInf},
                1e-5);
  // The storage order of x does not matter.
  expect_tensor(reduce_mean(copy_transpose(x, {time, batch}), {time}), {batch}, {1.5, 4.0 / 3, 0}, 1e-6);
  // Reducing over the static batch dim masks nothing.
  Tensor over_batch = reduce_sum(x, {batch});
  expect_tensor(over_batch, {time}, {104, 98, 205});
}

TEST_P(Ops, ReduceOverDynamicAndStaticDims) {
  Dim batch("batch", 2), feat("feat", 2);
  Dim time = dyn("time", batch, {1, 2});
  Tensor x = T({batch, time, feat}, {1, 2, 50, 50, 3, 4, 5, 6});
  expect_tensor(reduce_mean(x, {time, feat}), {batch}, {1.5, 4.5}, 1e-6);
  expect_tensor(reduce_sum(x, {time}), {batch, feat}, {1, 2, 8, 10});
  expect_tensor(reduce_mean(x, {time}), {batch, feat}, {1, 2, 4, 5}, 1e-6);
  expect_tensor(reduce_max(x, {time, feat}), {batch}, {2, 6});
  expect_tensor(reduce_sum(x, {batch, time, feat}), {}, {21});
}

TEST_P(Ops, ReduceIntegerWithDynamicPadding) {
  Dim batch("batch", 2);
  Dim time = dyn("time", batch, {1, 3});
  Tensor x = T({batch, time}, {-5, 99, 99, 2, 7, 1}, DType::int64);
  expect_tensor(reduce_max(x, {time}), {batch}, {-5, 7}, 0);
  expect_tensor(reduce(x, Reduce::min, {time}), {batch}, {-5, 1}, 0);
  expect_tensor(reduce_sum(x, {time}), {batch}, {-5, 10}, 0);
}

// --- softmax -----------------------------------------------------------------

TEST_P(Ops, SoftmaxStatic) {
  Dim a("a", 2), b("b", 3);
  Tensor x = T({a, b}, {0, 1, 2, 1, 1, 1});
  const double e = std::exp(1.0), s = 1 + e + e * e;
  Tensor y = softmax(x, b);
  EXPECT_TRUE(same_dim_set(y.dims(), {a, b}));
  expect_tensor(y, {a, b}, {1 / s, e / s, e * e / s, 1.0 / 3, 1.0 / 3, 1.0 / 3});
  expect_tensor(softmax(x, a), {a, b}, {1 / (1 + e), 0.5, e / (1 + e), e / (1 + e), 0.5, 1 / (1 + e)});
  expect_tensor(log_softmax(x, b), {a, b},
                {-std::log(s), 1 - std::log(s), 2 - std::log(s), -std::log(3.0), -std::log(3.0), -std::log(3.0)},
                1e-5);
  // Large logits are stable.
  expect_tensor(softmax(T({b}, {1000, 1001, 1002}), b), {b}, {1 / s, e / s, e * e / s});
  // Storage order does not matter.
  expect_tensor(softmax(copy_transpose(x, {b, a}), b), {a, b}, {1 / s, e / s, e * e / s, 1.0 / 3, 1.0 / 3, 1.0 / 3});
}

TEST_P(Ops, SoftmaxMasksDynamicAxis) {
  Dim batch("batch", 3);
  Dim time = dyn("time", batch, {2, 3, 0});
  // Padding holds NaN and large values: neither may leak.
  Tensor x = T({batch, time}, {0, 0, kNaN, 0, 1, 2, 1, kNaN, 3});
  const double e = std::exp(1.0), s = 1 + e + e * e;
  Tensor y = softmax(x, time);
  expect_tensor(y, {batch, time}, {0.5, 0.5, 0, 1 / s, e / s, e * e / s, 0, 0, 0});
  for (double v : to_host(y)) EXPECT_FALSE(std::isnan(v));
  expect_tensor(softmax(copy_transpose(x, {time, batch}), time), {batch, time},
                {0.5, 0.5, 0, 1 / s, e / s, e * e / s, 0, 0, 0});
  // Rows sum to 1, the empty row to 0.
  expect_tensor(reduce_sum(y, {time}), {batch}, {1, 1, 0}, 1e-6);
}

TEST_P(Ops, LogSoftmaxMasksDynamicAxis) {
  Dim batch("batch", 3);
  Dim time = dyn("time", batch, {2, 3, 0});
  Tensor x = T({batch, time}, {0, 0, 100, 0, 1, 2, 1, 2, 3});
  const double ls = std::log(1 + std::exp(1.0) + std::exp(2.0));
  Tensor y = log_softmax(x, time);
  expect_tensor(y, {batch, time},
                {-std::log(2.0), -std::log(2.0), -kInf, -ls, 1 - ls, 2 - ls, -kInf, -kInf, -kInf}, 1e-5);
  for (double v : to_host(y)) EXPECT_FALSE(std::isnan(v));
}

TEST_P(Ops, SoftmaxOverStaticAxisIgnoresOtherDynamicDims) {
  Dim batch("batch", 2), feat("feat", 2);
  Dim time = dyn("time", batch, {1, 2});
  Tensor x = T({batch, time, feat}, {0, 0, 5, 5, 0, 0, 0, 0});
  // Every (batch, time) row gets its softmax over feat, padding rows too.
  expect_tensor(softmax(x, feat), {batch, time, feat}, Values(8, 0.5));
}

// --- dropout -----------------------------------------------------------------

TEST_P(Ops, DropoutIsIdentityWithoutTrainFlag) {
  ASSERT_FALSE(train_flag());
  Dim a("a", 50), b("b", 40);
  Tensor x = random_normal({a, b}, 3, opts());
  expect_tensor(dropout(x, 0.5, {a, b}), {a, b}, to_host(x), 0);
  TrainFlagScope off(false);
  expect_tensor(dropout(x, 0.9, {a}), {a, b}, to_host(x), 0);
}

TEST_P(Ops, DropoutKeepRateAndScale) {
  Dim n("n", 20000);
  Tensor x = full({n}, 2.0, opts());
  Values v;
  {
    TrainFlagScope train(true);
    ASSERT_TRUE(train_flag());
    v = to_host(dropout(x, 0.25, {n}));
  }
  EXPECT_FALSE(train_flag());
  int64_t kept = 0;
  for (double e : v) {
    if (e != 0) {
      ++kept;
      EXPECT_NEAR(e, 2.0 / 0.75, 1e-5);
    }
  }
  EXPECT_NEAR(static_cast<double>(kept) / 20000, 0.75, 0.02);
  // p = 0 keeps everything, even in training.
  TrainFlagScope train(true);
  expect_tensor(dropout(x, 0.0, {n}), {n}, Values(20000, 2.0), 0);
}

TEST_P(Ops, DropoutMaskIsSharedAcrossNonVaryDims) {
  Dim batch("batch", 4), time("time", 300), feat("feat", 8);
  Tensor x = full({batch, time, feat}, 1.0, opts());
  TrainFlagScope train(true);
  // Varies over (batch, time): every feat entry of one (batch, time) agrees.
  const Values v = to_host(dropout(x, 0.5, {batch, time}), Dims{batch, time, feat});
  int64_t kept_rows = 0;
  for (int64_t r = 0; r < 4 * 300; ++r) {
    for (int64_t f = 1; f < 8; ++f) ASSERT_EQ(v[r * 8 + f], v[r * 8]) << "row " << r;
    EXPECT_TRUE(v[r * 8] == 0 || std::fabs(v[r * 8] - 2.0) < 1e-6) << v[r * 8];
    kept_rows += v[r * 8] != 0;
  }
  EXPECT_NEAR(static_cast<double>(kept_rows) / 1200, 0.5, 0.06);
  // Varies over feat only: one mask row repeated over (batch, time).
  const Values w = to_host(dropout(x, 0.5, {feat}), Dims{feat, batch, time});
  for (int64_t f = 0; f < 8; ++f)
    for (int64_t r = 1; r < 4 * 300; ++r) ASSERT_EQ(w[f * 1200 + r], w[f * 1200]) << "feat " << f;
  // Mask over both batch and time really varies along time.
  Values first_feat;
  for (int64_t r = 0; r < 300; ++r) first_feat.push_back(v[r * 8]);
  EXPECT_NE(*std::min_element(first_feat.begin(), first_feat.end()),
            *std::max_element(first_feat.begin(), first_feat.end()));
}

TEST_P(Ops, DropoutIsReproducibleFromTheRunSeed) {
  Dim n("n", 1000);
  Tensor x = full({n}, 1.0, opts());
  TrainFlagScope train(true);
  set_random_seed(1234);
  const Values a = to_host(dropout(x, 0.5, {n}));
  const Values b = to_host(dropout(x, 0.5, {n}));
  EXPECT_NE(a, b) << "consecutive calls draw different masks";
  set_random_seed(1234);
  EXPECT_EQ(to_host(dropout(x, 0.5, {n})), a);
}

TEST_P(Ops, DropoutKeepsDtypeAndDims) {
  Dim a("a", 16), b("b", 4);
  Tensor x = full({a, b}, 1.0, opts(DType::float64));
  TrainFlagScope train(true);
  Tensor y = dropout(x, 0.5, {a});
  EXPECT_EQ(y.dtype(), DType::float64);
  EXPECT_TRUE(same_dim_set(y.dims(), {a, b}));
  EXPECT_EQ(y.backend().name(), GetParam());
}

// --- elementwise -------------------------------------------------------------

TEST_P(Ops, ArithmeticBroadcastsOverUnionOfDims) {
  Dim i("i", 2), j("j", 3);
  Tensor a = T({i}, {1, 2});
  Tensor b = T({j}, {10, 20, 30});
  expect_tensor(add(a, b), {i, j}, {11, 21, 31, 12, 22, 32});
  expect_tensor(sub(a, b), {i, j}, {-9, -19, -29, -8, -18, -28});
  expect_tensor(mul(a, b), {i, j}, {10, 20, 30, 20, 40, 60});
  expect_tensor(div(b, a), {j, i}, {10, 5, 20, 10, 30, 15});
  // Partial overlap: (i, j) with (j, k).
  Dim k("k", 2);
  Tensor m = T({i, j}, {1, 2, 3, 4, 5, 6});
  Tensor n = T({k, j}, {0, 1, 2, 10, 20, 30});  // stored (k, j)
  Values want;
  for (int ii = 0; ii < 2; ++ii)
    for (int jj = 0; jj < 3; ++jj)
      for (int kk = 0; kk < 2; ++kk) want.push_back((ii * 3 + jj + 1) + (kk == 0 ? jj : 10 * (jj + 1)));
  expect_tensor(add(m, n), {i, j, k}, want);
  // Same dims in another storage order.
  expect_tensor(sub(m, copy_transpose(m, {j, i})), {i, j}, Values(6, 0.0));
  // A rank-0 operand broadcasts everywhere.
  expect_tensor(mul(m, scalar(2, opts())), {i, j}, {2, 4, 6, 8, 10, 12});
}

TEST_P(Ops, ArithmeticOperatorsAndScalarOverloads) {
  Dim i("i", 3);
  Tensor a = T({i}, {1, 2, 4});
  Tensor b = T({i}, {2, 2, 2});
  expect_tensor(a + b, {i}, {3, 4, 6});
  expect_tensor(a - b, {i}, {-1, 0, 2});
  expect_tensor(a * b, {i}, {2, 4, 8});
  expect_tensor(a / b, {i}, {0.5, 1, 2});
  expect_tensor(-a, {i}, {-1, -2, -4});
  expect_tensor(a * 0.5, {i}, {0.5, 1, 2});
  expect_tensor(a + 1.0, {i}, {2, 3, 5});
  expect_tensor(mul(a, -1.0), {i}, {-1, -2, -4});
  expect_tensor(add(a, -1.0), {i}, {0, 1, 3});
  // Scalar operands take the tensor's dtype and backend.
  Tensor ai = T({i}, {1, 2, 4}, DType::int64);
  Tensor r = ai + 3.0;
  EXPECT_EQ(r.dtype(), DType::int64);
  EXPECT_EQ(r.backend().name(), GetParam());
  expect_tensor(r, {i}, {4, 5, 7}, 0);
  expect_tensor(ai * 2.0, {i}, {2, 4, 8}, 0);
  Tensor d = T({i}, {1, 2, 4}, DType::float64) * 0.1;
  EXPECT_EQ(d.dtype(), DType::float64);
  expect_tensor(d, {i}, {0.1, 0.2, 0.4}, 1e-15);
}

TEST_P(Ops, MaximumMinimum) {
  Dim i("i", 3);
  Tensor a = T({i}, {1, 5, -2});
  Tensor b = T({i}, {3, 4, -2});
  expect_tensor(maximum(a, b), {i}, {3, 5, -2});
  expect_tensor(minimum(a, b), {i}, {1, 4, -2});
  expect_tensor(maximum(a, scalar(0, opts())), {i}, {1, 5, 0});
  expect_tensor(minimum(a, scalar(0, opts())), {i}, {0, 0, -2});
  Dim j("j", 2);
  expect_tensor(maximum(a, T({j}, {0, 4})), {i, j}, {1, 4, 5, 5, 0, 4});
  expect_tensor(maximum(T({i}, {1, 5, -2}, DType::int64), T({i}, {3, 4, -2}, DType::int64)), {i}, {3, 5, -2}, 0);
}

TEST_P(Ops, UnaryMath) {
  Dim i("i", 4);
  Tensor x = T({i}, {1, 4, 0.25, 9});
  expect_tensor(neg(x), {i}, {-1, -4, -0.25, -9});
  expect_tensor(exp(x), {i}, {std::exp(1.0), std::exp(4.0), std::exp(0.25), std::exp(9.0)}, 1e-2);
  expect_tensor(log(x), {i}, {0, std::log(4.0), std::log(0.25), std::log(9.0)}, 1e-6);
  expect_tensor(sqrt(x), {i}, {1, 2, 0.5, 3}, 1e-6);
  expect_tensor(abs(T({i}, {-1.5, 2, -0.0, -3})), {i}, {1.5, 2, 0, 3});
  expect_tensor(log(T({i}, {0, 1, 1, 1})), {i}, {-kInf, 0, 0, 0});
  Tensor n = T({i}, {-3, 0, 2, -1}, DType::int64);
  expect_tensor(neg(n), {i}, {3, 0, -2, 1}, 0);
  expect_tensor(abs(n), {i}, {3, 0, 2, 1}, 0);
  EXPECT_EQ(abs(n).dtype(), DType::int64);
  expect_tensor(exp(T({i}, {0, 1, 2, -1}, DType::float64)), {i},
                {1, std::exp(1.0), std::exp(2.0), std::exp(-1.0)}, 1e-12);
}

TEST_P(Ops, CompareOps) {
  Dim i("i", 3);
  Tensor a = T({i}, {1, 2, 3});
  Tensor b = T({i}, {2, 2, 2});
  const std::vector<std::pair<Compare, Values>> cases = {
      {Compare::eq, {0, 1, 0}}, {Compare::ne, {1, 0, 1}}, {Compare::lt, {1, 0, 0}},
      {Compare::le, {1, 1, 0}}, {Compare::gt, {0, 0, 1}}, {Compare::ge, {0, 1, 1}}};
  for (const auto& [op, want] : cases) {
    Tensor r = compare(a, op, b);
    EXPECT_EQ(r.dtype(), DType::boolean);
    expect_tensor(r, {i}, want, 0);
    expect_tensor(compare(a, op, 2.0), {i}, want, 0);
    expect_tensor(compare(cast(a, DType::int64), op, cast(b, DType::int64)), {i}, want, 0);
  }
  Dim j("j", 2);
  expect_tensor(compare(a, Compare::lt, T({j}, {2, 3})), {i, j}, {1, 1, 0, 1, 0, 0}, 0);
}

TEST_P(Ops, LogicalOps) {
  Dim i("i", 4);
  Tensor p = T({i}, {1, 1, 0, 0}, DType::boolean);
  Tensor q = T({i}, {1, 0, 1, 0}, DType::boolean);
  Tensor r = logical_and(p, q);
  EXPECT_EQ(r.dtype(), DType::boolean);
  expect_tensor(r, {i}, {1, 0, 0, 0}, 0);
  expect_tensor(logical_or(p, q), {i}, {1, 1, 1, 0}, 0);
  expect_tensor(logical_not(p), {i}, {0, 0, 1, 1}, 0);
  EXPECT_EQ(logical_not(p).dtype(), DType::boolean);
  Dim j("j", 2);
  Tensor s = T({j}, {1, 0}, DType::boolean);
  expect_tensor(logical_and(p, s), {i, j}, {1, 0, 1, 0, 0, 0, 0, 0}, 0);
  expect_tensor(logical_or(p, s), {i, j}, {1, 1, 1, 1, 1, 0, 1, 0}, 0);
}

TEST_P(Ops, WhereBroadcastsAllThreeOperands) {
  Dim i("i", 2), j("j", 3);
  Tensor cond = T({i}, {1, 0}, DType::boolean);
  Tensor a = T({j}, {1, 2, 3});
  Tensor b = T({i}, {10, 20});
  Tensor r = where(cond, a, b);
  EXPECT_EQ(r.dtype(), DType::float32);
  expect_tensor(r, {i, j}, {1, 2, 3, 20, 20, 20});
  expect_tensor(where(cond, a, -1.0), {i, j}, {1, 2, 3, -1, -1, -1});
  Tensor c2 = T({j, i}, {1, 0, 0, 1, 1, 1}, DType::boolean);  // stored (j, i)
  expect_tensor(where(c2, a, b), {i, j}, {1, 10, 3, 20, 2, 3});
  Tensor ai = T({j}, {1, 2, 3}, DType::int64);
  Tensor ri = where(cond, ai, 0.0);
  EXPECT_EQ(ri.dtype(), DType::int64);
  expect_tensor(ri, {i, j}, {1, 2, 3, 0, 0, 0}, 0);
}

// --- dims ops ----------------------------------------------------------------

TEST_P(Ops, RangeOverDim) {
  Dim t("t", 4);
  Tensor r = range_over_dim(t, opts(DType::int64));
  EXPECT_EQ(r.dims(), Dims{t});
  EXPECT_EQ(r.dtype(), DType::int64);
  EXPECT_EQ(r.backend().name(), GetParam());
  EXPECT_EQ(to_host(r), (Values{0, 1, 2, 3}));
  EXPECT_EQ(to_host(range_over_dim(t, opts(DType::int32))), (Values{0, 1, 2, 3}));
  EXPECT_EQ(to_host(range_over_dim(t, opts(DType::float32))), (Values{0, 1, 2, 3}));
  Dim batch("batch", 2);
  Dim time = dyn("time", batch, {1, 3});
  EXPECT_EQ(to_host(range_over_dim(time, opts(DType::int64))), (Values{0, 1, 2}));
}

TEST_P(Ops, SequenceMask) {
  Dim t("t", 3);
  Tensor s = sequence_mask(t, opts());
  EXPECT_EQ(s.dtype(), DType::boolean);
  EXPECT_EQ(s.backend().name(), GetParam());
  expect_tensor(s, {t}, {1, 1, 1}, 0);
  Dim batch("batch", 3);
  Dim time = dyn("time", batch, {2, 3, 0});
  Tensor m = sequence_mask(time, opts());
  EXPECT_EQ(m.dtype(), DType::boolean);
  EXPECT_EQ(m.backend().name(), GetParam());
  expect_tensor(m, {batch, time}, {1, 1, 0, 1, 1, 1, 0, 0, 0}, 0);
}

TEST_P(Ops, SequenceMaskOverSeveralDims) {
  Dim batch("batch", 2), s("s", 4);
  Dim time = dyn("time", batch, {2, 1});
  Dim feat = dyn("feat", batch, {1, 2});
  Tensor m = sequence_mask(Dims{time, s, feat}, opts());
  EXPECT_EQ(m.dtype(), DType::boolean);
  // Static dims add nothing: the mask is over (batch, time, feat).
  expect_tensor(m, {batch, time, feat}, {1, 0, 1, 0, 1, 1, 0, 0}, 0);
  Tensor all = sequence_mask(Dims{s}, opts());
  EXPECT_EQ(all.dtype(), DType::boolean);
  EXPECT_EQ(item(all), 1);
}

TEST_P(Ops, ReplaceDim) {
  Dim a("a", 2), b("b", 3), c("c", 3);
  Tensor x = T({a, b}, {0, 1, 2, 3, 4, 5});
  Tensor y = replace_dim(x, b, c);
  EXPECT_TRUE(y.has(c));
  EXPECT_FALSE(y.has(b));
  expect_tensor(y, {a, c}, {0, 1, 2, 3, 4, 5});
  expect_tensor(replace_dim(x, b, b), {a, b}, {0, 1, 2, 3, 4, 5});
  // A static dim may take a dynamic dim's place when the extents agree.
  Dim batch("batch", 2);
  Dim time = dyn("time", batch, {3, 1});
  Tensor z = replace_dim(T({batch, c}, {1, 2, 3, 4, 5, 6}), c, time);
  expect_tensor(reduce_sum(z, {time}), {batch}, {6, 4});
}

TEST_P(Ops, MergeDims) {
  Dim a("a", 2), b("b", 3);
  Tensor x = T({a, b}, {0, 1, 2, 3, 4, 5});
  auto [y, m] = merge_dims(x, {a, b});
  EXPECT_EQ(m.extent(), 6);
  EXPECT_FALSE(m.is_dynamic());
  EXPECT_EQ(y.dims(), Dims{m});
  EXPECT_EQ(to_host(y), (Values{0, 1, 2, 3, 4, 5}));
  // Outermost first: merging (b, a) walks a fastest.
  auto [y2, m2] = merge_dims(x, {b, a});
  EXPECT_NE(m2, m);
  expect_tensor(y2, {m2}, {0, 3, 1, 4, 2, 5});
  // With a remaining dim and an out dim given.
  Dim c("c", 2), out("out", 4);
  Values v(12);
  std::iota(v.begin(), v.end(), 0.0);
  auto [z, mo] = merge_dims(T({a, b, c}, v), {c, a}, out);
  EXPECT_EQ(mo, out);
  // (b, out=c*2+a) holds v[a*6 + b*2 + c].
  Values want;
  for (int bi = 0; bi < 3; ++bi)
    for (int ci = 0; ci < 2; ++ci)
      for (int ai = 0; ai < 2; ++ai) want.push_back(ai * 6 + bi * 2 + ci);
  expect_tensor(z, {b, out}, want);
}

TEST_P(Ops, MergeDimsOfDynamicDimIsStatic) {
  Dim batch("batch", 2);
  Dim time = dyn("time", batch, {1, 2});
  auto [y, m] = merge_dims(T({batch, time}, {1, 0, 2, 3}), {batch, time});
  EXPECT_FALSE(m.is_dynamic());
  EXPECT_EQ(m.extent(), 4);
  expect_tensor(y, {m}, {1, 0, 2, 3});
}

TEST_P(Ops, SplitDims) {
  Dim m("m", 6), p("p", 2), q("q", 3);
  Tensor x = T({m}, {0, 1, 2, 3, 4, 5});
  Tensor y = split_dims(x, m, {p, q});
  EXPECT_EQ(y.dims(), (Dims{p, q}));
  EXPECT_EQ(to_host(y), (Values{0, 1, 2, 3, 4, 5}));
  expect_tensor(y, {q, p}, {0, 3, 1, 4, 2, 5});
  // Other dims keep their place; x stored with m first.
  Dim a("a", 2);
  Values v(12);
  std::iota(v.begin(), v.end(), 0.0);
  Tensor z = split_dims(T({m, a}, v), m, {p, q});
  // (a, p, q) holds v[(p*3 + q)*2 + a].
  Values want;
  for (int ai = 0; ai < 2; ++ai)
    for (int pi = 0; pi < 2; ++pi)
      for (int qi = 0; qi < 3; ++qi) want.push_back((pi * 3 + qi) * 2 + ai);
  expect_tensor(z, {a, p, q}, want);
  // Split undoes merge.
  auto [merged, md] = merge_dims(z, {p, q});
  expect_tensor(split_dims(merged, md, {p, q}), {a, p, q}, want);
}

TEST_P(Ops, ExpandDim) {
  Dim a("a", 2), n("n", 3);
  Tensor y = expand_dim(T({a}, {1, 2}), n);
  EXPECT_TRUE(same_dim_set(y.dims(), {a, n}));
  expect_tensor(y, {a, n}, {1, 1, 1, 2, 2, 2});
  Dim one("one", 1);
  expect_tensor(expand_dim(T({a}, {1, 2}), one), {one, a}, {1, 2});
  expect_tensor(reduce_sum(y, {n}), {a}, {3, 6});
}

TEST_P(Ops, Squeeze) {
  Dim a("a", 2), one("one", 1);
  Tensor x = T({a, one}, {1, 2});
  Tensor y = squeeze(x, one);
  EXPECT_EQ(y.dims(), Dims{a});
  EXPECT_EQ(to_host(y), (Values{1, 2}));
  Tensor s = squeeze(T({one}, {7}), one);
  EXPECT_EQ(s.rank(), 0);
  EXPECT_EQ(item(s), 7);
}

TEST_P(Ops, ConcatStatic) {
  Dim a("a", 2), t1("t1", 2), t2("t2", 1);
  Tensor x = T({a, t1}, {1, 2, 3, 4});
  Tensor y = T({t2, a}, {5, 6});  // stored the other way round
  auto [z, out] = concat({{x, t1}, {y, t2}});
  EXPECT_EQ(out.extent(), 3);
  EXPECT_FALSE(out.is_dynamic());
  expect_tensor(z, {a, out}, {1, 2, 5, 3, 4, 6});
  Dim given("given", 5);
  auto [z3, out3] = concat({{x, t1}, {y, t2}, {x, t1}}, given);
  EXPECT_EQ(out3, given);
  expect_tensor(z3, {a, given}, {1, 2, 5, 1, 2, 3, 4, 6, 3, 4});
}

TEST_P(Ops, ConcatDynamicPerEntry) {
  Dim batch("batch", 2);
  Dim t1 = dyn("t1", batch, {1, 2});
  // Extent 2 with lengths (1, 1): every entry of y has padding.
  Dim t2 = Dim::dynamic("t2", T({batch}, {1, 1}, DType::int64), 2);
  Tensor x = T({batch, t1}, {1, 99, 2, 3});
  Tensor y = T({batch, t2}, {10, 99, 12, 99});
  auto [z, out] = concat({{x, t1}, {y, t2}});
  ASSERT_TRUE(out.is_dynamic());
  // Lengths add up per entry.
  EXPECT_EQ(to_host(out.lengths(), out.lengths().dims()), (Values{2, 3}));
  EXPECT_EQ(out.extent(), 3);
  // Entry b: the valid part of x, then of y, then zero padding.
  expect_tensor(z, {batch, out}, {1, 10, 0, 2, 3, 12});
}

TEST_P(Ops, ConcatDynamicWithStatic) {
  Dim batch("batch", 2), s("s", 1), feat("feat", 2);
  Dim t = dyn("t", batch, {1, 2});
  Tensor x = T({batch, t, feat}, {1, 1, 99, 99, 2, 2, 3, 3});
  Tensor y = T({feat, batch, s}, {7, 8, 70, 80});  // y[batch 0] = (7, 70), y[batch 1] = (8, 80)
  auto [z, out] = concat({{x, t}, {y, s}});
  ASSERT_TRUE(out.is_dynamic());
  expect_values(to_host(out.lengths()), {2, 3}, 0);
  expect_tensor(z, {batch, out, feat}, {1, 1, 7, 70, 0, 0, 2, 2, 3, 3, 8, 80});
  // Static first, then dynamic.
  auto [z2, out2] = concat({{y, s}, {x, t}});
  expect_tensor(z2, {batch, out2, feat}, {7, 70, 1, 1, 0, 0, 8, 80, 2, 2, 3, 3});
}

TEST_P(Ops, SliceStatic) {
  Dim a("a", 2), t("t", 4);
  Tensor x = T({a, t}, {0, 1, 2, 3, 4, 5, 6, 7});
  auto [y, out] = slice(x, t, 1, 3);
  EXPECT_EQ(out.extent(), 2);
  EXPECT_FALSE(out.is_dynamic());
  expect_tensor(y, {a, out}, {1, 2, 5, 6});
  Dim given("given", 1);
  auto [y2, out2] = slice(x, t, 3, 4, given);
  EXPECT_EQ(out2, given);
  expect_tensor(y2, {a, given}, {3, 7});
  auto [e, oute] = slice(x, t, 2, 2);
  EXPECT_EQ(oute.extent(), 0);
  EXPECT_EQ(e.numel(), 0);
  // Slicing a view works too.
  auto [yt, outt] = slice(copy_transpose(x, {t, a}), t, 0, 2);
  expect_tensor(yt, {a, outt}, {0, 1, 4, 5});
}

TEST_P(Ops, SliceDynamicClampsLengths) {
  Dim batch("batch", 3);
  Dim t = dyn("t", batch, {4, 2, 1});
  Tensor x = T({batch, t}, {0, 1, 2, 3, 10, 11, 12, 13, 20, 21, 22, 23});
  auto [y, out] = slice(x, t, 1, 3);
  ASSERT_TRUE(out.is_dynamic());
  EXPECT_EQ(out.extent(), 2);
  // min(max(length - start, 0), end - start).
  expect_values(to_host(out.lengths()), {2, 1, 0}, 0);
  // Values are the raw positions 1..2; padding is masked by ops that reduce.
  expect_tensor(y, {batch, out}, {1, 2, 11, 12, 21, 22});
  expect_tensor(reduce_sum(y, {out}), {batch}, {3, 11, 0});
}

TEST_P(Ops, GatherPlainIndices) {
  Dim a("a", 2), t("t", 4), k("k", 3);
  Tensor x = T({a, t}, {0, 1, 2, 3, 10, 11, 12, 13});
  for (DType idx_dt : {DType::int64, DType::int32}) {
    Tensor idx = T({k}, {3, 0, 2}, idx_dt);
    Tensor y = gather(x, t, idx);
    EXPECT_EQ(y.dtype(), DType::float32);
    EXPECT_FALSE(y.has(t));
    expect_tensor(y, {a, k}, {3, 0, 2, 13, 10, 12});
  }
  Tensor s = gather(x, t, scalar(2, opts(DType::int64)));
  expect_tensor(s, {a}, {2, 12});
  // Gather from a transposed view and of int data.
  expect_tensor(gather(copy_transpose(x, {t, a}), t, T({k}, {1, 1, 3}, DType::int64)), {a, k}, {1, 1, 3, 11, 11, 13});
  expect_tensor(gather(cast(x, DType::int64), t, T({k}, {3, 0, 2}, DType::int64)), {a, k}, {3, 0, 2, 13, 10, 12}, 0);
}

TEST_P(Ops, GatherIndicesSharingBatchDim) {
  Dim a("a", 2), t("t", 4), k("k", 2);
  Tensor x = T({a, t}, {0, 1, 2, 3, 10, 11, 12, 13});
  // Indices over a: entry a picks its own position.
  expect_tensor(gather(x, t, T({a}, {1, 3}, DType::int64)), {a}, {1, 13});
  // Indices over (k, a), stored k first.
  Tensor idx = T({k, a}, {0, 3, 1, 2}, DType::int64);  // a0: (0, 1), a1: (3, 2)
  expect_tensor(gather(x, t, idx), {a, k}, {0, 1, 13, 12});
}

// --- bad input: every op names itself and the offending dims --------------------

TEST_P(Ops, ErrorCreationBadArgs) {
  Dim a("a", 2), b("b", 3);
  expect_error([&] { zeros({a, b, a}, opts()); }, "zeros", {"a[2]", "twice"});
  expect_error([&] { full({a, a}, 1.0, opts()); }, "full", {"a[2]", "twice"});
  expect_error([&] { from_host({a, b}, {1, 2, 3, 4, 5}, opts()); }, "from_host", {"a[2]", "b[3]", "6", "5"});
  expect_error([&] { from_host({b, b}, Values(9), opts()); }, "from_host", {"b[3]", "twice"});
  expect_error([&] { zeros({a}, {.backend = "no_such_backend"}); }, "zeros", {"no_such_backend"});
  expect_error([&] { scalar(1.0, {.backend = "no_such_backend"}); }, "scalar", {"no_such_backend"});
}

TEST_P(Ops, ErrorUnsupportedDevice) {
  if (get_backend(GetParam()).supports(kCUDA)) GTEST_SKIP() << GetParam() << " supports cuda here";
  Dim a("a", 2);
  expect_error([&] { zeros({a}, {.device = kCUDA, .backend = GetParam()}); }, "zeros", {"cuda", GetParam()});
  expect_error([&] { from_host({a}, {1, 2}, {.device = kCUDA, .backend = GetParam()}); }, "from_host",
               {"cuda", GetParam()});
  expect_error([&] { range_over_dim(a, {.dtype = DType::int64, .device = kCUDA, .backend = GetParam()}); },
               "range_over_dim", {"cuda", GetParam()});
  expect_error([&] { to_device(T({a}, {1, 2}), kCUDA); }, "to_device", {"cuda", GetParam()});
  expect_error([&] { sequence_mask(a, {.device = kCUDA, .backend = GetParam()}); }, "sequence_mask",
               {"cuda", GetParam()});
  Dim batch("batch", 2);
  Dim time = dyn("time", batch, {1, 2});
  expect_error([&] { sequence_mask(time, {.device = kCUDA, .backend = GetParam()}); }, "sequence_mask",
               {"cuda", GetParam()});
}

TEST_P(Ops, ErrorRangeOverDimAndSequenceMask) {
  Dim t("t", 4);
  expect_error([&] { range_over_dim(t, opts(DType::boolean)); }, "range_over_dim", {"bool", "t[4]"});
  expect_error([&] { sequence_mask(t, {.backend = "no_such_backend"}); }, "sequence_mask", {"no_such_backend"});
  expect_error([&] { range_over_dim(t, {.dtype = DType::int64, .backend = "no_such_backend"}); }, "range_over_dim",
               {"no_such_backend"});
}

TEST_P(Ops, ErrorRandomBadArgs) {
  Dim a("a", 4);
  expect_error([&] { random_normal({a}, 1, opts(DType::int64)); }, "random_normal", {"int64"});
  expect_error([&] { random_normal({a}, 1, opts(), 0.0, -1.0); }, "random_normal", {"-1"});
  expect_error([&] { random_normal({a, a}, 1, opts()); }, "random_normal", {"a[4]"});
  expect_error([&] { random_uniform({a}, 1, opts(DType::boolean)); }, "random_uniform", {"bool"});
  expect_error([&] { random_uniform({a}, 1, opts(), 2.0, 1.0); }, "random_uniform", {"2", "1"});
  expect_error([&] { random_uniform({a}, 1, opts(), 0.0, kInf); }, "random_uniform", {"inf"});
}

TEST_P(Ops, ErrorToHostAndItem) {
  Dim a("a", 2), b("b", 3), c("c", 4);
  Tensor x = T({a, b}, Values(6));
  expect_error([&] { to_host(x, Dims{a}); }, "to_host", {"a[2]", "b[3]"});
  expect_error([&] { to_host(x, Dims{a, c}); }, "to_host", {"c[4]", "b[3]"});
  expect_error([&] { item(x); }, "item", {"a[2]", "b[3]"});
}

TEST_P(Ops, ErrorToBackendUnknown) {
  Dim a("a", 2);
  expect_error([&] { to_backend(T({a}, {1, 2}), "no_such_backend"); }, "to_backend",
               {"no_such_backend", GetParam()});
}

TEST_P(Ops, ErrorCopyTransposeNotAPermutation) {
  Dim a("a", 2), b("b", 3), c("c", 4);
  Tensor x = T({a, b}, Values(6));
  expect_error([&] { copy_transpose(x, {a}); }, "copy_transpose", {"a[2]", "b[3]"});
  expect_error([&] { copy_transpose(x, {a, c}); }, "copy_transpose", {"c[4]", "b[3]"});
  expect_error([&] { copy_transpose(x, {a, a}); }, "copy_transpose", {"a[2]"});
}

TEST_P(Ops, ErrorAlignMissingDim) {
  Dim a("a", 2), b("b", 3), c("c", 4);
  Tensor x = T({a, b}, Values(6));
  expect_error([&] { align(x, {a, c}); }, "align", {"b[3]", "c[4]"});
  expect_error([&] { align(x, {a, b, a}); }, "align", {"a[2]", "twice"});
}

TEST_P(Ops, ErrorMatmulReduceDimMissing) {
  Dim i("i", 2), k("k", 3), time("time", 5), j("j", 2);
  Tensor a = T({i, k}, Values(6));
  Tensor b = T({k, j}, Values(6));
  expect_error([&] { matmul(a, b, {time}); }, "matmul", {"time[5]", "i[2]", "j[2]"});
  Tensor bt = T({time, j}, Values(10));
  expect_error([&] { matmul(a, bt, {k}); }, "matmul", {"k[3]", "time[5]"});
  expect_error([&] { matmul(bt, a, {k}); }, "matmul", {"k[3]", "time[5]"});
  expect_error([&] { matmul(a, b, {k, k}); }, "matmul", {"k[3]", "twice"});
}

TEST_P(Ops, ErrorMatmulDtypes) {
  Dim i("i", 2), k("k", 3);
  Tensor a = T({i, k}, Values(6));
  expect_error([&] { matmul(a, T({k}, Values(3), DType::float64), {k}); }, "matmul",
               {"float32", "float64", "k[3]"});
  Tensor ai = T({i, k}, Values(6), DType::int64);
  expect_error([&] { matmul(ai, T({k}, Values(3), DType::int64), {k}); }, "matmul", {"int64", "k[3]"});
}

TEST_P(Ops, ErrorMixedBackends) {
  const std::string other = other_backend();
  if (other.empty()) GTEST_SKIP() << "only one backend is registered";
  Dim i("i", 2), k("k", 3);
  Tensor a = T({i, k}, Values(6));
  Tensor b = from_host({k}, Values(3), {.backend = other});
  const std::initializer_list<std::string> names = {GetParam(), other, "k[3]"};
  expect_error([&] { add(a, b); }, "add", names);
  expect_error([&] { sub(a, b); }, "sub", names);
  expect_error([&] { mul(a, b); }, "mul", names);
  expect_error([&] { div(a, b); }, "div", names);
  expect_error([&] { maximum(a, b); }, "maximum", names);
  expect_error([&] { minimum(a, b); }, "minimum", names);
  expect_error([&] { compare(a, Compare::lt, b); }, "compare", names);
  expect_error([&] { (void)(a + b); }, "add", names);
  expect_error([&] { matmul(a, b, {k}); }, "matmul", names);
  Tensor p = T({k}, {1, 0, 1}, DType::boolean);
  Tensor q = from_host({k}, {1, 0, 1}, {.dtype = DType::boolean, .backend = other});
  expect_error([&] { logical_and(p, q); }, "logical_and", names);
  expect_error([&] { logical_or(p, q); }, "logical_or", names);
  expect_error([&] { where(q, a, a); }, "where", names);
  expect_error([&] { where(p, a, b); }, "where", names);
  expect_error([&] { concat({{T({k}, Values(3)), k}, {b, k}}); }, "concat", names);
  expect_error([&] { gather(a, k, from_host({}, {1}, {.dtype = DType::int64, .backend = other})); }, "gather",
               {GetParam(), other, "k[3]"});
}

TEST_P(Ops, ErrorReduceBadAxis) {
  Dim a("a", 2), time("time", 5);
  Tensor x = T({a}, {1, 2});
  expect_error([&] { reduce_sum(x, {time}); }, "reduce", {"time[5]", "a[2]"});
  expect_error([&] { reduce_max(x, {a, time}); }, "reduce", {"time[5]", "a[2]"});
  expect_error([&] { reduce_mean(T({a}, {1, 2}, DType::int64), {a}); }, "reduce", {"int64", "a[2]"});
  expect_error([&] { reduce_logsumexp(T({a}, {1, 2}, DType::int32), {a}); }, "reduce", {"int32", "a[2]"});
}

TEST_P(Ops, ErrorSoftmaxAxisNotInX) {
  Dim a("a", 2), time("time", 5);
  Tensor x = T({a}, {1, 2});
  expect_error([&] { softmax(x, time); }, "softmax", {"time[5]", "a[2]"});
  expect_error([&] { log_softmax(x, time); }, "log_softmax", {"time[5]", "a[2]"});
  Dim batch("batch", 2);
  Dim dt = dyn("time", batch, {1, 2});
  expect_error([&] { softmax(x, dt); }, "softmax", {"time[<=2 over batch]", "a[2]"});
}

TEST_P(Ops, ErrorSoftmaxOfIntegers) {
  Dim a("a", 2);
  expect_error([&] { softmax(T({a}, {1, 2}, DType::int64), a); }, "softmax", {"int64", "a[2]"});
  expect_error([&] { log_softmax(T({a}, {1, 2}, DType::int32), a); }, "log_softmax", {"int32", "a[2]"});
}

TEST_P(Ops, ErrorDropoutBadProbability) {
  Dim a("a", 3);
  Tensor x = T({a}, {1, 2, 3});
  // Checked whether or not the train flag is on.
  for (bool train : {false, true}) {
    TrainFlagScope scope(train);
    expect_error([&] { dropout(x, 1.0, {a}); }, "dropout", {"1", "a[3]"});
    expect_error([&] { dropout(x, kNaN, {a}); }, "dropout", {"nan", "a[3]"});
    expect_error([&] { dropout(x, -0.1, {a}); }, "dropout", {"-0.1", "a[3]"});
    expect_error([&] { dropout(x, 1.5, {a}); }, "dropout", {"1.5", "a[3]"});
  }
}

TEST_P(Ops, ErrorDropoutBadVaryOverOrDtype) {
  Dim a("a", 3), time("time", 5);
  Tensor x = T({a}, {1, 2, 3});
  expect_error([&] { dropout(x, 0.5, {time}); }, "dropout", {"time[5]", "a[3]"});
  expect_error([&] { dropout(T({a}, {1, 2, 3}, DType::int64), 0.5, {a}); }, "dropout", {"int64", "a[3]"});
}

TEST_P(Ops, ErrorElementwiseMixedDtypes) {
  Dim i("i", 2), time("time", 5);
  Tensor a = T({i}, {1, 2});
  Tensor b = T({time}, Values(5), DType::float64);
  const std::initializer_list<std::string> parts = {"float32", "float64", "i[2]", "time[5]"};
  expect_error([&] { add(a, b); }, "add", parts);
  expect_error([&] { sub(a, b); }, "sub", parts);
  expect_error([&] { mul(a, b); }, "mul", parts);
  expect_error([&] { div(a, b); }, "div", parts);
  expect_error([&] { maximum(a, b); }, "maximum", parts);
  expect_error([&] { minimum(a, b); }, "minimum", parts);
  expect_error([&] { compare(a, Compare::eq, b); }, "compare", parts);
  expect_error([&] { (void)(a * b); }, "mul", parts);
  expect_error([&] { (void)(a - b); }, "sub", parts);
  expect_error([&] { (void)(a / b); }, "div", parts);
}

TEST_P(Ops, ErrorUnaryNeedsFloatingOrNumeric) {
  Dim i("i", 2);
  Tensor n = T({i}, {1, 2}, DType::int64);
  expect_error([&] { exp(n); }, "exp", {"int64", "i[2]"});
  expect_error([&] { log(n); }, "log", {"int64", "i[2]"});
  expect_error([&] { sqrt(n); }, "sqrt", {"int64", "i[2]"});
  Tensor p = T({i}, {1, 0}, DType::boolean);
  expect_error([&] { neg(p); }, "neg", {"bool", "i[2]"});
  expect_error([&] { (void)(-p); }, "neg", {"bool", "i[2]"});
  expect_error([&] { abs(p); }, "abs", {"bool", "i[2]"});
}

TEST_P(Ops, ErrorLogicalOpsNeedBool) {
  Dim i("i", 2);
  Tensor p = T({i}, {1, 0}, DType::boolean);
  Tensor f = T({i}, {1, 0});
  expect_error([&] { logical_and(p, f); }, "logical_and", {"float32", "i[2]"});
  expect_error([&] { logical_or(f, p); }, "logical_or", {"float32", "i[2]"});
  expect_error([&] { logical_not(f); }, "logical_not", {"float32", "i[2]"});
}

TEST_P(Ops, ErrorWhereBadOperands) {
  Dim i("i", 2), j("j", 3);
  Tensor f = T({i}, {1, 0});
  Tensor a = T({j}, {1, 2, 3});
  expect_error([&] { where(f, a, a); }, "where", {"float32", "i[2]"});
  Tensor p = T({i}, {1, 0}, DType::boolean);
  expect_error([&] { where(p, a, T({j}, {1, 2, 3}, DType::float64)); }, "where", {"float32", "float64", "j[3]"});
}

TEST_P(Ops, ErrorCompareMixedDtypes) {
  Dim i("i", 2);
  expect_error([&] { compare(T({i}, {1, 2}, DType::int64), Compare::lt, T({i}, {1, 2})); }, "compare",
               {"int64", "float32", "i[2]"});
}

TEST_P(Ops, ErrorReplaceDim) {
  Dim a("a", 2), b("b", 3), c("c", 4), time("time", 5);
  Tensor x = T({a, b}, Values(6));
  expect_error([&] { replace_dim(x, b, c); }, "replace_dim", {"b[3]", "c[4]"});
  expect_error([&] { replace_dim(x, time, c); }, "replace_dim", {"time[5]", "a[2]"});
  Dim a2("a2", 2);
  expect_error([&] { replace_dim(T({a, a2}, Values(4)), a, a2); }, "replace_dim", {"a2[2]"});
}

TEST_P(Ops, ErrorMergeDims) {
  Dim a("a", 2), b("b", 3), c("c", 4), out("out", 7);
  Tensor x = T({a, b}, Values(6));
  expect_error([&] { merge_dims(x, {a, c}); }, "merge_dims", {"c[4]", "a[2]", "b[3]"});
  expect_error([&] { merge_dims(x, {a, b}, out); }, "merge_dims", {"out[7]", "6"});
  expect_error([&] { merge_dims(x, {}); }, "merge_dims", {});
  expect_error([&] { merge_dims(x, {a, a}); }, "merge_dims", {"a[2]", "twice"});
}

TEST_P(Ops, ErrorSplitDims) {
  Dim m("m", 6), p("p", 2), q("q", 4), time("time", 5);
  Tensor x = T({m}, Values(6));
  expect_error([&] { split_dims(x, m, {p, q}); }, "split_dims", {"m[6]", "p[2]", "q[4]", "8"});
  expect_error([&] { split_dims(x, time, {p}); }, "split_dims", {"time[5]", "m[6]"});
  Dim r("r", 3);
  expect_error([&] { split_dims(T({m, p}, Values(12)), m, {p, r}); }, "split_dims", {"p[2]"});
  expect_error([&] { split_dims(x, m, {p, p}); }, "split_dims", {"p[2]", "twice"});
}

TEST_P(Ops, ErrorExpandDimAlreadyPresent) {
  Dim a("a", 2);
  expect_error([&] { expand_dim(T({a}, {1, 2}), a); }, "expand_dim", {"a[2]"});
}

TEST_P(Ops, ErrorSqueeze) {
  Dim a("a", 2), time("time", 5), one("one", 1);
  Tensor x = T({a, time}, Values(10));
  expect_error([&] { squeeze(x, time); }, "squeeze", {"time[5]", "5"});
  expect_error([&] { squeeze(x, one); }, "squeeze", {"one[1]", "a[2]"});
}

TEST_P(Ops, ErrorConcat) {
  Dim a("a", 2), b("b", 3), t1("t1", 2), t2("t2", 1), time("time", 5);
  Tensor x = T({a, t1}, Values(4));
  expect_error([&] { concat({{x, t1}, {T({b, t2}, Values(3)), t2}}); }, "concat", {"b[3]", "a[2]"});
  expect_error([&] { concat({{x, t1}, {T({a, t2}, Values(2), DType::float64), t2}}); }, "concat",
               {"float32", "float64", "t2[1]"});
  expect_error([&] { concat({{x, t1}, {T({a, t2}, Values(2)), time}}); }, "concat", {"time[5]", "t2[1]"});
  expect_error([&] { concat({{x, t1}, {T({a, t2}, Values(2)), t2}}, time); }, "concat", {"time[5]", "3"});
  expect_error([&] { concat({}); }, "concat", {});
}

TEST_P(Ops, ErrorSlice) {
  Dim a("a", 2), time("time", 5), other("other", 3);
  Tensor x = T({a, time}, Values(10));
  expect_error([&] { slice(x, time, 2, 9); }, "slice", {"time[5]", "9"});
  expect_error([&] { slice(x, time, -1, 2); }, "slice", {"time[5]", "-1"});
  expect_error([&] { slice(x, time, 3, 2); }, "slice", {"time[5]"});
  expect_error([&] { slice(x, other, 0, 1); }, "slice", {"other[3]", "time[5]"});
  expect_error([&] { slice(x, time, 0, 2, other); }, "slice", {"other[3]", "2"});
}

TEST_P(Ops, ErrorGather) {
  Dim a("a", 2), time("time", 5), k("k", 3);
  Tensor x = T({a, time}, Values(10));
  expect_error([&] { gather(x, time, T({k}, {0, 1, 2})); }, "gather", {"float32", "k[3]"});
  expect_error([&] { gather(x, time, T({k}, {0, 1, 2}, DType::boolean)); }, "gather", {"bool", "k[3]"});
  expect_error([&] { gather(x, k, T({a}, {0, 1}, DType::int64)); }, "gather", {"k[3]", "time[5]"});
  expect_error([&] { gather(x, time, T({time}, Values(5), DType::int64)); }, "gather", {"time[5]"});
  // Index values are checked where the data is (by the backend's gather
  // primitive): still a dimattn::Error that names gather and the index.
  try {
    gather(x, time, T({k}, {0, 7, 1}, DType::int64));
    ADD_FAILURE() << "expected a dimattn::Error for index 7 into time[5]";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("gather"), std::string::npos) << msg;
    EXPECT_NE(msg.find('7'), std::string::npos) << msg;
  }
}

// --- cross-backend comparison ---------------------------------------------------
// Each case draws random inputs on the first backend, moves them to every
// other backend with to_backend, runs there and compares with the first.

using Case = std::function<Tensor(const std::vector<Tensor>&)>;

void expect_same_on_every_backend(const std::vector<Tensor>& inputs, const Case& f, double tol) {
  const std::vector<std::string> names = backend_names();
  ASSERT_FALSE(names.empty());
  std::vector<Tensor> ref_inputs;
  for (const Tensor& x : inputs) ref_inputs.push_back(to_backend(x, names.front()));
  const Tensor ref = f(ref_inputs);
  const Values want = to_host(ref);
  for (size_t n = 1; n < names.size(); ++n) {
    SCOPED_TRACE("backend " + names[n] + " vs " + names.front());
    std::vector<Tensor> moved;
    for (const Tensor& x : inputs) moved.push_back(to_backend(x, names[n]));
    const Tensor got = f(moved);
    EXPECT_EQ(got.backend().name(), names[n]);
    EXPECT_EQ(got.dtype(), ref.dtype());
    ASSERT_TRUE(same_dim_set(got.dims(), ref.dims())) << repr(got.dims()) << " vs " << repr(ref.dims());
    expect_values(to_host(got, ref.dims()), want, tol);
  }
}

TensorOptions first_backend(DType dtype = DType::float32) { return {.dtype = dtype, .backend = backend_names().front()}; }

TEST(CrossBackend, Elementwise) {
  Dim i("i", 5), j("j", 7), k("k", 3);
  std::vector<Tensor> in = {random_normal({i, j}, 1, first_backend()), random_normal({j, k}, 2, first_backend()),
                            random_uniform({k}, 3, first_backend(), 0.5, 2.0)};
  expect_same_on_every_backend(in, [](const auto& x) { return (x[0] + x[1]) * exp(x[2]) - x[1] / x[2]; }, 1e-4);
  expect_same_on_every_backend(in, [](const auto& x) { return maximum(x[0], x[1]) + minimum(x[1], neg(x[0])); }, 0);
  expect_same_on_every_backend(in, [](const auto& x) { return sqrt(abs(x[0])) + log(x[2]) * 2.0; }, 1e-5);
  expect_same_on_every_backend(
      in, [](const auto& x) { return where(compare(x[0], Compare::gt, x[1]), x[0], x[1] * 3.0); }, 0);
  expect_same_on_every_backend(
      in,
      [](const auto& x) {
        return cast(logical_or(logical_not(compare(x[0], Compare::le, 0.0)), compare(x[1], Compare::ge, 0.5)),
                    DType::float32);
      },
      0);
}

TEST(CrossBackend, Matmul) {
  Dim batch("batch", 3), heads("heads", 2), q("q", 5), kv("kv", 6), feat("feat", 8), f2("f2", 3);
  std::vector<Tensor> in = {random_normal({batch, heads, q, feat}, 1, first_backend()),
                            random_normal({kv, heads, feat, batch}, 2, first_backend()),
                            random_normal({feat, f2, q}, 3, first_backend(DType::float64)),
                            random_normal({batch, f2, feat, q}, 4, first_backend(DType::float64))};
  expect_same_on_every_backend(in, [&](const auto& x) { return matmul(x[0], x[1], {feat}); }, 1e-4);
  expect_same_on_every_backend(in, [&](const auto& x) { return matmul(x[2], x[3], {feat, f2}); }, 1e-10);
  expect_same_on_every_backend(in, [&](const auto& x) { return matmul(x[2], x[3], {feat}); }, 1e-10);
}

TEST(CrossBackend, ReduceWithDynamicDims) {
  Dim batch("batch", 4), feat("feat", 3);
  Dim time = Dim::dynamic("time", from_host({batch}, {5, 0, 2, 7}, first_backend(DType::int64)));
  std::vector<Tensor> in = {random_normal({time, batch, feat}, 5, first_backend())};
  for (Reduce kind : {Reduce::sum, Reduce::max, Reduce::min, Reduce::mean, Reduce::logsumexp}) {
    expect_same_on_every_backend(in, [&](const auto& x) { return reduce(x[0], kind, {time}); }, 1e-5);
    expect_same_on_every_backend(in, [&](const auto& x) { return reduce(x[0], kind, {time, feat}); }, 1e-5);
    expect_same_on_every_backend(in, [&](const auto& x) { return reduce(x[0], kind, {batch}); }, 1e-5);
  }
}

TEST(CrossBackend, SoftmaxWithDynamicAxis) {
  Dim batch("batch", 4), heads("heads", 2);
  Dim time = Dim::dynamic("time", from_host({batch}, {5, 0, 2, 7}, first_backend(DType::int64)));
  std::vector<Tensor> in = {random_normal({heads, batch, time}, 6, first_backend(), 0, 3)};
  expect_same_on_every_backend(in, [&](const auto& x) { return softmax(x[0], time); }, 1e-6);
  expect_same_on_every_backend(in, [&](const auto& x) { return log_softmax(x[0], time); }, 1e-5);
  expect_same_on_every_backend(in, [&](const auto& x) { return softmax(x[0], heads); }, 1e-6);
}

TEST(CrossBackend, AttentionLikeChain) {
  Dim batch("batch", 2), heads("heads", 2), q("q", 4), feat("feat", 8), vfeat("vfeat", 5);
  Dim kv = Dim::dynamic("kv", from_host({batch}, {6, 3}, first_backend(DType::int64)));
  std::vector<Tensor> in = {random_normal({batch, heads, q, feat}, 1, first_backend()),
                            random_normal({batch, kv, heads, feat}, 2, first_backend()),
                            random_normal({batch, kv, heads, vfeat}, 3, first_backend())};
  expect_same_on_every_backend(
      in,
      [&](const auto& x) {
        Tensor energy = matmul(x[0], x[1], {feat}) * (1.0 / std::sqrt(8.0));
        return matmul(softmax(energy, kv), x[2], {kv});
      },
      1e-5);
}

// Ops that make a new dim make a new one on every call; results are compared
// after relabelling it to one fixed dim of the same extent.
std::function<Tensor(std::pair<Tensor, Dim>)> relabel_new_dim() {
  auto fixed = std::make_shared<std::optional<Dim>>();
  return [fixed](std::pair<Tensor, Dim> r) {
    if (!*fixed) *fixed = Dim("fixed_" + r.second.name(), r.second.extent());
    return replace_dim(r.first, r.second, **fixed);
  };
}

TEST(CrossBackend, DimsOps) {
  Dim batch("batch", 3), feat("feat", 4), s("s", 2);
  Dim t1 = Dim::dynamic("t1", from_host({batch}, {3, 1, 0}, first_backend(DType::int64)));
  Dim t2 = Dim::dynamic("t2", from_host({batch}, {2, 4, 1}, first_backend(DType::int64)));
  std::vector<Tensor> in = {random_normal({batch, t1, feat}, 1, first_backend()),
                            random_normal({feat, t2, batch}, 2, first_backend()),
                            random_normal({batch, s, feat}, 3, first_backend())};
  auto concat_fixed = relabel_new_dim();
  expect_same_on_every_backend(
      in, [&](const auto& x) { return concat_fixed(concat({{x[0], t1}, {x[1], t2}, {x[2], s}})); }, 0);
  auto slice_fixed = relabel_new_dim();
  expect_same_on_every_backend(in, [&](const auto& x) { return slice_fixed(slice(x[1], t2, 1, 3)); }, 0);
  auto merge_fixed = relabel_new_dim();
  expect_same_on_every_backend(in, [&](const auto& x) { return merge_fixed(merge_dims(x[1], {batch, feat})); }, 0);
  Dim f1("f1", 2), f2("f2", 2);
  expect_same_on_every_backend(in, [&](const auto& x) { return split_dims(x[2], feat, {f1, f2}); }, 0);
  expect_same_on_every_backend(in, [&](const auto& x) { return align(x[2], {feat, f1, s, batch}); }, 0);
  expect_same_on_every_backend(in, [&](const auto& x) { return copy_transpose(x[0], {feat, batch, t1}); }, 0);
  expect_same_on_every_backend(in, [&](const auto& x) { return expand_dim(x[2], f1); }, 0);
  Tensor idx = cast(random_uniform({batch, s}, 4, first_backend(), 0, 4), DType::int64);
  in.push_back(idx);
  expect_same_on_every_backend(in, [&](const auto& x) { return gather(x[0], feat, x[3]); }, 0);
  expect_same_on_every_backend(in, [&](const auto& x) { return gather(x[2], feat, x[3]); }, 0);
  expect_same_on_every_backend(in, [&](const auto& x) {
    return cast(sequence_mask(Dims{t1, t2}, {.backend = x[0].backend().name()}), DType::int32);
  }, 0);
}

TEST(CrossBackend, Casts) {
  Dim n("n", 257);
  std::vector<Tensor> in = {random_normal({n}, 9, first_backend(DType::float64), 0, 10)};
  for (DType dt : {DType::float32, DType::bfloat16, DType::float16, DType::int32, DType::int64, DType::boolean})
    expect_same_on_every_backend(in, [&](const auto& x) { return cast(x[0], dt); }, 0);
  expect_same_on_every_backend(in, [&](const auto& x) { return cast(cast(x[0], DType::float32), DType::bfloat16); },
                               0);
}

TEST(CrossBackend, LowPrecisionMath) {
  Dim i("i", 6), k("k", 16), j("j", 5);
  for (DType dt : {DType::bfloat16, DType::float16}) {
    std::vector<Tensor> in = {cast(random_normal({i, k}, 1, first_backend()), dt),
                              cast(random_normal({k, j}, 2, first_backend()), dt)};
    // Both accumulate in float32 and round once; allow one ulp of the output's scale.
    const double tol = dt == DType::bfloat16 ? 6e-2 : 8e-3;
    expect_same_on_every_backend(in, [&](const auto& x) { return matmul(x[0], x[1], {k}); }, tol);
    expect_same_on_every_backend(in, [&](const auto& x) { return softmax(x[0], k); }, tol / 4);
    expect_same_on_every_backend(in, [&](const auto& x) { return x[0] * x[0] + x[0]; }, 0);
  }
}

}  // namespace
}  // namespace dimattn
