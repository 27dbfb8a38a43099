#pragma once
// dimattn's fused CUDA attention ("cuda_flash"): FlashAttention-2-style
// forward and backward on the tensor cores (mma.sync m16n8k16, sm_80 and
// newer), over the same AttentionKernelParams as the CPU kernel.
//
// What it computes is AttentionKernelParams' contract (attention_params.h):
// causal masks with a per-batch offset, per-batch kv lengths (padding is
// skipped, as are causal blocks above the diagonal), GQA/MQA, dropout drawn
// from philox.h (the mask of the reference path and of the CPU kernel, bit for
// bit), arbitrary batch/head/row strides. Element types bfloat16 and float16,
// float32 accumulation and float32 lse; head dims 64 and 128 with
// head_dim == head_dim_v.
//
// Determinism: the forward pass and dk, dv are deterministic; dq is summed
// over kv blocks with float32 atomics, so its last bits can vary between runs.
//
// This header is plain C++ (no CUDA headers): the gate is host code that
// every build compiles and tests; the launchers exist only in builds with
// CUDA (cuda_flash_compiled()).
#include <cstddef>
#include <string>

#include "common/attention_params.h"

struct CUstream_st;  // cudaStream_t is CUstream_st*

namespace dimattn::kernels {

// Whether this build holds the CUDA kernels (DIMATTN_WITH_CUDA).
bool cuda_flash_compiled();

// Why cuda_flash cannot run `p`, or "" when it can. Host-only: reads no
// device memory, so the per-batch arrays are not checked (pre: their values
// satisfy validate_host_arrays()). Requirements beyond p.validate():
// bfloat16 or float16; head_dim == head_dim_v, 64 or 128; every tensor's base
// address 16-byte aligned and its batch/head/row strides multiples of 8
// elements (rows are copied as 16-byte vectors); batch, heads <= 65535 (grid
// dims) and seqlen_q, seqlen_k < 2^31.
std::string cuda_flash_gate(const AttentionKernelParams& p, bool backward);

// Bytes of device scratch memory the backward pass needs (dq in float32 and
// the row sums D_i = rowsum(dO * O)); the forward pass needs none.
size_t cuda_flash_backward_workspace_bytes(const AttentionKernelParams& p);

// Writes out (and lse when non-null) on `stream`. Every pointer in p, the
// per-batch arrays included, is device memory of the current device.
// pre: cuda_flash_gate(p, false) is empty, else std::invalid_argument with
//      that reason is thrown. Launch errors throw std::runtime_error.
void cuda_flash_forward(const AttentionKernelParams& p, CUstream_st* stream);

// Writes dq, dk, dv from q, k, v, out, lse and dout, recomputing the weights
// and the same dropout mask. `workspace` holds at least
// cuda_flash_backward_workspace_bytes(p) bytes of device memory, 16-byte
// aligned. Gradients of GQA query heads are summed into their kv head's
// dk, dv; padding rows and positions get 0.
// pre: cuda_flash_gate(p, true) is empty (else std::invalid_argument).
void cuda_flash_backward(const AttentionKernelParams& p, void* workspace, CUstream_st* stream);

}  // namespace dimattn::kernels
