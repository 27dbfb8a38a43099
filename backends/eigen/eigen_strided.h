#pragma once
// Shapes, views and strided iteration over EigenRaw: what every op family of
// the Eigen backend walks its operands with.
#include <array>
#include <cstdint>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "eigen_element.h"
#include "eigen_raw.h"

namespace dimattn::eigen {

// Prints "[2, 3]" when streamed; cheap to pass to DIMATTN_CHECK(), which only
// formats its message on failure.
struct ShapeFmt {
  const Shape& shape;
};
std::ostream& operator<<(std::ostream& os, ShapeFmt f);
inline ShapeFmt shape_str(const Shape& shape) { return {shape}; }
std::string shape_string(const Shape& shape);

// ---------------------------------------------------------------------------
// Shapes, devices, views

// Throws unless `device` is the CPU, suggesting the torch backend.
void check_cpu(Device device, const char* op);
int64_t numel_of(const Shape& shape);
// axis in [-rank, rank), counted from the end when negative.
// post: in [0, rank); throws naming `op` and `shape` otherwise.
int normalize_axis(int axis, int rank, const char* op, const Shape& shape);
// A new raw tensor sharing x's storage, for the caller to restride.
std::shared_ptr<EigenRaw> view_of(const EigenRaw& x);
// y.shape[i] = x.shape[perm[i]].
EigenRaw permuted(const EigenRaw& x, const std::vector<int>& perm);
std::vector<int> inverse_permutation(const std::vector<int>& perm);
// Strides that read x as if expanded to `shape` (same rank, numpy rules
// already checked): 0 on axes where x has size 1 and `shape` does not.
std::vector<int64_t> broadcast_strides(const EigenRaw& x, const Shape& shape);
// Throws unless a and b have one dtype; `what` names the op in the message.
void check_same_dtype(const EigenRaw& a, const EigenRaw& b, const char* op, const char* what);

// ---------------------------------------------------------------------------
// Strided iteration

// Calls run(offsets, n, steps) for every innermost run of `shape`, where
// offsets[k] is operand k's element offset of the run's first element and
// steps[k] its stride along the run. Axes of size 1 are dropped and axes that
// are nested contiguously in every operand are merged, so dense operands give
// one long run that the compiler (or Eigen) can vectorize.
template <size_t N, class Run>
void for_each_run(const Shape& shape, const std::array<const std::vector<int64_t>*, N>& strides, Run&& run) {
  using Steps = std::array<int64_t, N>;
  std::vector<int64_t> sizes;
  std::vector<Steps> steps;
  for (size_t d = 0; d < shape.size(); ++d) {
    if (shape[d] == 0) return;
    if (shape[d] == 1) continue;
    Steps s;
    for (size_t k = 0; k < N; ++k) s[k] = (*strides[k])[d];
    if (!sizes.empty()) {
      bool nested = true;
      for (size_t k = 0; k < N; ++k) nested = nested && steps.back()[k] == s[k] * shape[d];
      if (nested) {
        sizes.back() *= shape[d];
        steps.back() = s;
        continue;
      }
    }
    sizes.push_back(shape[d]);
    steps.push_back(s);
  }
  Steps offsets{};
  if (sizes.empty()) {
    run(offsets, int64_t{1}, Steps{});
    return;
  }
  const int outer = static_cast<int>(sizes.size()) - 1;
  const int64_t n = sizes.back();
  const Steps inner = steps.back();
  std::vector<int64_t> index(outer, 0);
  while (true) {
    run(offsets, n, inner);
    int d = outer - 1;
    for (; d >= 0; --d) {
      for (size_t k = 0; k < N; ++k) offsets[k] += steps[d][k];
      if (++index[d] < sizes[d]) break;
      for (size_t k = 0; k < N; ++k) offsets[k] -= steps[d][k] * sizes[d];
      index[d] = 0;
    }
    if (d < 0) return;
  }
}

// Copies the logical contents of src into dst (strides dst_strides over
// src's shape), converting the element type.
template <class D>
void copy_to(const EigenRaw& src, D* dst, const std::vector<int64_t>& dst_strides) {
  visit_dtype(src.dtype, [&](auto tag) {
    using S = typename decltype(tag)::type;
    const S* s = src.data<S>();
    for_each_run<2>(src.shape, {&src.strides, &dst_strides}, [&](auto off, int64_t n, auto step) {
      const S* ps = s + off[0];
      D* pd = dst + off[1];
      if (step[0] == 1 && step[1] == 1) {
        for (int64_t i = 0; i < n; ++i) pd[i] = convert<D>(ps[i]);
      } else {
        for (int64_t i = 0; i < n; ++i) pd[i * step[1]] = convert<D>(ps[i * step[0]]);
      }
    });
  });
}

// A dense copy of x with dtype `dtype`.
std::shared_ptr<EigenRaw> dense_copy(const EigenRaw& x, DType dtype);

// The elements of x in logical order as a dense array of C: x's own memory
// when that already is one, else a converted copy held here.
template <class C>
class DenseAs {
 public:
  explicit DenseAs(const EigenRaw& x) {
    if (x.dtype == dtype_of() && x.is_contiguous()) {
      data_ = x.data<C>();
    } else {
      copy_ = std::make_unique<C[]>(static_cast<size_t>(x.numel()));
      copy_to(x, copy_.get(), contiguous_strides(x.shape));
      data_ = copy_.get();
    }
  }
  const C* data() const { return data_; }

 private:
  static DType dtype_of() {
    if constexpr (std::is_same_v<C, float>) return DType::float32;
    else if constexpr (std::is_same_v<C, double>) return DType::float64;
    else if constexpr (std::is_same_v<C, int32_t>) return DType::int32;
    else if constexpr (std::is_same_v<C, int64_t>) return DType::int64;
    else return DType::boolean;
  }
  std::unique_ptr<C[]> copy_;  // not std::vector: vector<bool> has no data()
  const C* data_ = nullptr;
};

}  // namespace dimattn::eigen
