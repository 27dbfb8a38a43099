#pragma once
// Context parallelism's layout (context_parallel.cpp): which positions of the
// sequence each rank holds, as chunks with their dims, and the agreement of
// every rank on the call that lays them out.
#include <cstdint>
#include <exception>
#include <utility>
#include <vector>

#include "dimattn/context_parallel.h"
#include "dimattn/ext/backend.h"

namespace dimattn::detail {

using PositionRange = std::pair<int64_t, int64_t>;  // [start, end) of the whole sequence's positions

// A run of one rank's shard: its place in the sequence and in the shard, and
// the dims of its query rows and of its kv positions.
struct ContextChunk {
  PositionRange range;
  int64_t offset;
  Dim q_dim, kv_dim;
};

struct ContextLayout {
  int world = 0, rank = 0;
  uint64_t seed = 0;  // the dropout seed of every rank's blocks: rank 0's
  Dim axis{"", 0}, key_dim{"", 0};
  Dims qdims, kdims, vdims;  // this rank's operands' (every rank's but axis alike)
  DType dtype = DType::float32;
  Device device{};
  std::vector<int64_t> sizes;                     // per rank: its shard's length
  std::vector<Dim> shard_dims;                    // per rank: its shard's positions as one dim
  std::vector<std::vector<ContextChunk>> chunks;  // per rank, in shard order

  // Merges and gradients accumulate in float32 (float64 for float64 calls).
  DType acc_dtype() const { return dtype == DType::float64 ? DType::float64 : DType::float32; }
  // Elements of one position of `dims` (all but axis).
  int64_t per_position(const Dims& dims) const;
  // Elements of rank r's keys and values together; the most of any rank.
  int64_t packed_size(int r) const;
  int64_t max_packed_size() const;
  // `dims` with axis replaced by `by`.
  Dims replaced(const Dims& dims, const Dim& by) const;
  // The output's dims for a query chunk: the query's but key_dim, the keys'
  // and values' own dims but axis; value features included (lse_dims: not).
  Dims out_dims(const Dim& q_dim) const;
  Dims lse_dims(const Dim& q_dim) const;
  Dims value_features() const;
};

// One all_gather of each rank's shard length along opts.axis, its dropout
// seed, whether its own checks failed (`local_error`), and what every rank
// must make alike: the sizes of keys and values per position, the options
// (sharding, strategy, causal, dropout as it acts, broadcast dropout,
// lengths) and the variants' fingerprint. Checked alike on every rank, so
// that bad input raises on every rank: a failed rank rethrows its own error,
// the others say which rank failed.
ContextLayout agree_layout(Backend& be, ProcessGroup& pg, const ContextParallel& cp, const Tensor& q, const Tensor& k,
                           const Tensor& v, const AttentionOptions& opts, double dropout, uint64_t seed,
                           const std::exception_ptr& local_error);

}  // namespace dimattn::detail
