#pragma once
// Selection's gate of dimattn's own CUDA kernel ("cuda_flash",
// kernels/cuda), on the fields that choose a kernel (AttentionParams). Plain
// code in every build, so that the CPU tests check its reasons; the torch
// backend lists the candidate (backends/torch/cuda_flash_path.cpp runs it).
#include "dimattn/selection.h"

namespace dimattn::detail {

// pre: none. `compiled`: whether this build holds the CUDA kernels
// (kernels::cuda_flash_compiled(); a parameter so that tests cover both).
GateResult cuda_flash_gate(const AttentionParams& p, bool compiled);
GateResult cuda_flash_gate(const AttentionParams& p);  // with this build's kernels

}  // namespace dimattn::detail
