// Dim: identity semantics, static and dynamic dims, repr, and the cached
// product / quotient dims used to merge and split heads.
#include <gtest/gtest.h>

#include <set>
#include <string>

#include "dimattn/ext/backend.h"
#include "dimattn/dim.h"
#include "dimattn/error.h"
#include "dimattn/ops.h"
#include "dimattn/tensor.h"
#include "support/test_util.h"

namespace dimattn {
namespace {

using testing::expect_error;

Tensor int_lengths(const Dim& batch, const std::vector<double>& values, DType dtype = DType::int64) {
  return from_host({batch}, values, {.dtype = dtype});
}

TEST(Dim, CopiesCompareEqual) {
  Dim time("time", 5);
  Dim copy = time;
  Dim copy2(copy);
  EXPECT_EQ(time, copy);
  EXPECT_EQ(copy, copy2);
  EXPECT_FALSE(time != copy);
  EXPECT_EQ(copy.name(), "time");
  EXPECT_EQ(copy.extent(), 5);
}

TEST(Dim, SeparatelyMadeDimsNeverEqual) {
  Dim a("time", 5);
  Dim b("time", 5);
  EXPECT_NE(a, b);
  EXPECT_FALSE(a == b);
  // The order is strict and consistent, so both live side by side in a set.
  EXPECT_TRUE((a < b) != (b < a));
  std::set<Dim> s{a, b, a};
  EXPECT_EQ(s.size(), 2u);
  EXPECT_TRUE(contains({a}, a));
  EXPECT_FALSE(contains({a}, b));
  EXPECT_EQ(index_of({b, a}, a), 1);
  EXPECT_EQ(index_of({b}, a), -1);
}

TEST(Dim, TensorsDistinguishDimsByIdentity) {
  Dim a("feat", 3);
  Dim b("feat", 3);
  Tensor x = zeros({a});
  EXPECT_TRUE(x.has(a));
  EXPECT_FALSE(x.has(b));
  // Same name and size, different dim: the union has both.
  Tensor y = add(zeros({a}), zeros({b}));
  EXPECT_EQ(y.rank(), 2);
}

TEST(Dim, StaticDim) {
  Dim d("feat", 7);
  EXPECT_FALSE(d.is_dynamic());
  EXPECT_EQ(d.extent(), 7);
  ASSERT_TRUE(d.static_size().has_value());
  EXPECT_EQ(*d.static_size(), 7);
  Dim empty("none", 0);
  EXPECT_EQ(empty.extent(), 0);
}

TEST(Dim, StaticDimNegativeSizeIsAnError) {
  expect_error([] { Dim d("feat", -2); }, "Dim", {"feat", "-2"});
}

TEST(Dim, StaticDimWithoutLengthsIsAnError) {
  Dim d("feat", 4);
  expect_error([&] { (void)d.lengths(); }, "Dim", {"feat[4]"});
}

TEST(Dim, DynamicDimExtentIsMaxLength) {
  Dim batch("batch", 3);
  Dim time = Dim::dynamic("time", int_lengths(batch, {2, 5, 3}));
  EXPECT_TRUE(time.is_dynamic());
  EXPECT_FALSE(time.static_size().has_value());
  EXPECT_EQ(time.extent(), 5);
  EXPECT_EQ(time.name(), "time");
  ASSERT_EQ(time.lengths().dims(), Dims{batch});
  EXPECT_EQ(to_host(time.lengths()), (std::vector<double>{2, 5, 3}));
}

TEST(Dim, DynamicDimInt32Lengths) {
  Dim batch("batch", 2);
  Dim time = Dim::dynamic("time", int_lengths(batch, {4, 1}, DType::int32));
  EXPECT_EQ(time.extent(), 4);
}

TEST(Dim, DynamicDimAllZeroLengths) {
  Dim batch("batch", 2);
  Dim time = Dim::dynamic("time", int_lengths(batch, {0, 0}));
  EXPECT_EQ(time.extent(), 0);
}

TEST(Dim, DynamicDimExplicitExtent) {
  Dim batch("batch", 3);
  Dim time = Dim::dynamic("time", int_lengths(batch, {2, 5, 3}), 8);
  EXPECT_EQ(time.extent(), 8);
  Dim exact = Dim::dynamic("exact", int_lengths(batch, {2, 5, 3}), 5);
  EXPECT_EQ(exact.extent(), 5);
}

TEST(Dim, DynamicDimExtentBelowLongestLengthIsAnError) {
  Dim batch("batch", 3);
  expect_error([&] { Dim::dynamic("time", int_lengths(batch, {2, 5, 3}), 4); }, "Dim", {"time", "4", "5"});
}

TEST(Dim, DynamicDimNegativeLengthIsAnError) {
  Dim batch("batch", 3);
  expect_error([&] { Dim::dynamic("time", int_lengths(batch, {2, -1, 3})); }, "Dim",
               {"time", "-1", "batch[3]"});
}

TEST(Dim, DynamicDimNonIntegerLengthsAreAnError) {
  Dim batch("batch", 2);
  expect_error([&] { Dim::dynamic("time", from_host({batch}, {1.5, 2})); }, "Dim", {"time", "float32"});
  expect_error([&] { Dim::dynamic("time", from_host({batch}, {1, 0}, {.dtype = DType::boolean})); }, "Dim",
               {"time", "bool"});
}

TEST(Dim, DynamicDimsWithSameLengthsAreDistinct) {
  Dim batch("batch", 2);
  Tensor lengths = int_lengths(batch, {1, 2});
  Dim a = Dim::dynamic("time", lengths);
  Dim b = Dim::dynamic("time", lengths);
  EXPECT_NE(a, b);
  Dim copy = a;
  EXPECT_EQ(copy, a);
  EXPECT_TRUE(copy.is_dynamic());
}

TEST(Dim, Repr) {
  Dim batch("batch", 3);
  Dim time = Dim::dynamic("time", int_lengths(batch, {2, 7, 3}));
  EXPECT_EQ(Dim("feat", 7).repr(), "feat[7]");
  EXPECT_EQ(batch.repr(), "batch[3]");
  EXPECT_EQ(time.repr(), "time[<=7 over batch]");
  EXPECT_EQ(repr(Dims{batch, time}), "(batch[3], time[<=7 over batch])");
  EXPECT_EQ(repr(Dims{}), "()");
}

TEST(Dim, ReprOfDynamicDimOverTwoDims) {
  Dim beam("beam", 2);
  Dim batch("batch", 2);
  Dim time = Dim::dynamic("time", from_host({batch, beam}, {1, 2, 3, 4}, {.dtype = DType::int32}));
  EXPECT_EQ(time.repr(), "time[<=4 over batch,beam]");
}

TEST(Dim, TensorReprNamesDims) {
  Dim batch("batch", 3);
  Tensor x = zeros({batch});
  const std::string r = x.repr();
  EXPECT_NE(r.find("float32"), std::string::npos) << r;
  EXPECT_NE(r.find("batch[3]"), std::string::npos) << r;
  EXPECT_NE(r.find(x.backend().name()), std::string::npos) << r;
}

TEST(Dim, ProductIsTheSameObjectEachCall) {
  Dim heads("heads", 4);
  Dim per_head("per_head", 8);
  Dim p1 = heads * per_head;
  Dim p2 = heads * per_head;
  EXPECT_EQ(p1, p2);
  EXPECT_EQ(p1.extent(), 32);
  EXPECT_FALSE(p1.is_dynamic());
  // The order of the factors matters: per_head * heads is another dim.
  Dim swapped = per_head * heads;
  EXPECT_NE(swapped, p1);
  EXPECT_EQ(swapped, per_head * heads);
  // A separately made dim of the same name and size is not the product.
  EXPECT_NE(Dim(p1.name(), 32), p1);
}

TEST(Dim, ProductSurvivesWhileHeld) {
  Dim heads("heads", 2);
  Dim total = heads * Dim("per_head", 3);  // the factor is a temporary
  EXPECT_EQ(total.extent(), 6);
  EXPECT_EQ(total.divide_by(heads).extent(), 3);
}

TEST(Dim, DivideByRecoversTheFactor) {
  Dim heads("heads", 4);
  Dim per_head("per_head", 8);
  Dim total = heads * per_head;
  EXPECT_EQ(total.divide_by(heads), per_head);
  EXPECT_EQ(total.divide_by(per_head), heads);
  EXPECT_EQ(total.divide_by(heads), total.divide_by(heads));
}

TEST(Dim, DivideByOfPlainDimIsCached) {
  Dim total("total", 12);
  Dim heads("heads", 3);
  Dim q1 = total.divide_by(heads);
  Dim q2 = total.divide_by(heads);
  EXPECT_EQ(q1, q2);
  EXPECT_EQ(q1.extent(), 4);
  EXPECT_FALSE(q1.is_dynamic());
  // A different factor object of the same size gives a different quotient.
  Dim other_heads("heads", 3);
  EXPECT_NE(total.divide_by(other_heads), q1);
  EXPECT_EQ(total.divide_by(other_heads).extent(), 4);
}

TEST(Dim, DivideByNonDivisibleIsAnError) {
  Dim total("total", 10);
  Dim heads("heads", 3);
  expect_error([&] { total.divide_by(heads); }, "Dim", {"total[10]", "heads[3]", "not divisible"});
  Dim zero("zero", 0);
  expect_error([&] { total.divide_by(zero); }, "Dim", {"total[10]", "zero[0]"});
}

TEST(Dim, ProductOfDynamicDimsIsAnError) {
  Dim batch("batch", 2);
  Dim time = Dim::dynamic("time", int_lengths(batch, {1, 2}));
  Dim feat("feat", 3);
  expect_error([&] { (void)(time * feat); }, "Dim", {"time[<=2 over batch]", "feat[3]"});
  expect_error([&] { (void)(feat * time); }, "Dim", {"time[<=2 over batch]", "feat[3]"});
}

TEST(Dim, MergeAndSplitThroughProductDims) {
  // The product dim of heads * per_head works as merge_dims' out dim, and
  // split_dims with the recovered factors gives the original tensor back.
  Dim heads("heads", 2);
  Dim per_head("per_head", 3);
  Dim total = heads * per_head;
  Tensor x = from_host({heads, per_head}, {0, 1, 2, 3, 4, 5});
  auto [merged, out] = merge_dims(x, {heads, per_head}, heads * per_head);
  EXPECT_EQ(out, total);
  EXPECT_EQ(to_host(merged), (std::vector<double>{0, 1, 2, 3, 4, 5}));
  Tensor back = split_dims(merged, total, {heads, total.divide_by(heads)});
  EXPECT_EQ(back.dims(), (Dims{heads, per_head}));
  EXPECT_EQ(to_host(back), (std::vector<double>{0, 1, 2, 3, 4, 5}));
}

}  // namespace
}  // namespace dimattn
