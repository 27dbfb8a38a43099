#pragma once
// Forcing which attention kernels may run: a scoped, thread-local guard, else
// the environment variable DIMATTN_SDPA ("auto", "reference", or a comma list
// of kernel names). A forced kernel that cannot run a call is an error listing
// the reasons, never a silent fallback.
#include <string>
#include <vector>

namespace dimattn {

// Every kernel name, the same in forcing, logs, explain, the CLI and its JSON:
// "reference" and the kernels of the registered backends' tables.
std::vector<std::string> all_kernel_names();

struct KernelForce {
  bool automatic = true;             // "auto": selection decides
  std::vector<std::string> kernels;  // when !automatic: the allowed kernels, in priority order
  bool allows(const std::string& kernel) const;
  std::string describe() const;  // "auto" or "reference,aten_math"
};

// Parses "auto", "reference" or "a,b,c"; throws naming unknown kernels.
KernelForce parse_kernel_force(const std::string& spec);
// The innermost ForceKernels guard on this thread, else DIMATTN_SDPA, else auto.
KernelForce current_kernel_force();

class ForceKernels {
 public:
  explicit ForceKernels(const std::string& spec);  // as DIMATTN_SDPA
  ~ForceKernels();
  ForceKernels(const ForceKernels&) = delete;
  ForceKernels& operator=(const ForceKernels&) = delete;

 private:
  KernelForce saved_;
  bool had_saved_;
};

// Process-wide: when on, kernels whose results (or gradients) can differ
// between runs with the same inputs are rejected with that reason.
void set_deterministic_algorithms(bool on);
bool deterministic_algorithms();

}  // namespace dimattn
