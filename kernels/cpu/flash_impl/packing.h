// Element conversion (storage <-> accumulation type), operand packing
// (row copies, transposed panels) and the scratch arena.
// A part of cpu/flash_attention_impl.h, which says what includes it and how.
#ifndef DIMATTN_CPU_FLASH_PARTS
#error "included by cpu/flash_attention_impl.h only"
#endif

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

// float16 as stored: its bit pattern, in a type of its own so that the
// overloads tell it from bfloat16 (plain uint16_t). The includer's
// half_to_float / float_to_half convert (F16C on AVX2, half_bits.h otherwise).
struct Half {
  uint16_t bits;
};
DIMATTN_INLINE float to_acc(Half h) { return half_to_float(h.bits); }

// W elements of S at p as a vector of A (bfloat16 and float16 widened to float).
template <class A, class S>
DIMATTN_INLINE typename Simd<A>::V load_as(const S* p) {
  using V = typename Simd<A>::V;
  if constexpr (std::is_same_v<S, A>) {
    return vload<V>(p);
  } else if constexpr (std::is_same_v<S, uint16_t>) {  // bfloat16: the upper half of a float
    typedef uint16_t vh __attribute__((vector_size(sizeof(V) / 2)));
    const vi bits = __builtin_convertvector(vload<vh>(p), vi) << 16;
    V r;
    std::memcpy(&r, &bits, sizeof r);
    return r;
  } else {
    static_assert(std::is_same_v<S, Half>, "bfloat16, float16 or the accumulation type");
    return halves_to_vf(&p->bits);
  }
}

DIMATTN_INLINE void from_acc(float x, float* dst) { *dst = x; }
DIMATTN_INLINE void from_acc(float x, Half* dst) { dst->bits = float_to_half(x); }
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

// Where an operand's rows lie: row r at (*this)(r). A tensor's rows are rs
// apart from base; a paged kv cache (AttentionKernelParams::pages) keeps its
// rows in blocks of `block` rows, row j in block table[j / block] at
// base + table[j / block] * block_stride + (j % block) * rs. from(j0) is the
// source whose row 0 is row j0. Packers take 8 rows' addresses at a time, so
// the lookup costs one division per row, not per element.
template <class S>
struct Rows {
  const S* base;
  int64_t rs;
  const int32_t* table = nullptr;  // paged: the entry's block table; nullptr = strided
  int64_t block = 1, block_stride = 0, first = 0;
  int shift = -1;  // log2(block) when block is a power of two (a shift, not a division, per row)

  DIMATTN_INLINE const S* operator()(int64_t r) const {
    if (table == nullptr) return base + r * rs;
    const int64_t j = first + r;
    if (shift >= 0) return base + table[j >> shift] * block_stride + (j & (block - 1)) * rs;
    return base + table[j / block] * block_stride + (j % block) * rs;
  }
  Rows from(int64_t j0) const {
    Rows x = *this;
    if (table == nullptr)
      x.base += j0 * rs;
    else
      x.first += j0;
    return x;
  }
  // Whether rows [0, n) lie rs apart (then (*this)(0) + r * rs is row r).
  bool strided(int64_t n) const { return table == nullptr || n <= 1 || first / block == (first + n - 1) / block; }
  // How many of rows [j, n) lie rs apart from row j on (the rest of its block).
  int64_t run(int64_t j, int64_t n) const {
    return table == nullptr ? n - j : std::min(n - j, block - (first + j) % block);
  }
  // Whether rows [0, n) of `cols` elements lie back to back, one run of memory.
  bool back_to_back(int64_t n, int64_t cols) const { return rs == cols && strided(n); }
};
template <class S>
Rows<S> strided_rows(const S* base, int64_t rs) {
  return Rows<S>{base, rs};
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
DIMATTN_INLINE vf8 load8(const Half* p) {
  vf8 r;
  half8_to_float(&p->bits, reinterpret_cast<float*>(&r));
  return r;
}

// dst[r * ldd + c] = mul * src(r)[c] for c < cols, 0 for cols <= c < ldd.
// float: a vector at a time (bfloat16 and float16 widened by load_as), then
// 8 elements. The row products' 16-bit tiles: a vector at a time against 8
// elements, 0.91-0.92x the time of a multi-query call (Intel Xeon, family 6
// model 207; B = 1, 32k positions, calls alternating in one process).
template <class S, class A>
void pack_rows(const Rows<S>& src, int64_t rows, int64_t cols, A* dst, int64_t ldd, A mul) {
  for (int64_t r = 0; r < rows; ++r) {
    const S* s = src(r);
    A* d = dst + r * ldd;
    int64_t c = 0;
    if constexpr (std::is_same_v<A, float>) {
      for (; c + Simd<A>::W <= cols; c += Simd<A>::W) vstore(d + c, load_as<A>(s + c) * mul);
      for (; c + 8 <= cols; c += 8) vstore(d + c, load8(s + c) * mul);
    }
    for (; c < cols; ++c) d[c] = to_acc(s[c]) * mul;
    for (c = cols; c < ldd; ++c) d[c] = A(0);
  }
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
// src(r)[c] for r < rows, c < cols, and 0 for rows <= r < pad_rows.
// pre: pad_rows % W == 0. float: 8 x 8 blocks through registers.
template <class S, class A>
void pack_transposed(const Rows<S>& src, int64_t rows, int64_t pad_rows, int64_t cols, A* dst) {
  constexpr int64_t P = 2 * Simd<A>::W;
  auto at = [&](int64_t c, int64_t r) -> A& { return dst[(r / P) * cols * P + c * P + r % P]; };
  int64_t r = 0;
  if constexpr (std::is_same_v<A, float>) {
    for (; r + 8 <= rows; r += 8) {
      const S* row[8];
      for (int t = 0; t < 8; ++t) row[t] = src(r + t);
      int64_t c = 0;
      for (; c + 8 <= cols; c += 8) {
        vf8 in[8], out[8];
        for (int t = 0; t < 8; ++t) in[t] = load8(row[t] + c);
        transpose8x8(in, out);
        for (int t = 0; t < 8; ++t) vstore(&at(c + t, r), out[t]);
      }
      for (; c < cols; ++c)
        for (int t = 0; t < 8; ++t) at(c, r + t) = to_acc(row[t][c]);
    }
  }
  for (; r < rows; ++r) {
    const S* row = src(r);
    for (int64_t c = 0; c < cols; ++c) at(c, r) = to_acc(row[c]);
  }
  for (int64_t rr = rows; rr < pad_rows; ++rr)
    for (int64_t c = 0; c < cols; ++c) at(c, rr) = A(0);
}

// dst[c * ldd + r] = src[r * lds + c] for r < rows, c < cols: float in 8 x 8
// blocks through registers where both counts are whole blocks.
template <class A>
void transpose_into(const A* src, int64_t rows, int64_t cols, int64_t lds, A* dst, int64_t ldd) {
  int64_t r0 = 0;
  if constexpr (std::is_same_v<A, float>) {
    for (; r0 + 8 <= rows && cols % 8 == 0; r0 += 8)
      for (int64_t c = 0; c < cols; c += 8) {
        vf8 in[8], out[8];
        for (int t = 0; t < 8; ++t) in[t] = load8(src + (r0 + t) * lds + c);
        transpose8x8(in, out);
        for (int t = 0; t < 8; ++t) vstore(dst + (c + t) * ldd + r0, out[t]);
      }
  }
  for (int64_t r = r0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) dst[c * ldd + r] = src[r * lds + c];
}

// B = src in panel-major form: element (k = r, j = c) is src(r)[c] for
// c < cols, 0 for cols <= c < round_up(cols, W). panel_rows: the rows each
// panel has room for (>= rows).
template <class S, class A>
void pack_rows_panels(const Rows<S>& src, int64_t rows, int64_t cols, int64_t panel_rows, A* dst) {
  constexpr int64_t P = 2 * Simd<A>::W;
  const int64_t cp = round_up(std::max<int64_t>(cols, 1), Simd<A>::W);
  for (int64_t r = 0; r < rows; ++r) {
    const S* row = src(r);
    for (int64_t c0 = 0; c0 < cp; c0 += P) {
      const int64_t w = std::min(P, cp - c0), valid = std::clamp<int64_t>(cols - c0, 0, w);
      const S* s = row + c0;
      A* d = dst + (c0 / P) * panel_rows * P + r * P;
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
