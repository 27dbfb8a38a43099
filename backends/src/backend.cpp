#include "dimattn/backend.h"

#include "dimattn/error.h"

namespace dimattn {

const char* op_name(BinaryOp op) {
  constexpr const char* names[] = {"add", "sub", "mul", "div", "maximum", "minimum", "eq",
                                   "ne",  "lt",  "le",  "gt",  "ge",      "logical_and", "logical_or"};
  return names[static_cast<int>(op)];
}
const char* op_name(UnaryOp op) {
  constexpr const char* names[] = {"neg", "exp", "log", "sqrt", "abs", "logical_not"};
  return names[static_cast<int>(op)];
}
const char* op_name(ReduceOp op) {
  constexpr const char* names[] = {"sum", "max", "min", "mean", "logsumexp"};
  return names[static_cast<int>(op)];
}

std::optional<HostView> Backend::host_view(const RawPtr&) { return std::nullopt; }

// Backends without autograd: requests for gradients are errors, queries are "no".
void Backend::set_requires_grad(const RawPtr&, bool on) {
  check(!on, "requires_grad", "backend '", name(), "' has no autograd; use the torch backend for gradients");
}
bool Backend::requires_grad(const RawPtr&) { return false; }
RawPtr Backend::grad(const RawPtr&) { return nullptr; }
void Backend::backward(const RawPtr&) {
  detail::fail("backward", "backend '", name(), "' has no autograd; use the torch backend for gradients");
}

}  // namespace dimattn
