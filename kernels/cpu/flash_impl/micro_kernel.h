// Products: the register-blocked GEMM micro-kernel and ragged (causal) tiles.
// A part of cpu/flash_attention_impl.h, which says what includes it and how.
#ifndef DIMATTN_CPU_FLASH_PARTS
#error "included by cpu/flash_attention_impl.h only"
#endif

// ---------------------------------------------------------------------------
// GEMM micro-kernel: C[R x NV*W] (+)= sum_k A(r, k) * B[k][0 : NV*W], with R x NV
// accumulator vectors of T held in registers (6 x 2 = 12 of AVX2's 16,
// 12 x 2 = 24 of AVX-512's 32). The operands are of type U: T itself (one
// multiply-add per k), or pairs of bfloat16 (flash_impl/pairs.h: a k step
// is two products, k counts pairs). A is read by scalar broadcasts, so it
// may be row-major (A(r, k) = a[r * lda + k]) or transposed (A(r, k) =
// a[k * lda + r]); B rows are contiguous vectors.

// How the micro-kernel multiplies operands of type U into accumulators of
// type T: here U = T, one fused multiply-add per k.
template <class U>
struct Mac {
  using V = typename Simd<U>::V;  // a row of B, and A's broadcast
  static constexpr int64_t kPack = 1;  // elements of k per operand
  static DIMATTN_INLINE V load(const U* p) { return vload<V>(p); }
  static DIMATTN_INLINE V bcast(U x) { return Simd<U>::splat(x); }
  static DIMATTN_INLINE V mac(V acc, V a, V b) { return vfma(a, b, acc); }
};

// Columns of C (and of B) per micro-kernel block: two vectors.
template <class U>
constexpr int64_t panel_width() {
  return 2 * static_cast<int64_t>(sizeof(vf) / sizeof(U));
}

// What a product does besides its multiply-adds, once per k step: nothing,
// or (LineStream, direct.h) ask for a cache line of other rows towards L2,
// so that memory streams them while the registers compute.
struct NoPrefetch {
  DIMATTN_INLINE void step() {}
};

template <class T, class U, bool kATrans, bool kAccumulate, int R, int NV, class Pf>
DIMATTN_INLINE void micro_kernel(int64_t kdim, const U* __restrict a, int64_t lda, const U* __restrict b,
                                 int64_t ldb, T* __restrict c, int64_t ldc, Pf& pf) {
  using V = typename Simd<T>::V;
  using M = Mac<U>;
  constexpr int W = Simd<T>::W;
  V acc[R][NV];
  DIMATTN_UNROLL for (int r = 0; r < R; ++r) {
    DIMATTN_UNROLL for (int v = 0; v < NV; ++v) acc[r][v] = kAccumulate ? vload<V>(c + r * ldc + v * W) : V{};
  }
  const int64_t ars = kATrans ? 1 : lda, acs = kATrans ? lda : 1;
  for (int64_t kk = 0; kk < kdim; ++kk) {
    const U* bk = b + kk * ldb;
    const U* ak = a + kk * acs;
    pf.step();
    typename M::V bv[NV];
    DIMATTN_UNROLL for (int v = 0; v < NV; ++v) bv[v] = M::load(bk + v * W);
    DIMATTN_UNROLL for (int r = 0; r < R; ++r) {
      const typename M::V ar = M::bcast(ak[r * ars]);
      DIMATTN_UNROLL for (int v = 0; v < NV; ++v) acc[r][v] = M::mac(acc[r][v], ar, bv[v]);
    }
  }
  DIMATTN_UNROLL for (int r = 0; r < R; ++r) {
    DIMATTN_UNROLL for (int v = 0; v < NV; ++v) vstore(c + r * ldc + v * W, acc[r][v]);
  }
}

// The micro-kernel for `rows` rows, 1 <= rows <= R (= kMicroRows).
template <class T, class U, bool kATrans, bool kAccumulate, int NV, int R = kMicroRows, class Pf>
DIMATTN_INLINE void micro_rows(int rows, int64_t kdim, const U* a, int64_t lda, const U* b, int64_t ldb, T* c,
                               int64_t ldc, Pf& pf) {
  if constexpr (R > 1) {
    if (rows < R) return micro_rows<T, U, kATrans, kAccumulate, NV, R - 1>(rows, kdim, a, lda, b, ldb, c, ldc, pf);
  }
  micro_kernel<T, U, kATrans, kAccumulate, R, NV>(kdim, a, lda, b, ldb, c, ldc, pf);
}

// Causal tiles are triangular, and rows with their own kv lengths ragged:
// per row of C, bounds (in any order) that let whole micro-blocks be skipped
// or shortened, so that work follows the valid (row, kv) pairs instead of the
// rectangle. nullptr = the full rectangle. Bounds count elements of k (rows
// or kv positions), whatever U packs.
struct Ragged {
  const int64_t* cols = nullptr;     // row i needs C[i][0 : cols[i]] only (other columns: unspecified)
  const int64_t* k_begin = nullptr;  // A(i, k) = 0 for k < k_begin[i]
  const int64_t* k_end = nullptr;    // A(i, k) = 0 for k >= k_end[i]
  // Row i needs C[i][cols_begin[i] :] only (other columns: unspecified; for
  // products that set C, not those that add to it).
  const int64_t* cols_begin = nullptr;
};

// The B operand: element (k, j) at p[(j / P) * panel + k * ld + j % P] with
// P = panel_width<U>(), the micro-kernel's width. Row-major B is panel = P;
// packed tiles are panel-major (panel = rows * P, ld = P), so that the kdim
// x P panel a micro-kernel streams is contiguous memory, prefetched as one
// sequential stream from whichever cache level holds it.
template <class U>
struct BMat {
  const U* p;
  int64_t ld, panel;
};
template <class U>
BMat<U> row_major(const U* p, int64_t ld) {
  return {p, ld, panel_width<U>()};
}
template <class U>
BMat<U> panel_major(const U* p, int64_t rows) {
  return {p, panel_width<U>(), rows * panel_width<U>()};
}

// C[m x n] (+)= A[m x kdim] B[kdim x n], A row-major (or transposed, see
// micro_kernel) with leading dim lda, C row-major; kdim and lda count
// operands of U (pairs of k for bfloat16 pairs).
// pre: n % W == 0 (callers pad tiles to whole vectors); C rows don't overlap.
template <class T, class U, bool kATrans, bool kAccumulate, class Pf = NoPrefetch>
void gemm(int64_t m, int64_t n, int64_t kdim, const U* a, int64_t lda, const BMat<U>& b, T* c, int64_t ldc,
          const Ragged& rg, Pf&& pf = Pf{}) {
  constexpr int64_t P = panel_width<U>(), K = Mac<U>::kPack;
  static_assert(P == 2 * Simd<T>::W, "a panel is two accumulator vectors wide");
  auto block = [&](auto nv_tag, int64_t i, int64_t j) {
    constexpr int NV = decltype(nv_tag)::value;
    const int64_t rows = std::min<int64_t>(kMicroRows, m - i);
    // The block's rows' widest bounds (nondecreasing ones: its first and last row's).
    auto most = [&](const int64_t* x) { return *std::max_element(x + i, x + i + rows); };
    if (rg.cols && j >= most(rg.cols)) return;
    if (rg.cols_begin && j + NV * Simd<T>::W <= *std::min_element(rg.cols_begin + i, rg.cols_begin + i + rows)) return;
    const int64_t kb = rg.k_begin ? std::min(*std::min_element(rg.k_begin + i, rg.k_begin + i + rows) / K, kdim) : 0;
    const int64_t ke = rg.k_end ? std::min((most(rg.k_end) + K - 1) / K, kdim) : kdim;
    if (kAccumulate && ke <= kb) return;
    const U* ab = kATrans ? a + i + kb * lda : a + i * lda + kb;
    const U* bb = b.p + (j / P) * b.panel + (j % P) + kb * b.ld;
    micro_rows<T, U, kATrans, kAccumulate, NV>(static_cast<int>(rows), std::max<int64_t>(ke - kb, 0), ab, lda, bb,
                                               b.ld, c + i * ldc + j, ldc, pf);
  };
  int64_t j = 0;
  // Column blocks outside, row blocks inside: the kdim x P panel of B stays
  // in L1 while every row block of A streams past it.
  for (; j + P <= n; j += P)
    for (int64_t i = 0; i < m; i += kMicroRows) block(std::integral_constant<int, 2>{}, i, j);
  if (j < n)
    for (int64_t i = 0; i < m; i += kMicroRows) block(std::integral_constant<int, 1>{}, i, j);
}

// C = A B, C += A B, and C += A^T B with A stored [kdim][lda].
template <class T, class U, class Pf = NoPrefetch>
void gemm_set(int64_t m, int64_t n, int64_t kdim, const U* a, int64_t lda, const BMat<U>& b, T* c, int64_t ldc,
              const Ragged& rg = {}, Pf&& pf = Pf{}) {
  gemm<T, U, false, false>(m, n, kdim, a, lda, b, c, ldc, rg, pf);
}
template <class T, class U, class Pf = NoPrefetch>
void gemm_add(int64_t m, int64_t n, int64_t kdim, const U* a, int64_t lda, const BMat<U>& b, T* c, int64_t ldc,
              const Ragged& rg = {}, Pf&& pf = Pf{}) {
  gemm<T, U, false, true>(m, n, kdim, a, lda, b, c, ldc, rg, pf);
}
template <class T, class U>
void gemm_add_at(int64_t m, int64_t n, int64_t kdim, const U* a, int64_t lda, const BMat<U>& b, T* c, int64_t ldc,
                 const Ragged& rg = {}) {
  gemm<T, U, true, true>(m, n, kdim, a, lda, b, c, ldc, rg);
}
