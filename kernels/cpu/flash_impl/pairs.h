// bfloat16 products as pairs (the avx512_bf16 path): vdpbf16ps multiplies
// the two bfloat16 of each 32-bit lane of A and B exactly and adds both
// products to a float32 accumulator, so that one instruction does two
// multiply-adds per lane. Every product of the passes has a k dimension
// (head dim, kv positions, or query rows); its operands are packed with
// consecutive k in the two halves of a 32-bit word (Bf16Pair), and gemm's
// kdim counts pairs. q, k, v and dO are bfloat16 already, so S = Q K^T and
// dP = dO V^T are exact products summed in float32; the weights P (for
// P V and P^T dO) and dS (for dS K and dS^T Q) are rounded to bfloat16 first,
// as FlashAttention does on GPUs (its error bound: docs/numerics.md).
//
// The includer provides (flash_attention_x86.h with DIMATTN_X86_PAIRS):
//   dot_pairs(acc, a, b)   acc + per lane a.lo * b.lo + a.hi * b.hi (vdpbf16ps)
//   round_pairs(lo, hi)    the 32 floats lo[0..W), hi[0..W) rounded to bfloat16
//                          (nearest even) in that order: lane l holds elements 2l, 2l + 1
//   interleave_pairs(a, b) lane l holds (bfloat16(a[l]), bfloat16(b[l]))
//   zip_words(a, b, lo, hi), unzip_sums(lo, hi, first, second)
//                          the words of a and b as pairs, in vpunpck{l,h}wd's
//                          order, and sums in that order back in word order
// A part of cpu/flash_attention_impl.h, which says what includes it and how.
#ifndef DIMATTN_CPU_FLASH_PARTS
#error "included by cpu/flash_attention_impl.h only"
#endif

// Two bfloat16: the element of the lower k in the low half.
struct Bf16Pair {
  uint32_t bits;
};

template <>
struct Mac<Bf16Pair> {
  using V = vi;
  static constexpr int64_t kPack = 2;
  static DIMATTN_INLINE V load(const Bf16Pair* p) { return vload<vi>(p); }
  static DIMATTN_INLINE V bcast(Bf16Pair x) { return static_cast<int32_t>(x.bits) - vi{}; }
  static DIMATTN_INLINE vf mac(vf acc, vi a, vi b) { return dot_pairs(acc, a, b); }
};

constexpr int64_t kPairPanel = panel_width<Bf16Pair>();
static_assert(kPairPanel == 2 * Simd<float>::W, "a pair panel is as wide as a float one");

// W bfloat16 in one half-width vector.
typedef uint16_t vbf __attribute__((vector_size(sizeof(vi) / 2)));

DIMATTN_INLINE const Bf16Pair* as_pairs(const uint16_t* p) { return reinterpret_cast<const Bf16Pair*>(p); }

// ---------------------------------------------------------------------------
// Packing bfloat16 operands.

// dst[r * ldd + c] = src(r)[c] for c < cols, 0 for cols <= c < ldd:
// rows of pairs along the row (A operands: q, dO). pre: ldd even, >= cols.
inline void pack_bf16_rows(const Rows<uint16_t>& src, int64_t rows, int64_t cols, uint16_t* dst, int64_t ldd) {
  for (int64_t r = 0; r < rows; ++r) {
    std::memcpy(dst + r * ldd, src(r), static_cast<size_t>(cols) * 2);
    std::memset(dst + r * ldd + cols, 0, static_cast<size_t>(ldd - cols) * 2);
  }
}

// B = src^T as pairs: element (pair t, j) of B is (src(j)[2t], src(j)[2t + 1])
// (0 past cols), for j < rows, 0 for rows <= j < pad_rows, in panel-major
// form (BMat) with round_up(cols, 2) / 2 pairs per panel row. The 32-bit
// words of 8 rows go through transpose8x8 as they are (bit-exact shuffles).
// pre: pad_rows % W == 0.
inline void pack_pairs_transposed(const Rows<uint16_t>& src, int64_t rows, int64_t pad_rows, int64_t cols,
                                  Bf16Pair* dst) {
  constexpr int64_t P = kPairPanel;
  const int64_t kp = (cols + 1) / 2, full = cols / 2;  // pairs, and pairs with both halves in the row
  auto at = [&](int64_t t, int64_t j) -> Bf16Pair& { return dst[(j / P) * kp * P + t * P + j % P]; };
  auto word = [&](const uint16_t* row, int64_t t) {
    Bf16Pair w;
    if (2 * t + 1 < cols) {
      std::memcpy(&w.bits, row + 2 * t, 4);
    } else {
      w.bits = row[2 * t];  // an odd last element: its partner is 0
    }
    return w;
  };
  int64_t j = 0;
  for (; j + 8 <= rows; j += 8) {
    const uint16_t* row[8];
    for (int r = 0; r < 8; ++r) row[r] = src(j + r);
    int64_t t = 0;
    for (; t + 8 <= full; t += 8) {
      vf8 in[8], out[8];
      for (int r = 0; r < 8; ++r) in[r] = vload<vf8>(row[r] + 2 * t);
      transpose8x8(in, out);
      for (int r = 0; r < 8; ++r) vstore(&at(t + r, j), out[r]);
    }
    for (; t < kp; ++t)
      for (int r = 0; r < 8; ++r) at(t, j + r) = word(row[r], t);
  }
  for (; j < rows; ++j)
    for (int64_t t = 0; t < kp; ++t) at(t, j) = word(src(j), t);
  for (; j < pad_rows; ++j)
    for (int64_t t = 0; t < kp; ++t) at(t, j) = Bf16Pair{0};
}

// B as pairs of rows: element (pair t, c) is (src(2t)[c], src(2t + 1)[c]),
// the second 0 past `rows`, 0 for cols <= c < round_up(cols, W), laid out
// as `b` says (panel-major, or row-major: BMat's ld and panel). Used for the
// operands whose k is the row: v (P V), k (dS K), dO (X^T dO), q (dS^T Q).
inline void pack_pairs_rows(const Rows<uint16_t>& src, int64_t rows, int64_t cols, Bf16Pair* dst, int64_t ld,
                            int64_t panel) {
  constexpr int64_t P = kPairPanel, W = Simd<float>::W;
  const int64_t cp = round_up(std::max<int64_t>(cols, 1), W);
  for (int64_t t = 0; t < (rows + 1) / 2; ++t) {
    const uint16_t* r0 = src(2 * t);
    const uint16_t* r1 = 2 * t + 1 < rows ? src(2 * t + 1) : nullptr;
    for (int64_t c0 = 0; c0 < cp; c0 += W) {
      Bf16Pair* d = dst + (c0 / P) * panel + t * ld + c0 % P;
      if (c0 + W <= cols) {
        const vi lo = __builtin_convertvector(vload<vbf>(r0 + c0), vi);
        const vi hi = r1 ? __builtin_convertvector(vload<vbf>(r1 + c0), vi) << 16 : vi{};
        vstore(d, lo | hi);
      } else {
        for (int64_t c = 0; c < W; ++c) {
          const uint32_t lo = c0 + c < cols ? r0[c0 + c] : 0, hi = r1 && c0 + c < cols ? r1[c0 + c] : 0;
          d[c].bits = lo | hi << 16;
        }
      }
    }
  }
}

// float rows -> bfloat16 rows: dst[r * ldd + c] = bf16(src[r * lds + c]) for
// c < n. pre: n % W == 0.
inline void round_rows(const float* src, int64_t lds, int64_t rows, int64_t n, uint16_t* dst, int64_t ldd) {
  constexpr int64_t W = Simd<float>::W;
  using V = Simd<float>::V;
  for (int64_t r = 0; r < rows; ++r) {
    const float* s = src + r * lds;
    uint16_t* d = dst + r * ldd;
    int64_t c = 0;
    for (; c + 2 * W <= n; c += 2 * W) vstore(d + c, round_pairs(vload<V>(s + c), vload<V>(s + c + W)));
    if (c < n) {  // one vector left: its pairs, the upper half's zeros not stored
      const vi x = round_pairs(vload<V>(s + c), V{});
      std::memcpy(d + c, &x, W * 2);
    }
  }
}

// float rows -> pairs of rows: dst[t * ldd + c] = (bf16(src[2t][c]),
// bf16(src[2t + 1][c])), the second 0 past `rows`, for c < n (a transposed
// A operand of k = rows). pre: n % W == 0.
inline void interleave_rows(const float* src, int64_t lds, int64_t rows, int64_t n, Bf16Pair* dst, int64_t ldd) {
  constexpr int64_t W = Simd<float>::W;
  using V = Simd<float>::V;
  for (int64_t t = 0; t < (rows + 1) / 2; ++t) {
    const float* s0 = src + 2 * t * lds;
    const bool two = 2 * t + 1 < rows;
    for (int64_t c = 0; c < n; c += W)
      vstore(dst + t * ldd + c, interleave_pairs(vload<V>(s0 + c), two ? vload<V>(s0 + lds + c) : V{}));
  }
}

// ---------------------------------------------------------------------------
// The direct products (direct.h) on pairs, for few query rows: each kv row
// read once, in place, with half the multiply instructions of converting it
// to float and one FMA per element.

// direct_scores' products: q and k rows as they are, two elements per 32-bit
// lane, through vdpbf16ps: exact products summed in float32.
struct PairDot {
  using Q = uint16_t;
  static constexpr int64_t kStep = 2 * Simd<float>::W;
  static DIMATTN_INLINE vi q(const uint16_t* p) { return vload<vi>(p); }
  static DIMATTN_INLINE vi k(const uint16_t* p) { return vload<vi>(p); }
  static DIMATTN_INLINE vf mac(vf acc, vi q, vi k) { return dot_pairs(acc, q, k); }
};

// 2W words of a v row from column e (W of them, the rest 0, where half).
DIMATTN_INLINE vi load_words(const uint16_t* p, bool half) {
  vi x{};
  if (half)
    std::memcpy(&x, p, sizeof x / 2);
  else
    std::memcpy(&x, p, sizeof x);
  return x;
}

// o[r][0 : Dv) += sum_c w[r][c] v(c) for rows r < M and positions c in
// [c0, c1), w in bfloat16 (rows ldw apart, zero outside each row's
// positions). Positions go in pairs: the v rows c and c + 1 zipped
// (zip_words) against the pair (w[r][c], w[r][c + 1]), an odd last one with
// a zero partner; CP column blocks of 2W per pass, each summed in zip_words'
// order in two accumulators and put back in order on the way out.
// pre: Dv % W == 0.
template <int M, int CP>
void direct_pair_pv(int64_t c0, int64_t c1, int64_t Dv, const uint16_t* w, int64_t ldw, const Rows<uint16_t>& v,
                    float* o, int64_t ldo, const RowsAhead<uint16_t>& ahead) {
  constexpr int64_t W = Simd<float>::W;
  const int64_t bytes = Dv * 2;
  for (int64_t e0 = 0; e0 < Dv; e0 += CP * 2 * W) {
    const int cp = static_cast<int>(std::min<int64_t>(CP, (Dv - e0 + 2 * W - 1) / (2 * W)));
    const bool half = e0 + cp * 2 * W > Dv;  // the last block holds W columns
    vf lo[M][CP], hi[M][CP];
    for (int r = 0; r < M; ++r)
      for (int u = 0; u < CP; ++u) lo[r][u] = hi[r][u] = vf{};
    auto add = [&](const uint16_t* v0, const uint16_t* v1, const uint32_t* wp) {
      vi zl[CP], zh[CP];
      for (int u = 0; u < cp; ++u) {
        const bool h = half && u == cp - 1;
        zip_words(load_words(v0 + u * 2 * W, h), v1 ? load_words(v1 + u * 2 * W, h) : vi{}, zl[u], zh[u]);
      }
      for (int r = 0; r < M; ++r) {
        const vi wr = static_cast<int32_t>(wp[r]) - vi{};
        for (int u = 0; u < cp; ++u) {
          lo[r][u] = dot_pairs(lo[r][u], zl[u], wr);
          hi[r][u] = dot_pairs(hi[r][u], zh[u], wr);
        }
      }
    };
    int64_t c = c0;
    for (; c + 1 < c1; c += 2) {
      if (e0 == 0) {
        for (int64_t t = c; t < c + 2; ++t) {
          if (t + kPrefetchRows < c1) prefetch_row(v(t + kPrefetchRows), bytes);
          ahead.fetch(t);
        }
      }
      uint32_t wp[M];
      for (int r = 0; r < M; ++r) std::memcpy(&wp[r], w + r * ldw + c, 4);
      add(v(c) + e0, v(c + 1) + e0, wp);
    }
    if (c < c1) {  // an odd last position
      if (e0 == 0) ahead.fetch(c);
      uint32_t wp[M];
      for (int r = 0; r < M; ++r) wp[r] = w[r * ldw + c];
      add(v(c) + e0, nullptr, wp);
    }
    for (int r = 0; r < M; ++r)
      for (int u = 0; u < cp; ++u) {
        float* orow = o + r * ldo + e0 + u * 2 * W;
        vf first, second;
        unzip_sums(lo[r][u], hi[r][u], first, second);
        vstore(orow, vload<vf>(orow) + first);
        if (!(half && u == cp - 1)) vstore(orow + W, vload<vf>(orow + W) + second);
      }
  }
}

// o += w v for m <= decode_direct_rows() rows, row r's weights nonzero in
// [lbs[r], nvs[r]) only (nullptr: [0, n)), as direct_pv_rows.
inline void direct_pair_pv_rows(int64_t m, int64_t n, int64_t Dv, const uint16_t* w, int64_t ldw,
                                const Rows<uint16_t>& v, float* o, int64_t ldo, const int64_t* lbs, const int64_t* nvs,
                                const RowsAhead<uint16_t>& ahead) {
  // Accumulators: 16 of AVX-512's 32 registers, two per block of 2W columns.
  pv_row_groups(m, n, lbs, nvs, ahead, [&](int64_t r, int64_t rows, int64_t c0, int64_t c1,
                                           const RowsAhead<uint16_t>& a) {
    const uint16_t* wr = w + r * ldw;
    float* orow = o + r * ldo;
    switch (rows) {
      case 1: direct_pair_pv<1, 8>(c0, c1, Dv, wr, ldw, v, orow, ldo, a); break;
      case 2: direct_pair_pv<2, 4>(c0, c1, Dv, wr, ldw, v, orow, ldo, a); break;
      case 3: direct_pair_pv<3, 2>(c0, c1, Dv, wr, ldw, v, orow, ldo, a); break;
      default: direct_pair_pv<4, 2>(c0, c1, Dv, wr, ldw, v, orow, ldo, a); break;
    }
  });
}

// ---------------------------------------------------------------------------
// The forward pass's operands as pairs (see ForwardOperands, products.h):
// q rows as they are (the log2 scale goes on the float scores), k transposed
// pairs, v pairs of rows, and the weights rounded to bfloat16 for P V.

template <>
struct ForwardOperands<uint16_t, float> {
  static constexpr bool kRoundedWeights = true;
  using VMat = BMat<Bf16Pair>;
  int64_t D, bk, ldk, ldq;  // ldq: bfloat16 per q row (D made even)
  int64_t kslot, vslot;     // floats (= pairs) per packed k and v tile
  float qmul = 1;
  uint16_t* q;
  Bf16Pair *kt, *vs;
  uint16_t* pw;  // the weights of a block in bfloat16, [bq][ldk]

  static constexpr bool kRowProducts = false;  // pairs are packed
  static int64_t k_elements(int64_t D, int64_t ldk) { return (D + 1) / 2 * round_up(ldk, kPairPanel); }
  static int64_t v_elements(int64_t bk, int64_t dvp) { return (bk + 1) / 2 * round_up(dvp, kPairPanel); }
  static int64_t need(int64_t bq, int64_t bk, int64_t D, int64_t ldk, int64_t dvp, int64_t slots) {
    return Arena<float>::need(
        {bq * ((D + 1) / 2), slots * k_elements(D, ldk), slots * v_elements(bk, dvp), bq * ldk / 2});
  }
  ForwardOperands(Arena<float>& arena, int64_t bq, int64_t bk_, int64_t D_, int64_t ldk_, int64_t dvp, int64_t slots)
      : D(D_), bk(bk_), ldk(ldk_), ldq(round_up(D_, 2)), kslot(k_elements(D_, ldk_)), vslot(v_elements(bk_, dvp)) {
    q = reinterpret_cast<uint16_t*>(arena.take(bq * ((D + 1) / 2)));
    kt = reinterpret_cast<Bf16Pair*>(arena.take(slots * kslot));
    vs = reinterpret_cast<Bf16Pair*>(arena.take(slots * vslot));
    pw = reinterpret_cast<uint16_t*>(arena.take(bq * ldk / 2));
  }

  // q as it is: the log2 scale goes on the float32 scores (score_mul), not
  // into a second rounding of q.
  void pack_q(const Rows<uint16_t>& src, int64_t m, float mul, int64_t row0) {
    qmul = mul;
    pack_bf16_rows(src, m, D, q + row0 * ldq, ldq);
  }
  float score_mul() const { return qmul; }
  void pack_tile(int64_t slot, const Rows<uint16_t>& k, const Rows<uint16_t>& v, int64_t n, int64_t Dv) {
    pack_pairs_transposed(k, n, round_up(n, Simd<float>::W), D, kt + slot * kslot);
    pack_pairs_rows(v, n, Dv, vs + slot * vslot, kPairPanel, (bk + 1) / 2 * kPairPanel);
  }
  void prefetch_tile(int64_t slot, int64_t part, int64_t parts) const {
    prefetch_part(kt + slot * kslot, kslot * 4, part, parts);
    prefetch_part(vs + slot * vslot, vslot * 4, part, parts);
  }
  void scores(int64_t slot, int64_t m, int64_t np, float* s, const int64_t* lbs, const int64_t* nvs) const {
    gemm_set(m, np, ldq / 2, as_pairs(q), ldq / 2, panel_major(kt + slot * kslot, ldq / 2), s, ldk,
             Ragged{nvs, nullptr, nullptr, lbs});
  }
  VMat v_tile(int64_t slot) const { return panel_major(vs + slot * vslot, (bk + 1) / 2); }
  // Each row rounded as soon as it is final, while it is in L1.
  void weights_ready(int64_t r, const float* w, int64_t np) { round_rows(w, ldk, 1, np, pw + r * ldk, ldk); }
  void add_pv(int64_t m, int64_t n, float* /*w: rounded in pw*/, const VMat& v, float* o, int64_t dvp,
              const int64_t* lbs, const int64_t* nvs) {
    // (n + 1) / 2 pairs: the tile's v holds no more (w is 0 past n).
    gemm_add(m, dvp, (n + 1) / 2, as_pairs(pw), ldk / 2, v, o, dvp, Ragged{nullptr, lbs, nvs});
  }
  // The direct products on pairs (above): q as it is, the weights as rounded
  // in pw. Against converting to float32 (direct.h's FmaDot and direct_pv),
  // B = 1, 32 query over 8 kv heads, 32k positions: 6.39 -> 5.75 ms per call
  // heads-outer, 9.76 -> 9.09 ms heads-interleaved (bench/decode.py's rows,
  // alternating in one process; AMD EPYC Zen 4, 2 threads).
  void direct_scores(int64_t m, int64_t n, const Rows<uint16_t>& k, float* s, const RowsAhead<uint16_t>& ahead) {
    std::fill(q + m * ldq, q + round_up(m, 4) * ldq, uint16_t{0});  // three rows run as four
    direct_scores_rows<PairDot>(m, n, D, q, ldq, k, s, ldk, ahead);
  }
  void direct_pv(int64_t m, int64_t n, int64_t Dv, float* /*w: rounded in pw*/, const Rows<uint16_t>& v, float* o,
                 int64_t dvp, const int64_t* lbs, const int64_t* nvs, const RowsAhead<uint16_t>& ahead) {
    direct_pair_pv_rows(m, n, Dv, pw, ldk, v, o, dvp, lbs, nvs, ahead);
  }
};

// ---------------------------------------------------------------------------
// The backward pass's operands as pairs (see BackwardOperands, products.h).
// q and dO twice: rows (A of Q K^T and dO V^T) and pairs of rows (B of
// dS^T Q and X^T dO); the tile's k transposed (B of Q K^T) and as pairs of
// rows (B of dS K), v transposed (B of dO V^T); and per block X and dS
// rounded to bfloat16: pairs of rows (A^T of X^T dO and dS^T Q) and dS rows
// (A of dS K). Blocks start at even rows, so that the pairs of rows of a
// block are those of the task.

template <>
struct BackwardOperands<uint16_t, float> {
  static constexpr bool kRoundedWeights = true;
  static constexpr int64_t kRowStep = 2;
  int64_t D, Dv, dp, dvp, bk, ldk, ldq, ldo;  // ldq, ldo: bfloat16 per q and dO row (D, Dv made even)
  uint16_t *q, *dout;           // rows, [Tq][ldq], [Tq][ldo]
  Bf16Pair *qpairs, *dopairs;   // pairs of rows, [Tq / 2][dp], [Tq / 2][dvp]
  Bf16Pair *kt, *kr, *vt;       // the tile
  Bf16Pair *xi, *dsi;           // X and dS as pairs of rows, [bq / 2][ldk]
  uint16_t* dsr;                // dS rows, [bq][ldk]

  static int64_t need(int64_t Tq, int64_t D, int64_t Dv, int64_t dp, int64_t dvp, int64_t bk, int64_t ldk,
                      int64_t bq) {
    const int64_t pairs = (Tq + 1) / 2, hq = (bq + 1) / 2;
    return Arena<float>::need({Tq * ((D + 1) / 2), Tq * ((Dv + 1) / 2), pairs * dp, pairs * dvp,
                               (D + 1) / 2 * round_up(ldk, kPairPanel), (bk + 1) / 2 * round_up(dp, kPairPanel),
                               (Dv + 1) / 2 * round_up(ldk, kPairPanel), hq * ldk, hq * ldk, bq * ldk / 2});
  }
  BackwardOperands(Arena<float>& arena, int64_t Tq, int64_t D_, int64_t Dv_, int64_t dp_, int64_t dvp_, int64_t bk_,
                   int64_t ldk_, int64_t bq)
      : D(D_), Dv(Dv_), dp(dp_), dvp(dvp_), bk(bk_), ldk(ldk_), ldq(round_up(D_, 2)), ldo(round_up(Dv_, 2)) {
    auto pairs_of = [&](int64_t n) { return reinterpret_cast<Bf16Pair*>(arena.take(n)); };
    const int64_t rows2 = (Tq + 1) / 2, hq = (bq + 1) / 2;
    q = reinterpret_cast<uint16_t*>(arena.take(Tq * (ldq / 2)));
    dout = reinterpret_cast<uint16_t*>(arena.take(Tq * (ldo / 2)));
    qpairs = pairs_of(rows2 * dp);
    dopairs = pairs_of(rows2 * dvp);
    kt = pairs_of(ldq / 2 * round_up(ldk, kPairPanel));
    kr = pairs_of((bk + 1) / 2 * round_up(dp, kPairPanel));
    vt = pairs_of(ldo / 2 * round_up(ldk, kPairPanel));
    xi = pairs_of(hq * ldk);
    dsi = pairs_of(hq * ldk);
    dsr = reinterpret_cast<uint16_t*>(arena.take(bq * ldk / 2));
  }

  void pack_task_rows(const Rows<uint16_t>& q_rows, const Rows<uint16_t>& dout_rows, int64_t rows) {
    pack_bf16_rows(q_rows, rows, D, q, ldq);
    pack_bf16_rows(dout_rows, rows, Dv, dout, ldo);
    pack_pairs_rows(q_rows, rows, D, qpairs, dp, kPairPanel);
    pack_pairs_rows(dout_rows, rows, Dv, dopairs, dvp, kPairPanel);
  }
  void pack_tile(const Rows<uint16_t>& k, const Rows<uint16_t>& v, int64_t n, int64_t np) {
    pack_pairs_transposed(k, n, np, D, kt);
    pack_pairs_rows(k, n, D, kr, kPairPanel, (bk + 1) / 2 * kPairPanel);
    pack_pairs_transposed(v, n, np, Dv, vt);
  }
  void prefetch_rows(int64_t r0, int64_t n, int64_t part, int64_t parts) const {
    prefetch_part(q + r0 * ldq, n * ldq * 2, part, parts);
    prefetch_part(dout + r0 * ldo, n * ldo * 2, part, parts);
    prefetch_part(qpairs + r0 / 2 * dp, (n + 1) / 2 * dp * 4, part, parts);
    prefetch_part(dopairs + r0 / 2 * dvp, (n + 1) / 2 * dvp * 4, part, parts);
  }
  void scores(int64_t r0, int64_t mm, int64_t np, float* s, const int64_t* nvs) const {
    gemm_set(mm, np, ldq / 2, as_pairs(q + r0 * ldq), ldq / 2, panel_major(kt, ldq / 2), s, ldk,
             Ragged{nvs, nullptr, nullptr});
  }
  void dprobs(int64_t r0, int64_t mm, int64_t np, float* dpt, const int64_t* nvs) const {
    gemm_set(mm, np, ldo / 2, as_pairs(dout + r0 * ldo), ldo / 2, panel_major(vt, ldo / 2), dpt, ldk,
             Ragged{nvs, nullptr, nullptr});
  }
  // pre: r0 even (kRowStep).
  void accumulate(int64_t r0, int64_t mm, int64_t n, const float* x, const float* ds, float* dv, float* dk, float* dq,
                  const int64_t* kbeg, const int64_t* nvs) {
    const int64_t np = round_up(n, Simd<float>::W), hm = (mm + 1) / 2;
    interleave_rows(x, ldk, mm, np, xi, ldk);
    interleave_rows(ds, ldk, mm, np, dsi, ldk);
    round_rows(ds, ldk, mm, np, dsr, ldk);
    gemm_add_at(n, dvp, hm, xi, ldk, row_major(dopairs + r0 / 2 * dvp, dvp), dv, dvp, Ragged{nullptr, kbeg, nullptr});
    gemm_add_at(n, dp, hm, dsi, ldk, row_major(qpairs + r0 / 2 * dp, dp), dk, dp, Ragged{nullptr, kbeg, nullptr});
    gemm_add(mm, dp, (n + 1) / 2, as_pairs(dsr), ldk / 2, panel_major(kr, (bk + 1) / 2), dq, dp,
             Ragged{nullptr, nullptr, nvs});
  }
};
