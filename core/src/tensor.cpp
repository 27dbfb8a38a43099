#include "dimattn/tensor.h"

#include "dimattn/ext/backend.h"
#include "dimattn/error.h"
#include "dimattn/internal/check.h"

namespace dimattn {

Tensor::Tensor(Dims dims, DType dtype, Device device, RawPtr raw, Backend* backend)
    : dims_(std::move(dims)), dtype_(dtype), device_(device), raw_(std::move(raw)), backend_(backend) {
  for (size_t i = 0; i < dims_.size(); ++i)
    for (size_t j = i + 1; j < dims_.size(); ++j)
      DIMATTN_CHECK(dims_[i] != dims_[j], "Tensor", "dim ", dims_[i].repr(), " appears twice in ", dimattn::repr(dims_));
}

bool Tensor::has(const Dim& d) const { return axis_of(d) >= 0; }
int Tensor::axis_of(const Dim& d) const { return index_of(dims_, d); }

std::vector<int64_t> Tensor::shape() const {
  std::vector<int64_t> s;
  for (const Dim& d : dims_) s.push_back(d.extent());
  return s;
}

int64_t Tensor::numel() const {
  return product(dims_);
}

std::string Tensor::repr() const {
  return std::string("Tensor(") + dtype_name(dtype_) + " " + device_name(device_) + " " + backend_->name() + "; " +
         dimattn::repr(dims_) + ")";
}

Tensor& Tensor::requires_grad(bool on) {
  DIMATTN_CHECK(backend_->has_autograd(), "requires_grad", "backend '", backend_->name(),
        "' has no autograd; use the torch backend for gradients");
  DIMATTN_CHECK(is_floating(dtype_), "requires_grad", "only floating tensors can require grad; got ", dtype_name(dtype_),
        " ", dimattn::repr(dims_));
  backend_->set_requires_grad(raw_, on);
  return *this;
}

bool Tensor::requires_grad() const { return backend_->has_autograd() && backend_->requires_grad(raw_); }

std::optional<Tensor> Tensor::grad() const {
  if (!backend_->has_autograd()) return std::nullopt;
  RawPtr g = backend_->grad(raw_);
  if (!g) return std::nullopt;
  return Tensor(dims_, dtype_, device_, std::move(g), backend_);
}

void Tensor::backward() const {
  DIMATTN_CHECK(dims_.empty(), "backward", "needs a scalar (rank-0) tensor; got ", dimattn::repr(dims_),
        "; reduce_sum over all dims first");
  DIMATTN_CHECK(backend_->has_autograd(), "backward", "backend '", backend_->name(), "' has no autograd");
  backend_->backward(raw_);
}

}  // namespace dimattn
