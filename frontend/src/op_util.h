#pragma once
// Helpers shared by the named ops: operand checks and the name -> axis mapping.
#include <initializer_list>

#include "dimattn/ext/backend.h"
#include "dimattn/error.h"
#include "dimattn/internal/operand_checks.h"
#include "dimattn/ops.h"
#include "dimattn/tensor.h"

namespace dimattn::detail {

// Options to make a tensor beside x (same backend and device).
TensorOptions options_like(const Tensor& x, DType dtype);
TensorOptions options_like(const Tensor& x);
// pre: d in x.
void check_has(const char* op, const Tensor& x, const Dim& d, const char* role);
// a's dims, then b's dims that a lacks.
Dims union_dims(const Dims& a, const Dims& b);
Dims without(const Dims& dims, const Dims& remove);
// A rank-0 tensor with x's dtype, device and backend.
Tensor scalar_like(const Tensor& x, double value);
// Per entry, how many of the positions [start, start + size) lie within
// `lengths` (the valid part of a window of a dynamic dim), as int64.
Tensor window_lengths(const Tensor& lengths, int64_t start, int64_t size);


}  // namespace dimattn::detail
