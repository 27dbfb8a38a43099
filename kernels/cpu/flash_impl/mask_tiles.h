// Block classification of the bool mask: which (rows, kv tile) blocks it
// forbids entirely (skipped), allows entirely (the unmasked inner loop) or
// only in part (the per-element mask).
// A part of cpu/flash_attention_impl.h, which says what includes it and how.
#ifndef DIMATTN_CPU_FLASH_PARTS
#error "included by cpu/flash_attention_impl.h only"
#endif

// ---------------------------------------------------------------------------
// Mask tiles.

// What a block of the mask holds, as bits that combine by OR: a block of
// several cells is empty only if every cell is, full only if every cell is.
enum TileBits : uint8_t {
  kTileAllows = 1,   // some element may attend
  kTileForbids = 2,  // some element may not
};
enum class TileClass { empty, full, partial };

// The classes of a call's bool mask (ScoreParams::mask), made once per pass
// (forward and backward each classify for their own kv tile width; the scan
// reads each distinct plane's bytes once, the same bytes the kernel would
// read in its partial tiles anyway). Planes are told apart by their offsets:
// a mask shared by all heads (or all batch entries) is classified once.
// Cells are kRows query rows by bk kv positions, the tile width of the pass,
// so that a pass asks about whole kv tiles (kv tiles start at multiples of
// bk) and any row range.
class MaskTiles {
 public:
  static constexpr int64_t kRows = 16;

  MaskTiles() = default;  // no mask: every block partial (the caller applies the mask, if any, itself)
  MaskTiles(const AttentionKernelParams& p, int64_t bk, const ParallelFor& parallel_for) : bk_(bk) {
    const ScorePlanes& mk = p.score.mask;
    if (!mk.on() || p.seqlen_q == 0 || p.seqlen_k == 0) return;
    groups_ = (p.seqlen_q + kRows - 1) / kRows;
    tiles_ = (p.seqlen_k + bk - 1) / bk;
    const int64_t bhs = p.batch * p.heads;
    // Distinct planes, in order of first use.
    std::vector<int64_t> firsts;  // the first bh of each distinct plane
    plane_of_.resize(static_cast<size_t>(bhs));
    {
      std::vector<std::pair<int64_t, int64_t>> by_offset;  // (offset, bh), sorted
      by_offset.reserve(static_cast<size_t>(bhs));
      for (int64_t bh = 0; bh < bhs; ++bh) by_offset.push_back({mk.offsets[bh], bh});
      std::sort(by_offset.begin(), by_offset.end());
      for (size_t i = 0; i < by_offset.size(); ++i) {
        if (i == 0 || by_offset[i].first != by_offset[i - 1].first) firsts.push_back(by_offset[i].second);
        plane_of_[static_cast<size_t>(by_offset[i].second)] = static_cast<int64_t>(firsts.size()) - 1;
      }
    }
    bits_.assign(static_cast<size_t>(static_cast<int64_t>(firsts.size()) * groups_ * tiles_), 0);
    parallel_for(0, static_cast<int64_t>(firsts.size()) * groups_, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t plane = t / groups_, g = t % groups_;
        const int64_t i0 = g * kRows, rows = std::min(p.seqlen_q, i0 + kRows) - i0;
        const uint8_t* base = mk.plane<uint8_t>(firsts[static_cast<size_t>(plane)]) + i0 * mk.row_stride;
        uint8_t* out = bits_.data() + (plane * groups_ + g) * tiles_;
        for (int64_t tile = 0; tile < tiles_; ++tile) {
          const int64_t j0 = tile * bk, n = std::min(bk, p.seqlen_k - j0);
          out[tile] = scan(base + j0 * mk.col_stride, rows, mk.row_stride, n, mk.col_stride);
        }
      }
    });
  }

  bool on() const { return !bits_.empty(); }

  // The class of rows [i0, i1) by kv positions [j0, j0 + bk) (clipped to the
  // call) of plane bh. pre: on(), j0 % bk == 0, 0 <= i0 < i1 <= seqlen_q.
  TileClass of(int64_t bh, int64_t i0, int64_t i1, int64_t j0) const {
    const uint8_t* col = bits_.data() + plane_of_[static_cast<size_t>(bh)] * groups_ * tiles_ + j0 / bk_;
    uint8_t b = 0;
    for (int64_t g = i0 / kRows; g <= (i1 - 1) / kRows; ++g) b |= col[g * tiles_];
    return b == kTileAllows ? TileClass::full : b == kTileForbids ? TileClass::empty : TileClass::partial;
  }

 private:
  // The bits of a block of mask bytes: rows of n bytes at p + r * rs, byte
  // c at + c * cs.
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

  int64_t bk_ = 1, groups_ = 0, tiles_ = 0;
  std::vector<int64_t> plane_of_;  // per bh: its distinct plane
  std::vector<uint8_t> bits_;      // [plane][row group][kv tile]: TileBits
};
