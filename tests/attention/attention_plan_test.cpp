// The per-call plan (kernel_table.h: AttentionPlan) and its cache
// (backends/adapters/plan_cache.h): one plan per call, reused between
// decide and run; cached by structure, never by values, pointers or Dim
// identities; a change of strides, dims or options misses and still gives
// the reference's result.
#include "adapters/plan_cache.h"
#include "dimattn/attention.h"
#include "dimattn/forcing.h"
#include "dimattn/registry.h"
#include "dimattn/selection.h"
#include "support/test_util.h"

#ifdef DIMATTN_TEST_TORCH
#include <ATen/ops/randn.h>

#include "dimattn/torch_interop.h"
#endif

namespace dimattn {
namespace {
using detail::plan_cache_stats;
using testing::max_abs_diff;

struct Delta {
  uint64_t hits, misses;
};
template <class F>
Delta plan_delta(F&& f) {
  const detail::PlanCacheStats before = plan_cache_stats();
  f();
  const detail::PlanCacheStats after = plan_cache_stats();
  return {after.hits - before.hits, after.misses - before.misses};
}

Tensor reference(const Tensor& q, const Tensor& k, const Tensor& v, const AttentionOptions& o) {
  ForceKernels force("reference");
  return dot_attention(q, k, v, o);
}

// Every fused CPU kernel of the backend, and auto.
std::vector<std::string> fused_kernels(const std::string& backend) {
  std::vector<std::string> out = {"auto"};
  for (const std::string& k : get_backend(backend).attention_kernels(kCPU))
    if (k != kReferenceKernel) out.push_back(k);
  return out;
}

class AttentionPlanTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override { reset_selection_cache(); }
  Tensor randn(const Dims& dims, uint64_t seed) const { return random_normal(dims, seed, {.backend = GetParam()}); }
};

TEST_P(AttentionPlanTest, OnePlanPerCallAndTheSameStructureHits) {
  Dim batch("batch", 2), heads("heads", 3), time("time", 5), feat("feat", 8);
  for (const std::string& kernel : fused_kernels(GetParam())) {
    ForceKernels force(kernel);
    // Fresh tensors and, through self-attention, a fresh kv Dim every call:
    // the structure is what makes the key.
    const Tensor x1 = randn({batch, heads, time, feat}, 1), x2 = randn({batch, heads, time, feat}, 2);
    const AttentionOptions o{.key_dim = feat, .axis = time};
    const uint64_t lookups = selection_stats().lookups;
    Tensor out1 = dot_attention(x1, x1, x1, o);
    const Delta first = plan_delta([&] { out1 = dot_attention(x1, x1, x1, o); });
    Tensor out2 = out1;
    const Delta second = plan_delta([&] { out2 = dot_attention(x2, x2, x2, o); });
    EXPECT_EQ(first.hits + first.misses, 1u) << kernel << ": one plan per call, decide and run share it";
    EXPECT_EQ(second.hits, 1u) << kernel << ": new values, pointers and kv Dim, same structure";
    EXPECT_EQ(second.misses, 0u) << kernel;
    EXPECT_EQ(selection_stats().lookups - lookups, 3u) << kernel << ": a plan hit counts as a lookup";
    EXPECT_LE(max_abs_diff(out2, reference(x2, x2, x2, o), {batch, heads, time, feat}), 1e-5) << kernel;
  }
}

TEST_P(AttentionPlanTest, ADimChangeMissesAndStaysCorrect) {
  Dim batch("batch", 2), heads("heads", 2), feat("feat", 8);
  for (const std::string& kernel : fused_kernels(GetParam())) {
    ForceKernels force(kernel);
    for (int64_t T : {4, 7}) {
      Dim time("time", T);
      const Tensor q = randn({batch, heads, time, feat}, 3), kv = randn({batch, heads, time, feat}, 4);
      const AttentionOptions o{.key_dim = feat, .axis = time};
      dot_attention(q, kv, kv, o);  // this structure's plan, cached
      // The same sizes with the dims in another order: other strides per role.
      const Tensor qt = randn({heads, time, batch, feat}, 5);
      Tensor out = q;
      const Delta d = plan_delta([&] { out = dot_attention(qt, kv, kv, o); });
      EXPECT_EQ(d.misses, 1u) << kernel << " T=" << T << ": the query's dims in another order";
      EXPECT_LE(max_abs_diff(out, reference(qt, kv, kv, o), {batch, heads, time, feat}), 1e-5) << kernel;
      // A different extent of one dim (dims of the same names and roles).
      Dim longer("time", T + 1);
      const Tensor q2 = randn({batch, heads, longer, feat}, 6), kv2 = randn({batch, heads, longer, feat}, 7);
      const AttentionOptions o2{.key_dim = feat, .axis = longer};
      const Delta d2 = plan_delta([&] { out = dot_attention(q2, kv2, kv2, o2); });
      EXPECT_EQ(d2.misses, 1u) << kernel << ": T " << T << " -> " << T + 1;
      EXPECT_LE(max_abs_diff(out, reference(q2, kv2, kv2, o2), {batch, heads, longer, feat}), 1e-5) << kernel;
    }
  }
}

TEST_P(AttentionPlanTest, OptionsForcingAndResetMiss) {
  Dim batch("batch", 2), time("time", 6), feat("feat", 4);
  const Tensor x = randn({batch, time, feat}, 8);
  const AttentionOptions plain{.key_dim = feat, .axis = time};
  AttentionOptions causal = plain;
  causal.causal_query_spatial_dim = time;
  dot_attention(x, x, x, plain);
  EXPECT_EQ(plan_delta([&] { dot_attention(x, x, x, causal); }).misses, 1u) << "causal";
  EXPECT_EQ(plan_delta([&] { dot_attention(x, x, x, plain); }).hits, 1u);
  {
    ForceKernels force("reference");
    EXPECT_EQ(plan_delta([&] { dot_attention(x, x, x, plain); }).misses, 1u) << "forcing";
    EXPECT_EQ(explain_attention(x, x, x, plain).kernel, kReferenceKernel);
  }
  reset_selection_cache();
  EXPECT_EQ(plan_delta([&] { dot_attention(x, x, x, plain); }).misses, 1u) << "after reset_selection_cache";
  EXPECT_EQ(selection_stats().selections, 1u) << "the reset plan selected anew";
}

TEST_P(AttentionPlanTest, TheCacheIsBounded) {
  Dim batch("batch", 1), feat("feat", 4);
  for (int64_t T = 1; T <= static_cast<int64_t>(detail::kPlanCacheCapacity) + 5; ++T) {
    Dim time("time", T);
    const Tensor x = randn({batch, time, feat}, 9);
    dot_attention(x, x, x, {.key_dim = feat, .axis = time});
  }
  EXPECT_LE(plan_cache_stats().entries, detail::kPlanCacheCapacity);
}

INSTANTIATE_TEST_SUITE_P(Backends, AttentionPlanTest, ::testing::ValuesIn(backend_names()),
                         testing::backend_param_name);

#ifdef DIMATTN_TEST_TORCH
// The same dims, sizes and dims order, other strides: a view of a
// [B, T, H, D] buffer read as [B, H, T, D], then a packed qkv buffer.
TEST(AttentionPlanTorch, AStrideChangeMissesAndStaysCorrect) {
  reset_selection_cache();
  Dim batch("batch", 2), heads("heads", 3), time("time", 5), feat("feat", 8);
  const Dims dims = {batch, heads, time, feat};
  const at::Tensor kq = at::randn({2, 3, 5, 8}), kv = at::randn({2, 3, 5, 8});
  const Tensor k = from_aten(kq, dims), v = from_aten(kv, dims);
  const AttentionOptions o{.key_dim = feat, .axis = time};
  for (const std::string& kernel : fused_kernels("torch")) {
    ForceKernels force(kernel);
    const Tensor q = from_aten(at::randn({2, 3, 5, 8}), dims);
    dot_attention(q, k, v, o);
    const Tensor qp = from_aten(at::randn({2, 5, 3, 8}).permute({0, 2, 1, 3}), dims);
    Tensor out = q;
    const Delta d = plan_delta([&] { out = dot_attention(qp, k, v, o); });
    EXPECT_EQ(d.misses, 1u) << kernel << ": permuted strides";
    EXPECT_LE(max_abs_diff(out, reference(qp, k, v, o), dims), 1e-5) << kernel;
    const Tensor qs = from_aten(at::randn({2, 3, 5, 16}).slice(3, 0, 8), dims);  // rows of 16, read 8
    const Delta s = plan_delta([&] { out = dot_attention(qs, k, v, o); });
    EXPECT_EQ(s.misses, 1u) << kernel << ": a longer row stride";
    EXPECT_LE(max_abs_diff(out, reference(qs, k, v, o), dims), 1e-5) << kernel;
    // Packed q, k, v: one buffer, views at offsets; a new buffer of the same
    // layout hits, and its result is its own.
    for (uint64_t seed : {1, 2}) {
      at::manual_seed(seed);
      const at::Tensor packed = at::randn({2, 5, 3, 3, 8});  // [B, T, qkv, H, D]
      auto part = [&](int i) { return from_aten(packed.select(2, i).permute({0, 2, 1, 3}), dims); };
      const Tensor pq = part(0), pk = part(1), pv = part(2);
      const Delta p = plan_delta([&] { out = dot_attention(pq, pk, pv, o); });
      EXPECT_EQ(p.hits + p.misses, 1u);
      if (seed == 2) EXPECT_EQ(p.hits, 1u) << kernel << ": the same packed layout in a new buffer";
      EXPECT_LE(max_abs_diff(out, reference(pq, pk, pv, o), dims), 1e-5) << kernel;
    }
  }
}
#endif

}  // namespace
}  // namespace dimattn
