#pragma once
// context_parallel_attention: dot_attention over a sequence split across the
// ranks of a process group (context parallelism, docs/distributed.md), built
// on the blocks of attention.h (dot_attention_block and its backward): each
// rank passes its shard of query, keys and values along `axis`
// (self-attention: the query's positional dim and the kv axis are one dim)
// and gets its shard of the output; the result and its gradients equal the
// single-process call's, dropout included. On the torch backend, over a c10d
// process group (Gloo for CPU tensors) resolved by name through c10d's group
// registry, which torch.distributed fills (Python: group.group_name; the
// default group's is "0").
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "dimattn/attention.h"
#include "dimattn/tensor.h"

namespace dimattn {

enum class ContextSharding {
  contiguous,     // rank r holds one run of positions, runs in rank order, any sizes
  load_balanced,  // causal: 2N equal chunks, rank r holds chunks r and 2N-1-r
};
enum class ContextStrategy {
  ring,        // keys and values travel around the ring, overlapped with compute
  all_gather,  // every rank's keys and values gathered at once
};
struct ContextParallel {
  std::string group;
  ContextSharding sharding = ContextSharding::contiguous;
  ContextStrategy strategy = ContextStrategy::ring;
  // Bounds each wait for a peer, in seconds; unset: the group's own timeout.
  std::optional<double> timeout_seconds;
  // Padding: the whole sequence's lengths (an integer tensor over batch dims
  // of the call); each rank's axis is then a static dim of its shard's size.
  std::optional<Tensor> lengths;
};

// The [start, end) positions of a sequence of `total` that `rank` of `world`
// holds, in the order its shard lays them out (one range; two for
// load_balanced, which needs total a multiple of 2 x world).
std::vector<std::pair<int64_t, int64_t>> context_shard_ranges(int64_t total, int world, int rank,
                                                              ContextSharding sharding);

// This rank's shard of dot_attention(query, keys, values, opts) over the
// whole sequence, `opts` as for dot_attention on the shards. Every rank of
// the group makes the same call on its own shard; bad input raises on every
// rank. Not with causal_offset, positions, bias, mask or energy tracing yet.
// With autograd (torch backend) one node, whose backward pass runs the
// blocks' gradients over the group.
Tensor context_parallel_attention(const Tensor& query, const Tensor& keys, const Tensor& values,
                                  const AttentionOptions& opts, const ContextParallel& cp);

}  // namespace dimattn
