// dimattn's kv cache attention as a torch op (python/dimattn/_kv_cache.py),
// in FlashAttention's terms (flash_attn_with_kvcache):
//
//   dimattn::kv_cache_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor cache_seqlens,
//       Tensor? block_table, Tensor? seqlens_q, bool causal, float scale, int window_left,
//       float softcap, Tensor? alibi_slopes, Tensor? sinks, bool heads_outer, str force)
//       -> (Tensor out, str kernel)
//
// q [B, Tq, H, D] (H a multiple of the cache's kv heads), seqlens_q [B] each
// sequence's new positions (absent: Tq each). Without block_table the cache
// is [B, S, Hkv, D]: one block of S positions per sequence, read in place
// the same way. With it, the pools are [blocks, block_size, Hkv, D] or
// (heads_outer) [blocks, Hkv, block_size, D]; alibi_slopes and sinks [H] or
// [B, H] (float64). Returns [B, Tq, H, Dv] and the kernel that ran (the
// in-place one, or the kernel dot_attention chose for the gathered pages). The
// names become Dims here and the frontend's kv_cache_attention runs on the
// torch backend over the same memory. The op is composite (autograd reaches
// the gathered path's ops when q needs a gradient); torch.compile traces an
// opaque Python op around it instead (python/dimattn/_kv_cache.py).
#include <torch/library.h>

#include <ATen/ops/arange.h>

#include "dimattn/forcing.h"
#include "dimattn/kv_cache.h"
#include "dimattn/torch_interop.h"
#include "dimattn/trace.h"

namespace dimattn::python {
namespace {

std::tuple<at::Tensor, std::string> kv_cache_attention_op(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                 const at::Tensor& cache_seqlens, const std::optional<at::Tensor>& block_table,
                                 const std::optional<at::Tensor>& seqlens_q, bool causal, double scale,
                                 int64_t window_left, double softcap, const std::optional<at::Tensor>& alibi_slopes,
                                 const std::optional<at::Tensor>& sinks, bool heads_outer, const std::string& force) {
  constexpr const char* op = "[kv_cache_attention] ";
  TORCH_CHECK(q.dim() == 4, op, "q must be [batch, new positions, heads, head_dim], got ", q.sizes());
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 4, op, "k_cache and v_cache must be 4-d, got ", k_cache.sizes(),
              " and ", v_cache.sizes());
  const int64_t B = q.size(0), Tq = q.size(1), H = q.size(2), D = q.size(3);
  const int64_t hax = heads_outer ? 1 : 2, sax = heads_outer ? 2 : 1;
  const int64_t Hkv = k_cache.size(hax);
  for (const at::Tensor* t : {&k_cache, &v_cache})
    TORCH_CHECK(t->device() == q.device() && (q.is_cpu() || q.is_cuda()), op, "q, k_cache and v_cache must be on one ",
                "device, cpu or cuda; got ", q.device(), ", ", k_cache.device(), ", ", v_cache.device());
  TORCH_CHECK(Hkv > 0, op, "the cache has no kv heads: k_cache ", k_cache.sizes(), " (kv_layout ",
              heads_outer ? "HND" : "NHD", "); give it at least one, or check kv_layout");
  TORCH_CHECK(H % Hkv == 0, op, "q's ", H, " heads must be a multiple of the cache's ", Hkv, " kv heads");
  TORCH_CHECK(v_cache.size(0) == k_cache.size(0) && v_cache.size(hax) == Hkv && v_cache.size(sax) == k_cache.size(sax),
              op, "v_cache ", v_cache.sizes(), " must match k_cache ", k_cache.sizes(), " but for its last dim");
  TORCH_CHECK(k_cache.size(3) == D, op, "q's head_dim ", D, " must equal the cache's, got q ", q.sizes(), " and k_cache ",
              k_cache.sizes());
  TORCH_CHECK(cache_seqlens.dim() == 1 && cache_seqlens.size(0) == B && at::isIntegralType(cache_seqlens.scalar_type(), false),
              op, "cache_seqlens must be [batch] = [", B, "] integers, got ", cache_seqlens.sizes(), " ",
              cache_seqlens.scalar_type());
  if (B > 0) {
    const int64_t least = cache_seqlens.min().item<int64_t>();
    TORCH_CHECK(least >= 0, op, "cache_seqlens holds ", least, ": a sequence holds 0 or more positions");
  }
  if (block_table) {
    TORCH_CHECK(block_table->dim() == 2 && block_table->size(0) == B, op, "block_table must be [batch, max_blocks] with ",
                "batch = ", B, ", got ", block_table->sizes());
  } else {
    // FlashAttention's convention: a cache of more rows than the batch (allocated for the largest batch) serves
    // sequences 0..B-1 from its first rows.
    TORCH_CHECK(k_cache.size(0) >= B, op, "a contiguous cache holds one sequence per row of its first dim, so k_cache ",
                k_cache.sizes(), " needs at least q's batch of ", B, " rows there");
  }
  const Dim batch("batch", B), kv_heads("kv_heads", Hkv), group("group", H / Hkv), feat("head_dim", D),
      vfeat("head_dim_v", v_cache.size(3)), block("block", k_cache.size(0)), slot("slot", k_cache.size(sax));
  const Tensor lengths = from_aten(cache_seqlens, {batch});
  std::optional<Dim> q_spatial;
  if (seqlens_q)
    q_spatial = Dim::dynamic("new", from_aten(*seqlens_q, {batch}), Tq);
  else
    q_spatial = Dim("new", Tq);
  const Tensor query = from_aten(q.view({B, Tq, Hkv, H / Hkv, D}), {batch, *q_spatial, kv_heads, group, feat});
  const Dims kdims = heads_outer ? Dims{block, kv_heads, slot, feat} : Dims{block, slot, kv_heads, feat};
  const Dims vdims = heads_outer ? Dims{block, kv_heads, slot, vfeat} : Dims{block, slot, kv_heads, vfeat};
  // Without a table: sequence b is block b (a table [B, 1] of 0..B-1).
  const at::Tensor table_t =
      block_table ? *block_table : at::arange(B, cache_seqlens.options().dtype(at::kInt)).view({B, 1});
  const Dim table("table", table_t.size(1));
  const PagedKvCache cache{.keys = from_aten(k_cache, kdims), .values = from_aten(v_cache, vdims), .block = block,
                           .slot = slot, .block_table = from_aten(table_t, {batch, table}), .table = table};
  KvCacheAttentionOptions o{.key_dim = feat, .lengths = lengths, .query_spatial = q_spatial, .causal = causal,
                            .scale = scale};
  if (window_left >= 0) o.variants.window = AttentionWindow{.left = window_left};
  if (softcap > 0) o.variants.softcap = softcap;
  // [H] or [B, H] per-head values over {(batch,) kv_heads, group}.
  auto per_head = [&](const at::Tensor& t, const char* name) {
    TORCH_CHECK((t.dim() == 1 && t.size(0) == H) || (t.dim() == 2 && t.size(0) == B && t.size(1) == H), op, name,
                " must be [heads] or [batch, heads] = [", H, "] or [", B, ", ", H, "], got ", t.sizes());
    const at::Tensor d = t.to(at::kDouble);
    return t.dim() == 1 ? from_aten(d.view({Hkv, H / Hkv}), {kv_heads, group})
                        : from_aten(d.view({B, Hkv, H / Hkv}), {batch, kv_heads, group});
  };
  if (alibi_slopes) o.variants.alibi_slopes = per_head(*alibi_slopes, "alibi_slopes");
  if (sinks) o.variants.sinks = per_head(*sinks, "sinks");
  const ForceKernels forced(force);
  const TraceScope trace(false);
  const Tensor out = kv_cache_attention(query, cache, o);
  // {batch, new, kv_heads, group, head_dim_v} -> [B, Tq, H, Dv]
  const at::Tensor& raw = to_aten(out);
  std::vector<int64_t> perm;
  for (const Dim& d : {batch, *q_spatial, kv_heads, group, vfeat})
    for (size_t i = 0; i < out.dims().size(); ++i)
      if (out.dims()[i] == d) perm.push_back(static_cast<int64_t>(i));
  return {raw.permute(perm).reshape({B, Tq, H, v_cache.size(3)}),
          trace.records().empty() ? std::string() : trace.records().back().kernel};
}

}  // namespace
}  // namespace dimattn::python

TORCH_LIBRARY_FRAGMENT(dimattn, m) {
  m.def(
      "kv_cache_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor cache_seqlens, Tensor? block_table, "
      "Tensor? seqlens_q, bool causal, float scale, int window_left, float softcap, Tensor? alibi_slopes, "
      "Tensor? sinks, bool heads_outer, str force) -> (Tensor, str)");
}
TORCH_LIBRARY_IMPL(dimattn, CompositeImplicitAutograd, m) {
  m.impl("kv_cache_attention", &dimattn::python::kv_cache_attention_op);
}
