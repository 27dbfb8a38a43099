// Concurrency (docs/reliability.md): 8 threads × 1000 dot_attention calls
// with mixed configurations, per-thread kernel forcing and tracing. Every
// result must be bitwise equal to its single-threaded value, every trace
// record must name the kernel that the single-threaded run used, and the
// selection counters must add up. Decoding threads append to and read one
// shared pair of kv pools. The TSan preset runs these tests.
#include <atomic>
#include <cstring>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "dimattn/attention.h"
#include "dimattn/ext/backend.h"
#include "dimattn/forcing.h"
#include "dimattn/kv_cache.h"
#include "dimattn/ops.h"
#include "dimattn/registry.h"
#include "dimattn/run_context.h"
#include "dimattn/trace.h"
#include "support/test_util.h"

namespace dimattn {
namespace {

// One configuration: operands, options, train flag and seed, and the kernel
// forcings it may run under.
struct Config {
  std::string name;
  Tensor q, k, v;
  AttentionOptions opts;
  bool train = false;
  uint64_t seed = 0;
  std::vector<std::string> forcings;
};

// What one call produces: the output's values and dims, the kernel, or the error.
struct Outcome {
  std::vector<double> values;
  Dims dims;
  std::string kernel;
  std::string error;
  bool operator==(const Outcome& o) const {
    if (values.size() != o.values.size()) return false;
    for (size_t i = 0; i < values.size(); ++i)  // bitwise: NaN == NaN, +0 != -0
      if (std::memcmp(&values[i], &o.values[i], sizeof(double)) != 0) return false;
    return dims == o.dims && kernel == o.kernel && error == o.error;
  }
};

enum class TraceMode { none, capture, names };
constexpr TraceMode kTraceModes[] = {TraceMode::none, TraceMode::capture, TraceMode::names};

std::vector<Config> make_configs() {
  std::vector<Config> cs;
  for (const std::string& be : backend_names()) {
    const TensorOptions f32{.backend = be}, f64{.dtype = DType::float64, .backend = be},
        bf16{.dtype = DType::bfloat16, .backend = be}, i64{.dtype = DType::int64, .backend = be};
    std::vector<std::string> forcings = {"auto", "reference"};
    for (const std::string& k : get_backend(be).attention_kernels(kCPU))
      if (k != "reference") forcings.push_back(k);
    const std::vector<std::string> auto_ref = {"auto", "reference"};
    Dim batch("batch", 2), heads("heads", 2), time("time", 6), enc("enc", 5), feat("feat", 8), vfeat("vfeat", 4),
        beam("beam", 3), group("group", 2), step_feat("feat", 4);
    Dim lens = Dim::dynamic("enc_len", from_host({batch}, {5, 2}, i64), 5);
    Dim tlen = Dim::dynamic("tlen", from_host({batch}, {6, 3}, i64), 6);
    const std::string p = be + ":";
    // Cross attention with padding.
    cs.push_back({p + "cross_padded", random_normal({batch, heads, time, feat}, 1, f32),
                  random_normal({batch, heads, lens, feat}, 2, f32), random_normal({batch, heads, lens, feat}, 3, f32),
                  {.key_dim = feat, .axis = lens}, false, 0, forcings});
    // Causal self-attention over a dynamic axis.
    cs.push_back({p + "causal_self", random_normal({batch, heads, tlen, feat}, 4, f32),
                  random_normal({batch, heads, tlen, feat}, 5, f32), random_normal({batch, heads, tlen, feat}, 6, f32),
                  {.key_dim = feat, .axis = tlen, .causal_query_spatial_dim = tlen}, false, 0, forcings});
    // Causal chunk with per-entry history offsets, GQA query groups.
    cs.push_back({p + "causal_gqa_offset", random_normal({batch, heads, group, enc, feat}, 7, f32),
                  random_normal({batch, heads, time, feat}, 8, f32), random_normal({batch, heads, time, feat}, 9, f32),
                  {.key_dim = feat,
                   .axis = time,
                   .causal_query_spatial_dim = enc,
                   .causal_offset = from_host({batch}, {1, 0}, i64)},
                  false, 0, forcings});
    // Beam search cross-attention (query dims the keys lack), keys-only dims, float64.
    cs.push_back({p + "beam_keys_only", random_normal({batch, beam, feat}, 10, f64),
                  random_normal({batch, heads, enc, feat}, 11, f64), random_normal({batch, heads, enc, vfeat}, 12, f64),
                  {.key_dim = feat, .axis = enc}, false, 0, forcings});
    // Dropout (train flag on) with a per-call seed: the shared Philox stream.
    cs.push_back({p + "dropout", random_normal({batch, heads, time, feat}, 13, f32),
                  random_normal({batch, heads, enc, feat}, 14, f32), random_normal({batch, heads, enc, feat}, 15, f32),
                  {.key_dim = feat, .axis = enc, .att_dropout = 0.3}, true, 77, auto_ref});
    cs.push_back({p + "dropout_broadcast", random_normal({batch, heads, time, feat}, 16, f32),
                  random_normal({batch, heads, lens, feat}, 17, f32), random_normal({batch, heads, lens, feat}, 18, f32),
                  {.key_dim = feat, .axis = lens, .att_dropout = 0.5, .att_dropout_broadcast = true}, true, 78,
                  auto_ref});
    // One decoding step in bfloat16.
    cs.push_back({p + "step_bf16", random_normal({batch, heads, step_feat}, 19, bf16),
                  random_normal({batch, heads, enc, step_feat}, 20, bf16),
                  random_normal({batch, heads, enc, step_feat}, 21, bf16), {.key_dim = step_feat, .axis = enc}, false,
                  0, forcings});
    // A bad call: the error must be the same in every thread.
    cs.push_back({p + "bad_dropout", random_normal({batch, time, feat}, 22, f32),
                  random_normal({batch, enc, feat}, 23, f32), random_normal({batch, enc, feat}, 24, f32),
                  {.key_dim = feat, .axis = enc, .att_dropout = 1.5}, false, 0, auto_ref});
  }
  return cs;
}

// One call under the given forcing and trace mode, in the calling thread.
// Returns the outcome; `trace_ok` is false when the trace scope's records
// disagree with the outcome.
Outcome run_call(const Config& c, const std::string& forcing, TraceMode mode, bool* trace_ok) {
  Outcome out;
  ForceKernels force(forcing);
  TrainFlagScope train(c.train);
  set_random_seed(c.seed);
  std::optional<TraceScope> trace;
  if (mode != TraceMode::none) trace.emplace(mode == TraceMode::capture);
  try {
    const Tensor r = dot_attention(c.q, c.k, c.v, c.opts);
    out.values = to_host(r);
    out.dims = r.dims();
    if (trace) {
      *trace_ok = trace->records().size() == 1;
      if (*trace_ok) {
        const AttentionTrace& rec = trace->records()[0];
        out.kernel = rec.kernel;
        *trace_ok = rec.energy.has_value() == (mode == TraceMode::capture) &&
                    rec.att_weights.has_value() == (mode == TraceMode::capture) && rec.output.dims() == r.dims();
      }
    }
  } catch (const Error& e) {
    out.error = e.what();
    if (trace) *trace_ok = trace->records().empty();
  }
  return out;
}

struct Job {
  size_t config;
  std::string forcing;
  TraceMode mode;
};

// Every (config, forcing, trace mode) combination, in a fixed order.
std::vector<Job> all_jobs(const std::vector<Config>& cs) {
  std::vector<Job> jobs;
  for (size_t c = 0; c < cs.size(); ++c)
    for (const std::string& f : cs[c].forcings)
      for (TraceMode m : kTraceModes) jobs.push_back({c, f, m});
  return jobs;
}

// Which forced kernel runs which configuration: every CPU kernel of every
// backend runs every configuration it is forced on, except these gate
// rejections, the documented behaviour of aten_flash_cpu (its gate's reason as
// it appears in the error). Any other rejection fails the test.
std::optional<std::string> documented_rejection(const std::string& config, const std::string& forcing) {
  if (forcing != "aten_flash_cpu") return std::nullopt;
  const std::string name = config.substr(config.find(':') + 1);
  if (name == "causal_gqa_offset") return "causal attention with query groups (GQA/beam) needs kv repeated per group";
  if (name == "beam_keys_only") return "needs equal qk and v head dims";
  return std::nullopt;
}

std::string key_of(const Job& j) { return std::to_string(j.config) + "|" + j.forcing + "|" + std::to_string(int(j.mode)); }

TEST(Concurrency, EightThreadsMatchSingleThreadedResults) {
  const std::vector<Config> cs = make_configs();
  const std::vector<Job> jobs = all_jobs(cs);
  ASSERT_FALSE(jobs.empty());

  // Single-threaded expectations, the selection lookups each call makes,
  // and the selection keys they use.
  reset_selection_cache();
  std::map<std::string, Outcome> expected;
  std::map<std::string, uint64_t> lookups_per_call;
  for (const Job& j : jobs) {
    bool trace_ok = true;
    const uint64_t before = selection_stats().lookups;
    expected[key_of(j)] = run_call(cs[j.config], j.forcing, j.mode, &trace_ok);
    lookups_per_call[key_of(j)] = selection_stats().lookups - before;
    ASSERT_TRUE(trace_ok) << cs[j.config].name << " forced " << j.forcing;
  }
  const SelectionStats single = selection_stats();
  ASSERT_EQ(single.selections, single.entries);
  // Sanity: the bad call failed, and so did capturing traces under a forced
  // kernel other than the reference (docs/errors.md); so did the calls whose
  // gates reject them as documented (documented_rejection); every other call
  // ran, and the test counts them. Every call that ran looked its kernel up
  // once, except under a capturing trace (the reference path, without
  // selection).
  size_t ran = 0, must_run = 0;
  for (const Job& j : jobs) {
    const Outcome& e = expected[key_of(j)];
    const std::string what = cs[j.config].name + " forced " + j.forcing + " trace " + std::to_string(int(j.mode));
    const bool must_fail = cs[j.config].name.find("bad_") != std::string::npos ||
                           (j.mode == TraceMode::capture && j.forcing != "auto" && j.forcing != "reference");
    const std::optional<std::string> rejected = documented_rejection(cs[j.config].name, j.forcing);
    if (must_fail) {
      EXPECT_FALSE(e.error.empty()) << what << " must fail";
    } else if (rejected) {
      EXPECT_NE(e.error.find("no forced kernel can run this call"), std::string::npos)
          << what << " must be rejected by its gate (" << *rejected << "), got '" << e.error << "'";
      EXPECT_NE(e.error.find(*rejected), std::string::npos) << what << ": " << e.error;
    } else {
      ++must_run;
      EXPECT_EQ(e.error, "") << what << " must run";
    }
    if (e.error.empty()) {
      ++ran;
      EXPECT_EQ(lookups_per_call[key_of(j)], j.mode == TraceMode::capture ? 0u : 1u) << what;
    }
  }
  EXPECT_EQ(ran, must_run) << "calls that ran";

  // 8 threads × 1000 calls, each thread walking the jobs in its own order.
  constexpr int kThreads = 8, kCalls = 1000;
  reset_selection_cache();
  std::atomic<int> mismatches{0}, trace_errors{0};
  std::atomic<uint64_t> expected_lookups{0};
  std::vector<std::string> first_mismatch(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&, t] {
      for (int i = 0; i < kCalls; ++i) {
        const Job& j = jobs[(static_cast<size_t>(i) * 7 + static_cast<size_t>(t) * 131) % jobs.size()];
        bool trace_ok = true;
        const Outcome got = run_call(cs[j.config], j.forcing, j.mode, &trace_ok);
        expected_lookups += lookups_per_call.at(key_of(j));
        if (!trace_ok) ++trace_errors;
        if (!(got == expected.at(key_of(j)))) {
          if (mismatches++ == 0 || first_mismatch[t].empty())
            first_mismatch[t] = cs[j.config].name + " forced " + j.forcing + " trace " + std::to_string(int(j.mode)) +
                                " kernel " + got.kernel + " vs " + expected.at(key_of(j)).kernel + " error '" +
                                got.error + "'";
        }
      }
    });
  for (auto& th : threads) th.join();
  for (int t = 0; t < kThreads; ++t) EXPECT_TRUE(first_mismatch[t].empty()) << "thread " << t << ": " << first_mismatch[t];
  EXPECT_EQ(mismatches.load(), 0);
  EXPECT_EQ(trace_errors.load(), 0);

  // Counters: as many lookups as the same calls made on one thread, and
  // exactly one selection per distinct key however the threads raced for it.
  const SelectionStats multi = selection_stats();
  EXPECT_EQ(multi.lookups, expected_lookups.load());
  EXPECT_EQ(multi.selections, multi.entries);
  EXPECT_LE(multi.entries, single.entries);
}

// Guards are per thread: one thread's forcing, trace scope, train flag and
// seed never leak into another running at the same time.
TEST(Concurrency, ForcingTracingAndRunContextArePerThread) {
  const std::vector<Config> cs = make_configs();
  std::atomic<int> errors{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t)
    threads.emplace_back([&, t] {
      const bool reference = t % 2 == 0;
      ForceKernels force(reference ? "reference" : "auto");
      TraceScope trace(false);
      TrainFlagScope train(t % 4 == 1);
      set_random_seed(1000 + t);
      for (int i = 0; i < 200; ++i) {
        const Config& c = cs[static_cast<size_t>(i + t) % cs.size()];
        if (c.name.find("bad_") != std::string::npos) continue;
        const size_t before = trace.records().size();
        try {
          dot_attention(c.q, c.k, c.v, c.opts);
        } catch (const Error&) {
          ++errors;
          continue;
        }
        if (trace.records().size() != before + 1) ++errors;
        else if (reference && trace.records().back().kernel != "reference") ++errors;
        if (current_kernel_force().describe() != (reference ? "reference" : "auto")) ++errors;
        if (train_flag() != (t % 4 == 1)) ++errors;
      }
    });
  for (auto& th : threads) th.join();
  EXPECT_EQ(errors.load(), 0);
}

// Decoding sequences on threads of their own over one shared pair of pools
// (a server's workers): each thread appends its sequence's next key and
// value to its own blocks, then attends over its whole sequence, long
// enough (> 2 x decode_min_chunk_positions()) for cpu_flash's decode path to
// split it into chunks that it merges.
// Every step's output must be bitwise equal to a replay of the same steps
// on one thread.
TEST(Concurrency, DecodingThreadsShareKvPools) {
  constexpr int kSeqs = 4, kSteps = 40, kStart = 4500, kBlock = 16, kBlocksPer = (kStart + kSteps) / kBlock + 1;
  for (const std::string& be : backend_names()) {
    const TensorOptions f32{.backend = be}, i64{.dtype = DType::int64, .backend = be};
    const Dim block("block", kSeqs * kBlocksPer), slot("slot", kBlock), kv_heads("kv_heads", 2), group("group", 4),
        feat("feat", 64), one("one", 1), table("table", kBlocksPer), token("token", 1);
    // Sequence s owns blocks [s * kBlocksPer, (s + 1) * kBlocksPer), in reverse order.
    auto table_of = [&](int s) {
      std::vector<double> t;
      for (int b = 0; b < kBlocksPer; ++b) t.push_back((s + 1) * kBlocksPer - 1 - b);
      return from_host({one, table}, t, {.dtype = DType::int32, .backend = be});
    };
    auto slot_of = [&](int s, int64_t pos) {
      return (static_cast<double>((s + 1) * kBlocksPer - 1 - pos / kBlock)) * kBlock + static_cast<double>(pos % kBlock);
    };
    // Step i of sequence s: its new key, value and query.
    auto operand = [&](const Dims& dims, int s, int i, int which) {
      return random_normal(dims, static_cast<uint64_t>(1000 * s + 3 * i + which), f32);
    };
    // Runs sequence s's steps on pools that hold its first kStart positions.
    auto decode = [&](const PagedKvCache& pools, int s) {
      const PagedKvCache mine{pools.keys, pools.values, block, slot, table_of(s), table};
      std::vector<std::vector<double>> outs;
      TraceScope trace(false);
      for (int i = 0; i < kSteps; ++i) {
        const int64_t pos = kStart + i;
        kv_cache_append(mine, operand({token, kv_heads, feat}, s, i, 0), operand({token, kv_heads, feat}, s, i, 1),
                        from_host({token}, {slot_of(s, pos)}, i64));
        const Tensor out = kv_cache_attention(operand({one, kv_heads, group, feat}, s, i, 2), mine,
                                              {.key_dim = feat, .lengths = from_host({one}, {static_cast<double>(pos + 1)}, i64)});
        outs.push_back(to_host(out, Dims{one, kv_heads, group, feat}));
        if (trace.records().back().kernel != "cpu_flash") outs.back().clear();  // not in place: fails below
      }
      return outs;
    };
    auto fresh_pools = [&] {
      const Dims pool{block, slot, kv_heads, feat};
      const PagedKvCache p{random_normal(pool, 1, f32), random_normal(pool, 2, f32), block, slot, table_of(0), table};
      return p;
    };

    std::vector<std::vector<std::vector<double>>> want;
    {
      const PagedKvCache pools = fresh_pools();
      for (int s = 0; s < kSeqs; ++s) want.push_back(decode(pools, s));
    }
    const PagedKvCache pools = fresh_pools();
    std::vector<std::vector<std::vector<double>>> got(kSeqs);
    std::vector<std::thread> threads;
    for (int s = 0; s < kSeqs; ++s) threads.emplace_back([&, s] { got[s] = decode(pools, s); });
    for (auto& th : threads) th.join();
    for (int s = 0; s < kSeqs; ++s) {
      ASSERT_EQ(got[s].size(), static_cast<size_t>(kSteps)) << be;
      for (int i = 0; i < kSteps; ++i)
        ASSERT_TRUE(got[s][i].size() == 2 * 4 * 64 && want[s][i].size() == got[s][i].size())
            << be << " sequence " << s << " step " << i << ": not read in place by cpu_flash";
      for (int i = 0; i < kSteps; ++i)
        EXPECT_EQ(std::memcmp(got[s][i].data(), want[s][i].data(), got[s][i].size() * sizeof(double)), 0)
            << be << " sequence " << s << " step " << i;
    }
  }
}

}  // namespace
}  // namespace dimattn
