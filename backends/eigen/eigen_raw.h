#pragma once
// The Eigen backend's raw tensor: a strided view (sizes, strides, offset)
// over shared, 64-byte aligned storage. Views (permute, expand, slice and
// reshape where the strides allow) share the storage. Sharing is safe because
// only a fresh tensor is written after the op that made it returns: cpu_flash
// fills the outputs it created with `full` through host_view, before any view
// of them exists.
//
// Only the data structure, without Eigen's headers (eigen_element.h has
// those); kernels and layout detection do not include it but read pointers
// and strides through Backend::host_view. The op families' shared helpers are
// in eigen_strided.h, the primitives in eigen_ops.h.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <new>
#include <vector>

#include "dimattn/ext/backend.h"
#include "dimattn/dtype.h"
#include "dimattn/tensor.h"

namespace dimattn::eigen {

inline constexpr std::size_t kAlignment = 64;

// One allocation, shared by a tensor and every view of it.
class Storage {
 public:
  explicit Storage(std::size_t bytes)
      // Rounded up and never empty so that every tensor has a valid, aligned
      // base pointer, even one with no elements.
      : bytes_((bytes + kAlignment - 1) / kAlignment * kAlignment + (bytes == 0 ? kAlignment : 0)),
        data_(static_cast<std::byte*>(::operator new(bytes_, std::align_val_t{kAlignment}))) {}
  ~Storage() { ::operator delete(data_, std::align_val_t{kAlignment}); }
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;

  std::byte* data() const { return data_; }
  std::size_t bytes() const { return bytes_; }

 private:
  std::size_t bytes_;
  std::byte* data_;
};

struct EigenRaw final : RawTensor {
  DType dtype = DType::float32;
  Shape shape;
  std::vector<int64_t> strides;  // in elements, per axis; 0 on expanded (broadcast) axes
  int64_t offset = 0;            // in elements, from storage->data() to the first element
  std::shared_ptr<Storage> storage;

  int rank() const { return static_cast<int>(shape.size()); }
  int64_t numel() const {
    int64_t n = 1;
    for (int64_t s : shape) n *= s;
    return n;
  }
  // Dense row-major; the strides of size-1 axes do not matter.
  bool is_contiguous() const {
    if (numel() == 0) return true;
    int64_t expected = 1;
    for (int d = rank() - 1; d >= 0; --d) {
      if (shape[d] != 1 && strides[d] != expected) return false;
      expected *= shape[d];
    }
    return true;
  }
  std::byte* bytes() const { return storage->data() + offset * dtype_size(dtype); }
  // pre: T is the storage type of dtype (float, double, Eigen::bfloat16,
  // Eigen::half, int32_t, int64_t, bool).
  template <class T>
  T* data() const {
    return reinterpret_cast<T*>(bytes());
  }
};

// Row-major strides of a dense tensor of `shape`.
std::vector<int64_t> contiguous_strides(const Shape& shape);

// A new dense tensor; its elements are uninitialised. Throws on negative sizes.
std::shared_ptr<EigenRaw> empty_raw(DType dtype, const Shape& shape);

// Throws dimattn::Error when x is null or was made by another backend.
const EigenRaw& as_eigen(const RawPtr& x);

}  // namespace dimattn::eigen
