#pragma once
// A backend's attention kernels as one table: the single source of truth for
// what selection tries (in priority order, per device), what forcing accepts,
// what `dimattn explain` lists and what run_attention, attention_block and
// attention_backward run. Nothing else lists or dispatches kernels by name
// (DESIGN.md §4).
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "dimattn/dtype.h"
#include "dimattn/ext/attention_call.h"
#include "dimattn/ext/layout.h"
#include "dimattn/selection.h"

namespace dimattn {

class Backend;
struct AttentionPlan;

// What a caller asks of a kernel: dot_attention's output (KernelEntry::run,
// with the backend's autograd where it has one), or, outside autograd, a
// block's output and lse (KernelEntry::block) or a call's gradients
// (KernelEntry::backward; a block's from the merged output and lse).
// Selection, forcing and their errors are per use: a kernel without the
// use's function is a rejected candidate, with the reason.
enum class KernelUse { run, block, backward, block_backward };
// The op that asks it, as errors name it: "dot_attention", "dot_attention_block", ...
const char* kernel_use_op(KernelUse use);

struct KernelEntry {
  std::string name;  // as in forcing, logs, explain, the CLI and its JSON
  DeviceType device;
  std::function<GateResult(const AttentionParams&)> gate;
  // What the kernel needs of q, k and v in its form; views that miss it are
  // copied (and counted) before the kernel runs.
  LayoutRequirements layout;
  // Runs the kernel on a call its gate accepted, with the plan that chose
  // it; empty for the reference path, which dot_attention runs itself.
  std::function<Tensor(Backend&, const AttentionCall&, const AttentionPlan&)> run;
  // The call as one block of a longer attention: its output and each row's
  // lse, outside autograd. Empty for kernels that give no lse.
  std::function<AttentionBlockResult(Backend&, const AttentionCall&, const AttentionPlan&)> block;
  // The call's gradients for grad_output, outside autograd: the whole call's
  // (merged null: recomputes the forward pass) or a block's (merged: the
  // whole attention's output and lse for the block's rows). Empty for
  // kernels without a backward pass of their own.
  std::function<AttentionCallGrads(Backend&, const AttentionCall&, const AttentionPlan&, const Tensor& grad_output,
                                   const AttentionBlockResult* merged)>
      backward;

  // Attention over a paged kv cache read in place (kv_cache_attention);
  // empty for kernels that cannot, for which the frontend gathers the pages
  // and runs dot_attention's reference path.
  std::function<Tensor(Backend&, const PagedAttentionCall&)> paged;

  // Whether it has the function `use` needs; else why not (for the rejection).
  GateResult serves(KernelUse use) const;
  // The code path the kernel runs for params (Decision::isa); empty for a
  // kernel with one.
  std::function<std::string(const AttentionParams&)> isa;
};
using KernelTable = std::vector<KernelEntry>;

// One call's plan: the decision and what the backend derived from the call to
// reach it (for the fused kernels, the kernel form: adapters/kernel_form.h),
// made once per call by Backend::plan_attention and handed to run_attention,
// so that nothing is derived twice per call. A plan holds nothing of the call
// that made it but what follows from its structure (which role each dim has,
// extents, strides, dtype, device, the options that select), never values,
// pointers or Dims, so that a backend may cache plans by that structure and
// reuse one for every call that has it (docs/selection.md).
struct AttentionPlan {
  virtual ~AttentionPlan() = default;
  Decision decision;
  const KernelEntry* entry = nullptr;  // the chosen entry of the backend's table
};
using AttentionPlanPtr = std::shared_ptr<const AttentionPlan>;

// The table's entry for (device, name); null when there is none.
const KernelEntry* find_kernel(const KernelTable& table, DeviceType device, const std::string& name);

// The reference path's entry, last on every device of every table.
KernelEntry reference_entry(DeviceType device);

// Decides among the table's entries for params.device (priority order; the
// last is "reference", whose gate always passes), for `use`: the first that
// forcing allows (params.forced), that serves the use and whose gate passes;
// the rest before it are rejected with the reason. When none can, throws
// dimattn::Error listing the reasons, so that forcing a kernel that cannot
// run (or "reference" for a block) is an error that says why, never a
// silent fallback. Cached per (backend, params, use).
Decision select_kernel(const std::string& backend, const AttentionParams& params, const KernelTable& table,
                       KernelUse use);

}  // namespace dimattn
