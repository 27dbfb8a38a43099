#pragma once
// Plans of the backends whose fused kernels take the kernel form
// (kernel_form.h): made once per call, handed from decide to run, and cached
// per thread by what determines them (docs/selection.md, "Plans").
#include <cstdint>
#include <memory>

#include "adapters/kernel_form.h"
#include "dimattn/ext/kernel_table.h"

namespace dimattn::detail {

struct FormPlan : AttentionPlan {
  KernelForm form;
};

// The plan of `c` for `use` on `be`: this thread's cached plan for a call of
// the same structure and use made since the last reset_selection_cache(),
// else a new one (kernel_form, attention_params, select_kernel over be's
// table), cached.
// The structure is everything a plan follows from: each operand's dims as
// roles with their extents and its strides (never Dim identities: self-
// attention relabels the kv axis to a fresh Dim on every call), which operands
// share a buffer and at which distance from each other, requires_grad, dtype,
// device, the dims kv lengths and causal offsets vary over, the causal,
// offset, padding and dropout flags, forcing and determinism. Never values,
// pointers, lengths or seeds: they change every step. A hit counts as a
// selection lookup, as the select_kernel call it saves would.
std::shared_ptr<const FormPlan> plan_with_form(Backend& be, const AttentionCall& c, const OperandMemory (&m)[3],
                                               KernelUse use);
// The same from the backend's host views (Backend::host_view).
std::shared_ptr<const FormPlan> plan_with_host_form(Backend& be, const AttentionCall& c, KernelUse use);

// The form a plan carries; null for plans of other kinds.
const KernelForm* form_in(const AttentionPlan& plan);

// This thread's plan cache (tests, benchmarks).
struct PlanCacheStats {
  uint64_t hits = 0, misses = 0, entries = 0;
};
PlanCacheStats plan_cache_stats();
inline constexpr size_t kPlanCacheCapacity = 16;  // per thread; the oldest entry goes first

}  // namespace dimattn::detail
