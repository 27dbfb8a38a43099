#pragma once
// The backend registry. Built-in backends register on first use; a backend
// compiled out (DIMATTN_WITH_TORCH=OFF, ...) builds a stub that registers
// nothing, so callers ask the registry rather than assume.
#include <memory>
#include <string>
#include <vector>

#include "dimattn/backend.h"

namespace dimattn {

// Adds a backend under backend->name(); throws if the name is taken.
void register_backend(std::unique_ptr<Backend> backend);
// Throws dimattn::Error listing the registered names when `name` is unknown.
Backend& get_backend(const std::string& name);
bool has_backend(const std::string& name);
std::vector<std::string> backend_names();  // in registration order
// "torch" when built with LibTorch, else "eigen"; DIMATTN_BACKEND overrides.
Backend& default_backend();

}  // namespace dimattn
