// cuda_flash in the torch backend. Everything that turns roles into kernel
// params is the one kernel form (backends/adapters/kernel_form.h); this file
// adds device memory: views of CUDA tensors, the per-entry arrays copied to
// the device, the current stream, and its kernel-table entry (the autograd
// function is flash_function.h's, shared with cpu_flash).
//
// No CUDA headers here: the stream comes through c10's device-generic
// interface, and the kernels' host API is plain C++.
#include "cuda_flash_path.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_ops.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/Stream.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <cstring>
#include <stdexcept>

#include "adapters/cuda_flash_gate.h"
#include "adapters/kernel_form.h"
#include "adapters/plan_cache.h"
#include "flash_function.h"
#include "torch_raw.h"
#include "dimattn/error.h"
#include "dimattn/internal/check.h"
#include "dimattn/internal/counters.h"
#include "cuda/flash_attention_cuda.h"

namespace dimattn::torch_backend {
namespace {

constexpr const char* kOp = "dot_attention";


at::Tensor empty_on(at::IntArrayRef shape, at::ScalarType dtype, c10::Device device) {
  return at::_ops::empty_memory_format::call(c10::fromIntArrayRefSlow(shape), dtype, at::kStrided, device,
                                             std::nullopt, std::nullopt);
}

// t itself when the kernel can read it in place (16-byte aligned rows, unit
// last stride), else a contiguous copy, counted.
at::Tensor kernel_readable(const at::Tensor& t) {
  bool ok = reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 16 == 0 && (t.size(3) <= 1 || t.stride(3) == 1);
  for (int a = 0; a < 3 && ok; ++a) ok = t.size(a) <= 1 || t.stride(a) % 8 == 0;
  if (ok || t.numel() == 0) return t;
  count_layout_copy();
  at::Tensor c = t.contiguous();
  if (reinterpret_cast<uintptr_t>(c.const_data_ptr()) % 16 == 0) return c;
  // A contiguous view at an odd offset: a fresh buffer.
  at::Tensor fresh = empty_on(t.sizes(), t.scalar_type(), t.device());
  fresh.copy_(t);
  return fresh;
}

CUstream_st* current_stream(c10::Device device) {
  const c10::Stream s = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(device);
  return static_cast<CUstream_st*>(s.native_handle());
}

// The per-entry and per-head arrays (host vectors in FlashParams) on the
// device; p points at them while the returned tensors live. With sinks, the
// last one is d(sinks) (float64 [B * H]), written by the backward pass.
std::vector<at::Tensor> to_device_arrays(detail::FlashParams& pr, c10::Device device) {
  std::vector<at::Tensor> keep;
  // ptr: a const T* or a plane table's const void* data.
  auto upload = [&]<class T, class P>(const std::vector<T>& host, const P*& ptr, at::ScalarType type) {
    if (ptr == nullptr) return;
    at::Tensor h = empty_on({static_cast<int64_t>(host.size())}, type, c10::Device(c10::DeviceType::CPU));
    std::memcpy(h.mutable_data_ptr(), host.data(), host.size() * sizeof(T));
    keep.push_back(h.to(device));
    ptr = static_cast<const P*>(keep.back().const_data_ptr());
  };
  upload(pr.kv_len, pr.p.kv_lengths, at::kLong);
  upload(pr.offset, pr.p.causal_offset, at::kLong);
  upload(pr.kv_rows, pr.p.kv_row_lengths.data, at::kLong);
  upload(pr.kv_row_offsets, pr.p.kv_row_lengths.offsets, at::kLong);
  kernels::ScoreParams& score = pr.p.score;
  upload(pr.slopes, score.alibi.data, at::kDouble);
  upload(pr.sinks, score.sinks.data, at::kDouble);
  upload(pr.bias_offsets, score.bias.offsets, at::kLong);
  upload(pr.mask_offsets, score.mask.offsets, at::kLong);
  upload(pr.qseg_offsets, score.query_segments.offsets, at::kLong);
  upload(pr.kvseg_offsets, score.kv_segments.offsets, at::kLong);
  if (score.dsinks) {
    keep.push_back(empty_on({static_cast<int64_t>(pr.dsinks.size())}, at::kDouble, device));
    score.dsinks = keep.back().mutable_data_ptr<double>();
  }
  return keep;
}

// pre: the kernel gate passed at selection; what remains is caught here.
template <class F>
void run_kernel(const kernels::AttentionKernelParams& p, bool backward, F&& f) {
  if (std::string err = kernels::cuda_flash_gate(p, backward); !err.empty())
    detail::fail(kOp, "cuda_flash: internal error, the adapter built params the kernel rejects: ", err,
                 "; force another kernel with DIMATTN_SDPA and report this");
  try {
    f();
  } catch (const std::exception& e) {
    detail::fail(kOp, "cuda_flash: ", e.what());
  }
}

// The forward kernel on q, k, v in the kernel's 4-d form: out and lse.
struct CudaForward {
  at::Tensor out, lse;
};
CudaForward cuda_forward(TorchBackend& be, const AttentionCall& call, const detail::FlashLayout& l,
                         const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  const c10::DeviceGuard guard(q.device());
  detail::FlashParams pr;
  detail::flash_params(pr, call, l, memory_of(q), memory_of(k), memory_of(v));
  const detail::ScoreOperands so = detail::score_operands(be, call, pr, memory_of_raw);
  CudaForward f{empty_on({l.B, l.Hkv * l.G, l.Tq, l.Dv}, q.scalar_type(), q.device()),
                empty_on({l.B, l.Hkv * l.G, l.Tq}, at::kFloat, q.device())};
  detail::set_forward_outputs(pr.p, memory_of(f.out), memory_of(f.lse));
  const std::vector<at::Tensor> arrays = to_device_arrays(pr, q.device());
  run_kernel(pr.p, false, [&] { kernels::cuda_flash_forward(pr.p, current_stream(q.device())); });
  return f;
}

// The backward kernel from out and lse (the call's own, or a longer
// attention's merged ones for a block): dq, dk, dv, d(sinks) per (b, h) and
// d(bias) when `want_dbias`.
detail::FlashGrads cuda_backward(TorchBackend& be, const AttentionCall& call, const detail::FlashLayout& l,
                        const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const CudaForward& fwd,
                        const at::Tensor& dout, bool want_dbias) {
  const c10::DeviceGuard guard(q.device());
  detail::FlashParams pr;
  detail::flash_params(pr, call, l, memory_of(q), memory_of(k), memory_of(v));
  const detail::ScoreOperands so = detail::score_operands(be, call, pr, memory_of_raw, want_dbias);
  detail::FlashGrads g;
  if (want_dbias) g.dbias = detail::bias_gradient_buffer(be, pr, call, memory_of_raw, call.query.device());
  detail::set_forward_outputs(pr.p, memory_of(fwd.out), memory_of(fwd.lse));
  const at::Tensor dq = empty_on(q.sizes(), q.scalar_type(), q.device());
  const at::Tensor dk = empty_on(k.sizes(), k.scalar_type(), k.device());
  const at::Tensor dv = empty_on(v.sizes(), v.scalar_type(), v.device());
  detail::set_backward_tensors(pr.p, memory_of(dout), memory_of(dq), memory_of(dk), memory_of(dv));
  const std::vector<at::Tensor> arrays = to_device_arrays(pr, q.device());
  const int64_t ws_bytes = static_cast<int64_t>(kernels::cuda_flash_backward_workspace_bytes(pr.p));
  const at::Tensor workspace = empty_on({(ws_bytes + 3) / 4}, at::kFloat, q.device());
  run_kernel(pr.p, true, [&] {
    kernels::cuda_flash_backward(pr.p, workspace.data_ptr(), current_stream(q.device()));
  });
  if (call.variants.sinks) {
    const at::Tensor d = arrays.back().cpu();
    const double* x = d.const_data_ptr<double>();
    g.dsinks.assign(x, x + d.numel());
  }
  g.inputs = {wrap(dq), wrap(dk), wrap(dv)};
  return g;
}

// q, k, v as the kernel reads them, and the forward kernel's out and lse.
FlashSaved forward_pass(TorchBackend& be, const AttentionCall& call, const detail::FlashLayout& l,
                        const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  const at::Tensor qr = kernel_readable(q), kr = kernel_readable(k), vr = kernel_readable(v);
  const CudaForward f = cuda_forward(be, call, l, qr, kr, vr);
  return {qr, kr, vr, f.out, f.lse};
}

// cuda_flash's two passes for FlashFunction (flash_function.h).
struct CudaFlash {
  static FlashSaved forward(const FlashCall& fc, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
    return forward_pass(*fc.be, fc.call, fc.layout, q, k, v);
  }
  static detail::FlashGrads backward(const FlashCall& fc, const FlashSaved& s, const at::Tensor& dout) {
    const AttentionCall& call = fc.call;
    return cuda_backward(*fc.be, call, fc.layout, s.q, s.k, s.v, {s.out, s.lse}, kernel_readable(dout),
                         call.variants.bias && call.variants.bias->requires_grad());
  }
};

// The call's q, k, v in the kernel's 4-d form, by its plan's kernel form.
struct CudaCall {
  const detail::KernelForm& form;
  detail::FlashInputs in;
};
CudaCall cuda_call(TorchBackend& be, const AttentionCall& c, const AttentionPlan& plan) {
  const detail::KernelForm* form = detail::form_in(plan);
  DIMATTN_CHECK(form != nullptr, kOp, "internal error: the torch backend's plan has no kernel form");
  return {*form, detail::flash_inputs(be, *form, detail::aligned_inputs(be, c, *form), memory_of_raw)};
}

Tensor run(Backend& backend, const AttentionCall& c, const AttentionPlan& plan) {
  auto& be = static_cast<TorchBackend&>(backend);
  const CudaCall cc = cuda_call(be, c, plan);
  return flash_function_output<CudaFlash>(be, c, cc.form.layout, cc.in);
}

AttentionBlockResult block(Backend& backend, const AttentionCall& c, const AttentionPlan& plan) {
  auto& be = static_cast<TorchBackend&>(backend);
  const CudaCall cc = cuda_call(be, c, plan);
  const FlashSaved f = forward_pass(be, c, cc.form.layout, as_aten(cc.in.q), as_aten(cc.in.k), as_aten(cc.in.v));
  return detail::block_result(be, c, wrap(f.out), wrap(f.lse));
}

AttentionCallGrads backward(Backend& backend, const AttentionCall& c, const AttentionPlan& plan,
                            const Tensor& grad_output, const AttentionBlockResult* merged) {
  auto& be = static_cast<TorchBackend&>(backend);
  const char* op = kernel_use_op(merged ? KernelUse::block_backward : KernelUse::backward);
  const CudaCall cc = cuda_call(be, c, plan);
  const detail::FlashLayout& l = cc.form.layout;
  const at::Tensor q = as_aten(cc.in.q), k = as_aten(cc.in.k), v = as_aten(cc.in.v);
  const FlashSaved f =
      merged ? FlashSaved{kernel_readable(q), kernel_readable(k), kernel_readable(v),
                          as_aten(detail::in_kernel_form(be, c, l, merged->output, "the merged output", true,
                                                         c.query.dtype(), op)),
                          as_aten(detail::in_kernel_form(be, c, l, merged->lse, "the merged lse", false,
                                                         detail::lse_dtype_of(c), op))}
             : forward_pass(be, c, l, q, k, v);
  const at::Tensor dout =
      kernel_readable(as_aten(detail::in_kernel_form(be, c, l, grad_output, "grad_output", true, c.query.dtype(), op)));
  return detail::call_grads(be, c,
                            cuda_backward(be, c, l, f.q, f.k, f.v, {f.out, f.lse}, dout, c.variants.bias.has_value()));
}

}  // namespace

KernelEntry cuda_flash_entry() {
  return {"cuda_flash", DeviceType::cuda, [](const AttentionParams& p) { return detail::cuda_flash_gate(p); },
          {.last_dim_unit_stride = true}, run, block, backward};
}

}  // namespace dimattn::torch_backend
