#pragma once
// The torch backend's raw tensor and the conversions between dimattn's and
// ATen's dtypes and devices. Private to backends/torch: the primitives and
// the public interop (torch_backend.cpp), the SDPA kernel table
// (torch_attention.cpp) and the cuda_flash path (cuda_flash_path.cpp) share
// these.
#include <ATen/core/Tensor.h>

#include <memory>
#include <utility>

#include "dimattn/dtype.h"
#include "dimattn/error.h"
#include "dimattn/ext/backend.h"
#include "dimattn/tensor.h"
#include "dimattn/internal/check.h"

namespace dimattn::torch_backend {

struct TorchRaw final : RawTensor {
  explicit TorchRaw(at::Tensor tensor) : t(std::move(tensor)) {}
  at::Tensor t;
};

// The ATen tensor inside a raw made by the torch backend. `op` starts the
// error message ("[op] ..."), so primitives can name themselves.
inline const at::Tensor& as_aten(const RawPtr& x, const char* op = "torch") {
  DIMATTN_CHECK(x != nullptr, op, "got a null raw tensor");
  const auto* raw = dynamic_cast<const TorchRaw*>(x.get());
  DIMATTN_CHECK(raw != nullptr, op,
        "the raw tensor belongs to another backend, not 'torch'; convert the tensor first with "
        "to_backend(x, \"torch\")");
  return raw->t;
}

// pre: t is defined.
inline RawPtr wrap(at::Tensor t) {
  DIMATTN_CHECK(t.defined(), "torch", "internal error: wrapping an undefined ATen tensor");
  return std::make_shared<TorchRaw>(std::move(t));
}

inline at::ScalarType aten_dtype(DType d) {
  switch (d) {
    case DType::float32: return at::kFloat;
    case DType::float64: return at::kDouble;
    case DType::bfloat16: return at::kBFloat16;
    case DType::float16: return at::kHalf;
    case DType::int32: return at::kInt;
    case DType::int64: return at::kLong;
    case DType::boolean: return at::kBool;
  }
  detail::fail("torch", "unknown dtype value ", static_cast<int>(d));
}

inline bool has_dimattn_dtype(at::ScalarType s) {
  switch (s) {
    case at::kFloat: case at::kDouble: case at::kBFloat16: case at::kHalf:
    case at::kInt: case at::kLong: case at::kBool:
      return true;
    default:
      return false;
  }
}

// Throws for ATen dtypes dimattn does not have (uint8, complex, ...).
inline DType dimattn_dtype(at::ScalarType s, const char* op = "torch") {
  switch (s) {
    case at::kFloat: return DType::float32;
    case at::kDouble: return DType::float64;
    case at::kBFloat16: return DType::bfloat16;
    case at::kHalf: return DType::float16;
    case at::kInt: return DType::int32;
    case at::kLong: return DType::int64;
    case at::kBool: return DType::boolean;
    default: break;
  }
  detail::fail(op, "ATen dtype ", c10::toString(s), " has no dimattn equivalent; ",
               "cast to one of float32, float64, bfloat16, float16, int32, int64, bool first");
}

inline c10::Device aten_device(Device d) {
  if (d.type == DeviceType::cpu) return c10::Device(c10::DeviceType::CPU);
  return c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(d.index));
}

// Throws for ATen devices other than cpu and cuda.
inline Device dimattn_device(const c10::Device& d, const char* op = "torch") {
  if (d.is_cpu()) return kCPU;
  if (d.is_cuda()) return Device{DeviceType::cuda, d.has_index() ? static_cast<int>(d.index()) : 0};
  detail::fail(op, "ATen device ", d.str(), " is not supported; dimattn has cpu and cuda");
}

// A tensor's memory as dimattn's kernels read it, on any device: the
// at::Tensor's own pointer, sizes and strides.
inline HostView memory_of(const at::Tensor& t) {
  return HostView{t.data_ptr(), t.sizes().vec(), t.strides().vec(), dimattn_dtype(t.scalar_type())};
}
inline HostView memory_of_raw(const RawPtr& x) { return memory_of(as_aten(x)); }

}  // namespace dimattn::torch_backend
