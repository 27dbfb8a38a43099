#pragma once
// The torch backend's path to dimattn's own CUDA kernel ("cuda_flash",
// kernels/cuda): roles -> the shared kernel form (adapters/kernel_form.h)
// on device memory -> an autograd function over the forward and backward
// kernels, on the current CUDA stream.
#include <ATen/core/Tensor.h>

#include "adapters/kernel_form.h"
#include "torch_backend.h"

namespace dimattn::torch_backend {

// pre: detail::cuda_flash_gate passed for the call's AttentionParams; form
// is the call's kernel form (from its plan).
Tensor cuda_flash_attention(TorchBackend& be, const AttentionCall& call, const detail::KernelForm& form);
// The call as a block of a longer attention, and the gradients of a call
// (`merged`: a block's, from the merged output and lse), on cuda_flash
// outside autograd (Backend::attention_block, attention_backward).
AttentionBlockResult cuda_flash_attention_block(TorchBackend& be, const AttentionCall& call);
AttentionCallGrads cuda_flash_attention_backward(TorchBackend& be, const AttentionCall& call, const Tensor& grad_output,
                                                 const AttentionBlockResult* merged);

// The call's sinks and bias as autograd inputs of the fused functions
// (cpu_flash's and cuda_flash's), so that their gradients reach them; an
// empty tensor without, since autograd functions take no undefined inputs.
// The kernels read their values through the call.
at::Tensor sinks_input(const AttentionCall& call);
at::Tensor bias_input(const AttentionCall& call);

}  // namespace dimattn::torch_backend
