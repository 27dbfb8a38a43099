// Definitions for eigen_strided.h.
#include "eigen_strided.h"

#include <sstream>

namespace dimattn::eigen {

std::ostream& operator<<(std::ostream& os, ShapeFmt f) {
  os << '[';
  for (size_t i = 0; i < f.shape.size(); ++i) os << (i ? ", " : "") << f.shape[i];
  return os << ']';
}

std::string shape_string(const Shape& shape) {
  std::ostringstream os;
  os << shape_str(shape);
  return os.str();
}

void check_cpu(Device device, const char* op) {
  DIMATTN_CHECK(device.type == DeviceType::cpu, op, "device ", device_name(device),
        " is not supported by the eigen backend, which runs on the CPU only; use device cpu, or the torch "
        "backend for ",
        device_name(device));
}

int64_t numel_of(const Shape& shape) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

int normalize_axis(int axis, int rank, const char* op, const Shape& shape) {
  const int a = axis < 0 ? axis + rank : axis;
  DIMATTN_CHECK(a >= 0 && a < rank, op, "axis ", axis, " is out of range for shape ", shape_str(shape), " (rank ", rank, ")");
  return a;
}

std::shared_ptr<EigenRaw> view_of(const EigenRaw& x) { return std::make_shared<EigenRaw>(x); }

EigenRaw permuted(const EigenRaw& x, const std::vector<int>& perm) {
  EigenRaw y = x;
  for (size_t i = 0; i < perm.size(); ++i) {
    y.shape[i] = x.shape[perm[i]];
    y.strides[i] = x.strides[perm[i]];
  }
  return y;
}

std::vector<int> inverse_permutation(const std::vector<int>& perm) {
  std::vector<int> inv(perm.size());
  for (size_t i = 0; i < perm.size(); ++i) inv[perm[i]] = static_cast<int>(i);
  return inv;
}

std::vector<int64_t> broadcast_strides(const EigenRaw& x, const Shape& shape) {
  std::vector<int64_t> s = x.strides;
  for (size_t d = 0; d < shape.size(); ++d)
    if (x.shape[d] != shape[d]) s[d] = 0;
  return s;
}

void check_same_dtype(const EigenRaw& a, const EigenRaw& b, const char* op, const char* what) {
  DIMATTN_CHECK(a.dtype == b.dtype, op, what, ": operands must have the same dtype, got ", dtype_name(a.dtype), " ",
        shape_str(a.shape), " and ", dtype_name(b.dtype), " ", shape_str(b.shape), "; cast one of them first");
}

std::shared_ptr<EigenRaw> dense_copy(const EigenRaw& x, DType dtype) {
  auto out = empty_raw(dtype, x.shape);
  visit_dtype(dtype, [&](auto tag) {
    using D = typename decltype(tag)::type;
    copy_to(x, out->data<D>(), out->strides);
  });
  return out;
}

}  // namespace dimattn::eigen
