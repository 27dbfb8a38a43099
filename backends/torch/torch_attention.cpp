// The torch backend's attention kernels: its kernel table (dimattn's own
// cpu_flash and cuda_flash, ATen's SDPA kernels) with their gates and the
// adapter from roles to ATen's [B, H, T, D].
//
// Kernel form: the one mapping of adapters/cpu_flash_path.h (B and kv heads
// from the batch and keys-only dims). For ATen, query groups (beam, GQA heads
// per kv head) become more query rows, [B, H, G*Tq, D], so that one kv head
// serves them without a copy; for causal attention with groups the rows would
// lose their position, and the groups become GQA heads instead,
// [B, H*G, Tq, D], which only ATen's math kernel takes. Views are used
// wherever strides allow; each copy is counted.
#include <ATen/core/Tensor.h>
#include <ATen/ops/_scaled_dot_product_attention_math_ops.h>
#include <ATen/ops/_scaled_dot_product_cudnn_attention_ops.h>
#include <ATen/ops/_scaled_dot_product_efficient_attention_ops.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu_ops.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_ops.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/custom_function.h>

#include <limits>

#include "adapters/cpu_flash_path.h"
#include "adapters/plan_cache.h"
#include "common/attention_mask.h"
#include "adapters/cuda_flash_gate.h"
#include "cuda_flash_path.h"
#include "flash_function.h"
#include "torch_backend.h"
#include "torch_raw.h"
#include "dimattn/ext/layout.h"
#include "dimattn/selection.h"
#include "dimattn/internal/check.h"
#include "dimattn/internal/counters.h"

namespace dimattn::torch_backend {
namespace {

constexpr const char* kOp = "dot_attention";

bool is_16bit(DType d) { return d == DType::bfloat16 || d == DType::float16; }

// --- gates: what each ATen kernel can run, as values with reasons ---

// ATen's kernels take none of dimattn's variants: a window or ALiBi would be a
// materialised [B, H, Tq, Tk] bias, which costs what the reference path
// costs; a bias or mask could ride in attn_mask, but without d(bias) on every
// kernel; soft-capping and sinks they cannot express. dimattn's own kernels
// (cpu_flash, cuda_flash) compute them in the tiles. Rejecting by the set,
// not by name, keeps a new variant off ATen's paths without a change here.
GateResult variants_gate(const AttentionParams& p) {
  if (!p.variants.any()) return GateResult::pass();
  return GateResult::fail("does not take " + p.variants.names(true) +
                          " (ATen's kernels would need it as a materialised [B, H, Tq, Tk] bias or attn_mask, "
                          "without d(bias) on every kernel, or cannot express it); cpu_flash and cuda_flash compute "
                          "it per tile");
}

// The padding mask ATen's kernels get (masks_of) is one per batch entry,
// shared by every query head and group: per-row kv lengths do not fit it.
GateResult padding_gate(const AttentionParams& p) {
  if (p.padding != Padding::per_row) return GateResult::pass();
  return GateResult::fail("kv lengths vary over the query's own dims (each query row its own kv length), which the "
                          "per-batch-entry mask dimattn builds for ATen's kernels cannot express; cpu_flash and "
                          "cuda_flash take them per row");
}

GateResult common_fused_gate(const AttentionParams& p) {
  if (GateResult v = variants_gate(p); !v.ok) return v;
  if (GateResult v = padding_gate(p); !v.ok) return v;
  if (p.dropout)
    return GateResult::fail("dropout would come from ATen's RNG, not the shared Philox stream, so the result "
                            "could not be reproduced by the reference path");
  if (p.causal && p.gqa_ratio > 1)
    return GateResult::fail("causal attention with query groups (GQA/beam) needs kv repeated per group");
  if (p.head_dim_qk != p.head_dim_v) return GateResult::fail("needs equal qk and v head dims");
  return GateResult::pass();
}

GateResult gate_flash_cpu(const AttentionParams& p) {
  if (p.device != DeviceType::cpu) return GateResult::fail("runs on CPU only");
  return common_fused_gate(p);
}

GateResult gate_math(const AttentionParams& p) {
  if (GateResult v = variants_gate(p); !v.ok) return v;
  if (GateResult v = padding_gate(p); !v.ok) return v;
  if (p.dropout)
    return GateResult::fail("dropout would come from ATen's RNG (its explicit mask is a testing hook), not the "
                            "shared Philox stream");
  return GateResult::pass();
}

GateResult cuda_gate(const AttentionParams& p, bool allows_fp32, int64_t max_head_dim) {
  if (p.device != DeviceType::cuda) return GateResult::fail("runs on CUDA only");
  if (!is_16bit(p.dtype) && !(allows_fp32 && p.dtype == DType::float32))
    return GateResult::fail(std::string("does not take ") + dtype_name(p.dtype));
  if (p.head_dim_qk % 8 != 0 || p.head_dim_qk > max_head_dim)
    return GateResult::fail("head dim " + std::to_string(p.head_dim_qk) + " is not a multiple of 8 up to " +
                            std::to_string(max_head_dim));
  return common_fused_gate(p);
}

GateResult gate_cudnn(const AttentionParams& p) {
  if (p.requires_grad && p.deterministic) return GateResult::fail("backward is not deterministic");
  return cuda_gate(p, false, 128);
}

GateResult gate_flash_cuda(const AttentionParams& p) {
  if (p.padding != Padding::none || p.offset != OffsetKind::none)
    return GateResult::fail("takes no mask: kv padding and causal offsets need one");
  return cuda_gate(p, false, 256);
}

GateResult gate_efficient(const AttentionParams& p) {
  if (p.requires_grad && p.deterministic) return GateResult::fail("backward is not deterministic");
  return cuda_gate(p, true, 256);
}

// --- roles -> kernel form ---

ViewLayout view_of(const at::Tensor& t) {
  ViewLayout v;
  v.sizes = t.sizes().vec();
  v.strides = t.strides().vec();
  v.storage = t.storage().unsafeGetStorageImpl();
  v.offset = t.storage_offset();
  v.element_size = static_cast<int64_t>(t.element_size());
  v.data_address = reinterpret_cast<uintptr_t>(t.const_data_ptr());
  return v;
}

// t as the kernel can read it: itself, or a counted copy.
at::Tensor meeting(const at::Tensor& t, const LayoutRequirements& req, const char* which) {
  if (check_layout(view_of(t), req, which).ok) return t;
  count_layout_copy();
  return t.contiguous();
}

// The mask as the ATen kernels take it when called directly: an additive
// bias in the query's dtype (0 or -inf), [B, 1, Tq or 1, Tk]. (Only the
// public SDPA entry converts bool masks; the kernels read any mask as a
// bias.) Built on the host from the per-entry kv lengths and causal offsets.
// Kernels give NaN for a query row without any allowed kv position: such
// rows see kv position 0 instead, and `row_ok` [B, Tq] zeroes them (their
// gradients too) after the kernel.
struct Masks {
  std::optional<at::Tensor> bias;
  std::optional<at::Tensor> row_ok;
  std::optional<at::Tensor> kv_valid;  // [B, 1, Tk, 1]: kv positions inside the lengths, with padding
};

Masks masks_of(const AttentionCall& c, const detail::FlashLayout& f, const at::TensorOptions& like) {
  Masks m;
  const bool padding = c.kv_spatial.is_dynamic();
  if (!padding && !c.causal_offset) return m;  // none, or plain causal via is_causal
  const Dims outer = detail::outer_dims(c, f);
  const std::vector<int64_t> len = padding ? host_ints(c.kv_spatial.lengths(), outer) : std::vector<int64_t>{};
  const std::vector<int64_t> off = c.causal_offset ? host_ints(*c.causal_offset, outer) : std::vector<int64_t>{};
  const int64_t rows = c.causal ? f.Tq : 1;  // without causal every row of an entry is the same
  std::vector<float> bias(static_cast<size_t>(f.B * rows * f.Tk));
  std::vector<uint8_t> ok(static_cast<size_t>(f.B * f.Tq), 1);
  bool all_ok = true;
  for (int64_t b = 0; b < f.B; ++b) {
    // The one mask definition of the fused kernels (common/attention_mask.h).
    const kernels::EntryMask mask = kernels::entry_mask(nullptr, padding ? len.data() : nullptr,
                                                        off.empty() ? nullptr : off.data(), c.causal, f.Tq, f.Tk, b);
    for (int64_t i = 0; i < rows; ++i) {
      kernels::Range r = mask.row(i);
      if (r.empty()) {
        for (int64_t q = c.causal ? i : 0; q < (c.causal ? i + 1 : f.Tq); ++q) ok[b * f.Tq + q] = 0;
        all_ok = false;
        r = {0, std::min<int64_t>(1, f.Tk)};
      }
      float* row = bias.data() + (b * rows + i) * f.Tk;
      for (int64_t j = 0; j < f.Tk; ++j) row[j] = r.contains(j) ? 0.0f : -std::numeric_limits<float>::infinity();
    }
  }
  if (padding) {
    std::vector<uint8_t> valid(static_cast<size_t>(f.B * f.Tk));
    for (int64_t b = 0; b < f.B; ++b)
      for (int64_t j = 0; j < f.Tk; ++j) valid[b * f.Tk + j] = j < len[b];
    m.kv_valid = at::from_blob(valid.data(), {f.B, 1, f.Tk, 1}, at::TensorOptions().dtype(at::kBool))
                     .to(like.device(), at::kBool, false, /*copy=*/true);
  }
  const auto on_device = [&](auto* data, at::IntArrayRef shape, at::ScalarType type) {
    return at::from_blob(data, shape, at::TensorOptions().dtype(type))
        .to(like.device(), type == at::kBool ? at::kBool : c10::typeMetaToScalarType(like.dtype()),
            /*non_blocking=*/false, /*copy=*/true);
  };
  m.bias = on_device(bias.data(), {f.B, 1, rows, f.Tk}, at::kFloat);
  if (!all_ok) m.row_ok = on_device(ok.data(), {f.B, f.Tq}, at::kBool);
  return m;
}

// One ATen SDPA kernel called on the kernel form (heads_form: the query
// groups as heads, for causal attention with groups).
struct AtenArgs {
  at::Tensor q, k, v;
  std::optional<at::Tensor> bias;
  bool is_causal;
  std::optional<double> scale;
  bool requires_grad, heads_form;
};
using AtenKernel = at::Tensor (*)(const AtenArgs&);

at::Tensor aten_flash_cpu(const AtenArgs& a) {
  return std::get<0>(
      at::_ops::_scaled_dot_product_flash_attention_for_cpu::call(a.q, a.k, a.v, 0.0, a.is_causal, a.bias, a.scale));
}
at::Tensor aten_math(const AtenArgs& a) {
  return std::get<0>(at::_ops::_scaled_dot_product_attention_math::call(a.q, a.k, a.v, a.bias, 0.0, a.is_causal,
                                                                        std::nullopt, a.scale, a.heads_form));
}
at::Tensor aten_flash(const AtenArgs& a) {
  return std::get<0>(at::_ops::_scaled_dot_product_flash_attention::call(a.q, a.k, a.v, 0.0, a.is_causal, false, a.scale));
}
at::Tensor aten_efficient(const AtenArgs& a) {
  return std::get<0>(at::_ops::_scaled_dot_product_efficient_attention::call(a.q, a.k, a.v, a.bias, a.requires_grad,
                                                                             0.0, a.is_causal, a.scale));
}
at::Tensor aten_cudnn(const AtenArgs& a) {
  return std::get<0>(at::_ops::_scaled_dot_product_cudnn_attention::call(a.q, a.k, a.v, a.bias, a.requires_grad, 0.0,
                                                                         a.is_causal, false, a.scale));
}

// Roles -> kernel form -> `kernel` -> the call's output.
Tensor run_aten(TorchBackend& be, const AttentionCall& c, const detail::KernelForm& form, const KernelEntry& entry,
                AtenKernel kernel) {
  const detail::FlashLayout& f = form.layout;
  AtenArgs a;
  a.heads_form = c.causal && f.G > 1;  // gates allow it only for aten_math
  const detail::FlashInputs in = detail::flash_inputs(be, form, detail::aligned_inputs(be, c, form), memory_of_raw,
                                                      a.heads_form ? detail::QueryForm::heads : detail::QueryForm::rows);
  // flash_inputs gives unit last strides already: requirements beyond that
  // are checked per view (addresses change every call).
  const LayoutRequirements& req = entry.layout;
  const bool met = req.stride_multiple == 1 && req.address_alignment == 1 && req.zero_strides_ok;
  a.q = met ? as_aten(in.q) : meeting(as_aten(in.q), req, "query");
  a.k = met ? as_aten(in.k) : meeting(as_aten(in.k), req, "keys");
  a.v = met ? as_aten(in.v) : meeting(as_aten(in.v), req, "values");
  const Masks m = masks_of(c, f, a.q.options());
  if (m.kv_valid) {
    // Padding is not data: a masked weight is 0, but 0 * NaN is NaN, and a
    // NaN energy plus the mask's -inf is NaN too, so padded keys and values
    // (an uninitialised cache, say) are zeroed first, as the reference path
    // and cpu_flash never read them (docs/errors.md).
    const at::Tensor padded = m.kv_valid->logical_not();
    a.k = a.k.masked_fill(padded, 0);
    a.v = a.v.masked_fill(padded, 0);
  }
  a.is_causal = c.causal && !m.bias;  // top-left, offset 0, no padding
  a.scale = c.scale;
  a.bias = m.bias;
  a.requires_grad = a.q.requires_grad() || a.k.requires_grad() || a.v.requires_grad();
  at::Tensor out4;
  try {
    out4 = kernel(a);
  } catch (const c10::Error& e) {
    // A gate let through a call the kernel refuses: a bug in our gates, reported as such.
    detail::fail(kOp, "kernel ", entry.name, " failed on a call its gate accepted (", e.what_without_backtrace(),
                 "); force another kernel with DIMATTN_SDPA and report this");
  }
  if (m.row_ok) {
    // Rows are (groups, Tq) or, in the heads form, Tq alone: zero the rows
    // without any allowed kv position, per batch entry and query position.
    const at::Tensor keep = a.heads_form ? m.row_ok->view({f.B, 1, f.Tq, 1}) : m.row_ok->view({f.B, 1, 1, f.Tq, 1});
    const at::Tensor o = a.heads_form ? out4 : out4.reshape({f.B, f.Hkv, f.G, f.Tq, f.Dv});
    out4 = o.masked_fill(keep.logical_not(), 0);
  }
  return detail::flash_output(be, c, wrap(out4));
}

// --- dimattn's own CPU kernel, with autograd ---

// at::parallel_for is a header template; in a LibTorch built with OpenMP it
// splits work only where this file is compiled with OpenMP too, and runs the
// whole range on the calling thread otherwise (backends/CMakeLists.txt).
#if AT_PARALLEL_OPENMP && !defined(_OPENMP)
#error "compile the torch backend with OpenMP (-fopenmp), or at::parallel_for runs serially"
#endif
kernels::ParallelFor aten_parallel_for() {
  return [](int64_t begin, int64_t end, const kernels::ParallelBody& body) {
    at::parallel_for(begin, end, 1, [&](int64_t b, int64_t e) { body(b, e); });
  };
}

// cpu_flash's two passes for FlashFunction (flash_function.h), on ATen's threads.
struct CpuFlash {
  static FlashSaved forward(const FlashCall& fc, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
    const detail::FlashForward f =
        detail::flash_forward(*fc.be, fc.call, fc.layout, {wrap(q), wrap(k), wrap(v)}, aten_parallel_for());
    return {q, k, v, as_aten(f.out), as_aten(f.lse)};
  }
  static detail::FlashGrads backward(const FlashCall& fc, const FlashSaved& s, const at::Tensor& dout) {
    return detail::flash_backward(*fc.be, fc.call, fc.layout, {wrap(s.q), wrap(s.k), wrap(s.v)},
                                  {wrap(s.out), wrap(s.lse)}, wrap(dout), aten_parallel_for());
  }
};

// The kernel form in a plan of this backend (plan_attention).
const detail::KernelForm& form_of(const AttentionPlan& plan) {
  const detail::KernelForm* form = detail::form_in(plan);
  DIMATTN_CHECK(form != nullptr, kOp, "internal error: a plan without a kernel form reached the torch backend's kernels");
  return *form;
}

// dimattn's kernels (cpu_flash, cuda_flash) on this backend compute blocks
// and gradients outside autograd: the caller owns their gradients.
KernelEntry outside_autograd(KernelEntry e) {
  e.block = [block = std::move(e.block)](Backend& be, const AttentionCall& c, const AttentionPlan& plan) {
    const at::NoGradGuard no_grad;
    return block(be, c, plan);
  };
  e.backward = [backward = std::move(e.backward)](Backend& be, const AttentionCall& c, const AttentionPlan& plan,
                                                  const Tensor& grad_output, const AttentionBlockResult* merged) {
    const at::NoGradGuard no_grad;
    return backward(be, c, plan, grad_output, merged);
  };
  if (e.paged)
    e.paged = [paged = std::move(e.paged)](Backend& be, const PagedAttentionCall& c) {
      const at::NoGradGuard no_grad;
      return paged(be, c);
    };
  return e;
}

// cpu_flash on ATen's threads, dot_attention's call through its autograd function.
KernelEntry cpu_flash_entry() {
  KernelEntry e = outside_autograd(detail::cpu_flash_entry(aten_parallel_for));
  e.run = [](Backend& be, const AttentionCall& c, const AttentionPlan& plan) {
    const detail::KernelForm& form = form_of(plan);
    return flash_function_output<CpuFlash>(static_cast<TorchBackend&>(be), c, form.layout,
                                           detail::flash_inputs(be, c, form));
  };
  return e;
}

KernelEntry aten_entry(const char* name, DeviceType device, GateResult (*gate)(const AttentionParams&),
                       AtenKernel kernel) {
  // Every ATen kernel here reads the feature dim with unit stride.
  KernelEntry e{name, device, gate, {.last_dim_unit_stride = true}, {}};
  e.run = [kernel](Backend& be, const AttentionCall& c, const AttentionPlan& plan) {
    return run_aten(static_cast<TorchBackend&>(be), c, form_of(plan), *plan.entry, kernel);
  };
  return e;
}

}  // namespace

const KernelTable& TorchBackend::attention_table() const {
  using enum DeviceType;
  static const KernelTable table = {
      cpu_flash_entry(),
      aten_entry("aten_flash_cpu", cpu, gate_flash_cpu, aten_flash_cpu),
      aten_entry("aten_math", cpu, gate_math, aten_math),
      reference_entry(cpu),
      aten_entry("aten_cudnn", cuda, gate_cudnn, aten_cudnn),
      aten_entry("aten_flash", cuda, gate_flash_cuda, aten_flash),
      aten_entry("aten_efficient", cuda, gate_efficient, aten_efficient),
      // After ATen's fused kernels until it is measured on a GPU
      // (docs/backends.md); first for dropout, causal GQA and offsets.
      outside_autograd(cuda_flash_entry()),
      aten_entry("aten_math", cuda, gate_math, aten_math),
      reference_entry(cuda),
  };
  return table;
}

// The plan of a call: the kernel form, with the layout class of the views
// every kernel here would read (q, k and v in the fused kernels' form,
// adapters/kernel_form.h, before the 4-d merge), from the ATen tensors'
// sizes, strides and storages; cached per structure (adapters/plan_cache.h).
AttentionPlanPtr TorchBackend::plan_attention(const AttentionCall& call, KernelUse use) {
  const at::Tensor* t[3] = {&as_aten(call.query.raw()), &as_aten(call.keys.raw()), &as_aten(call.values.raw())};
  detail::OperandMemory m[3];
  for (int i = 0; i < 3; ++i) {
    const at::IntArrayRef sizes = t[i]->sizes(), strides = t[i]->strides();
    m[i] = {{sizes.data(), sizes.size()}, {strides.data(), strides.size()}, t[i]->storage().unsafeGetStorageImpl(),
            t[i]->storage_offset(), static_cast<int64_t>(t[i]->element_size()), t[i]->requires_grad()};
  }
  return detail::plan_with_form(*this, call, m, use);
}

}  // namespace dimattn::torch_backend
