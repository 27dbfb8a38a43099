// SIMD layer and row helpers: vector types of W lanes, exp2, row max/sum/scale.
// A part of cpu/flash_attention_impl.h, which says what includes it and how.
#ifndef DIMATTN_CPU_FLASH_PARTS
#error "included by cpu/flash_attention_impl.h only"
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

// The lanes of a vector reduced by op in halving steps (log2 W dependent
// operations instead of a chain of W - 1), in registers: the sum or max of a
// row's lanes.
#if defined(__clang__) || __GNUC__ >= 12
template <class V, size_t... I>
DIMATTN_INLINE auto pick_lanes(const V& x, std::index_sequence<I...>) {
  return __builtin_shufflevector(x, x, I...);
}
template <size_t Off, size_t... I>
constexpr auto offset_lanes(std::index_sequence<I...>) {
  return std::index_sequence<(I + Off)...>{};
}
template <class V, class Op>
DIMATTN_INLINE auto reduce_lanes(const V& x, Op op) {
  constexpr size_t W = sizeof(V) / sizeof(x[0]);
  if constexpr (W == 2) {
    return op(x[0], x[1]);
  } else {
    const auto lo = pick_lanes(x, std::make_index_sequence<W / 2>{});
    const auto hi = pick_lanes(x, offset_lanes<W / 2>(std::make_index_sequence<W / 2>{}));
    return reduce_lanes(op(lo, hi), op);
  }
}
#else
template <class V, class Op>
DIMATTN_INLINE auto reduce_lanes(const V& x, Op op) {
  auto r = x[0];
  for (size_t l = 1; l < sizeof(V) / sizeof(x[0]); ++l) r = op(r, x[l]);
  return r;
}
#endif
template <class V>
DIMATTN_INLINE auto hsum(const V& x) {
  return reduce_lanes(x, [](auto a, auto b) { return a + b; });
}
// NaN lanes may or may not win (callers look for NaN themselves).
template <class V>
DIMATTN_INLINE auto hmax(const V& x) {
  return reduce_lanes(x, [](auto a, auto b) { return a > b ? a : b; });
}

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

// 2^x for float lanes: 2^round(x) from the exponent bits times a polynomial
// of 2^f on |f| <= 1/2 (Chebyshev interpolation, float32 coefficients, p(0)
// = 1 exactly, so 2^0 = 1). kCoarse = false: degree 6, relative error 2e-8
// (9e-8, under 1 ulp, evaluated in float32 with FMA). kCoarse = true: degree
// 4, relative error 3.5e-6, for weights that are rounded to bfloat16 (u =
// 2^-8) before they are used (flash_impl/pairs.h; docs/numerics.md).
// x <= -127 (including -inf, the masked scores) gives exactly 0, so masked
// positions carry no weight.
// vexp2's parts: x clamped to [-127, 127] (NaN kept) = n + f with n an
// integer and |f| <= 1/2, pow2n = 2^n, and q with 2^f ~ 1 + f q(f).
struct Exp2Parts {
  vf f, q, pow2n;
};
template <bool kCoarse>
DIMATTN_INLINE Exp2Parts exp2_parts(vf x) {
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
  Exp2Parts r;
  r.f = x - (t - magic);
  const vf f = r.f;
  vf p;
  if constexpr (kCoarse) {
    p = S::splat(9.66636836528778e-03f);
    p = vfma(p, f, S::splat(5.5921975523233414e-02f));
    p = vfma(p, f, S::splat(2.402234971523285e-01f));
    p = vfma(p, f, S::splat(6.931210160255432e-01f));
  } else {
    p = S::splat(1.5461444724808513e-04f);
    p = vfma(p, f, S::splat(1.3400428177711937e-03f));
    p = vfma(p, f, S::splat(9.618056678432040e-03f));
    p = vfma(p, f, S::splat(5.550327226669895e-02f));
    p = vfma(p, f, S::splat(2.4022650922289554e-01f));
    p = vfma(p, f, S::splat(6.931472067028329e-01f));
  }
  r.q = p;
  vi e;
  std::memcpy(&e, &t, sizeof e);
  e = (e + 127) << 23;  // n = -127 gives the bit pattern of +0
  std::memcpy(&r.pow2n, &e, sizeof e);
  return r;
}

// 2^x for float lanes: 2^round(x) from the exponent bits times a polynomial
// of 2^f on |f| <= 1/2 (Chebyshev interpolation, float32 coefficients, p(0)
// = 1 exactly, so 2^0 = 1). kCoarse = false: degree 6, relative error 2e-8
// (9e-8, under 1 ulp, evaluated in float32 with FMA). kCoarse = true: degree
// 4, relative error 3.5e-6, for weights that are rounded to bfloat16 (u =
// 2^-8) before they are used (flash_impl/pairs.h; docs/numerics.md).
// x <= -127 (including -inf, the masked scores) gives exactly 0, so masked
// positions carry no weight.
template <bool kCoarse = false>
DIMATTN_INLINE vf vexp2(vf x) {
  const Exp2Parts e = exp2_parts<kCoarse>(x);
  return vfma(e.q, e.f, Simd<float>::splat(1.0f)) * e.pow2n;
}

// 2^x - 1 for float lanes, as accurate near x = 0 as elsewhere: vexp2's
// 2^n (1 + f q) - 1 taken as fma(f q, 2^n, 2^n - 1), so that nothing cancels
// where n = 0 (2^n - 1 is exact; docs/numerics.md bounds the error).
DIMATTN_INLINE vf vexp2m1(vf x) {
  const Exp2Parts e = exp2_parts<false>(x);
  return vfma(e.q * e.f, e.pow2n, e.pow2n - Simd<float>::splat(1.0f));
}

// tanh for float lanes, its argument given as z = 2 y log2(e) (callers fold
// that factor into their own scale): tanh(y) = m / (m + 2) with m = 2^z - 1
// (vexp2m1). Relative error 2.6e-7 (4.3 units of 2^-24; with the caller's
// rounding of z under 5e-7; docs/numerics.md);
// z = +-inf give +-1 (the clamp at 2^+-127), NaN stays NaN.
DIMATTN_INLINE vf vtanh2(vf z) {
  const vf m = vexp2m1(z);
  return m / (m + Simd<float>::splat(2.0f));
}

// float64 is the test dtype: exact library exp2 per lane.
template <bool kCoarse = false>
DIMATTN_INLINE vd vexp2(vd x) {
  vd r;
  for (int l = 0; l < Simd<double>::W; ++l) r[l] = std::exp2(x[l]);
  return r;
}
DIMATTN_INLINE vd vtanh2(vd z) {
  vd r;
  for (int l = 0; l < Simd<double>::W; ++l) r[l] = std::tanh(z[l] * 0.34657359027997264);  // ln(2) / 2
  return r;
}

#if defined(__clang__)
#define DIMATTN_UNROLL _Pragma("unroll")
#else
#define DIMATTN_UNROLL _Pragma("GCC unroll 16")
#endif

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
  return hmax(m);
}

// s[j] = 2^(s[j] * mul - sub) (vexp2<kCoarse>); returns the sum (fixed order:
// vectors left to right, then the lanes by halving).
template <bool kCoarse = false, class T>
T exp2_row(T* s, int64_t n, T mul, T sub) {
  using S = Simd<T>;
  using V = typename S::V;
  const V vm = S::splat(mul), vs = S::splat(-sub);
  V acc = V{};
  for (int64_t j = 0; j < n; j += S::W) {
    const V e = vexp2<kCoarse>(vfma(vload<V>(s + j), vm, vs));
    vstore(s + j, e);
    acc += e;
  }
  return hsum(acc);
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

template <class T>
void mul_rows(T* s, const T* z, int64_t n) {
  using S = Simd<T>;
  using V = typename S::V;
  for (int64_t j = 0; j < n; j += S::W) vstore(s + j, vload<V>(s + j) * vload<V>(z + j));
}
