// Fuzzes kv_cache_attention and kv_cache_append (dimattn/kv_cache.h): batch,
// kv-head and group dims (0 to 2 of each, sizes 0 included), pools of any
// block count and block size (0 included) with their dims in any order, block
// tables with entries out of range, lengths negative or past the table's
// capacity, float lengths and tables, a query of one step or of static or
// ragged (dynamic) new positions, dtypes, causal or not, scale, window,
// soft-capping, ALiBi slopes and sinks over some of the heads' dims (rarely
// over others), forcing and tracing; and appends at random slots (negative:
// skipped; past the pools; one slot twice; float slots).
//
// Outcome: a result or a dimattn::Error that names the function called, never
// anything else (libFuzzer reports other exceptions, the sanitizers the rest).
// For a result: its dims are the query's without the key dim, plus the
// values' feature dim; its dtype is the query's; its values are those of
// plain loops over named indices that walk the block table (a padded query
// row, or one without a kv position, gives 0). For an append: the slots
// written hold their tokens' rows, every other slot is unchanged.
#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "dimattn/error.h"
#include "dimattn/forcing.h"
#include "dimattn/kv_cache.h"
#include "dimattn/ops.h"
#include "dimattn/registry.h"
#include "dimattn/testing/cases.h"
#include "dimattn/trace.h"
#include "fuzz/fuzz_util.h"

using namespace dimattn;
using fuzz::Host;
using fuzz::pick_dtype;

namespace {

// The call being checked, described only on failure.
std::function<std::string()> describe_call;

[[noreturn]] void fail(const std::string& what) {
  std::fprintf(stderr, "fuzz_kv_cache: %s\n%s\n", what.c_str(), describe_call ? describe_call().c_str() : "");
  std::abort();
}

// Defaults (the input's bytes run out: zeros) give a valid call that reaches
// the kernels; the rare choices sit at the far ends of each range.

// 0..2 dims named prefix0.. (default `usual_count`), each of extent 1..3
// (default `usual`), rarely 0.
Dims some_dims(FuzzedDataProvider& in, const std::string& prefix, int usual_count, int64_t usual) {
  const int n = (in.ConsumeIntegralInRange<int>(0, 2) + usual_count) % 3;
  Dims out;
  for (int i = 0; i < n; ++i) {
    const int raw = in.ConsumeIntegralInRange<int>(0, 15);
    out.push_back(Dim(prefix + std::to_string(i), raw == 15 ? 0 : 1 + (raw + usual - 1) % 3));
  }
  return out;
}

// An extent in [0, most], `usual` by default.
int64_t some_extent(FuzzedDataProvider& in, int64_t most, int64_t usual) {
  return (in.ConsumeIntegralInRange<int64_t>(0, most) + usual) % (most + 1);
}

void shuffle(FuzzedDataProvider& in, Dims& dims) {
  for (size_t i = dims.size(); i > 1; --i) std::swap(dims[i - 1], dims[in.ConsumeIntegralInRange<size_t>(0, i - 1)]);
}

// Rarely (1 in 32) a dim dropped or a foreign one added: bad operands.
void maybe_spoil(FuzzedDataProvider& in, Dims& dims, const Dim& foreign) {
  const int r = in.ConsumeIntegralInRange<int>(0, 63);
  if (r == 63 && !dims.empty()) dims.erase(dims.begin() + in.ConsumeIntegralInRange<size_t>(0, dims.size() - 1));
  if (r == 62 && !contains(dims, foreign)) dims.push_back(foreign);
}

// Every index of `dims` in row-major order, as maps.
std::vector<std::map<Dim, int64_t>> all_indices(const Dims& dims) {
  std::vector<std::map<Dim, int64_t>> out{{}};
  for (const Dim& d : dims) {
    std::vector<std::map<Dim, int64_t>> next;
    for (const auto& m : out)
      for (int64_t i = 0; i < d.extent(); ++i) {
        next.push_back(m);
        next.back()[d] = i;
      }
    out = std::move(next);
  }
  return out;
}

}  // namespace

fuzz::Stats stats{"fuzz_kv_cache"};

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  const std::vector<std::string> backends = backend_names();
  const std::string be = backends[in.ConsumeIntegralInRange<size_t>(0, backends.size() - 1)];
  describe_call = [be] { return "backend " + be; };
  const char* op = "[kv_cache_attention]";
  bool calling = false;

  try {
    // --- dims ---
    const Dims batch = some_dims(in, "b", 1, 2), kv_heads = some_dims(in, "h", 1, 2), groups = some_dims(in, "g", 1, 2);
    const Dim feat("feat", some_extent(in, 8, 4));
    const Dim vfeat = in.ConsumeIntegralInRange<int>(0, 3) == 3 ? feat : Dim("vfeat", some_extent(in, 8, 3));
    const Dim block("block", some_extent(in, 7, 4)), slot("slot", some_extent(in, 5, 2)),
        table("table", some_extent(in, 5, 3));
    const int64_t bs = slot.extent(), cap = table.extent() * bs, blocks = block.extent();
    int64_t count = 1;
    for (const Dim& d : batch) count *= d.extent();

    // The query's new positions: one step (default), static, ragged, or none.
    const int qkind = in.ConsumeIntegralInRange<int>(0, 3);
    const int64_t tq = qkind == 0 ? 1 : qkind == 3 ? 0 : 1 + in.ConsumeIntegralInRange<int64_t>(0, 2);
    std::optional<Dim> q_spatial;
    std::optional<Tensor> qlens_t;
    if (qkind == 1 || qkind == 3) q_spatial = Dim("new", tq);
    if (qkind == 2) {
      std::vector<double> ql;
      for (int64_t e = 0; e < count; ++e)
        ql.push_back(in.ConsumeIntegralInRange<int>(0, 15) == 15 ? in.ConsumeIntegralInRange<int64_t>(-1, tq + 1)
                                                                  : tq - in.ConsumeIntegralInRange<int64_t>(0, tq));
      qlens_t = from_host(batch, ql, {.dtype = DType::int64, .backend = be});
      q_spatial = Dim::dynamic("new", *qlens_t, tq);
    }

    // Lengths (over all batch dims, rarely a subset), the block table.
    Dims len_dims;
    for (const Dim& d : batch)
      if (in.ConsumeIntegralInRange<int>(0, 7) != 7) len_dims.push_back(d);
    int64_t len_count = 1;
    for (const Dim& d : len_dims) len_count *= d.extent();
    std::vector<double> lens;
    for (int64_t e = 0; e < len_count; ++e)
      lens.push_back(in.ConsumeIntegralInRange<int>(0, 15) == 15 ? in.ConsumeIntegralInRange<int64_t>(-2, cap + 2)
                                                                 : cap - in.ConsumeIntegralInRange<int64_t>(0, cap));
    const int lk = in.ConsumeIntegralInRange<int>(0, 15);
    const Tensor lengths =
        from_host(len_dims, lens, {.dtype = lk == 15 ? DType::float32 : lk == 14 ? DType::int32 : DType::int64,
                                   .backend = be});
    Dims table_dims = batch;
    table_dims.push_back(table);
    shuffle(in, table_dims);
    std::vector<double> entries;
    for (int64_t t = 0; t < count * table.extent(); ++t)
      entries.push_back(in.ConsumeIntegralInRange<int>(0, 15) == 15
                            ? in.ConsumeIntegralInRange<int64_t>(-2, blocks + 1)
                            : (in.ConsumeIntegralInRange<int64_t>(0, std::max<int64_t>(blocks - 1, 0)) + t) %
                                  std::max<int64_t>(blocks, 1));
    const int tk = in.ConsumeIntegralInRange<int>(0, 15);
    const Tensor block_table =
        from_host(table_dims, entries, {.dtype = tk == 15 ? DType::float32 : tk == 14 ? DType::int64 : DType::int32,
                                        .backend = be});

    // --- operands, their dims in any order ---
    Dims qd = batch, kd{block, slot}, vd{block, slot};
    if (q_spatial) qd.push_back(*q_spatial);
    for (const Dims* ds : {&kv_heads, &groups}) qd.insert(qd.end(), ds->begin(), ds->end());
    qd.push_back(feat);
    kd.insert(kd.end(), kv_heads.begin(), kv_heads.end());
    vd.insert(vd.end(), kv_heads.begin(), kv_heads.end());
    kd.push_back(feat), vd.push_back(vfeat);
    maybe_spoil(in, qd, slot), maybe_spoil(in, kd, groups.empty() ? table : groups[0]), maybe_spoil(in, vd, table);
    for (Dims* ds : {&qd, &kd, &vd}) shuffle(in, *ds);
    const DType dt = pick_dtype(in);
    const DType pool_dt = in.ConsumeIntegralInRange<int>(0, 31) == 31 ? pick_dtype(in) : dt;
    const Tensor q = testing::random_operand(qd, 1, dt, be);
    const PagedKvCache cache{.keys = testing::random_operand(kd, 2, pool_dt, be),
                             .values = testing::random_operand(vd, 3, pool_dt, be),
                             .block = block,
                             .slot = slot,
                             .block_table = block_table,
                             .table = table};

    // --- options ---
    KvCacheAttentionOptions o{.key_dim = feat, .lengths = lengths, .query_spatial = q_spatial};
    o.causal = !in.ConsumeBool();
    static const double kScales[] = {0.5, 0.0, 2.0, NAN, -1.0};
    if (in.ConsumeIntegralInRange<int>(0, 3) == 3) o.scale = kScales[in.ConsumeIntegralInRange<int>(0, 4)];
    const int variants = in.ConsumeIntegralInRange<int>(0, 15);
    if (variants & 1) {
      auto bound = [&]() -> std::optional<int64_t> {
        const int b = in.ConsumeIntegralInRange<int>(0, 6);
        return b == 6 ? std::nullopt : std::optional<int64_t>(b - 1);  // -1 (bad) .. 4, or unbounded
      };
      o.variants.window = AttentionWindow{bound(), bound()};
    }
    static const double kSoftcaps[] = {2.0, 0.5, 0.0, -1.0, NAN};
    if (variants & 2) o.variants.softcap = kSoftcaps[in.ConsumeIntegralInRange<int>(0, 4)];
    // Per-head values over some of the heads' dims; rarely over the query's
    // positions (a value per row: the gathered path) or the slot dim (bad).
    auto per_head = [&](uint64_t seed) {
      Dims dims;
      for (const Dims* ds : {&batch, &kv_heads, &groups})
        for (const Dim& d : *ds)
          if (in.ConsumeBool()) dims.push_back(d);
      const int r = in.ConsumeIntegralInRange<int>(0, 15);
      if (r == 15 && q_spatial) dims.push_back(*q_spatial);
      if (r == 14) dims.push_back(slot);
      const int kind = in.ConsumeIntegralInRange<int>(0, 7);  // the query's dtype, float32, rarely int64 (bad)
      return testing::random_operand(dims, seed, kind == 7 ? DType::int64 : kind % 2 ? DType::float32 : dt, be);
    };
    if (variants & 4) o.variants.alibi_slopes = per_head(5);
    if (variants & 8) o.variants.sinks = per_head(6);
    const int mode = in.ConsumeIntegralInRange<int>(0, 5);

    describe_call = [=] {
      auto opt = [](const std::optional<Tensor>& t) { return t ? t->repr() : std::string("-"); };
      return "backend " + be + " q" + repr(qd) + " keys" + repr(kd) + " values" + repr(vd) + " dtype " +
             dtype_name(dt) + "/" + dtype_name(pool_dt) + " lengths " + lengths.repr() + " table " +
             block_table.repr() + " query_spatial " + (q_spatial ? q_spatial->repr() : "-") + " causal " +
             std::to_string(o.causal) + " scale " + (o.scale ? std::to_string(*o.scale) : "-") + " window " +
             (o.variants.window ? std::to_string(o.variants.window->left.value_or(-99)) + "," +
                                      std::to_string(o.variants.window->right.value_or(-99))
                                : "-") +
             " softcap " + (o.variants.softcap ? std::to_string(*o.variants.softcap) : "-") + " alibi " +
             opt(o.variants.alibi_slopes) + " sinks " + opt(o.variants.sinks) + " mode " + std::to_string(mode);
    };

    // --- mode 4: an append first, checked slot by slot ---
    if (mode == 4) {
      const Dim tokens("tokens", some_extent(in, 4, 2));
      const int64_t capacity = blocks * bs;
      std::vector<double> slots;
      for (int64_t t = 0; t < tokens.extent(); ++t)
        slots.push_back(in.ConsumeIntegralInRange<int>(0, 7) == 7
                            ? in.ConsumeIntegralInRange<int64_t>(-2, capacity + 1)
                            : capacity == 0 ? -1 : (t + in.ConsumeIntegralInRange<int64_t>(0, capacity - 1)) % capacity);
      const Tensor slot_t = from_host({tokens}, slots,
                                      {.dtype = in.ConsumeIntegralInRange<int>(0, 15) == 15 ? DType::float32
                                                                                            : DType::int64,
                                       .backend = be});
      Dims nk{tokens}, nv{tokens};
      nk.insert(nk.end(), kv_heads.begin(), kv_heads.end());
      nv.insert(nv.end(), kv_heads.begin(), kv_heads.end());
      nk.push_back(feat), nv.push_back(vfeat);
      maybe_spoil(in, nk, groups.empty() ? table : groups[0]), maybe_spoil(in, nv, slot);
      shuffle(in, nk), shuffle(in, nv);
      const Tensor new_k = testing::random_operand(nk, 7, pool_dt, be), new_v = testing::random_operand(nv, 8, pool_dt, be);
      const Host before_k(cache.keys), before_v(cache.values);
      op = "[kv_cache_append]";
      calling = true;
      try {
        kv_cache_append(cache, new_k, new_v, slot_t);
      } catch (const dimattn::Error&) {
        // A refused append writes nothing.
        if (Host(cache.keys).data != before_k.data || Host(cache.values).data != before_v.data)
          fail("kv_cache_append raised an error after writing a pool");
        throw;
      }
      calling = false;
      op = "[kv_cache_attention]";
      // Which token each slot got (the call refuses a slot given twice).
      std::map<int64_t, int64_t> token_of;
      for (int64_t t = 0; t < tokens.extent(); ++t)
        if (slots[t] >= 0 && !token_of.emplace(static_cast<int64_t>(slots[t]), t).second)
          fail("kv_cache_append accepted slot " + std::to_string(slots[t]) + " twice");
      const Host after_k(cache.keys), after_v(cache.values), hk(new_k), hv(new_v);
      const std::pair<const Host*, const Host*> pools[] = {{&before_k, &after_k}, {&before_v, &after_v}};
      const Host* news[] = {&hk, &hv};
      for (int p = 0; p < 2; ++p)
        for (const auto& idx : all_indices(pools[p].second->dims)) {
          if (!idx.count(block) || !idx.count(slot)) fail("kv_cache_append accepted a pool without its block or slot dim");
          const auto it = token_of.find(idx.at(block) * bs + idx.at(slot));
          std::map<Dim, int64_t> ti = idx;
          if (it != token_of.end()) ti[tokens] = it->second;
          const double want = it != token_of.end() ? news[p]->at(ti) : pools[p].first->at(idx);
          const double got = pools[p].second->at(idx);
          if (!(got == want || (std::isnan(got) && std::isnan(want))))
            fail("after kv_cache_append a pool holds " + std::to_string(got) + " where " + std::to_string(want) +
                 " belongs");
        }
      ++stats.appends;
    }

    // --- the call ---
    std::optional<ForceKernels> force;
    std::optional<TraceScope> trace;
    if (mode == 1) force.emplace("reference");
    if (mode == 2) force.emplace("cpu_flash");
    if (mode == 3) trace.emplace(true);
    calling = true;
    const Tensor out = kv_cache_attention(q, cache, o);
    calling = false;
    ++stats.results;

    // --- dims and dtype ---
    Dims expected;  // the query's dims (however spoiled) without the key dim, and the value feature dim
    for (const Dim& d : qd)
      if (d != feat) expected.push_back(d);
    expected.push_back(vfeat);
    if (!testing::same_dims(out.dims(), expected))
      fail("result dims " + repr(out.dims()) + " are not " + repr(expected));
    if (out.dtype() != dt) fail(std::string("result dtype ") + dtype_name(out.dtype()) + " is not the query's");

    // --- values, against plain loops over the block table ---
    const double scale = o.scale.value_or(1.0 / std::sqrt(static_cast<double>(feat.extent())));
    const Host hq(q), hk(cache.keys), hv(cache.values), ho(out), hlen(lengths), htab(block_table);
    std::optional<Host> hql, hslopes, hsinks;
    if (qlens_t) hql.emplace(*qlens_t);
    if (o.variants.alibi_slopes) hslopes.emplace(*o.variants.alibi_slopes);
    if (o.variants.sinks) hsinks.emplace(*o.variants.sinks);
    const double tol = dt == DType::float64 ? 1e-9 : dt == DType::float32 ? 2e-4 : 5e-2;
    const std::optional<AttentionWindow>& w = o.variants.window;
    const std::vector<std::map<Dim, int64_t>> elements = all_indices(ho.dims);
    for (size_t flat = 0; flat < elements.size(); ++flat) {
      const std::map<Dim, int64_t>& idx = elements[flat];
      for (const std::optional<Host>* h : {&hslopes, &hsinks})
        if (*h && !(*h)->indexed_by(idx)) fail("accepted per-head values over dims the result lacks");
      const int64_t i = q_spatial ? idx.at(*q_spatial) : 0;
      const int64_t qlen = hql ? static_cast<int64_t>(hql->at(idx)) : tq;
      const int64_t len = static_cast<int64_t>(hlen.at(idx));
      const int64_t diag = i + len - qlen;
      std::vector<double> e;
      std::vector<std::map<Dim, int64_t>> at;  // each attended position's pool index
      for (int64_t j = 0; i < qlen && j < len; ++j) {
        if (o.causal && j > diag) continue;
        if (w && w->left && j < diag - *w->left) continue;
        if (w && w->right && j > diag + *w->right) continue;
        std::map<Dim, int64_t> ti = idx, ki = idx, qi = idx;
        ti[table] = j / bs;
        ki[block] = static_cast<int64_t>(htab.at(ti));
        ki[slot] = j % bs;
        double s = 0;
        for (int64_t c = 0; c < feat.extent(); ++c) {
          qi[feat] = ki[feat] = c;
          s += hq.at(qi) * hk.at(ki);
        }
        s *= scale;
        if (o.variants.softcap) s = *o.variants.softcap * std::tanh(s / *o.variants.softcap);
        if (hslopes) s -= hslopes->at(idx) * static_cast<double>(std::abs(diag - j));
        e.push_back(s);
        ki[vfeat] = idx.at(vfeat);
        at.push_back(ki);
      }
      const double want = fuzz::softmax_average(e, hsinks ? std::optional<double>(hsinks->at(idx)) : std::nullopt,
                                                [&](size_t t) { return hv.at(at[t]); });
      const double got = ho.data[flat];
      if (!(std::abs(got - want) <= tol * std::max(1.0, std::abs(want))))
        fail("result element " + std::to_string(flat) + " is " + std::to_string(got) + ", plain loops give " +
             std::to_string(want));
    }
    ++stats.checked;
  } catch (const dimattn::Error& err) {
    // A clear error is a valid outcome for bad input: one that names the
    // function called (not an internal one it reached).
    ++stats.errors;
    const std::string what = err.what();
    if (calling && what.rfind(op, 0) != 0) fail(std::string("an error that does not name ") + op + ": " + what);
  }
  return 0;
}
