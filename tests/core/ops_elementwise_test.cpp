// Named ops on every backend: dropout, arithmetic, math, compare, logical
// and where, broadcasting over the union of dims.
#include "ops_test_util.h"

namespace dimattn {
namespace {

using namespace dimattn::testing;

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

}  // namespace
}  // namespace dimattn
