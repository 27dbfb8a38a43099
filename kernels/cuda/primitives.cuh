#pragma once
// Everything of CUDA that cuda_flash's kernels and launchers use, and the
// only place that names it: the tensor-core and shared-memory instructions
// (inline PTX), warp shuffles, barriers, atomics, 16-bit conversions, shared
// memory accesses, and the runtime calls of a launch. Kernel code touches
// shared memory only through ld_shared / st_shared / cp_async_16 / ldmatrix.
//
// A host emulation can replace every definition here without touching kernel
// code: a build that defines DIMATTN_CUDA_EMULATION as a header name includes
// that header instead, which declares the same names for the CPU
// (tests/cuda_emu, docs/gpu.md).
#if defined(DIMATTN_CUDA_EMULATION)
#include DIMATTN_CUDA_EMULATION
#else
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

namespace dimattn::kernels::cuda_flash {

using bf16 = __nv_bfloat16;
using f16 = __half;

// --- 16-bit conversions (round to nearest even); pack: lo in the low half ---

__device__ inline uint32_t pack_bf16x2(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}
__device__ inline uint32_t pack_f16x2(float lo, float hi) {
  const __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}
__device__ inline float to_float(bf16 x) { return __bfloat162float(x); }
__device__ inline float to_float(f16 x) { return __half2float(x); }
__device__ inline bf16 to_bf16(float x) { return __float2bfloat16_rn(x); }
__device__ inline f16 to_f16(float x) { return __float2half_rn(x); }

// --- tensor cores: d = a * b + c, m16n8k16, float32 accumulators ---
// A 16x16 row-major, B 16x8 column-major, in the fragments of the PTX ISA
// (lane l: group g = l / 4, t = l % 4): a = {(g, 2t..2t+1), (g+8, 2t..),
// (g, 2t+8..), (g+8, 2t+8..)}, b = {(k 2t..2t+1, n g), (k 2t+8.., n g)},
// c = {(g, 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1)}.

__device__ inline void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ inline void mma_f16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// --- shared memory ---

// The block's dynamic shared memory (the launch's smem bytes), 16-byte aligned.
__device__ inline unsigned char* dynamic_smem() {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  return smem_raw;
}
__device__ inline uint32_t smem_address(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

template <class T>
__device__ inline T ld_shared(const T* p) {
  return *p;
}
template <class T>
__device__ inline void st_shared(T* p, T v) {
  *p = v;
}

// 16 bytes from global to shared memory, or 16 zero bytes when !valid.
__device__ inline void cp_async_16(void* smem, const void* gmem, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_address(smem)), "l"(gmem),
               "r"(valid ? 16 : 0));
}
__device__ inline void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
// Waits until at most N of this thread's committed groups are in flight.
template <int N>
__device__ inline void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Four 8x8 matrices of 16-bit elements: lanes 8m .. 8m + 7 give the 16-byte
// row addresses of matrix m; lane l receives in r[m] its (l / 4, 2 (l % 4) ..
// + 1) elements, or with .trans its (2 (l % 4) .. + 1, l / 4) elements.
__device__ inline void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_address(p)));
}
__device__ inline void ldmatrix_x4_trans(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_address(p)));
}

// --- synchronisation, warp exchange, atomics ---

__device__ inline void block_sync() { __syncthreads(); }
// x of lane (this lane ^ lane_mask); every lane of the warp takes part.
__device__ inline float shfl_xor(float x, int lane_mask) { return __shfl_xor_sync(0xffffffffu, x, lane_mask); }
__device__ inline void atomic_add(float* p, float v) { atomicAdd(p, v); }
__device__ inline void atomic_add(double* p, double v) { atomicAdd(p, v); }

// --- the runtime calls of a launch: "" on success, else what failed ---

inline std::string cuda_error_text(cudaError_t e) {
  return e == cudaSuccess ? std::string() : std::string(cudaGetErrorName(e)) + " (" + cudaGetErrorString(e) + ")";
}
template <class P>
std::string allow_dynamic_smem(void (*kernel)(P), int bytes) {
  return cuda_error_text(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
}
template <class P>
std::string launch(void (*kernel)(P), dim3 grid, dim3 block, size_t smem_bytes, cudaStream_t stream, const P& arg) {
  kernel<<<grid, block, smem_bytes, stream>>>(arg);
  return cuda_error_text(cudaGetLastError());
}
inline std::string zero_async(void* p, size_t bytes, cudaStream_t stream) {
  return cuda_error_text(cudaMemsetAsync(p, 0, bytes, stream));
}

}  // namespace dimattn::kernels::cuda_flash
#endif
