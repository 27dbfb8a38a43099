// kv_cache_attention, kv_cache_gather, kv_cache_append (dimattn/kv_cache.h):
// names -> a PagedAttentionCall for a kernel that reads the pools in place
// (KernelEntry::paged), else the pages gathered and dot_attention.
#include "dimattn/kv_cache.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "dimattn/attention.h"
#include "dimattn/ext/backend.h"
#include "dimattn/ext/kernel_table.h"
#include "dimattn/forcing.h"
#include "dimattn/internal/check.h"
#include "dimattn/ops.h"
#include "dimattn/trace.h"
#include "op_util.h"

namespace dimattn {
namespace {

constexpr const char* kOp = "kv_cache_attention";

// The roles of a call, checked: batch dims (the table's), kv heads (the
// pools'), groups (the query's own), the one value feature dim.
struct Roles {
  Dims batch, kv_heads, groups;
  Dim value_feature{"", 0};
};

void check_integer(const char* op, const Tensor& t, const char* name) {
  DIMATTN_CHECK(!is_floating(t.dtype()) && t.dtype() != DType::boolean, op, name, " must be an integer tensor, got ",
                dtype_name(t.dtype()));
}

// |a| x |b| positions, refused where it does not fit an int64.
int64_t positions(const char* op, const Dim& a, const Dim& b) {
  int64_t n = 0;
  DIMATTN_CHECK(!__builtin_mul_overflow(a.extent(), b.extent(), &n), op, a.repr(), " x ", b.repr(),
                " positions do not fit a 64-bit count");
  return n;
}

void check_pool_dims(const char* op, const PagedKvCache& c) {
  for (const Tensor* pool : {&c.keys, &c.values})
    DIMATTN_CHECK(pool->has(c.block) && pool->has(c.slot), op, "the pools need the block dim ", c.block.repr(),
                  " and the slot dim ", c.slot.repr(), "; got keys ", repr(c.keys.dims()), ", values ",
                  repr(c.values.dims()));
}

Roles roles_of(const Tensor& q, const PagedKvCache& c, const KvCacheAttentionOptions& o, const Dim& q_spatial) {
  const Dim &block = c.block, &slot = c.slot;
  check_integer(kOp, c.block_table, "block_table");
  DIMATTN_CHECK(c.block_table.has(c.table), kOp, "block_table ", repr(c.block_table.dims()), " lacks its table dim ",
                c.table.repr());
  check_pool_dims(kOp, c);
  DIMATTN_CHECK(slot.extent() > 0, kOp, "the slot dim ", slot.repr(), " (the block size) holds no position; ",
                "a block must hold at least one");
  check_integer(kOp, o.lengths, "lengths");
  DIMATTN_CHECK(c.keys.has(o.key_dim) && q.has(o.key_dim), kOp, "query ", repr(q.dims()), " and keys ",
                repr(c.keys.dims()), " must both have key_dim ", o.key_dim.repr());
  DIMATTN_CHECK(o.key_dim.extent() > 0, kOp, "key_dim ", o.key_dim.repr(), " is empty: scores need at least one "
                "feature");
  DIMATTN_CHECK(c.keys.dtype() == q.dtype() && c.values.dtype() == q.dtype(), kOp, "query, keys and values must ",
                "share one dtype; got ", dtype_name(q.dtype()), ", ", dtype_name(c.keys.dtype()), ", ",
                dtype_name(c.values.dtype()), " (cast the query to the cache's dtype)");
  DIMATTN_CHECK(is_floating(q.dtype()), kOp, "needs floating query, keys and values; got ", dtype_name(q.dtype()),
                " (cast them to float32, bfloat16, float16 or float64)");
  Roles r;
  r.batch = detail::without(c.block_table.dims(), {c.table});
  r.kv_heads = detail::without(c.keys.dims(), {block, slot, o.key_dim});
  const Dims value_feature = detail::without(c.values.dims(), detail::union_dims({block, slot}, r.kv_heads));
  DIMATTN_CHECK(value_feature.size() == 1, kOp, "values ", repr(c.values.dims()), " must have the keys' kv head dims ",
                repr(r.kv_heads), " and exactly one value feature dim besides the block and slot dims");
  r.value_feature = value_feature[0];
  for (const Dim& d : detail::union_dims(r.batch, r.kv_heads))
    DIMATTN_CHECK(q.has(d), kOp, "query ", repr(q.dims()), " lacks ", d.repr(), " (a batch dim of block_table ",
                  repr(c.block_table.dims()), " or a kv head dim of the pools)");
  DIMATTN_CHECK(!q.has(block) && !q.has(slot) && !q.has(c.table), kOp, "query ", repr(q.dims()),
                " must not have the cache's block, slot or table dims");
  r.groups = detail::without(q.dims(), detail::union_dims(detail::union_dims(r.batch, r.kv_heads), {q_spatial, o.key_dim}));
  for (const Dim& d : o.lengths.dims())
    DIMATTN_CHECK(contains(r.batch, d), kOp, "lengths ", repr(o.lengths.dims()), " may vary over the batch dims ",
                  repr(r.batch), " only");
  return r;
}

// Every used table entry in the pool, every length within the table.
void check_table(const PagedKvCache& c, const Dims& batch, const Tensor& lengths, const std::vector<int64_t>& qlens) {
  Dims order = batch;
  order.push_back(c.table);
  const std::vector<int64_t> table = host_ints(c.block_table, order);
  const int64_t cap = c.table.extent(), bs = c.slot.extent(), blocks = c.block.extent(),
                capacity = positions(kOp, c.table, c.slot);
  // Each length in range (over the lengths' own dims: also those that no
  // sequence uses, where the batch is empty).
  const std::vector<int64_t> own = host_ints(lengths, lengths.dims());
  for (size_t i = 0; i < own.size(); ++i) {
    DIMATTN_CHECK(own[i] >= 0, kOp, "lengths[", i, "] = ", own[i], " is negative; a sequence holds 0 or more positions");
    DIMATTN_CHECK(own[i] <= capacity, kOp, "lengths[", i, "] = ", own[i], " is past the block table's ",
                  "capacity of ", cap, " blocks of ", bs, " positions (", c.table.repr(), " x ", c.slot.repr(),
                  "); give the table more columns");
  }
  const std::vector<int64_t> lens = lengths.dims() == batch ? own : host_ints(lengths, batch);
  for (size_t e = 0; e < lens.size(); ++e) {
    if (!qlens.empty())
      DIMATTN_CHECK(qlens[e] <= lens[e], kOp, "sequence ", e, " has ", qlens[e], " new query positions but only ",
                    lens[e], " cached positions; lengths must include the new positions (append them first)");
    for (int64_t t = 0; t < (lens[e] + bs - 1) / bs; ++t) {
      const int64_t blk = table[e * cap + t];
      DIMATTN_CHECK(blk >= 0 && blk < blocks, kOp, "block_table[", e, "][", t, "] = ", blk, " is outside the pool's ",
                    blocks, " blocks (", c.block.repr(), "); sequence ", e, " has ", lens[e], " positions");
    }
  }
}

// The kernel of the query's device that reads pages in place and that
// forcing allows; nullptr when none.
const KernelEntry* paged_kernel(const Tensor& q) {
  const KernelForce force = current_kernel_force();
  for (const KernelEntry& e : q.backend().attention_table())
    if (e.device == q.device().type && e.paged && force.allows(e.name)) return &e;
  return nullptr;
}

}  // namespace

std::pair<Tensor, Tensor> kv_cache_gather(const PagedKvCache& c, const Tensor& lengths, Dim* axis) {
  const int64_t bs = c.slot.extent();
  const Dim kv = Dim::dynamic("kv_cache", cast(lengths, DType::int64), positions("kv_cache_gather", c.table, c.slot));
  // Entries past a sequence's blocks may hold anything: read block 0 there
  // (masked by the lengths).
  const Tensor used = compare(range_over_dim(c.table, detail::options_like(lengths, DType::int64)) * static_cast<double>(bs), Compare::lt,
                              cast(lengths, DType::int64));
  const Tensor idx = where(used, cast(c.block_table, DType::int64), 0.0);
  auto pages = [&](const Tensor& pool) {
    return merge_dims(gather(pool, c.block, idx), {c.table, c.slot}, kv).first;
  };
  if (axis) *axis = kv;
  if (c.block.extent() == 0) {
    // No block to read (every length must be 0): zero pages, nothing gathered.
    auto empty = [&](const Tensor& pool) {
      Dims dims = detail::without(c.block_table.dims(), {c.table});
      dims.push_back(kv);
      for (const Dim& d : detail::without(pool.dims(), {c.block, c.slot})) dims.push_back(d);
      return zeros(dims, detail::options_like(pool));
    };
    return {empty(c.keys), empty(c.values)};
  }
  return {pages(c.keys), pages(c.values)};
}

Tensor kv_cache_attention(const Tensor& query, const PagedKvCache& cache, const KvCacheAttentionOptions& o) {
  const bool step = !o.query_spatial.has_value();
  DIMATTN_CHECK(step || query.has(*o.query_spatial), kOp, "query ", repr(query.dims()), " lacks query_spatial ",
                o.query_spatial->repr(), "; leave query_spatial unset for a query of one step");
  const Dim q_spatial = step ? Dim("query_step", 1) : *o.query_spatial;
  const Tensor q = step ? expand_dim(query, q_spatial) : query;
  const Roles r = roles_of(q, cache, o, q_spatial);
  std::vector<int64_t> qlens;
  if (q_spatial.is_dynamic()) qlens = host_ints(q_spatial.lengths(), r.batch);
  check_table(cache, r.batch, o.lengths, qlens);
  const double scale = o.scale.value_or(1.0 / std::sqrt(static_cast<double>(o.key_dim.extent())));
  DIMATTN_CHECK(std::isfinite(scale), kOp, "scale must be finite, got ", scale, "; leave it unset for 1/sqrt(",
                o.key_dim.repr(), ")");
  o.variants.check_values(kOp, o.causal);
  auto restore = [&](const Tensor& out) {
    const Tensor t = q_spatial.is_dynamic() ? where(sequence_mask(q_spatial, detail::options_like(out, DType::boolean)), out, 0.0) : out;
    return step ? squeeze(t, q_spatial) : t;
  };

  // The variants the kernel takes here: window, softcap, ALiBi and sinks
  // (per head: over the batch, kv-head and group dims; no gradient).
  AttentionVariants rest = o.variants;
  std::optional<Tensor> sinks = o.variants.sinks;
  if (o.variants.sink_off_by_one) sinks = full({}, 0.0, detail::options_like(q, DType::float64));
  const Dims heads = detail::union_dims(detail::union_dims(r.batch, r.kv_heads), r.groups);
  for (const auto& [t, name] : {std::pair{&o.variants.alibi_slopes, "alibi_slopes"}, {&o.variants.sinks, "sinks"}}) {
    if (!*t) continue;
    DIMATTN_CHECK(is_floating((*t)->dtype()), kOp, name, " must be a floating tensor, got ", dtype_name((*t)->dtype()));
    for (const Dim& d : (*t)->dims())
      DIMATTN_CHECK(contains(heads, d), kOp, name, " ", repr((*t)->dims()), " has ", d.repr(), ", which is not a ",
                    "batch, kv head or group dim ", repr(heads), "; they vary over those only");
  }
  auto no_grad = [](const std::optional<Tensor>& t) { return !t || !t->requires_grad(); };
  const bool takes_variants = no_grad(rest.alibi_slopes) && no_grad(sinks);
  rest.window.reset(), rest.softcap.reset(), rest.alibi_slopes.reset(), rest.sinks.reset();
  rest.sink_off_by_one = false;
  const KernelEntry* kernel = paged_kernel(q);
  if (kernel && takes_variants && !rest.any() && !q.requires_grad() && !TraceScope::capturing()) {
    const Tensor lengths = cast(o.lengths, DType::int64);
    std::optional<Tensor> qlen_t;
    if (q_spatial.is_dynamic()) qlen_t = cast(q_spatial.lengths(), DType::int64);
    const PagedAttentionCall call{.query = q, .keys = cache.keys, .values = cache.values,
                                  .block_table = cache.block_table, .lengths = lengths, .query_lengths = qlen_t,
                                  .batch = r.batch, .kv_heads = r.kv_heads, .groups = r.groups,
                                  .query_spatial = q_spatial, .key_dim = o.key_dim, .value_feature = r.value_feature,
                                  .block = cache.block, .slot = cache.slot, .table = cache.table, .scale = scale,
                                  .causal = o.causal, .window = o.variants.window, .softcap = o.variants.softcap,
                                  .alibi_slopes = o.variants.alibi_slopes, .sinks = sinks};
    const Tensor out = restore(kernel->paged(q.backend(), call));
    if (TraceScope::active())
      TraceScope::record({kernel->name, out, std::nullopt, std::nullopt, q.shape(), cache.keys.shape(),
                          cache.values.shape()});
    return out;
  }
  // The reference form: the pages gathered, then dot_attention.
  Dim axis("kv_cache", 0);
  const auto [k, v] = kv_cache_gather(cache, o.lengths, &axis);
  AttentionOptions a{.key_dim = o.key_dim, .axis = axis, .scale = scale, .variants = o.variants};
  const Tensor qlen = q_spatial.is_dynamic() ? cast(q_spatial.lengths(), DType::int64)
                                             : full({}, static_cast<double>(q_spatial.extent()),
                                                    detail::options_like(q, DType::int64));
  const Tensor offset = cast(o.lengths, DType::int64) - qlen;
  if (o.causal || o.variants.positional()) {
    a.causal_offset = offset;
    if (o.causal)
      a.causal_query_spatial_dim = q_spatial;
    else
      a.query_position_dim = q_spatial;
  }
  return restore(dot_attention(q, k, v, a));
}

void kv_cache_append(const PagedKvCache& c, const Tensor& keys, const Tensor& values, const Tensor& slots) {
  constexpr const char* op = "kv_cache_append";
  const Dims tokens = slots.dims();
  Backend& be = c.keys.backend();
  check_pool_dims(op, c);
  for (const Tensor* pool : {&c.keys, &c.values})
    DIMATTN_CHECK(!pool->requires_grad(), op, "the pools are written in place and must not require a gradient");
  check_integer(op, slots, "slots");
  const std::vector<int64_t> slot_of = host_ints(slots, tokens);
  const int64_t capacity = positions(op, c.block, c.slot);
  for (size_t t = 0; t < slot_of.size(); ++t)
    DIMATTN_CHECK(slot_of[t] < capacity, op, "slots[", t, "] = ", slot_of[t], " is past the pools' ", capacity,
                  " slots (", c.block.repr(), " x ", c.slot.repr(), ")");
  std::vector<int64_t> used;
  for (int64_t s : slot_of)
    if (s >= 0) used.push_back(s);
  std::sort(used.begin(), used.end());
  const auto twice = std::adjacent_find(used.begin(), used.end());
  DIMATTN_CHECK(twice == used.end(), op, "slots give slot ", twice == used.end() ? 0 : *twice, " to more than one ",
                "token: which one would stay is undefined; give each token its own slot");
  // Both operands are checked and laid out before either pool is written, so
  // that a bad one leaves both pools as they were.
  struct Write {
    HostView pool, rows;  // the pool over {block, slot, rest...}; the tokens' rows over {tokens..., rest...}
    RawPtr rows_copy;     // what `rows` points into
    int64_t esize, row;   // bytes per element, elements per token's row
  };
  auto plan = [&](const Tensor& pool, const Tensor& x, const char* what) {
    const Dims rest = detail::without(pool.dims(), {c.block, c.slot});  // kv heads and the feature dim
    for (const Dim& d : x.dims())
      DIMATTN_CHECK(contains(tokens, d) || contains(rest, d), op, what, " ", repr(x.dims()), " has ", d.repr(),
                    ", which neither slots ", repr(tokens), " nor the pool ", repr(pool.dims()), " has");
    DIMATTN_CHECK(x.dtype() == pool.dtype(), op, what, " must have the pool's dtype ", dtype_name(pool.dtype()),
                  ", got ", dtype_name(x.dtype()));
    Dims pool_order{c.block, c.slot};
    pool_order.insert(pool_order.end(), rest.begin(), rest.end());
    const std::optional<HostView> p = be.host_view(raw_in_order(op, pool, pool_order, false));
    DIMATTN_CHECK(p.has_value(), op, "the pools must expose host memory (CPU tensors); on other devices write ",
                  "them with the framework's indexing (dimattn.kv_cache_append does for torch)");
    Dims x_order = tokens;
    x_order.insert(x_order.end(), rest.begin(), rest.end());
    const RawPtr xd = be.contiguous(raw_in_order(op, x, x_order, true));
    const std::optional<HostView> xv = be.host_view(xd);
    DIMATTN_CHECK(xv.has_value(), op, what, " must be a CPU tensor like the pools");
    return Write{*p, *xv, xd, dtype_size(pool.dtype()), product(rest)};
  };
  const Write writes[] = {plan(c.keys, keys, "keys"), plan(c.values, values, "values")};
  for (const Write& w : writes) {
    // Each token's row of the pool (every kv head and feature) at its slot.
    const HostView& p = w.pool;
    Shape sizes(p.sizes.begin() + 2, p.sizes.end());
    std::vector<int64_t> strides(p.strides.begin() + 2, p.strides.end());
    auto* dst = static_cast<char*>(p.data);
    const auto* src = static_cast<const char*>(w.rows.data);
    // Copied a run at a time: the pool's innermost dim when it is dense (the feature dim), else an element.
    const int64_t run = !sizes.empty() && strides.back() == 1 ? sizes.back() : 1;
    for (size_t t = 0; t < slot_of.size(); ++t) {
      if (slot_of[t] < 0) continue;
      char* base = dst + (slot_of[t] / c.slot.extent() * p.strides[0] + slot_of[t] % c.slot.extent() * p.strides[1]) * w.esize;
      for (int64_t i = 0; i < w.row; i += run) {
        int64_t off = 0, rem = i;
        for (size_t a = sizes.size(); a-- > 0;) {
          off += rem % sizes[a] * strides[a];
          rem /= sizes[a];
        }
        std::memcpy(base + off * w.esize, src + (static_cast<int64_t>(t) * w.row + i) * w.esize,
                    static_cast<size_t>(run * w.esize));
      }
    }
  }
}

}  // namespace dimattn
