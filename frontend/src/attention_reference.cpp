#include "attention_reference.h"

#include <atomic>
#include <cstdlib>
#include <limits>

#include "dimattn/attention.h"
#include "dimattn/ext/backend.h"
#include "dimattn/forcing.h"
#include "dimattn/selection.h"
#include "dimattn/ops.h"
#include "dimattn/internal/check.h"
#include "op_util.h"
#include "common/attention_mask.h"

namespace dimattn {

Tensor attention_dropout_keep_mask(const AttentionCall& c, const Tensor& like) {
  // The one keep rule and keying of the fused kernels (common/attention_mask.h).
  const kernels::DropoutRule rule = kernels::dropout_rule(c.dropout);
  const auto offset = static_cast<uint32_t>(c.dropout_offset);
  const int64_t nk = c.kv_spatial.extent();
  if (c.dropout_broadcast) {
    std::vector<double> keep(nk);
    for (int64_t k = 0; k < nk; ++k) {
      const auto kp = static_cast<uint32_t>(k + c.dropout_kv_position);
      keep[k] = rule.keeps(kernels::dropout_words_broadcast(c.dropout_seed, offset, kp).v[kp & 3]);
    }
    return from_host({c.kv_spatial}, keep, detail::options_like(like, DType::boolean));
  }
  Dims flat = c.batch;
  flat.insert(flat.end(), c.keys_only.begin(), c.keys_only.end());
  flat.insert(flat.end(), c.query_groups.begin(), c.query_groups.end());
  const int64_t nbh = product(flat);
  const int64_t nq = c.query_spatial.extent();
  std::vector<double> keep(static_cast<size_t>(nbh * nq * nk));
  size_t i = 0;
  for (int64_t bh = 0; bh < nbh; ++bh)
    for (int64_t q = 0; q < nq; ++q)
      for (int64_t k = 0; k < nk; ++k) {
        const auto qp = static_cast<uint32_t>(q + c.dropout_q_position);
        const auto kp = static_cast<uint32_t>(k + c.dropout_kv_position);
        keep[i++] = rule.keeps(
            kernels::dropout_words(c.dropout_seed, offset, static_cast<uint32_t>(bh), qp, kp).v[kp & 3]);
      }
  Dims dims = flat;
  dims.push_back(c.query_spatial);
  dims.push_back(c.kv_spatial);
  return from_host(dims, keep, detail::options_like(like, DType::boolean));
}

namespace {
std::atomic<int64_t>& limit_bytes() {
  static std::atomic<int64_t> limit = [] {
    const char* env = std::getenv("DIMATTN_REFERENCE_MAX_BYTES");
    return env && *env ? std::atoll(env) : int64_t{4} << 30;
  }();
  return limit;
}
}  // namespace

void set_reference_memory_limit(int64_t bytes) { limit_bytes() = bytes; }
int64_t reference_memory_limit() { return limit_bytes(); }

namespace detail {

namespace {

// The relative-position term of the energies (variants.h): scale * (q + v) .
// pos_emb[center + j - step i] over [.., query, kv], from the [.., query, R]
// products skewed as RETURNN's generic path does (a zero column in front,
// rows merged and re-split one shorter; docs/api.md), never a [query, kv, R]
// tensor. q in the computation dtype dt.
Tensor rel_pos_energy(const AttentionCall& c, const Tensor& q, DType dt) {
  const AttentionVariants& var = c.variants;
  const RelPosForm& f = *c.rel_pos;
  const Tensor qv = var.pos_bias_v ? add(q, cast(*var.pos_bias_v, dt)) : q;
  const Tensor e = matmul(mul(qv, c.scale), cast(*var.pos_emb, dt), {c.key_dim});  // [.., query, R]
  if (f.step == 0) return e;  // R is the kv axis: row j for every query row
  const Dim& rows = c.query_spatial;
  const Dim pad("rel_pos_pad", 1), fresh_rows("rel_pos_rows", rows.extent()), cols("rel_pos_cols", f.dim.extent());
  Dims pad_dims = without(e.dims(), {f.dim});
  pad_dims.push_back(pad);
  const auto [padded, wide] = concat({{zeros(pad_dims, options_like(e)), pad}, {e, f.dim}});  // [.., query, 1 + R]
  const auto [flat, all] = merge_dims(padded, {rows, wide});
  // Dropping the first `rows` elements and splitting into rows of R puts
  // row i's column center + j - i at column j.
  const auto [shifted, rest] = slice(flat, all, rows.extent(), all.extent());
  const Tensor skewed = split_dims(shifted, rest, {fresh_rows, cols});
  const Tensor kept = slice(skewed, cols, 0, c.kv_spatial.extent(), c.kv_spatial).first;
  return replace_dim(kept, fresh_rows, rows);
}

}  // namespace

ReferenceAttention reference_attention(const AttentionCall& c) {
  // 16-bit inputs are computed in float32: the reference is the accurate side.
  const DType in_dtype = c.query.dtype();
  const DType dt = (in_dtype == DType::bfloat16 || in_dtype == DType::float16) ? DType::float32 : in_dtype;
  Dims energy_dims = c.batch;
  for (const Dims* ds : {&c.keys_only, &c.query_groups}) energy_dims.insert(energy_dims.end(), ds->begin(), ds->end());
  energy_dims.insert(energy_dims.end(), {c.query_spatial, c.kv_spatial});
  double bytes = dtype_size(dt);
  for (const Dim& d : energy_dims) bytes *= static_cast<double>(d.extent());
  DIMATTN_CHECK(bytes <= static_cast<double>(reference_memory_limit()), "dot_attention", "the reference path would hold an ",
        "energy tensor ", repr(energy_dims), " of ", bytes / (1 << 20), " MiB, over the limit of ",
        reference_memory_limit() / (1 << 20), " MiB (set_reference_memory_limit, DIMATTN_REFERENCE_MAX_BYTES); ",
        "use a fused kernel (force 'auto'), shorter sequences or chunks");
  const Tensor q = cast(c.query, dt), k = cast(c.keys, dt);
  Tensor v = cast(c.values, dt);
  // Padding is not data: a masked weight is 0, but 0 * NaN is NaN, so
  // padded values (an uninitialised cache, say) are zeroed before the
  // product, as the fused kernels never read them (docs/errors.md). With
  // per-row lengths only the positions that no query row reaches (past
  // their maximum over the query's own dims), so that values never gain
  // the query's dims.
  if (c.kv_spatial.is_dynamic()) {
    Tensor reach = to_device(to_backend(cast(c.kv_spatial.lengths(), DType::int64), v.backend().name()), v.device());
    Dims query_own;
    for (const Dim& d : reach.dims())
      if (d == c.query_spatial || contains(c.query_groups, d)) query_own.push_back(d);
    if (!query_own.empty()) reach = reduce_max(reach, query_own);
    v = where(compare(range_over_dim(c.kv_spatial, options_like(v, DType::int64)), Compare::lt, reach), v, 0.0);
  }

  // The order of docs/numerics.md: scale (of the content and the relative
  // positions' terms), soft-capping, bias and ALiBi,
  // masks, softmax with the sink, dropout.
  const AttentionVariants& var = c.variants;
  Tensor energy = matmul(mul(var.pos_bias_u ? add(q, cast(*var.pos_bias_u, dt)) : q, c.scale), k, {c.key_dim});
  if (c.rel_pos) energy = add(energy, rel_pos_energy(c, q, dt));
  if (var.softcap) energy = mul(tanh(mul(energy, 1.0 / *var.softcap)), *var.softcap);
  if (var.bias) energy = add(energy, cast(*var.bias, dt));

  // Positions along the diagonal: d = i + offset - j (query row i, kv j).
  const TensorOptions int_opts = options_like(energy, DType::int64);
  std::optional<Tensor> diag;
  if (c.positional()) {
    Tensor row = range_over_dim(c.query_spatial, int_opts);
    if (c.causal_offset) row = add(row, cast(*c.causal_offset, DType::int64));
    diag = sub(row, range_over_dim(c.kv_spatial, int_opts));
  }
  if (var.alibi_slopes) energy = sub(energy, mul(cast(*var.alibi_slopes, dt), cast(abs(*diag), dt)));

  std::optional<Tensor> valid;
  auto require = [&](const Tensor& allowed) { valid = valid ? logical_and(*valid, allowed) : allowed; };
  if (c.kv_spatial.is_dynamic()) valid = sequence_mask(c.kv_spatial, options_like(energy));
  if (c.causal) require(compare(*diag, Compare::ge, 0.0));
  if (var.window && var.window->left) require(compare(*diag, Compare::le, static_cast<double>(*var.window->left)));
  if (var.window && var.window->right) require(compare(*diag, Compare::ge, -static_cast<double>(*var.window->right)));
  if (var.mask) require(*var.mask);
  if (var.query_segments)  // equal ids may attend: [.., t] == [.., kv], broadcast by name
    require(compare(cast(*var.query_segments, DType::int64), Compare::eq, cast(*var.kv_segments, DType::int64)));

  constexpr double kInf = std::numeric_limits<double>::infinity();
  Tensor weights = energy;
  if (!valid && !var.sinks && !var.bias) {
    weights = softmax(energy, c.kv_spatial);
  } else {
    // w = exp(e - m) / (sum exp(e - m) + exp(sink - m)), m = max(max e, sink):
    // the sink's logit joins the denominator. A row without any valid
    // position (or with a -inf bias everywhere) has weights 0, never NaN:
    // there m = -inf is taken as 0 and a zero denominator as 1.
    const Tensor e = valid ? where(*valid, energy, -kInf) : energy;
    std::optional<Tensor> sink;
    if (var.sinks) sink = cast(*var.sinks, dt);
    Tensor m = reduce_max(e, {c.kv_spatial});
    if (sink) m = maximum(m, *sink);
    m = where(compare(m, Compare::ne, -kInf), m, 0.0);
    const Tensor x = exp(sub(e, m));
    Tensor denom = reduce_sum(x, {c.kv_spatial});
    if (sink) denom = add(denom, exp(sub(*sink, m)));
    weights = div(x, where(compare(denom, Compare::ne, 0.0), denom, 1.0));
  }
  if (c.dropout > 0) {
    Tensor keep = attention_dropout_keep_mask(c, weights);
    weights = where(keep, mul(weights, kernels::dropout_rule(c.dropout).keep_scale), 0.0);
  }
  Tensor out = cast(matmul(weights, v, {c.kv_spatial}), in_dtype);
  return {out, energy, weights};
}

}  // namespace detail

}  // namespace dimattn
