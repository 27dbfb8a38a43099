#include "dimattn/forcing.h"

#include <algorithm>
#include <atomic>
#include <map>
#include <cstdlib>
#include <mutex>
#include <optional>
#include <sstream>

#include "dimattn/error.h"
#include "dimattn/ext/backend.h"
#include "dimattn/registry.h"
#include "dimattn/internal/check.h"
#include "dimattn/internal/counters.h"

namespace dimattn {
namespace {
thread_local std::optional<KernelForce> t_force;
thread_local std::string t_spec;  // t_force->describe(), when t_force
std::atomic<bool> g_deterministic{false};
}  // namespace

void set_deterministic_algorithms(bool on) { g_deterministic = on; }
bool deterministic_algorithms() { return g_deterministic; }

// Derived from the kernel tables of the backends registered now (parsed
// forcing specs are cached, so this runs once per distinct spec).
std::vector<std::string> all_kernel_names() {
  std::vector<std::string> names = {kReferenceKernel};
  for (const std::string& b : backend_names())
    for (const KernelEntry& e : get_backend(b).attention_table())
      if (std::find(names.begin(), names.end(), e.name) == names.end()) names.push_back(e.name);
  return names;
}

bool KernelForce::allows(const std::string& kernel) const {
  if (automatic) return true;
  for (const auto& k : kernels)
    if (k == kernel) return true;
  return false;
}

std::string KernelForce::describe() const {
  if (automatic) return "auto";
  std::string s;
  for (const auto& k : kernels) s += (s.empty() ? "" : ",") + k;
  return s;
}

KernelForce parse_kernel_force(const std::string& spec) {
  if (spec.empty() || spec == "auto") return {};
  // Parsed specs are kept (a program uses a few; a forcing scope per call,
  // as the Python op opens, would otherwise list every backend's kernels
  // each time). Only valid specs are kept: an unknown name stays an error.
  // The thread's last one first, without the lock (the op forces the same
  // kernels call after call).
  thread_local std::string last_spec;
  thread_local KernelForce last;
  if (!last_spec.empty() && spec == last_spec) return last;
  static std::mutex mu;
  static std::map<std::string, KernelForce, std::less<>> parsed;
  {
    std::lock_guard lock(mu);
    if (const auto it = parsed.find(spec); it != parsed.end()) {
      last_spec = spec;
      last = it->second;
      return it->second;
    }
  }
  KernelForce f{false, {}};
  std::stringstream ss(spec);
  std::string name;
  while (std::getline(ss, name, ',')) {
    const std::vector<std::string> names = all_kernel_names();
    const bool known = std::find(names.begin(), names.end(), name) != names.end();
    std::string all;
    for (const auto& k : names) all += (all.empty() ? "" : ", ") + k;
    DIMATTN_CHECK(known, "DIMATTN_SDPA", "unknown kernel '", name, "' in '", spec, "'; use auto or a comma list of: ", all);
    f.kernels.push_back(name);
  }
  DIMATTN_CHECK(!f.kernels.empty(), "DIMATTN_SDPA", "no kernel named in '", spec, "'");
  std::lock_guard lock(mu);
  if (parsed.size() < 64) parsed.emplace(spec, f);
  return f;
}

KernelForce current_kernel_force() {
  if (t_force) return *t_force;
  // The environment is read on each call (cheap) so that tests and tools may
  // change it; parse results are cached per distinct value.
  const char* env = std::getenv("DIMATTN_SDPA");
  if (!env || !*env) return {};
  static std::mutex mu;
  static std::string cached_spec;
  static KernelForce cached;
  std::lock_guard lock(mu);
  if (cached_spec != env) {
    cached = parse_kernel_force(env);
    cached_spec = env;
  }
  return cached;
}

std::string current_kernel_force_spec() {
  if (t_force) return t_spec;
  const char* env = std::getenv("DIMATTN_SDPA");
  if (!env || !*env) return "auto";
  return current_kernel_force().describe();
}

ForceKernels::ForceKernels(const std::string& spec) : had_saved_(t_force.has_value()) {
  KernelForce f = parse_kernel_force(spec);
  if (had_saved_) saved_ = *t_force;
  t_force = f;
  t_spec = f.describe();
}

ForceKernels::~ForceKernels() {
  if (had_saved_) {
    t_force = saved_;
    t_spec = saved_.describe();
  } else {
    t_force.reset();
  }
}

}  // namespace dimattn
