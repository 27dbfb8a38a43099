#pragma once
// Checks of an op's operands that every layer's ops share, with their
// messages. Internal: not installed.
#include <initializer_list>
#include <string>

#include "dimattn/tensor.h"

namespace dimattn {
class Backend;
}

namespace dimattn::detail {

// The backend all operands live on. Throws, naming both, when they differ in
// backend or device.
Backend& common_backend(const char* op, std::initializer_list<const Tensor*> operands);
// Throws, naming it, when a dim appears twice in dims (else it would surface
// as a backend's permute error).
void check_unique(const char* op, const Dims& dims);
// Throws unless every operand has the same dtype.
void check_same_dtype(const char* op, std::initializer_list<const Tensor*> operands);

// When `x` lacks `d` but has another dim of the same name: Dims made
// separately never compare equal, which the bare "not in" message hides
// (both sides print as feat[4]). Empty otherwise.
std::string same_name_hint(const Tensor& x, const Dim& d, const char* which);

}  // namespace dimattn::detail
