// kv_cache_attention over a paged cache (dimattn/kv_cache.h) on every
// backend: the cache is written with kv_cache_append from plain keys and
// values through a shuffled block table, and both its paths (cpu_flash
// reading the pools in place, and the pages gathered for the reference path)
// must equal dot_attention over the plain keys and values. Part of the dual
// harness: ctest runs it once per cpu_flash instruction set.
#include <algorithm>
#include <numeric>
#include <random>

#include "dimattn/attention.h"
#include "dimattn/forcing.h"
#include "dimattn/kv_cache.h"
#include "dimattn/ops.h"
#include "dimattn/registry.h"
#include "dimattn/trace.h"
#include "support/test_util.h"

namespace dimattn {
namespace {
using testing::error_of;
using testing::max_abs_diff;

class KvCache : public ::testing::TestWithParam<std::string> {};

struct Names;

struct CacheCase {
  const Names* dims = nullptr;  // the case's dims; nullptr: names()
  int64_t block_size = 16;
  bool heads_outer = false;  // pools [block, kv_heads, slot, D] instead of [block, slot, kv_heads, D]
  std::vector<double> lengths{37, 1, 0, 16};
  std::vector<double> query_lengths;  // ragged new positions per sequence; empty: Tq each
  int64_t Tq = 1;                     // 0: one step (no query_spatial dim)
  DType dtype = DType::float32;
  AttentionVariants variants;
};

struct Names {
  Dim batch{"batch", 4}, kv_heads{"kv_heads", 2}, group{"group", 3}, feat{"feat", 16}, vfeat{"vfeat", 16};
};
const Names& names() {
  static const Names n;
  return n;
}

struct Built {
  // Plain keys/values over {batch, kv, kv_heads, feat}; optional only to be filled in by build.
  std::optional<Tensor> query, keys, values, lengths;
  std::optional<PagedKvCache> cache;
  // The case's dims (names() unless it has its own), so that per-head variants made for it fit.
  Dim batch = names().batch, kv_heads = names().kv_heads, group = names().group, feat = names().feat,
      vfeat = names().vfeat;
  std::optional<Dim> q_spatial;
  Dim kv{"kv", 1};
};

Built build(const CacheCase& s, const std::string& backend) {
  Built r;
  if (s.dims) {
    const Names& n = *s.dims;
    r.batch = n.batch, r.kv_heads = n.kv_heads, r.group = n.group, r.feat = n.feat, r.vfeat = n.vfeat;
  }
  const TensorOptions o{.dtype = s.dtype, .backend = backend};
  const TensorOptions ints{.dtype = DType::int64, .backend = backend};
  const int64_t B = 4, bs = s.block_size;
  const int64_t most = std::max<int64_t>(1, static_cast<int64_t>(*std::max_element(s.lengths.begin(), s.lengths.end())));
  const int64_t cap = (most + bs - 1) / bs + 1;
  r.lengths = from_host({r.batch}, s.lengths, ints);
  r.kv = Dim::dynamic("kv", *r.lengths, most);
  r.keys = random_normal({r.batch, r.kv, r.kv_heads, r.feat}, 3, o);
  r.values = random_normal({r.batch, r.kv, r.kv_heads, r.vfeat}, 4, o);
  if (s.Tq > 0)
    r.q_spatial = s.query_lengths.empty() ? Dim("new", s.Tq)
                                          : Dim::dynamic("new", from_host({r.batch}, s.query_lengths, ints), s.Tq);
  Dims qdims{r.batch, r.kv_heads, r.group, r.feat};
  if (r.q_spatial) qdims.insert(qdims.begin() + 1, *r.q_spatial);
  r.query = random_normal(qdims, 5, o);

  // Blocks handed out in a shuffled order; NaN in every pool slot first, so
  // that a slot the kernel should not read shows.
  std::vector<int64_t> order(static_cast<size_t>(B * cap) + 2);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), std::mt19937_64(11));
  const Dim block("block", static_cast<int64_t>(order.size())), slot("slot", bs), table("table", cap);
  std::vector<double> tab(static_cast<size_t>(B * cap), -1);
  size_t next = 0;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t * bs < s.lengths[b]; ++t) tab[b * cap + t] = static_cast<double>(order[next++]);
  const Dims kpool = s.heads_outer ? Dims{block, r.kv_heads, slot, r.feat} : Dims{block, slot, r.kv_heads, r.feat};
  const Dims vpool = s.heads_outer ? Dims{block, r.kv_heads, slot, r.vfeat} : Dims{block, slot, r.kv_heads, r.vfeat};
  r.cache = PagedKvCache{.keys = full(kpool, std::nan(""), o), .values = full(vpool, std::nan(""), o), .block = block,
             .slot = slot, .block_table = from_host({r.batch, table}, tab, {.dtype = DType::int32, .backend = backend}),
             .table = table};
  // Each sequence's positions appended through their slots.
  std::vector<double> slots;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t j = 0; j < most; ++j)
      slots.push_back(j < s.lengths[b] ? tab[b * cap + j / bs] * static_cast<double>(bs) + static_cast<double>(j % bs)
                                       : -1.0);
  kv_cache_append(*r.cache, *r.keys, *r.values, from_host({r.batch, r.kv}, slots, ints));
  return r;
}

// dot_attention over the plain keys and values: the oracle.
Tensor plain(const Built& b, const CacheCase& s) {
  AttentionOptions a{.key_dim = b.feat, .axis = b.kv, .variants = s.variants};
  if (b.q_spatial) {
    const Tensor qlen = b.q_spatial->is_dynamic() ? b.q_spatial->lengths()
                                                  : full({}, static_cast<double>(s.Tq), {.dtype = DType::int64,
                                                                                         .backend = b.lengths->backend().name()});
    a.causal_query_spatial_dim = *b.q_spatial;
    a.causal_offset = *b.lengths - qlen;
  }
  Tensor out = dot_attention(*b.query, *b.keys, *b.values, a);
  if (b.q_spatial && b.q_spatial->is_dynamic()) out = where(sequence_mask(*b.q_spatial, {.dtype = DType::boolean, .backend = b.lengths->backend().name()}),
                                                           out, 0.0);
  return out;
}

Tensor paged(const Built& b, const CacheCase& s) {
  return kv_cache_attention(*b.query, *b.cache,
                            {.key_dim = b.feat, .lengths = *b.lengths, .query_spatial = b.q_spatial,
                             .variants = s.variants});
}

double tol(DType t) { return t == DType::float32 ? 2e-5 : t == DType::bfloat16 ? 3e-2 : 4e-3; }

void check(const CacheCase& s, const std::string& backend, int& ran) {
  const Built b = build(s, backend);
  const Tensor want = plain(b, s);
  {
    TraceScope trace(false);
    const Tensor got = paged(b, s);
    ASSERT_EQ(trace.records().size(), 1u);
    EXPECT_EQ(trace.records()[0].kernel, "cpu_flash");  // the pools read in place
    EXPECT_LT(max_abs_diff(got, want, want.dims()), tol(s.dtype)) << "in place";
  }
  {
    ForceKernels force("reference");  // the pages gathered, dot_attention's reference path
    const Tensor got = paged(b, s);
    EXPECT_LT(max_abs_diff(got, want, want.dims()), tol(s.dtype)) << "gathered";
  }
  ++ran;
}

TEST_P(KvCache, PagedEqualsPlainKeysAndValues) {
  int ran = 0;
  for (int64_t bs : {1, 16, 7})
    for (bool outer : {false, true})
      for (int64_t tq : {0, 1, 4}) {
        SCOPED_TRACE("block " + std::to_string(bs) + (outer ? " heads-outer" : "") + " Tq " + std::to_string(tq));
        CacheCase s{.block_size = bs, .heads_outer = outer, .Tq = tq};
        if (tq == 4) s.lengths = {37, 4, 5, 16};  // every sequence holds its new positions
        check(s, GetParam(), ran);
      }
  EXPECT_EQ(ran, 18);
}

TEST_P(KvCache, RaggedQueriesHalfPrecisionAndVariants) {
  int ran = 0;
  CacheCase ragged{.lengths = {37, 3, 0, 20}, .query_lengths = {4, 1, 0, 2}, .Tq = 4};
  check(ragged, GetParam(), ran);
  for (DType t : {DType::bfloat16, DType::float16}) {
    CacheCase half{.Tq = 1, .dtype = t};
    check(half, GetParam(), ran);
  }
  CacheCase window{.lengths = {37, 9, 2, 16}, .Tq = 2};
  window.variants.window = AttentionWindow{.left = 5};
  window.variants.softcap = 2.0;
  check(window, GetParam(), ran);
  CacheCase alibi_sinks{.lengths = {37, 9, 2, 16}, .Tq = 2};
  const Dims heads{names().kv_heads, names().group};
  alibi_sinks.variants.alibi_slopes = from_host(heads, {0.5, 0.25, 0.125, 0.0625, 0.03, 0.01},
                                                {.dtype = DType::float64, .backend = GetParam()});
  alibi_sinks.variants.sinks =
      from_host(heads, {0.3, -1.0, 2.0, 0.0, 1.5, -0.5}, {.dtype = DType::float64, .backend = GetParam()});
  check(alibi_sinks, GetParam(), ran);
  CacheCase off_by_one{.lengths = {37, 9, 0, 16}, .Tq = 1};
  off_by_one.variants.sink_off_by_one = true;
  check(off_by_one, GetParam(), ran);
  EXPECT_EQ(ran, 6);
}

// Random cases over what the grids above fix: kv heads, GQA groups and
// feature sizes (rows per kv head past the direct products' 16, value
// features that are not whole vectors: the packed path), block sizes (1 to
// past the longest sequence), lengths (0 to long enough that the decode path
// splits the cache into chunks), ragged or equal query lengths, both pool
// layouts, the dtypes and the variants, each against the plain keys and
// values and the gathered pages (check). A fixed seed: the same cases every run.
TEST_P(KvCache, RandomCasesMatchThePlainCache) {
  std::mt19937_64 rng(20261207);
  auto below = [&](int64_t n) { return static_cast<int64_t>(rng() % static_cast<uint64_t>(n)); };
  auto pick = [&](const std::vector<int64_t>& from) { return from[below(static_cast<int64_t>(from.size()))]; };
  const std::vector<int64_t> blocks{1, 2, 3, 5, 8, 16, 17, 32, 64, 128, 300};
  int ran = 0, long_cases = 0, ragged_cases = 0, many_rows = 0;
  constexpr int kCases = 64;
  for (int i = 0; i < kCases; ++i) {
    const Names dims{Dim("batch", 4), Dim("kv_heads", pick({1, 2, 3})), Dim("group", pick({1, 2, 3, 4, 8})),
                     Dim("feat", pick({8, 16, 32, 64})), Dim("vfeat", pick({8, 16, 24, 32}))};
    const Dims heads{dims.kv_heads, dims.group};
    const int64_t H = dims.kv_heads.extent() * dims.group.extent();
    std::vector<double> slopes, sink_logits;
    for (int64_t h = 0; h < H; ++h) {
      slopes.push_back(std::ldexp(1.0, -static_cast<int>(h % 8) - 1));
      sink_logits.push_back(static_cast<double>(h % 3) - 1.0);
    }
    CacheCase c;
    c.dims = &dims;
    c.block_size = pick(blocks);
    c.heads_outer = below(2) == 1;
    c.Tq = below(6);  // 0: one step, no query dim
    const bool long_cache = below(6) == 0;  // past 4096 positions: chunks merged
    for (double& len : c.lengths) {
      const int64_t kind = below(4);
      len = static_cast<double>(kind == 0 ? below(2) : kind == 1 ? below(c.block_size + 1)
                                                                 : below(long_cache ? 6000 : 300));
      len = std::max(len, static_cast<double>(c.Tq));  // every sequence holds its new positions
    }
    if (c.Tq > 1 && below(2) == 1) {
      c.query_lengths.clear();
      for (double len : c.lengths)
        c.query_lengths.push_back(static_cast<double>(below(std::min<int64_t>(c.Tq, static_cast<int64_t>(len)) + 1)));
      ++ragged_cases;
    }
    const int64_t dt = below(6);
    c.dtype = dt == 0 ? DType::bfloat16 : dt == 1 ? DType::float16 : DType::float32;
    // A window and ALiBi measure distances along the query's positions: the
    // oracle needs a query dim (Tq > 0).
    if (c.Tq > 0 && below(3) == 0) c.variants.window = AttentionWindow{.left = 1 + below(40)};
    if (below(4) == 0) c.variants.softcap = 1.0 + static_cast<double>(below(4));
    if (c.Tq > 0 && below(4) == 0)
      c.variants.alibi_slopes = from_host(heads, slopes, {.dtype = DType::float64, .backend = GetParam()});
    if (below(4) == 0)
      c.variants.sinks = from_host(heads, sink_logits, {.dtype = DType::float64, .backend = GetParam()});
    long_cases += *std::max_element(c.lengths.begin(), c.lengths.end()) > 4096;
    many_rows += dims.group.extent() * std::max<int64_t>(c.Tq, 1) > 16;
    std::string what = "case " + std::to_string(i) + ": heads " + std::to_string(dims.kv_heads.extent()) + "x" +
                       std::to_string(dims.group.extent()) + " feat " + std::to_string(dims.feat.extent()) + "/" +
                       std::to_string(dims.vfeat.extent()) + " block " + std::to_string(c.block_size) +
                       (c.heads_outer ? " heads-outer" : "") + " Tq " + std::to_string(c.Tq) + " dtype " +
                       dtype_name(c.dtype) + " lengths";
    for (double len : c.lengths) what += " " + std::to_string(static_cast<int64_t>(len));
    if (!c.query_lengths.empty()) {
      what += " queries";
      for (double len : c.query_lengths) what += " " + std::to_string(static_cast<int64_t>(len));
    }
    SCOPED_TRACE(what);
    check(c, GetParam(), ran);
  }
  EXPECT_EQ(ran, kCases);
  EXPECT_GE(long_cases, 3);  // the split over threads ran
  EXPECT_GE(ragged_cases, 3);
  EXPECT_GE(many_rows, 3);  // blocks past the direct products' rows
}

// A query whose kv-head and group dims lie the other way round in memory
// (the kernel's heads do not merge): cpu_flash reads a copy of it, which must
// live through the call (ASan caught a copy freed before the kernel read it).
TEST_P(KvCache, QueryInAnotherDimOrderIsCopiedForTheKernel) {
  int ran = 0;
  for (const int64_t tq : {0, 3}) {
    const CacheCase s{.lengths = {37, 5, 0, 16}, .Tq = tq};
    Built b = build(s, GetParam());
    Dims order{b.group, b.batch, b.kv_heads, b.feat};
    if (b.q_spatial) order.insert(order.begin() + 1, *b.q_spatial);
    b.query = random_normal(order, 9, {.backend = GetParam()});  // laid out in `order`
    const Tensor want = plain(b, s);
    TraceScope trace(false);
    EXPECT_LT(max_abs_diff(paged(b, s), want, want.dims()), tol(s.dtype)) << "Tq " << tq;
    ASSERT_EQ(trace.records().size(), 1u);
    EXPECT_EQ(trace.records()[0].kernel, "cpu_flash");
    ++ran;
  }
  EXPECT_EQ(ran, 2);
}

TEST_P(KvCache, BadTablesAndPoolsAreErrors) {
  CacheCase s{.Tq = 1};
  Built b = build(s, GetParam());
  const KvCacheAttentionOptions o{.key_dim = b.feat, .lengths = *b.lengths, .query_spatial = b.q_spatial};
  PagedKvCache bad = *b.cache;
  std::vector<double> tab(static_cast<size_t>(4 * b.cache->table.extent()), 0);
  tab[1] = 999;  // sequence 0's second block
  bad.block_table = from_host({b.batch, b.cache->table}, tab, {.dtype = DType::int32, .backend = GetParam()});
  EXPECT_NE(error_of([&] { kv_cache_attention(*b.query, bad, o); }).find("block_table[0][1] = 999 is outside the pool"),
            std::string::npos);
  KvCacheAttentionOptions too_long = o;
  too_long.lengths = from_host({b.batch}, {1000, 1, 1, 1}, {.dtype = DType::int64, .backend = GetParam()});
  EXPECT_NE(error_of([&] { kv_cache_attention(*b.query, *b.cache, too_long); }).find("past the block table's capacity"),
            std::string::npos);
  PagedKvCache mismatched = *b.cache;
  mismatched.values = random_normal({Dim("other_blocks", 3), b.cache->slot, b.kv_heads, b.vfeat}, 1,
                                    {.backend = GetParam()});
  EXPECT_NE(error_of([&] { kv_cache_attention(*b.query, mismatched, o); }).find("the pools need the block dim"),
            std::string::npos);
  const Tensor slots = from_host({Dim("tokens", 1)}, {1e6}, {.dtype = DType::int64, .backend = GetParam()});
  EXPECT_NE(error_of([&] {
              kv_cache_append(*b.cache, random_normal({Dim("tokens", 1), b.kv_heads, b.feat}, 1, {.backend = GetParam()}),
                              random_normal({Dim("tokens", 1), b.kv_heads, b.vfeat}, 1, {.backend = GetParam()}), slots);
            }).find("past the pools'"),
            std::string::npos);
}

INSTANTIATE_TEST_SUITE_P(Backends, KvCache, ::testing::ValuesIn(backend_names()), testing::backend_param_name);

}  // namespace
}  // namespace dimattn
