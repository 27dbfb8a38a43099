// cuda_flash in the torch backend. Everything that turns roles into kernel
// params is the one kernel form (backends/adapters/kernel_form.h); this file
// adds device memory: views of CUDA tensors, the per-entry arrays copied to
// the device, the current stream, and the autograd function.
//
// No CUDA headers here: the stream comes through c10's device-generic
// interface, and the kernels' host API is plain C++.
#include "cuda_flash_path.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_ops.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/Stream.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cstring>
#include <stdexcept>

#include "adapters/cuda_flash_gate.h"
#include "adapters/kernel_form.h"
#include "adapters/plan_cache.h"
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
  auto upload = [&]<class T>(const std::vector<T>& host, const T*& ptr, at::ScalarType type) {
    if (ptr == nullptr) return;
    at::Tensor h = empty_on({static_cast<int64_t>(host.size())}, type, c10::Device(c10::DeviceType::CPU));
    std::memcpy(h.mutable_data_ptr(), host.data(), host.size() * sizeof(T));
    keep.push_back(h.to(device));
    ptr = static_cast<const T*>(keep.back().const_data_ptr());
  };
  upload(pr.kv_len, pr.p.kv_lengths, at::kLong);
  upload(pr.offset, pr.p.causal_offset, at::kLong);
  kernels::ScoreParams& score = pr.p.score;
  upload(pr.slopes, score.alibi.data, at::kDouble);
  upload(pr.sinks, score.sinks.data, at::kDouble);
  upload(pr.bias_offsets, score.bias.offsets, at::kLong);
  upload(pr.mask_offsets, score.mask.offsets, at::kLong);
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
struct CudaGrads {
  detail::FlashInputs inputs;
  std::vector<double> dsinks;
  RawPtr dbias;
};
CudaGrads cuda_backward(TorchBackend& be, const AttentionCall& call, const detail::FlashLayout& l,
                        const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const CudaForward& fwd,
                        const at::Tensor& dout, bool want_dbias) {
  const c10::DeviceGuard guard(q.device());
  detail::FlashParams pr;
  detail::flash_params(pr, call, l, memory_of(q), memory_of(k), memory_of(v));
  const detail::ScoreOperands so = detail::score_operands(be, call, pr, memory_of_raw, want_dbias);
  CudaGrads g;
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
  if (call.sinks) {
    const at::Tensor d = arrays.back().cpu();
    const double* x = d.const_data_ptr<double>();
    g.dsinks.assign(x, x + d.numel());
  }
  g.inputs = {wrap(dq), wrap(dk), wrap(dv)};
  return g;
}

struct CudaFlashInfo : torch::CustomClassHolder {
  CudaFlashInfo(TorchBackend* b, AttentionCall c, detail::FlashLayout l) : be(b), call(std::move(c)), layout(l) {}
  TorchBackend* be;
  AttentionCall call;
  detail::FlashLayout layout;
};

class CudaFlashFunction : public torch::autograd::Function<CudaFlashFunction> {
 public:
  // sinks, bias: as CpuFlashFunction's (torch_attention.cpp).
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v, const at::Tensor& /*sinks*/, const at::Tensor& /*bias*/,
                            c10::intrusive_ptr<CudaFlashInfo> info) {
    const at::Tensor qr = kernel_readable(q), kr = kernel_readable(k), vr = kernel_readable(v);
    const CudaForward f = cuda_forward(*info->be, info->call, info->layout, qr, kr, vr);
    ctx->save_for_backward({qr, kr, vr, f.out, f.lse});
    ctx->saved_data["info"] = at::IValue::make_capsule(std::move(info));
    return f.out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto info = c10::static_intrusive_pointer_cast<CudaFlashInfo>(ctx->saved_data["info"].toCapsule());
    const AttentionCall& call = info->call;
    const CudaGrads g = cuda_backward(*info->be, call, info->layout, saved[0], saved[1], saved[2],
                                      {saved[3], saved[4]}, kernel_readable(grads[0]),
                                      call.bias && call.bias->requires_grad());
    at::Tensor dsinks, dbias;
    if (call.sinks) dsinks = as_aten(detail::sinks_gradient(*info->be, call, g.dsinks).raw());
    if (g.dbias) dbias = as_aten(detail::bias_gradient(*info->be, call, g.dbias).raw());
    return {as_aten(g.inputs.q), as_aten(g.inputs.k), as_aten(g.inputs.v), dsinks, dbias, at::Tensor()};
  }
};

// A call that cuda_flash computes outside autograd (blocks, their
// gradients): its kernel form, its inputs in that form, after its gate.
struct CudaCall {
  AttentionPlanPtr plan;  // holds the form
  const detail::KernelForm& form;
  at::Tensor q, k, v;
};
CudaCall cuda_call(TorchBackend& be, const AttentionCall& c, const char* op) {
  const GateResult gate = detail::cuda_flash_gate(be.attention_params_of(c));
  DIMATTN_CHECK(gate.ok, op, "blocks of a longer attention on CUDA run dimattn's cuda_flash, which cannot run this ",
                "call: ", gate.reason);
  AttentionPlanPtr plan = be.plan_attention(c);
  const detail::KernelForm* form = detail::form_in(*plan);
  DIMATTN_CHECK(form != nullptr, op, "internal error: the torch backend's plan has no kernel form");
  CudaCall cc{std::move(plan), *form, {}, {}, {}};
  const detail::FlashInputs in =
      detail::flash_inputs(be, cc.form, detail::aligned_inputs(be, c, cc.form), memory_of_raw);
  cc.q = kernel_readable(as_aten(in.q));
  cc.k = kernel_readable(as_aten(in.k));
  cc.v = kernel_readable(as_aten(in.v));
  return cc;
}

}  // namespace

Tensor cuda_flash_attention(TorchBackend& be, const AttentionCall& c, const detail::KernelForm& form) {
  const detail::FlashInputs in = detail::flash_inputs(be, form, detail::aligned_inputs(be, c, form), memory_of_raw);
  at::Tensor out = CudaFlashFunction::apply(as_aten(in.q), as_aten(in.k), as_aten(in.v),
                                            sinks_input(c), bias_input(c),
                                            c10::make_intrusive<CudaFlashInfo>(&be, c, form.layout));
  return detail::flash_output(be, c, wrap(out));
}

}  // namespace dimattn::torch_backend

namespace dimattn::torch_backend {

AttentionBlockResult cuda_flash_attention_block(TorchBackend& be, const AttentionCall& c) {
  const CudaCall cc = cuda_call(be, c, "dot_attention_block");
  const CudaForward f = cuda_forward(be, c, cc.form.layout, cc.q, cc.k, cc.v);
  return detail::block_result(be, c, wrap(f.out), wrap(f.lse));
}

AttentionCallGrads cuda_flash_attention_backward(TorchBackend& be, const AttentionCall& c, const Tensor& grad_output,
                                                 const AttentionBlockResult* merged) {
  const char* op = merged ? "dot_attention_block_backward" : "dot_attention_backward";
  const CudaCall cc = cuda_call(be, c, op);
  const detail::FlashLayout& l = cc.form.layout;
  const CudaForward fwd =
      merged ? CudaForward{as_aten(detail::in_kernel_form(be, c, l, merged->output, "the merged output", true,
                                                          c.query.dtype(), op)),
                           as_aten(detail::in_kernel_form(be, c, l, merged->lse, "the merged lse", false,
                                                          detail::lse_dtype_of(c), op))}
             : cuda_forward(be, c, l, cc.q, cc.k, cc.v);
  const at::Tensor dout =
      kernel_readable(as_aten(detail::in_kernel_form(be, c, l, grad_output, "grad_output", true, c.query.dtype(), op)));
  const CudaGrads g = cuda_backward(be, c, l, cc.q, cc.k, cc.v, fwd, dout, c.bias.has_value());
  return detail::call_grads(be, c, g.inputs, g.dsinks, g.dbias);
}

}  // namespace dimattn::torch_backend
