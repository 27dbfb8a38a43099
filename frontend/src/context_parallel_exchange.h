#pragma once
// Context parallelism's exchange (context_parallel.cpp): every rank's keys
// and values reach every rank — around the ring (send/recv, the next
// transfer in flight while the current blocks compute) or all at once
// (all_gather) — their gradients travel back to their rank, and a failure on
// any rank reaches every rank (ProcessGroup's waits are bounded by the
// group's timeout).
#include <functional>
#include <utility>

#include "context_parallel_layout.h"

namespace dimattn::detail {

class ContextExchange {
 public:
  // pre: pg and layout outlive the exchange.
  ContextExchange(Backend& be, ProcessGroup& pg, const ContextLayout& layout, ContextStrategy strategy)
      : be_(be), pg_(pg), l_(layout), ring_(strategy == ContextStrategy::ring) {}

  // fn(r, keys, values) for every rank r, in the order this rank meets them
  // (its own first, then rank - 1, rank - 2, ...), over rank r's shard dim.
  using ShardFn = std::function<void(int r, const Tensor& keys, const Tensor& values)>;
  void each_shard(const Tensor& k, const Tensor& v, const ShardFn& fn);
  // The same for the backward pass: fn returns the gradients of rank r's keys
  // and values from this rank's rows (in the accumulation dtype, over its
  // shard dim); returns this rank's own keys' and values' gradients, summed
  // over every rank's rows (over axis).
  using GradientFn = std::function<std::pair<Tensor, Tensor>(int r, const Tensor& keys, const Tensor& values)>;
  std::pair<Tensor, Tensor> each_shard_back(const Tensor& k, const Tensor& v, const GradientFn& fn);

  // fn() on every rank, then one all-reduce of who failed: a rank whose peer
  // failed raises too instead of returning (or waiting forever on a transfer
  // that never comes).
  void guarded(const std::function<void()>& fn);

 private:
  // Rank r's keys and values (over its shard dim, dims as this rank's) from
  // one flat buffer of dtype dt.
  std::pair<Tensor, Tensor> unpack(const RawPtr& packed, int r, DType dt) const;
  // k's and v's elements, k's then v's, as one flat buffer (dims as kdims, vdims).
  RawPtr pack(const Tensor& k, const Tensor& v, const Dim& along) const;

  Backend& be_;
  ProcessGroup& pg_;
  const ContextLayout& l_;
  bool ring_;
};

}  // namespace dimattn::detail
