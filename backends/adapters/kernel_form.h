#pragma once
// The one mapping from an attention call's roles to the fused kernels' form,
// shared by every backend and every fused kernel: cpu_flash (cpu_flash_path.h),
// cuda_flash and ATen's SDPA kernels (backends/torch). Views wherever strides
// allow; each copy is counted (selection_stats().layout_copies).
//
// Kernel form: B = a prefix of (batch dims, keys-only dims) — all batch dims
// but the last, or more when kv lengths or the causal offset vary over later
// ones; kv heads = the rest; query heads = kv heads × query groups (GQA: one kv
// head serves its groups without a copy). The flat index b·H + h is then
// philox.h's canonical index (batch dims, keys-only dims, groups), so dropout
// masks match the reference path exactly.
#include <functional>
#include <initializer_list>
#include <vector>

#include "dimattn/ext/backend.h"
#include "dimattn/selection.h"
#include "common/attention_params.h"

namespace dimattn::detail {

Dims join(std::initializer_list<Dims> parts);

struct FlashLayout {
  Dims outer, head;  // dims of B and of the kv heads
  int64_t B, Hkv, G, Tq, Tk, D, Dv;
};
FlashLayout flash_layout(const AttentionCall& c);

// A tensor's memory as a kernel reads it (pointer, sizes, strides, dtype):
// Backend::host_view for cpu_flash, the device pointer for cuda_flash.
using MemoryView = std::function<HostView(const RawPtr&)>;
MemoryView host_memory(Backend& be);  // throws when be exposes no host memory

struct FlashInputs {
  RawPtr q, k, v;
};
// q, k and v with their dims in the kernel's order, not yet merged: q over
// (B dims, kv head dims, query groups, Tq, D), k over (B dims, kv head dims,
// Tk, D), v over (B dims, kv head dims, Tk, value features). Always views
// (no copies): what selection classifies (flash_layout_class).
FlashInputs aligned_inputs(const AttentionCall& c, const FlashLayout& l);
// The aligned inputs merged into the kernel's 4-d form: q [B, Hkv·G, Tq, D]
// (QueryForm::heads: groups are GQA heads, as dimattn's kernels take them) or
// [B, Hkv, G·Tq, D] (QueryForm::rows: groups are more query rows, for
// kernels without GQA), k [B, Hkv, Tk, D], v [B, Hkv, Tk, Dv]: views where
// strides allow (unit last stride), else counted copies.
enum class QueryForm { heads, rows };
FlashInputs flash_inputs(Backend& be, const FlashLayout& l, const FlashInputs& aligned, const MemoryView& mem,
                         QueryForm form = QueryForm::heads);
FlashInputs flash_inputs(Backend& be, const AttentionCall& c, const FlashLayout& l);  // host memory, heads
// The layout class of aligned inputs (aligned_inputs), from their memory.
LayoutClass flash_layout_class(Backend& be, const FlashInputs& aligned);
LayoutClass flash_layout_class(const FlashInputs& aligned, const MemoryView& mem);

// The kernel params both kernels take, without outputs; the per-entry arrays
// (kv lengths, causal offsets) are host vectors here, which p points at: a
// device kernel's adapter copies them and repoints p. Not copyable: p points
// into this object.
struct FlashParams {
  kernels::AttentionKernelParams p;
  std::vector<int64_t> kv_len, offset;
  // Per (b, h) of the kernel (flat index b * H + h): ALiBi slopes, sink
  // logits, and d(sinks) written by the backward pass.
  std::vector<double> slopes, sinks, dsinks;
  FlashParams() = default;
  FlashParams(const FlashParams&) = delete;
  FlashParams& operator=(const FlashParams&) = delete;
};
// pre: q, k, v are the memory of flash_inputs' q, k, v.
void flash_params(FlashParams& out, const AttentionCall& c, const FlashLayout& l, const HostView& q,
                  const HostView& k, const HostView& v);
// The dims of the kernel's flat (b, h) index: B dims, kv head dims, query groups.
Dims per_head_dims(const AttentionCall& c, const FlashLayout& l);
// d(sinks) per (b, h) summed over the dims the call's sinks lack, as a tensor
// over the sinks' dims on `be` (dtype and device of the sinks).
Tensor sinks_gradient(Backend& be, const AttentionCall& c, const FlashLayout& l, const std::vector<double>& dsinks);
// out [B, H, Tq, Dv] and lse [B, H, Tq]: written by the forward pass, read by the backward pass.
void set_forward_outputs(kernels::AttentionKernelParams& p, const HostView& out, const HostView& lse);
void set_backward_tensors(kernels::AttentionKernelParams& p, const HostView& dout, const HostView& dq,
                          const HostView& dk, const HostView& dv);
kernels::ElementType kernel_element_type(DType d);  // throws for non-floating dtypes
kernels::ElementStrides strides4(const HostView& v);  // pre: v is 4-d

// out [B, H, Tq, Dv] as the call's output tensor (on the query's device).
Tensor flash_output(Backend& be, const AttentionCall& c, const FlashLayout& l, const RawPtr& out4);

}  // namespace dimattn::detail
