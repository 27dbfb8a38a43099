// Backward pass: per (batch, kv head, kv chunk), dQ shares summed in chunk order.
// A part of cpu/flash_attention_impl.h, which says what includes it and how.
#ifndef DIMATTN_CPU_FLASH_PARTS
#error "included by cpu/flash_attention_impl.h only"
#endif

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
  plan.bk = p.score.rel_pos.on() ? cpu_flash::bwd_block_k_rel_pos(p.head_dim) : cpu_flash::bwd_block_k(p.head_dim);
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
  using Operands = BackwardOperands<S, A>;
  int64_t dp, dvp, ldk;
  Arena<A> arena;
  Operands ops;
  A *lse2, *di, *dq, *dkacc, *dvacc, *s, *dpt, *x, *z, *th;
  std::vector<int64_t> lb, nv, kbeg;  // a tile's row and column bounds, see backward_task
  BackwardScratch(const AttentionKernelParams& p, const BackwardPlan& plan)
      : dp(round_up(std::max<int64_t>(p.head_dim, 1), Simd<A>::W)),
        dvp(round_up(std::max<int64_t>(p.head_dim_v, 1), Simd<A>::W)),
        ldk(round_up(plan.bk, Simd<A>::W)),
        arena(Operands::need(p.seqlen_q, p.head_dim, p.head_dim_v, dp, dvp, plan.bk, ldk, plan.bq) +
              Arena<A>::need({p.seqlen_q, p.seqlen_q, plan.chunks == 1 ? p.seqlen_q * dp : 0, plan.chunk_len * dp,
                              plan.chunk_len * dvp, plan.bq * ldk, plan.bq * ldk, plan.bq * ldk, plan.bq * ldk,
                              p.score.capped() ? plan.bq * ldk : 0})),
        ops(arena, p.seqlen_q, p.head_dim, p.head_dim_v, dp, dvp, plan.bk, ldk, plan.bq) {
    lse2 = arena.take(p.seqlen_q);
    di = arena.take(p.seqlen_q);
    dq = arena.take(plan.chunks == 1 ? p.seqlen_q * dp : 0);
    dkacc = arena.take(plan.chunk_len * dp);
    dvacc = arena.take(plan.chunk_len * dvp);
    s = arena.take(plan.bq * ldk);
    dpt = arena.take(plan.bq * ldk);
    x = arena.take(plan.bq * ldk);
    z = arena.take(plan.bq * ldk);
    th = arena.take(p.score.capped() ? plan.bq * ldk : 0);  // tanh of the capped scores
    lb.resize(static_cast<size_t>(plan.bq));
    nv.resize(static_cast<size_t>(plan.bq));
    kbeg.resize(static_cast<size_t>(plan.bk));
  }
};

// One (b, kv head, kv chunk). share: this chunk's dQ share ([G][Tq][dp],
// unscaled), or nullptr when the chunk is the whole kv range and dq is
// written directly.
template <class S, class A>
void backward_task(const AttentionKernelParams& p, const DropoutSpec<A>& drop, const MaskTiles& tiles,
                   const BackwardPlan& plan, int64_t b, int64_t hk, int64_t chunk, A* share, BackwardScratch<S, A>& w,
                   RelPosBackward<S, A>* rel) {
  constexpr int W = Simd<A>::W;
  constexpr A kInf = std::numeric_limits<A>::infinity();
  const int64_t D = p.head_dim, Dv = p.head_dim_v, Tq = p.seqlen_q, G = p.group_size();
  const int64_t dp = w.dp, dvp = w.dvp, ldk = w.ldk;
  using Operands = BackwardOperands<S, A>;
  Operands& ops = w.ops;
  // The entry's mask bounds every head's; each head's (per-row kv lengths) below.
  const EntryMask entry = entry_mask_of(p, b);
  const int64_t kc0 = chunk * plan.chunk_len, kc1 = std::min(kc0 + plan.chunk_len, p.seqlen_k);
  const int64_t kend = std::min(kc1, entry.kv_len);  // valid positions [kc0, kend)
  // Rows that may attend some position of the chunk: [i_start, i_end).
  const Range rows_in =
      kend > kc0 ? Range{entry.rows_reaching(kc0).lo, entry.rows_reaching(kend - 1).hi} : Range{0, 0};
  const int64_t i_start = rows_in.lo, i_end = rows_in.hi;
  const bool any = !rows_in.empty();
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
    // Segments in runs bound each row's range instead of a test per element (forward.h).
    const EntryMask mask = tiles.bounded(entry_mask_of(p, b, h), b * p.heads + h);
    const ScoreMod<A> masked = tiles.score_mod<A>(p, mask, b, h);
    const ScoreMod<A> unmasked = masked.unmasked();  // for the full blocks of the bool mask and segments
    // d(bias) of this head's plane: dS itself (bias adds to the score).
    A* const dbias = p.score.dbias_plane<A>(b * p.heads + h);
    A* dq = share ? share + g * Tq * dp : w.dq;  // indexed by absolute row
    if (share) fill(share + g * Tq * dp, Tq * dp, A(0));

    if (any) {
      const S* q = static_cast<const S*>(p.q) + b * p.q_strides.batch + h * p.q_strides.head;
      const S* o = static_cast<const S*>(p.out) + b * p.out_strides.batch + h * p.out_strides.head;
      const S* dout = static_cast<const S*>(p.dout) + b * p.dout_strides.batch + h * p.dout_strides.head;
      const A* lse = static_cast<const A*>(p.lse) + b * p.lse_batch_stride + h * p.lse_head_stride;
      const int64_t rows = i_end - i_start;
      // Row-local copies, indexed by i - i_start.
      ops.pack_task_rows(strided_rows(q + i_start * p.q_strides.row, p.q_strides.row),
                         strided_rows(dout + i_start * p.dout_strides.row, p.dout_strides.row), rows);
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t i = i_start + r;
        w.lse2[r] = lse[i] * log2e;
        // D_i = rowsum(dO o O) = sum_j P_ij dP_ij (dropout included: O holds it).
        const S* orow = o + i * p.out_strides.row;
        const S* dorow = dout + i * p.dout_strides.row;
        A acc = 0;
        for (int64_t c = 0; c < Dv; ++c) acc += to_acc(dorow[c]) * to_acc(orow[c]);
        w.di[r] = acc;
      }
      if (!share) fill(dq + i_start * dp, rows * dp, A(0));
      if (rel) rel->begin(p, b, h, q, p.q_strides.row, i_start, i_end, k, krs, kc0, kend);

      for (int64_t j0 = kc0; j0 < kend; j0 += plan.bk) {
        const int64_t n = std::min(plan.bk, kend - j0), np = round_up(n, W);
        ops.pack_tile(strided_rows(k + j0 * krs, krs), strided_rows(v + j0 * vrs, vrs), n, np);
        if (rel) rel->begin_tile(np);
        A* dk_t = w.dkacc + (j0 - kc0) * dp;
        A* dv_t = w.dvacc + (j0 - kc0) * dvp;
        if (drop.on && drop.broadcast) {
          drop.broadcast_factors(j0, n, drop.keep_scale, w.z);
          fill(w.z + n, np - n, A(0));
        }
        // The tile's rows: from the first that reaches j0 to the last that
        // reaches its last position (a window's band, else every later row),
        // started at a row the products can start a block at (the rows
        // before the first reaching j0 weigh 0).
        const int64_t it_reach = std::max(i_start, mask.rows_reaching(j0).lo);
        const int64_t it0 = i_start + (it_reach - i_start) / Operands::kRowStep * Operands::kRowStep;
        const int64_t it1 = std::min(i_end, mask.rows_reaching(j0 + n - 1).hi);
        for (int64_t i0 = it0; i0 < it1; i0 += plan.bq) {
          const int64_t mm = std::min(plan.bq, it1 - i0);
          // Rows whose own kv lengths (or segment runs) end before the tile or start after it.
          if (mask.hi_max(i0, i0 + mm) <= j0 || mask.lo_min(i0, i0 + mm) >= j0 + n) continue;
          const int64_t r0 = i0 - i_start;  // the block's first row in the task's copies
          const A* lse2 = w.lse2 + (i0 - i_start);
          const A* di = w.di + (i0 - i_start);
          // The block's class under the bool mask and segments (forward.h): empty blocks add
          // nothing to any gradient.
          const TileClass cls = tiles.on() ? tiles.of(b * p.heads + h, i0, i0 + mm, j0) : TileClass::partial;
          if (cls == TileClass::empty) continue;
          const ScoreMod<A>& mod = cls == TileClass::full ? unmasked : masked;
          // Tiles that cross a row's limit (causal diagonal, per-row lengths,
          // a window's left edge, segment runs): row r attends positions
          // [lb[r], nv[r]) of the tile (row_spans; [n, 0): none), kv position
          // c is attended from local row kbeg[c] on at most.
          const bool bounded = !mask.covers(i0, i0 + mm, j0, j0 + n);
          const int64_t *nvs = nullptr, *kbeg = nullptr;
          if (bounded) {
            row_spans(mask, i0, mm, j0, n, w.lb.data(), w.nv.data());
            for (int64_t c = 0; c < n; ++c) w.kbeg[c] = std::clamp<int64_t>(mask.rows_reaching(j0 + c).lo - i0, 0, mm);
            nvs = w.nv.data();
            kbeg = w.kbeg.data();
          }
          auto lb = [&](int64_t r) { return bounded ? w.lb[r] : 0; };

          // P = exp(scale * Q K^T - lse), recomputed; 0 past each row's prefix.
          ops.scores(r0, mm, np, w.s, nvs);
          if (rel) rel->add_scores(i0, mm, j0, n, np, w.s, ldk);
          // The next q block's rows of Q, dO and dQ come from L3 for long
          // sequences: ask for them while this block computes.
          const int64_t next_rows = std::min(plan.bq, i_end - (i0 + plan.bq));
          for (int64_t r = 0; r < mm; ++r) {
            if (next_rows > 0) {
              ops.prefetch_rows(r0 + plan.bq, next_rows, r, mm);
              prefetch_part(dq + (i0 + plan.bq) * dp, next_rows * dp * static_cast<int64_t>(sizeof(A)), r, mm);
            }
            A* srow = w.s + r * ldk;
            const int64_t nv = bounded ? nvs[r] : n, lr = lb(r);
            if (nv <= lr || lse2[r] == -kInf) {
              fill(srow, np, A(0));
              continue;
            }
            if (mod.on()) {  // the forward's scores: scaled, capped, bias, ALiBi, mask
              apply_score_mods(mod, srow, mod.capped() ? w.th + r * ldk : nullptr, lr, nv, qk_mul, i0 + r, j0);
              exp2_row<Operands::kRoundedWeights>(srow, round_up(nv, W), A(1), lse2[r]);
            } else {
              exp2_row<Operands::kRoundedWeights>(srow, round_up(nv, W), qk_mul, lse2[r]);
            }
            fill(srow, lr, A(0));
            fill(srow + nv, np - nv, A(0));
          }
          // dPd = dO V^T (the gradient of the dropped-out weights); defined
          // up to each row's prefix rounded to whole vectors.
          ops.dprobs(r0, mm, np, w.dpt, nvs);
          // X = P o Z with Z = keep / (1 - p): the weights that produced O;
          // dP = dPd o Z; dS = P o (dP - D_i) in place of dP. Zero past the
          // prefix, where the transposed products below still read.
          const A* x = w.s;
          for (int64_t r = 0; r < mm; ++r) {
            using V = typename Simd<A>::V;
            const int64_t nv = bounded ? nvs[r] : n, npr = round_up(nv, W);
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
            if (dbias) {
              A* at = dbias + (i0 + r) * mod.bias_row + j0 * mod.bias_col;
              for (int64_t c = lb(r); c < nv; ++c) {
                A& e = at[c * mod.bias_col];
                if (p.score.dbias_shared)
                  std::atomic_ref<A>(e).fetch_add(drow[c], std::memory_order_relaxed);
                else
                  e += drow[c];
              }
            }
            // Through the cap, on the rows whose th the recomputation above wrote.
            if (mod.capped() && nv > lb(r) && lse2[r] != -kInf) dcapped_row(drow, w.th + r * ldk, lb(r), nv);
          }
          if (drop.on) x = w.x;
          // dV += X^T dO, dK += dS^T Q and dQ += dS K (dK, dQ scaled at the end).
          ops.accumulate(r0, mm, n, x, w.dpt, dv_t, dk_t, dq + i0 * dp, kbeg, nvs);
          if (rel) rel->add_grads(i0, mm, j0, n, np, w.dpt, ldk, dq + i0 * dp);
        }
        if (rel) rel->end_tile(j0, n, dk_t, k, krs);
      }
      if (rel) rel->end(p, b, h, scale);
    }

    if (!share) {
      S* dqo = static_cast<S*>(p.dq) + b * p.dq_strides.batch + h * p.dq_strides.head;
      for (int64_t i = 0; i < Tq; ++i) {
        S* row = dqo + i * p.dq_strides.row;
        if (any && i >= i_start && i < i_end) {
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
  if (p.score.sinks.on()) {
    // d(sink) = -sum_i P_sink(i) D_i with P_sink(i) = exp(sink - lse_i) and
    // D_i = rowsum(dO o O), per (b, h).
    parallel_for(0, p.batch * p.heads, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t b = t / p.heads, h = t % p.heads;
        const EntryMask mask = entry_mask_of(p, b);
        const S* o = static_cast<const S*>(p.out) + b * p.out_strides.batch + h * p.out_strides.head;
        const S* dout = static_cast<const S*>(p.dout) + b * p.dout_strides.batch + h * p.dout_strides.head;
        const A* lse = static_cast<const A*>(p.lse) + b * p.lse_batch_stride + h * p.lse_head_stride;
        const A sink = static_cast<A>(p.score.sinks.at(b, h));
        A acc = 0;
        for (int64_t i = 0; i < std::min(mask.q_len, Tq); ++i) {
          A di = 0;
          for (int64_t c = 0; c < p.head_dim_v; ++c)
            di += to_acc(dout[i * p.dout_strides.row + c]) * to_acc(o[i * p.out_strides.row + c]);
          acc -= std::exp(sink - lse[i]) * di;
        }
        p.score.dsinks[t] = static_cast<double>(acc);
      }
    });
  }
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

  // The mask's blocks at the backward pass's kv tile width, classified again
  // (the forward's tiles are wider; one scan of the mask's distinct planes).
  const MaskTiles tiles(p, plan.bk, parallel_for);
  parallel_for(0, groups * C, [&](int64_t t0, int64_t t1) {
    BackwardScratch<S, A> w(p, plan);
    std::optional<RelPosBackward<S, A>> rel;
    if (p.score.rel_pos.on()) rel.emplace(p, plan.bq, plan.bk, plan.chunk_len);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t grp = t / C, ci = t % C;
      // Under causal masking early kv chunks have more query rows: alternate.
      const int64_t chunk = p.causal ? (ci % 2 == 0 ? ci / 2 : C - 1 - ci / 2) : ci;
      A* share = C > 1 ? shares.get() + (grp * C + chunk) * share_len : nullptr;
      backward_task<S, A>(p, drop, tiles, plan, grp / p.kv_heads, grp % p.kv_heads, chunk, share, w,
                          rel ? &*rel : nullptr);
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
