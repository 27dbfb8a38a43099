// Dispatch overhead: dot_attention on the fast path vs calling the same ATen
// kernel directly on the same raw tensors (T = 32, where overhead shows).
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu.h>
#include <benchmark/benchmark.h>

#include "dimattn/attention.h"
#include "dimattn/forcing.h"
#include "dimattn/ops.h"
#include "dimattn/torch_interop.h"

namespace {
using namespace dimattn;

struct Inputs {
  Dim batch{"batch", 8}, heads{"heads", 8}, time{"time", 32}, feat{"feat", 64};
  Tensor q = random_normal({batch, heads, time, feat}, 1, {.backend = "torch"});
  Tensor k = random_normal({batch, heads, time, feat}, 2, {.backend = "torch"});
  Tensor v = random_normal({batch, heads, time, feat}, 3, {.backend = "torch"});
};

void BM_DotAttentionFastPath(benchmark::State& state) {
  Inputs in;
  ForceKernels force("aten_flash_cpu");
  AttentionOptions opts{.key_dim = in.feat, .axis = in.time};
  for (auto _ : state) benchmark::DoNotOptimize(dot_attention(in.q, in.k, in.v, opts).raw());
}
BENCHMARK(BM_DotAttentionFastPath)->Unit(benchmark::kMicrosecond)->UseRealTime();

void BM_AtenKernelDirect(benchmark::State& state) {
  Inputs in;
  const at::Tensor &q = to_aten(in.q), &k = to_aten(in.k), &v = to_aten(in.v);
  for (auto _ : state)
    benchmark::DoNotOptimize(std::get<0>(at::_scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, false)));
}
BENCHMARK(BM_AtenKernelDirect)->Unit(benchmark::kMicrosecond)->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
