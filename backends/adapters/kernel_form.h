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
#include <span>
#include <vector>

#include "dimattn/ext/backend.h"
#include "dimattn/ext/layout.h"
#include "dimattn/selection.h"
#include "common/attention_params.h"

namespace dimattn::detail {

Dims join(std::initializer_list<Dims> parts);

// B's dims are the first `split` of (batch dims, keys-only dims), the kv
// heads' dims the rest. Positional (no Dims), so that a cached plan fits every
// call of the same structure; outer_dims gives one call's dims.
struct FlashLayout {
  size_t split = 0;
  int64_t B = 1, Hkv = 1, G = 1, Tq = 1, Tk = 1, D = 1, Dv = 1;
};
FlashLayout flash_layout(const AttentionCall& c);
Dims outer_dims(const AttentionCall& c, const FlashLayout& l);  // the dims of B
Dims batch_head_dims(const AttentionCall& c);                   // the dims of B, then of the kv heads

// A tensor's memory as a kernel reads it (pointer, sizes, strides, dtype):
// Backend::host_view for cpu_flash, the device pointer for cuda_flash.
using MemoryView = std::function<HostView(const RawPtr&)>;
MemoryView host_memory(Backend& be);  // throws when be exposes no host memory

// One operand's raw tensor as a plan reads it: sizes and strides in the
// order of its dims, as spans into memory the caller keeps alive.
struct OperandMemory {
  std::span<const int64_t> sizes, strides;
  const void* storage = nullptr;  // the buffer's identity; null when unknown: overlapping views count as one buffer
  int64_t offset = 0;             // of the first element, in elements (from address 0 when storage is null)
  int64_t element_size = 4;
  bool requires_grad = false;
};

// How one operand's raw tensor becomes its aligned view (its dims in the
// kernel's order: what raw_in_order does), as numbers.
struct OperandForm {
  std::vector<int> perm;  // its axes in the kernel's order; empty when they are in it already
  Shape ones;             // the kernel-order shape with 1 for each dim it lacks; empty when it lacks none
  Shape sizes;            // of the aligned view (each dim's extent)
  std::vector<int64_t> strides;  // of the aligned view: 0 on the dims it lacks and on size-1 dims
};

// The kernel form of a call, derived once per call from its roles and its
// operands' memory, without touching the tensors: the layout, each
// operand's way to its aligned view, the layout class selection sees.
struct KernelForm {
  FlashLayout layout;
  OperandForm q, k, v;
  LayoutClass layout_class = LayoutClass::separate;
  bool requires_grad = false;
};
KernelForm kernel_form(const AttentionCall& c, const OperandMemory (&m)[3]);
// The form of a call on a backend whose tensors expose host memory, and the
// operands' memory it reads (m's spans point into h).
KernelForm host_kernel_form(Backend& be, const AttentionCall& c);
void host_operand_memory(Backend& be, const AttentionCall& c, HostView (&h)[3], OperandMemory (&m)[3]);

struct FlashInputs {
  RawPtr q, k, v;
};
// q, k and v with their dims in the kernel's order, not yet merged: q over
// (B dims, kv head dims, query groups, Tq, D), k over (B dims, kv head dims,
// Tk, D), v over (B dims, kv head dims, Tk, value features). Always views
// (no copies); no backend op where an operand is in that order already.
FlashInputs aligned_inputs(Backend& be, const AttentionCall& c, const KernelForm& f);
// The aligned inputs merged into the kernel's 4-d form: q [B, Hkv·G, Tq, D]
// (QueryForm::heads: groups are GQA heads, as dimattn's kernels take them) or
// [B, Hkv, G·Tq, D] (QueryForm::rows: groups are more query rows, for
// kernels without GQA), k [B, Hkv, Tk, D], v [B, Hkv, Tk, Dv]: views where
// strides allow (unit last stride), else counted copies.
enum class QueryForm { heads, rows };
FlashInputs flash_inputs(Backend& be, const KernelForm& f, const FlashInputs& aligned, const MemoryView& mem,
                         QueryForm form = QueryForm::heads);
FlashInputs flash_inputs(Backend& be, const AttentionCall& c, const KernelForm& f);  // host memory, heads

// The kernel params both kernels take, without outputs; the per-entry arrays
// (kv lengths, causal offsets) are host vectors here, which p points at: a
// device kernel's adapter copies them and repoints p. Not copyable: p points
// into this object.
struct FlashParams {
  kernels::AttentionKernelParams p;
  std::vector<int64_t> kv_len, offset;
  // Per-row kv lengths (lengths over the query's own dims): the lengths
  // tensor's values over its own dims, and where each (b, h) plane starts.
  std::vector<int64_t> kv_rows, kv_row_offsets;
  // Per (b, h) of the kernel (flat index b * H + h): ALiBi slopes, sink
  // logits, and d(sinks) written by the backward pass.
  std::vector<double> slopes, sinks, dsinks;
  // Per (b, h): where the bias, mask, segment id and relative-position
  // table planes start (score_operands).
  std::vector<int64_t> bias_offsets, mask_offsets, qseg_offsets, kvseg_offsets, table_offsets;
  // Relative positions' u and v per (b, h) ([B * H][D], flat index b * H +
  // h), and their gradients written by the backward pass.
  std::vector<double> pos_u, pos_v, dpos_u, dpos_v;
  FlashParams() = default;
  FlashParams(const FlashParams&) = delete;
  FlashParams& operator=(const FlashParams&) = delete;
};
// pre: q, k, v are the memory of flash_inputs' q, k, v.
void flash_params(FlashParams& out, const AttentionCall& c, const FlashLayout& l, const HostView& q,
                  const HostView& k, const HostView& v);
// The dims of the kernel's flat (b, h) index: B dims, kv head dims, query groups.
Dims per_head_dims(const AttentionCall& c);
// A gradient per (b, h) (then over `inner`, row-major: g holds
// per_head_dims(c) then `inner`) summed over the dims `like` lacks, as a
// tensor over like's dims on `be` (like's dtype and device): d(sinks), d(u),
// d(v) of relative positions. pre: like's dims are per-head dims and `inner`.
Tensor per_head_gradient(Backend& be, const AttentionCall& c, const Tensor& like, const std::vector<double>& g,
                         const Dims& inner = {});
// The call's bias, mask and segment ids as the kernels read them: the bias
// in the accumulation type, the mask as bytes, the ids as int64, each with
// its own strides (a
// broadcast view stays one: never expanded over the dims it lacks), the bias
// made contiguous when `dense_bias` (d(bias) is laid out as it).
// Points pr.p at their memory (`mem`: host or device, as the kernel reads
// it), with per-(b, h) plane offsets in pr and row and column strides, 0
// where they lack a dim. The result keeps the memory alive; null members
// when the call has no bias, mask or segments.
// The relative positions' table (c.variants.pos_emb) the same way, in the
// call's dtype, contiguous over rel_pos_table_order(c) (d(table) is laid out
// as it).
struct ScoreOperands {
  RawPtr bias, mask, query_segments, kv_segments, pos_emb;
};
ScoreOperands score_operands(Backend& be, const AttentionCall& c, FlashParams& pr, const MemoryView& mem,
                             bool dense_bias = false);
// d(bias) for the kernel to write: zeros laid out as score_operands' dense bias,
// on `device`; p.score.dbias points at it (and dbias_shared says whether bias
// elements are shared by several (b, h, i, j)). pre: score_operands ran.
RawPtr bias_gradient_buffer(Backend& be, FlashParams& pr, const AttentionCall& c, const MemoryView& mem,
                            Device device);
// That buffer as the gradient of the call's bias: over its dims, in its dtype.
Tensor bias_gradient(Backend& be, const AttentionCall& c, const RawPtr& dbias);
// The table's dims as the kernels read it: its per-head dims (in its own
// order), the relative-position dim, key_dim.
Dims rel_pos_table_order(const AttentionCall& c);
// d(table) for the kernel to write, as bias_gradient_buffer: zeros laid out as
// score_operands' table. pre: score_operands ran.
RawPtr rel_pos_gradient_buffer(Backend& be, FlashParams& pr, const AttentionCall& c, const MemoryView& mem,
                               Device device);

// out [B, H, Tq, Dv] and lse [B, H, Tq]: written by the forward pass, read by the backward pass.
void set_forward_outputs(kernels::AttentionKernelParams& p, const HostView& out, const HostView& lse);
void set_backward_tensors(kernels::AttentionKernelParams& p, const HostView& dout, const HostView& dq,
                          const HostView& dk, const HostView& dv);
kernels::ElementType kernel_element_type(DType d);  // throws for non-floating dtypes
// A window as the kernels' row bounds (-1: no bound on that side); none: unbounded.
kernels::RowBounds row_bounds_of(const std::optional<AttentionWindow>& w);
kernels::ElementStrides strides4(const HostView& v);  // pre: v is 4-d

// out [B, H, Tq, Dv] as the call's output tensor (on the query's device).
Tensor flash_output(Backend& be, const AttentionCall& c, const RawPtr& out4);

// --- blocks of a longer attention and fused backward passes (cpu_flash, cuda_flash) ---

// The lse's dtype: float32, float64 for float64 calls.
DType lse_dtype_of(const AttentionCall& c);
// A tensor over the call's output dims (without the value features when
// !with_features), `what` naming it in errors, as the kernel's [B, H, Tq(, Dv)].
RawPtr in_kernel_form(Backend& be, const AttentionCall& c, const FlashLayout& l, const Tensor& t, const char* what,
                      bool with_features, DType dtype, const char* op);
// The kernel's out [B, H, Tq, Dv] and lse [B, H, Tq] as a block's result.
AttentionBlockResult block_result(Backend& be, const AttentionCall& c, const RawPtr& out4, const RawPtr& lse3);
// What a fused backward pass gives: dq, dk, dv in the shapes of
// flash_inputs' q, k, v; with sinks, d(sinks) per (b, h) (per_head_gradient
// names it); with a bias whose gradient is wanted, d(bias) as
// bias_gradient_buffer lays it out (else null).
// With relative positions, d(table) as rel_pos_gradient_buffer lays it out
// (null when not wanted) and d(u), d(v) per (b, h) as FlashParams holds them.
struct FlashGrads {
  FlashInputs inputs;
  std::vector<double> dsinks;
  RawPtr dbias;
  RawPtr dpos_emb;
  std::vector<double> dpos_u, dpos_v;
};
// Those as the call's gradients (Backend::attention_backward).
AttentionCallGrads call_grads(Backend& be, const AttentionCall& c, const FlashGrads& g);
// The learnable variants' gradients of g alone, each over its tensor's dims.
AttentionVariants variant_grads(Backend& be, const AttentionCall& c, const FlashGrads& g);

}  // namespace dimattn::detail
