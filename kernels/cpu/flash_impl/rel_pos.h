// Relative positions (Transformer-XL; RelPosParams in common/attention_mask.h)
// in the tiles' scores, and their gradients.
// A part of cpu/flash_attention_impl.h, which says what includes it and how.
//
// Row i and kv position j gain u . k_j + (q_i + v) . table[center + j - step i]
// (raw units; the pass's scale multiplies the sum). A block of rows
// [i0, i0 + m) against a kv tile [j0, j0 + n) reads one band of table rows,
// [bs, bs + bw) with bs = center + j0 - step (i0 + m - 1), bw = n + step (m - 1);
// its row r reads the band's columns [off_r, off_r + n), off_r = step (m - 1 - r):
// a diagonal of the band product G = (Q + v) P^T, a contiguous run of G's
// row r. So the positional scores are one product and a shifted add per row,
// and nothing of [rows, 2T - 1] or [rows, T, D] is ever held.
//
// Forward: a block's consecutive kv tiles share step (m - 1) band columns
// (the next tile's band starts n further); they are kept, so that each
// (row, table row) product is computed once along a block's tiles.
// Backward: per (query block, kv tile) step, G is recomputed with the
// micro-blocks outside the diagonal's parallelogram skipped (Ragged); dS
// placed on the same diagonals (dG) gives dQ += dG P and d(table) += dG^T
// (Q + v), accumulated per task over its span of table rows and added to
// d(table) once per head; u's gradients come from the column sums of dS
// (dK += colsum u, du += colsum . K), v's from those of dG (dv += colsum . P).
#ifndef DIMATTN_CPU_FLASH_PARTS
#error "included by cpu/flash_attention_impl.h only"
#endif

// ---------------------------------------------------------------------------
// What one (b, h) reads of the call's relative positions.

template <class S>
struct RelPosHead {
  const S* table = nullptr;  // the plane of (b, h)
  int64_t trs = 0, center = 0, step = 1;
  const double* u = nullptr;  // head_dim values, or nullptr
  const double* v = nullptr;
};

template <class S>
RelPosHead<S> rel_pos_head(const AttentionKernelParams& p, int64_t b, int64_t h) {
  const RelPosParams& r = p.score.rel_pos;
  const int64_t bh = b * p.heads + h;
  return {r.table.plane<S>(bh), r.table.row_stride, r.center, r.step, r.u ? r.u + bh * p.head_dim : nullptr,
          r.v ? r.v + bh * p.head_dim : nullptr};
}

// The band of table rows that rows [i0, i0 + m) and kv positions [j0, j0 + n) read.
struct RelPosBand {
  int64_t start, width;
};
inline RelPosBand rel_pos_band(int64_t center, int64_t step, int64_t i0, int64_t m, int64_t j0, int64_t n) {
  return {center + j0 - step * (i0 + m - 1), n + step * (m - 1)};
}

// out[c] = mul * u . k_c for c < n (k's rows krs apart), 0 up to np.
template <class S, class A>
void rel_pos_u_dot_k(const A* u, const S* k, int64_t krs, int64_t n, int64_t np, int64_t D, A mul, A* out) {
  for (int64_t c = 0; c < n; ++c) {
    const S* kr = k + c * krs;
    A acc = 0;
    for (int64_t d = 0; d < D; ++d) acc += u[d] * to_acc(kr[d]);
    out[c] = acc * mul;
  }
  fill(out + n, np - n, A(0));
}

// (q + v) * mul for `rows` rows into dst (ld columns, zero past D).
template <class S, class A>
void rel_pos_pack_q(const S* q, int64_t qrs, int64_t rows, int64_t D, const A* v, A mul, A* dst, int64_t ld) {
  for (int64_t r = 0; r < rows; ++r) {
    const S* src = q + r * qrs;
    A* d = dst + r * ld;
    for (int64_t c = 0; c < D; ++c) d[c] = (to_acc(src[c]) + (v ? v[c] : A(0))) * mul;
    fill(d + D, ld - D, A(0));
  }
}

// s[r][c] += g[r][off_r + c] + uk[c] over c < np (whole vectors), for m rows.
template <class A>
void rel_pos_add_rows(int64_t m, int64_t step, int64_t np, const A* g, int64_t ldg, const A* uk, A* s, int64_t ldk) {
  using V = typename Simd<A>::V;
  constexpr int W = Simd<A>::W;
  for (int64_t r = 0; r < m; ++r) {
    const A* gr = g + r * ldg + step * (m - 1 - r);
    A* sr = s + r * ldk;
    if (uk) {
      for (int64_t c = 0; c < np; c += W) vstore(sr + c, vload<V>(sr + c) + vload<V>(gr + c) + vload<V>(uk + c));
    } else {
      for (int64_t c = 0; c < np; c += W) vstore(sr + c, vload<V>(sr + c) + vload<V>(gr + c));
    }
  }
}

// ---------------------------------------------------------------------------
// Forward.

template <class S, class A>
class RelPosForward {
 public:
  RelPosForward(const AttentionKernelParams& p, int64_t bq, int64_t bk)
      : D_(p.head_dim),
        dp_(round_up(std::max<int64_t>(p.head_dim, 1), Simd<A>::W)),
        ldg_(round_up(bk + bq, Simd<A>::W) + Simd<A>::W),
        arena_(Arena<A>::need({bq * dp_, p.head_dim * round_up(bk + bq, Simd<A>::W), bq * ldg_,
                               round_up(p.seqlen_k, Simd<A>::W) + bk + Simd<A>::W, dp_, dp_})) {
    qv_ = arena_.take(bq * dp_);
    pt_ = arena_.take(p.head_dim * round_up(bk + bq, Simd<A>::W));
    g_ = arena_.take(bq * ldg_);
    uk_ = arena_.take(round_up(p.seqlen_k, Simd<A>::W) + bk + Simd<A>::W);
    ua_ = arena_.take(dp_);
    va_ = arena_.take(dp_);
    fill(g_, bq * ldg_, A(0));  // lanes past a band hold finite values only
  }

  // Rows [r0, r0 + m) of (b, h) (q: the head's first row, k: its kv head's
  // first row, kv_len its entry's kv extent), their scores in the units of
  // mul times the raw ones.
  void begin(const AttentionKernelParams& p, int64_t b, int64_t h, const S* q, int64_t qrs, int64_t r0, int64_t m,
             const S* k, int64_t krs, int64_t kv_len, A mul) {
    head_ = rel_pos_head<S>(p, b, h);
    r0_ = r0, m_ = m, held_ = 0;
    if (head_.v)
      for (int64_t d = 0; d < D_; ++d) va_[d] = static_cast<A>(head_.v[d]);
    rel_pos_pack_q(q + r0 * qrs, qrs, m, D_, head_.v ? va_ : static_cast<const A*>(nullptr), mul, qv_, dp_);
    if (head_.u && (b != key_b_ || h != key_h_)) {  // u . k once per head and task range
      for (int64_t d = 0; d < D_; ++d) ua_[d] = static_cast<A>(head_.u[d]);
      const int64_t len = round_up(p.seqlen_k, Simd<A>::W) + Simd<A>::W;
      rel_pos_u_dot_k(ua_, k, krs, kv_len, len, D_, mul, uk_);
      key_b_ = b, key_h_ = h;
    }
  }

  // Adds the term to the scores s (m rows, ldk apart) of kv positions
  // [j0, j0 + np), n of them valid; the lanes past n get finite values.
  void add(int64_t j0, int64_t n, int64_t np, A* s, int64_t ldk) {
    constexpr int W = Simd<A>::W;
    const RelPosBand band = rel_pos_band(head_.center, head_.step, r0_, m_, j0, n);
    // The columns the last band shares with this one move to the front.
    int64_t keep = 0;
    if (held_ > 0 && band.start >= start_ && band.start < start_ + held_) {
      const int64_t shift = band.start - start_;
      keep = std::min(start_ + held_ - band.start, band.width);
      if (shift > 0)
        for (int64_t r = 0; r < m_; ++r) std::memmove(g_ + r * ldg_, g_ + r * ldg_ + shift, sizeof(A) * keep);
    }
    if (const int64_t nc = band.width - keep; nc > 0) {
      const int64_t ncp = round_up(nc, W);
      pack_transposed(strided_rows(head_.table + (band.start + keep) * head_.trs, head_.trs), nc, ncp, D_, pt_);
      gemm_set(m_, ncp, D_, qv_, dp_, panel_major(pt_, D_), g_ + keep, ldg_);
    }
    start_ = band.start, held_ = band.width;
    rel_pos_add_rows(m_, head_.step, np, g_, ldg_, head_.u ? uk_ + j0 : nullptr, s, ldk);
  }

 private:
  int64_t D_, dp_, ldg_;
  Arena<A> arena_;
  A *qv_, *pt_, *g_, *uk_, *ua_, *va_;
  RelPosHead<S> head_;
  int64_t r0_ = 0, m_ = 0;
  int64_t start_ = 0, held_ = 0;       // g_ holds band columns [start_, start_ + held_)
  int64_t key_b_ = -1, key_h_ = -1;   // whose u . k uk_ holds
};

// ---------------------------------------------------------------------------
// Backward.

template <class S, class A>
class RelPosBackward {
 public:
  RelPosBackward(const AttentionKernelParams& p, int64_t bq, int64_t bk, int64_t chunk_len)
      : D_(p.head_dim),
        dp_(round_up(std::max<int64_t>(p.head_dim, 1), Simd<A>::W)),
        bwmax_(round_up(bk + bq, Simd<A>::W)),
        ldg_(bwmax_ + Simd<A>::W),
        span_max_(chunk_len + p.seqlen_q),
        arena_(Arena<A>::need({p.seqlen_q * dp_, D_ * bwmax_, bwmax_ * round_up(dp_, panel_width<A>()), bq * ldg_,
                               chunk_len + bk + Simd<A>::W, span_max_ * dp_, span_max_, dp_, dp_, dp_, dp_,
                               bk + Simd<A>::W})) {
    qv_ = arena_.take(p.seqlen_q * dp_);
    pt_ = arena_.take(D_ * bwmax_);
    pr_ = arena_.take(bwmax_ * round_up(dp_, panel_width<A>()));
    g_ = arena_.take(bq * ldg_);
    uk_ = arena_.take(chunk_len + bk + Simd<A>::W);
    acc_ = arena_.take(span_max_ * dp_);
    cg_ = arena_.take(span_max_);
    ua_ = arena_.take(dp_);
    va_ = arena_.take(dp_);
    du_ = arena_.take(dp_);
    dv_ = arena_.take(dp_);
    cs_ = arena_.take(bk + Simd<A>::W);
    fill(g_, bq * ldg_, A(0));
    rows_.resize(static_cast<size_t>(std::max(bq, bwmax_)) * 2);
  }

  // Head h of a task over rows [i_start, i_end) (q: the head's first row)
  // and kv positions [kc0, kend) (k: the kv head's first row).
  void begin(const AttentionKernelParams& p, int64_t b, int64_t h, const S* q, int64_t qrs, int64_t i_start,
             int64_t i_end, const S* k, int64_t krs, int64_t kc0, int64_t kend) {
    head_ = rel_pos_head<S>(p, b, h);
    i_start_ = i_start, kc0_ = kc0;
    for (int64_t d = 0; d < D_; ++d) {
      ua_[d] = head_.u ? static_cast<A>(head_.u[d]) : A(0);
      va_[d] = head_.v ? static_cast<A>(head_.v[d]) : A(0);
    }
    rel_pos_pack_q(q + i_start * qrs, qrs, i_end - i_start, D_, head_.v ? va_ : static_cast<const A*>(nullptr), A(1),
                   qv_, dp_);
    if (head_.u) rel_pos_u_dot_k(ua_, k + kc0 * krs, krs, kend - kc0, kend - kc0 + Simd<A>::W, D_, A(1), uk_);
    base_ = head_.center + kc0 - head_.step * (i_end - 1);
    span_ = (kend - kc0) + head_.step * (i_end - 1 - i_start);
    fill(acc_, span_ * dp_, A(0));
    fill(cg_, span_, A(0));
    fill(du_, dp_, A(0));
  }

  // The recomputed raw scores s of rows [i0, i0 + mm) and kv tile [j0, j0 + n) gain the term.
  void add_scores(int64_t i0, int64_t mm, int64_t j0, int64_t n, int64_t np, A* s, int64_t ldk) {
    const RelPosBand band = rel_pos_band(head_.center, head_.step, i0, mm, j0, n);
    const int64_t ncp = round_up(band.width, Simd<A>::W);
    pack_transposed(strided_rows(head_.table + band.start * head_.trs, head_.trs), band.width, ncp, D_, pt_);
    int64_t* cb = rows_.data();
    int64_t* ce = cb + mm;
    for (int64_t r = 0; r < mm; ++r) cb[r] = head_.step * (mm - 1 - r), ce[r] = cb[r] + n;
    gemm_set(mm, ncp, D_, qv_ + (i0 - i_start_) * dp_, dp_, panel_major(pt_, D_), g_, ldg_,
             Ragged{ce, nullptr, nullptr, cb});
    // Each row reads its diagonal up to np: lanes the product left unset hold
    // finite values (g_ starts zeroed) and meet the tile's mask.
    rel_pos_add_rows(mm, head_.step, np, g_, ldg_, head_.u ? uk_ + (j0 - kc0_) : nullptr, s, ldk);
  }

  // A kv tile of np positions (whole vectors) begins: its column sums of dS start at 0.
  void begin_tile(int64_t np) { fill(cs_, np, A(0)); }

  // The same step's dS (ds: [mm][ldk], 0 outside each row's positions):
  // dq (the block's rows, [mm][dp]) += dG P; the tile's column sums of dS
  // and the task's d(table), d(v) sums gain theirs.
  void add_grads(int64_t i0, int64_t mm, int64_t j0, int64_t n, int64_t np, const A* ds, int64_t ldk, A* dq) {
    using V = typename Simd<A>::V;
    constexpr int W = Simd<A>::W;
    if (head_.u)  // u's term: the column sums of dS (end_tile)
      for (int64_t r = 0; r < mm; ++r)
        for (int64_t c = 0; c < np; c += W) vstore(cs_ + c, vload<V>(cs_ + c) + vload<V>(ds + r * ldk + c));
    const RelPosBand band = rel_pos_band(head_.center, head_.step, i0, mm, j0, n);
    const int64_t ncp = round_up(band.width, Simd<A>::W);
    // dG: row r's dS on its diagonal, zero elsewhere.
    for (int64_t r = 0; r < mm; ++r) {
      A* gr = g_ + r * ldg_;
      const int64_t off = head_.step * (mm - 1 - r);
      fill(gr, off, A(0));
      std::memcpy(gr + off, ds + r * ldk, sizeof(A) * np);
      fill(gr + off + np, ncp - off - np, A(0));
    }
    int64_t* kb = rows_.data();
    int64_t* ke = kb + mm;
    for (int64_t r = 0; r < mm; ++r) kb[r] = head_.step * (mm - 1 - r), ke[r] = kb[r] + n;
    // dQ += dG P (the band's rows as B).
    pack_rows_panels(strided_rows(head_.table + band.start * head_.trs, head_.trs), band.width, D_, bwmax_, pr_);
    gemm_add(mm, dp_, band.width, g_, ldg_, panel_major(pr_, bwmax_), dq, dp_, Ragged{nullptr, kb, ke});
    // d(table) rows of the band += dG^T (Q + v): band column c gets rows
    // [mm - 1 - c, mm - 1 - c + n) (step 1), every row (step 0).
    int64_t* tb = rows_.data();
    int64_t* te = tb + band.width;
    for (int64_t c = 0; c < band.width; ++c) {
      tb[c] = head_.step ? std::clamp<int64_t>(mm - 1 - c, 0, mm) : 0;
      te[c] = head_.step ? std::clamp<int64_t>(mm - 1 - c + n, 0, mm) : mm;
    }
    A* acc = acc_ + (band.start - base_) * dp_;
    gemm_add_at(band.width, dp_, mm, g_, ldg_, row_major(qv_ + (i0 - i_start_) * dp_, dp_), acc, dp_,
                Ragged{nullptr, tb, te});
    // v's term: the band's column sums of dG (row r's run of dS on its diagonal).
    A* cg = cg_ + (band.start - base_);
    for (int64_t r = 0; r < mm; ++r) {
      const A* dr = ds + r * ldk;
      A* at = cg + head_.step * (mm - 1 - r);
      for (int64_t c = 0; c < n; ++c) at[c] += dr[c];
    }
  }

  // The tile [j0, j0 + n) is done: dk (its rows, [n][dp]) += colsum(dS) u, and
  // d(u) gains colsum(dS) . K (k: the kv head's first row).
  void end_tile(int64_t j0, int64_t n, A* dk, const S* k, int64_t krs) {
    if (!head_.u) return;
    for (int64_t c = 0; c < n; ++c) {
      const A w = cs_[c];
      A* dkr = dk + c * dp_;
      const S* kr = k + (j0 + c) * krs;
      for (int64_t d = 0; d < D_; ++d) {
        dkr[d] += w * ua_[d];
        du_[d] += w * to_acc(kr[d]);
      }
    }
  }

  // Adds the head's sums, times scale, to d(table), d(u) and d(v).
  void end(const AttentionKernelParams& p, int64_t b, int64_t h, A scale) {
    const RelPosParams& r = p.score.rel_pos;
    const int64_t bh = b * p.heads + h;
    if (r.dtable) {
      A* dt = static_cast<A*>(r.dtable) + r.table.offsets[bh] + base_ * head_.trs;
      for (int64_t x = 0; x < span_; ++x)
        for (int64_t d = 0; d < D_; ++d)
          std::atomic_ref<A>(dt[x * head_.trs + d]).fetch_add(acc_[x * dp_ + d] * scale, std::memory_order_relaxed);
    }
    if (r.dv) {
      fill(dv_, dp_, A(0));
      for (int64_t x = 0; x < span_; ++x) {
        const A w = cg_[x];
        if (w == A(0)) continue;
        const S* row = head_.table + (base_ + x) * head_.trs;
        for (int64_t d = 0; d < D_; ++d) dv_[d] += w * to_acc(row[d]);
      }
      for (int64_t d = 0; d < D_; ++d)
        std::atomic_ref<double>(r.dv[bh * D_ + d]).fetch_add(static_cast<double>(dv_[d] * scale), std::memory_order_relaxed);
    }
    if (r.du)
      for (int64_t d = 0; d < D_; ++d)
        std::atomic_ref<double>(r.du[bh * D_ + d]).fetch_add(static_cast<double>(du_[d] * scale), std::memory_order_relaxed);
  }

 private:
  int64_t D_, dp_, bwmax_, ldg_, span_max_;
  Arena<A> arena_;
  A *qv_, *pt_, *pr_, *g_, *uk_, *acc_, *cg_, *ua_, *va_, *du_, *dv_, *cs_;
  std::vector<int64_t> rows_;  // Ragged bounds of a step
  RelPosHead<S> head_;
  int64_t i_start_ = 0, kc0_ = 0, base_ = 0, span_ = 0;
};
