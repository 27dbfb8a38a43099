#pragma once
// Counters that backends' adapters feed into selection_stats() (selection.h).
// Internal: not installed.
#include <cstdint>
#include <string>

namespace dimattn {

// Called by a backend's adapter for each copy of q, k, v or a mask that a
// kernel's layout requirements forced.
void count_layout_copy();

// Called by a backend for a call whose decision came from its plan cache
// instead of select_kernel: every call that asks for a decision counts as
// one lookup either way.
void count_selection_lookup();
// Changes whenever reset_selection_cache() runs: a plan cached before then
// is stale (its decision would not be in the selection cache any more).
uint64_t selection_epoch();

// The forcing spec in effect on this thread (KernelForce::describe() of
// current_kernel_force()), without copying the forced kernel list.
std::string current_kernel_force_spec();


}  // namespace dimattn
