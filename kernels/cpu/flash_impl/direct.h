// Few query rows (decoding): the products of a forward block of at most
// cpu_flash::decode_direct_rows() rows, reading the kv rows in place — strided,
// or through a paged cache's block table (packing.h's Rows) — and converting
// them to the accumulation type on load. A tile that no other row block reads
// would pay for its packing with nothing in return, and decoding is bound by
// reading the cache: every kv byte is read once, straight into registers.
// A part of cpu/flash_attention_impl.h, which says what includes it and how.
#ifndef DIMATTN_CPU_FLASH_PARTS
#error "included by cpu/flash_attention_impl.h only"
#endif

// How many kv rows ahead the direct products prefetch the rows they will
// read (within the tile: past it a paged table may end). The hardware's
// prefetchers alone left a heads-outer float32 cache at 17 ms per call for
// B = 1, 32 query over 8 kv heads, 32k positions; 8 rows ahead gave 10.5 ms,
// 16 or 32 less (bench/decode.py, AMD EPYC Zen 5, 2 threads).
constexpr int64_t kPrefetchRows = 8;

// Every cache line of a row of `bytes` towards L1.
DIMATTN_INLINE void prefetch_row(const void* row, int64_t bytes) {
  for (int64_t l = 0; l < bytes; l += 64) __builtin_prefetch(static_cast<const char*>(row) + l, 0, 3);
}

// Whether the direct products read float32 rows of W >= 16 floats (AVX-512)
// whole, one row after the other, instead of a vector of each of several
// rows in turn. Read whole, rows that lie back to back form one stream that
// AMD's hardware prefetchers follow alone, so that there the rows ahead need
// no prefetch instructions towards L1 (kPrefetchRows; 16 rows ahead took
// 1.13x the time); interleaved, they needed them. Measured, B = 1, 32 query
// over 8 kv heads, a 32k-position heads-outer float32 cache (in one process,
// against the interleaved order with its prefetches; AMD EPYC Zen 4, 2
// threads): 0.85-0.88x the time; the layouts that interleave the kv heads
// 0.92-0.99x. The price: a cache that the last level cache holds (1k-2k
// positions, the same call repeated) takes 1.15-1.4x the time, q's loads now
// beside every k vector's; decoding reads each layer's cache from memory. Not where the rows are bfloat16 or
// float16 (their products cost more per byte: the q vector each k vector
// then needs is one load more per multiply-add; 1.05-1.2x the time), nor on
// AVX2 (equal, and worse without the prefetches).
template <class A, class S>
constexpr bool kReadWholeRows = std::is_same_v<A, S> && std::is_same_v<A, float> && Simd<A>::W >= 16;
// Whether a direct product asks for the rows ahead of rows [0, n) of
// `cols` elements towards L1 (kPrefetchRows): not where kReadWholeRows reads
// them as one stream, unless the CPU's prefetchers do not follow that stream
// alone (Intel's cores: cpu_flash::decode_prefetch_whole_rows).
template <class A, class S>
bool prefetch_rows_ahead(const Rows<S>& rows, int64_t n, int64_t cols) {
  return !(kReadWholeRows<A, S> && rows.back_to_back(n, cols)) || cpu_flash::decode_prefetch_whole_rows();
}
// Rows that the direct products ask towards L2 while they read others: the
// tile's v rows during its scores, the next tile's k rows during P V, so
// that both streams stay in flight instead of each restarting once per tile.
// B = 1, 32 query over 8 kv heads, a 32k-position heads-outer cache: float32
// 13.9 -> 11.0 ms per call, bfloat16 8.7 -> 7.8 ms, paged 16 20.4 -> 16.9 ms
// (bench/decode.py's rows, interleaved in one process; AMD EPYC Zen 4, 2 threads).
template <class S>
struct RowsAhead {
  const Rows<S>* rows = nullptr;
  int64_t n = 0, bytes = 0;
  // Row c (if any) towards L2.
  DIMATTN_INLINE void fetch(int64_t c) const {
    if (rows && c < n) prefetch_part((*rows)(c), bytes, 0, 1);
  }
};

// The same rows asked one cache line per k step of a product (the
// micro-kernel's Pf, micro_kernel.h): the fetches spread over the product
// instead of coming in a burst that would stall it.
template <class S>
struct LineStream {
  RowsAhead<S> rows;
  int64_t r = 0, off = 0;  // the next line: row r, byte off
  const char* at = nullptr;
  explicit LineStream(const RowsAhead<S>& rows_) : rows(rows_) {
    if (rows.n > 0) at = reinterpret_cast<const char*>((*rows.rows)(0));
  }
  DIMATTN_INLINE void step() {
    if (r >= rows.n) return;
    __builtin_prefetch(at + off, 0, 2);
    if ((off += 64) < rows.bytes) return;
    off = 0;
    if (++r < rows.n) at = reinterpret_cast<const char*>((*rows.rows)(r));
  }
};

// The lane sums of W vectors as one vector (lane i: the sum of x[i]'s lanes).
// Each step adds the two halves of every block of lanes while pairing the
// vectors, so W sums take W - 1 additions and 2 (W - 1) shuffles instead of
// W horizontal sums of log2(W) dependent steps each.
#if defined(__clang__) || __GNUC__ >= 12
template <size_t W, size_t B, bool kHi>
constexpr int halving_lane(size_t l) {
  // Output lane l takes, from x (l < W / 2) or y, block l' / (B / 2) of its
  // blocks of B lanes (l' = l % (W / 2)): the block's lower or upper half.
  const size_t half = B / 2, within = l % (W / 2);
  return static_cast<int>(l / (W / 2) * W + within / half * B + (kHi ? half : 0) + within % half);
}
template <size_t B, bool kHi, class V, size_t... L>
DIMATTN_INLINE V halving_pick(const V& x, const V& y, std::index_sequence<L...>) {
  return __builtin_shufflevector(x, y, halving_lane<sizeof...(L), B, kHi>(L)...);
}
template <size_t B, class V>
DIMATTN_INLINE void halving_step(V* x, size_t n) {
  constexpr size_t W = sizeof(V) / sizeof(x[0][0]);
  for (size_t i = 0; i < n / 2; ++i)
    x[i] = halving_pick<B, false>(x[2 * i], x[2 * i + 1], std::make_index_sequence<W>{}) +
           halving_pick<B, true>(x[2 * i], x[2 * i + 1], std::make_index_sequence<W>{});
  if constexpr (B > 2) halving_step<B / 2>(x, n / 2);
}
template <class V>
DIMATTN_INLINE V lane_sums(V* x) {
  halving_step<sizeof(V) / sizeof(x[0][0])>(x, sizeof(V) / sizeof(x[0][0]));
  return x[0];
}
#else
template <class V>
DIMATTN_INLINE V lane_sums(V* x) {
  V r;
  for (size_t i = 0; i < sizeof(V) / sizeof(r[0]); ++i) r[i] = hsum(x[i]);
  return r;
}
#endif

// How direct_scores multiplies q by k: here in the accumulation type, k
// converted on load, one FMA per element; pairs.h's PairDot takes bfloat16
// pairs through vdpbf16ps instead. Q: q's element type; kStep elements per
// vector.
template <class A, class S>
struct FmaDot {
  using Q = A;
  using V = typename Simd<A>::V;
  static constexpr int64_t kStep = Simd<A>::W;
  static DIMATTN_INLINE V q(const Q* p) { return vload<V>(p); }
  static DIMATTN_INLINE V k(const S* p) { return load_as<A>(p); }
  static DIMATTN_INLINE V mac(V acc, V q, V k) { return vfma(q, k, acc); }
};

// s[r][c] = q[r] . k(c) for M rows (q: M rows of D elements, ldq apart) and
// kv positions c < n. KR positions per step keep M x KR = W accumulators,
// summed by lane_sums.
template <int M, class Dot, class A, class S>
void direct_scores(int64_t n, int64_t D, const typename Dot::Q* q, int64_t ldq, const Rows<S>& k, A* s, int64_t lds,
                   const RowsAhead<S>& ahead) {
  using V = typename Simd<A>::V;
  using QV = decltype(Dot::q(q));
  constexpr int W = Simd<A>::W, KR = W / M;
  static_assert(W % M == 0, "M divides the vector width");
  const int64_t dv = D / Dot::kStep * Dot::kStep;
  // x (the sum over whole vectors) plus the elements past them, one at a time.
  auto finish = [&](A x, int r, const S* kr) {
    for (int64_t d = dv; d < D; ++d) x += to_acc(q[r * ldq + d]) * to_acc(kr[d]);
    return x;
  };
  const int64_t pf_end = prefetch_rows_ahead<A>(k, n, D) ? n : 0;  // rows below it asked for towards L1
  int64_t c = 0;
  for (; c + KR <= n; c += KR) {
    const S* kr[KR];
    for (int t = 0; t < KR; ++t) kr[t] = k(c + t);
    for (int t = 0; t < KR; ++t) {
      if (c + t + kPrefetchRows < pf_end) prefetch_row(k(c + t + kPrefetchRows), D * static_cast<int64_t>(sizeof(S)));
      ahead.fetch(c + t);
    }
    V acc[M * KR];
    for (int i = 0; i < M * KR; ++i) acc[i] = V{};
    if constexpr (kReadWholeRows<A, S>) {  // row after row: q's vectors loaded once per k vector
      for (int t = 0; t < KR; ++t)
        for (int64_t d = 0; d < dv; d += Dot::kStep) {
          const QV kv = Dot::k(kr[t] + d);
          for (int r = 0; r < M; ++r) acc[r * KR + t] = Dot::mac(acc[r * KR + t], Dot::q(q + r * ldq + d), kv);
        }
    } else {  // a vector of each row in turn: q's vectors loaded once per KR k vectors
      for (int64_t d = 0; d < dv; d += Dot::kStep) {
        QV kv[KR];
        for (int t = 0; t < KR; ++t) kv[t] = Dot::k(kr[t] + d);
        for (int r = 0; r < M; ++r) {
          const QV qv = Dot::q(q + r * ldq + d);
          for (int t = 0; t < KR; ++t) acc[r * KR + t] = Dot::mac(acc[r * KR + t], qv, kv[t]);
        }
      }
    }
    const V sums = lane_sums(acc);
    // Row r's KR sums are lanes [r KR, (r + 1) KR): one store each where no
    // element is past the whole vectors, instead of a store per sum through
    // the (then empty) tail loop.
    if (dv == D) {
      A x[W];
      std::memcpy(x, &sums, sizeof x);
      for (int r = 0; r < M; ++r) std::memcpy(s + r * lds + c, x + r * KR, KR * sizeof(A));
    } else {
      for (int r = 0; r < M; ++r)
        for (int t = 0; t < KR; ++t) s[r * lds + c + t] = finish(sums[r * KR + t], r, kr[t]);
    }
  }
  for (; c < n; ++c) {  // the last positions, one at a time
    ahead.fetch(c);
    const S* kr = k(c);
    V acc[M];
    for (int r = 0; r < M; ++r) acc[r] = V{};
    for (int64_t d = 0; d < dv; d += Dot::kStep) {
      const QV kv = Dot::k(kr + d);
      for (int r = 0; r < M; ++r) acc[r] = Dot::mac(acc[r], Dot::q(q + r * ldq + d), kv);
    }
    for (int r = 0; r < M; ++r) s[r * lds + c] = finish(hsum(acc[r]), r, kr);
  }
}

// s = the scores of m <= decode_direct_rows() rows (q: rows ldq apart, zero
// rows up to the next multiple of 4 where m % 4 == 3: three rows run as four).
template <class Dot, class A, class S>
void direct_scores_rows(int64_t m, int64_t n, int64_t D, const typename Dot::Q* q, int64_t ldq, const Rows<S>& k, A* s,
                        int64_t lds, const RowsAhead<S>& ahead) {
  constexpr int kStep = Simd<A>::W % 4 == 0 ? 4 : 2;  // rows per pass: 4 where they divide the width
  for (int64_t r = 0; r < m; r += kStep) {
    const int64_t rows = std::min<int64_t>(kStep, m - r);
    const typename Dot::Q* qr = q + r * ldq;
    A* sr = s + r * lds;
    const RowsAhead<S> a = r == 0 ? ahead : RowsAhead<S>{};  // the first pass asks for them
    if (rows == 1) {
      direct_scores<1, Dot>(n, D, qr, ldq, k, sr, lds, a);
    } else if (rows == 2) {
      direct_scores<2, Dot>(n, D, qr, ldq, k, sr, lds, a);
    } else if constexpr (kStep == 4) {
      direct_scores<4, Dot>(n, D, qr, ldq, k, sr, lds, a);
    }
  }
}

// o[r][0 : Dv) += sum_c p[r][c] v(c) over rows r < M and positions c in
// [c0, c1): p's rows hold the weights, zero outside each row's positions.
// CV vectors of columns per pass keep M x CV accumulators in registers.
// pre: Dv % W == 0.
template <int M, int CV, class A, class S>
void direct_pv(int64_t c0, int64_t c1, int64_t Dv, const A* p, int64_t ldp, const Rows<S>& v, A* o, int64_t ldo,
               const RowsAhead<S>& ahead) {
  using V = typename Simd<A>::V;
  constexpr int W = Simd<A>::W;
  const int64_t pf_end = prefetch_rows_ahead<A>(v, c1, Dv) ? c1 : 0;  // rows below it asked for towards L1
  for (int64_t e0 = 0; e0 < Dv; e0 += CV * W) {
    const int cv = static_cast<int>(std::min<int64_t>(CV, (Dv - e0) / W));
    V acc[M][CV];
    for (int r = 0; r < M; ++r)
      for (int u = 0; u < CV; ++u) acc[r][u] = u < cv ? vload<V>(o + r * ldo + e0 + u * W) : V{};
    if (cv == CV) {
      for (int64_t c = c0; c < c1; ++c) {
        if (e0 == 0) {
          if (c + kPrefetchRows < pf_end) prefetch_row(v(c + kPrefetchRows), Dv * static_cast<int64_t>(sizeof(S)));
          ahead.fetch(c);
        }
        const S* vr = v(c) + e0;
        V vv[CV];
        for (int u = 0; u < CV; ++u) vv[u] = load_as<A>(vr + u * W);
        for (int r = 0; r < M; ++r) {
          const V pr = Simd<A>::splat(p[r * ldp + c]);
          for (int u = 0; u < CV; ++u) acc[r][u] = vfma(pr, vv[u], acc[r][u]);
        }
      }
    } else {  // the last columns: fewer vectors
      for (int64_t c = c0; c < c1; ++c) {
        const S* vr = v(c) + e0;
        for (int u = 0; u < cv; ++u) {
          const V vv = load_as<A>(vr + u * W);
          for (int r = 0; r < M; ++r) acc[r][u] = vfma(Simd<A>::splat(p[r * ldp + c]), vv, acc[r][u]);
        }
      }
    }
    for (int r = 0; r < M; ++r)
      for (int u = 0; u < cv; ++u) vstore(o + r * ldo + e0 + u * W, acc[r][u]);
  }
}

// pv(r, rows, c0, c1, ahead) for the groups of up to kGroup of m rows,
// [c0, c1) the positions any row of the group attends (row r's in [lbs[r],
// nvs[r]); nvs nullptr: [0, n)); a group that attends nothing is skipped,
// the first asks for `ahead`.
template <int kGroup = 4, class S, class F>
DIMATTN_INLINE void pv_row_groups(int64_t m, int64_t n, const int64_t* lbs, const int64_t* nvs,
                                  const RowsAhead<S>& ahead, F&& pv) {
  for (int64_t r = 0; r < m; r += kGroup) {
    const int64_t rows = std::min<int64_t>(kGroup, m - r);
    int64_t c0 = 0, c1 = n;
    if (nvs) {
      c0 = *std::min_element(lbs + r, lbs + r + rows);
      c1 = *std::max_element(nvs + r, nvs + r + rows);
      if (c1 <= c0) continue;
    }
    pv(r, rows, c0, c1, r == 0 ? ahead : RowsAhead<S>{});
  }
}

// o += p v for m <= decode_direct_rows() rows, row r's weights nonzero in
// [lbs[r], nvs[r]) only (nullptr: [0, n)).
template <class A, class S>
void direct_pv_rows(int64_t m, int64_t n, int64_t Dv, const A* p, int64_t ldp, const Rows<S>& v, A* o, int64_t ldo,
                    const int64_t* lbs, const int64_t* nvs, const RowsAhead<S>& ahead) {
  // Accumulators: 16 of AVX-512's 32 registers, 8 of AVX2's 16 (and of SSE's).
  constexpr int kAcc = Simd<A>::W * static_cast<int>(sizeof(A)) >= 64 ? 16 : 8;
  // Rows read whole: two query rows at a time over whole v rows (kAcc / 2
  // vectors: 128 floats), instead of four over half of them.
  constexpr int kGroup = kReadWholeRows<A, S> ? 2 : 4;
  pv_row_groups<kGroup>(m, n, lbs, nvs, ahead, [&](int64_t r, int64_t rows, int64_t c0, int64_t c1,
                                                   const RowsAhead<S>& a) {
    const A* pr = p + r * ldp;
    A* orow = o + r * ldo;
    switch (rows) {
      case 1: direct_pv<1, kAcc>(c0, c1, Dv, pr, ldp, v, orow, ldo, a); break;
      case 2: direct_pv<2, kAcc / 2>(c0, c1, Dv, pr, ldp, v, orow, ldo, a); break;
      case 3: direct_pv<3, kAcc / 4>(c0, c1, Dv, pr, ldp, v, orow, ldo, a); break;
      default: direct_pv<4, kAcc / 4>(c0, c1, Dv, pr, ldp, v, orow, ldo, a); break;
    }
  });
}
