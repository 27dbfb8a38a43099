#include "context_parallel_layout.h"

#include <algorithm>
#include <string>

#include "dimattn/internal/check.h"
#include "op_util.h"

namespace dimattn {

std::vector<std::pair<int64_t, int64_t>> context_shard_ranges(int64_t total, int world, int rank,
                                                              ContextSharding sharding) {
  const char* op = "context_shard_ranges";
  DIMATTN_CHECK(world >= 1 && rank >= 0 && rank < world && total >= 0, op, "needs 0 <= rank < world and total >= 0; ",
                "got total ", total, ", world ", world, ", rank ", rank);
  if (sharding == ContextSharding::load_balanced) {
    DIMATTN_CHECK(total % (2 * world) == 0, op, "load_balanced sharding splits the sequence into 2 x ", world,
                  " equal chunks, but its length ", total, " is not a multiple of ", 2 * world,
                  "; pad it or use contiguous sharding");
    const int64_t c = total / (2 * world);
    return {{rank * c, (rank + 1) * c}, {(2 * world - 1 - rank) * c, (2 * world - rank) * c}};
  }
  const int64_t base = total / world, extra = total % world;
  const int64_t start = rank * base + std::min<int64_t>(rank, extra);
  return {{start, start + base + (rank < extra ? 1 : 0)}};
}

namespace detail {
namespace {
constexpr const char* kOp = "context_parallel_attention";

std::string sizes_str(const std::vector<int64_t>& sizes) {
  std::string s;
  for (int64_t x : sizes) s += (s.empty() ? "" : ", ") + std::to_string(x);
  return "[" + s + "]";
}

// A chunk's dim: its positions of the sequence, dynamic with the whole
// sequence's lengths.
Dim chunk_dim(const std::string& name, const PositionRange& r, const std::optional<Tensor>& lengths) {
  if (!lengths) return Dim(name, r.second - r.first);
  return Dim::dynamic(name, window_lengths(*lengths, r.first, r.second - r.first), r.second - r.first);
}

}  // namespace

int64_t ContextLayout::per_position(const Dims& dims) const {
  int64_t n = 1;
  for (const Dim& d : dims)
    if (d != axis) n *= d.extent();
  return n;
}

int64_t ContextLayout::packed_size(int r) const { return (per_position(kdims) + per_position(vdims)) * sizes[r]; }

int64_t ContextLayout::max_packed_size() const {
  return (per_position(kdims) + per_position(vdims)) * *std::max_element(sizes.begin(), sizes.end());
}

Dims ContextLayout::replaced(const Dims& dims, const Dim& by) const {
  Dims out = dims;
  for (Dim& d : out)
    if (d == axis) d = by;
  return out;
}

Dims ContextLayout::out_dims(const Dim& q_dim) const { return union_dims(lse_dims(q_dim), value_features()); }

Dims ContextLayout::lse_dims(const Dim& q_dim) const {
  Dims out;
  for (const Dims* dims : {&qdims, &kdims})
    for (const Dim& d : *dims)
      if (d != key_dim && !contains(out, d)) out.push_back(d);
  return replaced(without(out, value_features()), q_dim);
}

Dims ContextLayout::value_features() const {
  Dims out;
  for (const Dim& d : vdims)
    if (d == key_dim || (d != axis && !contains(qdims, d) && !contains(kdims, d))) out.push_back(d);
  return out;
}

ContextLayout agree_layout(Backend& be, ProcessGroup& pg, const ContextParallel& cp, const Tensor& q, const Tensor& k,
                           const Tensor& v, const AttentionOptions& o, double dropout, uint64_t seed,
                           const std::exception_ptr& local_error) {
  ContextLayout l;
  l.world = pg.size();
  l.rank = pg.rank();
  l.axis = o.axis;
  l.key_dim = o.key_dim;
  l.qdims = q.dims();
  l.kdims = k.dims();
  l.vdims = v.dims();
  l.dtype = q.dtype();
  l.device = q.device();
  // What each rank sends: its shard length, its seed (rank 0's is used),
  // whether its own checks failed, then what every rank must agree on (from
  // kAgreed on). float64: the fingerprint holds fractions (a variant's number), the
  // seed's halves fit exactly.
  enum : size_t { kLength, kSeedHigh, kSeedLow, kFailed, kAgreed, kKeysPerPosition = kAgreed, kValuesPerPosition };
  std::vector<double> meta{double(q.has(o.axis) ? o.axis.extent() : 0),
                           double(seed >> 32),
                           double(seed & 0xffffffffu),
                           double(local_error != nullptr),
                           double(l.per_position(l.kdims)),
                           double(l.per_position(l.vdims)),
                           double(cp.sharding),
                           double(cp.strategy),
                           double(o.causal_query_spatial_dim.has_value()),
                           dropout,
                           double(o.att_dropout_broadcast),
                           double(cp.lengths.has_value())};
  // Segment ids: the elements per position of each side (their other dims'
  // sizes, so that the kv ids gather alike).
  for (const std::optional<Tensor>* ids : {&o.variants.query_segments, &o.variants.kv_segments})
    meta.push_back(*ids ? double(l.per_position((*ids)->dims())) : -1.0);
  const std::vector<double> fingerprint = o.variants.fingerprint();
  meta.insert(meta.end(), fingerprint.begin(), fingerprint.end());
  const auto n = static_cast<int64_t>(meta.size());
  std::vector<RawPtr> all;
  pg.all_gather(be.from_host({n}, meta, DType::float64, l.device), all)->wait();
  std::vector<std::vector<double>> metas;
  for (const RawPtr& r : all) metas.push_back(be.to_host(r));
  for (int r = 0; r < l.world; ++r) {
    const std::vector<double>& m = metas[r];
    if (m[kFailed] != 0) {
      if (r == l.rank) std::rethrow_exception(local_error);
      fail(kOp, "rank ", r, " of the group failed to prepare its call (its own error says why); every rank makes ",
           "the same call with its own shard");
    }
    DIMATTN_CHECK(std::equal(m.begin() + kAgreed, m.end(), metas[0].begin() + kAgreed), kOp, "rank ", r,
                  " calls with other options or other sizes of the dims but axis than rank 0 (sharding, strategy, ",
                  "causal, dropout, lengths, variants; keys and values have ", m[kKeysPerPosition], " and ",
                  m[kValuesPerPosition], " elements per position there, ", metas[0][kKeysPerPosition], " and ",
                  metas[0][kValuesPerPosition], " on rank 0); every rank must make the same call on its own shard");
    l.sizes.push_back(static_cast<int64_t>(m[kLength]));
  }
  l.seed = (uint64_t(metas[0][kSeedHigh]) << 32) | uint64_t(metas[0][kSeedLow]);
  int64_t total = 0;
  for (int64_t s : l.sizes) total += s;
  std::vector<std::vector<PositionRange>> ranges;
  if (cp.sharding == ContextSharding::load_balanced) {
    const bool even = std::all_of(l.sizes.begin(), l.sizes.end(), [&](int64_t s) { return s == l.sizes[0]; });
    DIMATTN_CHECK(even && l.sizes[0] % 2 == 0, kOp, "load_balanced shards hold two equal chunks each, so every ",
                  "rank's shard has one even length; got shard lengths ", sizes_str(l.sizes), " along ",
                  o.axis.repr());
    for (int r = 0; r < l.world; ++r) ranges.push_back(context_shard_ranges(total, l.world, r, cp.sharding));
  } else {
    int64_t start = 0;
    for (int r = 0; r < l.world; ++r) {
      ranges.push_back({{start, start + l.sizes[r]}});
      start += l.sizes[r];
    }
  }
  for (int r = 0; r < l.world; ++r) {
    l.shard_dims.emplace_back(o.axis.name() + "@" + std::to_string(r), l.sizes[r]);
    std::vector<ContextChunk>& chunks = l.chunks.emplace_back();
    int64_t offset = 0;
    for (const PositionRange& range : ranges[r]) {
      chunks.push_back({range, offset, chunk_dim(o.axis.name(), range, cp.lengths),
                        chunk_dim(o.axis.name() + "_kv", range, cp.lengths)});
      offset += range.second - range.first;
    }
  }
  return l;
}

}  // namespace detail
}  // namespace dimattn
