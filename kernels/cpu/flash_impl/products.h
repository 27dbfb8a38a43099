// The products of the forward and backward passes, per storage type S and
// accumulation type A: what q, k, v and dO are packed as, and which
// micro-kernel multiplies them. forward.h and backward.h do everything else
// (masks, softmax, dropout, score variants, the loops) once for every ISA.
//
// Here the general case: each operand is converted to A when packed, and
// the products multiply A by A. flash_impl/pairs.h specializes both structs
// for bfloat16 on avx512_bf16 (bfloat16 pairs through vdpbf16ps).
// A part of cpu/flash_attention_impl.h, which says what includes it and how.
#ifndef DIMATTN_CPU_FLASH_PARTS
#error "included by cpu/flash_attention_impl.h only"
#endif

// ---------------------------------------------------------------------------
// Forward: a query block's rows, and per kv tile slot its k (transposed) and
// v, as the products of forward_block read them. Row widths: ldk (kv
// positions of a score row, whole vectors), dvp (value features, whole
// vectors).

template <class S, class A>
struct ForwardOperands {
  // Whether the products round the weights P (and dS) to bfloat16: then their
  // exponentials need no more than vexp2<true>'s 3.5e-6 (flash_impl/simd.h).
  static constexpr bool kRoundedWeights = false;
  using VMat = BMat<A>;
  int64_t D, bk, ldk;
  int64_t kslot, vslot;  // elements per packed k and v tile
  A *q, *kt, *vs;

  static int64_t k_elements(int64_t D, int64_t ldk) { return D * ldk; }
  static int64_t v_elements(int64_t bk, int64_t dvp) { return bk * round_up(dvp, panel_width<A>()); }
  static int64_t need(int64_t bq, int64_t bk, int64_t D, int64_t ldk, int64_t dvp, int64_t slots) {
    return Arena<A>::need({bq * D, slots * k_elements(D, ldk), slots * v_elements(bk, dvp)});
  }
  ForwardOperands(Arena<A>& arena, int64_t bq, int64_t bk_, int64_t D_, int64_t ldk_, int64_t dvp, int64_t slots)
      : D(D_), bk(bk_), ldk(ldk_), kslot(k_elements(D_, ldk_)), vslot(v_elements(bk_, dvp)) {
    q = arena.take(bq * D);
    kt = arena.take(slots * kslot);
    vs = arena.take(slots * vslot);
  }

  // m query rows into the block's rows [row0, row0 + m), and the factor mul
  // that takes their scores to log2 units: here q * mul is packed
  // (score_mul() = 1). One mul for every row of a block.
  void pack_q(const Rows<S>& src, int64_t m, A mul, int64_t row0) { pack_rows(src, m, D, q + row0 * D, D, mul); }
  A score_mul() const { return A(1); }
  // n kv positions into tile slot `slot`: k transposed, v rows, zero-padded.
  void pack_tile(int64_t slot, const Rows<S>& k, const Rows<S>& v, int64_t n, int64_t Dv) {
    pack_transposed(k, n, round_up(n, Simd<A>::W), D, kt + slot * kslot);
    pack_rows_panels(v, n, Dv, bk, vs + slot * vslot);
  }
  // Part `part` of `parts` of tile slot's memory towards L2.
  void prefetch_tile(int64_t slot, int64_t part, int64_t parts) const {
    prefetch_part(kt + slot * kslot, kslot * static_cast<int64_t>(sizeof(A)), part, parts);
    prefetch_part(vs + slot * vslot, vslot * static_cast<int64_t>(sizeof(A)), part, parts);
  }
  // s[m x np] = the scores of the block against tile slot (times score_mul():
  // log2 units); row r is needed in [lbs[r], nvs[r]) only (nullptr: all).
  void scores(int64_t slot, int64_t m, int64_t np, A* s, const int64_t* lbs, const int64_t* nvs) const {
    gemm_set(m, np, D, q, D, panel_major(kt + slot * kslot, D), s, ldk, Ragged{nvs, nullptr, nullptr, lbs});
  }
  VMat v_tile(int64_t slot) const { return panel_major(vs + slot * vslot, bk); }
  // Row r of the weights is final (w[0, np)), while it is in L1.
  void weights_ready(int64_t /*r*/, const A* /*w*/, int64_t /*np*/) {}
  // o[m x dvp] += w[m x n] v, row r of w holding weights in [lbs[r], nvs[r])
  // (nullptr: [0, n)) and zeros around them up to whole vectors.
  void add_pv(int64_t m, int64_t n, A* w, const VMat& v, A* o, int64_t dvp, const int64_t* lbs, const int64_t* nvs) {
    gemm_add(m, dvp, n, w, ldk, v, o, dvp, Ragged{nullptr, lbs, nvs});
  }

  // A tile that no other block reads (decoding's blocks of more rows than
  // the direct products take), multiplied as rows: the scores as
  // st = k q^T (k's rows the broadcast operand, q's rows as the columns qc
  // that pack_q_columns puts there once per block), transposed into s;
  // o += w v with v's rows as B. Rows of type A are read where they lie,
  // run by run (a strided tile is one run, a paged one a run per block);
  // others are converted row by row into the slot's memory: a copy, not the
  // transposition that packing costs. `ahead` (LineStream, direct.h): rows
  // the products ask towards L2 as they go, the tile's v during the scores,
  // the next tile's k during w v. Against packing, B = 1, 32 query heads
  // over one kv head, 32k positions (calls alternating in one process;
  // Intel Xeon, family 6 model 207, 2 threads): float32 0.69-0.75x the time,
  // float16 0.67-0.69x, bfloat16 0.91-0.95x, pools of 16 positions
  // 0.83-0.91x; 16 query positions over 8 kv heads 0.89-0.99x; AVX2 0.77-0.94x.
  static constexpr bool kRowProducts = true;
  // f(rows, rs, j, len) for each run of rows [j, j + len) of x's [0, n) that
  // lie rs elements apart, cols elements each, as the products read them.
  template <class F>
  static void for_runs(const Rows<S>& x, int64_t n, int64_t cols, A* into, F&& f) {
    if constexpr (std::is_same_v<S, A>) {
      for (int64_t j = 0, len; j < n; j += len) {
        len = x.run(j, n);
        f(x(j), x.rs, j, len);
      }
    } else {
      pack_rows(x, n, cols, into, cols, A(1));
      f(static_cast<const A*>(into), cols, int64_t{0}, n);
    }
  }
  // qc[D][mq] = the block's m rows of q as columns, zero in [m, mq).
  // pre: mq % W == 0, mq <= the block's rows.
  void pack_q_columns(int64_t m, int64_t mq, A* qc) {
    fill(q + m * D, (mq - m) * D, A(0));
    transpose_into(q, mq, D, D, qc, mq);
  }
  void row_scores(int64_t m, int64_t n, int64_t np, const Rows<S>& k, const A* qc, int64_t mq, A* st, A* s,
                  LineStream<S> ahead) const {
    for_runs(k, n, D, kt, [&](const A* rows, int64_t rs, int64_t j, int64_t len) {
      gemm_set(len, mq, D, rows, rs, row_major(qc, mq), st + j * mq, mq, Ragged{}, ahead);
    });
    fill(st + n * mq, (np - n) * mq, A(0));
    // Whole 8 x 8 blocks where the columns allow (at most mq: st's rows).
    transpose_into(st, np, std::min(round_up(m, 8), mq), mq, s, ldk);
  }
  // Row r of w holds weights in [lbs[r], nvs[r]) (nullptr: [0, n)) and zeros
  // elsewhere: runs shorter than the tile multiply the zeros too.
  void row_pv(int64_t m, int64_t n, const A* w, const Rows<S>& v, A* o, int64_t dvp, const int64_t* lbs,
              const int64_t* nvs, LineStream<S> ahead) const {
    for_runs(v, n, dvp, vs, [&](const A* rows, int64_t rs, int64_t j, int64_t len) {
      gemm_add(m, dvp, len, w + j, ldk, row_major(rows, rs), o, dvp, len == n ? Ragged{nullptr, lbs, nvs} : Ragged{},
               ahead);
    });
  }

  // Few rows (m <= decode_direct_rows(), decoding): scores and add_pv's sums by
  // the direct products (direct.h), which read the tile's k and v rows in place
  // (nothing packed), q as pack_q left it; `ahead`: rows to ask towards L2
  // meanwhile.
  void direct_scores(int64_t m, int64_t n, const Rows<S>& k, A* s, const RowsAhead<S>& ahead) {
    fill(q + m * D, (round_up(m, 4) - m) * D, A(0));  // three rows run as four
    direct_scores_rows<FmaDot<A, S>>(m, n, D, q, D, k, s, ldk, ahead);
  }
  void direct_pv(int64_t m, int64_t n, int64_t Dv, A* w, const Rows<S>& v, A* o, int64_t dvp, const int64_t* lbs,
                 const int64_t* nvs, const RowsAhead<S>& ahead) {
    direct_pv_rows(m, n, Dv, w, ldk, v, o, dvp, lbs, nvs, ahead);
  }
};

// ---------------------------------------------------------------------------
// Backward: a task's query rows (q and dO, from its first row i_start on,
// indexed by row - i_start) and the current kv tile's k and v.

template <class S, class A>
struct BackwardOperands {
  static constexpr bool kRoundedWeights = false;  // as ForwardOperands
  // Blocks of rows start at even offsets from the task's first row where the
  // products pair rows (pairs.h); here any row may start one.
  static constexpr int64_t kRowStep = 1;
  int64_t D, Dv, dp, dvp, bk, ldk;
  A *q, *dout;     // [rows][dp], [rows][dvp]
  A *kt, *kr, *vt;  // the tile: k transposed, k rows (panel-major), v transposed

  static int64_t need(int64_t Tq, int64_t D, int64_t Dv, int64_t dp, int64_t dvp, int64_t bk, int64_t ldk,
                      int64_t /*bq*/) {
    return Arena<A>::need({Tq * dp, Tq * dvp, D * ldk, bk * round_up(dp, panel_width<A>()), Dv * ldk});
  }
  BackwardOperands(Arena<A>& arena, int64_t Tq, int64_t D_, int64_t Dv_, int64_t dp_, int64_t dvp_, int64_t bk_,
                   int64_t ldk_, int64_t /*bq*/)
      : D(D_), Dv(Dv_), dp(dp_), dvp(dvp_), bk(bk_), ldk(ldk_) {
    q = arena.take(Tq * dp);
    dout = arena.take(Tq * dvp);
    kt = arena.take(D * ldk);
    kr = arena.take(bk * round_up(dp, panel_width<A>()));
    vt = arena.take(Dv * ldk);
  }

  // The task's `rows` query rows of q and dO.
  void pack_task_rows(const Rows<S>& q_rows, const Rows<S>& dout_rows, int64_t rows) {
    pack_rows(q_rows, rows, D, q, dp, A(1));
    pack_rows(dout_rows, rows, Dv, dout, dvp, A(1));
  }
  // The tile's n kv positions (np: n in whole vectors).
  void pack_tile(const Rows<S>& k, const Rows<S>& v, int64_t n, int64_t np) {
    pack_transposed(k, n, np, D, kt);
    pack_rows_panels(k, n, D, bk, kr);
    pack_transposed(v, n, np, Dv, vt);
  }
  // Part `part` of `parts` of rows [r0, r0 + n) of q and dO towards L2.
  void prefetch_rows(int64_t r0, int64_t n, int64_t part, int64_t parts) const {
    prefetch_part(q + r0 * dp, n * dp * static_cast<int64_t>(sizeof(A)), part, parts);
    prefetch_part(dout + r0 * dvp, n * dvp * static_cast<int64_t>(sizeof(A)), part, parts);
  }
  // s[mm x np] = q k^T of rows [r0, r0 + mm) (unscaled); row r needed up to nvs[r].
  void scores(int64_t r0, int64_t mm, int64_t np, A* s, const int64_t* nvs) const {
    gemm_set(mm, np, D, q + r0 * dp, dp, panel_major(kt, D), s, ldk, Ragged{nvs, nullptr, nullptr});
  }
  // dpt[mm x np] = dO v^T of rows [r0, r0 + mm).
  void dprobs(int64_t r0, int64_t mm, int64_t np, A* dpt, const int64_t* nvs) const {
    gemm_set(mm, np, Dv, dout + r0 * dvp, dvp, panel_major(vt, Dv), dpt, ldk, Ragged{nvs, nullptr, nullptr});
  }
  // For rows [r0, r0 + mm) and the tile's n positions, from the weights x
  // (that made O) and ds ([mm][ldk], zero past each row's positions):
  // dv += x^T dO, dk += ds^T q, dq += ds k (dq: the rows' dQ, [mm][dp]).
  // Position c is reached from local row kbeg[c] on, row r reaches nvs[r]
  // positions (nullptr: all).
  void accumulate(int64_t r0, int64_t mm, int64_t n, const A* x, const A* ds, A* dv, A* dk, A* dq,
                  const int64_t* kbeg, const int64_t* nvs) {
    gemm_add_at(n, dvp, mm, x, ldk, row_major(dout + r0 * dvp, dvp), dv, dvp, Ragged{nullptr, kbeg, nullptr});
    gemm_add_at(n, dp, mm, ds, ldk, row_major(q + r0 * dp, dp), dk, dp, Ragged{nullptr, kbeg, nullptr});
    gemm_add(mm, dp, n, ds, ldk, panel_major(kr, bk), dq, dp, Ragged{nullptr, nullptr, nvs});
  }
};
