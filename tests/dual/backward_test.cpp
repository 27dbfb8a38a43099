// dot_attention_backward (the Eigen backend's gradients through cpu_flash)
// against the torch backend's autograd through the reference path.
#include "dimattn/attention.h"
#include "dimattn/forcing.h"
#include "dimattn/run_context.h"
#include "support/test_util.h"

namespace dimattn {
namespace {

TEST(Backward, EigenGradientsMatchTorchAutogradOfTheReference) {
  if (!has_backend("torch") || !has_backend("eigen")) GTEST_SKIP() << "needs both backends";
  Dim batch("batch", 2), heads("kv_heads", 2), group("group", 2), feat("feat", 8), vfeat("vfeat", 4);
  Dim time = Dim::dynamic("time", from_host({batch}, {6, 3}, {.dtype = DType::int64, .backend = "eigen"}), 6);
  for (const DType dt : {DType::float64, DType::float32}) {
    for (bool causal : {false, true}) {
      for (double dropout : {0.0, 0.25}) {
        const TensorOptions eo{.dtype = dt, .backend = "eigen"};
        Tensor q = random_normal({batch, heads, group, time, feat}, 1, eo);
        Tensor k = random_normal({batch, heads, time, feat}, 2, eo);
        Tensor v = random_normal({batch, heads, time, vfeat}, 3, eo);
        // reduce_sum below skips padded query rows, so their upstream gradient is 0.
        Tensor dout = where(sequence_mask(time, eo), random_normal({batch, heads, group, time, vfeat}, 4, eo), 0.0);
        AttentionOptions o{.key_dim = feat, .axis = time, .att_dropout = dropout};
        if (causal) o.causal_query_spatial_dim = time;
        TrainFlagScope train(true);
        set_random_seed(77);
        const AttentionGrads g = dot_attention_backward(q, k, v, o, dout);

        auto leaf = [](const Tensor& x) { return to_backend(x, "torch").requires_grad(true); };
        Tensor tq = leaf(q), tk = leaf(k), tv = leaf(v);
        set_random_seed(77);
        ForceKernels force("reference");
        Tensor out = dot_attention(tq, tk, tv, o);
        reduce_sum(mul(out, to_backend(dout, "torch")), out.dims()).backward();
        const double tol = testing::gradient_tolerance(dt);
        EXPECT_LT(testing::max_abs_diff(g.query, *tq.grad(), q.dims()), tol) << "dq causal " << causal;
        EXPECT_LT(testing::max_abs_diff(g.keys, *tk.grad(), k.dims()), tol) << "dk causal " << causal;
        EXPECT_LT(testing::max_abs_diff(g.values, *tv.grad(), v.dims()), tol) << "dv causal " << causal;
      }
    }
  }
}

// A dim whose lengths vary over the kv axis, kept in the result: which of
// its entries are padding would depend on a position the result sums over.
// A clear error (the query's gradient, summed over it, kept the axis and
// reached copy_transpose as an internal error; found by fuzz_dot_attention's
// check that errors name the op called).
TEST(Backward, DimsDynamicOverTheKvAxisAreAnError) {
  if (!has_backend("eigen")) GTEST_SKIP();
  const TensorOptions eo{.dtype = DType::float64, .backend = "eigen"};
  Dim feat("feat", 3), time("time", 3);
  Dim extra = Dim::dynamic("extra", from_host({time}, {1, 2, 0}, {.dtype = DType::int64, .backend = "eigen"}), 2);
  const Tensor q = random_normal({feat}, 1, eo), k = random_normal({time, extra, feat}, 2, eo),
               v = random_normal({extra, time, feat}, 3, eo);
  const AttentionOptions o{.key_dim = feat, .axis = time};
  const Tensor out = dot_attention(q, k, v, o);
  const std::string msg =
      testing::error_of([&] { dot_attention_backward(q, k, v, o, random_normal(out.dims(), 4, eo)); });
  EXPECT_EQ(msg.rfind("[dot_attention_backward]", 0), 0u) << msg;
  EXPECT_NE(msg.find("is dynamic over the kv axis time[3]"), std::string::npos) << msg;
}

TEST(Backward, BadGradOutputDimsAreAnError) {
  if (!has_backend("eigen")) GTEST_SKIP();
  Dim time("time", 4), feat("feat", 8), other("other", 3);
  const TensorOptions eo{.backend = "eigen"};
  Tensor x = random_normal({time, feat}, 1, eo);
  const std::string msg = testing::error_of(
      [&] { dot_attention_backward(x, x, x, {.key_dim = feat, .axis = time}, random_normal({other}, 2, eo)); });
  EXPECT_EQ(msg.rfind("[dot_attention_backward]", 0), 0u) << msg;
  EXPECT_NE(msg.find("other[3]"), std::string::npos) << msg;
}

}  // namespace
}  // namespace dimattn
