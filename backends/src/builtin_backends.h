#pragma once
// Registration entry points of the built-in backends. A backend compiled out
// links a stub whose function registers nothing.
namespace dimattn::detail {
void register_torch_backend();
void register_eigen_backend();
}  // namespace dimattn::detail
