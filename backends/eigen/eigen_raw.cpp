// Definitions for eigen_raw.h.
#include "eigen_raw.h"

#include <algorithm>

#include "dimattn/error.h"
#include "eigen_strided.h"

namespace dimattn::eigen {

std::vector<int64_t> contiguous_strides(const Shape& shape) {
  std::vector<int64_t> strides(shape.size());
  int64_t s = 1;
  for (int d = static_cast<int>(shape.size()) - 1; d >= 0; --d) {
    strides[d] = s;
    s *= std::max<int64_t>(shape[d], 1);
  }
  return strides;
}

std::shared_ptr<EigenRaw> empty_raw(DType dtype, const Shape& shape) {
  int64_t n = 1;
  for (int64_t s : shape) {
    DIMATTN_CHECK(s >= 0, "eigen", "negative size in shape ", shape_str(shape));
    n *= s;
  }
  auto r = std::make_shared<EigenRaw>();
  r->dtype = dtype;
  r->shape = shape;
  r->strides = contiguous_strides(shape);
  r->storage = std::make_shared<Storage>(static_cast<std::size_t>(n) * dtype_size(dtype));
  return r;
}

const EigenRaw& as_eigen(const RawPtr& x) {
  DIMATTN_CHECK(x != nullptr, "eigen", "got a null tensor");
  const auto* r = dynamic_cast<const EigenRaw*>(x.get());
  DIMATTN_CHECK(r != nullptr, "eigen",
        "got a tensor made by another backend; move it with that backend's to_host and eigen's from_host");
  return *r;
}

}  // namespace dimattn::eigen
