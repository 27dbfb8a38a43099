// The dual-implementation harness: every attention case, written once as
// data, runs on every eligible kernel of every backend and is compared with
// the reference path on the same backend — outputs, and gradients of q, k and
// v where the backend has autograd. A kernel that rejects a case is listed
// with its reason (printed, and checked to be non-empty), never skipped
// silently.
#include <cmath>
#include <iostream>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include "dimattn/tolerance.h"
#include "dimattn/attention.h"
#include "dimattn/backend.h"
#include "dimattn/forcing.h"
#include "dimattn/run_context.h"
#include "dimattn/selection.h"
#include "tests/common/test_util.h"

namespace dimattn {
namespace {
using testing::error_of;

struct DualCase {
  std::string name;
  DType dtype = DType::float32;
  int64_t B = 2, H = 2, G = 1, Tq = 5, Tk = 7, D = 8, Dv = 8;
  bool causal = false;
  bool self = false;             // axis in the query (Tq == Tk)
  bool single_step = false;      // query without a spatial dim
  std::vector<double> lengths;   // kv lengths per batch entry; empty = static
  bool beam_and_time = false;    // G is a beam dim and the query keeps its time dim
  double dropout = 0;            // with the train flag on, a fixed seed per run
  bool broadcast_dropout = false;
};


std::vector<DualCase> cases() {
  std::vector<DualCase> out;
  for (DType dt : {DType::float32, DType::float64, DType::bfloat16}) {
    const std::string s = std::string("_") + dtype_name(dt);
    out.push_back({.name = "self" + s, .dtype = dt, .Tq = 9, .Tk = 9, .self = true});
    out.push_back({.name = "causal" + s, .dtype = dt, .Tq = 9, .Tk = 9, .causal = true, .self = true});
    out.push_back({.name = "cross_lengths" + s, .dtype = dt, .lengths = {7, 3}});
    out.push_back({.name = "causal_lengths" + s, .dtype = dt, .Tq = 7, .Tk = 7, .causal = true, .self = true,
                   .lengths = {7, 4}});
    out.push_back({.name = "gqa" + s, .dtype = dt, .H = 2, .G = 4, .Tq = 6, .Tk = 6});
    out.push_back({.name = "gqa_causal" + s, .dtype = dt, .H = 2, .G = 4, .Tq = 6, .Tk = 6, .causal = true});
    out.push_back({.name = "gqa_causal_lengths" + s, .dtype = dt, .H = 2, .G = 2, .Tq = 6, .Tk = 6, .causal = true,
                   .self = true, .lengths = {6, 3}});
    out.push_back({.name = "mqa" + s, .dtype = dt, .H = 1, .G = 8, .Tq = 5, .Tk = 9});
    out.push_back({.name = "beam_cross" + s, .dtype = dt, .G = 3, .Tq = 4, .lengths = {7, 5}, .beam_and_time = true});
    out.push_back({.name = "single_step" + s, .dtype = dt, .Tq = 1, .single_step = true, .lengths = {7, 2}});
    out.push_back({.name = "dropout" + s, .dtype = dt, .Tq = 9, .Tk = 9, .causal = true, .self = true,
                   .lengths = {9, 5}, .dropout = 0.3});
    out.push_back({.name = "dropout_gqa" + s, .dtype = dt, .G = 2, .Tq = 6, .Tk = 6, .dropout = 0.2});
    out.push_back({.name = "broadcast_dropout" + s, .dtype = dt, .lengths = {7, 4}, .dropout = 0.5,
                   .broadcast_dropout = true});
  }
  out.push_back({.name = "t1", .Tq = 1, .Tk = 1});
  out.push_back({.name = "odd_head_dims", .D = 5, .Dv = 3});
  out.push_back({.name = "d128", .B = 1, .H = 2, .Tq = 16, .Tk = 16, .D = 128, .Dv = 128, .causal = true, .self = true});
  out.push_back({.name = "empty_entry", .lengths = {0, 7}});
  return out;
}

// The named operands of a case on one backend.
struct Operands {
  Tensor q, k, v;
  AttentionOptions opts;
  Dims out_order;
};

Operands make_operands(const DualCase& c, const std::string& backend) {
  const TensorOptions o{.dtype = c.dtype, .backend = backend};
  Dim batch("batch", c.B), heads("kv_heads", c.H), group(c.beam_and_time ? "beam" : "group", c.G);
  Dim feat("feat", c.D), vfeat("vfeat", c.Dv);
  Dim kv = c.lengths.empty()
               ? Dim("kv", c.Tk)
               : Dim::dynamic("kv", from_host({batch}, c.lengths, {.dtype = DType::int64, .backend = backend}), c.Tk);
  Dim time = c.self ? kv : Dim("time", c.Tq);
  Dims qd = {batch, heads};
  if (c.G > 1) qd.push_back(group);
  if (!c.single_step) qd.push_back(time);
  qd.push_back(feat);
  Operands ops{random_normal(qd, 1, o), random_normal({batch, heads, kv, feat}, 2, o),
               random_normal({batch, heads, kv, vfeat}, 3, o), {.key_dim = feat, .axis = kv}, {}};
  if (c.causal) ops.opts.causal_query_spatial_dim = time;
  ops.opts.att_dropout = c.dropout;
  ops.opts.att_dropout_broadcast = c.broadcast_dropout;
  for (const Dim& d : qd)
    if (d != feat) ops.out_order.push_back(d);
  ops.out_order.push_back(vfeat);
  return ops;
}

struct RunResult {
  std::string kernel;
  Tensor out;
  std::vector<Tensor> grads;  // q, k, v; empty without autograd
};

// A new leaf with x's dims and values, so that gradients never accumulate across runs.
Tensor fresh_leaf(const Tensor& x) {
  return from_host(x.dims(), to_host(x), {.dtype = x.dtype(), .device = x.device(), .backend = x.backend().name()});
}

RunResult run(Operands ops, const std::string& force) {
  ForceKernels guard(force);
  Backend& be = ops.q.backend();
  const bool grad = be.has_autograd();
  if (grad)
    for (Tensor* t : {&ops.q, &ops.k, &ops.v}) *t = fresh_leaf(*t).requires_grad(true);
  // Every run draws the same dropout seed, so kernels and the reference must
  // apply the identical mask (the shared Philox stream).
  TrainFlagScope train(ops.opts.att_dropout > 0);
  set_random_seed(1234);
  Tensor out = dot_attention(ops.q, ops.k, ops.v, ops.opts);
  RunResult r{force, out, {}};
  if (grad) {
    // Weights drawn in one dim order for every run: kernels may order dims differently.
    Tensor w = random_normal(ops.out_order, 99, {.dtype = out.dtype(), .backend = be.name()});
    reduce_sum(mul(out, w), ops.out_order).backward();
    for (Tensor* t : {&ops.q, &ops.k, &ops.v}) r.grads.push_back(*t->grad());
  }
  return r;
}

class Dual : public ::testing::TestWithParam<DualCase> {};

TEST_P(Dual, EveryKernelAgreesWithTheReference) {
  const DualCase& c = GetParam();
  for (const std::string& backend : backend_names()) {
    const Operands ops = make_operands(c, backend);
    const RunResult ref = run(ops, "reference");
    const double tol = reference_tolerance(c.dtype);
    for (const std::string& kernel : get_backend(backend).attention_kernels(kCPU)) {
      if (kernel == "reference") continue;
      std::optional<RunResult> got;
      const std::string err = error_of([&] { got = run(ops, kernel); });
      if (!err.empty()) {
        EXPECT_NE(err.find("[dot_attention]"), std::string::npos) << err;
        // The kernel's own reason, from the decision with it first in line.
        std::string reason = err;
        {
          ForceKernels force(kernel + ",reference");
          TrainFlagScope train(ops.opts.att_dropout > 0);
          for (const Rejection& r : explain_attention(ops.q, ops.k, ops.v, ops.opts).rejected)
            if (r.kernel == kernel) reason = r.reason;
        }
        std::cout << "[ dual ] " << c.name << " " << backend << "/" << kernel << ": rejected: " << reason << "\n";
        continue;
      }
      const double e = testing::max_abs_diff(got->out, ref.out, ops.out_order);
      std::cout << "[ dual ] " << c.name << " " << backend << "/" << kernel << ": max abs err " << e << "\n";
      EXPECT_LE(e, tol) << c.name << " " << backend << "/" << kernel;
      for (size_t i = 0; i < got->grads.size(); ++i) {
        const Tensor& g = got->grads[i];
        const double ge = testing::max_abs_diff(g, ref.grads[i], g.dims());
        EXPECT_LE(ge, 2 * tol) << c.name << " " << backend << "/" << kernel << " grad of " << "qkv"[i];
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, Dual, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<DualCase>& i) { return i.param.name; });

// q, k and v split from one fused [T, B, Hq + 2*Hkv, D] buffer (GQA, 16 query
// heads, one kv head): a kernel that took the layout from a label rather than
// the strides once gave a max error of 6.19 here.
TEST(DualLayouts, FusedGqaBufferSplitIntoQkv) {
  for (const std::string& backend : backend_names()) {
    Dim time("time", 2048), batch("batch", 1), all_heads("heads", 18), feat("feat", 64);
    Dim q_heads("q_heads", 16), kv_heads("kv_heads", 1);
    Tensor buffer = random_normal({time, batch, all_heads, feat}, 7, {.backend = backend});
    Tensor q = slice(buffer, all_heads, 0, 16, q_heads).first;
    Tensor k = slice(buffer, all_heads, 16, 17, kv_heads).first;
    Tensor v = slice(buffer, all_heads, 17, 18, kv_heads).first;
    for (bool causal : {false, true}) {
      AttentionOptions o{.key_dim = feat, .axis = time};
      if (causal) o.causal_query_spatial_dim = time;
      const uint64_t copies_before = selection_stats().layout_copies;
      Tensor fast = dot_attention(q, k, v, o);
      EXPECT_EQ(selection_stats().layout_copies, copies_before) << "q, k and v reach the kernel as views";
      const Decision d = explain_attention(q, k, v, o);
      Tensor ref = [&] {
        ForceKernels force("reference");
        return dot_attention(q, k, v, o);
      }();
      const double e = testing::max_abs_diff(fast, ref, {time, batch, kv_heads, q_heads, feat});
      std::cout << "[ dual ] fused GQA buffer, " << backend << ", causal " << causal << ": " << d.explain()
                << "\n  max abs err " << e << "\n";
      EXPECT_LE(e, 1e-5);
    }
  }
}

TEST(DualSelection, OneSelectionPerDistinctKeyOver1000Calls) {
  reset_selection_cache();
  std::set<std::string> keys_seen;
  uint64_t calls = 0;
  TrainFlagScope train(true);
  for (int i = 0; i < 1000; ++i) {
    const std::string backend = backend_names()[i % backend_names().size()];
    const int64_t B = 1 + i % 4, T = 1 + (i * 7) % 13;
    std::vector<double> lens;
    for (int64_t b = 0; b < B; ++b) lens.push_back(static_cast<double>((i + b) % (T + 1)));
    Dim batch("batch", B), feat("feat", 4);
    Dim time = Dim::dynamic("time", from_host({batch}, lens, {.dtype = DType::int64, .backend = backend}), T);
    const DType dt = i % 3 == 0 ? DType::float64 : DType::float32;
    Tensor x = random_normal({batch, time, feat}, static_cast<uint64_t>(i), {.dtype = dt, .backend = backend});
    AttentionOptions o{.key_dim = feat, .axis = time, .att_dropout = i % 5 == 0 ? 0.1 : 0.0};
    if (i % 2) o.causal_query_spatial_dim = time;
    dot_attention(x, x, x, o);
    ++calls;
    keys_seen.insert(backend + (i % 3 == 0 ? "f64" : "f32") + (i % 2 ? "c" : "n") + (i % 5 == 0 ? "d" : ""));
  }
  const SelectionStats s = selection_stats();
  EXPECT_EQ(s.lookups, calls);
  EXPECT_EQ(s.selections, s.entries);
  EXPECT_EQ(s.entries, keys_seen.size()) << "batch sizes, lengths and seeds must not be part of the key";
}

TEST(DualConcurrency, EightThreadsWithMixedConfigsAndForcing) {
  struct Config {
    std::string backend, force;
    bool causal;
  };
  std::vector<Config> configs;
  for (const std::string& b : backend_names())
    for (const std::string& k : get_backend(b).attention_kernels(kCPU))
      for (bool causal : {false, true}) configs.push_back({b, k, causal});
  Dim batch("batch", 2), time("time", 16), feat("feat", 8);
  auto compute = [&](const Config& c) {
    ForceKernels force(c.force);
    Tensor x = random_normal({batch, time, feat}, 5, {.backend = c.backend});
    AttentionOptions o{.key_dim = feat, .axis = time};
    if (c.causal) o.causal_query_spatial_dim = time;
    return to_host(dot_attention(x, x, x, o), Dims{batch, time, feat});
  };
  std::vector<std::vector<double>> expected;
  for (const Config& c : configs) expected.push_back(compute(c));
  const SelectionStats before = selection_stats();
  std::atomic<int> mismatches{0};
  std::vector<std::thread> threads;
  constexpr int kThreads = 8, kCalls = 100;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&, t] {
      for (int i = 0; i < kCalls; ++i) {
        const size_t c = static_cast<size_t>(t * 31 + i) % configs.size();
        if (compute(configs[c]) != expected[c]) ++mismatches;
      }
    });
  for (auto& th : threads) th.join();
  EXPECT_EQ(mismatches.load(), 0);
  const SelectionStats after = selection_stats();
  EXPECT_EQ(after.lookups - before.lookups, static_cast<uint64_t>(kThreads * kCalls));
  EXPECT_EQ(after.selections, after.entries);
}

}  // namespace
}  // namespace dimattn
