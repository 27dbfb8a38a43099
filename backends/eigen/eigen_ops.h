#pragma once
// The Eigen backend's primitives, one function each over EigenRaw operands
// (the EigenBackend class unwraps RawPtrs with as_eigen and calls these),
// grouped by the file that defines them. Results never alias an input's
// memory unless they are views (permute, reshape, expand, slice).
#include <cstdint>
#include <vector>

#include "dimattn/ext/backend.h"
#include "eigen_raw.h"

namespace dimattn::eigen {

// eigen_creation.cpp
RawPtr full_impl(const Shape& shape, double value, DType dtype);
// The same seed gives the same values for every dtype, up to rounding.
RawPtr random_impl(const Shape& shape, RandomKind kind, double a, double b, uint64_t seed, DType dtype);

// eigen_layout_ops.cpp: views where the strides allow, else copies
RawPtr permute_impl(const EigenRaw& x, const std::vector<int>& perm);
RawPtr reshape_impl(const EigenRaw& x, const Shape& shape);
RawPtr expand_impl(const EigenRaw& x, const Shape& shape);
RawPtr slice_impl(const EigenRaw& x, int axis_in, int64_t start, int64_t end);
RawPtr concat_impl(const std::vector<RawPtr>& raws, int axis_in);
RawPtr gather_impl(const EigenRaw& x, int axis_in, const EigenRaw& idx);

// eigen_elementwise.cpp
RawPtr binary_impl(BinaryOp op, const EigenRaw& a, const EigenRaw& b);
RawPtr unary_impl(UnaryOp op, const EigenRaw& x);
RawPtr where_impl(const EigenRaw& cond, const EigenRaw& a, const EigenRaw& b);

// eigen_reductions.cpp
RawPtr reduce_impl(ReduceOp op, const EigenRaw& x, const std::vector<int>& axes_in);
RawPtr softmax_impl(const EigenRaw& x, int axis_in, bool log);

// eigen_matmul.cpp: a [B, M, K] x b [B, K, N] -> [B, M, N]
RawPtr bmm_impl(const EigenRaw& a, const EigenRaw& b);

}  // namespace dimattn::eigen
