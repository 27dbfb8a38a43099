// context_parallel_attention: one attention over a sequence split across the
// ranks of a process group (docs/distributed.md), on the public blocks of
// attention.h alone. This file is the entry and the merge; the layout of the
// shards and the agreement of the ranks are context_parallel_layout.h, the
// transfers and failures context_parallel_exchange.h.
//
// Every rank computes its query rows against every rank's keys and values,
// one block per pair of chunks, through dot_attention_block with the local
// call's options (only the kv axis, the positional dim and the positions
// change; the sinks join the merge once); the blocks merge exactly through
// the lse in float32 (float64 for float64 calls). A block knows where it lies
// in the sequence (AttentionOptions::positions), so causal masks, windows
// and ALiBi see global positions and dropout keys its mask by global (query
// row, kv column) from one seed: the result and the gradients equal the
// single-process call's, dropout included. Blocks a mask leaves empty are
// skipped, not computed. Segment ids go with their positions: each block
// takes its query chunk's ids and its kv chunk's, every rank's kv ids
// gathered once per call.
#include "dimattn/context_parallel.h"

#include <algorithm>
#include <cmath>
#include <exception>
#include <memory>
#include <vector>

#include "dimattn/internal/check.h"
#include "dimattn/run_context.h"
#include "dimattn/trace.h"
#include "common/attention_mask.h"
#include "context_parallel_exchange.h"
#include "context_parallel_layout.h"
#include "op_util.h"

namespace dimattn {
using namespace detail;

namespace {
constexpr const char* kOp = "context_parallel_attention";

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

std::vector<Dim> q_dims_of(const std::vector<ContextChunk>& chunks) {
  std::vector<Dim> out;
  for (const ContextChunk& c : chunks) out.push_back(c.q_dim);
  return out;
}
std::vector<Dim> kv_dims_of(const std::vector<ContextChunk>& chunks) {
  std::vector<Dim> out;
  for (const ContextChunk& c : chunks) out.push_back(c.kv_dim);
  return out;
}

// One more block merged into its rows' running result through the lse.
void merge(Tensor& out, Tensor& lse, const Tensor& o, const Tensor& l, DType acc) {
  const Tensor lb = cast(l, acc);
  const Tensor top = maximum(lse, lb);
  const Tensor ref = where(compare(top, Compare::eq, -INFINITY), scalar_like(top, 0), top);
  const Tensor sum = add(exp(sub(lse, ref)), exp(sub(lb, ref)));
  const Tensor merged = add(ref, log(sum));
  const Tensor base = where(compare(merged, Compare::eq, -INFINITY), scalar_like(merged, 0), merged);  // empty rows stay 0
  out = add(mul(out, exp(sub(lse, base))), mul(cast(o, acc), exp(sub(lb, base))));
  lse = merged;
}

// One context-parallel call: its group, layout and exchange, and the blocks
// and their merge, forward and backward.
class ContextCall {
 public:
  // The group, the agreement of every rank (context_parallel_layout.h) and
  // the blocks' options: the local call's `local` (checked on this rank,
  // `local_error` when that failed), sinks dropped, rank 0's dropout seed.
  ContextCall(Backend& be, std::unique_ptr<ProcessGroup> pg, const ContextParallel& cp, const Tensor& q,
              const Tensor& k, const Tensor& v, const AttentionOptions& local, double dropout, uint64_t seed,
              const std::exception_ptr& local_error)
      : pg_(std::move(pg)),
        layout_(agree_layout(be, *pg_, cp, q, k, v, local, dropout, seed, local_error)),
        exchange_(be, *pg_, layout_, cp.strategy),
        opts_(local),
        dropout_(dropout),
        sink_off_by_one_(local.variants.sink_off_by_one) {
    opts_.variants.sinks.reset();
    opts_.variants.sink_off_by_one = false;
    opts_.dropout_seed = layout_.seed;
    if (opts_.causal_query_spatial_dim) opts_.query_position_dim.reset();  // one positional dim per block
  }

  // This rank's output and, per query chunk, the lse of its rows. `sinks`:
  // the call's learnable sinks (else the off-by-one sink, or none).
  CustomFunction::Result forward(const Tensor& q, const Tensor& k, const Tensor& v,
                                 const std::optional<Tensor>& sinks) {
    const ContextLayout& l = layout_;
    const std::vector<ContextChunk>& mine = l.chunks[l.rank];
    const DType acc = l.acc_dtype();
    std::vector<Tensor> acc_out, acc_lse;
    gather_kv_segments();
    for (const ContextChunk& c : mine) {
      acc_out.push_back(zeros(l.out_dims(c.q_dim), options_like(q, acc)));
      acc_lse.push_back(full(l.lse_dims(c.q_dim), -INFINITY, options_like(q, acc)));
    }
    exchange_.each_shard(k, v, [&](int r, const Tensor& kr, const Tensor& vr) {
      for_blocks(r, kr, vr, [&](const Block& b) {
        const AttentionBlock res =
            dot_attention_block(slice_along(q, l.axis, b.q->offset, b.q->q_dim), b.k, b.v, b.opts);
        merge(acc_out[b.i], acc_lse[b.i], res.output, res.lse, acc);
      });
    });
    // A sink joins every row's denominator once, with no value: one more
    // block of lse = its logit and output 0.
    const std::optional<Tensor> sink =
        sinks ? sinks : sink_off_by_one_ ? std::optional(scalar_like(q, 0)) : std::nullopt;
    if (sink)
      for (size_t i = 0; i < mine.size(); ++i) merge(acc_out[i], acc_lse[i], scalar_like(q, 0), *sink, acc);
    std::vector<Tensor> outs;
    for (const Tensor& o : acc_out) outs.push_back(cast(o, l.dtype));
    CustomFunction::Result result;
    result.outputs = {concat_along(outs, q_dims_of(mine), l.axis)};
    result.saved = {q, k, v, result.outputs[0]};
    result.saved.insert(result.saved.end(), acc_lse.begin(), acc_lse.end());
    if (sinks) result.saved.push_back(*sinks);
    return result;
  }

  // d(query), d(keys), d(values) (and d(sinks) with learnable sinks) from
  // the saved tensors and d(output).
  std::vector<Tensor> backward(const std::vector<Tensor>& saved, const Tensor& dout, bool with_sinks) {
    const ContextLayout& l = layout_;
    const Tensor &q = saved[0], &k = saved[1], &v = saved[2], &out = saved[3];
    const std::vector<ContextChunk>& mine = l.chunks[l.rank];
    const DType acc = l.acc_dtype();
    std::vector<Tensor> dq;  // per query chunk
    for (const ContextChunk& c : mine) dq.push_back(zeros(l.replaced(l.qdims, c.q_dim), options_like(q, acc)));
    const auto [gk, gv] = exchange_.each_shard_back(k, v, [&](int r, const Tensor& kr, const Tensor& vr) {
      const std::vector<ContextChunk>& theirs = l.chunks[r];
      std::vector<Tensor> dk, dv;  // per kv chunk of rank r
      for (const ContextChunk& c : theirs) {
        dk.push_back(zeros(l.replaced(l.kdims, c.kv_dim), options_like(k, acc)));
        dv.push_back(zeros(l.replaced(l.vdims, c.kv_dim), options_like(v, acc)));
      }
      for_blocks(r, kr, vr, [&](const Block& b) {
        const Dim& qd = b.q->q_dim;
        const AttentionBlock merged{slice_along(out, l.axis, b.q->offset, qd), saved[4 + b.i]};
        const AttentionGrads g =
            dot_attention_block_backward(slice_along(q, l.axis, b.q->offset, qd), b.k, b.v, b.opts, merged,
                                         slice_along(dout, l.axis, b.q->offset, qd));
        dq[b.i] = add(dq[b.i], cast(g.query, acc));
        dk[b.j] = add(dk[b.j], cast(g.keys, acc));
        dv[b.j] = add(dv[b.j], cast(g.values, acc));
      });
      return std::pair{concat_along(dk, kv_dims_of(theirs), l.shard_dims[r]),
                       concat_along(dv, kv_dims_of(theirs), l.shard_dims[r])};
    });
    std::vector<Tensor> grads{cast(concat_along(dq, q_dims_of(mine), l.axis), l.dtype), cast(gk, l.dtype),
                              cast(gv, l.dtype)};
    if (with_sinks) grads.push_back(sinks_gradient(saved, dout));
    return grads;
  }

  ContextExchange& exchange() { return exchange_; }

 private:
  struct Block {
    size_t i, j;  // the query chunk (of this rank), the kv chunk (of its rank)
    const ContextChunk* q;
    Tensor k, v;  // the kv chunk's keys and values
    AttentionOptions opts;
  };

  // d(sinks) of this rank's rows: -sum_i exp(sink - lse_i) (dO_i . O_i),
  // summed over the dims the sinks lack (each rank's part; summed over the
  // ranks, as replicated parameters' gradients are, it is the whole call's).
  Tensor sinks_gradient(const std::vector<Tensor>& saved, const Tensor& dout) const {
    const ContextLayout& l = layout_;
    const Tensor& out = saved[3];
    const Tensor& sinks = saved.back();
    const DType acc = l.acc_dtype();
    const Tensor s = cast(sinks, acc);
    const std::vector<ContextChunk>& mine = l.chunks[l.rank];
    std::optional<Tensor> total;
    for (size_t i = 0; i < mine.size(); ++i) {
      const ContextChunk& c = mine[i];
      const Tensor& lse = saved[4 + i];
      const Tensor rows = reduce_sum(mul(cast(slice_along(dout, l.axis, c.offset, c.q_dim), acc),
                                         cast(slice_along(out, l.axis, c.offset, c.q_dim), acc)),
                                     l.value_features());
      const Tensor part = mul(exp(sub(s, lse)), rows);
      const Tensor summed = reduce_sum(part, without(part.dims(), sinks.dims()));
      total = total ? add(*total, summed) : summed;
    }
    return cast(copy_transpose(neg(*total), sinks.dims()), sinks.dtype());
  }

  // Every rank's kv segment ids over its shard (kv_ids_[r]: the keys' dims
  // order, axis last as rank r's shard dim), from one all_gather (padded to
  // the longest shard); once per call (the backward pass reuses them).
  void gather_kv_segments() {
    const std::optional<Tensor>& ids = opts_.variants.kv_segments;
    const ContextLayout& l = layout_;
    if (!ids || !kv_ids_.empty()) return;
    Dims order;  // alike on every rank (check_local: the ids' dims are the keys')
    for (const Dim& d : l.kdims)
      if (d != l.axis && ids->has(d)) order.push_back(d);
    order.push_back(l.axis);
    const Tensor mine = cast(copy_transpose(*ids, order), DType::int64);
    Backend& be = mine.backend();
    const int64_t per = l.per_position(order), most = *std::max_element(l.sizes.begin(), l.sizes.end());
    const RawPtr flat = be.reshape(be.contiguous(mine.raw()), {mine.numel()});
    std::vector<RawPtr> all;
    pg_->all_gather(be.concat({flat, be.full({per * most - mine.numel()}, 0, DType::int64, l.device)}, 0), all)
        ->wait();
    for (int r = 0; r < l.world; ++r) {
      Dims dims = order;
      dims.back() = l.shard_dims[r];
      Shape shape;
      for (const Dim& d : dims) shape.push_back(d.extent());
      kv_ids_.emplace_back(dims, DType::int64, l.device, be.reshape(be.slice(all[r], 0, 0, per * l.sizes[r]), shape),
                           &be);
    }
  }

  // Whether the masks leave every element of the block empty (no kernel
  // call): no row of the query range attends into the kv range, by the
  // kernels' own row ranges (kernels/common/attention_mask.h) over the whole
  // sequence's positions (padding is not looked at: such blocks still run).
  bool skipped(const PositionRange& q, const PositionRange& kv) const {
    const std::optional<AttentionWindow>& w = opts_.variants.window;
    const kernels::RowBounds bounds{w ? w->left.value_or(-1) : -1, w ? w->right.value_or(-1) : -1};
    const bool causal = opts_.causal_query_spatial_dim.has_value();
    const kernels::EntryMask m =
        kernels::entry_mask(nullptr, nullptr, nullptr, causal, q.second, kv.second, 0, bounds);
    for (int64_t i = q.first; i < q.second; ++i) {
      const kernels::Range row = m.row(i);
      if (std::max(row.lo, kv.first) < std::min(row.hi, kv.second)) return false;
    }
    return true;
  }

  // fn(block) for each block of this rank's query chunks against rank r's
  // keys kr and values vr that some element reaches: the local call's
  // options with the kv chunk's axis, the query chunk's positional dim and
  // the chunks' positions.
  template <class F>
  void for_blocks(int r, const Tensor& kr, const Tensor& vr, F fn) const {
    const ContextLayout& l = layout_;
    const std::vector<ContextChunk>& theirs = l.chunks[r];
    const std::vector<ContextChunk>& mine = l.chunks[l.rank];
    for (size_t j = 0; j < theirs.size(); ++j) {
      const ContextChunk& kc = theirs[j];
      const Tensor kb = slice_along(kr, l.shard_dims[r], kc.offset, kc.kv_dim);
      const Tensor vb = slice_along(vr, l.shard_dims[r], kc.offset, kc.kv_dim);
      for (size_t i = 0; i < mine.size(); ++i) {
        const ContextChunk& qc = mine[i];
        if (skipped(qc.range, kc.range)) continue;
        AttentionOptions o = opts_;
        o.axis = kc.kv_dim;
        (o.causal_query_spatial_dim ? o.causal_query_spatial_dim : o.query_position_dim) = qc.q_dim;
        o.positions = AttentionPositions{qc.range.first, kc.range.first};
        if (std::optional<Tensor>& qs = o.variants.query_segments) {  // and kv_segments (both or neither)
          qs = slice_along(*qs, l.axis, qc.offset, qc.q_dim);
          o.variants.kv_segments = slice_along(kv_ids_[r], l.shard_dims[r], kc.offset, kc.kv_dim);
        }
        const TrainFlagScope train(dropout_ > 0);  // the backward pass runs after the caller's scope ended
        fn(Block{i, j, &qc, kb, vb, std::move(o)});
      }
    }
  }

  std::unique_ptr<ProcessGroup> pg_;
  ContextLayout layout_;
  ContextExchange exchange_;
  AttentionOptions opts_;  // the blocks': the local call's, without sinks, with the shared seed
  std::vector<Tensor> kv_ids_;  // per rank: its kv segment ids (gather_kv_segments)
  double dropout_;         // as it acts in this call (0 when the train flag is off)
  bool sink_off_by_one_;  // the call's: a sink of logit 0, merged once
};

// The checks every rank makes alike on its own (the same call everywhere).
void check_local(const Tensor& q, const Tensor& k, const Tensor& v, const AttentionOptions& o,
                 const ContextParallel& cp) {
  for (const auto& [name, x] : {std::pair{"query", &q}, std::pair{"keys", &k}, std::pair{"values", &v}})
    DIMATTN_CHECK(x->has(o.axis), kOp, "shards the sequence dim axis ", o.axis.repr(), " of query, keys and values ",
                  "together (self-attention), but ", name, " ", repr(x->dims()), " lacks it; a dim that is not the ",
                  "query's positional dim and the kv axis at once cannot be sharded");
  for (const auto& [name, d] : {std::pair{"causal_query_spatial_dim", &o.causal_query_spatial_dim},
                                std::pair{"query_position_dim", &o.query_position_dim}})
    DIMATTN_CHECK(!*d || **d == o.axis, kOp, "shards axis ", o.axis.repr(), ", but ", name, " is ", (*d)->repr(),
                  ": the sharded dim must be the query's positional dim");
  std::string bad;
  auto unsupported = [&](bool set, const char* what) {
    if (set) bad += (bad.empty() ? "" : ", ") + std::string(what);
  };
  unsupported(o.causal_offset.has_value(), "causal_offset");
  unsupported(o.positions.has_value(), "positions");
  unsupported(o.variants.bias.has_value(), "bias");
  unsupported(o.variants.mask.has_value(), "mask");
  DIMATTN_CHECK(bad.empty(), kOp, "does not take ", bad, " yet (a bias, mask or offset over the whole sequence ",
                "would have to be split with it); call without them or on one process");
  for (const auto& [name, ids] : {std::pair{"query_segments", &o.variants.query_segments},
                                  std::pair{"kv_segments", &o.variants.kv_segments}})
    if (*ids) {
      for (const Dim& d : (*ids)->dims())
        DIMATTN_CHECK(d == o.axis || (q.has(d) && k.has(d) && v.has(d) && d != o.key_dim), kOp, name, " ",
                      repr((*ids)->dims()), " vary over ", d.repr(), ", which is neither the sharded axis ",
                      o.axis.repr(), " nor a dim of query, keys and values; give each rank its shard's ids over ",
                      "the batch dims and axis");
      DIMATTN_CHECK((*ids)->has(o.axis), kOp, name, " ", repr((*ids)->dims()), " do not vary over the sharded axis ",
                    o.axis.repr(), "; give each rank its shard's ids over axis (a constant id expanded over it)");
    }
  DIMATTN_CHECK(!TraceScope::capturing(), kOp, "calls cannot be traced (the energies live on every rank); trace a ",
                "single-process call");
  if (cp.lengths) {
    DIMATTN_CHECK(!o.axis.is_dynamic(), kOp, "has the whole sequence's lengths, and axis ", o.axis.repr(),
                  " is dynamic too; give each rank's shard a static axis of its size");
    const DType dt = cp.lengths->dtype();
    DIMATTN_CHECK(dt == DType::int32 || dt == DType::int64, kOp, "lengths must be int32 or int64, got ",
                  cp.lengths->repr());
    for (const Dim& d : cp.lengths->dims())
      DIMATTN_CHECK(q.has(d) && k.has(d) && v.has(d) && d != o.axis && d != o.key_dim, kOp, "lengths ",
                    repr(cp.lengths->dims()), " vary over ", d.repr(), ", which is not a batch dim of query, keys ",
                    "and values");
  }
}

}  // namespace

Tensor context_parallel_attention(const Tensor& query, const Tensor& keys, const Tensor& values,
                                  const AttentionOptions& o, const ContextParallel& cp) {
  check_local(query, keys, values, o, cp);
  Backend& be = query.backend();
  std::unique_ptr<ProcessGroup> pg = be.process_group(cp.group, cp.timeout_seconds);
  DIMATTN_CHECK(pg->size() >= 2, kOp, "over a process group of size ", pg->size(), " ('", cp.group,
                "'): there is nothing to split; call dot_attention on one process");
  // The call on this rank's shard alone, checked as dot_attention checks it,
  // with the seed its dropout draws as a single-process call draws it (rank
  // 0's is shared).
  const double dropout = train_flag() ? o.att_dropout : 0.0;  // as it acts
  AttentionOptions local = o;
  if (!local.causal_query_spatial_dim) local.query_position_dim = o.axis;
  if (dropout > 0 && !local.dropout_seed) local.dropout_seed = next_random_seed();
  // The blocks pass every variant on (they copy these options), the sinks
  // through the merge; check_local rejected those over the whole sequence.
  std::exception_ptr error;
  try {
    explain_attention(query, keys, values, local);
  } catch (const Error&) {
    error = std::current_exception();
  }
  auto call = std::make_shared<ContextCall>(be, std::move(pg), cp, query, keys, values, local, dropout,
                                            local.dropout_seed.value_or(0), error);

  auto fn = std::make_shared<CustomFunction>();
  const bool learnable = o.variants.sinks.has_value();
  fn->forward = [call, learnable](const std::vector<Tensor>& in) {
    CustomFunction::Result result;
    call->exchange().guarded(
        [&] { result = call->forward(in[0], in[1], in[2], learnable ? std::optional(in[3]) : std::nullopt); });
    return result;
  };
  fn->backward = [call, learnable](const std::vector<Tensor>& saved, const std::vector<Tensor>& grads) {
    std::vector<Tensor> result;
    call->exchange().guarded([&] { result = call->backward(saved, grads[0], learnable); });
    return result;
  };
  std::vector<Tensor> inputs{query, keys, values};
  if (learnable) inputs.push_back(*o.variants.sinks);
  return be.apply_custom_function(inputs, fn)[0];
}

}  // namespace dimattn
