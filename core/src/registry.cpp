#include "dimattn/registry.h"

#include <algorithm>
#include <cstdlib>
#include <mutex>

#include "dimattn/ext/backend.h"
#include "dimattn/error.h"
#include "dimattn/internal/check.h"

namespace dimattn {
namespace {

struct Registry {
  std::mutex mu;
  std::vector<std::unique_ptr<Backend>> backends;
};

// Never destroyed: backends may still be used during static destruction.
Registry& storage() {
  static Registry* r = new Registry;
  return *r;
}

// Filled by BuiltinBackend objects while the library loads (static
// initialisation, single-threaded); read once, by registry().
std::vector<std::pair<int, BuiltinBackend::Factory>>& builtins() {
  static auto* b = new std::vector<std::pair<int, BuiltinBackend::Factory>>;
  return *b;
}

// The registry with the built-in backends registered (once).
Registry& registry() {
  static std::once_flag once;
  std::call_once(once, [] {
    auto b = builtins();
    std::stable_sort(b.begin(), b.end(), [](const auto& x, const auto& y) { return x.first < y.first; });
    for (const auto& [priority, make] : b) register_backend(make());
  });
  return storage();
}

Backend* find(Registry& r, const std::string& name) {
  for (auto& b : r.backends)
    if (b->name() == name) return b.get();
  return nullptr;
}

std::string joined_names(Registry& r) {
  std::string s;
  for (auto& b : r.backends) s += (s.empty() ? "" : ", ") + b->name();
  return s.empty() ? "none" : s;
}

}  // namespace

BuiltinBackend::BuiltinBackend(int priority, Factory make) { builtins().emplace_back(priority, make); }

void register_backend(std::unique_ptr<Backend> backend) {
  auto& r = storage();  // not registry(): built-ins register through here
  std::lock_guard lock(r.mu);
  DIMATTN_CHECK(find(r, backend->name()) == nullptr, "register_backend", "a backend named '", backend->name(),
        "' is already registered");
  r.backends.push_back(std::move(backend));
}

Backend& get_backend(const std::string& name) {
  auto& r = registry();
  std::lock_guard lock(r.mu);
  Backend* b = find(r, name);
  DIMATTN_CHECK(b != nullptr, "get_backend", "no backend named '", name, "'; registered: ", joined_names(r),
        ". Backends compiled out (DIMATTN_WITH_TORCH / DIMATTN_WITH_EIGEN = OFF) are not registered.");
  return *b;
}

bool has_backend(const std::string& name) {
  auto& r = registry();
  std::lock_guard lock(r.mu);
  return find(r, name) != nullptr;
}

std::vector<std::string> backend_names() {
  auto& r = registry();
  std::lock_guard lock(r.mu);
  std::vector<std::string> names;
  for (auto& b : r.backends) names.push_back(b->name());
  return names;
}

Backend& default_backend() {
  if (const char* env = std::getenv("DIMATTN_BACKEND"); env && *env) return get_backend(env);
  auto names = backend_names();
  DIMATTN_CHECK(!names.empty(), "default_backend", "no backend is registered; build with DIMATTN_WITH_TORCH or ",
        "DIMATTN_WITH_EIGEN");
  return get_backend(has_backend("torch") ? "torch" : names.front());
}

}  // namespace dimattn
