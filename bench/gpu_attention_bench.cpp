// GPU attention benchmark: dimattn's cuda_flash vs the kernel torch's SDPA
// picks vs dimattn's reference path, side by side in one run (DESIGN.md §9).
//
// Problems: B·T = 16384 tokens, H·D = 2048, D ∈ {64, 128}, T ∈ {1024, 4096,
// 16384}, bf16, causal and not, forward and forward+backward. FLOPs of a
// forward pass 4·B·H·T²·D (halved for causal), forward+backward 3.5× that.
// Each figure is the median of --reps timed runs (CUDA events on the current
// stream) after --warmup runs.
//
//   gpu_attention_bench [--json FILE] [--reps N] [--warmup N] [--reference-max-t T] [--quick]
//
// Without a CUDA device it prints why and exits 0 (so CI can build it).
#include <ATen/core/Tensor.h>
#include <ATen/ops/_fused_sdp_choice.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/scaled_dot_product_attention.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "dimattn/attention.h"
#include "dimattn/forcing.h"
#include "dimattn/ops.h"
#include "dimattn/ext/backend.h"
#include "dimattn/registry.h"
#include "dimattn/torch_interop.h"

namespace {
using namespace dimattn;

void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "gpu_attention_bench: %s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

// Median milliseconds of `reps` runs of f, each between two events.
double median_ms(const std::function<void()>& f, const std::function<void()>& before, int warmup, int reps) {
  for (int i = 0; i < warmup; ++i) {
    before();
    f();
  }
  check_cuda(cudaDeviceSynchronize(), "warm-up");
  cudaEvent_t start, stop;
  check_cuda(cudaEventCreate(&start), "cudaEventCreate");
  check_cuda(cudaEventCreate(&stop), "cudaEventCreate");
  std::vector<double> ms;
  for (int i = 0; i < reps; ++i) {
    before();
    check_cuda(cudaEventRecord(start, nullptr), "cudaEventRecord");
    f();
    check_cuda(cudaEventRecord(stop, nullptr), "cudaEventRecord");
    check_cuda(cudaEventSynchronize(stop), "cudaEventSynchronize");
    check_cuda(cudaGetLastError(), "a timed run");
    float t = 0;
    check_cuda(cudaEventElapsedTime(&t, start, stop), "cudaEventElapsedTime");
    ms.push_back(t);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

const char* sdp_backend_name(int64_t b) {
  switch (b) {
    case 0: return "math";
    case 1: return "flash";
    case 2: return "efficient";
    case 3: return "cudnn";
    default: return "other";
  }
}

struct Row {
  int64_t D, T, B, H;
  bool causal, backward;
  std::string path, kernel;
  double ms, tflops, max_err;
};

}  // namespace

int main(int argc, char** argv) {
  std::string json_path;
  int reps = 20, warmup = 3;
  int64_t reference_max_t = 4096;
  bool quick = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&] { return i + 1 < argc ? std::string(argv[++i]) : std::string(); };
    if (a == "--json") json_path = next();
    else if (a == "--reps") reps = std::max(1, std::atoi(next().c_str()));
    else if (a == "--warmup") warmup = std::max(0, std::atoi(next().c_str()));
    else if (a == "--reference-max-t") reference_max_t = std::atoll(next().c_str());
    else if (a == "--quick") quick = true;
    else {
      std::fprintf(stderr, "usage: %s [--json FILE] [--reps N] [--warmup N] [--reference-max-t T] [--quick]\n", argv[0]);
      return 2;
    }
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0 || !get_backend("torch").supports(kCUDA)) {
    std::printf("gpu_attention_bench: no CUDA device; nothing to measure\n");
    return 0;
  }
  cudaDeviceProp prop{};
  check_cuda(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  std::printf("device: %s (%d SMs)\n", prop.name, prop.multiProcessorCount);

  std::vector<Row> rows;
  const std::vector<int64_t> Ts = quick ? std::vector<int64_t>{1024, 4096} : std::vector<int64_t>{1024, 4096, 16384};
  for (int64_t D : {64, 128})
    for (int64_t T : Ts)
      for (bool causal : {false, true}) {
        const int64_t B = 16384 / T, H = 2048 / D;
        const auto opts = at::TensorOptions().dtype(at::kBFloat16).device(at::kCUDA);
        // [B, H, T, D] for every path.
        at::Tensor q = at::randn({B, H, T, D}, opts), k = at::randn({B, H, T, D}, opts),
                   v = at::randn({B, H, T, D}, opts), gout = at::randn({B, H, T, D}, opts);
        Dim batch("batch", B), heads("heads", H), time("time", T), feat("feat", D);
        const Dims dims = {batch, heads, time, feat};
        AttentionOptions ao{.key_dim = feat, .axis = time};
        if (causal) ao.causal_query_spatial_dim = time;
        const int64_t sdp = at::_fused_sdp_choice(q, k, v, std::nullopt, 0.0, causal, std::nullopt, false);
        at::Tensor sdpa_out = at::scaled_dot_product_attention(q, k, v, std::nullopt, 0.0, causal);

        for (bool backward : {false, true}) {
          const double flops = 4.0 * B * H * T * T * D * (causal ? 0.5 : 1.0) * (backward ? 3.5 : 1.0);
          for (const std::string path : {"cuda_flash", "sdpa", "reference"}) {
            if (path == "reference" && T > reference_max_t) continue;
            at::Tensor qa = q.detach().requires_grad_(backward), ka = k.detach().requires_grad_(backward),
                       va = v.detach().requires_grad_(backward);
            auto reset = [&] {
              for (at::Tensor* t : {&qa, &ka, &va})
                if (t->grad().defined()) t->mutable_grad().reset();
            };
            std::function<at::Tensor()> fwd;
            std::string kernel = path;
            if (path == "sdpa") {
              kernel = std::string("sdpa:") + sdp_backend_name(sdp);
              fwd = [&] { return at::scaled_dot_product_attention(qa, ka, va, std::nullopt, 0.0, causal); };
            } else {
              fwd = [&, path] {
                ForceKernels force(path);
                Tensor out = dot_attention(from_aten(qa, dims), from_aten(ka, dims), from_aten(va, dims), ao);
                return to_aten(out);
              };
            }
            auto run = [&] {
              at::Tensor out = fwd();
              if (backward) out.backward(gout);
            };
            double ms = 0, err = NAN;
            try {
              ms = median_ms(run, reset, warmup, path == "reference" ? std::min(reps, 5) : reps);
              if (!backward) err = fwd().detach().to(at::kFloat).sub(sdpa_out.to(at::kFloat)).abs().max().item().toDouble();
            } catch (const std::exception& e) {
              std::printf("D=%ld T=%ld causal=%d %s %s: failed: %s\n", static_cast<long>(D), static_cast<long>(T),
                          causal, backward ? "fwd+bwd" : "fwd", path.c_str(), e.what());
              continue;
            }
            rows.push_back({D, T, B, H, causal, backward, path, kernel, ms, flops / (ms * 1e-3) / 1e12, err});
            const Row& r = rows.back();
            std::printf("D=%-3ld T=%-5ld B=%-2ld H=%-2ld causal=%d %-7s %-16s %9.3f ms %7.1f TFLOP/s  max|out-sdpa| %.3g\n",
                        static_cast<long>(D), static_cast<long>(T), static_cast<long>(B), static_cast<long>(H), causal,
                        backward ? "fwd+bwd" : "fwd", r.kernel.c_str(), r.ms, r.tflops, r.max_err);
            std::fflush(stdout);
          }
        }
      }

  // The table: one line per problem, TFLOP/s of each path.
  std::printf("\n%-4s %-6s %-7s %-8s %12s %18s %12s\n", "D", "T", "causal", "pass", "cuda_flash", "sdpa", "reference");
  for (size_t i = 0; i < rows.size();) {
    size_t j = i;
    double ours = NAN, sdpa = NAN, ref = NAN;
    std::string sdpa_kernel;
    for (; j < rows.size() && rows[j].D == rows[i].D && rows[j].T == rows[i].T && rows[j].causal == rows[i].causal &&
           rows[j].backward == rows[i].backward;
         ++j) {
      if (rows[j].path == "cuda_flash") ours = rows[j].tflops;
      if (rows[j].path == "sdpa") sdpa = rows[j].tflops, sdpa_kernel = rows[j].kernel.substr(5);
      if (rows[j].path == "reference") ref = rows[j].tflops;
    }
    std::printf("%-4ld %-6ld %-7d %-8s %12.1f %11.1f %-6s %12.1f\n", static_cast<long>(rows[i].D),
                static_cast<long>(rows[i].T), rows[i].causal, rows[i].backward ? "fwd+bwd" : "fwd", ours, sdpa,
                sdpa_kernel.c_str(), ref);
    i = j;
  }

  if (!json_path.empty()) {
    std::ofstream f(json_path);
    f << "{\"device\": \"" << prop.name << "\", \"results\": [\n";
    for (size_t i = 0; i < rows.size(); ++i) {
      const Row& r = rows[i];
      f << "  {\"D\": " << r.D << ", \"T\": " << r.T << ", \"B\": " << r.B << ", \"H\": " << r.H
        << ", \"causal\": " << (r.causal ? "true" : "false") << ", \"pass\": \"" << (r.backward ? "fwd+bwd" : "fwd")
        << "\", \"path\": \"" << r.path << "\", \"kernel\": \"" << r.kernel << "\", \"median_ms\": " << r.ms
        << ", \"tflops\": " << r.tflops << ", \"max_err_vs_sdpa\": "
        << (std::isnan(r.max_err) ? std::string("null") : std::to_string(r.max_err)) << "}"
        << (i + 1 < rows.size() ? ",\n" : "\n");
    }
    f << "]}\n";
    std::printf("wrote %s\n", json_path.c_str());
  }
  return 0;
}
