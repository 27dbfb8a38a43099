// Every primitive of the Backend interface, called through the interface and
// checked against hand-computed values, on every registered backend.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <initializer_list>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "dimattn/ext/backend.h"
#include "dimattn/dtype.h"
#include "dimattn/error.h"
#include "dimattn/registry.h"
#include "support/test_util.h"

namespace dimattn {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
const std::vector<DType> kAllDTypes = {DType::float32, DType::float64, DType::bfloat16, DType::float16,
                                       DType::int32,   DType::int64,   DType::boolean};
const std::vector<DType> kFloatDTypes = {DType::float32, DType::float64, DType::bfloat16, DType::float16};

// A raw tensor no backend made: every backend must refuse it.
struct ForeignRaw : RawTensor {};

class BackendPrimitives : public ::testing::TestWithParam<std::string> {
 protected:
  Backend& be() { return get_backend(GetParam()); }

  RawPtr make(const Shape& shape, const std::vector<double>& data, DType dtype = DType::float32) {
    return be().from_host(shape, data, dtype, kCPU);
  }
  std::vector<double> host(const RawPtr& x) { return be().to_host(x); }
  RawPtr bin(BinaryOp op, const RawPtr& a, const RawPtr& b) { return be().binary(op, a, b); }

  // Values equal within tol (absolute), NaN equal to NaN, infinities exact.
  static void expect_values(const std::vector<double>& actual, const std::vector<double>& expected, double tol = 0,
                            const std::string& what = "") {
    ASSERT_EQ(actual.size(), expected.size()) << what;
    for (size_t i = 0; i < actual.size(); ++i) {
      const double a = actual[i], e = expected[i];
      if (std::isnan(e)) {
        EXPECT_TRUE(std::isnan(a)) << what << " at " << i << ": got " << a << ", expected NaN";
      } else if (std::isinf(e) || tol == 0) {
        EXPECT_EQ(a, e) << what << " at " << i;
      } else {
        EXPECT_NEAR(a, e, tol) << what << " at " << i;
      }
    }
  }
};

using testing::expect_error;

// --- creation, host transfer, introspection ---

TEST_P(BackendPrimitives, NameAndCpuSupport) {
  EXPECT_EQ(be().name(), GetParam());
  EXPECT_TRUE(be().supports(kCPU));
}

TEST_P(BackendPrimitives, FullInEveryDType) {
  for (DType dt : kAllDTypes) {
    auto x = be().full({2, 3}, 2.5, dt, kCPU);
    EXPECT_EQ(be().shape(x), (Shape{2, 3})) << dtype_name(dt);
    const double expected = dt == DType::boolean ? 1.0 : is_floating(dt) ? 2.5 : 2.0;
    expect_values(host(x), std::vector<double>(6, expected), 0, dtype_name(dt));
  }
  auto scalar = be().full({}, -1, DType::float32, kCPU);
  EXPECT_EQ(be().shape(scalar), Shape{});
  expect_values(host(scalar), {-1});
  auto empty = be().full({0, 4}, 1, DType::float32, kCPU);
  EXPECT_EQ(be().shape(empty), (Shape{0, 4}));
  EXPECT_TRUE(host(empty).empty());
}

TEST_P(BackendPrimitives, FromHostToHostRoundTrip) {
  const std::vector<double> v = {0.1, -2, 1e10, 1.0 / 3, 0, 7};
  expect_values(host(make({2, 3}, v, DType::float64)), v);
  // float32 keeps ~7 digits.
  auto f = host(make({3, 2}, v, DType::float32));
  for (size_t i = 0; i < v.size(); ++i) EXPECT_EQ(f[i], static_cast<double>(static_cast<float>(v[i])));
  // integers truncate toward zero; bool is != 0
  expect_values(host(make({4}, {3.7, -3.7, 0, 2}, DType::int64)), {3, -3, 0, 2});
  expect_values(host(make({4}, {3.7, -3.7, 0, 2}, DType::int32)), {3, -3, 0, 2});
  expect_values(host(make({4}, {3.7, -3.7, 0, 2}, DType::boolean)), {1, 1, 0, 1});
  // int64 beyond float precision is exact
  expect_values(host(make({1}, {1099511627777.0}, DType::int64)), {1099511627777.0});
}

TEST_P(BackendPrimitives, FromHostSizeMismatchThrows) {
  EXPECT_THROW(make({2, 2}, {1, 2, 3}), Error);
  expect_error([&] { make({2, 2}, {1, 2, 3}); }, {"from_host"});
}

TEST_P(BackendPrimitives, BFloat16AndFloat16RoundToNearestEven) {
  // bf16 has 8 significant bits: ulp(1) = 2^-7. 1 + 2^-8 is a tie -> even (1);
  // 1 + 3 * 2^-8 is a tie -> even (1 + 2^-6).
  expect_values(host(make({4}, {1.00390625, 1.01171875, 3.14159, -0.1}, DType::bfloat16)),
                {1.0, 1.015625, 3.140625, -0.10009765625});
  // f16 has 11 significant bits: ulp(2048) = 2; 65520 rounds past the max (65504) to inf.
  expect_values(host(make({4}, {2049, 2051, 65520, 0.1}, DType::float16)), {2048, 2052, kInf, 0.0999755859375});
}

TEST_P(BackendPrimitives, BFloat16ArithmeticRoundsOnStore) {
  auto one = make({2}, {1, 1}, DType::bfloat16);
  auto small = make({2}, {0.00390625, 0.01171875}, DType::bfloat16);  // 2^-8, 3 * 2^-8: exact in bf16
  expect_values(host(bin(BinaryOp::add, one, small)), {1.0, 1.015625});
  // 81 * (1 + 2^-7) = 81.6328125 -> 81.5 in bf16 (ulp 0.5 in [64, 128))
  auto a = make({1}, {81}, DType::bfloat16), b = make({1}, {1.0078125}, DType::bfloat16);
  expect_values(host(bin(BinaryOp::mul, a, b)), {81.5});
  // f16: 2048 + 1 -> 2048
  auto h = make({1}, {2048}, DType::float16), h1 = make({1}, {1}, DType::float16);
  expect_values(host(bin(BinaryOp::add, h, h1)), {2048});
}

TEST_P(BackendPrimitives, ArangeInDTypes) {
  expect_values(host(be().arange(5, DType::int64, kCPU)), {0, 1, 2, 3, 4});
  expect_values(host(be().arange(4, DType::float32, kCPU)), {0, 1, 2, 3});
  expect_values(host(be().arange(3, DType::bfloat16, kCPU)), {0, 1, 2});
  auto empty = be().arange(0, DType::int32, kCPU);
  EXPECT_EQ(be().shape(empty), Shape{0});
}

TEST_P(BackendPrimitives, RandomIsDeterministicAndHasTheRequestedDistribution) {
  const Shape shape = {100, 200};
  auto n1 = host(be().random(shape, RandomKind::normal, 1.0, 2.0, 42, DType::float32, kCPU));
  auto n2 = host(be().random(shape, RandomKind::normal, 1.0, 2.0, 42, DType::float32, kCPU));
  auto n3 = host(be().random(shape, RandomKind::normal, 1.0, 2.0, 43, DType::float32, kCPU));
  EXPECT_EQ(n1, n2);
  EXPECT_NE(n1, n3);
  double mean = 0, sq = 0;
  for (double v : n1) mean += v;
  mean /= n1.size();
  for (double v : n1) sq += (v - mean) * (v - mean);
  EXPECT_NEAR(mean, 1.0, 0.05);
  EXPECT_NEAR(std::sqrt(sq / n1.size()), 2.0, 0.05);

  auto u = host(be().random(shape, RandomKind::uniform, -3.0, 5.0, 7, DType::float64, kCPU));
  double umean = 0;
  for (double v : u) {
    EXPECT_GE(v, -3.0);
    EXPECT_LT(v, 5.0);
    umean += v;
  }
  EXPECT_NEAR(umean / u.size(), 1.0, 0.1);
  auto ub = host(be().random({1000}, RandomKind::uniform, 0.0, 1.0, 9, DType::bfloat16, kCPU));
  for (double v : ub) {
    EXPECT_GE(v, 0.0);
    EXPECT_LT(v, 1.0);
  }
}

TEST_P(BackendPrimitives, ShapeOfViews) {
  auto x = be().full({2, 3, 4}, 0, DType::float32, kCPU);
  EXPECT_EQ(be().shape(be().permute(x, {2, 0, 1})), (Shape{4, 2, 3}));
  EXPECT_EQ(be().shape(be().slice(x, 2, 1, 3)), (Shape{2, 3, 2}));
  EXPECT_EQ(be().shape(be().reshape(x, {6, 4})), (Shape{6, 4}));
  EXPECT_EQ(be().shape(be().expand(be().full({1, 3}, 0, DType::float32, kCPU), {5, 3})), (Shape{5, 3}));
}

TEST_P(BackendPrimitives, ForeignRawIsRejected) {
  RawPtr foreign = std::make_shared<ForeignRaw>();
  EXPECT_THROW(be().shape(foreign), Error);
  EXPECT_THROW(be().to_host(foreign), Error);
}

TEST_P(BackendPrimitives, NonCpuDeviceRejectedWhenUnsupported) {
  if (be().supports(kCUDA)) GTEST_SKIP() << "backend supports cuda";
  expect_error([&] { be().full({2}, 0, DType::float32, kCUDA); }, {"cuda"});
  expect_error([&] { be().from_host({1}, {1}, DType::float32, kCUDA); }, {"cuda"});
  expect_error([&] { be().arange(3, DType::int64, kCUDA); }, {"cuda"});
  expect_error([&] { be().random({2}, RandomKind::normal, 0, 1, 1, DType::float32, kCUDA); }, {"cuda"});
  expect_error([&] { be().to_device(make({1}, {1}), kCUDA); }, {"cuda"});
}

TEST_P(BackendPrimitives, ToDeviceCpuKeepsValues) {
  auto x = make({2}, {1, 2});
  expect_values(host(be().to_device(x, kCPU)), {1, 2});
}

// --- layout ---

TEST_P(BackendPrimitives, CastRules) {
  auto f = make({5}, {2.7, -2.7, 0, -0.5, 3});
  expect_values(host(be().cast(f, DType::int64)), {2, -2, 0, 0, 3});   // toward zero
  expect_values(host(be().cast(f, DType::int32)), {2, -2, 0, 0, 3});
  expect_values(host(be().cast(f, DType::boolean)), {1, 1, 0, 1, 1});  // != 0
  expect_values(host(be().cast(f, DType::float32)), host(f));
  auto b = make({3}, {1, 0, 1}, DType::boolean);
  expect_values(host(be().cast(b, DType::float32)), {1, 0, 1});
  expect_values(host(be().cast(b, DType::int64)), {1, 0, 1});
  auto i = make({3}, {257, -3, 16777217}, DType::int64);
  expect_values(host(be().cast(i, DType::float64)), {257, -3, 16777217});
  expect_values(host(be().cast(i, DType::bfloat16)), {256, -3, 16777216});  // bf16: 8 significant bits
  auto wide = make({2}, {1.00390625, 1.01171875}, DType::float64);
  expect_values(host(be().cast(wide, DType::bfloat16)), {1.0, 1.015625});
  // cast of a non-contiguous view keeps logical order
  auto m = make({2, 3}, {1, 2, 3, 4, 5, 6});
  expect_values(host(be().cast(be().permute(m, {1, 0}), DType::int64)), {1, 4, 2, 5, 3, 6});
}

TEST_P(BackendPrimitives, PermuteGivesLogicalOrder) {
  auto x = make({2, 3}, {1, 2, 3, 4, 5, 6});
  expect_values(host(be().permute(x, {1, 0})), {1, 4, 2, 5, 3, 6});
  // [2, 2, 3] -> [3, 2, 2] with perm {2, 0, 1}: out[k][i][j] = x[i][j][k]
  std::vector<double> v(12);
  for (int i = 0; i < 12; ++i) v[i] = i;
  auto y = be().permute(make({2, 2, 3}, v), {2, 0, 1});
  EXPECT_EQ(be().shape(y), (Shape{3, 2, 2}));
  expect_values(host(y), {0, 3, 6, 9, 1, 4, 7, 10, 2, 5, 8, 11});
  // permuting twice round-trips
  expect_values(host(be().permute(be().permute(x, {1, 0}), {1, 0})), {1, 2, 3, 4, 5, 6});
}

TEST_P(BackendPrimitives, ReshapeOfDenseAndOfViews) {
  auto x = make({2, 3}, {1, 2, 3, 4, 5, 6});
  expect_values(host(be().reshape(x, {3, 2})), {1, 2, 3, 4, 5, 6});
  expect_values(host(be().reshape(x, {6})), {1, 2, 3, 4, 5, 6});
  expect_values(host(be().reshape(x, {1, 2, 1, 3})), {1, 2, 3, 4, 5, 6});
  // a transposed view reshapes in logical order (needs a copy)
  auto t = be().permute(x, {1, 0});
  auto r = be().reshape(t, {6});
  EXPECT_EQ(be().shape(r), Shape{6});
  expect_values(host(r), {1, 4, 2, 5, 3, 6});
  // splitting an axis of a permuted view (no copy needed)
  auto s = be().reshape(be().permute(make({3, 4}, {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11}), {1, 0}), {2, 2, 3});
  expect_values(host(s), {0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11});
  // rank 0 <-> rank 1
  auto scalar = be().reshape(make({1}, {5}), {});
  EXPECT_EQ(be().shape(scalar), Shape{});
  expect_values(host(be().reshape(scalar, {1, 1})), {5});
  EXPECT_THROW(be().reshape(x, {4}), Error);
}

TEST_P(BackendPrimitives, ExpandBroadcastsSizeOneAxes) {
  auto row = make({1, 3}, {1, 2, 3});
  expect_values(host(be().expand(row, {2, 3})), {1, 2, 3, 1, 2, 3});
  auto col = make({2, 1}, {7, 8});
  auto e = be().expand(col, {2, 3});
  expect_values(host(e), {7, 7, 7, 8, 8, 8});
  // ops on an expanded view read it logically
  expect_values(host(bin(BinaryOp::add, e, be().expand(row, {2, 3}))), {8, 9, 10, 9, 10, 11});
  expect_values(host(be().reduce(ReduceOp::sum, e, {1})), {21, 24});
  // an expanded view reshapes and permutes correctly
  expect_values(host(be().reshape(e, {3, 2})), {7, 7, 7, 8, 8, 8});
  expect_values(host(be().permute(e, {1, 0})), {7, 8, 7, 8, 7, 8});
  EXPECT_THROW(be().expand(make({2, 3}, {1, 2, 3, 4, 5, 6}), {4, 3}), Error);
}

TEST_P(BackendPrimitives, SliceIsAViewInLogicalOrder) {
  auto x = make({2, 4}, {0, 1, 2, 3, 4, 5, 6, 7});
  auto s = be().slice(x, 1, 1, 3);
  EXPECT_EQ(be().shape(s), (Shape{2, 2}));
  expect_values(host(s), {1, 2, 5, 6});
  expect_values(host(be().slice(s, 0, 1, 2)), {5, 6});
  expect_values(host(be().slice(x, 0, 1, 2)), {4, 5, 6, 7});
  EXPECT_EQ(be().shape(be().slice(x, 1, 2, 2)), (Shape{2, 0}));
  // slice of a transposed view
  expect_values(host(be().slice(be().permute(x, {1, 0}), 0, 2, 4)), {2, 6, 3, 7});
  // math on a slice
  expect_values(host(bin(BinaryOp::mul, s, s)), {1, 4, 25, 36});
}

TEST_P(BackendPrimitives, ConcatAlongAxes) {
  auto a = make({2, 2}, {1, 2, 3, 4});
  auto b = make({1, 2}, {5, 6});
  expect_values(host(be().concat({a, b}, 0)), {1, 2, 3, 4, 5, 6});
  auto c = make({2, 1}, {9, 10});
  auto r = be().concat({a, c, a}, 1);
  EXPECT_EQ(be().shape(r), (Shape{2, 5}));
  expect_values(host(r), {1, 2, 9, 1, 2, 3, 4, 10, 3, 4});
  // views as inputs
  expect_values(host(be().concat({be().permute(a, {1, 0}), be().expand(b, {2, 2})}, 1)), {1, 3, 5, 6, 2, 4, 5, 6});
  // int and bool
  auto i = be().concat({make({2}, {1, 2}, DType::int64), make({1}, {3}, DType::int64)}, 0);
  expect_values(host(i), {1, 2, 3});
}

TEST_P(BackendPrimitives, ConcatMismatchThrows) {
  auto a = make({2, 2}, {1, 2, 3, 4});
  auto b = make({2, 3}, {1, 2, 3, 4, 5, 6});
  EXPECT_THROW(be().concat({a, b}, 0), Error);
  expect_error([&] { be().concat({a, b}, 0); }, {"concat"});
}

TEST_P(BackendPrimitives, GatherTakesAlongAxis) {
  auto x = make({2, 3}, {10, 11, 12, 20, 21, 22});
  auto idx = make({2, 2}, {2, 0, 1, 1}, DType::int64);
  auto g = be().gather(x, 1, idx);
  EXPECT_EQ(be().shape(g), (Shape{2, 2}));
  expect_values(host(g), {12, 10, 21, 21});
  // axis 0, more indices than x has along the axis
  auto idx0 = make({3, 3}, {1, 0, 1, 0, 0, 0, 1, 1, 1}, DType::int64);
  expect_values(host(be().gather(x, 0, idx0)), {20, 11, 22, 10, 11, 12, 20, 21, 22});
  // x as a transposed view
  auto xt = be().permute(x, {1, 0});  // [[10,20],[11,21],[12,22]]
  auto idxt = make({3, 1}, {1, 0, 1}, DType::int64);
  expect_values(host(be().gather(xt, 1, idxt)), {20, 11, 22});
}

TEST_P(BackendPrimitives, GatherOutOfRangeThrowsWithIndexAndExtent) {
  auto x = make({2, 3}, {10, 11, 12, 20, 21, 22});
  auto bad = make({2, 1}, {0, 7}, DType::int64);
  EXPECT_THROW(be().gather(x, 1, bad), Error);
  expect_error([&] { be().gather(x, 1, bad); }, {"7", "3"});
}

// --- math ---

TEST_P(BackendPrimitives, BinaryArithmeticOnFloats) {
  for (DType dt : kFloatDTypes) {
    auto a = make({4}, {1, -2, 3, 0.5}, dt);
    auto b = make({4}, {2, 4, -1, 0.5}, dt);
    const std::string w = dtype_name(dt);
    expect_values(host(bin(BinaryOp::add, a, b)), {3, 2, 2, 1}, 0, w);
    expect_values(host(bin(BinaryOp::sub, a, b)), {-1, -6, 4, 0}, 0, w);
    expect_values(host(bin(BinaryOp::mul, a, b)), {2, -8, -3, 0.25}, 0, w);
    expect_values(host(bin(BinaryOp::div, a, b)), {0.5, -0.5, -3, 1}, 0, w);
    expect_values(host(bin(BinaryOp::maximum, a, b)), {2, 4, 3, 0.5}, 0, w);
    expect_values(host(bin(BinaryOp::minimum, a, b)), {1, -2, -1, 0.5}, 0, w);
  }
  auto z = make({2}, {1, -1});
  auto zero = make({2}, {0, 0});
  expect_values(host(bin(BinaryOp::div, z, zero)), {kInf, -kInf});
}

TEST_P(BackendPrimitives, BinaryBroadcastsSizeOneAxes) {
  auto col = make({2, 1}, {1, 2});
  auto row = make({1, 3}, {10, 20, 30});
  auto s = bin(BinaryOp::add, col, row);
  EXPECT_EQ(be().shape(s), (Shape{2, 3}));
  expect_values(host(s), {11, 21, 31, 12, 22, 32});
  expect_values(host(bin(BinaryOp::sub, row, col)), {9, 19, 29, 8, 18, 28});
  auto m = make({2, 3}, {1, 2, 3, 4, 5, 6});
  expect_values(host(bin(BinaryOp::mul, m, make({1, 1}, {2}))), {2, 4, 6, 8, 10, 12});
  expect_values(host(bin(BinaryOp::div, make({1, 1}, {12}), m)), {12, 6, 4, 3, 2.4, 2}, 1e-6);
  // rank 0
  expect_values(host(bin(BinaryOp::add, make({}, {1.5}), make({}, {2}))), {3.5});
  // 3-d with broadcast in the middle, on a permuted operand
  auto a = make({2, 1, 2}, {1, 2, 3, 4});
  auto b = be().permute(make({2, 3, 1}, {0, 10, 20, 0, 10, 20}), {2, 1, 0});  // [1, 3, 2]
  expect_values(host(bin(BinaryOp::add, a, b)), {1, 2, 11, 12, 21, 22, 3, 4, 13, 14, 23, 24});
  // broadcasting to size 0
  EXPECT_EQ(be().shape(bin(BinaryOp::add, make({1, 2}, {1, 2}), be().full({0, 2}, 0, DType::float32, kCPU))),
            (Shape{0, 2}));
}

TEST_P(BackendPrimitives, BinaryShapeMismatchThrowsNamingShapes) {
  auto a = be().full({2, 3}, 1, DType::float32, kCPU);
  auto b = be().full({4, 3}, 1, DType::float32, kCPU);
  EXPECT_THROW(bin(BinaryOp::add, a, b), Error);
  expect_error([&] { bin(BinaryOp::add, a, b); }, {"[2, 3]", "[4, 3]"});
  expect_error([&] { be().where(be().full({2, 3}, 1, DType::boolean, kCPU), a, b); }, {"[2, 3]", "[4, 3]"});
}

TEST_P(BackendPrimitives, BinaryDTypeMismatchThrowsNamingDTypes) {
  auto a = be().full({2}, 1, DType::float32, kCPU);
  auto b = be().full({2}, 1, DType::int64, kCPU);
  EXPECT_THROW(bin(BinaryOp::add, a, b), Error);
  expect_error([&] { bin(BinaryOp::mul, a, b); }, {"float32", "int64"});
}

TEST_P(BackendPrimitives, ComparisonsReturnBool) {
  auto a = make({3}, {1, 2, 3});
  auto b = make({3}, {2, 2, 2});
  expect_values(host(bin(BinaryOp::eq, a, b)), {0, 1, 0});
  expect_values(host(bin(BinaryOp::ne, a, b)), {1, 0, 1});
  expect_values(host(bin(BinaryOp::lt, a, b)), {1, 0, 0});
  expect_values(host(bin(BinaryOp::le, a, b)), {1, 1, 0});
  expect_values(host(bin(BinaryOp::gt, a, b)), {0, 0, 1});
  expect_values(host(bin(BinaryOp::ge, a, b)), {0, 1, 1});
  // the result is bool: where() accepts it as cond
  auto lt = bin(BinaryOp::lt, a, b);
  expect_values(host(be().where(lt, a, b)), {1, 2, 2});
  // and it combines with other bools
  auto t = make({3}, {1, 1, 0}, DType::boolean);
  expect_values(host(bin(BinaryOp::logical_and, lt, t)), {1, 0, 0});
  // NaN compares unequal
  auto n = make({1}, {std::nan("")});
  expect_values(host(bin(BinaryOp::eq, n, n)), {0});
  expect_values(host(bin(BinaryOp::ne, n, n)), {1});
}

TEST_P(BackendPrimitives, LogicalOps) {
  auto a = make({4}, {0, 0, 1, 1}, DType::boolean);
  auto b = make({4}, {0, 1, 0, 1}, DType::boolean);
  expect_values(host(bin(BinaryOp::logical_and, a, b)), {0, 0, 0, 1});
  expect_values(host(bin(BinaryOp::logical_or, a, b)), {0, 1, 1, 1});
  expect_values(host(be().unary(UnaryOp::logical_not, a)), {1, 1, 0, 0});
  // broadcast
  auto one = make({1}, {1}, DType::boolean);
  expect_values(host(bin(BinaryOp::logical_and, a, one)), {0, 0, 1, 1});
}

TEST_P(BackendPrimitives, IntegerArithmetic) {
  for (DType dt : {DType::int32, DType::int64}) {
    const std::string w = dtype_name(dt);
    auto a = make({4}, {7, -3, 0, 100}, dt);
    auto b = make({4}, {2, 5, -1, 100}, dt);
    expect_values(host(bin(BinaryOp::add, a, b)), {9, 2, -1, 200}, 0, w);
    expect_values(host(bin(BinaryOp::sub, a, b)), {5, -8, 1, 0}, 0, w);
    expect_values(host(bin(BinaryOp::mul, a, b)), {14, -15, 0, 10000}, 0, w);
    expect_values(host(bin(BinaryOp::maximum, a, b)), {7, 5, 0, 100}, 0, w);
    expect_values(host(bin(BinaryOp::minimum, a, b)), {2, -3, -1, 100}, 0, w);
    expect_values(host(bin(BinaryOp::lt, a, b)), {0, 1, 0, 0}, 0, w);
    expect_values(host(bin(BinaryOp::eq, a, b)), {0, 0, 0, 1}, 0, w);
    expect_values(host(be().unary(UnaryOp::neg, a)), {-7, 3, 0, -100}, 0, w);
    expect_values(host(be().unary(UnaryOp::abs, a)), {7, 3, 0, 100}, 0, w);
    auto m = make({2, 3}, {1, 5, -2, 4, 0, 9}, dt);
    expect_values(host(be().reduce(ReduceOp::sum, m, {1})), {4, 13}, 0, w);
    expect_values(host(be().reduce(ReduceOp::max, m, {0})), {4, 5, 9}, 0, w);
    expect_values(host(be().reduce(ReduceOp::min, m, {0, 1})), {-2}, 0, w);
  }
  // int64 stays exact past float precision
  auto big = make({1}, {1099511627776.0}, DType::int64);
  auto one = make({1}, {1}, DType::int64);
  expect_values(host(bin(BinaryOp::add, big, one)), {1099511627777.0});
}

TEST_P(BackendPrimitives, UnaryMath) {
  auto x = make({4}, {1, 4, 0.25, 2});
  expect_values(host(be().unary(UnaryOp::neg, x)), {-1, -4, -0.25, -2});
  expect_values(host(be().unary(UnaryOp::exp, x)), {std::exp(1.0), std::exp(4.0), std::exp(0.25), std::exp(2.0)}, 1e-4);
  expect_values(host(be().unary(UnaryOp::log, x)), {0, std::log(4.0), std::log(0.25), std::log(2.0)}, 1e-6);
  expect_values(host(be().unary(UnaryOp::sqrt, x)), {1, 2, 0.5, std::sqrt(2.0)}, 1e-6);
  expect_values(host(be().unary(UnaryOp::abs, make({3}, {-1.5, 0, 2}))), {1.5, 0, 2});
  expect_values(host(be().unary(UnaryOp::tanh, make({4}, {-30, -0.5, 0, 2}))),
                {-1, std::tanh(-0.5), 0, std::tanh(2.0)}, 1e-6);
  // edge values
  auto e = make({3}, {0, -1, -kInf});
  expect_values(host(be().unary(UnaryOp::log, e)), {-kInf, std::nan(""), std::nan("")});
  expect_values(host(be().unary(UnaryOp::exp, e)), {1, std::exp(-1.0), 0}, 1e-6);
  expect_values(host(be().unary(UnaryOp::sqrt, e)), {0, std::nan(""), std::nan("")});
  // float64 keeps full precision, bf16 rounds
  expect_values(host(be().unary(UnaryOp::exp, make({1}, {1}, DType::float64))), {std::exp(1.0)}, 1e-15);
  expect_values(host(be().unary(UnaryOp::exp, make({1}, {1}, DType::bfloat16))), {2.71875});
  // a strided (transposed) operand
  auto t = be().permute(make({2, 2}, {0, 1, 2, 3}), {1, 0});
  expect_values(host(be().unary(UnaryOp::neg, t)), {-0.0, -2, -1, -3});
  expect_values(host(be().unary(UnaryOp::exp, t)), {1, std::exp(2.0), std::exp(1.0), std::exp(3.0)}, 1e-5);
}

TEST_P(BackendPrimitives, WhereSelectsWithBroadcasting) {
  auto cond = make({2, 1}, {1, 0}, DType::boolean);
  auto a = make({2, 3}, {1, 2, 3, 4, 5, 6});
  auto b = make({1, 1}, {-kInf});
  expect_values(host(be().where(cond, a, b)), {1, 2, 3, -kInf, -kInf, -kInf});
  auto c2 = make({1, 3}, {0, 1, 0}, DType::boolean);
  expect_values(host(be().where(c2, a, make({2, 3}, {0, 0, 0, 0, 0, 0}))), {0, 2, 0, 0, 5, 0});
  // integers
  auto ia = make({2}, {1, 2}, DType::int64), ib = make({2}, {-1, -2}, DType::int64);
  expect_values(host(be().where(make({2}, {0, 1}, DType::boolean), ia, ib)), {-1, 2});
  EXPECT_THROW(be().where(cond, a, make({1, 1}, {0}, DType::int64)), Error);
}

TEST_P(BackendPrimitives, ReduceSumMaxMinMean) {
  auto x = make({2, 3}, {1, 5, -2, 4, 0, 9});
  auto s1 = be().reduce(ReduceOp::sum, x, {1});
  EXPECT_EQ(be().shape(s1), Shape{2});
  expect_values(host(s1), {4, 13});
  expect_values(host(be().reduce(ReduceOp::sum, x, {0})), {5, 5, 7});
  auto all = be().reduce(ReduceOp::sum, x, {0, 1});
  EXPECT_EQ(be().shape(all), Shape{});
  expect_values(host(all), {17});
  expect_values(host(be().reduce(ReduceOp::max, x, {1})), {5, 9});
  expect_values(host(be().reduce(ReduceOp::min, x, {0})), {1, 0, -2});
  expect_values(host(be().reduce(ReduceOp::mean, x, {1})), {4.0 / 3, 13.0 / 3}, 1e-6);
  // a middle axis of a 3-d tensor, and two non-adjacent axes
  std::vector<double> v(12);
  for (int i = 0; i < 12; ++i) v[i] = i;
  auto t = make({2, 3, 2}, v);
  expect_values(host(be().reduce(ReduceOp::sum, t, {1})), {6, 9, 24, 27});
  expect_values(host(be().reduce(ReduceOp::max, t, {0, 2})), {7, 9, 11});
  // on a transposed view
  expect_values(host(be().reduce(ReduceOp::sum, be().permute(x, {1, 0}), {1})), {5, 5, 7});
  // bf16 accumulates in float32 before rounding: 256 + 1 * 8 = 264 exactly
  auto h = make({9}, {256, 1, 1, 1, 1, 1, 1, 1, 1}, DType::bfloat16);
  expect_values(host(be().reduce(ReduceOp::sum, h, {0})), {264});
}

TEST_P(BackendPrimitives, ReduceOverEmptyAxis) {
  auto x = be().full({2, 0}, 1, DType::float32, kCPU);
  expect_values(host(be().reduce(ReduceOp::sum, x, {1})), {0, 0});
  expect_values(host(be().reduce(ReduceOp::max, x, {1})), {-kInf, -kInf});
  expect_values(host(be().reduce(ReduceOp::logsumexp, x, {1})), {-kInf, -kInf});
}

TEST_P(BackendPrimitives, LogsumexpIsStable) {
  auto x = make({3, 2}, {1000, 1000, -kInf, -kInf, 0, -kInf});
  expect_values(host(be().reduce(ReduceOp::logsumexp, x, {1})), {1000 + std::log(2.0), -kInf, 0}, 1e-3);
  auto small = make({1, 3}, {1, 2, 3}, DType::float64);
  expect_values(host(be().reduce(ReduceOp::logsumexp, small, {1})),
                {std::log(std::exp(1.0) + std::exp(2.0) + std::exp(3.0))}, 1e-12);
  expect_values(host(be().reduce(ReduceOp::logsumexp, make({2}, {-1000, -1000}), {0})), {-1000 + std::log(2.0)},
                1e-3);
}

TEST_P(BackendPrimitives, SoftmaxAndLogSoftmax) {
  auto x = make({2, 3}, {1, 2, 3, 1000, 1000, 1000}, DType::float64);
  const double z = std::exp(1.0) + std::exp(2.0) + std::exp(3.0);
  const std::vector<double> row0 = {std::exp(1.0) / z, std::exp(2.0) / z, std::exp(3.0) / z};
  expect_values(host(be().softmax(x, 1, false)), {row0[0], row0[1], row0[2], 1.0 / 3, 1.0 / 3, 1.0 / 3}, 1e-12);
  expect_values(host(be().softmax(x, 1, true)),
                {std::log(row0[0]), std::log(row0[1]), std::log(row0[2]), -std::log(3.0), -std::log(3.0),
                 -std::log(3.0)},
                1e-12);
  // over axis 0: columns [1, 1000] etc.
  const double p = 1.0 / (1.0 + std::exp(999.0));
  expect_values(host(be().softmax(make({2, 1}, {1, 1000}, DType::float64), 0, false)), {p, 1 - p}, 1e-12);
  // a middle axis of a 3-d tensor
  auto t = make({1, 2, 2}, {0, 0, 0, std::log(3.0)});
  expect_values(host(be().softmax(t, 1, false)), {0.5, 0.25, 0.5, 0.75}, 1e-6);
  // -inf entries get weight 0
  expect_values(host(be().softmax(make({3}, {0, -kInf, 0}), 0, false)), {0.5, 0, 0.5}, 1e-7);
  // bf16 computes in float32 and rounds
  expect_values(host(be().softmax(make({2}, {0, std::log(3.0)}, DType::bfloat16), 0, false)), {0.25, 0.75}, 1e-2);
}

TEST_P(BackendPrimitives, SoftmaxOfAllNegInfRowDoesNotCrash) {
  auto x = make({2, 2}, {-kInf, -kInf, 0, 0});
  auto y = host(be().softmax(x, 1, false));
  ASSERT_EQ(y.size(), 4u);
  EXPECT_NEAR(y[2], 0.5, 1e-7);
  EXPECT_NEAR(y[3], 0.5, 1e-7);
}

TEST_P(BackendPrimitives, BmmSmall) {
  // [[1,2,3],[4,5,6]] x [[1,0],[0,1],[1,1]] = [[4,5],[10,11]]
  auto a = make({1, 2, 3}, {1, 2, 3, 4, 5, 6});
  auto b = make({1, 3, 2}, {1, 0, 0, 1, 1, 1});
  auto c = be().bmm(a, b);
  EXPECT_EQ(be().shape(c), (Shape{1, 2, 2}));
  expect_values(host(c), {4, 5, 10, 11});
  // two batches, float64
  auto a2 = make({2, 1, 2}, {1, 2, 3, 4}, DType::float64);
  auto b2 = make({2, 2, 1}, {5, 6, 7, 8}, DType::float64);
  expect_values(host(be().bmm(a2, b2)), {17, 53});
  // K = 0 gives zeros
  auto e = be().bmm(be().full({1, 2, 0}, 1, DType::float32, kCPU), be().full({1, 0, 3}, 1, DType::float32, kCPU));
  expect_values(host(e), {0, 0, 0, 0, 0, 0});
}

TEST_P(BackendPrimitives, BmmOfStridedViews) {
  // b given as a transposed view of [B, N, K] (the k^T of attention)
  auto a = make({1, 2, 3}, {1, 2, 3, 4, 5, 6});
  auto bt = make({1, 2, 3}, {1, 0, 1, 0, 1, 1});  // [N, K] rows: [1,0,1], [0,1,1]
  auto b = be().permute(bt, {0, 2, 1});
  expect_values(host(be().bmm(a, b)), {4, 5, 10, 11});
  // a as a transposed view, batch as a permuted axis
  auto at = be().permute(make({3, 1, 2}, {1, 4, 2, 5, 3, 6}), {1, 2, 0});  // [1, 2, 3]
  expect_values(host(be().bmm(at, b)), {4, 5, 10, 11});
  // an expanded (broadcast) batch
  auto ae = be().expand(a, {3, 2, 3});
  expect_values(host(be().bmm(ae, be().expand(b, {3, 3, 2}))), {4, 5, 10, 11, 4, 5, 10, 11, 4, 5, 10, 11});
  // a slice along K
  auto as = be().slice(a, 2, 0, 2);                                  // [[1,2],[4,5]]
  auto bs = be().slice(make({1, 3, 2}, {1, 0, 0, 1, 1, 1}), 1, 0, 2);  // identity
  expect_values(host(be().bmm(as, bs)), {1, 2, 4, 5});
}

TEST_P(BackendPrimitives, BmmReducedPrecisionAndIntegers) {
  // bf16: 1*1 + 1*(2^-8) + 1*(2^-8) = 1.0078125 exact in float32, exact in bf16
  auto a = make({1, 1, 3}, {1, 1, 1}, DType::bfloat16);
  auto b = make({1, 3, 1}, {1, 0.00390625, 0.00390625}, DType::bfloat16);
  expect_values(host(be().bmm(a, b)), {1.0078125});
  // f16
  auto h = be().bmm(make({1, 1, 2}, {1, 2}, DType::float16), make({1, 2, 1}, {3, 4}, DType::float16));
  expect_values(host(h), {11});
  auto i = be().bmm(make({1, 1, 2}, {3, 4}, DType::int64), make({1, 2, 2}, {1, 2, 3, 4}, DType::int64));
  expect_values(host(i), {15, 22});
}

TEST_P(BackendPrimitives, BmmShapeMismatchThrows) {
  auto a = be().full({2, 3, 4}, 1, DType::float32, kCPU);
  auto b = be().full({2, 5, 6}, 1, DType::float32, kCPU);
  EXPECT_THROW(be().bmm(a, b), Error);
  expect_error([&] { be().bmm(a, b); }, {"[2, 3, 4]", "[2, 5, 6]"});
  EXPECT_THROW(be().bmm(a, be().full({2, 4, 6}, 1, DType::float64, kCPU)), Error);
}

TEST_P(BackendPrimitives, LargerBmmMatchesNaiveProduct) {
  const int64_t B = 2, M = 17, K = 33, N = 9;
  auto av = host(be().random({B, M, K}, RandomKind::normal, 0, 1, 1, DType::float64, kCPU));
  auto bv = host(be().random({B, K, N}, RandomKind::normal, 0, 1, 2, DType::float64, kCPU));
  std::vector<double> expected(B * M * N, 0.0);
  for (int64_t bi = 0; bi < B; ++bi)
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n)
        for (int64_t k = 0; k < K; ++k)
          expected[(bi * M + m) * N + n] += av[(bi * M + m) * K + k] * bv[(bi * K + k) * N + n];
  // The same operands stored transposed ([B, K, M] and [B, N, K]) and viewed back.
  std::vector<double> at(av.size()), bt(bv.size());
  for (int64_t bi = 0; bi < B; ++bi) {
    for (int64_t m = 0; m < M; ++m)
      for (int64_t k = 0; k < K; ++k) at[(bi * K + k) * M + m] = av[(bi * M + m) * K + k];
    for (int64_t k = 0; k < K; ++k)
      for (int64_t n = 0; n < N; ++n) bt[(bi * N + n) * K + k] = bv[(bi * K + k) * N + n];
  }
  for (DType dt : {DType::float64, DType::float32}) {
    const double tol = dt == DType::float64 ? 1e-10 : 1e-4;
    auto a = make({B, M, K}, av, dt), b = make({B, K, N}, bv, dt);
    auto a_t = be().permute(make({B, K, M}, at, dt), {0, 2, 1});
    auto b_t = be().permute(make({B, N, K}, bt, dt), {0, 2, 1});
    expect_values(host(be().bmm(a, b)), expected, tol, dtype_name(dt));
    expect_values(host(be().bmm(a_t, b)), expected, tol, "a transposed");
    expect_values(host(be().bmm(a, b_t)), expected, tol, "b transposed");
    expect_values(host(be().bmm(a_t, b_t)), expected, tol, "both transposed");
  }
}

std::string param_name(const ::testing::TestParamInfo<std::string>& info) { return info.param; }

INSTANTIATE_TEST_SUITE_P(AllBackends, BackendPrimitives, ::testing::ValuesIn(backend_names()), param_name);
// A build with every backend compiled out registers none.
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(BackendPrimitives);

}  // namespace
}  // namespace dimattn
