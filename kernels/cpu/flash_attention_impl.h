// The CPU flash attention kernel, written once for every instruction set.
//
// No include guard and no #includes, on purpose: flash_attention.cpp includes
// this file inside namespace dimattn::kernels::cpu_flash_generic, and
// flash_attention_avx2.cpp inside dimattn::kernels::cpu_flash_avx2 under
// `#pragma GCC target("avx2,fma")`. The compiler vectorizes each copy for its
// instruction set, and the copies coexist in one library because their
// namespaces differ (no ODR clash, so no AVX2 code can leak into the baseline
// path). The includer provides, before opening its namespace: <algorithm>,
// <cmath>, <cstdint>, <cstdlib>, <cstring>, <limits>, <memory>, philox.h,
// attention_params.h, thread_pool.h and flash_attention_heuristics.h; and in
// its namespace:
//   vf, vd, vi      GCC vector types: float x 8, double x 4, int32 x 8
//   vfma(a, b, c)   a * b + c for vf and vd (fused where the ISA has FMA)
//   DIMATTN_INLINE  the always-inline function specifier
//
// Layout of a kernel call:
//   forward  tasks (b, h, query block): tiled online softmax over kv tiles.
//   backward tasks (b, kv head, kv chunk): for each query head of the group,
//            for each kv tile, for each query block: recompute P, then dV, dP,
//            dS, dK (task-local accumulators), dQ (task-local, or a per-chunk
//            share summed by a second pass in chunk order).

#ifndef DIMATTN_INLINE
#error "flash_attention_impl.h is included by the kernel's translation units only"
#endif

// ---------------------------------------------------------------------------
// SIMD layer: W lanes of T in one vector.

template <class T>
struct Simd;
template <>
struct Simd<float> {
  using V = vf;
  static constexpr int W = 8;
  static DIMATTN_INLINE V splat(float x) { return V{x, x, x, x, x, x, x, x}; }
};
template <>
struct Simd<double> {
  using V = vd;
  static constexpr int W = 4;
  static DIMATTN_INLINE V splat(double x) { return V{x, x, x, x}; }
};

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
  const vf lo = S::splat(-127.0f), hi = S::splat(127.0f);
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  // x + 128.5 > 0, so truncation is floor: n = floor(x + 1/2), f in [-1/2, 1/2).
  const vi n = __builtin_convertvector(x + 128.5f, vi) - 128;
  const vf f = x - __builtin_convertvector(n, vf);
  vf p = S::splat(1.525273380405984e-05f);
  p = vfma(p, f, S::splat(1.540353039338161e-04f));
  p = vfma(p, f, S::splat(1.333355814642844e-03f));
  p = vfma(p, f, S::splat(9.618129107628477e-03f));
  p = vfma(p, f, S::splat(5.550410866482158e-02f));
  p = vfma(p, f, S::splat(2.402265069591007e-01f));
  p = vfma(p, f, S::splat(6.931471805599453e-01f));
  p = vfma(p, f, S::splat(1.0f));
  const vi e = (n + 127) << 23;  // n = -127 gives the bit pattern of +0
  vf pow2n;
  std::memcpy(&pow2n, &e, sizeof e);
  return p * pow2n;
}

// float64 is the test dtype: exact library exp2 per lane.
DIMATTN_INLINE vd vexp2(vd x) {
  vd r;
  for (int l = 0; l < 4; ++l) r[l] = std::exp2(x[l]);
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

template <class T, bool kATrans, int R, int NV>
DIMATTN_INLINE void micro_kernel(int64_t kdim, const T* __restrict a, int64_t lda, const T* __restrict b,
                                 int64_t ldb, T* __restrict c, int64_t ldc, bool accumulate) {
  using S = Simd<T>;
  using V = typename S::V;
  constexpr int W = S::W;
  V acc[R][NV];
  DIMATTN_UNROLL for (int r = 0; r < R; ++r) {
    DIMATTN_UNROLL for (int v = 0; v < NV; ++v) acc[r][v] = accumulate ? vload<V>(c + r * ldc + v * W) : V{};
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

constexpr int kMicroRows = 6;

template <class T, bool kATrans, int NV>
void micro_rows(int rows, int64_t kdim, const T* a, int64_t lda, const T* b, int64_t ldb, T* c, int64_t ldc,
                bool accumulate) {
  switch (rows) {
    case 6: micro_kernel<T, kATrans, 6, NV>(kdim, a, lda, b, ldb, c, ldc, accumulate); break;
    case 5: micro_kernel<T, kATrans, 5, NV>(kdim, a, lda, b, ldb, c, ldc, accumulate); break;
    case 4: micro_kernel<T, kATrans, 4, NV>(kdim, a, lda, b, ldb, c, ldc, accumulate); break;
    case 3: micro_kernel<T, kATrans, 3, NV>(kdim, a, lda, b, ldb, c, ldc, accumulate); break;
    case 2: micro_kernel<T, kATrans, 2, NV>(kdim, a, lda, b, ldb, c, ldc, accumulate); break;
    default: micro_kernel<T, kATrans, 1, NV>(kdim, a, lda, b, ldb, c, ldc, accumulate); break;
  }
}

// C[m x n] (+)= A[m x kdim] B[kdim x n], A row-major (or transposed, see
// micro_kernel) with leading dim lda, B and C row-major.
// pre: n % W == 0 (callers pad tiles to whole vectors); C rows don't overlap.
template <class T, bool kATrans>
void gemm(int64_t m, int64_t n, int64_t kdim, const T* a, int64_t lda, const T* b, int64_t ldb, T* c, int64_t ldc,
          bool accumulate) {
  constexpr int W = Simd<T>::W;
  int64_t j = 0;
  // Column blocks outside, row blocks inside: the kdim x 2W panel of B stays
  // in L1 while every row block of A streams past it.
  for (; j + 2 * W <= n; j += 2 * W)
    for (int64_t i = 0; i < m; i += kMicroRows)
      micro_rows<T, kATrans, 2>(static_cast<int>(std::min<int64_t>(kMicroRows, m - i)), kdim,
                                kATrans ? a + i : a + i * lda, lda, b + j, ldb, c + i * ldc + j, ldc, accumulate);
  if (j < n)
    for (int64_t i = 0; i < m; i += kMicroRows)
      micro_rows<T, kATrans, 1>(static_cast<int>(std::min<int64_t>(kMicroRows, m - i)), kdim,
                                kATrans ? a + i : a + i * lda, lda, b + j, ldb, c + i * ldc + j, ldc, accumulate);
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
    m = x > m ? x : m;
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

// dst[c * ldd + r] = src[r * srs + c] for r < rows, c < cols; 0 for
// rows <= r < pad_rows. Eight source rows at a time, so each destination row
// gets whole 8-element runs.
template <class S, class A>
void pack_transposed(const S* src, int64_t srs, int64_t rows, int64_t pad_rows, int64_t cols, A* dst, int64_t ldd) {
  int64_t r = 0;
  for (; r + 8 <= rows; r += 8) {
    const S* s[8];
    for (int t = 0; t < 8; ++t) s[t] = src + (r + t) * srs;
    for (int64_t c = 0; c < cols; ++c) {
      A* d = dst + c * ldd + r;
      for (int t = 0; t < 8; ++t) d[t] = to_acc(s[t][c]);
    }
  }
  for (; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) dst[c * ldd + r] = to_acc(src[r * srs + c]);
  for (int64_t c = 0; c < cols; ++c)
    for (int64_t rr = rows; rr < pad_rows; ++rr) dst[c * ldd + rr] = A(0);
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
    for (int64_t c = 0; c < n; c += 4) {
      const Philox4 r = philox4x32_10(Philox4{{static_cast<uint32_t>((j0 + c) >> 2), q, bh, offset}}, seed);
      const int64_t lanes = std::min<int64_t>(4, n - c);
      for (int64_t l = 0; l < lanes; ++l) z[c + l] = (r.v[l] >> 8) >= threshold ? kept : A(0);
    }
  }
  // Broadcast dropout: the same factors for every row.
  void broadcast_factors(int64_t j0, int64_t n, A kept, A* z) const {
    for (int64_t c = 0; c < n; c += 4) {
      const Philox4 r =
          philox4x32_10(Philox4{{static_cast<uint32_t>((j0 + c) >> 2), 0, 0, offset}}, seed ^ kBroadcastSalt);
      const int64_t lanes = std::min<int64_t>(4, n - c);
      for (int64_t l = 0; l < lanes; ++l) z[c + l] = (r.v[l] >> 8) >= threshold ? kept : A(0);
    }
  }
};

template <class T>
void mul_rows(T* s, const T* z, int64_t n) {
  using S = Simd<T>;
  using V = typename S::V;
  for (int64_t j = 0; j < n; j += S::W) vstore(s + j, vload<V>(s + j) * vload<V>(z + j));
}

// ---------------------------------------------------------------------------
// Forward.

template <class S, class A>
struct ForwardScratch {
  int64_t bq, bk, ldk, dvp;
  A *qs, *kt, *vs, *s, *o, *m, *l, *z;
  Arena<A> arena;
  ForwardScratch(const AttentionKernelParams& p, int64_t bq_, int64_t bk_)
      : bq(bq_),
        bk(bk_),
        ldk(round_up(bk_, Simd<A>::W)),
        dvp(round_up(std::max<int64_t>(p.head_dim_v, 1), Simd<A>::W)),
        arena(Arena<A>::need({bq * p.head_dim, p.head_dim * ldk, bk * dvp, bq * ldk, bq * dvp, bq, bq, ldk})) {
    qs = arena.take(bq * p.head_dim);
    kt = arena.take(p.head_dim * ldk);
    vs = arena.take(bk * dvp);
    s = arena.take(bq * ldk);
    o = arena.take(bq * dvp);
    m = arena.take(bq);
    l = arena.take(bq);
    z = arena.take(ldk);
  }
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

  for (int64_t j0 = 0; j0 < kv_end; j0 += w.bk) {
    const int64_t n = std::min(w.bk, kv_end - j0), np = round_up(n, W);
    pack_transposed(k + j0 * krs, krs, n, np, D, w.kt, ldk);
    pack_rows(v + j0 * vrs, vrs, n, Dv, w.vs, dvp, A(1));
    gemm<A, false>(m, np, D, w.qs, D, w.kt, ldk, w.s, ldk, false);

    // Rows attend a prefix of the tile; only tiles crossing a row's limit mask.
    const bool partial = lim.limit(r0) < j0 + n;
    const bool row_dropout = drop.on && !drop.broadcast;
    if (drop.on && drop.broadcast) {
      drop.broadcast_factors(j0, n, A(1), w.z);
      fill(w.z + n, np - n, A(0));
    }
    for (int64_t r = 0; r < m; ++r) {
      A* srow = w.s + r * ldk;
      const int64_t nv = partial ? std::clamp<int64_t>(lim.limit(r0 + r) - j0, 0, n) : n;
      if (nv == 0) {  // nothing to attend here: zero weights, state unchanged
        fill(srow, np, A(0));
        continue;
      }
      fill(srow + nv, np - nv, -kInf);
      const A mnew = std::max(w.m[r], row_max(srow, np));
      const A alpha = std::exp2(w.m[r] - mnew);  // 0 on the row's first tile
      const A sum = exp2_row(srow, np, A(1), mnew);
      w.l[r] = w.l[r] * alpha + sum;
      if (alpha != A(1)) scale_row(w.o + r * dvp, dvp, alpha);
      w.m[r] = mnew;
      // Dropout after the normaliser's sum: kept weights only reach O.
      if (row_dropout) {
        drop.row_factors(bh, static_cast<uint32_t>(r0 + r), j0, nv, A(1), w.z);
        fill(w.z + nv, np - nv, A(0));
        mul_rows(srow, w.z, np);
      } else if (drop.on) {
        mul_rows(srow, w.z, np);
      }
    }
    gemm<A, false>(m, dvp, n, w.s, ldk, w.vs, dvp, w.o, dvp, true);
  }

  for (int64_t r = 0; r < m; ++r) {
    const int64_t i = r0 + r;
    if (!(w.l[r] > A(0))) {
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
  if (share_bytes > 0) chunks = std::min(chunks, std::max<int64_t>(1, cpu_flash::bwd_max_partial_bytes() / share_bytes));
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
  BackwardScratch(const AttentionKernelParams& p, const BackwardPlan& plan)
      : dp(round_up(std::max<int64_t>(p.head_dim, 1), Simd<A>::W)),
        dvp(round_up(std::max<int64_t>(p.head_dim_v, 1), Simd<A>::W)),
        ldk(round_up(plan.bk, Simd<A>::W)),
        arena(Arena<A>::need({p.seqlen_q * dp, p.seqlen_q * dvp, p.seqlen_q, p.seqlen_q,
                              plan.chunks == 1 ? p.seqlen_q * dp : 0, plan.chunk_len * dp, plan.chunk_len * dvp,
                              p.head_dim * ldk, plan.bk * dp, p.head_dim_v * ldk, plan.bq * ldk, plan.bq * ldk,
                              plan.bq * ldk, plan.bq * ldk})) {
    qf = arena.take(p.seqlen_q * dp);
    dof = arena.take(p.seqlen_q * dvp);
    lse2 = arena.take(p.seqlen_q);
    di = arena.take(p.seqlen_q);
    dq = arena.take(plan.chunks == 1 ? p.seqlen_q * dp : 0);
    dkacc = arena.take(plan.chunk_len * dp);
    dvacc = arena.take(plan.chunk_len * dvp);
    kt = arena.take(p.head_dim * ldk);
    kr = arena.take(plan.bk * dp);
    vt = arena.take(p.head_dim_v * ldk);
    s = arena.take(plan.bq * ldk);
    dpt = arena.take(plan.bq * ldk);
    x = arena.take(plan.bq * ldk);
    z = arena.take(plan.bq * ldk);
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
        pack_transposed(k + j0 * krs, krs, n, np, D, w.kt, ldk);
        pack_rows(k + j0 * krs, krs, n, D, w.kr, dp, A(1));
        pack_transposed(v + j0 * vrs, vrs, n, np, Dv, w.vt, ldk);
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
          const bool partial = lim.limit(i0) < j0 + n;

          // P = exp(scale * Q K^T - lse), recomputed.
          gemm<A, false>(mm, np, D, qi, dp, w.kt, ldk, w.s, ldk, false);
          for (int64_t r = 0; r < mm; ++r) {
            A* srow = w.s + r * ldk;
            const int64_t nv = partial ? std::clamp<int64_t>(lim.limit(i0 + r) - j0, 0, n) : n;
            if (nv == 0 || lse2[r] == -kInf) {
              fill(srow, np, A(0));
              continue;
            }
            exp2_row(srow, np, qk_mul, lse2[r]);
            fill(srow + nv, np - nv, A(0));
          }
          // dPd = dO V^T (the gradient of the dropped-out weights).
          gemm<A, false>(mm, np, Dv, doi, dvp, w.vt, ldk, w.dpt, ldk, false);
          // X = P o Z, Z = keep / (1 - p): the weights that produced O.
          const A* x = w.s;
          if (drop.on) {
            for (int64_t r = 0; r < mm; ++r) {
              A* z = drop.broadcast ? w.z : w.z + r * ldk;
              if (!drop.broadcast) {
                drop.row_factors(bh, static_cast<uint32_t>(i0 + r), j0, n, drop.keep_scale, z);
                fill(z + n, np - n, A(0));
              }
              A* xr = w.x + r * ldk;
              std::memcpy(xr, w.s + r * ldk, static_cast<size_t>(np) * sizeof(A));
              mul_rows(xr, z, np);
              mul_rows(w.dpt + r * ldk, z, np);  // dP = dPd o Z
            }
            x = w.x;
          }
          // dV += X^T dO.
          gemm<A, true>(n, dvp, mm, x, ldk, doi, dvp, dv_t, dvp, true);
          // dS = P o (dP - D_i), in place of dP.
          for (int64_t r = 0; r < mm; ++r) {
            using V = typename Simd<A>::V;
            const V dvec = Simd<A>::splat(di[r]);
            const A* prow = w.s + r * ldk;
            A* drow = w.dpt + r * ldk;
            for (int64_t c = 0; c < np; c += W) vstore(drow + c, vload<V>(prow + c) * (vload<V>(drow + c) - dvec));
          }
          // dK += dS^T Q and dQ += dS K (both scaled once at the end).
          gemm<A, true>(n, dp, mm, w.dpt, ldk, qi, dp, dk_t, dp, true);
          gemm<A, false>(mm, dp, n, w.dpt, ldk, w.kr, dp, dq + i0 * dp, dp, true);
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
  }
}

inline void run_backward(const AttentionKernelParams& p, const ParallelFor& pf) {
  switch (p.dtype) {
    case ElementType::float32: backward<float, float>(p, pf); break;
    case ElementType::float64: backward<double, double>(p, pf); break;
    case ElementType::bfloat16: backward<uint16_t, float>(p, pf); break;
  }
}
