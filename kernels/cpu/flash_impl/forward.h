// Forward pass: tiled online softmax per query block.
// A part of cpu/flash_attention_impl.h, which says what includes it and how.
#ifndef DIMATTN_CPU_FLASH_PARTS
#error "included by cpu/flash_attention_impl.h only"
#endif

// ---------------------------------------------------------------------------
// Forward.

template <class S, class A>
struct ForwardScratch {
  using Operands = ForwardOperands<S, A>;
  int64_t bq, bk, ldk, dvp;
  // Packed kv tiles (ForwardOperands' slots). A task range usually holds
  // several query blocks of one kv head (and the GQA heads sharing it), so
  // the slots keep every tile of the current (b, kv head) when that fits the
  // budget, and each tile is packed once per range instead of once per query
  // block. Otherwise one slot is repacked.
  int64_t slots;
  int64_t key_b = -1, key_hk = -1;  // whose tiles the slots hold
  int64_t packed = 0;               // many slots: tiles [0, packed) are ready
  int64_t single = -1;              // one slot: the tile it holds
  Arena<A> arena;
  Operands ops;
  A *s, *o, *m, *l, *z;
  std::vector<int64_t> nv;  // per row: end of its valid positions in the current tile
  std::vector<int64_t> lb;  // per row: start of them (windows, segment runs)

  static int64_t slots_for(const AttentionKernelParams& p, int64_t bq, int64_t bk, int64_t ldk, int64_t dvp) {
    // A kv head's tiles are read again only by its next query block or by
    // another query head of its group; without either, one slot that stays
    // in L1/L2 beats a buffer that spills to L3.
    if (p.seqlen_q <= bq && p.group_size() == 1) return 1;
    const int64_t tiles = std::max<int64_t>(1, (p.seqlen_k + bk - 1) / bk);
    const int64_t bytes = tiles * (Operands::k_elements(p.head_dim, ldk) + Operands::v_elements(bk, dvp)) *
                          static_cast<int64_t>(sizeof(A));
    return bytes <= cpu_flash::fwd_kv_cache_bytes() ? tiles : 1;
  }
  ForwardScratch(const AttentionKernelParams& p, int64_t bq_, int64_t bk_)
      : bq(bq_),
        bk(bk_),
        ldk(round_up(bk_, Simd<A>::W)),
        dvp(round_up(std::max<int64_t>(p.head_dim_v, 1), Simd<A>::W)),
        slots(slots_for(p, bq, bk, ldk, dvp)),
        arena(Operands::need(bq, bk, p.head_dim, ldk, dvp, slots) + Arena<A>::need({bq * ldk, bq * dvp, bq, bq, ldk})),
        ops(arena, bq, bk, p.head_dim, ldk, dvp, slots) {
    s = arena.take(bq * ldk);
    o = arena.take(bq * dvp);
    m = arena.take(bq);
    l = arena.take(bq);
    z = arena.take(ldk);
    nv.resize(static_cast<size_t>(bq));
    lb.resize(static_cast<size_t>(bq));
  }

  // Makes kv tile t of (b, hk) available and returns its slot. A tile holds
  // positions [t * bk, min((t + 1) * bk, kv_len)), zero-padded to whole
  // vectors, whatever prefix of it the asking block uses.
  int64_t tile(const S* k, int64_t krs, const S* v, int64_t vrs, int64_t Dv, int64_t kv_len, int64_t b, int64_t hk,
               int64_t t) {
    if (key_b != b || key_hk != hk) {
      key_b = b, key_hk = hk, packed = 0, single = -1;
    }
    auto pack = [&](int64_t tt, int64_t slot) {
      const int64_t j0 = tt * bk, n = std::min(bk, kv_len - j0);
      ops.pack_tile(slot, k + j0 * krs, krs, v + j0 * vrs, vrs, n, Dv);
    };
    if (slots > 1) {
      for (; packed <= t; ++packed) pack(packed, packed);
      return t;
    }
    if (single != t) pack(t, 0), single = t;
    return 0;
  }
  // Tile t of the current kv head if it is packed already, else -1.
  int64_t ready(int64_t t) const { return slots > 1 && t < packed ? t : -1; }
};

// Rows [r0, r1) of (b, h).
// rel: the relative positions' term (rel_pos.h), or nullptr without them.
template <class S, class A>
void forward_block(const AttentionKernelParams& p, const DropoutSpec<A>& drop, const MaskTiles& tiles, int64_t b,
                   int64_t h, int64_t r0, int64_t r1, ForwardScratch<S, A>& w, RelPosForward<S, A>* rel) {
  constexpr int W = Simd<A>::W;
  constexpr A kInf = std::numeric_limits<A>::infinity();
  const int64_t D = p.head_dim, Dv = p.head_dim_v, dvp = w.dvp, ldk = w.ldk;
  using Operands = ForwardOperands<S, A>;
  Operands& ops = w.ops;
  // Segments in runs bound each row's range instead of a test per element.
  const EntryMask mask = tiles.bounded(entry_mask_of(p, b, h), b * p.heads + h);
  const ScoreMod<A> masked = tiles.score_mod<A>(p, mask, b, h);
  const ScoreMod<A> unmasked = masked.unmasked();  // for the full tiles of the bool mask and segments
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
  const int64_t rv = std::min(r1, mask.q_len);  // valid rows [r0, rv)
  for (int64_t i = std::max(r0, rv); i < r1; ++i) write_empty_row(i);
  if (r0 >= rv) return;
  const int64_t m = rv - r0;
  // The block attends [lo_min(r0, rv), hi_max(r0, rv)).
  const int64_t kv_end = mask.hi_max(r0, rv);

  // Scores in log2 units: exp(scale * q.k) = 2^(q' . k) with q' = q * scale * log2(e).
  const A qmul = static_cast<A>(p.scale * 1.4426950408889634);
  ops.pack_q(q + r0 * qrs, qrs, m, qmul);
  const A smul = ops.score_mul();  // what the products' scores are still to be multiplied by
  if (rel) rel->begin(p, b, h, q, qrs, r0, m, k, krs, mask.kv_len, qmul / smul);
  // A sink logit starts each row's softmax: weight 2^(sink - max) in the sum.
  fill(w.m, m, sink_log2_of<A>(p.score, b, h));
  fill(w.l, m, p.score.sinks.on() ? A(1) : A(0));
  fill(w.o, m * dvp, A(0));
  const uint32_t bh = static_cast<uint32_t>(b * p.heads + h);

  // Few rows of float32 (decoding): read k and v rows in place, no packing.
  // v's rows are the product's B operand as they are, so their padded width
  // must stay inside each row: Dv a multiple of the vector width.
  // Dv = 0 (an empty value feature dim) packs instead: the padded width of an
  // empty v would be read past its end (found by fuzz_dot_attention).
  const bool direct = Operands::kDirect && m <= 4 && Dv > 0 && Dv % W == 0;

  for (int64_t j0 = mask.lo_min(r0, rv) / w.bk * w.bk; j0 < kv_end; j0 += w.bk) {
    const int64_t n = std::min(w.bk, kv_end - j0), np = round_up(n, W);
    // The class of the block under the bool mask and segments: nothing allowed (skipped: no
    // products, no exponentials), everything (no per-element mask), or some.
    const TileClass cls = tiles.on() ? tiles.of(b * p.heads + h, r0, rv, j0) : TileClass::partial;
    if (cls == TileClass::empty) continue;
    const ScoreMod<A>& mod = cls == TileClass::full ? unmasked : masked;
    // Row r attends positions [lb[r], nv[r]) of the tile. Only tiles that
    // cross a row's limit (causal diagonal, per-row lengths, a window's left
    // edge, a segment run's ends) bound rows, and there the products skip the
    // blocks outside every row's range (rows with nothing here: [n, 0)).
    const bool bounded = !mask.covers(r0, rv, j0, j0 + n);
    const int64_t *lbs = nullptr, *nvs = nullptr;
    if (bounded) {
      row_spans(mask, r0, m, j0, n, w.lb.data(), w.nv.data());
      lbs = w.lb.data(), nvs = w.nv.data();
    }
    typename Operands::VMat vmat;
    if constexpr (Operands::kDirect) {
      if (direct) {
        scores_direct_rows(m, n, D, ops.q, k + j0 * krs, krs, w.s, ldk);
        vmat = row_major(v + j0 * vrs, vrs);
      }
    }
    if (!direct) {
      const int64_t slot = w.tile(k, krs, v, vrs, Dv, mask.kv_len, b, hk, j0 / w.bk);
      ops.scores(slot, m, np, w.s, lbs, nvs);
      vmat = ops.v_tile(slot);
    }
    if (rel) rel->add(j0, n, np, w.s, ldk);

    const bool row_dropout = drop.on && !drop.broadcast;
    if (drop.on && drop.broadcast) {
      drop.broadcast_factors(j0, n, A(1), w.z);
      fill(w.z + n, np - n, A(0));
    }
    const int64_t next = !direct && j0 + w.bk < kv_end ? w.ready(j0 / w.bk + 1) : -1;
    // Row r's weights in srow (its scores on entry), zero up to np past its positions.
    auto row_weights = [&](int64_t r, A* srow) {
      const int64_t nv = bounded ? nvs[r] : n, lb = bounded ? w.lb[r] : 0;
      if (nv <= lb) {  // nothing to attend here: zero weights, state unchanged
        fill(srow, np, A(0));
        return;
      }
      const int64_t npr = round_up(nv, W);
      // The row's work runs over whole vectors from the one holding lb,
      // sr = srow + lb0 (positions before lb0 get weight 0 at the end): a
      // row whose range starts inside the tile (a window, a segment run)
      // pays for its own positions only.
      const int64_t lb0 = lb / W * W, nr = npr - lb0;
      A* const sr = srow + lb0;
      // x = smul * s (log2 units). The variants are applied to x; without them
      // smul > 0 goes into the max and the exponentials (a factor <= 0 would
      // turn the max into a min, and 0 * -inf is NaN).
      A mul = smul;
      if (mod.on()) {  // cap, bias, ALiBi, mask
        apply_score_mods(mod, srow, static_cast<A*>(nullptr), lb, nv, mul, r0 + r, j0);
        mul = A(1);
      } else if (!(mul > A(0))) {
        scale_row(sr, nr, mul);
        mul = A(1);
      }
      fill(sr, lb - lb0, -kInf);
      fill(srow + nv, npr - nv, -kInf);
      const A mnew = std::max(w.m[r], row_max(sr, nr) * mul);
      // A mask or a -inf bias forbade all of it so far: as above. (row_max
      // skips NaN, which must still reach the output: NaN in, NaN out.)
      if (mnew == -kInf && std::none_of(srow + lb, srow + nv, [](A x) { return x != x; })) {
        fill(srow, np, A(0));
        return;
      }
      // 0 on the row's first tile; vexp2 (no library call per row and tile):
      // exactly 1 when the max is unchanged, exactly 0 from -inf.
      const A alpha = vexp2(Simd<A>::splat(w.m[r] - mnew))[0];
      const A sum = exp2_row<Operands::kRoundedWeights>(sr, nr, mul, mnew);
      fill(srow, lb0, A(0));
      fill(srow + npr, np - npr, A(0));  // read by P V up to the row block's longest prefix
      w.l[r] = w.l[r] * alpha + sum;
      if (alpha != A(1)) scale_row(w.o + r * dvp, dvp, alpha);
      w.m[r] = mnew;
      // Dropout after the normaliser's sum: kept weights only reach O.
      if (row_dropout) {
        drop.row_factors(bh, static_cast<uint32_t>(r0 + r), j0 + lb0, nv - lb0, A(1), w.z);
        fill(w.z + (nv - lb0), npr - nv, A(0));
        mul_rows(sr, w.z, nr);
      } else if (drop.on) {
        mul_rows(sr, w.z + lb0, nr);
      }
    };
    for (int64_t r = 0; r < m; ++r) {
      if (next >= 0) ops.prefetch_tile(next, r, m);
      A* srow = w.s + r * ldk;
      row_weights(r, srow);
      ops.weights_ready(r, srow, np);
    }
    ops.add_pv(m, n, w.s, vmat, w.o, dvp, lbs, nvs);
  }

  for (int64_t r = 0; r < m; ++r) {
    const int64_t i = r0 + r;
    if (w.l[r] == A(0)) {  // attended nothing, no sink (a NaN sum falls through: NaN in, NaN out)
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
  const int64_t bq = cpu_flash::fwd_block_q(p.head_dim), bk = cpu_flash::fwd_block_k(p.head_dim, Simd<float>::W);
  const int64_t nqb = (p.seqlen_q + bq - 1) / bq;
  const int64_t tasks = p.batch * p.heads * nqb;
  if (tasks == 0) return;
  const DropoutSpec<A> drop(p);
  const MaskTiles tiles(p, bk, parallel_for);
  parallel_for(0, tasks, [&](int64_t t0, int64_t t1) {
    ForwardScratch<S, A> w(p, bq, bk);
    std::optional<RelPosForward<S, A>> rel;
    if (p.score.rel_pos.on()) rel.emplace(p, bq, bk);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t bh = t / nqb, qi = t % nqb;
      // Causal blocks cost more the later they are: alternate cheap and
      // expensive ones so that any contiguous split of the tasks is balanced.
      const int64_t blk = p.causal ? (qi % 2 == 0 ? qi / 2 : nqb - 1 - qi / 2) : qi;
      const int64_t r0 = blk * bq;
      forward_block<S, A>(p, drop, tiles, bh / p.heads, bh % p.heads, r0, std::min(r0 + bq, p.seqlen_q), w,
                          rel ? &*rel : nullptr);
    }
  });
}
