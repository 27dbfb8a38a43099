// Dispatch overhead: dot_attention on the fast path vs calling the same ATen
// kernel directly on the same raw tensors (T = 32, where overhead shows).
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu.h>
#include <benchmark/benchmark.h>

#include "dimattn/attention.h"
#include "dimattn/forcing.h"
#include "dimattn/testing/cases.h"
#include "dimattn/torch_interop.h"

namespace {
using namespace dimattn;

// q, k, v of [batch 8, heads 8, time 32, feat 64] on the torch backend.
testing::Operands inputs() {
  return testing::make_operands({.backend = "torch", .kind = testing::Kind::self, .batch = 8, .heads = 8, .seq_q = 32,
                                 .seq_k = 32, .head_dim = 64, .head_dim_v = 64});
}

void BM_DotAttentionFastPath(benchmark::State& state) {
  const testing::Operands in = inputs();
  ForceKernels force("aten_flash_cpu");
  for (auto _ : state) benchmark::DoNotOptimize(dot_attention(in.q, in.k, in.v, in.opts).raw());
}
BENCHMARK(BM_DotAttentionFastPath)->Unit(benchmark::kMicrosecond)->UseRealTime();

void BM_AtenKernelDirect(benchmark::State& state) {
  const testing::Operands in = inputs();
  const at::Tensor &q = to_aten(in.q), &k = to_aten(in.k), &v = to_aten(in.v);
  for (auto _ : state)
    benchmark::DoNotOptimize(std::get<0>(at::_scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, false)));
}
BENCHMARK(BM_AtenKernelDirect)->Unit(benchmark::kMicrosecond)->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
