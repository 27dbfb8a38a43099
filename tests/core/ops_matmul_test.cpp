// Named ops on every backend: matmul (batch, reduce and result dims).
#include "ops_test_util.h"

namespace dimattn {
namespace {

using namespace dimattn::testing;

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

}  // namespace
}  // namespace dimattn
