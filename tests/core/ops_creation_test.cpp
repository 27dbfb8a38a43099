// Named ops on every backend: creation, random, casts, host and backend
// transfer, copy_transpose and align.
#include "ops_test_util.h"

namespace dimattn {
namespace {

using namespace dimattn::testing;

// The one instantiation of the Ops suite: the TEST_Ps of every ops_*_test.cpp.
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

}  // namespace
}  // namespace dimattn
