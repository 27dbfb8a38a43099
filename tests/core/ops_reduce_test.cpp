// Named ops on every backend: reductions and softmax, static and over the
// padding of dynamic dims.
#include "ops_test_util.h"

namespace dimattn {
namespace {

using namespace dimattn::testing;

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

}  // namespace
}  // namespace dimattn
