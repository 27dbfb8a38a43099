#pragma once
// Interop between dimattn tensors and ATen tensors, for code that uses the
// torch backend and LibTorch directly. Both directions share memory: no copy.
#include <ATen/core/Tensor.h>

#include "dimattn/dim.h"
#include "dimattn/tensor.h"

namespace dimattn {

// A dimattn tensor on the "torch" backend over t's memory, with t's axes
// named by `dims` in order.
// pre: t.dim() == dims.size() and t.size(i) == dims[i].extent() for every i;
//      t's dtype is one of dimattn's (float32, float64, bfloat16, float16,
//      int32, int64, bool) and its device cpu or cuda.
// Throws dimattn::Error "[from_aten] ..." naming the dims and sizes otherwise.
Tensor from_aten(const at::Tensor& t, const Dims& dims);

// The ATen tensor holding x's data; its axes are x.dims() in order. The
// reference lives as long as x (or a copy of x) does.
// Throws dimattn::Error "[to_aten] ..." when x is not on the torch backend.
const at::Tensor& to_aten(const Tensor& x);

}  // namespace dimattn
