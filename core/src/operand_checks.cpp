#include "dimattn/internal/operand_checks.h"

#include "dimattn/ext/backend.h"
#include "dimattn/internal/check.h"

namespace dimattn::detail {

Backend& common_backend(const char* op, std::initializer_list<const Tensor*> operands) {
  const Tensor* first = *operands.begin();
  for (const Tensor* t : operands) {
    DIMATTN_CHECK(&t->backend() == &first->backend(), op, "operands live on different backends: ", first->repr(),
          " and ", t->repr(), "; convert one with to_backend(x, \"", first->backend().name(), "\")");
    DIMATTN_CHECK(t->device() == first->device(), op, "operands live on different devices: ", first->repr(), " and ",
          t->repr(), "; move one with to_device");
  }
  return first->backend();
}

void check_unique(const char* op, const Dims& dims) {
  for (size_t i = 0; i < dims.size(); ++i)
    for (size_t j = i + 1; j < dims.size(); ++j)
      DIMATTN_CHECK(dims[i] != dims[j], op, "dim ", dims[i].repr(), " appears twice in ", repr(dims));
}

void check_same_dtype(const char* op, std::initializer_list<const Tensor*> operands) {
  const Tensor* first = *operands.begin();
  for (const Tensor* t : operands)
    DIMATTN_CHECK(t->dtype() == first->dtype(), op, "operands have different dtypes: ", first->repr(), " and ",
          t->repr(), "; cast one with cast(x, ", dtype_name(first->dtype()), ")");
}

std::string same_name_hint(const Tensor& x, const Dim& d, const char* which) {
  for (const Dim& e : x.dims())
    if (e != d && e.name() == d.name())
      return std::string("; ") + which + " " + e.repr() + " is another Dim with the same name: Dims made " +
             "separately never compare equal, so make both tensors with one Dim object";
  return "";
}

}  // namespace dimattn::detail
