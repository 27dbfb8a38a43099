#pragma once
// The cases cuda_flash is checked on (kernel-level cases of
// tests/support/kernel_case.h), and the check: forward and backward on
// 16-bit inputs against the float64 oracle and against cpu_flash on the same
// bits. Written once for both places the kernel runs: a GPU
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
#include "support/kernel_case.h"

namespace dimattn::kernels::test {

// GoogleTest prints a case by its name.
inline void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

// Every case: the CUDA dual harness's cases at kernel level (cross, causal
// self-attention, kv lengths, causal offsets, GQA, MQA, dropout, broadcast
// dropout, packed qkv views), the edge cases (zero-length entries, query
// lengths, negative offsets, dropout near 1 in float16, per-row kv lengths
// with rows of length 0) and the variants
// (windows, soft-capping, ALiBi, sinks, bias, mask, segments, and all of them with dropout), each
// for bfloat16 and float16, head dims 64 and 128.
std::vector<Case> cuda_kernel_cases();

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
void check_cuda_flash_case(const Case& c, CudaFlashRunner& runner);

}  // namespace dimattn::kernels::test
