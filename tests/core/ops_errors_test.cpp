// Named ops on every backend given bad input: each error names its op and
// the offending dims with their sizes.
#include "ops_test_util.h"

namespace dimattn {
namespace {

using namespace dimattn::testing;

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

}  // namespace
}  // namespace dimattn
