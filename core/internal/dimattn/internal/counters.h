#pragma once
// Counters that backends' adapters feed into selection_stats() (selection.h).
// Internal: not installed.
namespace dimattn {

// Called by a backend's adapter for each copy of q, k, v or a mask that a
// kernel's layout requirements forced.
void count_layout_copy();

}  // namespace dimattn
