// What a tile's rows attend: each row's span of the tile (row_spans), and
// the block classification of the bool mask and of segment ids: which (rows,
// kv tile) blocks they forbid entirely (skipped), allow entirely (the
// unmasked inner loop) or only in part (the per-element mask), with segment
// ids in runs bounding each row instead (MaskTiles::bounded).
// A part of cpu/flash_attention_impl.h, which says what includes it and how.
#ifndef DIMATTN_CPU_FLASH_PARTS
#error "included by cpu/flash_attention_impl.h only"
#endif

// ---------------------------------------------------------------------------
// Row spans.

// What rows [i0, i0 + m) attend of a tile's kv positions [j0, j0 + n): row r
// positions [lb[r], nv[r]), and [n, 0) when none, so that an empty row
// widens no product's bounds (micro_kernel.h's Ragged).
inline void row_spans(const EntryMask& mask, int64_t i0, int64_t m, int64_t j0, int64_t n, int64_t* lb,
                      int64_t* nv) {
  for (int64_t r = 0; r < m; ++r) {
    const int64_t lo = std::clamp<int64_t>(mask.lo(i0 + r) - j0, 0, n);
    const int64_t hi = std::clamp<int64_t>(mask.hi(i0 + r) - j0, 0, n);
    lb[r] = hi > lo ? lo : n, nv[r] = hi > lo ? hi : 0;
  }
}

// ---------------------------------------------------------------------------
// Mask tiles.

// What a block of the mask holds, as bits that combine by OR: a block of
// several cells is empty only if every cell is, full only if every cell is.
enum TileBits : uint8_t {
  kTileAllows = 1,   // some element may attend
  kTileForbids = 2,  // some element may not
};

// The distinct planes of a plane table (ScorePlanes::offsets over bhs flat
// (b, h) indices), told apart by their offsets: the first bh of each, in
// order of offset, and each bh's plane (an index into them) in plane_of.
inline std::vector<int64_t> distinct_planes(const int64_t* offsets, int64_t bhs, std::vector<int64_t>& plane_of) {
  std::vector<int64_t> firsts;
  plane_of.resize(static_cast<size_t>(bhs));
  std::vector<std::pair<int64_t, int64_t>> by_offset;  // (offset, bh), sorted
  by_offset.reserve(static_cast<size_t>(bhs));
  for (int64_t bh = 0; bh < bhs; ++bh) by_offset.push_back({offsets[bh], bh});
  std::sort(by_offset.begin(), by_offset.end());
  for (size_t i = 0; i < by_offset.size(); ++i) {
    if (i == 0 || by_offset[i].first != by_offset[i - 1].first) firsts.push_back(by_offset[i].second);
    plane_of[static_cast<size_t>(by_offset[i].second)] = static_cast<int64_t>(firsts.size()) - 1;
  }
  return firsts;
}

// The [min, max] of segment ids over cells of a plane: kRows query rows of
// the query side, or one kv tile of the kv side.
struct IdRange {
  int64_t lo, hi;
};

// The classes of a call's bool mask (ScoreParams::mask) and segment ids
// (ScoreParams::query_segments, kv_segments), made once per pass (forward
// and backward each classify for their own kv tile width; the scan reads
// each distinct plane's bytes once, the same bytes the kernel would read in
// its partial tiles anyway). Planes are told apart by their offsets: a mask
// or ids shared by all heads (or all batch entries) are classified once.
// Cells are kRows query rows by bk kv positions, the tile width of the pass,
// so that a pass asks about whole kv tiles (kv tiles start at multiples of
// bk) and any row range. Segments: a block is empty when the [min, max] of
// its rows' ids and of its kv positions' ids are disjoint, full when both
// hold one and the same id, else partial; with the mask too, empty when
// either is, full when both are.
class MaskTiles {
 public:
  static constexpr int64_t kRows = 16;

  MaskTiles() = default;  // no mask: every block partial (the caller applies the mask, if any, itself)
  MaskTiles(const AttentionKernelParams& p, int64_t bk, const ParallelFor& parallel_for) : bk_(bk) {
    if (p.seqlen_q == 0 || p.seqlen_k == 0) return;
    groups_ = (p.seqlen_q + kRows - 1) / kRows;
    tiles_ = (p.seqlen_k + bk - 1) / bk;
    const int64_t bhs = p.batch * p.heads;
    const ScorePlanes& mk = p.score.mask;
    if (mk.on()) {
      // Causal: the tiles past a row group's reach under the largest causal
      // offset of any entry are never asked about (a pass asks only about
      // tiles its rows reach), so they are not scanned (bits 0: partial).
      constexpr int64_t kFar = int64_t{1} << 61;  // entry_mask's clamp of offsets
      int64_t reach = kFar;
      if (p.causal) {
        reach = p.causal_offset ? -kFar : 0;
        for (int64_t b = 0; p.causal_offset && b < p.batch; ++b)
          reach = std::max(reach, std::clamp(p.causal_offset[b], -kFar, kFar));
      }
      const std::vector<int64_t> firsts = distinct_planes(mk.offsets, bhs, plane_of_);
      bits_.assign(static_cast<size_t>(static_cast<int64_t>(firsts.size()) * groups_ * tiles_), 0);
      parallel_for(0, static_cast<int64_t>(firsts.size()) * groups_, [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; ++t) {
          const int64_t plane = t / groups_, g = t % groups_;
          const int64_t i0 = g * kRows, rows = std::min(p.seqlen_q, i0 + kRows) - i0;
          const uint8_t* base = mk.plane<uint8_t>(firsts[static_cast<size_t>(plane)]) + i0 * mk.row_stride;
          uint8_t* out = bits_.data() + (plane * groups_ + g) * tiles_;
          for (int64_t tile = 0; tile < tiles_; ++tile) {
            const int64_t j0 = tile * bk, n = std::min(bk, p.seqlen_k - j0);
            out[tile] = j0 > i0 + rows - 1 + reach ? 0 : scan(base + j0 * mk.col_stride, rows, mk.row_stride, n, mk.col_stride);
          }
        }
      });
    }
    const ScorePlanes &qs = p.score.query_segments, &ks = p.score.kv_segments;
    if (qs.on()) {  // O(T) per distinct plane: no threads
      const std::vector<int64_t> qf = distinct_planes(qs.offsets, bhs, qplane_of_);
      for (int64_t first : qf)
        for (int64_t g = 0; g < groups_; ++g)
          qranges_.push_back(id_range(qs.plane<int64_t>(first) + g * kRows * qs.row_stride,
                                      std::min(kRows, p.seqlen_q - g * kRows), qs.row_stride));
      const std::vector<int64_t> kf = distinct_planes(ks.offsets, bhs, kplane_of_);
      for (int64_t first : kf)
        for (int64_t tile = 0; tile < tiles_; ++tile)
          kranges_.push_back(id_range(ks.plane<int64_t>(first) + tile * bk * ks.col_stride,
                                      std::min(bk, p.seqlen_k - tile * bk), ks.col_stride));
      find_runs(p, qf, kf);
    }
  }

  bool on() const { return !bits_.empty() || !qranges_.empty(); }

  // Whether every kv plane's segment ids are runs (each id's positions one
  // contiguous range, as in packed sequences and documents): then each row
  // attends, of the kv positions, only its id's run, which bounded() adds to
  // its mask, and no element needs the per-element id test.
  bool runs() const { return !run_lo_.empty(); }
  // m (the mask of plane bh) with each row bounded to its id's kv run when runs().
  EntryMask bounded(EntryMask m, int64_t bh) const {
    if (!runs()) return m;
    const int64_t at = pair_of_[static_cast<size_t>(bh)] * seqlen_q_;
    m.run_lo = run_lo_.data() + at;
    m.run_hi = run_hi_.data() + at;
    return m;
  }
  // The score variants of (b, h) whose mask is m (bounded()'s): without the
  // per-element segment test when runs() bound the rows instead.
  template <class A>
  ScoreMod<A> score_mod(const AttentionKernelParams& p, const EntryMask& m, int64_t b, int64_t h) const {
    const ScoreMod<A> mod = score_mod_of<A>(p.score, m, b, h, p.heads);
    return runs() ? mod.without_segments() : mod;
  }

  // The class of rows [i0, i1) by kv positions [j0, j0 + bk) (clipped to the
  // call) of plane bh. pre: on(), j0 % bk == 0, 0 <= i0 < i1 <= seqlen_q.
  TileClass of(int64_t bh, int64_t i0, int64_t i1, int64_t j0) const {
    const int64_t g0 = i0 / kRows, g1 = (i1 - 1) / kRows;
    TileClass mask = TileClass::full;
    if (!bits_.empty()) {
      const uint8_t* col = bits_.data() + plane_of_[static_cast<size_t>(bh)] * groups_ * tiles_ + j0 / bk_;
      uint8_t b = 0;
      for (int64_t g = g0; g <= g1; ++g) b |= col[g * tiles_];
      mask = b == kTileAllows ? TileClass::full : b == kTileForbids ? TileClass::empty : TileClass::partial;
    }
    if (qranges_.empty() || mask == TileClass::empty) return mask;
    const IdRange* q = qranges_.data() + qplane_of_[static_cast<size_t>(bh)] * groups_;
    IdRange r = q[g0];
    for (int64_t g = g0 + 1; g <= g1; ++g) r.lo = std::min(r.lo, q[g].lo), r.hi = std::max(r.hi, q[g].hi);
    const IdRange k = kranges_[static_cast<size_t>(kplane_of_[static_cast<size_t>(bh)] * tiles_ + j0 / bk_)];
    if (r.hi < k.lo || k.hi < r.lo) return TileClass::empty;
    const bool one = r.lo == r.hi && k.lo == k.hi && r.lo == k.lo;
    return one && mask == TileClass::full ? TileClass::full : TileClass::partial;
  }

 private:
  // The bits of a block of mask bytes: rows of n bytes at p + r * rs, byte
  // c at + c * cs.
  static IdRange id_range(const int64_t* ids, int64_t n, int64_t stride) {
    IdRange r{ids[0], ids[0]};
    for (int64_t x = 1; x < n; ++x) r.lo = std::min(r.lo, ids[x * stride]), r.hi = std::max(r.hi, ids[x * stride]);
    return r;
  }
  static uint8_t scan(const uint8_t* p, int64_t rows, int64_t rs, int64_t n, int64_t cs) {
    bool allows = false, forbids = false;
    if (cs == 1) {
      // A vector of bytes at a time: per lane, OR of (byte != 0) and of
      // (byte == 0) over the block, reduced once at the end.
      typedef uint8_t vb __attribute__((vector_size(sizeof(vf))));
      constexpr int64_t B = sizeof(vb);
      vb any_nz{}, any_z{};
      for (int64_t r = 0; r < rows; ++r) {
        const uint8_t* row = p + r * rs;
        int64_t j = 0;
        for (; j + B <= n; j += B) {
          const vb x = vload<vb>(row + j);
          any_nz |= (vb)(x != 0);
          any_z |= (vb)(x == 0);
        }
        for (; j < n; ++j) allows |= row[j] != 0, forbids |= row[j] == 0;
      }
      uint64_t w[B / 8];
      std::memcpy(w, &any_nz, B);
      for (uint64_t x : w) allows |= x != 0;
      std::memcpy(w, &any_z, B);
      for (uint64_t x : w) forbids |= x != 0;
    } else {
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t j = 0; j < n; ++j) allows |= p[r * rs + j * cs] != 0, forbids |= p[r * rs + j * cs] == 0;
    }
    return static_cast<uint8_t>((allows ? kTileAllows : 0) | (forbids ? kTileForbids : 0));
  }

  // The kv run [lo, hi) of each id of the kv planes (firsts kf), and of each
  // row of each (query plane, kv plane) pair in use its id's run ([seqlen_k,
  // 0) when the kv plane lacks the id: no block of rows starts earlier for
  // it): run_lo_, run_hi_. Nothing when some kv
  // plane repeats an id after another one (ids not in runs).
  void find_runs(const AttentionKernelParams& p, const std::vector<int64_t>& qf, const std::vector<int64_t>& kf) {
    const ScorePlanes &qs = p.score.query_segments, &ks = p.score.kv_segments;
    struct Run {
      int64_t id, lo, hi;
    };
    std::vector<std::vector<Run>> runs(kf.size());  // per kv plane, sorted by id
    for (size_t k = 0; k < kf.size(); ++k) {
      const int64_t* ids = ks.plane<int64_t>(kf[k]);
      for (int64_t j = 0; j < p.seqlen_k; ++j) {
        const int64_t id = ids[j * ks.col_stride];
        if (runs[k].empty() || runs[k].back().id != id) runs[k].push_back({id, j, j + 1});
        else runs[k].back().hi = j + 1;
      }
      std::sort(runs[k].begin(), runs[k].end(), [](const Run& a, const Run& b) { return a.id < b.id; });
      for (size_t r = 1; r < runs[k].size(); ++r)
        if (runs[k][r].id == runs[k][r - 1].id) return;  // an id in two runs
    }
    seqlen_q_ = p.seqlen_q;
    // The (query plane, kv plane) pairs in use, told apart as distinct_planes does.
    std::vector<int64_t> pair_key(qplane_of_.size());
    for (size_t bh = 0; bh < pair_key.size(); ++bh)
      pair_key[bh] = qplane_of_[bh] * static_cast<int64_t>(kf.size()) + kplane_of_[bh];
    for (int64_t bh : distinct_planes(pair_key.data(), static_cast<int64_t>(pair_key.size()), pair_of_)) {
      const std::vector<Run>& kr = runs[static_cast<size_t>(kplane_of_[static_cast<size_t>(bh)])];
      const int64_t* ids = qs.plane<int64_t>(qf[static_cast<size_t>(qplane_of_[static_cast<size_t>(bh)])]);
      for (int64_t i = 0; i < p.seqlen_q; ++i) {
        const int64_t id = ids[i * qs.row_stride];
        const auto r = std::lower_bound(kr.begin(), kr.end(), id, [](const Run& a, int64_t x) { return a.id < x; });
        const bool has = r != kr.end() && r->id == id;
        run_lo_.push_back(has ? r->lo : p.seqlen_k);  // none: an empty range past every position
        run_hi_.push_back(has ? r->hi : 0);
      }
    }
  }

  int64_t bk_ = 1, groups_ = 0, tiles_ = 0, seqlen_q_ = 0;
  std::vector<int64_t> plane_of_;  // per bh: its distinct plane of the mask
  std::vector<uint8_t> bits_;      // [plane][row group][kv tile]: TileBits
  std::vector<int64_t> qplane_of_, kplane_of_;  // per bh: its distinct plane of query and kv ids
  std::vector<IdRange> qranges_;                // [query plane][row group]
  std::vector<IdRange> kranges_;                // [kv plane][kv tile]
  std::vector<int64_t> pair_of_;                // per bh: its (query plane, kv plane) pair of the runs
  std::vector<int64_t> run_lo_, run_hi_;        // [pair][query row]: the kv run of the row's id
};
