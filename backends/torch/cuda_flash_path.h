#pragma once
// The torch backend's path to dimattn's own CUDA kernel ("cuda_flash",
// kernels/cuda): roles -> the shared kernel form (adapters/kernel_form.h)
// on device memory -> an autograd function over the forward and backward
// kernels, on the current CUDA stream.
#include "adapters/kernel_form.h"
#include "torch_backend.h"

namespace dimattn::torch_backend {

// pre: detail::cuda_flash_gate passed for the call's AttentionParams; form
// is the call's kernel form (from its plan).
Tensor cuda_flash_attention(TorchBackend& be, const AttentionCall& call, const detail::KernelForm& form);

}  // namespace dimattn::torch_backend
