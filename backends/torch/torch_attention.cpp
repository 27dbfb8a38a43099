// The torch backend's attention fast path: roles -> ATen's [B, H, T, D]
// views -> the ATen SDPA kernel that selection chose; the reference path
// otherwise.
//
// Kernel form. B is the product of the batch dims that masks depend on (kv
// lengths, causal offset), H the product of the other batch and keys-only
// dims. Query groups (beam, GQA heads per kv head) become more query rows,
// [B, H, G*Tq, D], so that one kv head serves them without a copy; for causal
// attention with groups the rows would lose their position, and the groups
// become GQA heads instead, [B, H*G, Tq, D], which only ATen's math kernel
// takes. Views are used wherever strides allow; each copy is counted.
#include <ATen/core/Tensor.h>
#include <ATen/ops/_scaled_dot_product_attention_math_ops.h>
#include <ATen/ops/_scaled_dot_product_cudnn_attention_ops.h>
#include <ATen/ops/_scaled_dot_product_efficient_attention_ops.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu_ops.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_ops.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/custom_function.h>

#include <limits>

#include "backends/src/cpu_flash_path.h"
#include "backends/src/cuda_flash_gate.h"
#include "backends/torch/cuda_flash_path.h"
#include "backends/torch/torch_backend.h"
#include "backends/torch/torch_raw.h"
#include "dimattn/layout.h"
#include "dimattn/ops.h"
#include "dimattn/selection.h"

namespace dimattn::torch_backend {
namespace {

constexpr const char* kOp = "dot_attention";

bool is_16bit(DType d) { return d == DType::bfloat16 || d == DType::float16; }

// --- gates: what each ATen kernel can run, as values with reasons ---

GateResult common_fused_gate(const AttentionParams& p) {
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
  if (p.padding || p.offset != OffsetKind::none)
    return GateResult::fail("takes no mask: kv padding and causal offsets need one");
  return cuda_gate(p, false, 256);
}

GateResult gate_efficient(const AttentionParams& p) {
  if (p.requires_grad && p.deterministic) return GateResult::fail("backward is not deterministic");
  return cuda_gate(p, true, 256);
}

GateResult gate_reference(const AttentionParams&) { return GateResult::pass(); }

const std::vector<KernelCandidate>& candidates(DeviceType device) {
  static const std::vector<KernelCandidate> cpu = {{"cpu_flash", detail::cpu_flash_gate},
                                                   {"aten_flash_cpu", gate_flash_cpu},
                                                   {"aten_math", gate_math},
                                                   {"reference", gate_reference}};
  static const std::vector<KernelCandidate> cuda = {{"aten_cudnn", gate_cudnn},
                                                    {"aten_flash", gate_flash_cuda},
                                                    {"aten_efficient", gate_efficient},
                                                    // After ATen's fused kernels until it is measured on a GPU
                                                    // (docs/backends.md); first for dropout, causal GQA and offsets.
                                                    {"cuda_flash", [](const AttentionParams& p) {
                                                       return detail::cuda_flash_gate(p);
                                                     }},
                                                    {"aten_math", gate_math},
                                                    {"reference", gate_reference}};
  return device == DeviceType::cpu ? cpu : cuda;
}

// --- roles -> kernel form ---

int64_t product(const Dims& dims) {
  int64_t n = 1;
  for (const Dim& d : dims) n *= d.extent();
  return n;
}

Dims join(std::initializer_list<Dims> parts) {
  Dims out;
  for (const Dims& p : parts) out.insert(out.end(), p.begin(), p.end());
  return out;
}

// The raw ATen tensor of x with dims in `order`; dims x lacks are broadcast.
at::Tensor aten_in(const Tensor& x, const Dims& order) { return as_aten(align(x, order).raw()); }

// t.reshape(shape), counting a copy when no view exists.
at::Tensor reshaped(const at::Tensor& t, at::IntArrayRef shape) {
  at::Tensor r = t.reshape(shape);
  if (r.numel() > 0 && !r.is_alias_of(t)) count_layout_copy();
  return r;
}

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

// Every ATen kernel here reads the feature dim with unit stride.
at::Tensor unit_last_stride(const at::Tensor& t, const char* which) {
  static const LayoutRequirements req{.last_dim_unit_stride = true};
  if (check_layout(view_of(t), req, which).ok) return t;
  count_layout_copy();
  return t.contiguous();
}

struct KernelForm {
  Dims mask_b, other_b;  // dims of B and of H
  int64_t B, H, G, Tq, Tk, D, Dv;
  at::Tensor q, k, v;  // [B, H, rows, D] aligned per role (before the rows/heads merge for q)
  LayoutClass layout;
  bool requires_grad;
};

KernelForm form_of(const AttentionCall& c) {
  KernelForm f;
  Dims mask_dims;
  if (c.kv_spatial.is_dynamic()) mask_dims = c.kv_spatial.lengths().dims();
  if (c.causal_offset) mask_dims = join({mask_dims, c.causal_offset->dims()});
  for (const Dim& d : join({c.batch, c.keys_only})) (contains(mask_dims, d) ? f.mask_b : f.other_b).push_back(d);
  f.B = product(f.mask_b);
  f.H = product(f.other_b);
  f.G = product(c.query_groups);
  f.Tq = c.query_spatial.extent();
  f.Tk = c.kv_spatial.extent();
  f.D = c.key_dim.extent();
  f.Dv = product(c.value_feature);
  const Dims bh = join({f.mask_b, f.other_b});
  f.q = aten_in(c.query, join({bh, c.query_groups, {c.query_spatial, c.key_dim}}));
  f.k = aten_in(c.keys, join({bh, {c.kv_spatial, c.key_dim}}));
  f.v = aten_in(c.values, join({bh, {c.kv_spatial}, c.value_feature}));
  f.layout = classify_layout(view_of(f.q), view_of(f.k), view_of(f.v));
  f.requires_grad = f.q.requires_grad() || f.k.requires_grad() || f.v.requires_grad();
  return f;
}

// The named bool mask of allowed (query, kv) pairs, when one is needed, and
// the rows that have at least one allowed pair when some may have none.
struct Masks {
  std::optional<Tensor> allowed;  // dims ⊆ mask_b ∪ {query_spatial, kv_spatial}
  std::optional<Tensor> row_ok;   // dims ⊆ mask_b ∪ {query_spatial}
};

Masks masks_of(const AttentionCall& c) {
  Masks m;
  const bool padding = c.kv_spatial.is_dynamic();
  if (!padding && !c.causal_offset) return m;  // none, or plain causal via is_causal
  const TensorOptions bool_opts{DType::boolean, c.query.device(), "torch"};
  const TensorOptions int_opts{DType::int64, c.query.device(), "torch"};
  const Tensor kpos = range_over_dim(c.kv_spatial, int_opts);
  Tensor ok_rows = full({}, 1.0, bool_opts);
  if (padding) {
    m.allowed = sequence_mask(c.kv_spatial, bool_opts);
    ok_rows = compare(to_backend(cast(c.kv_spatial.lengths(), DType::int64), "torch"), Compare::gt, 0.0);
  }
  if (c.causal) {
    Tensor limit = range_over_dim(c.query_spatial, int_opts);
    if (c.causal_offset) limit = add(limit, cast(*c.causal_offset, DType::int64));
    Tensor causal = compare(kpos, Compare::le, limit);
    m.allowed = m.allowed ? logical_and(*m.allowed, causal) : causal;
    ok_rows = logical_and(ok_rows, compare(limit, Compare::ge, 0.0));
  }
  bool all_rows_ok = true;
  for (double x : to_host(ok_rows)) all_rows_ok = all_rows_ok && x != 0;
  if (!all_rows_ok) {
    // Kernels give NaN for a row without any allowed pair; let such rows see
    // kv position 0, then zero them (their gradients too) after the kernel.
    m.allowed = logical_or(*m.allowed, logical_and(logical_not(ok_rows), compare(kpos, Compare::eq, 0.0)));
    m.row_ok = ok_rows;
  }
  return m;
}

// The mask as the ATen kernels take it when called directly: an additive
// bias in the query's dtype (0 or -inf), [B, 1, Tq or 1, Tk]. (Only the
// public SDPA entry converts bool masks; the kernels read any mask as a bias.)
at::Tensor aten_mask(const Tensor& allowed, const AttentionCall& c, const KernelForm& f) {
  const bool per_row = allowed.has(c.query_spatial);
  Dims order = f.mask_b;
  if (per_row) order.push_back(c.query_spatial);
  order.push_back(c.kv_spatial);
  at::Tensor m = reshaped(aten_in(allowed, order), {f.B, 1, per_row ? f.Tq : 1, f.Tk});
  return f.q.new_zeros(m.sizes()).masked_fill(m.logical_not(), -std::numeric_limits<double>::infinity());
}

at::Tensor run_kernel(const std::string& kernel, const AttentionCall& c, const KernelForm& f, const Masks& m) {
  const bool heads_form = c.causal && f.G > 1;  // gates allow it only for aten_math
  at::Tensor q = heads_form ? reshaped(f.q, {f.B, f.H * f.G, f.Tq, f.D}) : reshaped(f.q, {f.B, f.H, f.G * f.Tq, f.D});
  at::Tensor k = reshaped(f.k, {f.B, f.H, f.Tk, f.D});
  at::Tensor v = reshaped(f.v, {f.B, f.H, f.Tk, f.Dv});
  q = unit_last_stride(q, "query");
  k = unit_last_stride(k, "keys");
  v = unit_last_stride(v, "values");
  const bool is_causal = c.causal && !m.allowed;  // top-left, offset 0, no padding
  const std::optional<double> scale = c.scale;
  std::optional<at::Tensor> bias;
  if (m.allowed) bias = aten_mask(*m.allowed, c, f);
  if (kernel == "aten_flash_cpu")
    return std::get<0>(at::_ops::_scaled_dot_product_flash_attention_for_cpu::call(q, k, v, 0.0, is_causal, bias, scale));
  if (kernel == "aten_math")
    return std::get<0>(at::_ops::_scaled_dot_product_attention_math::call(q, k, v, bias, 0.0, is_causal,
                                                                          std::nullopt, scale, heads_form));
  if (kernel == "aten_flash")
    return std::get<0>(at::_ops::_scaled_dot_product_flash_attention::call(q, k, v, 0.0, is_causal, false, scale));
  if (kernel == "aten_efficient")
    return std::get<0>(at::_ops::_scaled_dot_product_efficient_attention::call(q, k, v, bias, f.requires_grad, 0.0,
                                                                               is_causal, scale));
  if (kernel == "aten_cudnn")
    return std::get<0>(at::_ops::_scaled_dot_product_cudnn_attention::call(q, k, v, bias, f.requires_grad, 0.0,
                                                                           is_causal, false, scale));
  detail::fail(kOp, "internal error: no adapter for kernel ", kernel);
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

// What backward needs besides tensors, kept in the autograd context.
struct CpuFlashInfo : torch::CustomClassHolder {
  CpuFlashInfo(TorchBackend* b, AttentionCall c, detail::FlashLayout l) : be(b), call(std::move(c)), layout(l) {}
  TorchBackend* be;
  AttentionCall call;
  detail::FlashLayout layout;
};

class CpuFlashFunction : public torch::autograd::Function<CpuFlashFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v, c10::intrusive_ptr<CpuFlashInfo> info) {
    const detail::FlashForward f =
        detail::flash_forward(*info->be, info->call, info->layout, {wrap(q), wrap(k), wrap(v)}, aten_parallel_for());
    const at::Tensor out = as_aten(f.out);
    ctx->save_for_backward({q, k, v, out, as_aten(f.lse)});
    ctx->saved_data["info"] = at::IValue::make_capsule(std::move(info));
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto info = c10::static_intrusive_pointer_cast<CpuFlashInfo>(ctx->saved_data["info"].toCapsule());
    const detail::FlashInputs g = detail::flash_backward(
        *info->be, info->call, info->layout, {wrap(saved[0]), wrap(saved[1]), wrap(saved[2])},
        {wrap(saved[3]), wrap(saved[4])}, wrap(grads[0]), aten_parallel_for());
    return {as_aten(g.q), as_aten(g.k), as_aten(g.v), at::Tensor()};
  }
};

Decision decide(const AttentionCall& c, const KernelForm& f) {
  return select_kernel("torch", attention_params(c, f.layout, f.requires_grad), candidates(c.query.device().type));
}

}  // namespace

std::vector<std::string> TorchBackend::attention_kernels(Device device) const {
  std::vector<std::string> names;
  for (const auto& k : candidates(device.type)) names.push_back(k.name);
  return names;
}

Decision TorchBackend::explain_attention(const AttentionCall& call) { return decide(call, form_of(call)); }

AttentionResult TorchBackend::scaled_dot_product_attention(const AttentionCall& c) {
  const KernelForm f = form_of(c);
  const Decision d = decide(c, f);
  if (d.kernel == "reference") return reference_path(c);
  if (d.kernel == "cpu_flash") {
    const detail::FlashLayout layout = detail::flash_layout(c);
    const detail::FlashInputs in = detail::flash_inputs(*this, c, layout);
    at::Tensor out = CpuFlashFunction::apply(as_aten(in.q), as_aten(in.k), as_aten(in.v),
                                             c10::make_intrusive<CpuFlashInfo>(this, c, layout));
    return {detail::flash_output(*this, c, layout, wrap(out)), "cpu_flash"};
  }
  if (d.kernel == "cuda_flash") return cuda_flash_attention(*this, c);
  const Masks m = masks_of(c);
  at::Tensor out4;
  try {
    out4 = run_kernel(d.kernel, c, f, m);
  } catch (const c10::Error& e) {
    // A gate let through a call the kernel refuses: a bug in our gates, reported as such.
    detail::fail(kOp, "kernel ", d.kernel, " failed on a call its gate accepted (", e.what_without_backtrace(),
                 "); force another kernel with DIMATTN_SDPA and report this");
  }
  const Dims out_dims = join({f.mask_b, f.other_b, c.query_groups, {c.query_spatial}, c.value_feature});
  std::vector<int64_t> shape;
  for (const Dim& d : out_dims) shape.push_back(d.extent());
  Tensor out(out_dims, c.query.dtype(), c.query.device(), wrap(out4.reshape(shape)), this);
  if (m.row_ok) out = dimattn::where(*m.row_ok, out, 0.0);
  return {out, d.kernel};
}

}  // namespace dimattn::torch_backend
