// Named ops on every backend that make, relabel or rearrange dims:
// range_over_dim, sequence_mask, replace/merge/split/expand/squeeze, concat,
// slice and gather.
#include "ops_test_util.h"

namespace dimattn {
namespace {

using namespace dimattn::testing;

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

}  // namespace
}  // namespace dimattn
