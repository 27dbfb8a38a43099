#pragma once
// The backend registry. Built-in backends register on first use; a backend
// compiled out (DIMATTN_WITH_TORCH=OFF, ...) is simply absent, so callers ask
// the registry rather than assume.
#include <memory>
#include <string>
#include <vector>

namespace dimattn {

class Backend;  // dimattn/ext/backend.h

// Adds a backend under backend->name(); throws if the name is taken.
void register_backend(std::unique_ptr<Backend> backend);
// Throws dimattn::Error listing the registered names when `name` is unknown.
Backend& get_backend(const std::string& name);
bool has_backend(const std::string& name);
std::vector<std::string> backend_names();  // in registration order
// How a backend built into the library announces itself: a namespace-scope
// BuiltinBackend in its source file. The registry constructs and registers
// the built-ins on its first use, lowest priority value first, so that core
// never names a backend.
struct BuiltinBackend {
  using Factory = std::unique_ptr<Backend> (*)();
  BuiltinBackend(int priority, Factory make);
};

// "torch" when built with LibTorch, else "eigen"; DIMATTN_BACKEND overrides.
Backend& default_backend();

}  // namespace dimattn
