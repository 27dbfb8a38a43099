#pragma once
// Named ops with RETURNN's rules. Every op validates its inputs and throws
// dimattn::Error "[op] ..." naming the offending dims with their sizes.
//
// - Elementwise ops broadcast over the union of their operands' dims.
// - matmul(a, b, reduce): dims in both operands and not reduced are batch
//   dims; result dims = common dims, then a-only, then b-only.
// - Ops over a dynamic dim (softmax, reduce, concat) mask its padding.
// - An op runs on its operands' backend; operands on different backends are
//   an error naming both (convert one with to_backend).
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "dimattn/dim.h"
#include "dimattn/tensor.h"

namespace dimattn {

class Backend;

// Where and as what a new tensor is made. backend empty = default_backend().
struct TensorOptions {
  DType dtype = DType::float32;
  Device device = kCPU;
  std::string backend;
};

// --- construction and transfer ---
Tensor zeros(const Dims& dims, const TensorOptions& opts = {});
Tensor full(const Dims& dims, double value, const TensorOptions& opts = {});
Tensor scalar(double value, const TensorOptions& opts = {});
Tensor random_normal(const Dims& dims, uint64_t seed, const TensorOptions& opts = {}, double mean = 0,
                     double stddev = 1);
Tensor random_uniform(const Dims& dims, uint64_t seed, const TensorOptions& opts = {}, double low = 0,
                      double high = 1);
// data is row-major in the order of `dims`.
Tensor from_host(const Dims& dims, const std::vector<double>& data, const TensorOptions& opts = {});
// Row-major values in the order `order` (default: x's own dim order).
std::vector<double> to_host(const Tensor& x, const std::optional<Dims>& order = std::nullopt);
double item(const Tensor& x);  // pre: rank 0
Tensor cast(const Tensor& x, DType dtype);
Tensor to_device(const Tensor& x, Device device);
Tensor to_backend(const Tensor& x, const std::string& backend);
// Same values with dims stored in `order` (a permutation of x's dims).
Tensor copy_transpose(const Tensor& x, const Dims& order);
// x broadcast to the dims `order` (a superset of x's dims), values repeated
// along the dims x lacks; a view where the backend allows.
Tensor align(const Tensor& x, const Dims& order);

// --- contraction, reduction, normalisation ---
Tensor matmul(const Tensor& a, const Tensor& b, const Dims& reduce);
enum class Reduce { sum, max, min, mean, logsumexp };
// Padding of dynamic dims in `axes` is excluded (mean divides by the lengths).
Tensor reduce(const Tensor& x, Reduce kind, const Dims& axes);
Tensor reduce_sum(const Tensor& x, const Dims& axes);
Tensor reduce_max(const Tensor& x, const Dims& axes);
Tensor reduce_mean(const Tensor& x, const Dims& axes);
Tensor reduce_logsumexp(const Tensor& x, const Dims& axes);
// Padding of a dynamic axis gets probability 0; a row without any valid
// position gives all zeros (log_softmax: -inf), never NaN.
Tensor softmax(const Tensor& x, const Dim& axis);
Tensor log_softmax(const Tensor& x, const Dim& axis);
// Zeroes elements with probability p and scales the rest by 1/(1-p), only
// while the run context's train flag is on. The mask varies over `vary_over`
// and is shared across every other dim. pre: 0 <= p < 1.
Tensor dropout(const Tensor& x, double p, const Dims& vary_over);

// --- elementwise (union-of-dims broadcasting) ---
Tensor add(const Tensor& a, const Tensor& b);
Tensor sub(const Tensor& a, const Tensor& b);
Tensor mul(const Tensor& a, const Tensor& b);
Tensor div(const Tensor& a, const Tensor& b);
Tensor maximum(const Tensor& a, const Tensor& b);
Tensor minimum(const Tensor& a, const Tensor& b);
Tensor neg(const Tensor& x);
Tensor exp(const Tensor& x);
Tensor log(const Tensor& x);
Tensor sqrt(const Tensor& x);
Tensor abs(const Tensor& x);
Tensor tanh(const Tensor& x);
enum class Compare { eq, ne, lt, le, gt, ge };
Tensor compare(const Tensor& a, Compare op, const Tensor& b);  // -> bool
Tensor logical_and(const Tensor& a, const Tensor& b);
Tensor logical_or(const Tensor& a, const Tensor& b);
Tensor logical_not(const Tensor& x);
Tensor where(const Tensor& cond, const Tensor& a, const Tensor& b);
// Scalar operands take the tensor's dtype, device and backend.
Tensor add(const Tensor& a, double b);
Tensor mul(const Tensor& a, double b);
Tensor where(const Tensor& cond, const Tensor& a, double b);
Tensor compare(const Tensor& a, Compare op, double b);

Tensor operator+(const Tensor& a, const Tensor& b);
Tensor operator-(const Tensor& a, const Tensor& b);
Tensor operator*(const Tensor& a, const Tensor& b);
Tensor operator/(const Tensor& a, const Tensor& b);
Tensor operator-(const Tensor& x);
Tensor operator*(const Tensor& a, double b);
Tensor operator+(const Tensor& a, double b);

// --- dims ---
// int64 tensor over [dim] with values 0 .. extent-1.
Tensor range_over_dim(const Dim& dim, const TensorOptions& opts = {.dtype = DType::int64});
// bool tensor over dim's length dims + dim: true at valid positions. For a
// static dim, all true over [dim].
Tensor sequence_mask(const Dim& dim, const TensorOptions& opts = {});
Tensor sequence_mask(const Dims& dims, const TensorOptions& opts = {});  // and over several
// Same data, `old_dim` relabelled to `new_dim`. pre: equal extents.
Tensor replace_dim(const Tensor& x, const Dim& old_dim, const Dim& new_dim);
// Merges `dims` (in that order, outermost first) into one dim; `out` names it
// (default: a new static dim with the product extent).
std::pair<Tensor, Dim> merge_dims(const Tensor& x, const Dims& dims, const std::optional<Dim>& out = std::nullopt);
// Splits `axis` into `dims` (outermost first). pre: product of extents == axis extent.
Tensor split_dims(const Tensor& x, const Dim& axis, const Dims& dims);
// Adds a size-1... or any-size dim, broadcasting x's values along it.
Tensor expand_dim(const Tensor& x, const Dim& dim);
// Removes a dim of extent 1.
Tensor squeeze(const Tensor& x, const Dim& dim);
// Concatenates along each tensor's own dim. Dynamic dims are concatenated per
// entry: entry b of the result holds the valid part of each input in turn,
// then padding. out_dim defaults to a new dim (dynamic if any input is).
std::pair<Tensor, Dim> concat(const std::vector<std::pair<Tensor, Dim>>& parts,
                              const std::optional<Dim>& out_dim = std::nullopt);
// Positions [start, end) of `axis` (static axes). out_dim defaults to a new dim.
std::pair<Tensor, Dim> slice(const Tensor& x, const Dim& axis, int64_t start, int64_t end,
                             const std::optional<Dim>& out_dim = std::nullopt);
// RETURNN gather: out = x[..., indices, ...] along `axis`; indices' dims shared
// with x act as batch dims; result dims = x's dims without axis, then indices'
// dims x lacks. pre: indices integer, values in [0, extent(axis)).
Tensor gather(const Tensor& x, const Dim& axis, const Tensor& indices);

}  // namespace dimattn
