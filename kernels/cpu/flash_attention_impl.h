// The CPU flash attention kernel, written once for every instruction set.
//
// No include guard and no #includes, on purpose: flash_attention.cpp includes
// this file inside namespace dimattn::kernels::cpu_flash_generic, and the x86
// translation units inside their own namespaces under their target pragmas
// (flash_attention_x86.h: cpu_flash_avx2, cpu_flash_avx512,
// cpu_flash_avx512_bf16). The compiler vectorizes each copy for its
// instruction set, and the copies coexist in one library because their
// namespaces differ (no ODR clash, so no AVX code can leak into the baseline
// path). The includer provides, before opening its namespace: <algorithm>, <atomic>,
// <cmath>, <cstdint>, <cstdlib>, <cstring>, <limits>, <memory>, <optional>,
// <type_traits>, <utility>, <vector>, philox.h, attention_mask.h, attention_params.h, thread_pool.h and
// flash_attention_heuristics.h; and in its namespace:
//   vf, vd, vi      GCC vector types of one width (16 bytes portable, 32 on
//                   AVX2, 64 on AVX-512): float, double and int32 lanes
//   vfma(a, b, c)   a * b + c for vf and vd (fused where the ISA has FMA)
//   vmax, vmin      lane-wise max and min of vf and vd
//   philox_bits(key, k4, c1, c2, c3, groups, out)
//                   out[4 g + l] = lane l of philox4x32_10({k4 + g, c1, c2, c3}, key)
//                   for g < groups (philox.h's generator, several counters at once)
//   half_to_float(h), float_to_half(x)
//                   float16 bits <-> float, round to nearest even (half_bits.h's rules)
//   half8_to_float(src, dst)
//                   dst[0..7] = half_to_float(src[0..7])
//   halves_to_vf(src) the vf of half_to_float(src[0..W))
//   kMicroRows      rows of the GEMM micro-kernel: kMicroRows x 2 vectors of
//                   accumulators, 2 vectors of B and a broadcast fill the registers
//   DIMATTN_INLINE  the always-inline function specifier
// and, where DIMATTN_X86_PAIRS is defined (the avx512_bf16 copy), what
// flash_impl/pairs.h lists: bfloat16 products run there as pairs.
//
// Layout of a kernel call:
//   forward  tasks (b, h, query block): tiled online softmax over kv tiles;
//            kv tiles are packed (k transposed, float) once per kv head and
//            task range, and read by the products as contiguous panels.
//            Decoding (forward_decode: the query heads of a kv head in one
//            block, long caches in chunks) reads each tile once, where it
//            lies: direct products for few rows, row products for more.
//   backward tasks (b, kv head, kv chunk): for each query head of the group,
//            for each kv tile, for each query block: recompute P, then dV, dP,
//            dS, dK (task-local accumulators), dQ (task-local, or a per-chunk
//            share summed by a second pass in chunk order).
// Every product is one register-blocked micro-kernel (kMicroRows rows x 2
// vectors: 6 x 16 float32 on AVX2, 12 x 32 on AVX-512) over packed or
// row-major operands, through Products<S, A> (flash_impl/products.h: what the
// operands are packed as and which micro-kernel multiplies them); causal
// diagonal tiles skip the micro-blocks past the rows' limits.
//
// The parts, in include order (each uses only those before it):
//   flash_impl/simd.h          vector layer (Simd<T>, loads, exp2) and row helpers
//   flash_impl/micro_kernel.h  the GEMM micro-kernel, ragged tiles
//   flash_impl/packing.h       element conversion, operand packing, scratch arena
//   flash_impl/direct.h        few query rows' products, k and v read in place
//   flash_impl/products.h      the products of a pass, per storage type
//   flash_impl/pairs.h         (avx512_bf16 only) bfloat16 products as pairs
//   flash_impl/dropout.h       dropout factors of a row tile
//   flash_impl/score_mods.h    the score variants on a row of a tile, vectorised
//   flash_impl/mask_tiles.h    what a tile's rows attend: row spans; the bool mask's and
//                              segments' blocks classified (empty, full, partial), segment runs
//   flash_impl/rel_pos.h       relative positions: the band products along the diagonals
//   flash_impl/forward.h       the forward pass
//   flash_impl/backward.h      the backward pass

#ifndef DIMATTN_INLINE
#error "flash_attention_impl.h is included by the kernel's translation units only"
#endif

#define DIMATTN_CPU_FLASH_PARTS
#include "cpu/flash_impl/simd.h"
#include "cpu/flash_impl/micro_kernel.h"
#include "cpu/flash_impl/packing.h"
#include "cpu/flash_impl/direct.h"
#include "cpu/flash_impl/products.h"
#ifdef DIMATTN_X86_PAIRS
#include "cpu/flash_impl/pairs.h"
#endif
#include "cpu/flash_impl/dropout.h"
#include "cpu/flash_impl/score_mods.h"
#include "cpu/flash_impl/mask_tiles.h"
#include "cpu/flash_impl/rel_pos.h"
#include "cpu/flash_impl/forward.h"
#include "cpu/flash_impl/backward.h"
#undef DIMATTN_CPU_FLASH_PARTS

// ---------------------------------------------------------------------------
// Entry points of this instruction set. pre: p validated.

inline void run_forward(const AttentionKernelParams& p, const ParallelFor& pf) {
  switch (p.dtype) {
    case ElementType::float32: forward<float, float>(p, pf); break;
    case ElementType::float64: forward<double, double>(p, pf); break;
    case ElementType::bfloat16: forward<uint16_t, float>(p, pf); break;
    case ElementType::float16: forward<Half, float>(p, pf); break;
  }
}

inline void run_backward(const AttentionKernelParams& p, const ParallelFor& pf) {
  switch (p.dtype) {
    case ElementType::float32: backward<float, float>(p, pf); break;
    case ElementType::float64: backward<double, double>(p, pf); break;
    case ElementType::bfloat16: backward<uint16_t, float>(p, pf); break;
    case ElementType::float16: backward<Half, float>(p, pf); break;
  }
}
