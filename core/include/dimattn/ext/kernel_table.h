#pragma once
// A backend's attention kernels as one table: the single source of truth for
// what selection tries (in priority order, per device), what forcing accepts,
// what `dimattn explain` lists and what run_attention runs. Nothing else
// lists or dispatches kernels by name (DESIGN.md §4).
#include <functional>
#include <string>
#include <vector>

#include "dimattn/dtype.h"
#include "dimattn/ext/attention_call.h"
#include "dimattn/ext/layout.h"
#include "dimattn/selection.h"

namespace dimattn {

class Backend;

struct KernelEntry {
  std::string name;  // as in forcing, logs, explain, the CLI and its JSON
  DeviceType device;
  std::function<GateResult(const AttentionParams&)> gate;
  // What the kernel needs of q, k and v in its form; views that miss it are
  // copied (and counted) before the kernel runs.
  LayoutRequirements layout;
  // Runs the kernel on a call its gate accepted; empty for the reference
  // path, which dot_attention runs itself.
  std::function<Tensor(Backend&, const AttentionCall&)> run;
};
using KernelTable = std::vector<KernelEntry>;

// The reference path's entry, last on every device of every table.
KernelEntry reference_entry(DeviceType device);

// select_kernel (selection.h) over the table's entries for params.device.
Decision select_kernel(const std::string& backend, const AttentionParams& params, const KernelTable& table);

}  // namespace dimattn
