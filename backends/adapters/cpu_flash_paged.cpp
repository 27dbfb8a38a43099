// cpu_flash over a paged kv cache (PagedAttentionCall): the pools, the block
// table and the lengths as the kernel's KvPages, read in place. Only the
// query (a few rows per sequence) is copied, when its dims do not merge.
#include <algorithm>
#include <stdexcept>

#include "adapters/cpu_flash_path.h"
#include "cpu/flash_attention.h"
#include "dimattn/internal/check.h"

namespace dimattn::detail {
namespace {

constexpr const char* kOp = "kv_cache_attention";

// A raw tensor's view over `groups` (each a run of its dims, in order) as one
// size and stride per group; nullopt when a group's dims do not merge.
struct Merged {
  std::vector<int64_t> sizes, strides;
  void* data = nullptr;
  RawPtr copy;  // the dense copy data points into, when one was made: kept alive with it
};
std::optional<Merged> merge(Backend& be, const Tensor& x, const std::vector<Dims>& groups) {
  Dims order;
  for (const Dims& g : groups) order.insert(order.end(), g.begin(), g.end());
  const HostView h = host_memory(be)(raw_in_order(kOp, x, order, true));
  Merged m{{}, {}, h.data};
  size_t axis = 0;
  for (const Dims& g : groups) {
    int64_t size = 1, stride = 0;
    for (size_t i = 0; i < g.size(); ++i, ++axis) {
      const int64_t n = h.sizes[axis], st = h.strides[axis];
      if (n == 1) continue;
      if (size > 1 && stride != st * n) return std::nullopt;
      stride = st, size *= n;
    }
    m.sizes.push_back(size);
    m.strides.push_back(stride);
  }
  return m;
}

// x over `groups`, merged, its last dim dense. A pool must be a view (a
// paged cache is read in place); the query is copied when it is not one.
Merged merged(Backend& be, const Tensor& x, const std::vector<Dims>& groups, const char* what, bool may_copy) {
  std::optional<Merged> m = merge(be, x, groups);
  if (m && m->strides.back() <= 1) return *m;
  Dims order;
  for (const Dims& g : groups) order.insert(order.end(), g.begin(), g.end());
  DIMATTN_CHECK(may_copy, kOp, what, " ", repr(x.dims()), " is read in place, so its dims ", repr(order),
                " must be a strided view with a dense last dim; make it contiguous once when you allocate it");
  const RawPtr copy = be.contiguous(raw_in_order(kOp, x, order, true));
  m = merge(be, Tensor(order, x.dtype(), x.device(), copy, &be), groups);
  DIMATTN_CHECK(m.has_value(), kOp, "internal error: ", what, " does not merge after a copy");
  m->copy = copy;
  return *m;
}

}  // namespace

Tensor cpu_flash_paged(Backend& be, const PagedAttentionCall& c, const kernels::ParallelFor& pf) {
  const Dims kv_heads_groups = join({c.kv_heads, c.groups});  // query head h = kv head * G + group
  const Merged q = merged(be, c.query, {c.batch, kv_heads_groups, {c.query_spatial}, {c.key_dim}}, "the query", true);
  const Merged k = merged(be, c.keys, {{c.block}, {c.slot}, c.kv_heads, {c.key_dim}}, "the key pool", false);
  const Merged v = merged(be, c.values, {{c.block}, {c.slot}, c.kv_heads, {c.value_feature}}, "the value pool", false);
  const int64_t B = q.sizes[0], Hkv = k.sizes[2], Tq = q.sizes[2];

  // The block table as int32 [B, table], the lengths and query lengths as int64.
  Dims table_order = c.batch;
  table_order.push_back(c.table);
  std::vector<int32_t> table;
  for (int64_t x : host_ints(c.block_table, table_order)) table.push_back(static_cast<int32_t>(x));
  const std::vector<int64_t> lengths = host_ints(c.lengths, c.batch);
  std::vector<int64_t> qlens, offsets(static_cast<size_t>(B));
  if (c.query_lengths) qlens = host_ints(*c.query_lengths, c.batch);
  for (int64_t b = 0; b < B; ++b) offsets[b] = lengths[b] - (qlens.empty() ? Tq : qlens[b]);

  Dims out_dims = c.batch;
  out_dims.insert(out_dims.end(), kv_heads_groups.begin(), kv_heads_groups.end());
  out_dims.push_back(c.query_spatial);
  out_dims.push_back(c.value_feature);
  Shape shape;
  for (const Dim& d : out_dims) shape.push_back(d.extent());
  const RawPtr out = be.full(shape, 0.0, c.query.dtype(), kCPU);
  // An empty result, or no sequence with a position (pools perhaps without a
  // block): nothing to read, zeros.
  const int64_t longest = product(out_dims) == 0 ? 0 : *std::max_element(lengths.begin(), lengths.end());
  if (longest == 0) return Tensor(out_dims, c.query.dtype(), c.query.device(), out, &be);
  const int64_t G = q.sizes[1] / Hkv;
  const HostView o = host_memory(be)(out);
  const int64_t Dv = c.value_feature.extent();

  kernels::AttentionKernelParams p;
  p.dtype = kernel_element_type(c.query.dtype());
  p.q = q.data, p.k = k.data, p.v = v.data, p.out = o.data;
  p.batch = B, p.heads = Hkv * G, p.kv_heads = Hkv;
  p.seqlen_q = Tq;
  p.seqlen_k = longest;
  p.head_dim = c.key_dim.extent(), p.head_dim_v = Dv;
  p.q_strides = {q.strides[0], q.strides[1], q.strides[2], 1};
  p.k_strides = {0, k.strides[2], k.strides[1], 1};
  p.v_strides = {0, v.strides[2], v.strides[1], 1};
  p.out_strides = {Hkv * G * Tq * Dv, Tq * Dv, Dv, 1};
  p.pages = {table.data(), c.table.extent(), c.slot.extent(), c.block.extent(), k.strides[0], v.strides[0]};
  // One block per sequence, block e for sequence e (a contiguous cache): plain
  // strides, no table.
  bool identity = c.table.extent() == 1;
  for (int64_t b = 0; identity && b < B; ++b) identity = table[b] == b;
  if (identity) {
    p.k_strides.batch = k.strides[0], p.v_strides.batch = v.strides[0];
    p.pages = {};
  }
  p.kv_lengths = lengths.data();
  p.q_lengths = qlens.empty() ? nullptr : qlens.data();
  p.causal = c.causal;
  p.causal_offset = offsets.data();
  p.scale = c.scale;
  p.bounds = row_bounds_of(c.window);
  if (c.softcap) p.score.softcap = *c.softcap;
  // ALiBi slopes and sinks as [B][H] values (h = kv head * G + group).
  const Dims bh = join({c.batch, kv_heads_groups});
  std::vector<double> slopes, sinks;
  if (c.alibi_slopes) {
    slopes = host_values(*c.alibi_slopes, bh);
    p.score.alibi = {slopes.data(), Hkv * G, 1};
  }
  if (c.sinks) {
    sinks = host_values(*c.sinks, bh);
    p.score.sinks = {sinks.data(), Hkv * G, 1};
  }
  try {
    kernels::flash_attention_forward_cpu(p, pf);
  } catch (const std::invalid_argument& e) {
    fail(kOp, "cpu_flash: ", e.what());
  }
  return Tensor(out_dims, c.query.dtype(), c.query.device(), out, &be);
}

}  // namespace dimattn::detail
