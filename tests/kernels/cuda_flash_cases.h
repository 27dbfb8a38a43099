#pragma once
// The cases cuda_flash is checked on, and the check: forward and backward on
// 16-bit inputs against a float64 loop oracle and against cpu_flash on the
// same bits. Written once for both places the kernel runs: a GPU
// (tests/kernels/cuda_host_test.cpp, device memory) and the host emulation
// (tests/cuda_emu, host memory).
//
// Tolerance (docs/numerics.md, "16-bit fused kernels"): each element's error
// bound follows its reduction, u * (|ref| + M) with u = 2^-8 (bfloat16) or
// 2^-11 (float16) and M the sum of the magnitudes of the terms the kernel
// rounds to 16 bits before summing them (P V for out, P^T dO for dV, dS^T Q
// and dS K for dK and dQ, dS carrying the error of D_i = rowsum(dO O)).
#include <cstddef>
#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "common/attention_params.h"

namespace dimattn::kernels::test {

struct CudaKernelCase {
  std::string name;
  ElementType dtype = ElementType::bfloat16;
  int64_t B = 2, H = 4, Hkv = 2, Tq = 100, Tk = 130, D = 64;
  bool causal = false;
  bool packed_qkv = false;  // q, k, v are views of one [B, T, H + 2 Hkv, D] buffer (Tq = Tk)
  std::vector<int64_t> q_lens, kv_lens, offsets;
  // Per-row kv lengths (attention_params.h's kv_row_lengths), drawn in [0,
  // kv_lens[b]] (Tk without kv_lens, whose place the entries' maxima take
  // then), one in six 0: per (b, h, row), or per (b, row) shared by the heads
  // (their plane offsets repeat).
  enum class RowLengths { off, per_head, shared_by_heads } row_lengths = RowLengths::off;
  double p = 0;
  bool broadcast = false;
  bool zero_queries = false;  // q = 0: every allowed weight equal (the dropout overflow case)
  double scale = 0;           // 0: 1 / sqrt(D)
  // Variants (attention_params.h): a window, soft-capping, ALiBi slopes per
  // head (2^(-8 (h + 1) / H), shared by the batch: stride 0), sink logits per
  // head (unit normal, shared by the batch).
  int64_t window_left = -1, window_right = -1;
  double softcap = 0;
  bool alibi = false, sinks = false;
  // A float32 bias over [heads, Tq, Tk] shared by the batch (offset stride 0:
  // d(bias) sums over it) and a mask over [batch, Tq, Tk] shared by the heads
  // (true with probability 3/4; every 7th row of entry 0 all false), read
  // through per-(b, h) plane offsets.
  bool bias = false, mask = false;
  // > 0: the mask (mask on) is documents of this many positions instead,
  // (i, j) allowed iff (i + 13 b) / n == (j + 13 b) / n: blocks of it that
  // forbid everything (skipped), allow everything (no per-element test) and
  // some, in the forward's and the backward's blocks.
  int64_t mask_docs = 0;
  // Segment ids (attention_params.h's query_segments, kv_segments) per batch
  // entry, shared by the heads: documents of irregular lengths (about 40
  // positions, shifted per entry), over [batch, Tq] and [batch, Tk].
  bool segments = false;
  // With segments: packed sequences instead, sequence d of length
  // packed[d % n] on the query side and on the kv side, where every fifth
  // (d % 5 == 2) has no kv positions (its rows attend nothing).
  std::vector<int64_t> packed;
  // The call as a block of a longer sequence: dropout keys row q_position + i
  // and kv position kv_position + j (attention_params.h).
  int64_t q_position = 0, kv_position = 0;
};

// GoogleTest prints a case by its name.
inline void PrintTo(const CudaKernelCase& c, std::ostream* os) { *os << c.name; }

// Every case: the CUDA dual harness's cases at kernel level (cross, causal
// self-attention, kv lengths, causal offsets, GQA, MQA, dropout, broadcast
// dropout, packed qkv views), the edge cases (zero-length entries, query
// lengths, negative offsets, dropout near 1 in float16, per-row kv lengths
// with rows of length 0) and the variants
// (windows, soft-capping, ALiBi, sinks, bias, mask, segments, and all of them with dropout), each
// for bfloat16 and float16, head dims 64 and 128.
std::vector<CudaKernelCase> cuda_kernel_cases();

// Where cuda_flash runs: memory it can read and write, and the two passes.
struct CudaFlashRunner {
  virtual ~CudaFlashRunner() = default;
  virtual void* alloc(size_t bytes) = 0;  // filled with 0xFF bytes (NaN)
  virtual void free(void* p) = 0;
  virtual void upload(void* dst, const void* src, size_t bytes) = 0;
  virtual void download(void* dst, const void* src, size_t bytes) = 0;
  virtual void forward(const AttentionKernelParams& p) = 0;
  virtual void backward(const AttentionKernelParams& p, void* workspace) = 0;
};

// Runs `c` on the runner and on cpu_flash and checks both against the oracle
// (GoogleTest assertions); prints the worst error / tolerance per output.
void check_cuda_flash_case(const CudaKernelCase& c, CudaFlashRunner& runner);

}  // namespace dimattn::kernels::test
