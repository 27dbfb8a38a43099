// The score variants (soft-capping, bias, ALiBi, the boolean mask, segments) on a row
// of a score tile, in the tile's vector loop.
// A part of cpu/flash_attention_impl.h, which says what includes it and how.
#ifndef DIMATTN_CPU_FLASH_PARTS
#error "included by cpu/flash_attention_impl.h only"
#endif

// ---------------------------------------------------------------------------
// Score variants of one row: common/attention_mask.h's ScoreMod::apply, in
// its order (cap, bias, ALiBi, then the mask and segments), W lanes at a time.

// Row i of a tile whose column c is kv position j0 + c: srow[c] becomes
// apply(srow[c] * mul, i, j0 + c) for c in [lb, nv), computed in whole
// vectors from lb rounded down to nv rounded up; srow's other lanes there
// are left unspecified for the caller to fill. The bias is read at columns
// [lb rounded down, nv) (inside the call: j0 <= j < j0 + nv), the mask at
// [lb, nv).
// th, when not nullptr (soft-capping on), receives tanh(x / cap) (vtanh2,
// the backward pass's dcapped) in [lb, nv) and 0 in the vectors' other
// lanes, where dcapped(0) = 1 leaves dS as it is.
template <class A>
void apply_score_mods(const ScoreMod<A>& mod, A* srow, A* th, int64_t lb, int64_t nv, A mul, int64_t i, int64_t j0) {
  using S = Simd<A>;
  using V = typename S::V;
  constexpr int W = S::W;
  const int64_t c0 = lb / W * W, npr = round_up(nv, W);
  // Capped: tanh(x / cap) with x = s * mul, as vtanh2 of s * (mul * 2 log2(e) / cap).
  const V vmul = S::splat(mul), vcap = S::splat(mod.cap);
  const V vtanh_mul = S::splat(mod.capped() ? mul * A(2.8853900817779268) / mod.cap : A(0));
  const V vlog2e = S::splat(static_cast<A>(kScoreLog2e)), vslope = S::splat(-mod.slope);
  const A* brow = mod.bias ? mod.bias + i * mod.bias_row + j0 * mod.bias_col : nullptr;
  // |i + offset - j| = |diag - lane| at column c, diag = i + offset - j0 - c.
  V lane;
  for (int l = 0; l < W; ++l) lane[l] = static_cast<A>(l);
  for (int64_t c = c0; c < npr; c += W) {
    V x;
    if (mod.capped()) {
      const V t = vtanh2(vload<V>(srow + c) * vtanh_mul);
      x = vcap * t;
      if (th) vstore(th + c, t);
    } else {
      x = vload<V>(srow + c) * vmul;
    }
    if (brow) {
      V b;
      if (mod.bias_col == 1 && c + W <= nv) {
        b = vload<V>(brow + c);
      } else {  // a strided bias, or the row's last vector: its lanes in [.., nv) only
        for (int l = 0; l < W; ++l) b[l] = c + l < nv ? brow[(c + l) * mod.bias_col] : A(0);
      }
      x = vfma(vlog2e, b, x);
    }
    if (mod.slope != 0) {
      const V d = S::splat(static_cast<A>(i + mod.offset - j0 - c)) - lane;
      x = vfma(vslope, vmax(d, -d), x);
    }
    vstore(srow + c, x);
  }
  if (mod.mask) {
    const uint8_t* mrow = mod.mask + i * mod.mask_row + j0 * mod.mask_col;
    for (int64_t c = lb; c < nv; ++c)
      if (mrow[c * mod.mask_col] == 0) srow[c] = -std::numeric_limits<A>::infinity();
  }
  if (mod.qseg) {  // segments: kv positions of another id are forbidden
    const int64_t id = mod.qseg[i * mod.qseg_row];
    const int64_t* krow = mod.kvseg + j0 * mod.kvseg_col;
    for (int64_t c = lb; c < nv; ++c)
      if (krow[c * mod.kvseg_col] != id) srow[c] = -std::numeric_limits<A>::infinity();
  }
  if (th) {
    fill(th + c0, lb - c0, A(0));
    fill(th + nv, npr - nv, A(0));
  }
}

// dS of row r through the cap: ds[c] *= dcapped(th[c]) = 1 - th[c]^2 for
// the vectors apply_score_mods wrote th in ([lb rounded down, nv rounded up)).
template <class A>
void dcapped_row(A* ds, const A* th, int64_t lb, int64_t nv) {
  using S = Simd<A>;
  using V = typename S::V;
  const V one = S::splat(A(1));
  for (int64_t c = lb / S::W * S::W; c < round_up(nv, S::W); c += S::W) {
    const V t = vload<V>(th + c);
    vstore(ds + c, vload<V>(ds + c) * vfma(-t, t, one));
  }
}
