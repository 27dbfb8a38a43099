// cuda_flash's gate and workspace size: host code, compiled into every build
// (with or without CUDA) so that the CPU tests check what it accepts.
#include <cstdint>
#include <limits>

#include "cuda/flash_attention_cuda.h"

namespace dimattn::kernels {

bool cuda_flash_compiled() {
#if defined(DIMATTN_HAS_CUDA_KERNELS)
  return true;
#else
  return false;
#endif
}

std::string cuda_flash_gate(const AttentionKernelParams& p, bool backward) {
  const std::string op = backward ? "[cuda_flash backward] " : "[cuda_flash] ";
  if (std::string err = p.validate(backward, kCudaElementTypes); !err.empty()) return err;
  if (p.head_dim != p.head_dim_v)
    return op + "needs equal q/k and v head dims, got " + std::to_string(p.head_dim) + " and " +
           std::to_string(p.head_dim_v);
  if (p.head_dim != 64 && p.head_dim != 128)
    return op + "takes head dim 64 or 128, got " + std::to_string(p.head_dim) +
           " (the tiles are compiled for these two)";
  if (p.batch > 65535 || p.heads > 65535)
    return op + "batch and heads are grid dims of at most 65535, got batch=" + std::to_string(p.batch) +
           " heads=" + std::to_string(p.heads);
  constexpr int64_t kMaxLen = std::numeric_limits<int32_t>::max();
  if (p.seqlen_q > kMaxLen || p.seqlen_k > kMaxLen)
    return op + "seqlen_q and seqlen_k must be < 2^31, got " + std::to_string(p.seqlen_q) + " and " +
           std::to_string(p.seqlen_k);

  struct T {
    const char* name;
    const void* ptr;
    const ElementStrides* st;
    int64_t rows;
  };
  const T all[] = {{"q", p.q, &p.q_strides, p.batch * p.heads * p.seqlen_q},
                   {"k", p.k, &p.k_strides, p.batch * p.kv_heads * p.seqlen_k},
                   {"v", p.v, &p.v_strides, p.batch * p.kv_heads * p.seqlen_k},
                   {"out", p.out, &p.out_strides, p.batch * p.heads * p.seqlen_q},
                   {"dout", p.dout, &p.dout_strides, p.batch * p.heads * p.seqlen_q},
                   {"dq", p.dq, &p.dq_strides, p.batch * p.heads * p.seqlen_q},
                   {"dk", p.dk, &p.dk_strides, p.batch * p.kv_heads * p.seqlen_k},
                   {"dv", p.dv, &p.dv_strides, p.batch * p.kv_heads * p.seqlen_k}};
  const int used = backward ? 8 : 4;
  for (int i = 0; i < used; ++i) {
    const T& t = all[i];
    if (t.rows == 0) continue;
    if (reinterpret_cast<uintptr_t>(t.ptr) % 16 != 0)
      return op + t.name + " must start on a 16-byte boundary (rows are copied as 16-byte vectors); copy it first";
    if (t.st->batch % 8 != 0 || t.st->head % 8 != 0 || t.st->row % 8 != 0)
      return op + t.name + "'s strides (batch " + std::to_string(t.st->batch) + ", head " +
             std::to_string(t.st->head) + ", row " + std::to_string(t.st->row) +
             ") must be multiples of 8 elements (16 bytes); copy it first";
  }
  return {};
}

size_t cuda_flash_backward_workspace_bytes(const AttentionKernelParams& p) {
  const int64_t rows = p.batch * p.heads * p.seqlen_q;
  auto round16 = [](int64_t bytes) { return static_cast<size_t>((bytes + 15) / 16 * 16); };
  return round16(rows * p.head_dim * 4) + round16(rows * 4);  // dq in float32, then D_i
}

}  // namespace dimattn::kernels
