// The machine's own limits, which the benchmarks' figures are set against
// (DESIGN.md §9; dimattn/testing/machine_peak.h measures them): float32 FMA
// throughput (AVX2 and AVX-512 where the CPU has them), bfloat16 dot-product
// throughput (AVX512_BF16's vdpbf16ps), and read bandwidth, each on 1 thread
// and on every thread. Prints a markdown table.
//
//   peak_probe [--threads=N] [--json=PATH]
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "dimattn/testing/json.h"
#include "dimattn/testing/machine_peak.h"

namespace t = dimattn::testing;

int main(int argc, char** argv) {
  int threads = static_cast<int>(std::thread::hardware_concurrency());
  std::string json;
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--threads=", 10) == 0 && std::atoi(argv[i] + 10) >= 1) {
      threads = std::atoi(argv[i] + 10);
    } else if (std::strncmp(argv[i], "--json=", 7) == 0) {
      json = argv[i] + 7;
    } else {
      std::fprintf(stderr, "usage: peak_probe [--threads=N (>= 1)] [--json=PATH]\n");
      return 2;
    }
  }
  struct Row {
    std::string what, unit;
    double one, all;
  };
  std::vector<Row> rows;
  auto add = [&](const char* what, const char* unit, double (*measure)(int)) {
    const double one = measure(1);
    if (one > 0) rows.push_back({what, unit, one, measure(threads)});
  };
  add("float32 FMA, AVX2 (ymm)", "GFLOP/s", [](int n) { return t::fma_f32_gflops("avx2", n); });
  add("float32 FMA, AVX-512 (zmm)", "GFLOP/s", [](int n) { return t::fma_f32_gflops("avx512", n); });
  add("bfloat16 dot, AVX512_BF16 (vdpbf16ps)", "GFLOP/s", [](int n) { return t::dot_bf16_gflops(n); });
  add("read bandwidth (vector sum, 512 MiB per thread)", "GB/s", [](int n) { return t::read_gbps(n); });
  std::printf("| limit | 1 thread | %d threads | unit |\n|---|---|---|---|\n", threads);
  for (const Row& r : rows) std::printf("| %s | %.1f | %.1f | %s |\n", r.what.c_str(), r.one, r.all, r.unit.c_str());
  if (!json.empty()) {
    std::ofstream f(json);
    f << "{\"threads\": " << threads << ", \"limits\": [";
    for (size_t i = 0; i < rows.size(); ++i)
      f << (i ? ", " : "") << "{\"what\": " << t::json_string(rows[i].what) << ", \"unit\": "
        << t::json_string(rows[i].unit) << ", \"one_thread\": " << t::json_number(rows[i].one)
        << ", \"all_threads\": " << t::json_number(rows[i].all) << "}";
    f << "]}\n";
    if (!f) {
      std::fprintf(stderr, "peak_probe: cannot write %s\n", json.c_str());
      return 1;
    }
  }
  return 0;
}
