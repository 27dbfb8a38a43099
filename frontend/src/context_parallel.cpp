// dot_attention(..., context_parallel): one attention over a sequence split
// across the ranks of a process group (docs/distributed.md).
//
// Every rank computes its query rows against every rank's keys and values,
// one block per pair of chunks, through dot_attention_block (dimattn's CPU
// kernel, which returns each row's log-sum-exp); the blocks merge exactly
// through the lse in float32 (float64 for float64 calls). A block knows where
// it lies in the sequence (AttentionOptions::positions), so causal masks,
// windows and ALiBi see global positions and dropout keys its mask by global
// (query row, kv column): the result and the gradients equal the
// single-process call's, dropout included. Blocks a mask leaves empty are
// skipped, not computed.
//
// ring: each rank's keys and values travel around the ring (send/recv), the
// next transfer in flight while the current blocks compute; in the backward
// pass their gradients travel with them and arrive home at the end.
// all_gather: every rank's keys and values at once, their gradients summed by
// one all-reduce.
#include <algorithm>
#include <cmath>
#include <exception>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "dimattn/attention.h"
#include "dimattn/ext/backend.h"
#include "dimattn/internal/check.h"
#include "dimattn/run_context.h"
#include "dimattn/trace.h"
#include "common/attention_mask.h"
#include "attention_roles.h"
#include "op_util.h"

namespace dimattn {
using namespace detail;

namespace {
constexpr const char* kOp = "dot_attention";

using Range = std::pair<int64_t, int64_t>;  // [start, end) of the whole sequence's positions


// x's positions [start, start + into.extent()) along d, as dim `into`.
Tensor slice_along(const Tensor& x, const Dim& d, int64_t start, const Dim& into) {
  return slice(x, d, start, start + into.extent(), into).first;
}

// Parts over chunk dims (parts[i] over chunks[i], else alike), joined in
// order along one dim `into`, in the dims order of parts[0].
Tensor concat_along(const std::vector<Tensor>& parts, const std::vector<Dim>& chunks, const Dim& into) {
  const Dims& order = parts[0].dims();
  const int ax = parts[0].axis_of(chunks[0]);
  std::vector<RawPtr> raws;
  for (size_t i = 0; i < parts.size(); ++i) {
    Dims o = order;
    o[ax] = chunks[i];
    raws.push_back(copy_transpose(parts[i], o).raw());
  }
  Dims dims = order;
  dims[ax] = into;
  Backend& be = parts[0].backend();
  RawPtr raw = raws.size() == 1 ? raws[0] : be.concat(raws, ax);
  return Tensor(std::move(dims), parts[0].dtype(), parts[0].device(), std::move(raw), &be);
}

// A tensor's elements, row-major, as a 1-d raw tensor.
RawPtr flat(const Tensor& x) { return x.backend().reshape(x.backend().contiguous(x.raw()), {x.numel()}); }

// One context-parallel call: its group, chunks and blocks, the exchange of
// keys and values, and the lse merge, forward and backward.
class Ring {
 public:
  Ring(Backend& be, std::unique_ptr<ProcessGroup> pg, const ContextParallel& cp) : be_(be), pg_(std::move(pg)), cp_(cp) {
    world_ = pg_->size();
    rank_ = pg_->rank();
  }

  int world() const { return world_; }

  // Exchanges every rank's shard length and call, checks them alike on every
  // rank (so that bad input raises on every rank), and lays out the chunks.
  void agree(const Tensor& q, const Tensor& k, const Tensor& v, const AttentionOptions& o, const AttentionCall* local,
             const std::exception_ptr& local_error) {
    axis_ = o.axis;
    key_dim_ = o.key_dim;
    qdims_ = q.dims();
    kdims_ = k.dims();
    vdims_ = v.dims();
    dtype_ = q.dtype();
    device_ = q.device();
    lengths_ = cp_.lengths;
    if (local) {
      causal_ = local->causal;
      dropout_ = local->dropout;
      broadcast_ = local->dropout_broadcast;
      seed_ = local->dropout_seed;
      scale_ = local->scale;
    }
    variants_ = o.variants;
    // What each rank sends: its shard length, its seed (rank 0's is used),
    // whether preparing its call failed, then what every rank must agree on
    // (from kAgreed on): the sizes of keys and values per position, the
    // options, and the variants' fingerprint. float64: the fingerprint holds
    // fractions (a softcap), the seed's halves fit exactly.
    enum : size_t { kLength, kSeedHigh, kSeedLow, kFailed, kAgreed, kKeysPerPosition = kAgreed, kValuesPerPosition };
    std::vector<double> meta{double(q.has(axis_) ? axis_.extent() : 0),
                             double(seed_ >> 32),
                             double(seed_ & 0xffffffffu),
                             double(local_error != nullptr),
                             double(per_position(kdims_)),
                             double(per_position(vdims_)),
                             double(cp_.sharding),
                             double(cp_.strategy),
                             double(causal_),
                             dropout_,
                             double(broadcast_),
                             double(lengths_.has_value())};
    const std::vector<double> fingerprint = variants_.fingerprint();
    meta.insert(meta.end(), fingerprint.begin(), fingerprint.end());
    const auto n = static_cast<int64_t>(meta.size());
    std::vector<RawPtr> all;
    pg_->all_gather(be_.from_host({n}, meta, DType::float64, device_), all)->wait();
    std::vector<std::vector<double>> metas;
    for (const RawPtr& r : all) metas.push_back(be_.to_host(r));
    for (int r = 0; r < world_; ++r) {
      const std::vector<double>& m = metas[r];
      if (m[kFailed] != 0) {
        if (r == rank_) std::rethrow_exception(local_error);
        fail(kOp, "context_parallel: rank ", r, " of the group failed to prepare its call (its own error says why); ",
             "every rank makes the same call with its own shard");
      }
      DIMATTN_CHECK(std::equal(m.begin() + kAgreed, m.end(), metas[0].begin() + kAgreed), kOp,
                    "context_parallel: rank ", r, " calls with other options or other sizes of the dims but axis than ",
                    "rank 0 (sharding, strategy, causal, dropout, lengths, variants; keys and values have ",
                    m[kKeysPerPosition], " and ", m[kValuesPerPosition], " elements per position there, ",
                    metas[0][kKeysPerPosition], " and ", metas[0][kValuesPerPosition],
                    " on rank 0); every rank must make the same call on its own shard");
      sizes_.push_back(static_cast<int64_t>(m[kLength]));
    }
    seed_ = (uint64_t(metas[0][kSeedHigh]) << 32) | uint64_t(metas[0][kSeedLow]);  // rank 0's draw, shared
    int64_t total = 0;
    for (int64_t s : sizes_) total += s;
    if (cp_.sharding == ContextSharding::load_balanced) {
      const bool even = std::all_of(sizes_.begin(), sizes_.end(), [&](int64_t s) { return s == sizes_[0]; });
      DIMATTN_CHECK(even && sizes_[0] % 2 == 0, kOp, "context_parallel: load_balanced shards hold two equal chunks ",
                    "each, so every rank's shard has one even length; got shard lengths ", sizes_str(), " along ",
                    axis_.repr());
      for (int r = 0; r < world_; ++r) ranges_.push_back(context_shard_ranges(total, world_, r, cp_.sharding));
    } else {
      int64_t start = 0;
      for (int r = 0; r < world_; ++r) {
        ranges_.push_back({{start, start + sizes_[r]}});
        start += sizes_[r];
      }
    }
    for (int r = 0; r < world_; ++r) shard_dims_.emplace_back(axis_.name() + "@" + std::to_string(r), sizes_[r]);
  }

  // This rank's output and, per query chunk, the lse of its rows. `sinks`:
  // the call's learnable sinks (else the off-by-one sink, or none).
  CustomFunction::Result forward(const Tensor& q, const Tensor& k, const Tensor& v,
                                 const std::optional<Tensor>& sinks) {
    const std::vector<Chunk> mine = chunks(rank_);
    std::vector<Tensor> acc_out, acc_lse;
    for (const Chunk& c : mine) {
      acc_out.push_back(zeros(out_dims(c.q_dim), options_like(q, acc_dtype())));
      acc_lse.push_back(full(lse_dims(c.q_dim), -INFINITY, options_like(q, acc_dtype())));
    }
    exchange(k, v, [&](int r, const Tensor& kr, const Tensor& vr) {
      for_blocks(r, kr, vr, [&](const Block& b) {
        const AttentionBlock res = attention_block(slice_along(q, axis_, b.q->offset, b.q->q_dim), b.k, b.v,
                                                   b.opts, seed_);
        merge(acc_out[b.i], acc_lse[b.i], res.output, res.lse);
      });
    });
    // A sink joins every row's denominator once, with no value: one more
    // block of lse = its logit and output 0.
    const std::optional<Tensor> sink =
        sinks ? sinks : variants_.sink_off_by_one ? std::optional(scalar_like(q, 0)) : std::nullopt;
    if (sink)
      for (size_t i = 0; i < mine.size(); ++i) merge(acc_out[i], acc_lse[i], scalar_like(q, 0), *sink);
    std::vector<Tensor> outs;
    std::vector<Dim> q_dims;
    for (size_t i = 0; i < mine.size(); ++i) {
      outs.push_back(cast(acc_out[i], dtype_));
      q_dims.push_back(mine[i].q_dim);
    }
    CustomFunction::Result result;
    result.outputs = {concat_along(outs, q_dims, axis_)};
    result.saved = {q, k, v, result.outputs[0]};
    result.saved.insert(result.saved.end(), acc_lse.begin(), acc_lse.end());
    if (sinks) result.saved.push_back(*sinks);
    return result;
  }

  // d(query), d(keys), d(values) (and d(sinks) with learnable sinks) from
  // the saved tensors and d(output).
  std::vector<Tensor> backward(const std::vector<Tensor>& saved, const Tensor& dout, bool with_sinks) {
    const Tensor &q = saved[0], &k = saved[1], &v = saved[2], &out = saved[3];
    const std::vector<Chunk> mine = chunks(rank_);
    std::vector<Tensor> dq;  // per query chunk, in acc_dtype
    for (const Chunk& c : mine) dq.push_back(zeros(replaced(qdims_, c.q_dim), options_like(q, acc_dtype())));
    const bool ring = cp_.strategy == ContextStrategy::ring;
    const int nxt = (rank_ + 1) % world_, prv = (rank_ + world_ - 1) % world_;
    CollectiveWorkPtr sending;
    std::vector<RawPtr> slots;  // all_gather: each rank's flat gradients
    exchange(k, v, [&](int r, const Tensor& kr, const Tensor& vr) {
      // Ring: d(keys), d(values) of rank r travel with its keys. This step's
      // blocks add into fresh zeros while the sum of the ranks before
      // arrives; both meet after the blocks, and the sum moves on while the
      // next step computes.
      RawPtr incoming;
      CollectiveWorkPtr receiving;
      if (ring && r != rank_) {
        incoming = be_.full({packed_size(r)}, 0, acc_dtype(), device_);
        receiving = pg_->recv(incoming, prv, 1);
      }
      std::vector<Tensor> dk, dv;  // per kv chunk of rank r
      for (const Chunk& c : chunks(r)) {
        dk.push_back(zeros(replaced(kdims_, c.kv_dim), options_like(k, acc_dtype())));
        dv.push_back(zeros(replaced(vdims_, c.kv_dim), options_like(v, acc_dtype())));
      }
      for_blocks(r, kr, vr, [&](const Block& b) {
        const Dim& qd = b.q->q_dim;
        const AttentionBlock merged{slice_along(out, axis_, b.q->offset, qd), saved[4 + b.i]};
        const AttentionGrads g = attention_block_backward(slice_along(q, axis_, b.q->offset, qd), b.k, b.v, b.opts,
                                                          merged, slice_along(dout, axis_, b.q->offset, qd), seed_);
        dq[b.i] = add(dq[b.i], cast(g.query, acc_dtype()));
        dk[b.j] = add(dk[b.j], cast(g.keys, acc_dtype()));
        dv[b.j] = add(dv[b.j], cast(g.values, acc_dtype()));
      });
      std::vector<Dim> kv_dims;
      for (const Chunk& c : chunks(r)) kv_dims.push_back(c.kv_dim);
      RawPtr grads = be_.concat({flat(concat_along(dk, kv_dims, shard_dims_[r])),
                                 flat(concat_along(dv, kv_dims, shard_dims_[r]))}, 0);
      if (!ring) {
        slots.push_back(be_.concat({grads, be_.full({max_packed_size() - packed_size(r)}, 0, acc_dtype(), device_)}, 0));
        return;
      }
      if (receiving) {
        receiving->wait();
        grads = be_.binary(BinaryOp::add, grads, incoming);
      }
      if (sending) sending->wait();
      sending = pg_->send(grads, nxt, 1);
    });
    RawPtr own;
    if (ring) {
      // After the last step this rank's own gradients arrive, summed over
      // every rank.
      own = be_.full({packed_size(rank_)}, 0, acc_dtype(), device_);
      pg_->recv(own, prv, 1)->wait();
      if (sending) sending->wait();
    } else {
      // slots are in the order exchange() visits the ranks: rank - step.
      std::vector<RawPtr> ordered(world_);
      for (int step = 0; step < world_; ++step) ordered[(rank_ - step + world_) % world_] = slots[step];
      RawPtr all = be_.concat(ordered, 0);
      pg_->all_reduce_sum(all)->wait();
      own = be_.slice(all, 0, rank_ * max_packed_size(), rank_ * max_packed_size() + packed_size(rank_));
    }
    std::vector<Dim> q_dims;
    for (const Chunk& c : mine) q_dims.push_back(c.q_dim);
    const auto [gk, gv] = unpack(own, rank_, acc_dtype());
    std::vector<Tensor> grads{cast(concat_along(dq, q_dims, axis_), dtype_),
                              cast(replace_dim(gk, shard_dims_[rank_], axis_), dtype_),
                              cast(replace_dim(gv, shard_dims_[rank_], axis_), dtype_)};
    if (with_sinks) grads.push_back(sinks_gradient(saved, dout));
    return grads;
  }

  // d(sinks) of this rank's rows: -sum_i exp(sink - lse_i) (dO_i . O_i),
  // summed over the dims the sinks lack (each rank's part; summed over the
  // ranks, as replicated parameters' gradients are, it is the whole call's).
  Tensor sinks_gradient(const std::vector<Tensor>& saved, const Tensor& dout) {
    const Tensor& out = saved[3];
    const Tensor& sinks = saved.back();
    const Tensor s = cast(sinks, acc_dtype());
    const std::vector<Chunk> mine = chunks(rank_);
    std::optional<Tensor> total;
    for (size_t i = 0; i < mine.size(); ++i) {
      const Chunk& c = mine[i];
      const Tensor& lse = saved[4 + i];
      const Tensor rows = reduce_sum(mul(cast(slice_along(dout, axis_, c.offset, c.q_dim), acc_dtype()),
                                         cast(slice_along(out, axis_, c.offset, c.q_dim), acc_dtype())),
                                     value_features());
      const Tensor part = mul(exp(sub(s, lse)), rows);
      const Tensor summed = reduce_sum(part, without(part.dims(), sinks.dims()));
      total = total ? add(*total, summed) : summed;
    }
    return cast(copy_transpose(neg(*total), sinks.dims()), sinks.dtype());
  }

  // fn() on every rank, then one all-reduce of who failed: a rank whose peer
  // failed raises too instead of returning (or waiting forever on a transfer
  // that never comes: each wait is bounded by the timeout).
  template <class F>
  auto guarded(F fn) -> decltype(fn()) {
    std::exception_ptr error;
    decltype(fn()) result;
    try {
      result = fn();
    } catch (...) {
      error = std::current_exception();
    }
    std::vector<double> flags(world_, 0.0);
    if (error) flags[rank_] = 1;
    const RawPtr failed = be_.from_host({world_}, flags, DType::int32, device_);
    try {
      pg_->all_reduce_sum(failed)->wait();
    } catch (...) {
      if (!error) throw;
    }
    if (error) std::rethrow_exception(error);
    const std::vector<double> sums = be_.to_host(failed);
    std::string ranks;
    for (int r = 0; r < world_; ++r)
      if (sums[r] != 0) ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
    DIMATTN_CHECK(ranks.empty(), kOp, "context_parallel: rank(s) ", ranks, " of the group failed in this call (their ",
                  "own errors say why); this rank's result would be incomplete");
    return result;
  }

 private:
  // A chunk of a rank's shard: its place in the sequence and in the shard,
  // and the dims of its query rows and of its kv positions.
  struct Chunk {
    Range range;
    int64_t offset;
    Dim q_dim, kv_dim;
  };
  struct Block {
    size_t i, j;       // the query chunk (of this rank), the kv chunk (of its rank)
    const Chunk* q;
    Tensor k, v;       // the kv chunk's keys and values
    AttentionOptions opts;
  };

  std::vector<Chunk> chunks(int r) {
    auto it = chunks_.find(r);
    if (it != chunks_.end()) return it->second;
    std::vector<Chunk> out;
    int64_t offset = 0;
    for (const Range& range : ranges_[r]) {
      out.push_back({range, offset, chunk_dim(axis_.name(), range), chunk_dim(axis_.name() + "_kv", range)});
      offset += range.second - range.first;
    }
    return chunks_[r] = out;
  }

  Dim chunk_dim(const std::string& name, const Range& r) const {
    if (!lengths_) return Dim(name, r.second - r.first);
    return Dim::dynamic(name, window_lengths(*lengths_, r.first, r.second - r.first), r.second - r.first);
  }

  // Whether the masks leave every element of the block empty (no kernel
  // call): no row of the query range attends into the kv range, by the
  // kernels' own row ranges (kernels/common/attention_mask.h) over the whole
  // sequence's positions (padding is not looked at: such blocks still run).
  bool skipped(const Range& q, const Range& kv) const {
    const std::optional<AttentionWindow>& w = variants_.window;
    const kernels::RowBounds bounds{w ? w->left.value_or(-1) : -1, w ? w->right.value_or(-1) : -1};
    const kernels::EntryMask m =
        kernels::entry_mask(nullptr, nullptr, nullptr, causal_, q.second, kv.second, 0, bounds);
    for (int64_t i = q.first; i < q.second; ++i) {
      const kernels::Range row = m.row(i);
      if (std::max(row.lo, kv.first) < std::min(row.hi, kv.second)) return false;
    }
    return true;
  }

  // fn(block) for each block of this rank's query chunks against rank r's
  // keys kr and values vr that some element reaches.
  template <class F>
  void for_blocks(int r, const Tensor& kr, const Tensor& vr, F fn) {
    const std::vector<Chunk> theirs = chunks(r), mine = chunks(rank_);
    for (size_t j = 0; j < theirs.size(); ++j) {
      const Chunk& kc = theirs[j];
      const Tensor kb = slice_along(kr, shard_dims_[r], kc.offset, kc.kv_dim);
      const Tensor vb = slice_along(vr, shard_dims_[r], kc.offset, kc.kv_dim);
      for (size_t i = 0; i < mine.size(); ++i) {
        const Chunk& qc = mine[i];
        if (skipped(qc.range, kc.range)) continue;
        AttentionOptions o{.key_dim = key_dim_, .axis = kc.kv_dim};
        o.att_dropout = dropout_;
        o.att_dropout_broadcast = broadcast_;
        (causal_ ? o.causal_query_spatial_dim : o.query_position_dim) = qc.q_dim;
        o.scale = scale_;
        // The call's variants but its sinks, which join the merge once
        // (forward) instead of every block's lse.
        o.variants = variants_;
        o.variants.sinks.reset();
        o.variants.sink_off_by_one = false;
        o.positions = AttentionPositions{qc.range.first, kc.range.first};
        const TrainFlagScope train(dropout_ > 0);  // the backward pass runs after the caller's scope ended
        fn(Block{i, j, &qc, kb, vb, std::move(o)});
      }
    }
  }

  // fn(r, keys, values) for every rank r in the order this rank meets them
  // (its own first), rank r's shard over its shard dim; with the ring, the
  // transfer of the next in flight while fn computes.
  template <class F>
  void exchange(const Tensor& k, const Tensor& v, F fn) {
    RawPtr packed = be_.concat({flat(k), flat(v)}, 0);
    std::vector<RawPtr> gathered;
    if (cp_.strategy == ContextStrategy::all_gather) {
      RawPtr mine = be_.concat({packed, be_.full({max_packed_size() - packed_size(rank_)}, 0, dtype_, device_)}, 0);
      pg_->all_gather(mine, gathered)->wait();
    }
    const int nxt = (rank_ + 1) % world_, prv = (rank_ + world_ - 1) % world_;
    for (int step = 0; step < world_; ++step) {
      const int r = (rank_ - step + world_) % world_;
      if (!gathered.empty()) {
        const auto [kr, vr] = unpack(be_.slice(gathered[r], 0, 0, packed_size(r)), r, dtype_);
        fn(r, kr, vr);
        continue;
      }
      CollectiveWorkPtr send, recv;
      RawPtr next;
      if (step < world_ - 1) {
        next = be_.full({packed_size((r + world_ - 1) % world_)}, 0, dtype_, device_);
        send = pg_->send(packed, nxt, 0);
        recv = pg_->recv(next, prv, 0);
      }
      const auto [kr, vr] = unpack(packed, r, dtype_);
      fn(r, kr, vr);
      if (send) {
        send->wait();
        recv->wait();
        packed = next;
      }
    }
  }

  // Rank r's keys and values (over its shard dim) from one flat buffer.
  std::pair<Tensor, Tensor> unpack(const RawPtr& packed, int r, DType dt) {
    auto shaped = [&](const Dims& dims, int64_t start, int64_t n) {
      const Dims d = replaced(dims, shard_dims_[r]);
      Shape shape;
      for (const Dim& x : d) shape.push_back(x.extent());
      return Tensor(d, dt, device_, be_.reshape(be_.slice(packed, 0, start, start + n), shape), &be_);
    };
    const int64_t nk = per_position(kdims_) * sizes_[r];
    return {shaped(kdims_, 0, nk), shaped(vdims_, nk, per_position(vdims_) * sizes_[r])};
  }

  int64_t per_position(const Dims& dims) const {
    int64_t n = 1;
    for (const Dim& d : dims)
      if (d != axis_) n *= d.extent();
    return n;
  }
  int64_t packed_size(int r) const { return (per_position(kdims_) + per_position(vdims_)) * sizes_[r]; }
  int64_t max_packed_size() const {
    return (per_position(kdims_) + per_position(vdims_)) * *std::max_element(sizes_.begin(), sizes_.end());
  }

  Dims replaced(const Dims& dims, const Dim& by) const {
    Dims out = dims;
    for (Dim& d : out)
      if (d == axis_) d = by;
    return out;
  }

  // The output's dims for a query chunk: the query's but key_dim, the keys'
  // and values' own dims but axis; value features included (lse_dims: not).
  Dims out_dims(const Dim& q_dim) const { return union_dims(lse_dims(q_dim), value_features()); }
  Dims lse_dims(const Dim& q_dim) const {
    Dims out;
    for (const Dims* dims : {&qdims_, &kdims_})
      for (const Dim& d : *dims)
        if (d != key_dim_ && !contains(out, d)) out.push_back(d);
    return replaced(without(out, value_features()), q_dim);
  }
  Dims value_features() const {
    Dims out;
    for (const Dim& d : vdims_)
      if (d == key_dim_ || (d != axis_ && !contains(qdims_, d) && !contains(kdims_, d))) out.push_back(d);
    return out;
  }
  static bool contains(const Dims& dims, const Dim& d) { return std::find(dims.begin(), dims.end(), d) != dims.end(); }

  DType acc_dtype() const { return dtype_ == DType::float64 ? DType::float64 : DType::float32; }

  // One more block merged into its rows' running result through the lse.
  void merge(Tensor& out, Tensor& lse, const Tensor& o, const Tensor& l) const {
    const Tensor lb = cast(l, acc_dtype());
    const Tensor top = maximum(lse, lb);
    const Tensor ref = where(compare(top, Compare::eq, -INFINITY), scalar_like(top, 0), top);
    const Tensor sum = add(exp(sub(lse, ref)), exp(sub(lb, ref)));
    const Tensor merged = add(ref, log(sum));
    const Tensor base = where(compare(merged, Compare::eq, -INFINITY), scalar_like(merged, 0), merged);  // empty rows stay 0
    out = add(mul(out, exp(sub(lse, base))), mul(cast(o, acc_dtype()), exp(sub(lb, base))));
    lse = merged;
  }

  std::string sizes_str() const {
    std::string s;
    for (int64_t x : sizes_) s += (s.empty() ? "" : ", ") + std::to_string(x);
    return "[" + s + "]";
  }

  Backend& be_;
  std::unique_ptr<ProcessGroup> pg_;
  ContextParallel cp_;
  int world_ = 0, rank_ = 0;
  Dim axis_{"", 0}, key_dim_{"", 0};
  Dims qdims_, kdims_, vdims_;
  DType dtype_ = DType::float32;
  Device device_{};
  std::optional<Tensor> lengths_;
  bool causal_ = false, broadcast_ = false;
  double dropout_ = 0.0;
  uint64_t seed_ = 0;
  double scale_ = 1.0;
  AttentionVariants variants_;  // the call's
  std::vector<int64_t> sizes_;
  std::vector<std::vector<Range>> ranges_;
  std::vector<Dim> shard_dims_;  // per rank: its shard's positions, as received
  std::map<int, std::vector<Chunk>> chunks_;
};

// The checks every rank makes alike on its own (the same call everywhere).
void check_local(const Tensor& q, const Tensor& k, const Tensor& v, const AttentionOptions& o) {
  const ContextParallel& cp = *o.context_parallel;
  for (const auto& [name, x] : {std::pair{"query", &q}, std::pair{"keys", &k}, std::pair{"values", &v}})
    DIMATTN_CHECK(x->has(o.axis), kOp, "context_parallel shards the sequence dim axis ", o.axis.repr(), " of query, ",
                  "keys and values together (self-attention), but ", name, " ", repr(x->dims()), " lacks it; a dim ",
                  "that is not the query's positional dim and the kv axis at once cannot be sharded");
  for (const auto& [name, d] : {std::pair{"causal_query_spatial_dim", &o.causal_query_spatial_dim},
                                std::pair{"query_position_dim", &o.query_position_dim}})
    DIMATTN_CHECK(!*d || **d == o.axis, kOp, "context_parallel shards axis ", o.axis.repr(), ", but ", name, " is ",
                  (*d)->repr(), ": the sharded dim must be the query's positional dim");
  std::string bad;
  auto unsupported = [&](bool set, const char* what) {
    if (set) bad += (bad.empty() ? "" : ", ") + std::string(what);
  };
  unsupported(o.causal_offset.has_value(), "causal_offset");
  unsupported(o.positions.has_value(), "positions");
  unsupported(o.variants.bias.has_value(), "bias");
  unsupported(o.variants.mask.has_value(), "mask");
  DIMATTN_CHECK(bad.empty(), kOp, "context_parallel does not take ", bad, " yet (a bias, mask or offset over the ",
                "whole sequence would have to be split with it); call without them or on one process");
  DIMATTN_CHECK(!TraceScope::capturing(), kOp, "context_parallel calls cannot be traced (the energies live on every ",
                "rank); trace a single-process call");
  if (cp.lengths) {
    DIMATTN_CHECK(!o.axis.is_dynamic(), kOp, "context_parallel has the whole sequence's lengths, and axis ",
                  o.axis.repr(), " is dynamic too; give each rank's shard a static axis of its size");
    const DType dt = cp.lengths->dtype();
    DIMATTN_CHECK(dt == DType::int32 || dt == DType::int64, kOp, "context_parallel lengths must be int32 or int64, got ",
                  cp.lengths->repr());
    for (const Dim& d : cp.lengths->dims())
      DIMATTN_CHECK(q.has(d) && k.has(d) && v.has(d) && d != o.axis && d != o.key_dim, kOp, "context_parallel ",
                    "lengths ", repr(cp.lengths->dims()), " vary over ", d.repr(), ", which is not a batch dim of ",
                    "query, keys and values");
  }
}

}  // namespace

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

Tensor detail::context_parallel_attention(const Tensor& query, const Tensor& keys, const Tensor& values,
                                          const AttentionOptions& o) {
  const ContextParallel& cp = *o.context_parallel;
  check_local(query, keys, values, o);
  Backend& be = query.backend();
  auto ring = std::make_shared<Ring>(be, be.process_group(cp.group, cp.timeout_seconds), cp);
  DIMATTN_CHECK(ring->world() >= 2, kOp, "context_parallel over a process group of size ", ring->world(), " ('",
                cp.group, "'): there is nothing to split; call dot_attention without context_parallel");
  // The call on this rank's shard alone checks the rest like dot_attention
  // does, and draws the dropout seed (rank 0's is shared).
  AttentionOptions local = o;
  local.context_parallel.reset();
  if (!local.causal_query_spatial_dim) local.query_position_dim = o.axis;
  std::optional<Prepared> prepared;
  std::exception_ptr error;
  try {
    prepared.emplace(prepare(query, keys, values, local));
    // The variants the blocks pass on (for_blocks); any other would be dropped.
    using V = VariantKind;
    const VariantSet passed =
        VariantSet().set(V::window).set(V::softcap).set(V::alibi).set(V::sinks).set(V::sinks_grad);
    const VariantSet other = prepared->call.variants.set().without(passed);
    DIMATTN_CHECK(!other.any(), kOp, "context_parallel does not take ", other.names(true), " yet; call without it or on ",
                  "one process");
  } catch (const Error&) {
    error = std::current_exception();
  }
  ring->agree(query, keys, values, o, prepared ? &prepared->call : nullptr, error);

  auto fn = std::make_shared<CustomFunction>();
  const bool learnable = o.variants.sinks.has_value();
  fn->forward = [ring, learnable](const std::vector<Tensor>& in) {
    return ring->guarded([&] { return ring->forward(in[0], in[1], in[2], learnable ? std::optional(in[3]) : std::nullopt); });
  };
  fn->backward = [ring, learnable](const std::vector<Tensor>& saved, const std::vector<Tensor>& grads) {
    return ring->guarded([&] { return ring->backward(saved, grads[0], learnable); });
  };
  std::vector<Tensor> inputs{query, keys, values};
  if (learnable) inputs.push_back(*o.variants.sinks);
  return be.apply_custom_function(inputs, fn)[0];
}

}  // namespace dimattn
