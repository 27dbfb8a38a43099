#pragma once
// cuda_flash's device code: tile sizes, warp-level matrix primitives, and the
// forward and backward kernels. Included by flash_attention_cuda.cu only.
//
// Notation. A block owns a tile of query rows (forward) or of kv positions
// (backward); each of its 4 warps owns 16 rows of that tile. Matrix products
// use mma.sync.m16n8k16 (A 16x16 row-major, B 16x8 column-major, C 16x8
// float32): in the C fragment, lane l holds rows g = l / 4 and g + 8, columns
// 2 * (l % 4) and + 1 of each 8-column tile. Fragments come from shared memory
// through ldmatrix (.trans where the stored tile is k-major). Every CUDA
// instruction, intrinsic and shared-memory access goes through
// cuda/primitives.cuh, so that a host emulation can run this code.
#include <cmath>
#include <cstdint>

#include "common/attention_mask.h"
#include "common/philox.h"
#include "cuda/primitives.cuh"

namespace dimattn::kernels::cuda_flash {

// --- tile sizes (compile-time; heuristics in one place) ---

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kFwdBlockM = 64;  // query rows per forward block (16 per warp)
constexpr int kFwdBlockN = 64;  // kv positions per step of the forward loop
constexpr int kBwdBlockN = 64;  // kv positions per backward block (16 per warp)
constexpr int kBwdBlockM = 32;  // query rows per step of the backward loop
// Shared-memory rows are padded by 16 bytes: the 8 row addresses of one
// ldmatrix then fall on distinct bank groups.
__host__ __device__ constexpr int padded(int cols) { return cols + 8; }

// Past the tiles: block_class's flags (2 floats per warp).
template <int D>
constexpr int fwd_smem_bytes() {
  return (kFwdBlockM + 2 * kFwdBlockN) * padded(D) * 2 + 2 * kWarps * 4;
}
template <int D>
constexpr int bwd_smem_bytes() {
  return (2 * kBwdBlockN + 2 * kBwdBlockM) * padded(D) * 2 + kBwdBlockM * padded(kBwdBlockN) * 2 +
         2 * kBwdBlockM * 4 + 2 * kWarps * 4;
}

static_assert(kFwdBlockM == 16 * kWarps && kBwdBlockN == 16 * kWarps, "one 16-row mma tile per warp");
static_assert(kFwdBlockN % 16 == 0 && kBwdBlockM % 16 == 0, "whole k-steps of 16");
static_assert((kWarps * 16) % kBwdBlockM == 0, "dq warps split the q rows evenly");

// --- the kernels' view of AttentionKernelParams ---

struct Strides {
  int64_t batch, head, row;
};

struct DeviceParams {
  const void *q, *k, *v;
  void* out;
  float* lse;
  const void* dout;
  void *dq, *dk, *dv;
  float* dq_accum;  // [batch, heads, seqlen_q, head_dim], zeroed before the backward kernel
  float* dsum;      // [batch, heads, seqlen_q]: D_i = rowsum(dO * O)
  Strides qs, ks, vs, os, dos, dqs, dks, dvs;
  int64_t lse_batch, lse_head;
  int batch, heads, group;  // group = heads / kv_heads
  int seqlen_q, seqlen_k;
  const int64_t *q_lengths, *kv_lengths, *causal_offset;
  ScorePlanes kv_row_lengths;  // per-row kv lengths (attention_params.h); off = per entry
  bool causal;
  float scale;       // softmax scale
  float scale_log2;  // scale * log2(e): scores in base-2 units
  bool dropout, dropout_broadcast;
  uint64_t seed;
  uint32_t rng_offset;
  uint32_t q_position, kv_position;  // attention_params.h's dropout_q/kv_position
  DropoutRule rule;  // common/attention_mask.h's keep rule
  float keep_scale;  // rule.keep_scale in float32
  // Variants (attention_params.h), as AttentionKernelParams carries them:
  // positional bounds (the window) and the score variants (the bias in
  // float32; dsinks zeroed before the backward kernels; d(bias) zeroed by
  // the caller and added to atomically).
  RowBounds bounds;
  ScoreParams score;
};

// 64-bit min without relying on which overloads CUDA's headers declare.
__host__ __device__ constexpr int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

// The mask of batch entry b (common/attention_mask.h; with per-row kv
// lengths, kv_len bounds every row's), and that of its head h (with its
// rows' lengths).
__device__ inline EntryMask entry_mask_of(const DeviceParams& p, int b, int h = -1) {
  return entry_mask(p.q_lengths, p.kv_lengths, p.causal_offset, p.causal, p.seqlen_q, p.seqlen_k, b, p.bounds,
                    p.kv_row_lengths, h < 0 ? -1 : int64_t{b} * p.heads + h);
}

// --- dropout: attention_mask.h's keying and keep rule ---

__device__ inline uint32_t philox_lane(const Philox4& r, uint32_t lane) {
  // Selects without a run-time index into the array (which would spill it).
  return lane == 0 ? r.v[0] : lane == 1 ? r.v[1] : lane == 2 ? r.v[2] : r.v[3];
}

// The Philox words of kv positions 4 * (jp / 4) .. + 3 of row (bh, i), for
// the keyed kv position jp (the call's j + kv_position).
__device__ inline Philox4 dropout_words_of(const DeviceParams& p, uint32_t bh, uint32_t i, uint32_t jp) {
  return p.dropout_broadcast ? dropout_words_broadcast(p.seed, p.rng_offset, jp)
                             : dropout_words(p.seed, p.rng_offset, bh, i + p.q_position, jp);
}

// Random bits of elements (bh, i, j) and (bh, i, j + 1). pre: j even. Both
// share one counter unless kv_position is odd and the pair straddles two.
__device__ inline void dropout_bits_pair(const DeviceParams& p, uint32_t bh, uint32_t i, uint32_t j, uint32_t& b0,
                                         uint32_t& b1) {
  const uint32_t jp = j + p.kv_position;
  const Philox4 r = dropout_words_of(p, bh, i, jp);
  b0 = philox_lane(r, jp & 3);
  b1 = (jp & 3) == 3 ? philox_lane(dropout_words_of(p, bh, i, jp + 1), 0) : philox_lane(r, (jp + 1) & 3);
}

__device__ inline uint32_t dropout_bits(const DeviceParams& p, uint32_t bh, uint32_t i, uint32_t j) {
  const uint32_t jp = j + p.kv_position;
  return philox_lane(dropout_words_of(p, bh, i, jp), jp & 3);
}

// 1 or 0: whether dropout keeps an element. The rescale 1 / (1 - p) is not
// applied to weights that are rounded to 16 bits (with float16 and p near 1 it
// would overflow there); it scales the float32 results at the end.
__device__ inline float kept(const DeviceParams& p, uint32_t bits) { return p.rule.keeps(bits) ? 1.f : 0.f; }

// --- element types ---

template <class T>
struct Elem;

template <>
struct Elem<bf16> {
  __device__ static uint32_t pack(float lo, float hi) { return pack_bf16x2(lo, hi); }
  __device__ static float to_float(bf16 x) { return cuda_flash::to_float(x); }
  __device__ static bf16 from_float(float x) { return to_bf16(x); }
  // c += a * b, 16x8x16, float32 accumulators.
  __device__ static void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    mma_bf16(c, a, b0, b1);
  }
};

template <>
struct Elem<f16> {
  __device__ static uint32_t pack(float lo, float hi) { return pack_f16x2(lo, hi); }
  __device__ static float to_float(f16 x) { return cuda_flash::to_float(x); }
  __device__ static f16 from_float(float x) { return to_f16(x); }
  __device__ static void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    mma_f16(c, a, b0, b1);
  }
};

// --- fragments from shared memory ---

// The A fragment of the 16x16 block at (r0, c0) of a row-major tile
// (M rows, K columns): r = {a0, a1, a2, a3}.
template <class T>
__device__ inline void load_a(uint32_t (&r)[4], const T* tile, int ld, int r0, int c0, int lane) {
  ldmatrix_x4(r, tile + (r0 + (lane & 7) + ((lane >> 3) & 1) * 8) * ld + c0 + (lane >> 4) * 8);
}

// B fragments of two 8-column tiles (n0 and n0 + 8) of k-step k0, from a tile
// stored n-major (row n holds the K values of column n, e.g. K for Q K^T):
// r = {b0, b1 of n0; b0, b1 of n0 + 8}.
template <class T>
__device__ inline void load_b_nmajor(uint32_t (&r)[4], const T* tile, int ld, int n0, int k0, int lane) {
  ldmatrix_x4(r, tile + (n0 + (lane & 7) + (lane >> 4) * 8) * ld + k0 + ((lane >> 3) & 1) * 8);
}

// The same from a tile stored k-major (row k holds the N values, e.g. V for
// P V): transposed on load.
template <class T>
__device__ inline void load_b_kmajor(uint32_t (&r)[4], const T* tile, int ld, int k0, int n0, int lane) {
  ldmatrix_x4_trans(r, tile + (k0 + (lane & 7) + ((lane >> 3) & 1) * 8) * ld + n0 + (lane >> 4) * 8);
}

// Rows [0, rows) of a tile of D columns from global memory (row stride
// `stride` elements) into shared memory (row stride padded(D)); rows at or
// after `valid_rows` are zero-filled. Every thread of the block takes part.
template <class T, int D>
__device__ inline void load_tile(T* smem, const T* gmem, int64_t stride, int rows, int64_t valid_rows) {
  constexpr int kChunks = D / 8;  // 16-byte chunks per row
  for (int c = threadIdx.x; c < rows * kChunks; c += kThreads) {
    const int r = c / kChunks, col = (c % kChunks) * 8;
    const bool valid = r < valid_rows;
    cp_async_16(smem + r * padded(D) + col, valid ? gmem + r * stride + col : gmem, valid);
  }
}

// The A fragment of k-step t of a product whose A operand is the C fragments
// `s` (16 rows x 8-column tiles) of an earlier product, rounded to T.
template <class T>
__device__ inline void c_to_a(uint32_t (&a)[4], const float (&s0)[4], const float (&s1)[4]) {
  a[0] = Elem<T>::pack(s0[0], s0[1]);
  a[1] = Elem<T>::pack(s0[2], s0[3]);
  a[2] = Elem<T>::pack(s1[0], s1[1]);
  a[3] = Elem<T>::pack(s1[2], s1[3]);
}

__device__ inline float quad_max(float x) {
  x = fmaxf(x, shfl_xor(x, 1));
  return fmaxf(x, shfl_xor(x, 2));
}
__device__ inline float quad_sum(float x) {
  x += shfl_xor(x, 1);
  return x + shfl_xor(x, 2);
}

// The class of a block of cells under the bool mask and segments, from
// what each thread found in its share of them (some allowed, some
// forbidden): OR over the warp's lanes, then over the warps through `flags`
// (kFlagFloats floats of shared memory). Every thread of the block takes
// part and gets the same class; it ends past a barrier, and `flags` may be
// written again only past another one.
constexpr int kFlagFloats = 2 * kWarps;
__device__ inline TileClass block_class(bool allows, bool forbids, float* flags) {
  float a = allows ? 1.f : 0.f, f = forbids ? 1.f : 0.f;
#pragma unroll
  for (int m = 16; m >= 1; m >>= 1) {
    a = fmaxf(a, shfl_xor(a, m));
    f = fmaxf(f, shfl_xor(f, m));
  }
  const int warp = threadIdx.x >> 5;
  if ((threadIdx.x & 31) == 0) {
    st_shared(flags + 2 * warp, a);
    st_shared(flags + 2 * warp + 1, f);
  }
  block_sync();
  a = f = 0.f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) {
    a = fmaxf(a, ld_shared(flags + 2 * w));
    f = fmaxf(f, ld_shared(flags + 2 * w + 1));
  }
  return a == 0.f ? TileClass::empty : f == 0.f ? TileClass::full : TileClass::partial;
}

// The class of a block of cells under the bool mask and segments (`mod`'s),
// each thread testing the cells of its C fragment, (i, j) = at(t, e) for
// tiles t < kTiles and elements e < 4, that the positional mask allows (the
// others are masked anyway, and may lie outside the call); block_class votes.
template <int kTiles, class At>
__device__ inline TileClass fragment_class(const EntryMask& mask, const ScoreMod<float>& mod, At at, float* flags) {
  bool allows = false, forbids = false;
#pragma unroll
  for (int t = 0; t < kTiles; ++t)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      int64_t i, j;
      at(t, e, i, j);
      if (!mask.allowed(i, j)) continue;
      const bool ok = mod.permits(i, j);
      allows |= ok;
      forbids |= !ok;
    }
  return block_class(allows, forbids, flags);
}

// ---------------------------------------------------------------------------
// Forward: grid (query blocks, heads, batch). Each warp keeps 16 query rows'
// Q fragments, output accumulators and softmax statistics in registers and
// walks the kv positions those rows attend, 64 at a time.

template <class T, int D>
__global__ void __launch_bounds__(kThreads) forward_kernel(const DeviceParams p) {
  constexpr int BM = kFwdBlockM, BN = kFwdBlockN, LD = padded(D);
  const float kInf = INFINITY;
  T* sQ = reinterpret_cast<T*>(dynamic_smem());
  T* sK = sQ + BM * LD;
  T* sV = sK + BN * LD;
  float* sFlags = reinterpret_cast<float*>(sV + BN * LD);

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, tig = lane & 3;
  const int b = blockIdx.z, h = blockIdx.y;
  // Causal blocks further down cost more: start those first.
  const int mb = p.causal ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
  const int64_t m0 = int64_t{mb} * BM;
  const EntryMask mask = entry_mask_of(p, b, h);
  const ScoreMod<float> mod = score_mod_of<float>(p.score, mask, b, h, p.heads);
  const ScoreMod<float> unmasked = mod.unmasked();  // for kv blocks the mask and segments allow entirely
  const int hk = h / p.group;
  const uint32_t bh = static_cast<uint32_t>(b * p.heads + h);

  const T* qg = static_cast<const T*>(p.q) + b * p.qs.batch + h * p.qs.head + m0 * p.qs.row;
  const T* kg = static_cast<const T*>(p.k) + b * p.ks.batch + hk * p.ks.head;
  const T* vg = static_cast<const T*>(p.v) + b * p.vs.batch + hk * p.vs.head;
  T* og = static_cast<T*>(p.out) + b * p.os.batch + h * p.os.head;

  // The block's rows attend kv positions [lo(m0), hi_max(m0, rows_end)).
  // Kv blocks [nb_begin, n_blocks) hold them.
  const int64_t rows_end = min64(m0 + BM, mask.q_len);
  const int64_t n_end = rows_end > m0 ? mask.hi_max(m0, rows_end) : 0;
  const int n_blocks = static_cast<int>((n_end + BN - 1) / BN);
  const int nb_begin = rows_end > m0 ? static_cast<int>(min64(mask.lo(m0), n_end) / BN) : 0;

  // This thread's two rows.
  const int64_t i0 = m0 + warp * 16 + g, i1 = i0 + 8;
  const Range row0 = mask.row(i0), row1 = mask.row(i1);

  float o[D / 8][4];
#pragma unroll
  for (int t = 0; t < D / 8; ++t) o[t][0] = o[t][1] = o[t][2] = o[t][3] = 0.f;
  // A sink logit starts each row's softmax: its weight 2^(sink - max) is in
  // the sum (held by lane tig 0 of the quad, whose sums are added at the end).
  const float sink = sink_log2_of<float>(p.score, b, h);
  float row_max[2] = {sink, sink};
  const float sink_weight = p.score.sinks.on() && tig == 0 ? 1.f : 0.f;
  float row_sum[2] = {sink_weight, sink_weight};

  // The bool mask and segments classify each kv block (block_class over the
  // cells each thread would mask, those inside its rows' ranges): one they
  // forbid entirely is skipped (no products, no exponentials; its copies
  // still run, so that the pipeline's order stays as it is), one they allow
  // entirely runs without the per-element test, the others test each
  // element (ScoreMod::apply).
  const bool classify = mod.mask != nullptr || mod.qseg != nullptr;

  if (n_blocks > nb_begin) {
    const int64_t nb0 = int64_t{nb_begin} * BN;
    load_tile<T, D>(sQ, qg, p.qs.row, BM, rows_end - m0);
    load_tile<T, D>(sK, kg + nb0 * p.ks.row, p.ks.row, BN, min64(int64_t{BN}, n_end - nb0));
    cp_async_commit();
    uint32_t qf[D / 16][4];

    for (int nb = nb_begin; nb < n_blocks; ++nb) {
      const int64_t n0 = int64_t{nb} * BN;
      // Waits for this block's V and, once every warp is done with K, starts
      // copying the next block's K.
      auto next_k = [&] {
        cp_async_wait<0>();
        block_sync();
        if (nb + 1 < n_blocks) {
          const int64_t n1 = n0 + BN;
          load_tile<T, D>(sK, kg + n1 * p.ks.row, p.ks.row, BN, min64(int64_t{BN}, n_end - n1));
          cp_async_commit();
        }
      };
      // Positions at or after n_end are read by no row: zero-filled, so that
      // 0-weights never meet NaN or inf there.
      load_tile<T, D>(sV, vg + n0 * p.vs.row, p.vs.row, BN, min64(int64_t{BN}, n_end - n0));
      cp_async_commit();
      cp_async_wait<1>();  // Q and this block's K
      block_sync();
      if (nb == nb_begin) {
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) load_a(qf[kk], sQ, LD, warp * 16, kk * 16, lane);
      }
      TileClass cls = TileClass::partial;
      if (classify) {  // uniform: every thread takes part and gets the same class
        cls = fragment_class<BN / 8>(mask, mod, [&](int t, int e, int64_t& i, int64_t& j) {
          i = e < 2 ? i0 : i1, j = n0 + t * 8 + tig * 2 + (e & 1);
        }, sFlags);
        if (cls == TileClass::empty) {
          next_k();  // this block's V unread
          continue;
        }
      }
      const ScoreMod<float>& active = cls == TileClass::full ? unmasked : mod;

      // S = Q K^T for the warp's 16 rows x BN positions.
      float s[BN / 8][4];
#pragma unroll
      for (int t = 0; t < BN / 8; ++t) s[t][0] = s[t][1] = s[t][2] = s[t][3] = 0.f;
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
        for (int np = 0; np < BN / 16; ++np) {
          uint32_t kf[4];
          load_b_nmajor(kf, sK, LD, np * 16, kk * 16, lane);
          Elem<T>::mma(s[2 * np], qf[kk], kf[0], kf[1]);
          Elem<T>::mma(s[2 * np + 1], qf[kk], kf[2], kf[3]);
        }
      }

      // Scale to base-2 units, cap, ALiBi, mask; online softmax per row.
      float mx[2] = {-kInf, -kInf};
#pragma unroll
      for (int t = 0; t < BN / 8; ++t)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int64_t j = n0 + t * 8 + tig * 2 + (e & 1);
          float x = s[t][e] * p.scale_log2, th;
          const bool allowed = (e < 2 ? row0 : row1).contains(j);
          if (active.on() && allowed) x = active.apply(x, e < 2 ? i0 : i1, j, th);  // reads bias and mask in range only
          x = allowed ? x : -kInf;
          s[t][e] = x;
          mx[e >> 1] = fmaxf(mx[e >> 1], x);
        }
      float base[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const float m_new = fmaxf(row_max[r], quad_max(mx[r]));
        base[r] = m_new == -kInf ? 0.f : m_new;  // a row with nothing allowed yet: exp2(-inf - 0) = 0, no NaN
        const float alpha = exp2f(row_max[r] - base[r]);
        row_max[r] = m_new;
        row_sum[r] *= alpha;
#pragma unroll
        for (int t = 0; t < D / 8; ++t) {
          o[t][2 * r] *= alpha;
          o[t][2 * r + 1] *= alpha;
        }
      }
#pragma unroll
      for (int t = 0; t < BN / 8; ++t)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float w = exp2f(s[t][e] - base[e >> 1]);
          row_sum[e >> 1] += w;  // the normaliser is that of the weights before dropout
          s[t][e] = w;
        }
      if (p.dropout) {
#pragma unroll
        for (int t = 0; t < BN / 8; ++t) {
          const uint32_t j = static_cast<uint32_t>(n0 + t * 8 + tig * 2);
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            uint32_t b0, b1;
            dropout_bits_pair(p, bh, static_cast<uint32_t>(r ? i1 : i0), j, b0, b1);
            s[t][2 * r] *= kept(p, b0);
            s[t][2 * r + 1] *= kept(p, b1);
          }
        }
      }

      next_k();

      // O += P V.
#pragma unroll
      for (int kt = 0; kt < BN / 16; ++kt) {
        uint32_t pa[4];
        c_to_a<T>(pa, s[2 * kt], s[2 * kt + 1]);
#pragma unroll
        for (int dp = 0; dp < D / 16; ++dp) {
          uint32_t vf[4];
          load_b_kmajor(vf, sV, LD, kt * 16, dp * 16, lane);
          Elem<T>::mma(o[2 * dp], pa, vf[0], vf[1]);
          Elem<T>::mma(o[2 * dp + 1], pa, vf[2], vf[3]);
        }
      }
      block_sync();  // every warp is done with V before the next block's copy
    }
  }

  // out = O / l (0 for rows that attend nothing), times 1 / (1 - p) under
  // dropout; lse = ln(l) + max.
  constexpr float kLn2 = 0.6931471805599453f;
  const float out_scale = p.dropout ? p.keep_scale : 1.f;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float l = quad_sum(row_sum[r]);
    const float inv = l > 0.f ? out_scale / l : 0.f;
    const int64_t i = r ? i1 : i0;
    if (i >= p.seqlen_q) continue;
    T* orow = og + i * p.os.row;
#pragma unroll
    for (int t = 0; t < D / 8; ++t) {
      const uint32_t v = Elem<T>::pack(o[t][2 * r] * inv, o[t][2 * r + 1] * inv);
      *reinterpret_cast<uint32_t*>(orow + t * 8 + tig * 2) = v;
    }
    if (p.lse && tig == 0)  // padding rows: -inf, sinks or not
      p.lse[b * p.lse_batch + h * p.lse_head + i] = l > 0.f && i < mask.q_len ? row_max[r] * kLn2 + logf(l) : -kInf;
  }
}

// ---------------------------------------------------------------------------
// Backward, step 1: D_i = rowsum(dO * O) per query row (0 on padding rows).
// One warp per row.

template <class T, int D>
__global__ void __launch_bounds__(kThreads) row_dot_kernel(const DeviceParams p) {
  const int lane = threadIdx.x & 31;
  const int64_t row = int64_t{blockIdx.x} * kWarps + (threadIdx.x >> 5);
  const int64_t rows = int64_t{p.batch} * p.heads * p.seqlen_q;
  if (row >= rows) return;
  const int i = static_cast<int>(row % p.seqlen_q);
  const int bh = static_cast<int>(row / p.seqlen_q), b = bh / p.heads, h = bh % p.heads;
  const int64_t q_len = p.q_lengths ? p.q_lengths[b] : p.seqlen_q;
  float acc = 0.f;
  if (i < q_len) {
    const T* o = static_cast<const T*>(p.out) + b * p.os.batch + h * p.os.head + i * p.os.row;
    const T* d = static_cast<const T*>(p.dout) + b * p.dos.batch + h * p.dos.head + i * p.dos.row;
    for (int c = lane; c < D; c += 32) acc += Elem<T>::to_float(o[c]) * Elem<T>::to_float(d[c]);
  }
#pragma unroll
  for (int s = 16; s > 0; s >>= 1) acc += shfl_xor(acc, s);
  if (lane == 0) {
    p.dsum[row] = acc;
    // d(sink) = -sum_i P_sink(i) D_i, P_sink(i) = exp(sink - lse_i).
    if (p.score.sinks.on() && i < q_len) {
      const float lse = p.lse[b * p.lse_batch + h * p.lse_head + i];
      const float sink = static_cast<float>(p.score.sinks.at(b, h));
      atomic_add(p.score.dsinks + bh, static_cast<double>(-expf(sink - lse) * acc));
    }
  }
}

// Backward, step 2: grid (kv blocks, kv heads, batch). Each warp keeps dK and
// dV of its 16 kv positions in registers over every query row of every query
// head of the group that attends them; dQ is added to dq_accum with float32
// atomics.

template <class T, int D>
__global__ void __launch_bounds__(kThreads) backward_kernel(const DeviceParams p) {
  constexpr int BN = kBwdBlockN, BM = kBwdBlockM, LD = padded(D), LDS = padded(BN);
  constexpr float kLog2e = 1.4426950408889634f;
  T* sK = reinterpret_cast<T*>(dynamic_smem());
  T* sV = sK + BN * LD;
  T* sQ = sV + BN * LD;
  T* sdO = sQ + BM * LD;
  T* sdS = sdO + BM * LD;  // dS [BM query rows][BN kv positions]
  float* sLse = reinterpret_cast<float*>(sdS + BM * LDS);
  float* sDsum = sLse + BM;
  float* sFlags = sDsum + BM;

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, tig = lane & 3;
  const int b = blockIdx.z, hk = blockIdx.y;
  const int64_t n0 = int64_t{blockIdx.x} * BN;
  // The entry's mask bounds every head's; each head's (per-row kv lengths) below.
  const EntryMask entry = entry_mask_of(p, b);
  const int64_t kv_end = min64(n0 + BN, entry.kv_len);  // valid positions [n0, kv_end)
  // This thread's two kv positions.
  const int64_t j0 = n0 + warp * 16 + g, j1 = j0 + 8;

  float dk[D / 8][4], dv[D / 8][4];
#pragma unroll
  for (int t = 0; t < D / 8; ++t)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[t][e] = dv[t][e] = 0.f;

  // Rows that may attend some of the block's positions: [i_start, i_end).
  const int64_t i_start = kv_end > n0 ? entry.rows_reaching(n0).lo : 0;
  const int64_t i_end = kv_end > n0 ? entry.rows_reaching(kv_end - 1).hi : 0;
  if (i_start < i_end) {
    const T* kg = static_cast<const T*>(p.k) + b * p.ks.batch + hk * p.ks.head + n0 * p.ks.row;
    const T* vg = static_cast<const T*>(p.v) + b * p.vs.batch + hk * p.vs.head + n0 * p.vs.row;
    load_tile<T, D>(sK, kg, p.ks.row, BN, kv_end - n0);
    load_tile<T, D>(sV, vg, p.vs.row, BN, kv_end - n0);
    cp_async_commit();

    for (int gi = 0; gi < p.group; ++gi) {
      const int h = hk * p.group + gi;
      const uint32_t bh = static_cast<uint32_t>(b * p.heads + h);
      const EntryMask mask = entry_mask_of(p, b, h);
      const ScoreMod<float> mod = score_mod_of<float>(p.score, mask, b, h, p.heads);
      const ScoreMod<float> unmasked = mod.unmasked();  // for steps the mask and segments allow entirely
      const bool classify = mod.mask != nullptr || mod.qseg != nullptr;
      // d(bias) of this head's plane: dS itself (bias adds to the score).
      float* const dbias = p.score.dbias_plane<float>(int64_t{b} * p.heads + h);
      const T* qh = static_cast<const T*>(p.q) + b * p.qs.batch + h * p.qs.head;
      const T* doh = static_cast<const T*>(p.dout) + b * p.dos.batch + h * p.dos.head;
      const float* lseh = p.lse + b * p.lse_batch + h * p.lse_head;
      const int64_t row_base = (int64_t{b} * p.heads + h) * p.seqlen_q;
      float* dqh = p.dq_accum + row_base * D;

      for (int64_t m0 = i_start / BM * BM; m0 < i_end; m0 += BM) {
        block_sync();  // the previous step's reads of sQ, sdO, sdS, sLse (and sFlags) are done
        // The step's class under the bool mask and segments (the forward's):
        // a step they forbid entirely adds nothing to any gradient.
        TileClass cls = TileClass::partial;
        if (classify) {  // uniform: every thread takes part and gets the same class
          cls = fragment_class<BM / 8>(mask, mod, [&](int t, int e, int64_t& i, int64_t& j) {
            i = m0 + t * 8 + tig * 2 + (e & 1), j = e < 2 ? j0 : j1;
          }, sFlags);
          if (cls == TileClass::empty) continue;
        }
        const ScoreMod<float>& active = cls == TileClass::full ? unmasked : mod;
        const int64_t rows = min64(int64_t{BM}, i_end - m0);
        load_tile<T, D>(sQ, qh + m0 * p.qs.row, p.qs.row, BM, rows);
        load_tile<T, D>(sdO, doh + m0 * p.dos.row, p.dos.row, BM, rows);
        cp_async_commit();
        if (threadIdx.x < BM) {
          const int64_t i = m0 + threadIdx.x;
          st_shared(sLse + threadIdx.x, i < mask.q_len ? lseh[i] * kLog2e : 0.f);
          st_shared(sDsum + threadIdx.x, i < mask.q_len ? p.dsum[row_base + i] : 0.f);
        }
        cp_async_wait<0>();
        block_sync();

        // S^T = K Q^T and dP^T = V dO^T: the warp's 16 positions x BM rows.
        float st[BM / 8][4], dpt[BM / 8][4];
#pragma unroll
        for (int t = 0; t < BM / 8; ++t)
#pragma unroll
          for (int e = 0; e < 4; ++e) st[t][e] = dpt[t][e] = 0.f;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
          uint32_t ka[4], va[4];
          load_a(ka, sK, LD, warp * 16, kk * 16, lane);
          load_a(va, sV, LD, warp * 16, kk * 16, lane);
#pragma unroll
          for (int np = 0; np < BM / 16; ++np) {
            uint32_t qf[4], df[4];
            load_b_nmajor(qf, sQ, LD, np * 16, kk * 16, lane);
            load_b_nmajor(df, sdO, LD, np * 16, kk * 16, lane);
            Elem<T>::mma(st[2 * np], ka, qf[0], qf[1]);
            Elem<T>::mma(st[2 * np + 1], ka, qf[2], qf[3]);
            Elem<T>::mma(dpt[2 * np], va, df[0], df[1]);
            Elem<T>::mma(dpt[2 * np + 1], va, df[2], df[3]);
          }
        }

        // P = exp2(x - lse log2e) where allowed, else 0, with x the scaled,
        // capped, biased and ALiBi-shifted score (-inf where the mask forbids); K = 1 where dropout keeps, else 0;
        // Z = K / (1 - p). X = P K (the weights that made O, before the
        // rescale, which dV gets at the end), dP = dPd Z, dS = P (dP - D_i)
        // (d(bias)) times the cap's derivative (ScoreMod::dcapped). st becomes X, dpt dS.
#pragma unroll
        for (int t = 0; t < BM / 8; ++t)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int c = t * 8 + tig * 2 + (e & 1);  // row within the step
            const int64_t i = m0 + c, j = e < 2 ? j0 : j1;
            const bool allowed = mask.allowed(i, j);
            float x = st[t][e] * p.scale_log2, th = 0.f;
            if (active.on() && allowed) x = active.apply(x, i, j, th);
            // lse = -inf: a row the mask (or a -inf bias) left no position has P = 0.
            const float lse2 = ld_shared(sLse + c);
            const float w = allowed && lse2 != -INFINITY ? exp2f(x - lse2) : 0.f;
            float k = 1.f, z = 1.f;
            if (p.dropout && allowed) {
              k = kept(p, dropout_bits(p, bh, static_cast<uint32_t>(i), static_cast<uint32_t>(j)));
              z = k * p.keep_scale;
            }
            st[t][e] = w * k;
            const float ds = w * (dpt[t][e] * z - ld_shared(sDsum + c));
            if (dbias && allowed) atomic_add(dbias + i * mod.bias_row + j * mod.bias_col, ds);
            dpt[t][e] = ds * active.dcapped(th);
          }

        // dV += X^T dO and dK += dS^T Q (scaled at the end): A from the
        // registers above (k = query rows), B k-major from shared memory.
#pragma unroll
        for (int kt = 0; kt < BM / 16; ++kt) {
          uint32_t xa[4], sa[4];
          c_to_a<T>(xa, st[2 * kt], st[2 * kt + 1]);
          c_to_a<T>(sa, dpt[2 * kt], dpt[2 * kt + 1]);
#pragma unroll
          for (int dp = 0; dp < D / 16; ++dp) {
            uint32_t df[4], qf[4];
            load_b_kmajor(df, sdO, LD, kt * 16, dp * 16, lane);
            load_b_kmajor(qf, sQ, LD, kt * 16, dp * 16, lane);
            Elem<T>::mma(dv[2 * dp], xa, df[0], df[1]);
            Elem<T>::mma(dv[2 * dp + 1], xa, df[2], df[3]);
            Elem<T>::mma(dk[2 * dp], sa, qf[0], qf[1]);
            Elem<T>::mma(dk[2 * dp + 1], sa, qf[2], qf[3]);
          }
        }

        // dS to shared memory as [query row][position], for dQ.
#pragma unroll
        for (int t = 0; t < BM / 8; ++t)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int c = t * 8 + tig * 2 + (e & 1);
            st_shared(sdS + c * LDS + warp * 16 + g + (e < 2 ? 0 : 8), Elem<T>::from_float(dpt[t][e]));
          }
        block_sync();

        // dQ += dS K over this block's positions. Warp w: query rows
        // 16 * (w % kRowTiles) + [0, 16), columns of its share of D, 32 at a time.
        constexpr int kRowTiles = BM / 16, kColShares = kWarps / kRowTiles, kCols = D / kColShares;
        static_assert(kCols % 32 == 0, "dq columns in chunks of 32");
        const int rt = warp % kRowTiles, cs = warp / kRowTiles;
        const int64_t qi0 = m0 + rt * 16 + g, qi1 = qi0 + 8;
#pragma unroll
        for (int c0 = cs * kCols; c0 < (cs + 1) * kCols; c0 += 32) {
          float acc[4][4];
#pragma unroll
          for (int t = 0; t < 4; ++t) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.f;
#pragma unroll
          for (int kt = 0; kt < BN / 16; ++kt) {
            uint32_t sa[4];
            load_a(sa, sdS, LDS, rt * 16, kt * 16, lane);
#pragma unroll
            for (int np = 0; np < 2; ++np) {
              uint32_t kf[4];
              load_b_kmajor(kf, sK, LD, kt * 16, c0 + np * 16, lane);
              Elem<T>::mma(acc[2 * np], sa, kf[0], kf[1]);
              Elem<T>::mma(acc[2 * np + 1], sa, kf[2], kf[3]);
            }
          }
#pragma unroll
          for (int t = 0; t < 4; ++t) {
            const int col = c0 + t * 8 + tig * 2;
            if (qi0 < mask.q_len) {
              atomic_add(dqh + qi0 * D + col, acc[t][0]);
              atomic_add(dqh + qi0 * D + col + 1, acc[t][1]);
            }
            if (qi1 < mask.q_len) {
              atomic_add(dqh + qi1 * D + col, acc[t][2]);
              atomic_add(dqh + qi1 * D + col + 1, acc[t][3]);
            }
          }
        }
      }
    }
    cp_async_wait<0>();  // K and V, when the mask or segments left every step out
  }

  // dK (times the scale) and dV (times 1 / (1 - p) under dropout) of the
  // block's positions; 0 past kv_len.
  const float dv_scale = p.dropout ? p.keep_scale : 1.f;
  T* dkg = static_cast<T*>(p.dk) + b * p.dks.batch + hk * p.dks.head;
  T* dvg = static_cast<T*>(p.dv) + b * p.dvs.batch + hk * p.dvs.head;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t j = r ? j1 : j0;
    if (j >= p.seqlen_k) continue;
#pragma unroll
    for (int t = 0; t < D / 8; ++t) {
      const int col = t * 8 + tig * 2;
      *reinterpret_cast<uint32_t*>(dkg + j * p.dks.row + col) =
          Elem<T>::pack(dk[t][2 * r] * p.scale, dk[t][2 * r + 1] * p.scale);
      *reinterpret_cast<uint32_t*>(dvg + j * p.dvs.row + col) = Elem<T>::pack(dv[t][2 * r] * dv_scale, dv[t][2 * r + 1] * dv_scale);
    }
  }
}

// Backward, step 3: dq = scale * dq_accum in the element type.
template <class T, int D>
__global__ void __launch_bounds__(256) convert_dq_kernel(const DeviceParams p) {
  const int64_t n = int64_t{p.batch} * p.heads * p.seqlen_q * D;
  for (int64_t x = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; x < n; x += int64_t{gridDim.x} * blockDim.x) {
    const int c = static_cast<int>(x % D);
    const int64_t row = x / D;
    const int64_t i = row % p.seqlen_q, bh = row / p.seqlen_q, b = bh / p.heads, h = bh % p.heads;
    static_cast<T*>(p.dq)[b * p.dqs.batch + h * p.dqs.head + i * p.dqs.row + c] =
        Elem<T>::from_float(p.dq_accum[x] * p.scale);
  }
}

}  // namespace dimattn::kernels::cuda_flash
