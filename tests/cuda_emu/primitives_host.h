#pragma once
// cuda/primitives.cuh for the host: the same names, run by the emulator
// (emulator.h). A translation unit compiled with
// DIMATTN_CUDA_EMULATION="cuda_emu/primitives_host.h" gets these instead of
// CUDA's, and with them compiles cuda_flash's kernels and launchers as C++.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#include "cuda_emu/emulator.h"
#include "support/bf16_bits.h"

// CUDA's declaration specifiers and built-in variables.
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) alignas(n)
#define threadIdx (::dimattn::cuda_emu::thread_idx())
#define blockIdx (::dimattn::cuda_emu::block_idx())
#define blockDim (::dimattn::cuda_emu::block_dim())
#define gridDim (::dimattn::cuda_emu::grid_dim())

struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct CUstream_st;

namespace dimattn::kernels::cuda_flash {

namespace emu = ::dimattn::cuda_emu;

// 16-bit floats as their bit patterns.
struct bf16 {
  uint16_t bits;
};
struct f16 {
  uint16_t bits;
};

inline uint16_t bf16_bits_of(float x) {  // round to nearest even; NaN stays NaN
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
inline uint16_t f16_bits_of(float x) { return kernels::test::f16_round(x); }  // round to nearest even
inline float to_float(bf16 x) {
  const uint32_t u = static_cast<uint32_t>(x.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float to_float(f16 x) { return kernels::test::f16_value(x.bits); }
inline bf16 to_bf16(float x) { return {bf16_bits_of(x)}; }
inline f16 to_f16(float x) { return {f16_bits_of(x)}; }
inline uint32_t pack_bf16x2(float lo, float hi) { return bf16_bits_of(lo) | uint32_t{bf16_bits_of(hi)} << 16; }
inline uint32_t pack_f16x2(float lo, float hi) { return f16_bits_of(lo) | uint32_t{f16_bits_of(hi)} << 16; }

inline void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1,
                     emu::Site s = emu::Site::current()) {
  emu::mma_m16n8k16(emu::MmaType::bf16, c, a, b0, b1, s);
}
inline void mma_f16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1,
                    emu::Site s = emu::Site::current()) {
  emu::mma_m16n8k16(emu::MmaType::f16, c, a, b0, b1, s);
}

inline unsigned char* dynamic_smem() { return emu::dynamic_smem(); }

template <class T>
T ld_shared(const T* p, emu::Site s = emu::Site::current()) {
  emu::smem_access(p, sizeof(T), false, s);
  return *p;
}
template <class T>
void st_shared(T* p, T v, emu::Site s = emu::Site::current()) {
  emu::smem_access(p, sizeof(T), true, s);
  *p = v;
}

inline void cp_async_16(void* smem, const void* gmem, bool valid, emu::Site s = emu::Site::current()) {
  emu::cp_async_16(smem, gmem, valid, s);
}
inline void cp_async_commit() { emu::cp_async_commit(); }
template <int N>
void cp_async_wait(emu::Site s = emu::Site::current()) {
  emu::cp_async_wait(N, s);
}

inline void ldmatrix_x4(uint32_t (&r)[4], const void* p, emu::Site s = emu::Site::current()) {
  emu::ldmatrix_x4(r, p, false, s);
}
inline void ldmatrix_x4_trans(uint32_t (&r)[4], const void* p, emu::Site s = emu::Site::current()) {
  emu::ldmatrix_x4(r, p, true, s);
}

inline void block_sync(emu::Site s = emu::Site::current()) { emu::block_barrier(s); }
inline float shfl_xor(float x, int lane_mask, emu::Site s = emu::Site::current()) {
  return emu::shfl_xor(x, lane_mask, s);
}
// Blocks run one at a time, threads between collectives one at a time: a
// plain add is atomic here.
inline void atomic_add(float* p, float v) { *p += v; }
inline void atomic_add(double* p, double v) { *p += v; }

template <class P>
std::string allow_dynamic_smem(void (*kernel)(P), int bytes) {
  emu::allow_dynamic_smem(reinterpret_cast<const void*>(kernel), static_cast<size_t>(bytes));
  return {};
}
template <class P>
std::string launch(void (*kernel)(P), dim3 grid, dim3 block, size_t smem_bytes, CUstream_st* /*stream*/,
                   const P& arg) {
  return emu::launch("kernel", reinterpret_cast<const void*>(kernel), {grid.x, grid.y, grid.z},
                     {block.x, block.y, block.z}, smem_bytes, [&] { kernel(arg); });
}
inline std::string zero_async(void* p, size_t bytes, CUstream_st* /*stream*/) {
  std::memset(p, 0, bytes);
  return {};
}

}  // namespace dimattn::kernels::cuda_flash
