#pragma once
// How far a fused kernel may be from the reference path: max abs error of the
// output at unit-normal inputs (DESIGN.md §6; gradients get twice this). One
// table for the dual harness and `dimattn check` (docs/numerics.md).
#include "dimattn/dtype.h"

namespace dimattn {

inline double reference_tolerance(DType d) {
  switch (d) {
    case DType::float64: return 1e-10;
    case DType::float32: return 1e-5;
    case DType::bfloat16: return 2e-2;
    case DType::float16: return 2e-3;
    default: return 0;
  }
}

// Unit roundoff u of a floating dtype: the largest relative error of one
// rounding to it (2^-p for a p-bit significand, its hidden bit counted once).
// The dual harness's gradient tolerance grows by scale · u (docs/numerics.md).
inline double unit_roundoff(DType d) {
  switch (d) {
    case DType::float64: return 0x1p-53;
    case DType::float32: return 0x1p-24;
    case DType::bfloat16: return 0x1p-8;
    case DType::float16: return 0x1p-11;
    default: return 0;
  }
}

}  // namespace dimattn
