#pragma once
// Tensor: ordered dims + dtype + device + a raw tensor owned by one backend.
// The order of dims is a storage detail: no op's meaning depends on it.
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dimattn/dim.h"
#include "dimattn/dtype.h"

namespace dimattn {

class Backend;

// A backend's own tensor type derives from this; the frontend only passes it
// back to the backend that made it.
struct RawTensor {
  virtual ~RawTensor() = default;
};
using RawPtr = std::shared_ptr<RawTensor>;

class Tensor {
 public:
  // pre: raw's shape is the extents of dims, in order; no dim repeats.
  Tensor(Dims dims, DType dtype, Device device, RawPtr raw, Backend* backend);

  const Dims& dims() const { return dims_; }
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }
  Backend& backend() const { return *backend_; }
  const RawPtr& raw() const { return raw_; }

  int rank() const { return static_cast<int>(dims_.size()); }
  bool has(const Dim& d) const;
  int axis_of(const Dim& d) const;  // -1 when absent
  std::vector<int64_t> shape() const;
  int64_t numel() const;
  std::string repr() const;  // "Tensor(float32 cpu torch; batch[3], time[<=7 over batch])"

  // Autograd, where the backend has it (Backend::has_autograd).
  Tensor& requires_grad(bool on = true);
  bool requires_grad() const;
  std::optional<Tensor> grad() const;  // same dims as this tensor
  // Back-propagates from this scalar (rank 0) tensor.
  void backward() const;

 private:
  Dims dims_;
  DType dtype_;
  Device device_;
  RawPtr raw_;
  Backend* backend_;
};

}  // namespace dimattn
