// The CPU flash attention kernel, written once for every instruction set.
//
// No include guard and no #includes, on purpose: flash_attention.cpp includes
// this file inside namespace dimattn::kernels::cpu_flash_generic, and
// flash_attention_avx2.cpp inside dimattn::kernels::cpu_flash_avx2 under
// `#pragma GCC target("avx2,fma")`. The compiler vectorizes each copy for its
// instruction set, and the copies coexist in one library because their
// namespaces differ (no ODR clash, so no AVX2 code can leak into the baseline
// path). The includer provides, before opening its namespace: <algorithm>,
// <cmath>, <cstdint>, <cstdlib>, <cstring>, <limits>, <memory>,
// <type_traits>, <vector>, philox.h, attention_params.h, thread_pool.h and
// flash_attention_heuristics.h; and in its namespace:
//   vf, vd, vi      GCC vector types of one width (32 bytes on AVX2, 16
//                   without): float, double and int32 lanes
//   vfma(a, b, c)   a * b + c for vf and vd (fused where the ISA has FMA)
//   vmax, vmin      lane-wise max and min of vf and vd
//   philox_bits(key, k4, c1, c2, c3, groups, out)
//                   out[4 g + l] = lane l of philox4x32_10({k4 + g, c1, c2, c3}, key)
//                   for g < groups (philox.h's generator, several counters at once)
//   kMicroRows      rows of the GEMM micro-kernel (<= 6): 6 x 2 vectors of
//                   accumulators fill AVX2's 16 registers
//   DIMATTN_INLINE  the always-inline function specifier
//
// Layout of a kernel call:
//   forward  tasks (b, h, query block): tiled online softmax over kv tiles;
//            kv tiles are packed (k transposed, float) once per kv head and
//            task range, and read by the products as contiguous panels.
//   backward tasks (b, kv head, kv chunk): for each query head of the group,
//            for each kv tile, for each query block: recompute P, then dV, dP,
//            dS, dK (task-local accumulators), dQ (task-local, or a per-chunk
//            share summed by a second pass in chunk order).
// Every product is one register-blocked micro-kernel (6 rows x 2 vectors:
// 16 float32 columns on AVX2) over packed or row-major operands; causal diagonal tiles
// skip the micro-blocks past the rows' limits.

#ifndef DIMATTN_INLINE
#error "flash_attention_impl.h is included by the kernel's translation units only"
#endif

// ---------------------------------------------------------------------------
// SIMD layer: W lanes of T in one vector.

// splat: x - 0 is x for every x (-0 and NaN included), so this is exactly a
// broadcast, and compilers emit it as one instruction at any width.
template <class T>
struct Simd;
template <>
struct Simd<float> {
  using V = vf;
  static constexpr int W = sizeof(vf) / sizeof(float);
  static DIMATTN_INLINE V splat(float x) { return x - V{}; }
};
template <>
struct Simd<double> {
  using V = vd;
  static constexpr int W = sizeof(vd) / sizeof(double);
  static DIMATTN_INLINE V splat(double x) { return x - V{}; }
};
static_assert(sizeof(vi) == sizeof(vf) && sizeof(vd) == sizeof(vf), "one vector width per instruction set");

template <class V, class T>
DIMATTN_INLINE V vload(const T* p) {
  V r;
  std::memcpy(&r, p, sizeof r);
  return r;
}
template <class V, class T>
DIMATTN_INLINE void vstore(T* p, const V& v) {
  std::memcpy(p, &v, sizeof v);
}

// 2^x for float lanes: 2^round(x) from the exponent bits times a degree-7
// Taylor polynomial of 2^f on |f| <= 1/2 (relative error < 1e-8 before
// rounding, about 1 ulp after). x <= -127 (including -inf, the masked scores)
// gives exactly 0, so masked positions carry no weight.
DIMATTN_INLINE vf vexp2(vf x) {
  using S = Simd<float>;
  // Bound first, x second: max/min return their second operand when either
  // is NaN, so a NaN score stays NaN (and poisons its row) rather than
  // becoming a silent 0.
  x = vmin(S::splat(127.0f), vmax(S::splat(-127.0f), x));
  // Adding 1.5 * 2^23 rounds x to an integer n held in the low mantissa bits
  // of t (exact for |x| < 2^22), so f = x - n is in [-1/2, 1/2] and the bits
  // of 2^n are (bits(t) + 127) << 23 (the constant's own bits shift out).
  const vf magic = S::splat(12582912.0f);
  const vf t = x + magic;
  const vf f = x - (t - magic);
  vf p = S::splat(1.525273380405984e-05f);
  p = vfma(p, f, S::splat(1.540353039338161e-04f));
  p = vfma(p, f, S::splat(1.333355814642844e-03f));
  p = vfma(p, f, S::splat(9.618129107628477e-03f));
  p = vfma(p, f, S::splat(5.550410866482158e-02f));
  p = vfma(p, f, S::splat(2.402265069591007e-01f));
  p = vfma(p, f, S::splat(6.931471805599453e-01f));
  p = vfma(p, f, S::splat(1.0f));
  vi e;
  std::memcpy(&e, &t, sizeof e);
  e = (e + 127) << 23;  // n = -127 gives the bit pattern of +0
  vf pow2n;
  std::memcpy(&pow2n, &e, sizeof e);
  return p * pow2n;
}

// float64 is the test dtype: exact library exp2 per lane.
DIMATTN_INLINE vd vexp2(vd x) {
  vd r;
  for (int l = 0; l < Simd<double>::W; ++l) r[l] = std::exp2(x[l]);
  return r;
}

#if defined(__clang__)
#define DIMATTN_UNROLL _Pragma("unroll")
#else
#define DIMATTN_UNROLL _Pragma("GCC unroll 16")
#endif

// ---------------------------------------------------------------------------
// GEMM micro-kernel: C[R x NV*W] (+)= sum_k A(r, k) * B[k][0 : NV*W], with R x NV
// accumulator vectors held in registers (6 x 2 = 12 of AVX2's 16). A is read
// by scalar broadcasts, so it may be row-major (A(r, k) = a[r * lda + k]) or
// transposed (A(r, k) = a[k * lda + r]); B rows are contiguous vectors.

template <class T, bool kATrans, bool kAccumulate, int R, int NV>
DIMATTN_INLINE void micro_kernel(int64_t kdim, const T* __restrict a, int64_t lda, const T* __restrict b,
                                 int64_t ldb, T* __restrict c, int64_t ldc) {
  using S = Simd<T>;
  using V = typename S::V;
  constexpr int W = S::W;
  V acc[R][NV];
  DIMATTN_UNROLL for (int r = 0; r < R; ++r) {
    DIMATTN_UNROLL for (int v = 0; v < NV; ++v) acc[r][v] = kAccumulate ? vload<V>(c + r * ldc + v * W) : V{};
  }
  const int64_t ars = kATrans ? 1 : lda, acs = kATrans ? lda : 1;
  for (int64_t kk = 0; kk < kdim; ++kk) {
    const T* bk = b + kk * ldb;
    const T* ak = a + kk * acs;
    V bv[NV];
    DIMATTN_UNROLL for (int v = 0; v < NV; ++v) bv[v] = vload<V>(bk + v * W);
    DIMATTN_UNROLL for (int r = 0; r < R; ++r) {
      const V ar = S::splat(ak[r * ars]);
      DIMATTN_UNROLL for (int v = 0; v < NV; ++v) acc[r][v] = vfma(ar, bv[v], acc[r][v]);
    }
  }
  DIMATTN_UNROLL for (int r = 0; r < R; ++r) {
    DIMATTN_UNROLL for (int v = 0; v < NV; ++v) vstore(c + r * ldc + v * W, acc[r][v]);
  }
}


template <class T, bool kATrans, bool kAccumulate, int NV>
void micro_rows(int rows, int64_t kdim, const T* a, int64_t lda, const T* b, int64_t ldb, T* c, int64_t ldc) {
  switch (rows) {
    case 6: micro_kernel<T, kATrans, kAccumulate, 6, NV>(kdim, a, lda, b, ldb, c, ldc); break;
    case 5: micro_kernel<T, kATrans, kAccumulate, 5, NV>(kdim, a, lda, b, ldb, c, ldc); break;
    case 4: micro_kernel<T, kATrans, kAccumulate, 4, NV>(kdim, a, lda, b, ldb, c, ldc); break;
    case 3: micro_kernel<T, kATrans, kAccumulate, 3, NV>(kdim, a, lda, b, ldb, c, ldc); break;
    case 2: micro_kernel<T, kATrans, kAccumulate, 2, NV>(kdim, a, lda, b, ldb, c, ldc); break;
    default: micro_kernel<T, kATrans, kAccumulate, 1, NV>(kdim, a, lda, b, ldb, c, ldc); break;
  }
}

// Causal tiles are triangular: per row of C, nondecreasing bounds that let
// whole micro-blocks be skipped or shortened, so that work follows the valid
// (row, kv) pairs instead of the rectangle. nullptr = the full rectangle.
struct Ragged {
  const int64_t* cols = nullptr;     // row i needs C[i][0 : cols[i]] only (other columns: unspecified)
  const int64_t* k_begin = nullptr;  // A(i, k) = 0 for k < k_begin[i]
  const int64_t* k_end = nullptr;    // A(i, k) = 0 for k >= k_end[i]
};

// The B operand: element (k, j) at p[(j / P) * panel + k * ld + j % P] with
// P = 2W, the micro-kernel's width. Row-major B is panel = P; packed tiles
// are panel-major (panel = rows * P, ld = P), so that the kdim x P panel a
// micro-kernel streams is contiguous memory, prefetched as one sequential
// stream from whichever cache level holds it.
template <class T>
struct BMat {
  const T* p;
  int64_t ld, panel;
};
template <class T>
BMat<T> row_major(const T* p, int64_t ld) {
  return {p, ld, 2 * Simd<T>::W};
}
template <class T>
BMat<T> panel_major(const T* p, int64_t rows) {
  return {p, 2 * Simd<T>::W, rows * 2 * Simd<T>::W};
}

// C[m x n] (+)= A[m x kdim] B[kdim x n], A row-major (or transposed, see
// micro_kernel) with leading dim lda, C row-major.
// pre: n % W == 0 (callers pad tiles to whole vectors); C rows don't overlap.
template <class T, bool kATrans, bool kAccumulate>
void gemm(int64_t m, int64_t n, int64_t kdim, const T* a, int64_t lda, const BMat<T>& b, T* c, int64_t ldc,
          const Ragged& rg) {
  constexpr int W = Simd<T>::W;
  auto block = [&](auto nv_tag, int64_t i, int64_t j) {
    constexpr int NV = decltype(nv_tag)::value;
    const int64_t rows = std::min<int64_t>(kMicroRows, m - i), last = i + rows - 1;
    if (rg.cols && j >= rg.cols[last]) return;
    const int64_t kb = rg.k_begin ? std::min(rg.k_begin[i], kdim) : 0;
    const int64_t ke = rg.k_end ? std::min(rg.k_end[last], kdim) : kdim;
    if (kAccumulate && ke <= kb) return;
    const T* ab = kATrans ? a + i + kb * lda : a + i * lda + kb;
    const T* bb = b.p + (j / (2 * W)) * b.panel + (j % (2 * W)) + kb * b.ld;
    micro_rows<T, kATrans, kAccumulate, NV>(static_cast<int>(rows), std::max<int64_t>(ke - kb, 0), ab, lda, bb, b.ld,
                                            c + i * ldc + j, ldc);
  };
  int64_t j = 0;
  // Column blocks outside, row blocks inside: the kdim x 2W panel of B stays
  // in L1 while every row block of A streams past it.
  for (; j + 2 * W <= n; j += 2 * W)
    for (int64_t i = 0; i < m; i += kMicroRows) block(std::integral_constant<int, 2>{}, i, j);
  if (j < n)
    for (int64_t i = 0; i < m; i += kMicroRows) block(std::integral_constant<int, 1>{}, i, j);
}

// C = A B, C += A B, and C += A^T B with A stored [kdim][lda].
template <class T>
void gemm_set(int64_t m, int64_t n, int64_t kdim, const T* a, int64_t lda, const BMat<T>& b, T* c, int64_t ldc,
              const Ragged& rg = {}) {
  gemm<T, false, false>(m, n, kdim, a, lda, b, c, ldc, rg);
}
template <class T>
void gemm_add(int64_t m, int64_t n, int64_t kdim, const T* a, int64_t lda, const BMat<T>& b, T* c, int64_t ldc,
              const Ragged& rg = {}) {
  gemm<T, false, true>(m, n, kdim, a, lda, b, c, ldc, rg);
}
template <class T>
void gemm_add_at(int64_t m, int64_t n, int64_t kdim, const T* a, int64_t lda, const BMat<T>& b, T* c, int64_t ldc,
                 const Ragged& rg = {}) {
  gemm<T, true, true>(m, n, kdim, a, lda, b, c, ldc, rg);
}

// ---------------------------------------------------------------------------
// Row helpers over n = whole vectors.

template <class T>
T row_max(const T* s, int64_t n) {
  using S = Simd<T>;
  using V = typename S::V;
  V m = S::splat(-std::numeric_limits<T>::infinity());
  for (int64_t j = 0; j < n; j += S::W) {
    const V x = vload<V>(s + j);
    m = vmax(x, m);
  }
  T r = m[0];
  for (int l = 1; l < S::W; ++l) r = std::max(r, static_cast<T>(m[l]));
  return r;
}

// s[j] = 2^(s[j] * mul - sub); returns the sum (fixed order: lanes, then
// vectors left to right).
template <class T>
T exp2_row(T* s, int64_t n, T mul, T sub) {
  using S = Simd<T>;
  using V = typename S::V;
  const V vm = S::splat(mul), vs = S::splat(-sub);
  V acc = V{};
  for (int64_t j = 0; j < n; j += S::W) {
    const V e = vexp2(vfma(vload<V>(s + j), vm, vs));
    vstore(s + j, e);
    acc += e;
  }
  T r = acc[0];
  for (int l = 1; l < S::W; ++l) r += acc[l];
  return r;
}

template <class T>
void scale_row(T* s, int64_t n, T mul) {
  using S = Simd<T>;
  using V = typename S::V;
  const V vm = S::splat(mul);
  for (int64_t j = 0; j < n; j += S::W) vstore(s + j, vload<V>(s + j) * vm);
}

template <class T>
void fill(T* s, int64_t n, T x) {
  for (int64_t j = 0; j < n; ++j) s[j] = x;
}

constexpr int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Asks for part `part` of `parts` of [p, p + bytes) to be brought into L2.
// Spread over a loop that does other work, it overlaps the next kv tile's
// trip from L3 with the current tile's softmax.
inline void prefetch_part(const void* p, int64_t bytes, int64_t part, int64_t parts) {
  const int64_t lines = (bytes + 63) / 64, begin = lines * part / parts, end = lines * (part + 1) / parts;
  for (int64_t l = begin; l < end; ++l) __builtin_prefetch(static_cast<const char*>(p) + l * 64, 0, 2);
}

// ---------------------------------------------------------------------------
// Element conversion: storage type S <-> accumulation type A.

DIMATTN_INLINE float to_acc(float x) { return x; }
DIMATTN_INLINE double to_acc(double x) { return x; }
DIMATTN_INLINE float to_acc(uint16_t bf16) {
  const uint32_t bits = static_cast<uint32_t>(bf16) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

DIMATTN_INLINE void from_acc(float x, float* dst) { *dst = x; }
DIMATTN_INLINE void from_acc(double x, double* dst) { *dst = x; }
// Round to nearest even; NaN stays a (quiet) NaN.
DIMATTN_INLINE void from_acc(float x, uint16_t* dst) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) {
    *dst = static_cast<uint16_t>((bits >> 16) | 0x40u);
    return;
  }
  bits += 0x7fffu + ((bits >> 16) & 1u);
  *dst = static_cast<uint16_t>(bits >> 16);
}

// dst[r * ldd + c] = mul * src[r * srs + c] for c < cols, 0 for cols <= c < ldd.
template <class S, class A>
void pack_rows(const S* src, int64_t srs, int64_t rows, int64_t cols, A* dst, int64_t ldd, A mul) {
  for (int64_t r = 0; r < rows; ++r) {
    const S* s = src + r * srs;
    A* d = dst + r * ldd;
    if (mul == A(1))
      for (int64_t c = 0; c < cols; ++c) d[c] = to_acc(s[c]);
    else
      for (int64_t c = 0; c < cols; ++c) d[c] = to_acc(s[c]) * mul;
    for (int64_t c = cols; c < ldd; ++c) d[c] = A(0);
  }
}

// The transposing packer works on 8 x 8 blocks whatever the ISA's width (a
// 32-byte vector is two registers without AVX, still far faster than
// element-wise transposition).
typedef float vf8 __attribute__((vector_size(32)));
typedef int32_t vi8 __attribute__((vector_size(32)));

// Eight float lanes from eight consecutive source elements.
DIMATTN_INLINE vf8 load8(const float* p) { return vload<vf8>(p); }
DIMATTN_INLINE vf8 load8(const uint16_t* p) {
  typedef uint16_t vh __attribute__((vector_size(16)));
  const vh h = vload<vh>(p);
  const vi8 bits = __builtin_convertvector(h, vi8) << 16;
  vf8 r;
  std::memcpy(&r, &bits, sizeof r);
  return r;
}

// In-register transpose of an 8 x 8 float block (rows in, columns out):
// pairs interleaved, then quads, then 128-bit halves. The shuffle patterns
// are those of unpack{lo,hi}_ps, shuffle_ps and permute2f128 on AVX.
DIMATTN_INLINE void transpose8x8(const vf8 (&in)[8], vf8 (&out)[8]) {
#if defined(__clang__) || __GNUC__ >= 12
#define DIMATTN_SHUF(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define DIMATTN_SHUF(a, b, ...) __builtin_shuffle(a, b, vi8{__VA_ARGS__})
#endif
  const vf8 t0 = DIMATTN_SHUF(in[0], in[1], 0, 8, 1, 9, 4, 12, 5, 13);
  const vf8 t1 = DIMATTN_SHUF(in[0], in[1], 2, 10, 3, 11, 6, 14, 7, 15);
  const vf8 t2 = DIMATTN_SHUF(in[2], in[3], 0, 8, 1, 9, 4, 12, 5, 13);
  const vf8 t3 = DIMATTN_SHUF(in[2], in[3], 2, 10, 3, 11, 6, 14, 7, 15);
  const vf8 t4 = DIMATTN_SHUF(in[4], in[5], 0, 8, 1, 9, 4, 12, 5, 13);
  const vf8 t5 = DIMATTN_SHUF(in[4], in[5], 2, 10, 3, 11, 6, 14, 7, 15);
  const vf8 t6 = DIMATTN_SHUF(in[6], in[7], 0, 8, 1, 9, 4, 12, 5, 13);
  const vf8 t7 = DIMATTN_SHUF(in[6], in[7], 2, 10, 3, 11, 6, 14, 7, 15);
  const vf8 u0 = DIMATTN_SHUF(t0, t2, 0, 1, 8, 9, 4, 5, 12, 13);
  const vf8 u1 = DIMATTN_SHUF(t0, t2, 2, 3, 10, 11, 6, 7, 14, 15);
  const vf8 u2 = DIMATTN_SHUF(t1, t3, 0, 1, 8, 9, 4, 5, 12, 13);
  const vf8 u3 = DIMATTN_SHUF(t1, t3, 2, 3, 10, 11, 6, 7, 14, 15);
  const vf8 u4 = DIMATTN_SHUF(t4, t6, 0, 1, 8, 9, 4, 5, 12, 13);
  const vf8 u5 = DIMATTN_SHUF(t4, t6, 2, 3, 10, 11, 6, 7, 14, 15);
  const vf8 u6 = DIMATTN_SHUF(t5, t7, 0, 1, 8, 9, 4, 5, 12, 13);
  const vf8 u7 = DIMATTN_SHUF(t5, t7, 2, 3, 10, 11, 6, 7, 14, 15);
  out[0] = DIMATTN_SHUF(u0, u4, 0, 1, 2, 3, 8, 9, 10, 11);
  out[1] = DIMATTN_SHUF(u1, u5, 0, 1, 2, 3, 8, 9, 10, 11);
  out[2] = DIMATTN_SHUF(u2, u6, 0, 1, 2, 3, 8, 9, 10, 11);
  out[3] = DIMATTN_SHUF(u3, u7, 0, 1, 2, 3, 8, 9, 10, 11);
  out[4] = DIMATTN_SHUF(u0, u4, 4, 5, 6, 7, 12, 13, 14, 15);
  out[5] = DIMATTN_SHUF(u1, u5, 4, 5, 6, 7, 12, 13, 14, 15);
  out[6] = DIMATTN_SHUF(u2, u6, 4, 5, 6, 7, 12, 13, 14, 15);
  out[7] = DIMATTN_SHUF(u3, u7, 4, 5, 6, 7, 12, 13, 14, 15);
#undef DIMATTN_SHUF
}

// B = src^T in panel-major form (see BMat): element (k = c, j = r) of B is
// src[r * srs + c] for r < rows, c < cols, and 0 for rows <= r < pad_rows.
// pre: pad_rows % W == 0. float: 8 x 8 blocks through registers.
template <class S, class A>
void pack_transposed(const S* src, int64_t srs, int64_t rows, int64_t pad_rows, int64_t cols, A* dst) {
  constexpr int64_t P = 2 * Simd<A>::W;
  auto at = [&](int64_t c, int64_t r) -> A& { return dst[(r / P) * cols * P + c * P + r % P]; };
  int64_t r = 0;
  if constexpr (std::is_same_v<A, float>) {
    for (; r + 8 <= rows; r += 8) {
      int64_t c = 0;
      for (; c + 8 <= cols; c += 8) {
        vf8 in[8], out[8];
        for (int t = 0; t < 8; ++t) in[t] = load8(src + (r + t) * srs + c);
        transpose8x8(in, out);
        for (int t = 0; t < 8; ++t) vstore(&at(c + t, r), out[t]);
      }
      for (; c < cols; ++c)
        for (int t = 0; t < 8; ++t) at(c, r + t) = to_acc(src[(r + t) * srs + c]);
    }
  }
  for (; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) at(c, r) = to_acc(src[r * srs + c]);
  for (int64_t rr = rows; rr < pad_rows; ++rr)
    for (int64_t c = 0; c < cols; ++c) at(c, rr) = A(0);
}

// B = src in panel-major form: element (k = r, j = c) is src[r * srs + c]
// for c < cols, 0 for cols <= c < round_up(cols, W). panel_rows: the rows
// each panel has room for (>= rows).
template <class S, class A>
void pack_rows_panels(const S* src, int64_t srs, int64_t rows, int64_t cols, int64_t panel_rows, A* dst) {
  constexpr int64_t P = 2 * Simd<A>::W;
  const int64_t cp = round_up(std::max<int64_t>(cols, 1), Simd<A>::W);
  for (int64_t c0 = 0; c0 < cp; c0 += P) {
    A* panel = dst + (c0 / P) * panel_rows * P;
    const int64_t w = std::min(P, cp - c0), valid = std::clamp<int64_t>(cols - c0, 0, w);
    for (int64_t r = 0; r < rows; ++r) {
      const S* s = src + r * srs + c0;
      A* d = panel + r * P;
      for (int64_t c = 0; c < valid; ++c) d[c] = to_acc(s[c]);
      for (int64_t c = valid; c < w; ++c) d[c] = A(0);
    }
  }
}

// ---------------------------------------------------------------------------
// Scratch memory: one aligned block per call of a task range.

template <class A>
class Arena {
 public:
  explicit Arena(int64_t elements)
      : size_(round_up(std::max<int64_t>(elements, 1) * static_cast<int64_t>(sizeof(A)), 64)),
        mem_(static_cast<A*>(std::aligned_alloc(64, static_cast<size_t>(size_)))) {
    if (!mem_) throw std::bad_alloc();
  }
  ~Arena() { std::free(mem_); }
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;
  // Carves n elements, 64-byte aligned. pre: the sum of takes fits the size.
  A* take(int64_t n) {
    A* p = mem_ + used_;
    used_ += round_up(n, 64 / static_cast<int64_t>(sizeof(A)));
    return p;
  }
  // Elements needed for a list of takes.
  static int64_t need(std::initializer_list<int64_t> takes) {
    int64_t s = 0;
    for (int64_t n : takes) s += round_up(n, 64 / static_cast<int64_t>(sizeof(A)));
    return s;
  }

 private:
  int64_t size_;
  A* mem_;
  int64_t used_ = 0;
};

// ---------------------------------------------------------------------------
// Masking and dropout of one batch entry.

struct RowLimits {
  int64_t q_len, kv_len, offset;
  bool causal;
  // Row i attends kv positions [0, limit(i)).
  int64_t limit(int64_t i) const {
    int64_t l = kv_len;
    if (causal) l = std::min(l, i + offset + 1);
    return std::max<int64_t>(l, 0);
  }
};

inline RowLimits limits_of(const AttentionKernelParams& p, int64_t b) {
  RowLimits r;
  r.q_len = p.q_lengths ? p.q_lengths[b] : p.seqlen_q;
  r.kv_len = p.kv_lengths ? p.kv_lengths[b] : p.seqlen_k;
  r.causal = p.causal;
  // Clamping keeps i + offset + 1 from overflowing without changing any mask:
  // offset >= seqlen_k allows every position, offset <= -seqlen_q - 1 none.
  const int64_t off = p.causal_offset ? p.causal_offset[b] : 0;
  r.offset = std::clamp<int64_t>(off, -p.seqlen_q - 1, p.seqlen_k);
  return r;
}

template <class A>
struct DropoutSpec {
  bool on = false, broadcast = false;
  uint64_t seed = 0;
  uint32_t offset = 0;
  // Philox's uniform is (bits >> 8) / 2^24, so "uniform >= p" is exactly
  // "(bits >> 8) >= ceil(p * 2^24)" (p * 2^24 is exact in double).
  uint32_t threshold = 0;
  A keep_scale = 1;  // 1 / (1 - p): what a kept weight is multiplied by

  explicit DropoutSpec(const AttentionKernelParams& p) {
    on = p.dropout_p > 0;
    broadcast = p.dropout_broadcast;
    seed = p.seed;
    offset = p.rng_offset;
    threshold = p.dropout_p >= 1 ? (1u << 24) : static_cast<uint32_t>(std::ceil(p.dropout_p * 16777216.0));
    keep_scale = p.dropout_p >= 1 ? A(0) : static_cast<A>(1.0 / (1.0 - p.dropout_p));
  }

  // z[c] = keep(bh, q, j0 + c) ? kept : 0 for c < n. pre: j0 % 4 == 0.
  void row_factors(uint32_t bh, uint32_t q, int64_t j0, int64_t n, A kept, A* z) const {
    factors(seed, q, bh, j0, n, kept, z);
  }
  // Broadcast dropout: the same factors for every row.
  void broadcast_factors(int64_t j0, int64_t n, A kept, A* z) const {
    factors(seed ^ kBroadcastSalt, 0, 0, j0, n, kept, z);
  }

 private:
  // Counters {k / 4, c1, c2, offset} for k in [j0, j0 + n), lane k % 4.
  void factors(uint64_t key, uint32_t c1, uint32_t c2, int64_t j0, int64_t n, A kept, A* z) const {
    constexpr int64_t kChunk = 256;
    alignas(32) uint32_t bits[kChunk];
    for (int64_t c0 = 0; c0 < n; c0 += kChunk) {
      const int64_t len = std::min(kChunk, n - c0);
      philox_bits(key, static_cast<uint32_t>((j0 + c0) >> 2), c1, c2, offset, (len + 3) / 4, bits);
      for (int64_t c = 0; c < len; ++c) z[c0 + c] = (bits[c] >> 8) >= threshold ? kept : A(0);
    }
  }
};

template <class T>
void mul_rows(T* s, const T* z, int64_t n) {
  using S = Simd<T>;
  using V = typename S::V;
  for (int64_t j = 0; j < n; j += S::W) vstore(s + j, vload<V>(s + j) * vload<V>(z + j));
}

// Few query rows (decoding): S[r][c] = qs[r] . k[c] read straight from k's
// rows, vectorized along the head dim, instead of packing k transposed for
// a product too small to pay for the packing. KR kv rows per step keep
// M x KR accumulators in registers.
template <int M, class A>
void scores_direct(int64_t n, int64_t D, const A* qs, const A* k, int64_t krs, A* s, int64_t lds) {
  using V = typename Simd<A>::V;
  constexpr int W = Simd<A>::W, KR = M == 1 ? 8 : 12 / M;
  const int64_t dv = D / W * W;
  auto hsum = [](const V& x) {
    A r = x[0];
    for (int l = 1; l < W; ++l) r += x[l];
    return r;
  };
  int64_t c = 0;
  auto step = [&](auto kr_tag) {
    constexpr int R = decltype(kr_tag)::value;
    V acc[M][R];
    for (int r = 0; r < M; ++r)
      for (int t = 0; t < R; ++t) acc[r][t] = V{};
    for (int64_t d = 0; d < dv; d += W) {
      V kv[R];
      for (int t = 0; t < R; ++t) kv[t] = vload<V>(k + (c + t) * krs + d);
      for (int r = 0; r < M; ++r) {
        const V qv = vload<V>(qs + r * D + d);
        for (int t = 0; t < R; ++t) acc[r][t] = vfma(qv, kv[t], acc[r][t]);
      }
    }
    for (int r = 0; r < M; ++r)
      for (int t = 0; t < R; ++t) {
        A x = hsum(acc[r][t]);
        for (int64_t d = dv; d < D; ++d) x += qs[r * D + d] * k[(c + t) * krs + d];
        s[r * lds + c + t] = x;
      }
  };
  for (; c + KR <= n; c += KR) step(std::integral_constant<int, KR>{});
  for (; c < n; ++c) step(std::integral_constant<int, 1>{});
}

template <class A>
void scores_direct_rows(int64_t m, int64_t n, int64_t D, const A* qs, const A* k, int64_t krs, A* s, int64_t lds) {
  switch (m) {
    case 1: scores_direct<1>(n, D, qs, k, krs, s, lds); break;
    case 2: scores_direct<2>(n, D, qs, k, krs, s, lds); break;
    case 3: scores_direct<3>(n, D, qs, k, krs, s, lds); break;
    default: scores_direct<4>(n, D, qs, k, krs, s, lds); break;
  }
}

// ---------------------------------------------------------------------------
// Forward.

template <class S, class A>
struct ForwardScratch {
  int64_t bq, bk, ldk, dvp, D;
  int64_t vslot;  // elements per packed v tile: panels of 2W columns
  // Packed kv tiles (k transposed, v rows, as float/double). A task range
  // usually holds several query blocks of one kv head (and the GQA heads
  // sharing it), so the slots keep every tile of the current (b, kv head)
  // when that fits the budget, and each tile is packed once per range
  // instead of once per query block. Otherwise one slot is repacked.
  int64_t slots;
  int64_t key_b = -1, key_hk = -1;  // whose tiles the slots hold
  int64_t packed = 0;               // many slots: tiles [0, packed) are ready
  int64_t single = -1;              // one slot: the tile it holds
  A *qs, *kt, *vs, *s, *o, *m, *l, *z;
  Arena<A> arena;
  std::vector<int64_t> nv;  // per row: valid positions of the current tile

  static int64_t slots_for(const AttentionKernelParams& p, int64_t bq, int64_t bk, int64_t ldk, int64_t dvp) {
    // A kv head's tiles are read again only by its next query block or by
    // another query head of its group; without either, one slot that stays
    // in L1/L2 beats a buffer that spills to L3.
    if (p.seqlen_q <= bq && p.group_size() == 1) return 1;
    const int64_t tiles = std::max<int64_t>(1, (p.seqlen_k + bk - 1) / bk);
    const int64_t bytes =
        tiles * (p.head_dim * ldk + bk * round_up(dvp, 2 * Simd<A>::W)) * static_cast<int64_t>(sizeof(A));
    return bytes <= cpu_flash::fwd_kv_cache_bytes() ? tiles : 1;
  }
  ForwardScratch(const AttentionKernelParams& p, int64_t bq_, int64_t bk_)
      : bq(bq_),
        bk(bk_),
        ldk(round_up(bk_, Simd<A>::W)),
        dvp(round_up(std::max<int64_t>(p.head_dim_v, 1), Simd<A>::W)),
        D(p.head_dim),
        vslot(bk * round_up(dvp, 2 * Simd<A>::W)),
        slots(slots_for(p, bq, bk, ldk, dvp)),
        arena(Arena<A>::need({bq * p.head_dim, slots * p.head_dim * ldk, slots * vslot, bq * ldk, bq * dvp, bq, bq,
                              ldk})) {
    qs = arena.take(bq * p.head_dim);
    kt = arena.take(slots * p.head_dim * ldk);
    vs = arena.take(slots * vslot);
    s = arena.take(bq * ldk);
    o = arena.take(bq * dvp);
    m = arena.take(bq);
    l = arena.take(bq);
    z = arena.take(ldk);
    nv.resize(static_cast<size_t>(bq));
  }

  // Makes kv tile t of (b, hk) available and returns its slot. A tile holds
  // positions [t * bk, min((t + 1) * bk, kv_len)), zero-padded to whole
  // vectors, whatever prefix of it the asking block uses.
  int64_t tile(const S* k, int64_t krs, const S* v, int64_t vrs, int64_t Dv, int64_t kv_len, int64_t b, int64_t hk,
               int64_t t) {
    if (key_b != b || key_hk != hk) {
      key_b = b, key_hk = hk, packed = 0, single = -1;
    }
    auto pack = [&](int64_t tt, int64_t slot) {
      const int64_t j0 = tt * bk, n = std::min(bk, kv_len - j0);
      pack_transposed(k + j0 * krs, krs, n, round_up(n, Simd<A>::W), D, kt + slot * D * ldk);
      pack_rows_panels(v + j0 * vrs, vrs, n, Dv, bk, vs + slot * vslot);
    };
    if (slots > 1) {
      for (; packed <= t; ++packed) pack(packed, packed);
      return t;
    }
    if (single != t) pack(t, 0), single = t;
    return 0;
  }
  // Tile t of the current kv head if it is packed already, else -1.
  int64_t ready(int64_t t) const { return slots > 1 && t < packed ? t : -1; }
};

// Rows [r0, r1) of (b, h).
template <class S, class A>
void forward_block(const AttentionKernelParams& p, const DropoutSpec<A>& drop, int64_t b, int64_t h, int64_t r0,
                   int64_t r1, ForwardScratch<S, A>& w) {
  constexpr int W = Simd<A>::W;
  constexpr A kInf = std::numeric_limits<A>::infinity();
  const int64_t D = p.head_dim, Dv = p.head_dim_v, dvp = w.dvp, ldk = w.ldk;
  const RowLimits lim = limits_of(p, b);
  const int64_t hk = h / p.group_size();
  const S* q = static_cast<const S*>(p.q) + b * p.q_strides.batch + h * p.q_strides.head;
  const S* k = static_cast<const S*>(p.k) + b * p.k_strides.batch + hk * p.k_strides.head;
  const S* v = static_cast<const S*>(p.v) + b * p.v_strides.batch + hk * p.v_strides.head;
  S* out = static_cast<S*>(p.out) + b * p.out_strides.batch + h * p.out_strides.head;
  A* lse = p.lse ? static_cast<A*>(p.lse) + b * p.lse_batch_stride + h * p.lse_head_stride : nullptr;
  const int64_t qrs = p.q_strides.row, krs = p.k_strides.row, vrs = p.v_strides.row, ors = p.out_strides.row;

  auto write_empty_row = [&](int64_t i) {
    for (int64_t c = 0; c < Dv; ++c) from_acc(A(0), out + i * ors + c);
    if (lse) lse[i] = -kInf;
  };
  const int64_t rv = std::min(r1, lim.q_len);  // valid rows [r0, rv)
  for (int64_t i = std::max(r0, rv); i < r1; ++i) write_empty_row(i);
  if (r0 >= rv) return;
  const int64_t m = rv - r0;
  const int64_t kv_end = lim.limit(rv - 1);  // the block's last row attends the most

  // Scores in log2 units: exp(scale * q.k) = 2^(q' . k) with q' = q * scale * log2(e).
  const A qmul = static_cast<A>(p.scale * 1.4426950408889634);
  pack_rows(q + r0 * qrs, qrs, m, D, w.qs, D, qmul);
  fill(w.m, m, -kInf);
  fill(w.l, m, A(0));
  fill(w.o, m * dvp, A(0));
  const uint32_t bh = static_cast<uint32_t>(b * p.heads + h);

  // Few rows of float32 (decoding): read k and v rows in place, no packing.
  // v's rows are the product's B operand as they are, so their padded width
  // must stay inside each row: Dv a multiple of the vector width.
  const bool direct = std::is_same_v<S, A> && m <= 4 && Dv % W == 0;

  for (int64_t j0 = 0; j0 < kv_end; j0 += w.bk) {
    const int64_t n = std::min(w.bk, kv_end - j0), np = round_up(n, W);
    // Rows attend a prefix of the tile; only tiles crossing a row's limit
    // (causal diagonal) mask, and there the products skip the blocks past
    // every row's prefix.
    const bool partial = lim.limit(r0) < j0 + n;
    const int64_t* nvs = nullptr;
    if (partial) {
      for (int64_t r = 0; r < m; ++r) w.nv[r] = std::clamp<int64_t>(lim.limit(r0 + r) - j0, 0, n);
      nvs = w.nv.data();
    }
    BMat<A> vmat;
    if constexpr (std::is_same_v<S, A>) {
      if (direct) {
        scores_direct_rows(m, n, D, w.qs, k + j0 * krs, krs, w.s, ldk);
        vmat = row_major(v + j0 * vrs, vrs);
      }
    }
    if (!direct) {
      const int64_t slot = w.tile(k, krs, v, vrs, Dv, lim.kv_len, b, hk, j0 / w.bk);
      gemm_set(m, np, D, w.qs, D, panel_major(w.kt + slot * D * ldk, D), w.s, ldk, Ragged{nvs, nullptr, nullptr});
      vmat = panel_major(w.vs + slot * w.vslot, w.bk);
    }

    const bool row_dropout = drop.on && !drop.broadcast;
    if (drop.on && drop.broadcast) {
      drop.broadcast_factors(j0, n, A(1), w.z);
      fill(w.z + n, np - n, A(0));
    }
    const int64_t next = !direct && j0 + w.bk < kv_end ? w.ready(j0 / w.bk + 1) : -1;
    for (int64_t r = 0; r < m; ++r) {
      if (next >= 0) {
        prefetch_part(w.kt + next * D * ldk, D * ldk * static_cast<int64_t>(sizeof(A)), r, m);
        prefetch_part(w.vs + next * w.vslot, w.vslot * static_cast<int64_t>(sizeof(A)), r, m);
      }
      A* srow = w.s + r * ldk;
      const int64_t nv = partial ? nvs[r] : n;
      if (nv == 0) {  // nothing to attend here: zero weights, state unchanged
        fill(srow, np, A(0));
        continue;
      }
      const int64_t npr = round_up(nv, W);
      fill(srow + nv, npr - nv, -kInf);
      const A mnew = std::max(w.m[r], row_max(srow, npr));
      const A alpha = std::exp2(w.m[r] - mnew);  // 0 on the row's first tile
      const A sum = exp2_row(srow, npr, A(1), mnew);
      fill(srow + npr, np - npr, A(0));  // read by P V up to the row block's longest prefix
      w.l[r] = w.l[r] * alpha + sum;
      if (alpha != A(1)) scale_row(w.o + r * dvp, dvp, alpha);
      w.m[r] = mnew;
      // Dropout after the normaliser's sum: kept weights only reach O.
      if (row_dropout) {
        drop.row_factors(bh, static_cast<uint32_t>(r0 + r), j0, nv, A(1), w.z);
        fill(w.z + nv, npr - nv, A(0));
        mul_rows(srow, w.z, npr);
      } else if (drop.on) {
        mul_rows(srow, w.z, npr);
      }
    }
    gemm_add(m, dvp, n, w.s, ldk, vmat, w.o, dvp, Ragged{nullptr, nullptr, nvs});
  }

  for (int64_t r = 0; r < m; ++r) {
    const int64_t i = r0 + r;
    if (w.l[r] == A(0)) {  // attended nothing (a NaN sum falls through: NaN in, NaN out)
      write_empty_row(i);
      continue;
    }
    const A inv = drop.keep_scale / w.l[r];
    const A* o = w.o + r * dvp;
    for (int64_t c = 0; c < Dv; ++c) from_acc(o[c] * inv, out + i * ors + c);
    if (lse) lse[i] = (w.m[r] + std::log2(w.l[r])) * static_cast<A>(0.6931471805599453);
  }
}

template <class S, class A>
void forward(const AttentionKernelParams& p, const ParallelFor& parallel_for) {
  const int64_t bq = cpu_flash::fwd_block_q(p.head_dim), bk = cpu_flash::fwd_block_k(p.head_dim);
  const int64_t nqb = (p.seqlen_q + bq - 1) / bq;
  const int64_t tasks = p.batch * p.heads * nqb;
  if (tasks == 0) return;
  const DropoutSpec<A> drop(p);
  parallel_for(0, tasks, [&](int64_t t0, int64_t t1) {
    ForwardScratch<S, A> w(p, bq, bk);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t bh = t / nqb, qi = t % nqb;
      // Causal blocks cost more the later they are: alternate cheap and
      // expensive ones so that any contiguous split of the tasks is balanced.
      const int64_t blk = p.causal ? (qi % 2 == 0 ? qi / 2 : nqb - 1 - qi / 2) : qi;
      const int64_t r0 = blk * bq;
      forward_block<S, A>(p, drop, bh / p.heads, bh % p.heads, r0, std::min(r0 + bq, p.seqlen_q), w);
    }
  });
}

// ---------------------------------------------------------------------------
// Backward.

struct BackwardPlan {
  int64_t bq, bk;
  int64_t chunks;     // kv chunks per (b, kv head)
  int64_t chunk_len;  // kv positions per chunk (a multiple of bk)
};

template <class A>
BackwardPlan plan_backward(const AttentionKernelParams& p) {
  BackwardPlan plan;
  plan.bq = cpu_flash::bwd_block_q(p.head_dim);
  plan.bk = cpu_flash::bwd_block_k(p.head_dim);
  const int64_t tiles = std::max<int64_t>(1, (p.seqlen_k + plan.bk - 1) / plan.bk);
  const int64_t groups = std::max<int64_t>(1, p.batch * p.kv_heads);
  int64_t chunks = (cpu_flash::bwd_min_tasks() + groups - 1) / groups;
  chunks = std::min(chunks, std::max<int64_t>(1, tiles / cpu_flash::bwd_min_tiles_per_chunk()));
  const int64_t share_bytes = p.batch * p.heads * p.seqlen_q *
                              round_up(std::max<int64_t>(p.head_dim, 1), Simd<A>::W) *
                              static_cast<int64_t>(sizeof(A));
  if (share_bytes > 0)
    chunks = std::min(chunks, std::max<int64_t>(1, cpu_flash::bwd_max_partial_bytes() / share_bytes));
  const int64_t tiles_per_chunk = (tiles + chunks - 1) / chunks;
  plan.chunks = (tiles + tiles_per_chunk - 1) / tiles_per_chunk;
  plan.chunk_len = tiles_per_chunk * plan.bk;
  return plan;
}

template <class S, class A>
struct BackwardScratch {
  int64_t dp, dvp, ldk;
  A *qf, *dof, *lse2, *di, *dq, *dkacc, *dvacc, *kt, *kr, *vt, *s, *dpt, *x, *z;
  Arena<A> arena;
  std::vector<int64_t> nv, kbeg;  // causal tile bounds, see backward_task
  BackwardScratch(const AttentionKernelParams& p, const BackwardPlan& plan)
      : dp(round_up(std::max<int64_t>(p.head_dim, 1), Simd<A>::W)),
        dvp(round_up(std::max<int64_t>(p.head_dim_v, 1), Simd<A>::W)),
        ldk(round_up(plan.bk, Simd<A>::W)),
        arena(Arena<A>::need({p.seqlen_q * dp, p.seqlen_q * dvp, p.seqlen_q, p.seqlen_q,
                              plan.chunks == 1 ? p.seqlen_q * dp : 0, plan.chunk_len * dp, plan.chunk_len * dvp,
                              p.head_dim * ldk, plan.bk * round_up(dp, 2 * Simd<A>::W), p.head_dim_v * ldk,
                              plan.bq * ldk, plan.bq * ldk, plan.bq * ldk, plan.bq * ldk})) {
    qf = arena.take(p.seqlen_q * dp);
    dof = arena.take(p.seqlen_q * dvp);
    lse2 = arena.take(p.seqlen_q);
    di = arena.take(p.seqlen_q);
    dq = arena.take(plan.chunks == 1 ? p.seqlen_q * dp : 0);
    dkacc = arena.take(plan.chunk_len * dp);
    dvacc = arena.take(plan.chunk_len * dvp);
    kt = arena.take(p.head_dim * ldk);
    kr = arena.take(plan.bk * round_up(dp, 2 * Simd<A>::W));
    vt = arena.take(p.head_dim_v * ldk);
    s = arena.take(plan.bq * ldk);
    dpt = arena.take(plan.bq * ldk);
    x = arena.take(plan.bq * ldk);
    z = arena.take(plan.bq * ldk);
    nv.resize(static_cast<size_t>(plan.bq));
    kbeg.resize(static_cast<size_t>(plan.bk));
  }
};

// One (b, kv head, kv chunk). share: this chunk's dQ share ([G][Tq][dp],
// unscaled), or nullptr when the chunk is the whole kv range and dq is
// written directly.
template <class S, class A>
void backward_task(const AttentionKernelParams& p, const DropoutSpec<A>& drop, const BackwardPlan& plan, int64_t b,
                   int64_t hk, int64_t chunk, A* share, BackwardScratch<S, A>& w) {
  constexpr int W = Simd<A>::W;
  constexpr A kInf = std::numeric_limits<A>::infinity();
  const int64_t D = p.head_dim, Dv = p.head_dim_v, Tq = p.seqlen_q, G = p.group_size();
  const int64_t dp = w.dp, dvp = w.dvp, ldk = w.ldk;
  const RowLimits lim = limits_of(p, b);
  const int64_t kc0 = chunk * plan.chunk_len, kc1 = std::min(kc0 + plan.chunk_len, p.seqlen_k);
  const int64_t kend = std::min(kc1, lim.kv_len);  // valid positions [kc0, kend)
  const A qk_mul = static_cast<A>(p.scale * 1.4426950408889634);
  const A log2e = static_cast<A>(1.4426950408889634);
  const A scale = static_cast<A>(p.scale);

  const S* k = static_cast<const S*>(p.k) + b * p.k_strides.batch + hk * p.k_strides.head;
  const S* v = static_cast<const S*>(p.v) + b * p.v_strides.batch + hk * p.v_strides.head;
  const int64_t krs = p.k_strides.row, vrs = p.v_strides.row;
  if (kend > kc0) {
    fill(w.dkacc, (kend - kc0) * dp, A(0));
    fill(w.dvacc, (kend - kc0) * dvp, A(0));
  }

  for (int64_t g = 0; g < G; ++g) {
    const int64_t h = hk * G + g;
    const uint32_t bh = static_cast<uint32_t>(b * p.heads + h);
    // Rows that attend some position of the chunk: i + offset + 1 > kc0.
    const int64_t i_start = p.causal ? std::clamp<int64_t>(kc0 - lim.offset, 0, lim.q_len) : 0;
    const bool any = kend > kc0 && i_start < lim.q_len;
    A* dq = share ? share + g * Tq * dp : w.dq;  // indexed by absolute row
    if (share) fill(share + g * Tq * dp, Tq * dp, A(0));

    if (any) {
      const S* q = static_cast<const S*>(p.q) + b * p.q_strides.batch + h * p.q_strides.head;
      const S* o = static_cast<const S*>(p.out) + b * p.out_strides.batch + h * p.out_strides.head;
      const S* dout = static_cast<const S*>(p.dout) + b * p.dout_strides.batch + h * p.dout_strides.head;
      const A* lse = static_cast<const A*>(p.lse) + b * p.lse_batch_stride + h * p.lse_head_stride;
      const int64_t rows = lim.q_len - i_start;
      // Row-local copies, indexed by i - i_start.
      pack_rows(q + i_start * p.q_strides.row, p.q_strides.row, rows, D, w.qf, dp, A(1));
      pack_rows(dout + i_start * p.dout_strides.row, p.dout_strides.row, rows, Dv, w.dof, dvp, A(1));
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t i = i_start + r;
        w.lse2[r] = lse[i] * log2e;
        // D_i = rowsum(dO o O) = sum_j P_ij dP_ij (dropout included: O holds it).
        const S* orow = o + i * p.out_strides.row;
        const A* dorow = w.dof + r * dvp;
        A acc = 0;
        for (int64_t c = 0; c < Dv; ++c) acc += dorow[c] * to_acc(orow[c]);
        w.di[r] = acc;
      }
      if (!share) fill(dq + i_start * dp, rows * dp, A(0));

      for (int64_t j0 = kc0; j0 < kend; j0 += plan.bk) {
        const int64_t n = std::min(plan.bk, kend - j0), np = round_up(n, W);
        pack_transposed(k + j0 * krs, krs, n, np, D, w.kt);
        pack_rows_panels(k + j0 * krs, krs, n, D, plan.bk, w.kr);
        pack_transposed(v + j0 * vrs, vrs, n, np, Dv, w.vt);
        A* dk_t = w.dkacc + (j0 - kc0) * dp;
        A* dv_t = w.dvacc + (j0 - kc0) * dvp;
        if (drop.on && drop.broadcast) {
          drop.broadcast_factors(j0, n, drop.keep_scale, w.z);
          fill(w.z + n, np - n, A(0));
        }
        const int64_t it0 = p.causal ? std::max(i_start, j0 - lim.offset) : i_start;
        for (int64_t i0 = it0; i0 < lim.q_len; i0 += plan.bq) {
          const int64_t mm = std::min(plan.bq, lim.q_len - i0);
          const A* qi = w.qf + (i0 - i_start) * dp;
          const A* doi = w.dof + (i0 - i_start) * dvp;
          const A* lse2 = w.lse2 + (i0 - i_start);
          const A* di = w.di + (i0 - i_start);
          // Causal diagonal tiles: row r attends the tile's first nv[r]
          // positions, kv position c is attended from local row kbeg[c] on.
          const bool partial = lim.limit(i0) < j0 + n;
          const int64_t *nvs = nullptr, *kbeg = nullptr;
          if (partial) {
            for (int64_t r = 0; r < mm; ++r) w.nv[r] = std::clamp<int64_t>(lim.limit(i0 + r) - j0, 0, n);
            for (int64_t c = 0; c < n; ++c) w.kbeg[c] = std::clamp<int64_t>(j0 + c - lim.offset - i0, 0, mm);
            nvs = w.nv.data();
            kbeg = w.kbeg.data();
          }

          // P = exp(scale * Q K^T - lse), recomputed; 0 past each row's prefix.
          gemm_set(mm, np, D, qi, dp, panel_major(w.kt, D), w.s, ldk, Ragged{nvs, nullptr, nullptr});
          // The next q block's rows of Q, dO and dQ come from L3 for long
          // sequences: ask for them while this block computes.
          const int64_t next_rows = std::min(plan.bq, lim.q_len - (i0 + plan.bq));
          for (int64_t r = 0; r < mm; ++r) {
            if (next_rows > 0) {
              const int64_t nb = i0 + plan.bq - i_start;
              prefetch_part(w.qf + nb * dp, next_rows * dp * static_cast<int64_t>(sizeof(A)), r, mm);
              prefetch_part(w.dof + nb * dvp, next_rows * dvp * static_cast<int64_t>(sizeof(A)), r, mm);
              prefetch_part(dq + (i0 + plan.bq) * dp, next_rows * dp * static_cast<int64_t>(sizeof(A)), r, mm);
            }
            A* srow = w.s + r * ldk;
            const int64_t nv = partial ? nvs[r] : n;
            if (nv == 0 || lse2[r] == -kInf) {
              fill(srow, np, A(0));
              continue;
            }
            exp2_row(srow, round_up(nv, W), qk_mul, lse2[r]);
            fill(srow + nv, np - nv, A(0));
          }
          // dPd = dO V^T (the gradient of the dropped-out weights); defined
          // up to each row's prefix rounded to whole vectors.
          gemm_set(mm, np, Dv, doi, dvp, panel_major(w.vt, Dv), w.dpt, ldk, Ragged{nvs, nullptr, nullptr});
          // X = P o Z with Z = keep / (1 - p): the weights that produced O;
          // dP = dPd o Z; dS = P o (dP - D_i) in place of dP. Zero past the
          // prefix, where the transposed products below still read.
          const A* x = w.s;
          for (int64_t r = 0; r < mm; ++r) {
            using V = typename Simd<A>::V;
            const int64_t nv = partial ? nvs[r] : n, npr = round_up(nv, W);
            const A* prow = w.s + r * ldk;
            A* drow = w.dpt + r * ldk;
            if (drop.on) {
              A* z = drop.broadcast ? w.z : w.z + r * ldk;
              if (!drop.broadcast) {
                drop.row_factors(bh, static_cast<uint32_t>(i0 + r), j0, nv, drop.keep_scale, z);
                fill(z + nv, npr - nv, A(0));
              }
              A* xr = w.x + r * ldk;
              for (int64_t c = 0; c < npr; c += W) {
                const V zc = vload<V>(z + c);
                vstore(xr + c, vload<V>(prow + c) * zc);
                vstore(drow + c, vload<V>(drow + c) * zc);
              }
              fill(xr + npr, np - npr, A(0));
            }
            const V dvec = Simd<A>::splat(di[r]);
            for (int64_t c = 0; c < npr; c += W) vstore(drow + c, vload<V>(prow + c) * (vload<V>(drow + c) - dvec));
            fill(drow + npr, np - npr, A(0));
          }
          if (drop.on) x = w.x;
          // dV += X^T dO, dK += dS^T Q and dQ += dS K (dK, dQ scaled at the end).
          gemm_add_at(n, dvp, mm, x, ldk, row_major(doi, dvp), dv_t, dvp, Ragged{nullptr, kbeg, nullptr});
          gemm_add_at(n, dp, mm, w.dpt, ldk, row_major(qi, dp), dk_t, dp, Ragged{nullptr, kbeg, nullptr});
          gemm_add(mm, dp, n, w.dpt, ldk, panel_major(w.kr, plan.bk), dq + i0 * dp, dp, Ragged{nullptr, nullptr, nvs});
        }
      }
    }

    if (!share) {
      S* dqo = static_cast<S*>(p.dq) + b * p.dq_strides.batch + h * p.dq_strides.head;
      for (int64_t i = 0; i < Tq; ++i) {
        S* row = dqo + i * p.dq_strides.row;
        if (any && i >= i_start && i < lim.q_len) {
          const A* src = dq + i * dp;
          for (int64_t c = 0; c < D; ++c) from_acc(src[c] * scale, row + c);
        } else {
          for (int64_t c = 0; c < D; ++c) from_acc(A(0), row + c);
        }
      }
    }
  }

  S* dko = static_cast<S*>(p.dk) + b * p.dk_strides.batch + hk * p.dk_strides.head;
  S* dvo = static_cast<S*>(p.dv) + b * p.dv_strides.batch + hk * p.dv_strides.head;
  for (int64_t j = kc0; j < kc1; ++j) {
    S* dkr = dko + j * p.dk_strides.row;
    S* dvr = dvo + j * p.dv_strides.row;
    if (j < kend) {
      const A* sk = w.dkacc + (j - kc0) * dp;
      const A* sv = w.dvacc + (j - kc0) * dvp;
      for (int64_t c = 0; c < D; ++c) from_acc(sk[c] * scale, dkr + c);
      for (int64_t c = 0; c < Dv; ++c) from_acc(sv[c], dvr + c);
    } else {
      for (int64_t c = 0; c < D; ++c) from_acc(A(0), dkr + c);
      for (int64_t c = 0; c < Dv; ++c) from_acc(A(0), dvr + c);
    }
  }
}

template <class S, class A>
void backward(const AttentionKernelParams& p, const ParallelFor& parallel_for) {
  const BackwardPlan plan = plan_backward<A>(p);
  const DropoutSpec<A> drop(p);
  const int64_t G = p.group_size(), Tq = p.seqlen_q, D = p.head_dim;
  const int64_t dp = round_up(std::max<int64_t>(D, 1), Simd<A>::W);
  const int64_t groups = p.batch * p.kv_heads;
  if (groups == 0) return;
  if (p.seqlen_k == 0) {
    // No kv positions: dq is all zeros, dk and dv are empty.
    parallel_for(0, p.batch * p.heads, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        S* dq = static_cast<S*>(p.dq) + (t / p.heads) * p.dq_strides.batch + (t % p.heads) * p.dq_strides.head;
        for (int64_t i = 0; i < Tq; ++i)
          for (int64_t c = 0; c < D; ++c) from_acc(A(0), dq + i * p.dq_strides.row + c);
      }
    });
    return;
  }
  const int64_t C = plan.chunks;
  // dQ shares: [groups][C][G][Tq][dp], summed in chunk order by the second pass.
  std::unique_ptr<A[]> shares;
  const int64_t share_len = G * Tq * dp;
  if (C > 1) shares.reset(new A[static_cast<size_t>(groups * C * share_len)]);

  parallel_for(0, groups * C, [&](int64_t t0, int64_t t1) {
    BackwardScratch<S, A> w(p, plan);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t grp = t / C, ci = t % C;
      // Under causal masking early kv chunks have more query rows: alternate.
      const int64_t chunk = p.causal ? (ci % 2 == 0 ? ci / 2 : C - 1 - ci / 2) : ci;
      A* share = C > 1 ? shares.get() + (grp * C + chunk) * share_len : nullptr;
      backward_task<S, A>(p, drop, plan, grp / p.kv_heads, grp % p.kv_heads, chunk, share, w);
    }
  });
  if (C == 1) return;

  const A scale = static_cast<A>(p.scale);
  parallel_for(0, p.batch * p.heads, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / p.heads, h = t % p.heads, hk = h / G, g = h % G;
      const A* base = shares.get() + (b * p.kv_heads + hk) * C * share_len + g * Tq * dp;
      S* dq = static_cast<S*>(p.dq) + b * p.dq_strides.batch + h * p.dq_strides.head;
      for (int64_t i = 0; i < Tq; ++i) {
        S* row = dq + i * p.dq_strides.row;
        for (int64_t c = 0; c < D; ++c) {
          A acc = 0;
          for (int64_t ch = 0; ch < C; ++ch) acc += base[ch * share_len + i * dp + c];
          from_acc(acc * scale, row + c);
        }
      }
    }
  });
}

// ---------------------------------------------------------------------------
// Entry points of this instruction set. pre: p validated.

inline void run_forward(const AttentionKernelParams& p, const ParallelFor& pf) {
  switch (p.dtype) {
    case ElementType::float32: forward<float, float>(p, pf); break;
    case ElementType::float64: forward<double, double>(p, pf); break;
    case ElementType::bfloat16: forward<uint16_t, float>(p, pf); break;
    case ElementType::float16: break;  // rejected by validate() (CUDA only)
  }
}

inline void run_backward(const AttentionKernelParams& p, const ParallelFor& pf) {
  switch (p.dtype) {
    case ElementType::float32: backward<float, float>(p, pf); break;
    case ElementType::float64: backward<double, double>(p, pf); break;
    case ElementType::bfloat16: backward<uint16_t, float>(p, pf); break;
    case ElementType::float16: break;  // rejected by validate() (CUDA only)
  }
}
