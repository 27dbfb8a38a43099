// Forward pass: tiled online softmax per block of query rows, and its
// decoding form (few query rows over a long kv cache): the query heads that
// share a kv head folded into one block, so that each kv tile is read once
// for all of them, and the cache split into chunks whose partial results
// merge exactly by their softmax statistics.
// A part of cpu/flash_attention_impl.h, which says what includes it and how.
#ifndef DIMATTN_CPU_FLASH_PARTS
#error "included by cpu/flash_attention_impl.h only"
#endif

// ---------------------------------------------------------------------------
// The kv rows of a call.

// The k (or v) rows of batch entry b and kv head hk: strided, or through
// the entry's row of a paged cache's block table (attention_params.h's KvPages).
template <class S>
Rows<S> kv_rows(const AttentionKernelParams& p, const void* data, const ElementStrides& st, int64_t block_stride,
                int64_t b, int64_t hk) {
  const S* base = static_cast<const S*>(data) + hk * st.head;
  if (!p.pages.on()) return strided_rows(base + b * st.batch, st.row);
  const int64_t bs = p.pages.block_size;
  const int shift = (bs & (bs - 1)) == 0 ? __builtin_ctzll(static_cast<unsigned long long>(bs)) : -1;
  return Rows<S>{base, st.row, p.pages.block_table + b * p.pages.table_stride, bs, block_stride, 0, shift};
}

// ---------------------------------------------------------------------------
// Forward.

// One query head of a forward block (BlockRows): its mask and score
// variants, and its valid rows [r0, rv) at block rows [row0, row0 + rv - r0).
template <class A>
struct BlockHead {
  EntryMask mask;
  ScoreMod<A> masked, unmasked;  // unmasked: for the full tiles of the bool mask and segments
  uint32_t bh;
  int64_t h, rv, row0;
  TileClass cls;  // of the current tile
};

template <class S, class A>
struct ForwardScratch {
  using Operands = ForwardOperands<S, A>;
  int64_t bq, bk, ldk, dvp;
  // Packed kv tiles (ForwardOperands' slots). A task range usually holds
  // several query blocks of one kv head (and the GQA heads sharing it), so
  // the slots keep every tile of the current (b, kv head) when that fits the
  // budget, and each tile is packed once per range instead of once per query
  // block. Otherwise one slot is repacked. Decoding reads no tile twice
  // (!reuse): its products read the rows in place (direct.h, the row
  // products), the one slot holding at most a tile's rows converted to A.
  int64_t slots;
  int64_t key_b = -1, key_hk = -1;  // whose tiles the slots hold
  int64_t packed = 0;               // many slots: tiles [0, packed) are ready
  int64_t single = -1;              // one slot: the tile it holds
  Arena<A> arena;
  Operands ops;
  A *s, *o, *m, *l, *z;
  // Decoding (!reuse): q's columns and the transposed scores of the row
  // products (ForwardOperands::kRowProducts), [D][bqc] and [ldk][bqc].
  int64_t bqc;
  A *qc = nullptr, *st = nullptr;
  std::vector<int64_t> nv;  // per row: end of its valid positions in the current tile
  std::vector<int64_t> lb;  // per row: start of them (windows, segment runs)
  std::vector<BlockHead<A>> heads;  // of the current block (at most one per row)

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
  // reuse: whether tiles may be read again by the task range's next block.
  ForwardScratch(const AttentionKernelParams& p, int64_t bq_, int64_t bk_, bool reuse)
      : bq(bq_),
        bk(bk_),
        ldk(round_up(bk_, Simd<A>::W)),
        dvp(round_up(std::max<int64_t>(p.head_dim_v, 1), Simd<A>::W)),
        slots(reuse ? slots_for(p, bq, bk, ldk, dvp) : 1),
        arena(Operands::need(bq, bk, p.head_dim, ldk, dvp, slots) +
              Arena<A>::need({bq * ldk, bq * dvp, bq, bq, ldk}) +
              (reuse ? 0 : Arena<A>::need({p.head_dim * round_up(bq, Simd<A>::W), ldk * round_up(bq, Simd<A>::W)}))),
        ops(arena, bq, bk, p.head_dim, ldk, dvp, slots),
        bqc(round_up(bq, Simd<A>::W)) {
    s = arena.take(bq * ldk);
    o = arena.take(bq * dvp);
    m = arena.take(bq);
    l = arena.take(bq);
    z = arena.take(ldk);
    if (!reuse) {
      qc = arena.take(p.head_dim * bqc);
      st = arena.take(ldk * bqc);
    }
    nv.resize(static_cast<size_t>(bq));
    lb.resize(static_cast<size_t>(bq));
    heads.resize(static_cast<size_t>(bq));
  }

  // Makes kv tile t of (b, hk) available and returns its slot. A tile holds
  // positions [t * bk, min((t + 1) * bk, kv_len)), zero-padded to whole
  // vectors, whatever prefix of it the asking block uses.
  int64_t tile(const Rows<S>& k, const Rows<S>& v, int64_t Dv, int64_t kv_len, int64_t b, int64_t hk, int64_t t) {
    if (key_b != b || key_hk != hk) {
      key_b = b, key_hk = hk, packed = 0, single = -1;
    }
    auto pack = [&](int64_t tt, int64_t slot) {
      const int64_t j0 = tt * bk, n = std::min(bk, kv_len - j0);
      ops.pack_tile(slot, k.from(j0), v.from(j0), n, Dv);
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

// Output row and lse from a row's softmax state: max m (log2 units), sum l,
// unnormalised o. A row that attended nothing (l = 0, and no sink) gets 0
// and lse -inf; a NaN sum falls through: NaN in, NaN out.
template <class S, class A>
void write_row(A m, A l, const A* o, A keep_scale, int64_t Dv, S* out, A* lse) {
  if (l == A(0)) {
    for (int64_t c = 0; c < Dv; ++c) from_acc(A(0), out + c);
    if (lse) *lse = -std::numeric_limits<A>::infinity();
    return;
  }
  const A inv = keep_scale / l;
  for (int64_t c = 0; c < Dv; ++c) from_acc(o[c] * inv, out + c);
  if (lse) *lse = (m + std::log2(l)) * static_cast<A>(0.6931471805599453);
}

// The query rows of a forward block: rows [r0, r1) of each of `heads` query
// heads h0, h0 + 1, ... of batch entry b, all of one kv head. Several heads
// (decoding: a GQA group) are folded into one block, head after head, each
// with the rows it has (padding rows left out).
struct BlockRows {
  int64_t b, h0, heads, r0, r1;
};

// Where a block's softmax state goes instead of the output when it covers a
// chunk of the kv positions (forward_decode): per block row slot g * (r1 -
// r0) + (i - r0) of head g and query row i, its running max m (log2 units),
// sum l and unnormalised output o ([dvp] per slot).
template <class A>
struct ChunkState {
  A *m, *l, *o;
  bool sink;    // whether this chunk's state includes the sink logit (the first chunk's does)
  bool resume;  // the rows continue from this state (a chunk computed tile by tile) instead of starting afresh
};

// Blocks rows of br over kv positions [c0, c1) (c0 a multiple of bk):
// writes out and lse, or (state != nullptr) the rows' softmax state.
// rel: the relative positions' term (rel_pos.h) of a one-head block, or nullptr.
// after: k rows that the products reading in place (decoding) ask towards L2
// during the last tile, as they ask the next tile's during the others: the
// first rows of the caller's next block, whose first tile would otherwise
// come from memory unasked.
template <class S, class A>
void forward_block(const AttentionKernelParams& p, const DropoutSpec<A>& drop, const MaskTiles& tiles,
                   const BlockRows& br, int64_t c0, int64_t c1, ForwardScratch<S, A>& w, RelPosForward<S, A>* rel,
                   const ChunkState<A>* state, const RowsAhead<S>& after = {}) {
  constexpr int W = Simd<A>::W;
  constexpr A kInf = std::numeric_limits<A>::infinity();
  const int64_t D = p.head_dim, Dv = p.head_dim_v, dvp = w.dvp, ldk = w.ldk;
  const int64_t b = br.b, r0 = br.r0, r1 = br.r1, hk = br.h0 / p.group_size();
  using Operands = ForwardOperands<S, A>;
  Operands& ops = w.ops;
  const Rows<S> k = kv_rows<S>(p, p.k, p.k_strides, p.pages.k_block_stride, b, hk);
  const Rows<S> v = kv_rows<S>(p, p.v, p.v_strides, p.pages.v_block_stride, b, hk);
  const int64_t qrs = p.q_strides.row, ors = p.out_strides.row;
  // Scores in log2 units: exp(scale * q.k) = 2^(q' . k) with q' = q * scale * log2(e).
  const A qmul = static_cast<A>(p.scale * 1.4426950408889634);

  // The block's heads: their masks and score variants, and their valid rows
  // [r0, rv) at block rows [row0, row0 + rv - r0).
  BlockHead<A>* const heads = w.heads.data();
  int64_t m = 0, kv_lo = std::numeric_limits<int64_t>::max(), kv_hi = 0, kv_len = 0;
  for (int64_t g = 0; g < br.heads; ++g) {
    BlockHead<A>& hd = heads[g];
    hd.h = br.h0 + g;
    hd.bh = static_cast<uint32_t>(b * p.heads + hd.h);
    // Segments in runs bound each row's range instead of a test per element.
    hd.mask = tiles.bounded(entry_mask_of(p, b, hd.h), b * p.heads + hd.h);
    hd.masked = tiles.score_mod<A>(p, hd.mask, b, hd.h);
    hd.unmasked = hd.masked.unmasked();
    hd.rv = std::max(r0, std::min(r1, hd.mask.q_len));
    hd.row0 = m;
    kv_len = hd.mask.kv_len;
    if (hd.rv > r0) {
      m += hd.rv - r0;
      kv_lo = std::min(kv_lo, hd.mask.lo_min(r0, hd.rv));
      kv_hi = std::max(kv_hi, hd.mask.hi_max(r0, hd.rv));
    }
  }
  // Few rows (decoding): the direct products (ops.direct_scores, direct.h)
  // read k and v rows in place, no packing. v's rows are read in whole
  // vectors, so Dv must be a multiple of the vector width; Dv = 0 (an empty
  // value feature dim) packs instead: the padded width of an empty v would be
  // read past its end (found by fuzz_dot_attention).
  const bool direct = m <= cpu_flash::decode_direct_rows() && Dv > 0 && Dv % W == 0;
  for (int64_t g = 0; g < br.heads; ++g) {
    const BlockHead<A>& hd = heads[g];
    if (hd.rv <= r0) continue;
    const Rows<S> q = strided_rows(static_cast<const S*>(p.q) + b * p.q_strides.batch + hd.h * p.q_strides.head +
                                       r0 * qrs,
                                   qrs);
    ops.pack_q(q, hd.rv - r0, qmul, hd.row0);
  }
  // More rows over tiles that no other block reads: the row products
  // (ForwardOperands::kRowProducts), no packing. v's rows are read in whole
  // vectors, as the direct products read them.
  const bool row_products = !direct && Operands::kRowProducts && w.st && Dv > 0 && Dv % W == 0;
  const int64_t mq = round_up(m, W);
  if constexpr (Operands::kRowProducts)
    if (row_products) ops.pack_q_columns(m, mq, w.qc);
  // What the products' scores are still to be multiplied by.
  const A smul = ops.score_mul();
  if (rel) {
    const S* q = static_cast<const S*>(p.q) + b * p.q_strides.batch + br.h0 * p.q_strides.head;
    rel->begin(p, b, br.h0, q, qrs, r0, m, k.base, k.rs, kv_len, qmul / smul);
  }
  // A sink logit starts each row's softmax: weight 2^(sink - max) in the sum.
  const bool sink = p.score.sinks.on() && (!state || state->sink);
  for (int64_t g = 0; g < br.heads; ++g) {
    const BlockHead<A>& hd = heads[g];
    if (state && state->resume) {  // where the chunk's earlier tiles left the rows
      for (int64_t i = r0; i < hd.rv; ++i) {
        const int64_t slot = g * (r1 - r0) + i - r0, r = hd.row0 + i - r0;
        w.m[r] = state->m[slot], w.l[r] = state->l[slot];
        std::copy(state->o + slot * dvp, state->o + (slot + 1) * dvp, w.o + r * dvp);
      }
      continue;
    }
    fill(w.m + hd.row0, hd.rv - r0, sink ? sink_log2_of<A>(p.score, b, hd.h) : -kInf);
    fill(w.l + hd.row0, hd.rv - r0, sink ? A(1) : A(0));
    fill(w.o + hd.row0 * dvp, (hd.rv - r0) * dvp, A(0));
  }

  const int64_t kv_end = std::min(kv_hi, c1);

  for (int64_t j0 = std::max(c0, m > 0 ? kv_lo / w.bk * w.bk : c1); j0 < kv_end; j0 += w.bk) {
    const int64_t n = std::min(w.bk, kv_end - j0), np = round_up(n, W);
    // The class of each head's rows under the bool mask and segments: nothing
    // allowed (no products, no exponentials), everything (no per-element
    // mask), or some. Rows cross their limit in a tile (causal diagonal,
    // per-row lengths, a window's left edge, a segment run's ends) where the
    // mask does not cover it: there row r attends positions [lb[r], nv[r])
    // of the tile ([n, 0): none), and the products skip the blocks outside
    // every row's range.
    bool bounded = false, any = false;
    for (int64_t g = 0; g < br.heads; ++g) {
      BlockHead<A>& hd = heads[g];
      hd.cls = tiles.on() && hd.rv > r0 ? tiles.of(hd.bh, r0, hd.rv, j0) : TileClass::partial;
      if (hd.rv > r0 && hd.cls != TileClass::empty) any = true;
      bounded = bounded || hd.cls == TileClass::empty || !hd.mask.covers(r0, hd.rv, j0, j0 + n);
    }
    if (!any) continue;
    const int64_t *lbs = nullptr, *nvs = nullptr;
    if (bounded) {
      for (int64_t g = 0; g < br.heads; ++g) {
        const BlockHead<A>& hd = heads[g];
        row_spans(hd.mask, r0, hd.rv - r0, j0, n, w.lb.data() + hd.row0, w.nv.data() + hd.row0);
        if (hd.cls == TileClass::empty)
          for (int64_t r = hd.row0; r < hd.row0 + hd.rv - r0; ++r) w.lb[r] = n, w.nv[r] = 0;
      }
      lbs = w.lb.data(), nvs = w.nv.data();
    }
    const Rows<S> kt = k.from(j0), vt = v.from(j0), kn = k.from(j0 + w.bk), vn = v.from(j0 + w.bk);
    const int64_t next_n = std::min(w.bk, kv_end - j0 - w.bk);  // the next tile's positions (<= 0: none)
    typename Operands::VMat vmat{};
    // What the products read in place ask towards L2 meanwhile: the tile's v
    // rows during the scores, the next tile's k rows during P V.
    const RowsAhead<S> v_now{&vt, n, Dv * static_cast<int64_t>(sizeof(S))},
        k_next = next_n > 0 ? RowsAhead<S>{&kn, next_n, D * static_cast<int64_t>(sizeof(S))} : after;
    if (direct) {
      ops.direct_scores(m, n, kt, w.s, v_now);
    } else if (row_products) {
      if constexpr (Operands::kRowProducts) {
        ops.row_scores(m, n, np, kt, w.qc, mq, w.st, w.s, LineStream<S>(v_now));
      }
    } else {
      const int64_t slot = w.tile(k, v, Dv, kv_len, b, hk, j0 / w.bk);
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
    // A next tile not packed yet (decoding's blocks, a head's first block):
    // its rows towards L2, spread over the rows' softmax below, so that its
    // packing reads from L2 instead of memory. Multi-query decoding (B = 1,
    // 32 heads over one, 32k positions): float32 5.9 -> 5.0 ms, bfloat16
    // 3.1 -> 2.4 ms; prefill unchanged (kernel_bench; AMD EPYC Zen 4, 2 threads).
    const int64_t ahead_n = !direct && !row_products && next < 0 ? next_n : 0;
    const RowsAhead<S> k_ahead{&kn, ahead_n, D * static_cast<int64_t>(sizeof(S))},
        v_ahead{&vn, ahead_n, Dv * static_cast<int64_t>(sizeof(S))};
    // Row r (query row i of head hd) weights in srow (its scores on entry),
    // zero up to np past its positions.
    auto row_weights = [&](const BlockHead<A>& hd, int64_t r, int64_t i, A* srow) {
      const int64_t nv = bounded ? nvs[r] : n, lb = bounded ? w.lb[r] : 0;
      if (nv <= lb) {  // nothing to attend here: zero weights, state unchanged
        fill(srow, np, A(0));
        return;
      }
      const ScoreMod<A>& mod = hd.cls == TileClass::full ? hd.unmasked : hd.masked;
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
        apply_score_mods(mod, srow, static_cast<A*>(nullptr), lb, nv, mul, i, j0);
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
      // Coarse exponentials only for weights rounded to bfloat16.
      const A sum = exp2_row<Operands::kRoundedWeights>(sr, nr, mul, mnew);
      fill(srow, lb0, A(0));
      fill(srow + npr, np - npr, A(0));  // read by P V up to the row block's longest prefix
      w.l[r] = w.l[r] * alpha + sum;
      if (alpha != A(1)) scale_row(w.o + r * dvp, dvp, alpha);
      w.m[r] = mnew;
      // Dropout after the normaliser's sum: kept weights only reach O.
      if (row_dropout) {
        drop.row_factors(hd.bh, static_cast<uint32_t>(i), j0 + lb0, nv - lb0, A(1), w.z);
        fill(w.z + (nv - lb0), npr - nv, A(0));
        mul_rows(sr, w.z, nr);
      } else if (drop.on) {
        mul_rows(sr, w.z + lb0, nr);
      }
    };
    for (int64_t g = 0; g < br.heads; ++g) {
      const BlockHead<A>& hd = heads[g];
      for (int64_t i = r0; i < hd.rv; ++i) {
        const int64_t r = hd.row0 + i - r0;
        if (next >= 0) ops.prefetch_tile(next, r, m);
        for (int64_t c = ahead_n * r / m, ce = ahead_n * (r + 1) / m; c < ce; ++c) k_ahead.fetch(c), v_ahead.fetch(c);
        A* srow = w.s + r * ldk;
        if (hd.cls == TileClass::empty)
          fill(srow, np, A(0));
        else
          row_weights(hd, r, i, srow);
        ops.weights_ready(r, srow, np);
      }
    }
    if (direct) {
      ops.direct_pv(m, n, Dv, w.s, vt, w.o, dvp, lbs, nvs, k_next);
    } else if (row_products) {
      if constexpr (Operands::kRowProducts)
        ops.row_pv(m, n, w.s, vt, w.o, dvp, lbs, nvs, LineStream<S>(k_next));
    } else
      ops.add_pv(m, n, w.s, vmat, w.o, dvp, lbs, nvs);
  }

  for (int64_t g = 0; g < br.heads; ++g) {
    const BlockHead<A>& hd = heads[g];
    if (state) {  // the chunk's state of every row; padding rows: nothing attended
      for (int64_t i = r0; i < r1; ++i) {
        const int64_t slot = g * (r1 - r0) + i - r0, r = hd.row0 + i - r0;
        const bool valid = i < hd.rv;
        state->m[slot] = valid ? w.m[r] : -kInf;
        state->l[slot] = valid ? w.l[r] : A(0);
        if (valid)
          std::copy(w.o + r * dvp, w.o + (r + 1) * dvp, state->o + slot * dvp);
        else
          fill(state->o + slot * dvp, dvp, A(0));
      }
      continue;
    }
    S* out = static_cast<S*>(p.out) + b * p.out_strides.batch + hd.h * p.out_strides.head;
    A* lse = p.lse ? static_cast<A*>(p.lse) + b * p.lse_batch_stride + hd.h * p.lse_head_stride : nullptr;
    for (int64_t i = r0; i < r1; ++i) {
      const int64_t r = hd.row0 + i - r0;
      const bool valid = i < hd.rv;
      write_row<S, A>(valid ? w.m[r] : -kInf, valid ? w.l[r] : A(0), w.o + r * dvp, drop.keep_scale, Dv,
                      out + i * ors, lse ? lse + i : nullptr);
    }
  }
}

// Decoding: few query rows (cpu_flash::fwd_decode) over a kv cache. One
// block per (batch entry, kv head, group of its query heads): the group's
// rows share every kv tile, read once. When such blocks are too few to give
// every thread work, each kv head's positions are split into chunks of
// whole tiles (cpu_flash::decode_chunk_tiles: by shape only), each chunk's
// block leaves its rows' softmax state, and a second pass merges the
// chunks' states in chunk order: exact up to rounding, and the same on any
// pool.
template <class S, class A>
void forward_decode(const AttentionKernelParams& p, const ParallelFor& parallel_for, int64_t bq, int64_t bk) {
  const int64_t G = p.group_size(), Tq = p.seqlen_q;
  const int64_t hb = std::min(G, std::max<int64_t>(1, bq / std::max<int64_t>(Tq, 1)));
  const int64_t nhb = (G + hb - 1) / hb;  // head groups per kv head
  const int64_t blocks = p.batch * p.kv_heads * nhb;
  if (blocks == 0) return;
  // Kv heads interleaved within each position's row (a [batch, positions,
  // kv heads, D] cache, or pools of that layout): a block per kv head reads
  // 1/Hkv of every row, strides that leave memory idle. Then one task takes
  // every kv head of its chunk, tile by tile: it prefetches the next tile's
  // whole rows towards L2 (across its chunks: the next task's first tile)
  // and runs each head's block over the tile, resuming the rows' states.
  // Its chunks hold every head, so they may be Hkv times shorter.
  // Pools of small heads-outer blocks ([blocks, kv heads, block_size, D])
  // interleave the heads block by block: the same, a tile's blocks whole.
  const bool heads_in_rows = p.k_strides.head < p.k_strides.row && p.v_strides.head < p.v_strides.row;
  const bool heads_in_blocks =
      p.pages.on() && p.k_strides.head >= p.pages.block_size * p.k_strides.row &&
      p.v_strides.head >= p.pages.block_size * p.v_strides.row &&
      std::max(p.pages.k_block_stride, p.pages.v_block_stride) * static_cast<int64_t>(sizeof(S)) <= (int64_t{256} << 10);
  const bool interleaved = p.kv_heads > 1 && (heads_in_rows || heads_in_blocks);
  const int64_t ntiles = (p.seqlen_k + bk - 1) / bk;
  const int64_t chunk_tiles = interleaved ? cpu_flash::decode_chunk_tiles(p.batch * nhb, ntiles, bk, p.kv_heads)
                                          : cpu_flash::decode_chunk_tiles(blocks, ntiles, bk);
  const int64_t chunks = ntiles == 0 ? 1 : (ntiles + chunk_tiles - 1) / chunk_tiles;
  const int64_t chunk_len = chunk_tiles * bk;
  const DropoutSpec<A> drop(p);
  const MaskTiles tiles(p, bk, parallel_for);
  auto block = [&](int64_t t) {
    const int64_t b = t / (p.kv_heads * nhb), hk = t / nhb % p.kv_heads, g0 = t % nhb * hb;
    return BlockRows{b, hk * G + g0, std::min(hb, G - g0), 0, Tq};
  };
  // Block t's kv positions from c0 on, at most a tile of them within its
  // sequence: what the task before it asks towards L2 during its last tile.
  // B = 8, 32 query heads over 8 kv heads, 4k positions: 0.97x the time
  // (calls alternating in one process; Intel Xeon, family 6 model 207,
  // 2 threads).
  struct FirstRows {
    Rows<S> k;
    RowsAhead<S> ahead;
    FirstRows(const AttentionKernelParams& p, const BlockRows& br, int64_t c0, int64_t bk)
        : k(kv_rows<S>(p, p.k, p.k_strides, p.pages.k_block_stride, br.b, br.h0 / p.group_size()).from(c0)) {
      const int64_t len = p.kv_lengths ? std::min(p.seqlen_k, p.kv_lengths[br.b]) : p.seqlen_k;
      ahead = {&k, std::min(bk, len - c0), p.head_dim * static_cast<int64_t>(sizeof(S))};
    }
    FirstRows(const FirstRows&) = delete;  // ahead points into k
  };
  // Task t's block is block(t / chunks), its positions from t % chunks *
  // chunk_len on; in a range ending at t1, the rows after task t are task
  // t + 1's first (none after the last).
  auto rows_after = [&](int64_t t, int64_t t1) {
    const int64_t tn = std::min(t + 1, t1 - 1);
    return FirstRows(p, block(tn / chunks), tn % chunks * chunk_len, t + 1 < t1 ? bk : 0);
  };
  if (chunks == 1 && !interleaved) {
    parallel_for(0, blocks, [&](int64_t t0, int64_t t1) {
      ForwardScratch<S, A> w(p, bq, bk, false);
      for (int64_t t = t0; t < t1; ++t) {
        const FirstRows next = rows_after(t, t1);
        forward_block<S, A>(p, drop, tiles, block(t), 0, p.seqlen_k, w, nullptr, nullptr, next.ahead);
      }
    });
    return;
  }
  const int64_t dvp = round_up(std::max<int64_t>(p.head_dim_v, 1), Simd<A>::W);
  const int64_t slots = hb * Tq, per_chunk = slots * (dvp + 2);
  std::vector<A> states(static_cast<size_t>(blocks * chunks * per_chunk));
  auto state_of = [&](int64_t t, int64_t c) {
    A* base = states.data() + (t * chunks + c) * per_chunk;
    return ChunkState<A>{base, base + slots, base + 2 * slots, c == 0, false};
  };
  if (interleaved) {
    const int64_t per_entry = nhb * chunks;  // tasks of a batch entry: head groups x chunks
    // The rows [j0, j0 + n) of entry b, every kv head, towards L2.
    auto prefetch_tile = [&](int64_t b, int64_t j0, int64_t n) {
      const Rows<S> k = kv_rows<S>(p, p.k, p.k_strides, p.pages.k_block_stride, b, 0).from(j0);
      const Rows<S> v = kv_rows<S>(p, p.v, p.v_strides, p.pages.v_block_stride, b, 0).from(j0);
      auto towards_l2 = [](const S* from, int64_t elements) {
        prefetch_part(from, elements * static_cast<int64_t>(sizeof(S)), 0, 1);
      };
      if (heads_in_rows) {  // each row, every head
        for (int64_t r = 0; r < n; ++r) {
          towards_l2(k(r), (p.kv_heads - 1) * p.k_strides.head + p.head_dim);
          towards_l2(v(r), (p.kv_heads - 1) * p.v_strides.head + p.head_dim_v);
        }
        return;
      }
      for (int64_t r = 0, bs = p.pages.block_size; r < n;) {  // each block from the tile's first row in it, every head
        const int64_t in = (j0 + r) % bs;
        towards_l2(k(r), p.pages.k_block_stride - in * p.k_strides.row);
        towards_l2(v(r), p.pages.v_block_stride - in * p.v_strides.row);
        r += bs - in;
      }
    };
    // Task t's chunk: its entry, head group and positions [c0, c1), of which
    // [c0, len) hold the entry's cache.
    struct Chunk {
      int64_t b, g, c, c0, c1, len;
    };
    auto chunk_of = [&](int64_t t) {
      Chunk x{t / per_entry, t / chunks % nhb, t % chunks, 0, 0, 0};
      x.c0 = x.c * chunk_len, x.c1 = std::min(p.seqlen_k, (x.c + 1) * chunk_len);
      x.len = p.kv_lengths ? std::min(x.c1, p.kv_lengths[x.b]) : x.c1;
      return x;
    };
    parallel_for(0, p.batch * per_entry, [&](int64_t t0, int64_t t1) {
      ForwardScratch<S, A> w(p, bq, bk, false);
      Chunk x = chunk_of(t0);
      if (x.c0 < x.len) prefetch_tile(x.b, x.c0, std::min(bk, x.len - x.c0));
      for (int64_t t = t0; t < t1; ++t) {
        const Chunk next = t + 1 < t1 ? chunk_of(t + 1) : Chunk{};
        for (int64_t j0 = x.c0; j0 < x.c1; j0 += bk) {
          if (j0 + bk < x.len)
            prefetch_tile(x.b, j0 + bk, std::min(bk, x.len - j0 - bk));
          else if (j0 + bk >= x.c1 && next.c0 < next.len)
            prefetch_tile(next.b, next.c0, std::min(bk, next.len - next.c0));
          for (int64_t hk = 0; hk < p.kv_heads; ++hk) {
            const int64_t blk = (x.b * p.kv_heads + hk) * nhb + x.g;
            ChunkState<A> st = state_of(blk, x.c);
            st.resume = j0 > x.c0;
            forward_block<S, A>(p, drop, tiles, block(blk), j0, std::min(x.c1, j0 + bk), w, nullptr, &st);
          }
        }
        x = next;
      }
    });
  } else {
    parallel_for(0, blocks * chunks, [&](int64_t t0, int64_t t1) {
      ForwardScratch<S, A> w(p, bq, bk, false);
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t c = t % chunks;
        const ChunkState<A> st = state_of(t / chunks, c);
        const FirstRows next = rows_after(t, t1);
        forward_block<S, A>(p, drop, tiles, block(t / chunks), c * chunk_len,
                            std::min(p.seqlen_k, (c + 1) * chunk_len), w, nullptr, &st, next.ahead);
      }
    });
  }
  // Merge: M = max_c m_c, l = sum_c l_c 2^(m_c - M), o = sum_c o_c 2^(m_c - M).
  parallel_for(0, blocks, [&](int64_t t0, int64_t t1) {
    std::vector<A> o(static_cast<size_t>(dvp));
    for (int64_t t = t0; t < t1; ++t) {
      const BlockRows br = block(t);
      for (int64_t g = 0; g < br.heads; ++g) {
        const int64_t h = br.h0 + g;
        S* out = static_cast<S*>(p.out) + br.b * p.out_strides.batch + h * p.out_strides.head;
        A* lse = p.lse ? static_cast<A*>(p.lse) + br.b * p.lse_batch_stride + h * p.lse_head_stride : nullptr;
        for (int64_t i = 0; i < Tq; ++i) {
          const int64_t slot = g * Tq + i;
          A mmax = -std::numeric_limits<A>::infinity();
          for (int64_t c = 0; c < chunks; ++c) mmax = std::max(mmax, state_of(t, c).m[slot]);
          A l = 0;
          fill(o.data(), dvp, A(0));
          for (int64_t c = 0; c < chunks; ++c) {
            const ChunkState<A> st = state_of(t, c);
            // Every chunk at -inf (nothing attended, or a -inf sink): weight 1, so
            // that a NaN or the sink's 1 still reaches l.
            const A alpha = mmax == -std::numeric_limits<A>::infinity() ? A(1) : std::exp2(st.m[slot] - mmax);
            l += st.l[slot] * alpha;
            const A* oc = st.o + slot * dvp;
            for (int64_t e = 0; e < dvp; ++e) o[e] += oc[e] * alpha;
          }
          write_row<S, A>(mmax, l, o.data(), drop.keep_scale, p.head_dim_v, out + i * p.out_strides.row,
                          lse ? lse + i : nullptr);
        }
      }
    }
  });
}

template <class S, class A>
void forward(const AttentionKernelParams& p, const ParallelFor& parallel_for) {
  const int64_t bq = cpu_flash::fwd_block_q(p.head_dim), bk = cpu_flash::fwd_block_k(p.head_dim, Simd<float>::W);
  if (cpu_flash::fwd_decode(p.seqlen_q) && !p.score.rel_pos.on()) return forward_decode<S, A>(p, parallel_for, bq, bk);
  const int64_t nqb = (p.seqlen_q + bq - 1) / bq;
  const int64_t tasks = p.batch * p.heads * nqb;
  if (tasks == 0) return;
  const DropoutSpec<A> drop(p);
  const MaskTiles tiles(p, bk, parallel_for);
  parallel_for(0, tasks, [&](int64_t t0, int64_t t1) {
    ForwardScratch<S, A> w(p, bq, bk, true);
    std::optional<RelPosForward<S, A>> rel;
    if (p.score.rel_pos.on()) rel.emplace(p, bq, bk);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t bh = t / nqb, qi = t % nqb;
      // Causal blocks cost more the later they are: alternate cheap and
      // expensive ones so that any contiguous split of the tasks is balanced.
      const int64_t blk = p.causal ? (qi % 2 == 0 ? qi / 2 : nqb - 1 - qi / 2) : qi;
      const int64_t r0 = blk * bq;
      const BlockRows br{bh / p.heads, bh % p.heads, 1, r0, std::min(r0 + bq, p.seqlen_q)};
      forward_block<S, A>(p, drop, tiles, br, 0, p.seqlen_k, w, rel ? &*rel : nullptr, nullptr);
    }
  });
}
