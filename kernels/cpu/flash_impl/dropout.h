// Masks and dropout of one batch entry, as common/attention_mask.h defines
// them (dropout drawn several counters at a time by philox_bits).
// A part of cpu/flash_attention_impl.h, which says what includes it and how.
#ifndef DIMATTN_CPU_FLASH_PARTS
#error "included by cpu/flash_attention_impl.h only"
#endif

// ---------------------------------------------------------------------------
// Dropout factors of one row tile: common/attention_mask.h's keying and keep
// rule, with philox_bits drawing several counters at once.

template <class A>
struct DropoutSpec {
  bool on = false, broadcast = false;
  uint64_t seed = 0;
  uint32_t offset = 0;
  int64_t q_position = 0, kv_position = 0;  // of row 0 and kv position 0 (attention_params.h)
  DropoutRule rule;
  A keep_scale = 1;  // rule.keep_scale in the accumulation type

  explicit DropoutSpec(const AttentionKernelParams& p)
      : on(p.dropout_p > 0),
        broadcast(p.dropout_broadcast),
        seed(p.seed),
        offset(p.rng_offset),
        q_position(p.dropout_q_position),
        kv_position(p.dropout_kv_position),
        rule(dropout_rule(p.dropout_p)),
        keep_scale(static_cast<A>(rule.keep_scale)) {}

  // z[c] = keep(bh, q, j0 + c) ? kept : 0 for c < n (the call's rows and
  // kv positions, keyed at their positions).
  void row_factors(uint32_t bh, uint32_t q, int64_t j0, int64_t n, A kept, A* z) const {
    factors(dropout_stream(seed, offset, bh, static_cast<uint32_t>(q + q_position)), j0 + kv_position, n, kept, z);
  }
  // Broadcast dropout: the same factors for every row.
  void broadcast_factors(int64_t j0, int64_t n, A kept, A* z) const {
    factors(dropout_stream_broadcast(seed, offset), j0 + kv_position, n, kept, z);
  }

 private:
  // Positions [j0, j0 + n) of the stream; j0 need not be a multiple of 4
  // (a block's first kv position may be any): the words are drawn from the
  // counter of j0's group and the first j0 % 4 lanes skipped.
  void factors(const DropoutStream& st, int64_t j0, int64_t n, A kept, A* z) const {
    constexpr int64_t kChunk = 256;
    alignas(32) uint32_t bits[kChunk + 4];
    const int64_t skip = j0 & 3;
    for (int64_t c0 = 0; c0 < n; c0 += kChunk) {
      const int64_t len = std::min(kChunk, n - c0);
      philox_bits(st.key, static_cast<uint32_t>((j0 + c0) >> 2), st.c1, st.c2, st.c3, (len + skip + 3) / 4, bits);
      for (int64_t c = 0; c < len; ++c) z[c0 + c] = rule.keeps(bits[skip + c]) ? kept : A(0);
    }
  }
};

// The mask of batch entry b of a call (with per-row kv lengths, kv_len
// bounds every row's), and that of its head h (with its rows' lengths).
inline EntryMask entry_mask_of(const AttentionKernelParams& p, int64_t b, int64_t h = -1) {
  return entry_mask(p.q_lengths, p.kv_lengths, p.causal_offset, p.causal, p.seqlen_q, p.seqlen_k, b, p.bounds,
                    p.kv_row_lengths, h < 0 ? -1 : b * p.heads + h);
}
