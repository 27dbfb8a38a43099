// Batched matrix product of the Eigen backend through Eigen's GEMM, reading
// strided operands in place where Eigen can (row- or column-major).
#include <algorithm>
#include <memory>
#include <type_traits>

#include "eigen_ops.h"
#include "eigen_strided.h"

namespace dimattn::eigen {
namespace {

template <class T, int Order>
using MatMap = Eigen::Map<const Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Order>, 0, Eigen::OuterStride<>>;

// How one [B, rows, cols] operand is read by Eigen without a copy: row-major
// when the column stride is 1, column-major when the row stride is 1 (e.g. a
// transposed view), else not at all.
struct MatLayout {
  bool ok = false;
  bool row_major = true;
  int64_t outer_stride = 0;
};

MatLayout mat_layout(const EigenRaw& x) {
  const int64_t rows = x.shape[1], cols = x.shape[2];
  const int64_t sr = x.strides[1], sc = x.strides[2];
  if (cols <= 1 || sc == 1) {
    const int64_t outer = rows <= 1 ? std::max<int64_t>(cols, 1) : sr;
    if (outer >= cols) return {true, true, outer};
  }
  if (rows <= 1 || sr == 1) {
    const int64_t outer = cols <= 1 ? std::max<int64_t>(rows, 1) : sc;
    if (outer >= rows) return {true, false, outer};
  }
  return {};
}

template <class T, int OrderA, int OrderB>
void bmm_batches(const EigenRaw& a, const MatLayout& la, const EigenRaw& b, const MatLayout& lb, EigenRaw& out) {
  const int64_t B = a.shape[0], M = a.shape[1], K = a.shape[2], N = b.shape[2];
  const T* pa = a.data<T>();
  const T* pb = b.data<T>();
  T* po = out.data<T>();
  for (int64_t i = 0; i < B; ++i) {
    MatMap<T, OrderA> A(pa + i * a.strides[0], M, K, Eigen::OuterStride<>(la.outer_stride));
    MatMap<T, OrderB> Bm(pb + i * b.strides[0], K, N, Eigen::OuterStride<>(lb.outer_stride));
    Eigen::Map<Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>> O(po + i * M * N, M, N);
    O.noalias() = A * Bm;
  }
}

// pre: a and b have dtype T (float, double or an integer type).
template <class T>
void bmm_native(const EigenRaw& a_in, const EigenRaw& b_in, EigenRaw& out) {
  MatLayout la = mat_layout(a_in), lb = mat_layout(b_in);
  std::shared_ptr<EigenRaw> a_copy, b_copy;
  // Only the float types get the transposed (column-major) GEMM variants;
  // integer products are rare enough to go through one dense layout.
  constexpr bool kAllLayouts = std::is_floating_point_v<T>;
  if (!la.ok || (!kAllLayouts && !la.row_major)) {
    a_copy = dense_copy(a_in, a_in.dtype);
    la = mat_layout(*a_copy);
  }
  if (!lb.ok || (!kAllLayouts && !lb.row_major)) {
    b_copy = dense_copy(b_in, b_in.dtype);
    lb = mat_layout(*b_copy);
  }
  const EigenRaw& a = a_copy ? *a_copy : a_in;
  const EigenRaw& b = b_copy ? *b_copy : b_in;
  constexpr int R = Eigen::RowMajor, C = Eigen::ColMajor;
  if (la.row_major && lb.row_major) bmm_batches<T, R, R>(a, la, b, lb, out);
  else if constexpr (kAllLayouts) {
    if (la.row_major) bmm_batches<T, R, C>(a, la, b, lb, out);
    else if (lb.row_major) bmm_batches<T, C, R>(a, la, b, lb, out);
    else bmm_batches<T, C, C>(a, la, b, lb, out);
  }
}

}  // namespace

RawPtr bmm_impl(const EigenRaw& a, const EigenRaw& b) {
  const char* kOp = "eigen.bmm";
  DIMATTN_CHECK(a.rank() == 3 && b.rank() == 3, kOp, "expects a [B, M, K] and b [B, K, N], got shapes ", shape_str(a.shape),
        " and ", shape_str(b.shape));
  check_same_dtype(a, b, kOp, "bmm");
  DIMATTN_CHECK(a.shape[0] == b.shape[0] && a.shape[2] == b.shape[1], kOp,
        "expects a [B, M, K] and b [B, K, N] with equal B and K, got shapes ", shape_str(a.shape), " and ",
        shape_str(b.shape));
  DIMATTN_CHECK(a.dtype != DType::boolean, kOp, "bmm of bool ", shape_str(a.shape),
        " is not supported; cast to a numeric dtype first");
  const int64_t B = a.shape[0], M = a.shape[1], K = a.shape[2], N = b.shape[2];
  auto out = empty_raw(a.dtype, {B, M, N});
  if (out->numel() == 0) return out;
  visit_dtype(a.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if constexpr (std::is_same_v<T, bool>) {
      // excluded above
    } else if (K == 0) {
      std::fill_n(out->data<T>(), out->numel(), T(0));
    } else if constexpr (is_reduced_v<T>) {
      // 16-bit floats: float32 GEMM (accumulating in float32), rounded once.
      auto af = dense_copy(a, DType::float32), bf = dense_copy(b, DType::float32);
      auto of = empty_raw(DType::float32, {B, M, N});
      bmm_native<float>(*af, *bf, *of);
      Eigen::Map<RowArray<T>>(out->data<T>(), out->numel()) =
          Eigen::Map<const RowArray<float>>(of->data<float>(), of->numel()).template cast<T>();
    } else {
      bmm_native<T>(a, b, *out);
    }
  });
  return out;
}

}  // namespace dimattn::eigen
