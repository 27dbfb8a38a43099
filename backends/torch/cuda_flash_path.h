#pragma once
// The torch backend's path to dimattn's own CUDA kernel ("cuda_flash",
// kernels/cuda): roles -> the shared kernel form (adapters/kernel_form.h)
// on device memory -> the forward and backward kernels, on the current CUDA
// stream.
#include "dimattn/ext/kernel_table.h"

namespace dimattn::torch_backend {

// cuda_flash's kernel-table entry (its gate: adapters/cuda_flash_gate.h): the
// call through its autograd function (flash_function.h), and a block of a
// longer attention and the gradients of a call outside autograd, on the
// call's kernel form (from its plan).
KernelEntry cuda_flash_entry();

}  // namespace dimattn::torch_backend
