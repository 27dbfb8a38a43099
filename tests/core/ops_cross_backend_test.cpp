// The named ops on random inputs on every registered backend, compared with
// each other (the first backend is the reference).
#include "ops_test_util.h"

namespace dimattn {
namespace {

using namespace dimattn::testing;

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
