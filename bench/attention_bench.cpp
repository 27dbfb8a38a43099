// Reference path vs fast path of dot_attention, side by side in one run, and
// the cost of a selection-cache hit; docs/perf-log.md records the ratios.
//
//   build/bench/attention_bench --benchmark_format=json --benchmark_out=att.json
#include <benchmark/benchmark.h>

#include "dimattn/attention.h"
#include "dimattn/forcing.h"
#include "dimattn/ops.h"
#include "dimattn/ext/backend.h"
#include "dimattn/registry.h"
#include "dimattn/selection.h"
#include "dimattn/testing/cases.h"

namespace {
using namespace dimattn;

// The paths compared: forced kernels, and what selection picks.
const char* const kPaths[] = {"reference", "aten_flash_cpu", "cpu_flash", "auto"};

// args: T, causal (0/1), dtype (0 float32, 1 bfloat16), path (index into kPaths)
void BM_SelfAttention(benchmark::State& state) {
  const int64_t T = state.range(0);
  const bool causal = state.range(1) != 0;
  const DType dtype = state.range(2) ? DType::bfloat16 : DType::float32;
  const char* path = kPaths[state.range(3)];
  const testing::AttentionCase c{.dtype = dtype, .kind = testing::Kind::self, .batch = 8, .heads = 8, .seq_q = T,
                                 .seq_k = T, .head_dim = 64, .head_dim_v = 64, .causal = causal};
  const testing::Operands ops = testing::make_operands(c);
  ForceKernels force(path);
  for (auto _ : state) {
    Tensor out = dot_attention(ops.q, ops.k, ops.v, ops.opts);
    benchmark::DoNotOptimize(out.raw());
  }
  state.counters["GFLOP/s"] = benchmark::Counter(c.flops() * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.SetLabel(std::string(path) + " -> " + explain_attention(ops.q, ops.k, ops.v, ops.opts).kernel);
}
BENCHMARK(BM_SelfAttention)
    ->ArgNames({"T", "causal", "bf16", "path"})
    ->ArgsProduct({{32, 1024}, {0, 1}, {0, 1}, {0, 1, 2, 3}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

// A lookup whose decision is cached: what every call after the first pays.
void BM_SelectionCacheHit(benchmark::State& state) {
  const KernelTable table = {
      {.name = "aten_flash_cpu", .device = DeviceType::cpu, .gate = [](const AttentionParams&) { return GateResult::pass(); }},
      reference_entry(DeviceType::cpu)};
  AttentionParams p;
  p.head_dim_qk = p.head_dim_v = 64;
  p.forced = "auto";
  select_kernel("bench", p, table, KernelUse::run);
  for (auto _ : state) benchmark::DoNotOptimize(select_kernel("bench", p, table, KernelUse::run).kernel.size());
}
BENCHMARK(BM_SelectionCacheHit);

// Forming the params of a call (what the fast path does before the lookup).
void BM_SelectionFromCall(benchmark::State& state) {
  const testing::Operands ops = testing::make_operands(
      {.kind = testing::Kind::self, .batch = 8, .heads = 8, .seq_q = 32, .seq_k = 32, .head_dim = 64, .head_dim_v = 64});
  const Tensor& x = ops.q;  // one tensor as q, k and v, as docs/perf-log.md's figures were measured
  for (auto _ : state) benchmark::DoNotOptimize(explain_attention(x, x, x, ops.opts).kernel.size());
}
BENCHMARK(BM_SelectionFromCall);

}  // namespace

BENCHMARK_MAIN();
