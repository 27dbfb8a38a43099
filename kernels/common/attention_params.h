#pragma once
// AttentionKernelParams: one fused attention call (forward, or forward plus
// backward) as raw pointers, sizes and element strides. Shared by the CPU
// kernel (kernels/cpu) and the CUDA kernel (kernels/cuda), so it holds no
// frontend or framework types: a backend's adapter fills it from its own
// tensors (the FlashAttention `Flash_fwd_params` pattern).
//
// Logical shapes (row-major index order; strides say where elements live):
//   q, out, dout, dq : [batch, heads,    seqlen_q, head_dim | head_dim_v]
//   k, dk            : [batch, kv_heads, seqlen_k, head_dim]
//   v, dv            : [batch, kv_heads, seqlen_k, head_dim_v]
//   lse              : [batch, heads,    seqlen_q]
// Query head h reads kv head h / (heads / kv_heads): kv_heads == heads is
// multi-head attention, 1 < kv_heads < heads grouped-query (GQA), 1 multi-query
// (MQA). Grouped heads read the same k/v memory: nothing is tiled.
//
// Masking: query row i of batch entry b and head h attends kv position j iff
//   j < len(b, h, i)  and  (!causal or j <= i + causal_offset[b]),
// with len(b, h, i) = kv_lengths[b], or row i's length in plane b * heads + h
// of kv_row_lengths when it is on; rows i >= q_len[b] are padding. A row that attends nothing gets out = 0
// and lse = -inf (never NaN), matching the reference path's contract. A
// window (`bounds`) and a boolean mask (`score.mask`) may forbid more elements.
//
// Dropout: the keep decision of element (b, h, i, j) is
//   dropout_uniform(seed, rng_offset, b * heads + h, qp + i, kp + j) >= dropout_p
// or dropout_uniform_broadcast(seed, rng_offset, kp + j) >= dropout_p when
// dropout_broadcast (kernels/common/philox.h), qp and kp being
// dropout_q_position and dropout_kv_position (0 unless the call is a block of
// a longer sequence). b * heads + h is philox.h's flat
// `bh` index when the caller flattens its batch dims (then keys-only dims, then
// query groups) row-major into `batch` and `heads` in that order. Kept weights
// are scaled by 1 / (1 - dropout_p); the softmax normaliser and lse are those
// of the weights before dropout.
#include <cmath>
#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>

#include "common/attention_mask.h"

namespace dimattn::kernels {

// Element type of q, k, v, out, dout, dq, dk, dv (all the same).
// bfloat16 and float16 are stored as their uint16_t bit patterns.
enum class ElementType : uint8_t { float32, float64, bfloat16, float16 };

inline const char* element_type_name(ElementType t) {
  switch (t) {
    case ElementType::float32: return "float32";
    case ElementType::float64: return "float64";
    case ElementType::bfloat16: return "bfloat16";
    case ElementType::float16: return "float16";
  }
  return "invalid";
}

// Sets of element types, for the kernel that validates params: each kernel
// computes only some (the CPU kernel all four; the CUDA kernel bfloat16 and
// float16).
using ElementTypeSet = unsigned;
constexpr ElementTypeSet element_type_bit(ElementType t) { return 1u << static_cast<unsigned>(t); }
inline constexpr ElementTypeSet kCpuElementTypes = element_type_bit(ElementType::float32) |
                                                   element_type_bit(ElementType::float64) |
                                                   element_type_bit(ElementType::bfloat16) |
                                                   element_type_bit(ElementType::float16);
inline constexpr ElementTypeSet kCudaElementTypes =
    element_type_bit(ElementType::bfloat16) | element_type_bit(ElementType::float16);

inline std::string element_type_list(ElementTypeSet set) {
  std::string s;
  for (ElementType t : {ElementType::float32, ElementType::float64, ElementType::bfloat16, ElementType::float16})
    if (set & element_type_bit(t)) {
      if (!s.empty()) s += ", ";
      s += element_type_name(t);
    }
  return s;
}

// lse and every internal sum are kept in the accumulation type: float32 for
// float32, bfloat16 and float16, float64 for float64 (whose 1e-10 tolerance a float32
// lse could not meet in the backward pass).

// Element strides of one 4-d tensor. `last` exists only so that validate()
// can reject a caller whose innermost dim is not contiguous: kernels load
// whole rows as vectors.
struct ElementStrides {
  int64_t batch = 0, head = 0, row = 0;
  int64_t last = 1;  // pre: 1
};

// A paged kv cache (vLLM's, FlashAttention's flash_attn_with_kvcache): k and
// v are pools of blocks of block_size positions, and each batch entry's kv
// positions are addressed through its row of a block table. Kv position j
// of entry b and kv head hk lives at
//   k + block_table[b * table_stride + j / block_size] * k_block_stride
//     + hk * k_strides.head + (j % block_size) * k_strides.row
// (v alike), so both layouts of serving stacks are strides: [num_blocks,
// block_size, kv_heads, D] and heads-outer [num_blocks, kv_heads,
// block_size, D]. k_strides.batch and v_strides.batch are unused. Only the
// table entries of positions < kv_lengths[b] are read. Forward pass only.
struct KvPages {
  const int32_t* block_table = nullptr;  // [batch][table_stride] on the kernel's device; nullptr = off
  int64_t table_stride = 0;              // entries per batch entry (the table's capacity)
  int64_t block_size = 0;                // positions per block, >= 1
  int64_t num_blocks = 0;                // blocks in each pool: table entries lie in [0, num_blocks)
  int64_t k_block_stride = 0, v_block_stride = 0;

  bool on() const { return block_table != nullptr; }
};

struct AttentionKernelParams {
  ElementType dtype = ElementType::float32;

  // Forward inputs and outputs.
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* out = nullptr;
  // log-sum-exp of the scaled scores per query row (natural log), in the
  // accumulation type. Optional in the forward pass (nullptr = not written),
  // required by the backward pass, which recomputes the weights from it.
  void* lse = nullptr;

  // Backward inputs (q, k, v, out, lse, dout) and outputs (dq, dk, dv). dk and
  // dv are per kv head: the gradients of the query heads sharing a kv head
  // are summed into it.
  const void* dout = nullptr;
  void* dq = nullptr;
  void* dk = nullptr;
  void* dv = nullptr;

  int64_t batch = 0;      // B: every batch dim flattened
  int64_t heads = 1;      // H: query heads
  int64_t kv_heads = 1;   // Hkv. pre: heads % kv_heads == 0
  int64_t seqlen_q = 0;   // Tq: extent (maximum length) of the query rows
  int64_t seqlen_k = 0;   // Tk: extent of the kv positions
  int64_t head_dim = 0;   // D of q and k
  int64_t head_dim_v = 0; // Dv of v, out

  ElementStrides q_strides, k_strides, v_strides, out_strides;
  KvPages pages;  // k and v in a paged cache (KvPages); off = [batch, kv_heads, seqlen_k, D] by k_strides, v_strides
  ElementStrides dout_strides, dq_strides, dk_strides, dv_strides;
  int64_t lse_batch_stride = 0, lse_head_stride = 0;  // rows contiguous

  // Per batch entry, nullptr = full length. Read on the device that runs the
  // kernel (host memory for the CPU kernel).
  // pre: 0 <= q_lengths[b] <= seqlen_q, 0 <= kv_lengths[b] <= seqlen_k
  const int64_t* q_lengths = nullptr;
  const int64_t* kv_lengths = nullptr;
  // Per query row, off (data nullptr) = each row has its entry's kv_lengths:
  // int64 kv lengths of row i of (b, h) at plane<int64_t>(b * heads + h)[i *
  // row_stride] (col_stride unused), for lengths that vary over the query's
  // own dims (a chunk attending a history whose lengths differ per query
  // position, beams, GQA heads). kv_lengths then holds each entry's maximum
  // over its rows (which the kernels read as the entry's kv extent).
  // pre: 0 <= each row's length <= kv_lengths[b] (seqlen_k when absent)
  ScorePlanes kv_row_lengths;

  bool causal = false;
  // Per batch entry, nullptr = 0 (the history length when a chunk of queries
  // is appended to a kv state). Any value: negative offsets leave the first
  // rows without a valid position.
  const int64_t* causal_offset = nullptr;

  double scale = 1.0;  // scores = scale * q . k

  double dropout_p = 0.0;  // pre: 0 <= dropout_p <= 1; 0 = no dropout
  bool dropout_broadcast = false;
  uint64_t seed = 0;
  uint32_t rng_offset = 0;  // philox.h keys the counter with 32 bits
  // Where row 0 and kv position 0 lie in the sequence whose dropout mask this
  // call draws (a block of a longer sequence: context parallelism): element
  // (b, h, i, j) is keyed by query position dropout_q_position + i and kv
  // position dropout_kv_position + j. pre: both >= 0 and every keyed
  // position < 2^32.
  int64_t dropout_q_position = 0, dropout_kv_position = 0;

  // Variants, in this order (docs/numerics.md): scores s = scale * q . k;
  // soft-capping; + bias + ALiBi; masks (lengths, causal, window, mask);
  // softmax with the sink logit in its denominator; dropout.
  //
  // Positional masks beyond lengths and causal (attention_mask.h's RowBounds):
  // a sliding window around row i's diagonal i + causal_offset[b] (0 without
  // offsets): row i attends only kv j with
  //   i + offset - bounds.window_left <= j <= i + offset + bounds.window_right;
  // a negative bound is no bound on that side (causal bounds the right side
  // by itself).
  RowBounds bounds;
  // Soft-capping, ALiBi, sinks, bias and mask (attention_mask.h's
  // ScoreParams, carried whole and read through score_mod_of and
  // sink_log2_of):
  // - softcap: s becomes softcap * tanh(s / softcap). 0 = off.
  // - alibi: s(i, j) -= slope(b, h) * |i + offset - j| with slope(b, h) =
  //   alibi.at(b, h) (float64, so that float64 calls keep their precision).
  // - sinks: the logit sinks.at(b, h) (float64) joins every row's softmax
  //   denominator and adds no value; lse includes it. The backward pass
  //   writes d(sink) per (b, h) into dsinks ([batch, heads] dense, float64).
  // - bias (after ALiBi), in the accumulation type (float64 for float64
  //   calls, else float32), and mask (bytes, nonzero = may attend; combined
  //   with every other mask), each over any subset of a call's dims as
  //   ScorePlanes lay them out: never expanded.
  // - dbias: d(bias), written by the backward pass when not null (the
  //   forward pass ignores it), laid out as `bias` (same offsets and
  //   strides, accumulation type), zeroed by the caller; every (b, h, i, j)
  //   adds its gradient to its bias element, so broadcast dims are summed;
  //   dbias_shared when some elements receive several (b, h, i, j), which
  //   kernels then add atomically.
  // - rel_pos: relative positions (RelPosParams): scale * (q_i . k_j +
  //   u . k_j + (q_i + v) . table[center + j - step * i]) is the score
  //   before soft-capping; the backward pass adds d(table), d(u) and d(v)
  //   where asked.
  // Every pointer nullptr = off.
  ScoreParams score;

  bool has_dropout() const { return dropout_p > 0.0; }
  int64_t group_size() const { return heads / kv_heads; }  // query heads per kv head

  // Everything a caller can get wrong in the fields above, without reading
  // the per-batch arrays (which may live on a device). Empty when ok.
  // `types`: the element types the calling kernel computes (default: the CPU
  // kernel's), so that a kernel rejects the others with a reason.
  std::string validate(bool backward, ElementTypeSet types = kCpuElementTypes) const;
  // The per-batch arrays' values. pre: they are readable from the host.
  std::string validate_host_arrays() const;
};

// ---------------------------------------------------------------------------

namespace detail {

inline std::string dim_list(int64_t a, int64_t b, int64_t c, int64_t d) {
  std::string s(1, '[');  // appended piecewise: GCC 12 warns (-Wrestrict) on "[" + std::string
  for (int64_t x : {a, b, c, d}) {
    if (s.size() > 1) s += ", ";
    s += std::to_string(x);
  }
  s += ']';
  return s;
}

// Whether distinct indices of a [sizes] view with these strides address
// distinct elements: sort the dims that have more than one index by stride;
// each stride must step over everything the smaller dims span. Sufficient, not
// necessary (an interleaving layout that never collides is rejected), which
// is the safe side for outputs written by concurrent tasks.
inline bool non_overlapping(const int64_t (&sizes)[4], const int64_t (&strides)[4]) {
  int64_t s[4], n[4];
  int m = 0;
  for (int a = 0; a < 4; ++a) {
    if (sizes[a] == 0) return true;
    if (sizes[a] > 1) {
      s[m] = strides[a];
      n[m] = sizes[a];
      ++m;
    }
  }
  for (int i = 1; i < m; ++i)  // insertion sort by stride
    for (int j = i; j > 0 && s[j] < s[j - 1]; --j) {
      std::swap(s[j], s[j - 1]);
      std::swap(n[j], n[j - 1]);
    }
  int64_t span = 1;  // elements spanned by the dims sorted so far
  for (int i = 0; i < m; ++i) {
    if (s[i] < span) return false;
    span = s[i] * (n[i] - 1) + span;
  }
  return true;
}

}  // namespace detail

inline std::string AttentionKernelParams::validate(bool backward, ElementTypeSet types) const {
  const std::string op = backward ? "[attention backward] " : "[attention] ";
  if (static_cast<unsigned>(dtype) > static_cast<unsigned>(ElementType::float16))
    return op + "unsupported element type " + std::to_string(static_cast<int>(dtype));
  if (!(types & element_type_bit(dtype)))
    return op + "this kernel does not take " + element_type_name(dtype) + "; it takes " + element_type_list(types);
  if (batch < 0 || seqlen_q < 0 || seqlen_k < 0 || head_dim < 0 || head_dim_v < 0)
    return op + "sizes must be >= 0, got batch=" + std::to_string(batch) + " seqlen_q=" + std::to_string(seqlen_q) +
           " seqlen_k=" + std::to_string(seqlen_k) + " head_dim=" + std::to_string(head_dim) +
           " head_dim_v=" + std::to_string(head_dim_v);
  if (heads < 1 || kv_heads < 1)
    return op + "heads and kv_heads must be >= 1, got heads=" + std::to_string(heads) +
           " kv_heads=" + std::to_string(kv_heads);
  if (heads % kv_heads != 0)
    return op + "heads=" + std::to_string(heads) + " is not a multiple of kv_heads=" + std::to_string(kv_heads) +
           " (grouped-query attention shares each kv head among heads / kv_heads query heads)";
  if (!(dropout_p >= 0.0 && dropout_p <= 1.0))
    return op + "dropout_p must be in [0, 1], got " + std::to_string(dropout_p);
  if (!std::isfinite(scale)) return op + "scale must be finite, got " + std::to_string(scale);
  if (!(score.softcap >= 0.0) || !std::isfinite(score.softcap))
    return op + "softcap must be finite and >= 0 (0 = off), got " + std::to_string(score.softcap);
  if (backward && score.sinks.on() && batch * heads > 0 && score.dsinks == nullptr)
    return op + "sinks need dsinks ([batch, heads] float64) in the backward pass";
  for (const HeadValues* x : {&score.alibi, &score.sinks})
    if (x->batch_stride < 0 || x->head_stride < 0) return op + "alibi slopes and sinks need strides >= 0";
  for (const ScorePlanes* x : {&score.bias, &score.mask, &score.query_segments, &score.kv_segments})
    if (x->row_stride < 0 || x->col_stride < 0) return op + "bias, mask and segment ids need strides >= 0";
  if (score.query_segments.on() != score.kv_segments.on())
    return op + "query_segments and kv_segments are both set or both unset";
  if (score.query_segments.col_stride != 0 || score.kv_segments.row_stride != 0)
    return op + "query_segments vary over no kv position and kv_segments over no query row (strides 0 there)";
  if (const RelPosParams& r = score.rel_pos; r.on()) {
    if (r.table.row_stride < 0 || r.table.col_stride != 1)
      return op + "rel_pos.table needs a row stride >= 0 and a column stride of 1";
    if (r.step != 0 && r.step != 1) return op + "rel_pos.step must be 0 or 1, got " + std::to_string(r.step);
    // The rows that (i, j) read: center + j - step * i over i < seqlen_q, j < seqlen_k.
    const int64_t lo = r.center - r.step * std::max<int64_t>(seqlen_q - 1, 0), hi = r.center + seqlen_k - 1;
    if (seqlen_q > 0 && seqlen_k > 0 && (lo < 0 || hi >= r.rows))
      return op + "rel_pos reads table rows " + std::to_string(lo) + ".." + std::to_string(hi) + " but the table has " +
             std::to_string(r.rows) + " (center " + std::to_string(r.center) + ", step " + std::to_string(r.step) + ")";
    if (batch * heads > 0 && r.table.offsets == nullptr) return op + "rel_pos.table needs offsets ([batch * heads])";
  }
  if (pages.on()) {
    if (backward)
      return op + "a paged kv cache is read by the forward pass only; gather its blocks into a tensor to "
                  "differentiate through it";
    if (score.rel_pos.on())
      return op + "relative positions (pos_emb) are not read from a paged kv cache; gather its blocks first";
    if (pages.block_size < 1) return op + "pages.block_size must be >= 1, got " + std::to_string(pages.block_size);
    if (pages.num_blocks < 0 || pages.table_stride < 0 || pages.k_block_stride < 0 || pages.v_block_stride < 0)
      return op + "pages need num_blocks, table_stride and block strides >= 0";
    if (seqlen_k > pages.table_stride * pages.block_size)
      return op + "seqlen_k=" + std::to_string(seqlen_k) + " is past the block table's capacity of " +
             std::to_string(pages.table_stride) + " blocks of " + std::to_string(pages.block_size) + " positions";
  }
  if (kv_row_lengths.row_stride < 0) return op + "kv_row_lengths needs a row stride >= 0";
  if (kv_row_lengths.on() && batch * heads > 0 && kv_row_lengths.offsets == nullptr)
    return op + "kv_row_lengths needs offsets ([batch * heads])";
  if (batch * heads * seqlen_q * seqlen_k > 0) {
    if (score.bias.on() && score.bias.offsets == nullptr) return op + "bias needs offsets ([batch * heads])";
    if (score.mask.on() && score.mask.offsets == nullptr) return op + "mask needs offsets ([batch * heads])";
    if (score.query_segments.on() && (score.query_segments.offsets == nullptr || score.kv_segments.offsets == nullptr))
      return op + "segment ids need offsets ([batch * heads])";
    if (score.dbias != nullptr && !score.bias.on()) return op + "dbias is set but bias is not";
  }

  struct T {
    const char* name;
    const void* ptr;
    const ElementStrides* st;
    int64_t n0, n1, n2, n3;
    bool output;
  };
  const T all[] = {
      {"q", q, &q_strides, batch, heads, seqlen_q, head_dim, false},
      {"k", k, &k_strides, batch, kv_heads, seqlen_k, head_dim, false},
      {"v", v, &v_strides, batch, kv_heads, seqlen_k, head_dim_v, false},
      {"out", out, &out_strides, batch, heads, seqlen_q, head_dim_v, !backward},
      {"dout", dout, &dout_strides, batch, heads, seqlen_q, head_dim_v, false},
      {"dq", dq, &dq_strides, batch, heads, seqlen_q, head_dim, true},
      {"dk", dk, &dk_strides, batch, kv_heads, seqlen_k, head_dim, true},
      {"dv", dv, &dv_strides, batch, kv_heads, seqlen_k, head_dim_v, true},
  };
  const int used = backward ? 8 : 4;
  for (int i = 0; i < used; ++i) {
    const T& t = all[i];
    const int64_t numel = t.n0 * t.n1 * t.n2 * t.n3;
    if (numel == 0) continue;  // an empty tensor may have no storage
    if (t.ptr == nullptr)
      return op + t.name + " is null but has shape " + detail::dim_list(t.n0, t.n1, t.n2, t.n3);
    if (t.st->last != 1)
      return op + t.name + " needs a contiguous last dim (stride 1), got stride " + std::to_string(t.st->last) +
             "; copy it to a contiguous layout first";
    if (t.st->batch < 0 || t.st->head < 0 || t.st->row < 0)
      return op + t.name + " has a negative stride (batch " + std::to_string(t.st->batch) + ", head " +
             std::to_string(t.st->head) + ", row " + std::to_string(t.st->row) + ")";
    if (t.output) {
      const int64_t sizes[4] = {t.n0, t.n1, t.n2, t.n3};
      const int64_t strides[4] = {t.st->batch, t.st->head, t.st->row, 1};
      if (!detail::non_overlapping(sizes, strides))
        return op + "output " + t.name + " of shape " + detail::dim_list(t.n0, t.n1, t.n2, t.n3) +
               " has overlapping strides " + detail::dim_list(t.st->batch, t.st->head, t.st->row, 1);
    }
  }
  const int64_t rows = batch * heads * seqlen_q;
  if (rows > 0) {
    if (backward && lse == nullptr) return op + "lse (from the forward pass) is required";
    if (lse != nullptr) {
      if (lse_batch_stride < 0 || lse_head_stride < 0)
        return op + "lse has a negative stride (batch " + std::to_string(lse_batch_stride) + ", head " +
               std::to_string(lse_head_stride) + ")";
      if (!backward) {
        const int64_t sizes[4] = {batch, heads, seqlen_q, 1};
        const int64_t strides[4] = {lse_batch_stride, lse_head_stride, 1, 1};
        if (!detail::non_overlapping(sizes, strides))
          return op + "output lse of shape [" + std::to_string(batch) + ", " + std::to_string(heads) + ", " +
                 std::to_string(seqlen_q) + "] has overlapping strides [" + std::to_string(lse_batch_stride) + ", " +
                 std::to_string(lse_head_stride) + ", 1]";
      }
    }
  }
  if (has_dropout()) {
    // philox.h's counter words are 32 bits wide.
    constexpr int64_t kMax = int64_t{1} << 32;
    if (batch * heads > kMax || seqlen_q > kMax || seqlen_k > kMax)
      return op + "dropout keys batch * heads, seqlen_q and seqlen_k with 32 bits each, got " +
             std::to_string(batch * heads) + ", " + std::to_string(seqlen_q) + ", " + std::to_string(seqlen_k);
    if (dropout_q_position < 0 || dropout_kv_position < 0 || dropout_q_position + seqlen_q > kMax ||
        dropout_kv_position + seqlen_k > kMax)
      return op + "dropout positions [" + std::to_string(dropout_q_position) + ", +" + std::to_string(seqlen_q) +
             ") x [" + std::to_string(dropout_kv_position) + ", +" + std::to_string(seqlen_k) +
             ") must lie in [0, 2^32): dropout keys positions with 32 bits";
  }
  return {};
}

inline std::string AttentionKernelParams::validate_host_arrays() const {
  for (int64_t b = 0; b < batch; ++b) {
    if (q_lengths && (q_lengths[b] < 0 || q_lengths[b] > seqlen_q))
      return "[attention] q_lengths[" + std::to_string(b) + "] = " + std::to_string(q_lengths[b]) +
             " is outside [0, seqlen_q=" + std::to_string(seqlen_q) + "]";
    if (kv_lengths && (kv_lengths[b] < 0 || kv_lengths[b] > seqlen_k))
      return "[attention] kv_lengths[" + std::to_string(b) + "] = " + std::to_string(kv_lengths[b]) +
             " is outside [0, seqlen_k=" + std::to_string(seqlen_k) + "]";
    if (pages.on()) {
      const int64_t len = kv_lengths ? kv_lengths[b] : seqlen_k;
      for (int64_t t = 0; t < (len + pages.block_size - 1) / pages.block_size; ++t)
        if (const int64_t blk = pages.block_table[b * pages.table_stride + t]; blk < 0 || blk >= pages.num_blocks)
          return "[attention] block_table[" + std::to_string(b) + "][" + std::to_string(t) + "] = " +
                 std::to_string(blk) + " is outside the pool's [0, " + std::to_string(pages.num_blocks) +
                 ") blocks (entry " + std::to_string(b) + " has " + std::to_string(len) + " positions)";
    }
    if (!kv_row_lengths.on() || kv_row_lengths.offsets == nullptr) continue;  // validate() names the latter
    const int64_t most = kv_lengths ? kv_lengths[b] : seqlen_k;
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t* rows = kv_row_lengths.plane<int64_t>(b * heads + h);
      for (int64_t i = 0; i < seqlen_q; ++i)
        if (const int64_t len = rows[i * kv_row_lengths.row_stride]; len < 0 || len > most)
          return "[attention] kv_row_lengths of batch entry " + std::to_string(b) + ", head " + std::to_string(h) +
                 ", row " + std::to_string(i) + " = " + std::to_string(len) + " is outside [0, " +
                 (kv_lengths ? "kv_lengths[b]=" : "seqlen_k=") + std::to_string(most) + "]";
    }
  }
  return {};
}

}  // namespace dimattn::kernels
