// Layout primitives of the Eigen backend: permute, reshape, expand and
// slice are views of x's storage where its strides allow; concat and gather
// copy.
#include <optional>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include "eigen_ops.h"
#include "eigen_strided.h"

namespace dimattn::eigen {

RawPtr permute_impl(const EigenRaw& x, const std::vector<int>& perm) {
  const char* kOp = "eigen.permute";
  std::vector<bool> seen(x.rank(), false);
  bool valid = static_cast<int>(perm.size()) == x.rank();
  for (int p : perm) {
    valid = valid && p >= 0 && p < x.rank() && !seen[p];
    if (valid) seen[p] = true;
  }
  if (!valid) {
    std::ostringstream os;
    for (size_t i = 0; i < perm.size(); ++i) os << (i ? ", " : "") << perm[i];
    detail::fail(kOp, "perm [", os.str(), "] is not a permutation of the axes of shape ", shape_str(x.shape));
  }
  return std::make_shared<EigenRaw>(permuted(x, perm));
}

namespace {

// Strides viewing x as `shape` without a copy, when x's strides allow it
// (PyTorch's computeStride): every run of merged axes must be contiguous.
std::optional<std::vector<int64_t>> view_strides(const EigenRaw& x, const Shape& shape) {
  if (x.numel() == 0 || x.rank() == 0) return contiguous_strides(shape);
  std::vector<int64_t> strides(shape.size());
  int view_d = static_cast<int>(shape.size()) - 1;
  int64_t chunk_base = x.strides.back(), tensor_numel = 1, view_numel = 1;
  for (int d = x.rank() - 1; d >= 0; --d) {
    tensor_numel *= x.shape[d];
    if (d == 0 || (x.shape[d - 1] != 1 && x.strides[d - 1] != tensor_numel * chunk_base)) {
      while (view_d >= 0 && (view_numel < tensor_numel || shape[view_d] == 1)) {
        strides[view_d] = view_numel * chunk_base;
        view_numel *= shape[view_d];
        --view_d;
      }
      if (view_numel != tensor_numel) return std::nullopt;
      if (d > 0) {
        chunk_base = x.strides[d - 1];
        tensor_numel = 1;
        view_numel = 1;
      }
    }
  }
  if (view_d != -1) return std::nullopt;
  return strides;
}

}  // namespace

RawPtr reshape_impl(const EigenRaw& x, const Shape& shape) {
  const char* kOp = "eigen.reshape";
  for (int64_t s : shape) DIMATTN_CHECK(s >= 0, kOp, "negative size in target shape ", shape_str(shape));
  DIMATTN_CHECK(numel_of(shape) == x.numel(), kOp, "cannot reshape ", shape_str(x.shape), " (", x.numel(),
        " elements) to ", shape_str(shape), " (", numel_of(shape), " elements)");
  if (auto strides = view_strides(x, shape)) {
    auto y = view_of(x);
    y->shape = shape;
    y->strides = *strides;
    return y;
  }
  auto y = dense_copy(x, x.dtype);
  y->shape = shape;
  y->strides = contiguous_strides(shape);
  return y;
}

RawPtr expand_impl(const EigenRaw& x, const Shape& shape) {
  const char* kOp = "eigen.expand";
  DIMATTN_CHECK(static_cast<int>(shape.size()) == x.rank(), kOp, "cannot expand ", shape_str(x.shape), " to ",
        shape_str(shape), ": ranks differ");
  auto y = view_of(x);
  for (int d = 0; d < x.rank(); ++d) {
    if (x.shape[d] == shape[d]) continue;
    DIMATTN_CHECK(x.shape[d] == 1 && shape[d] >= 0, kOp, "cannot expand ", shape_str(x.shape), " to ", shape_str(shape),
          ": axis ", d, " has size ", x.shape[d], ", only size-1 axes broadcast");
    y->shape[d] = shape[d];
    y->strides[d] = 0;
  }
  return y;
}

RawPtr slice_impl(const EigenRaw& x, int axis_in, int64_t start, int64_t end) {
  const char* kOp = "eigen.slice";
  const int axis = normalize_axis(axis_in, x.rank(), kOp, x.shape);
  DIMATTN_CHECK(0 <= start && start <= end && end <= x.shape[axis], kOp, "range [", start, ", ", end, ") is out of bounds for axis ",
        axis, " of size ", x.shape[axis], " (shape ", shape_str(x.shape), ")");
  auto y = view_of(x);
  y->shape[axis] = end - start;
  if (end > start) y->offset += start * x.strides[axis];
  return y;
}

RawPtr concat_impl(const std::vector<RawPtr>& raws, int axis_in) {
  const char* kOp = "eigen.concat";
  DIMATTN_CHECK(!raws.empty(), kOp, "needs at least one tensor");
  std::vector<const EigenRaw*> xs;
  for (const auto& r : raws) xs.push_back(&as_eigen(r));
  const EigenRaw& first = *xs.front();
  const int axis = normalize_axis(axis_in, first.rank(), kOp, first.shape);
  auto all_shapes = [&] {
    std::string s;
    for (size_t i = 0; i < xs.size(); ++i) s += (i ? ", " : "") + std::string(dtype_name(xs[i]->dtype)) + " " + shape_string(xs[i]->shape);
    return s;
  };
  Shape shape = first.shape;
  shape[axis] = 0;
  for (const EigenRaw* x : xs) {
    if (x->dtype != first.dtype) detail::fail(kOp, "tensors must have the same dtype, got ", all_shapes(), "; cast first");
    bool same = x->rank() == first.rank();
    for (int d = 0; same && d < first.rank(); ++d) same = d == axis || x->shape[d] == first.shape[d];
    if (!same) detail::fail(kOp, "tensors must have equal sizes except on axis ", axis, ", got ", all_shapes());
    shape[axis] += x->shape[axis];
  }
  auto out = empty_raw(first.dtype, shape);
  visit_dtype(first.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    int64_t start = 0;
    for (const EigenRaw* x : xs) {
      copy_to(*x, out->data<T>() + start * out->strides[axis], out->strides);
      start += x->shape[axis];
    }
  });
  return out;
}

RawPtr gather_impl(const EigenRaw& x, int axis_in, const EigenRaw& idx) {
  const char* kOp = "eigen.gather";
  const int axis = normalize_axis(axis_in, x.rank(), kOp, x.shape);
  DIMATTN_CHECK(idx.dtype == DType::int64 || idx.dtype == DType::int32, kOp, "indices must be int64 or int32, got ",
        dtype_name(idx.dtype), " ", shape_str(idx.shape));
  bool sizes_ok = idx.rank() == x.rank();
  for (int d = 0; sizes_ok && d < x.rank(); ++d) sizes_ok = d == axis || idx.shape[d] == x.shape[d];
  DIMATTN_CHECK(sizes_ok, kOp, "indices ", shape_str(idx.shape), " must have the rank and sizes of x ", shape_str(x.shape),
        " except on axis ", axis);
  auto out = empty_raw(x.dtype, idx.shape);
  // x read along idx's shape with the gathered axis held at 0; the index
  // then adds idx * stride on that axis.
  std::vector<int64_t> xs = x.strides;
  xs[axis] = 0;
  const int64_t extent = x.shape[axis], axis_stride = x.strides[axis];
  visit_dtype(x.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    visit_dtype(idx.dtype, [&](auto itag) {
      using I = typename decltype(itag)::type;
      if constexpr (std::is_same_v<I, int32_t> || std::is_same_v<I, int64_t>) {
        const T* px = x.data<T>();
        const I* pi = idx.data<I>();
        T* po = out->data<T>();
        for_each_run<3>(idx.shape, {&xs, &idx.strides, &out->strides}, [&](auto off, int64_t n, auto step) {
          for (int64_t i = 0; i < n; ++i) {
            const int64_t k = pi[off[1] + i * step[1]];
            if (k < 0 || k >= extent)
              detail::fail(kOp, "index ", k, " is out of range for axis ", axis, " of size ", extent, " (x ",
                           shape_str(x.shape), ", indices ", shape_str(idx.shape), ")");
            po[off[2] + i * step[2]] = px[off[0] + i * step[0] + k * axis_stride];
          }
        });
      }
    });
  });
  return out;
}

}  // namespace dimattn::eigen
