#pragma once
// The collectives context parallelism needs (frontend/src/context_parallel_exchange.cpp),
// over a backend's process group (Backend::process_group): the torch backend
// adapts c10d's ProcessGroup (Gloo on CPU, NCCL on CUDA), resolved by name.
// Buffers are raw 1-d tensors of the backend; ranks are the group's own.
// Each operation starts at once and returns its handle; wait() blocks until it
// completes (at most the group's timeout) and throws dimattn::Error on failure
// or timeout. A handle keeps its buffers alive until then.
#include <memory>
#include <vector>

#include "dimattn/tensor.h"

namespace dimattn {

class CollectiveWork {
 public:
  virtual ~CollectiveWork() = default;
  virtual void wait() = 0;
};
using CollectiveWorkPtr = std::unique_ptr<CollectiveWork>;

class ProcessGroup {
 public:
  virtual ~ProcessGroup() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Each rank's x (all of one size), in rank order, into `out` (resized).
  virtual CollectiveWorkPtr all_gather(const RawPtr& x, std::vector<RawPtr>& out) = 0;
  // x summed over the ranks, in place.
  virtual CollectiveWorkPtr all_reduce_sum(const RawPtr& x) = 0;
  virtual CollectiveWorkPtr send(const RawPtr& x, int peer, int tag) = 0;
  // Into `into`, in place (allocated by the caller with the sender's size).
  virtual CollectiveWorkPtr recv(const RawPtr& into, int peer, int tag) = 0;
};

}  // namespace dimattn
