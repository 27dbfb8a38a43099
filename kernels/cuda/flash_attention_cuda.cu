// cuda_flash's launchers: AttentionKernelParams -> DeviceParams -> the
// kernels of flash_attention_cuda_impl.cuh, for {bfloat16, float16} x head
// dim {64, 128}; causal masks, lengths and dropout are run-time flags so that
// these four instantiations per pass are all there is to compile. CUDA is
// reached only through cuda/primitives.cuh, so a host emulation compiles this
// file too (tests/cuda_emu).
#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "cuda/flash_attention_cuda.h"
#include "cuda/flash_attention_cuda_impl.cuh"

namespace dimattn::kernels {
namespace {

using cuda_flash::DeviceParams;
using cuda_flash::kThreads;

using cuda_flash::bf16;
using cuda_flash::f16;
using Stream = CUstream_st*;

// err: "" or what the runtime reported.
void check_cuda(const std::string& err, const char* what) {
  if (!err.empty()) throw std::runtime_error(std::string("[cuda_flash] ") + what + ": " + err);
}

cuda_flash::Strides strides_of(const ElementStrides& s) { return {s.batch, s.head, s.row}; }

DeviceParams device_params(const AttentionKernelParams& p) {
  DeviceParams d{};
  d.q = p.q;
  d.k = p.k;
  d.v = p.v;
  d.out = p.out;
  d.lse = static_cast<float*>(p.lse);
  d.dout = p.dout;
  d.dq = p.dq;
  d.dk = p.dk;
  d.dv = p.dv;
  d.qs = strides_of(p.q_strides);
  d.ks = strides_of(p.k_strides);
  d.vs = strides_of(p.v_strides);
  d.os = strides_of(p.out_strides);
  d.dos = strides_of(p.dout_strides);
  d.dqs = strides_of(p.dq_strides);
  d.dks = strides_of(p.dk_strides);
  d.dvs = strides_of(p.dv_strides);
  d.lse_batch = p.lse_batch_stride;
  d.lse_head = p.lse_head_stride;
  d.batch = static_cast<int>(p.batch);
  d.heads = static_cast<int>(p.heads);
  d.group = static_cast<int>(p.group_size());
  d.seqlen_q = static_cast<int>(p.seqlen_q);
  d.seqlen_k = static_cast<int>(p.seqlen_k);
  d.q_lengths = p.q_lengths;
  d.kv_lengths = p.kv_lengths;
  d.causal_offset = p.causal_offset;
  d.kv_row_lengths = p.kv_row_lengths;
  d.causal = p.causal;
  d.scale = static_cast<float>(p.scale);
  d.scale_log2 = static_cast<float>(p.scale * 1.4426950408889634);
  d.dropout = p.has_dropout();
  d.dropout_broadcast = p.dropout_broadcast;
  d.seed = p.seed;
  d.rng_offset = p.rng_offset;
  d.q_position = static_cast<uint32_t>(p.dropout_q_position);
  d.kv_position = static_cast<uint32_t>(p.dropout_kv_position);
  d.rule = dropout_rule(p.dropout_p);  // the rule of every path
  d.keep_scale = static_cast<float>(d.rule.keep_scale);
  d.bounds = p.bounds;
  d.score = p.score;
  return d;
}

void check_gate(const AttentionKernelParams& p, bool backward) {
  if (std::string err = cuda_flash_gate(p, backward); !err.empty()) throw std::invalid_argument(err);
}

template <class T, int D>
void forward(const DeviceParams& d, Stream stream) {
  using cuda_flash::launch;
  constexpr int smem = cuda_flash::fwd_smem_bytes<D>();
  auto* kernel = cuda_flash::forward_kernel<T, D>;
  check_cuda(cuda_flash::allow_dynamic_smem(kernel, smem), "raising the forward kernel's shared memory limit");
  const dim3 grid((d.seqlen_q + cuda_flash::kFwdBlockM - 1) / cuda_flash::kFwdBlockM, d.heads, d.batch);
  check_cuda(launch(kernel, grid, dim3(kThreads), smem, stream, d), "launching the forward kernel");
}

template <class T, int D>
void backward(const DeviceParams& d, Stream stream) {
  using cuda_flash::launch;
  // pre: batch >= 1 (else nothing to do, checked by the caller).
  const int64_t rows = int64_t{d.batch} * d.heads * d.seqlen_q;
  if (rows > 0) {
    check_cuda(cuda_flash::zero_async(d.dq_accum, static_cast<size_t>(rows) * D * sizeof(float), stream),
               "zeroing the dq accumulator");
    if (d.score.sinks.on())
      check_cuda(cuda_flash::zero_async(d.score.dsinks, static_cast<size_t>(d.batch) * d.heads * sizeof(double), stream),
                 "zeroing dsinks");
    const dim3 grid(static_cast<unsigned>((rows + cuda_flash::kWarps - 1) / cuda_flash::kWarps));
    check_cuda(launch(cuda_flash::row_dot_kernel<T, D>, grid, dim3(kThreads), 0, stream, d),
               "launching the row-sum kernel");
  }
  if (d.seqlen_k > 0) {  // with no query rows it writes dk = dv = 0
    constexpr int smem = cuda_flash::bwd_smem_bytes<D>();
    auto* kernel = cuda_flash::backward_kernel<T, D>;
    check_cuda(cuda_flash::allow_dynamic_smem(kernel, smem), "raising the backward kernel's shared memory limit");
    const dim3 grid((d.seqlen_k + cuda_flash::kBwdBlockN - 1) / cuda_flash::kBwdBlockN, d.heads / d.group, d.batch);
    check_cuda(launch(kernel, grid, dim3(kThreads), smem, stream, d), "launching the backward kernel");
  }
  if (rows > 0) {
    const int64_t n = rows * D;
    const dim3 grid(static_cast<unsigned>(std::min<int64_t>((n + 255) / 256, 65536)));
    check_cuda(launch(cuda_flash::convert_dq_kernel<T, D>, grid, dim3(256), 0, stream, d),
               "launching the dq conversion kernel");
  }
}

// The pass's instantiation for the params' element type and head dim.
using Pass = void (*)(const DeviceParams&, Stream);
Pass pick(const AttentionKernelParams& p, Pass bf16_64, Pass f16_64, Pass bf16_128, Pass f16_128) {
  const bool bf16 = p.dtype == ElementType::bfloat16;
  if (p.head_dim == 64) return bf16 ? bf16_64 : f16_64;
  return bf16 ? bf16_128 : f16_128;
}

}  // namespace

void cuda_flash_forward(const AttentionKernelParams& p, CUstream_st* stream) {
  check_gate(p, false);
  if (p.batch * p.heads * p.seqlen_q == 0) return;
  const DeviceParams d = device_params(p);
  pick(p, forward<bf16, 64>, forward<f16, 64>, forward<bf16, 128>, forward<f16, 128>)(d, stream);
}

void cuda_flash_backward(const AttentionKernelParams& p, void* workspace, CUstream_st* stream) {
  check_gate(p, true);
  const int64_t rows = p.batch * p.heads * p.seqlen_q;
  const int64_t kv_rows = p.batch * p.kv_heads * p.seqlen_k;
  if (p.batch == 0 || (rows == 0 && kv_rows == 0)) return;
  // A workspace of 0 bytes (no query rows) may be null.
  const size_t ws_bytes = cuda_flash_backward_workspace_bytes(p);
  if ((ws_bytes > 0 && workspace == nullptr) || reinterpret_cast<uintptr_t>(workspace) % 16 != 0)
    throw std::invalid_argument("[cuda_flash backward] needs a 16-byte aligned workspace of " +
                                std::to_string(ws_bytes) + " bytes");
  DeviceParams d = device_params(p);
  d.dq_accum = static_cast<float*>(workspace);
  const size_t dq_bytes = (static_cast<size_t>(rows) * p.head_dim * 4 + 15) / 16 * 16;
  d.dsum = reinterpret_cast<float*>(static_cast<char*>(workspace) + dq_bytes);
  pick(p, backward<bf16, 64>, backward<f16, 64>, backward<bf16, 128>, backward<f16, 128>)(d, stream);
}

}  // namespace dimattn::kernels
