// Products: the register-blocked GEMM micro-kernel, ragged (causal) tiles, and
// the direct scores of few query rows.
// A part of cpu/flash_attention_impl.h, which says what includes it and how.
#ifndef DIMATTN_CPU_FLASH_PARTS
#error "included by cpu/flash_attention_impl.h only"
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
