#include "context_parallel_exchange.h"

#include <exception>
#include <string>
#include <vector>

#include "dimattn/internal/check.h"
#include "dimattn/ops.h"

namespace dimattn::detail {
namespace {
constexpr const char* kOp = "context_parallel_attention";

// A tensor's elements, row-major, as a 1-d raw tensor.
RawPtr flat(const Tensor& x) { return x.backend().reshape(x.backend().contiguous(x.raw()), {x.numel()}); }

}  // namespace

RawPtr ContextExchange::pack(const Tensor& k, const Tensor& v, const Dim& along) const {
  return be_.concat({flat(copy_transpose(k, l_.replaced(l_.kdims, along))),
                     flat(copy_transpose(v, l_.replaced(l_.vdims, along)))},
                    0);
}

std::pair<Tensor, Tensor> ContextExchange::unpack(const RawPtr& packed, int r, DType dt) const {
  auto shaped = [&](const Dims& dims, int64_t start, int64_t n) {
    const Dims d = l_.replaced(dims, l_.shard_dims[r]);
    Shape shape;
    for (const Dim& x : d) shape.push_back(x.extent());
    return Tensor(d, dt, l_.device, be_.reshape(be_.slice(packed, 0, start, start + n), shape), &be_);
  };
  const int64_t nk = l_.per_position(l_.kdims) * l_.sizes[r];
  return {shaped(l_.kdims, 0, nk), shaped(l_.vdims, nk, l_.per_position(l_.vdims) * l_.sizes[r])};
}

void ContextExchange::each_shard(const Tensor& k, const Tensor& v, const ShardFn& fn) {
  const int world = l_.world, rank = l_.rank;
  RawPtr packed = pack(k, v, l_.axis);
  std::vector<RawPtr> gathered;
  if (!ring_) {
    RawPtr mine = be_.concat(
        {packed, be_.full({l_.max_packed_size() - l_.packed_size(rank)}, 0, l_.dtype, l_.device)}, 0);
    pg_.all_gather(mine, gathered)->wait();
  }
  const int nxt = (rank + 1) % world, prv = (rank + world - 1) % world;
  for (int step = 0; step < world; ++step) {
    const int r = (rank - step + world) % world;
    if (!gathered.empty()) {
      const auto [kr, vr] = unpack(be_.slice(gathered[r], 0, 0, l_.packed_size(r)), r, l_.dtype);
      fn(r, kr, vr);
      continue;
    }
    // The next shard's transfer in flight while fn computes on this one.
    CollectiveWorkPtr send, recv;
    RawPtr next;
    if (step < world - 1) {
      next = be_.full({l_.packed_size((r + world - 1) % world)}, 0, l_.dtype, l_.device);
      send = pg_.send(packed, nxt, 0);
      recv = pg_.recv(next, prv, 0);
    }
    const auto [kr, vr] = unpack(packed, r, l_.dtype);
    fn(r, kr, vr);
    if (send) {
      send->wait();
      recv->wait();
      packed = next;
    }
  }
}

std::pair<Tensor, Tensor> ContextExchange::each_shard_back(const Tensor& k, const Tensor& v, const GradientFn& fn) {
  const int world = l_.world, rank = l_.rank;
  const DType acc = l_.acc_dtype();
  const int nxt = (rank + 1) % world, prv = (rank + world - 1) % world;
  CollectiveWorkPtr sending;
  std::vector<RawPtr> slots;  // all_gather: each rank's flat gradients, in the order the ranks are met
  each_shard(k, v, [&](int r, const Tensor& kr, const Tensor& vr) {
    // Ring: d(keys), d(values) of rank r travel with its keys. This step's
    // blocks add into fresh zeros while the sum of the ranks before
    // arrives; both meet after the blocks, and the sum moves on while the
    // next step computes.
    RawPtr incoming;
    CollectiveWorkPtr receiving;
    if (ring_ && r != rank) {
      incoming = be_.full({l_.packed_size(r)}, 0, acc, l_.device);
      receiving = pg_.recv(incoming, prv, 1);
    }
    const auto [dk, dv] = fn(r, kr, vr);
    RawPtr grads = pack(dk, dv, l_.shard_dims[r]);
    if (!ring_) {
      slots.push_back(be_.concat({grads, be_.full({l_.max_packed_size() - l_.packed_size(r)}, 0, acc, l_.device)}, 0));
      return;
    }
    if (receiving) {
      receiving->wait();
      grads = be_.binary(BinaryOp::add, grads, incoming);
    }
    if (sending) sending->wait();
    sending = pg_.send(grads, nxt, 1);
  });
  RawPtr own;
  if (ring_) {
    // After the last step this rank's own gradients arrive, summed over
    // every rank.
    own = be_.full({l_.packed_size(rank)}, 0, acc, l_.device);
    pg_.recv(own, prv, 1)->wait();
    if (sending) sending->wait();
  } else {
    // slots are in the order each_shard visits the ranks: rank - step.
    std::vector<RawPtr> ordered(world);
    for (int step = 0; step < world; ++step) ordered[(rank - step + world) % world] = slots[step];
    RawPtr all = be_.concat(ordered, 0);
    pg_.all_reduce_sum(all)->wait();
    const int64_t start = rank * l_.max_packed_size();
    own = be_.slice(all, 0, start, start + l_.packed_size(rank));
  }
  const auto [gk, gv] = unpack(own, rank, acc);
  return {replace_dim(gk, l_.shard_dims[rank], l_.axis), replace_dim(gv, l_.shard_dims[rank], l_.axis)};
}

void ContextExchange::guarded(const std::function<void()>& fn) {
  std::exception_ptr error;
  try {
    fn();
  } catch (...) {
    error = std::current_exception();
  }
  std::vector<double> flags(l_.world, 0.0);
  if (error) flags[l_.rank] = 1;
  const RawPtr failed = be_.from_host({l_.world}, flags, DType::int32, l_.device);
  try {
    pg_.all_reduce_sum(failed)->wait();
  } catch (...) {
    if (!error) throw;
  }
  if (error) std::rethrow_exception(error);
  const std::vector<double> sums = be_.to_host(failed);
  std::string ranks;
  for (int r = 0; r < l_.world; ++r)
    if (sums[r] != 0) ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
  DIMATTN_CHECK(ranks.empty(), kOp, "rank(s) ", ranks, " of the group failed in this call (their own errors say ",
                "why); this rank's result would be incomplete");
}

}  // namespace dimattn::detail
