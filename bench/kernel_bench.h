#pragma once
// kernel_bench's parts (see kernel_bench.cpp for what it measures): the
// command line and main (kernel_bench.cpp), the operands both modes build
// (kernel_bench_problem.cpp), the timed grid (kernel_bench_grid.cpp) and
// the memory mode (kernel_bench_memory.cpp).
#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>
#include <fstream>
#include <string>
#include <vector>

#include "bench_util.h"
#include "cpu/flash_attention.h"

namespace dimattn::bench::kernel_bench {

namespace k = dimattn::kernels;

// ---------------------------------------------------------------------------
// Options (kernel_bench.cpp)

struct Options {
  int threads = 2;
  std::vector<int64_t> T = {128, 512, 1024, 4096};
  std::vector<int64_t> D = {64, 128};
  std::vector<std::string> dtypes = {"float32", "bfloat16"};
  std::vector<int64_t> causal = {0, 1};
  // Our kernel's code paths, each timed side by side (cpu_isa.h names; "best"
  // = DIMATTN_CPU_ISA or the CPU's best). A path a dtype does not run
  // (avx512_bf16 for float32 runs avx512's code) is timed once per row.
  std::vector<std::string> isas = {"best"};
  int64_t batch = 1, heads = 16;  // B·H = 16
  bool backward = true;           // also time the backward pass
  bool reference = true;
  int64_t ref_max_T = 1024;
  int64_t window = 0;  // > 0: also time ours with a causal window of this many past positions
  double softcap = 0;  // > 0: also time ours with this soft-cap (forward and backward)
  bool own_pool = false;
  bool cpu_clock = false;  // process CPU time instead of wall time
  double budget_s = 3.0;    // timed rounds per configuration, in seconds (estimate)
  int min_reps = 3, max_reps = 25;
  double single_run_s = 10.0;
  int64_t gemm_n = 2048;        // 0: no GEMM
  int64_t gemm_round_n = 1024;  // GEMM timed in every round of a configuration; 0: none
  std::string json;
  bool memory = false;
  int64_t mem_T = 32768, mem_bh = 8, mem_D = 64;
  bool mem_aten = true;
  bool mem_bias = false;     // also ours with a float32 bias over {heads, Tq, Tk} and over {Tq, Tk}
  std::string memory_child;  // internal: "ours", "ours-bias-htk", "ours-bias-tk" or "aten"
};

// Prints msg and the usage to stderr and exits with status 2.
[[noreturn]] void usage_error(const std::string& msg);

// What the output records about the run (DESIGN.md §9).
struct RunInfo {
  std::string command, cpu, flags, date, load_before, load_after, pool, clock;
  std::string isa;  // what "best" resolves to in this process
  int threads = 0;
  double gemm_before = NAN, gemm_after = NAN;
  double peak_float32 = NAN, peak_bfloat16 = NAN;  // the machine's arithmetic peaks (machine_peak.h), GFLOP/s
  int64_t gemm_n = 0, gemm_round_n = 0;
  double wall_s = 0;
};

// The fields every JSON file opens with, up to "wall_s" (no closing brace).
void write_json_header(std::ofstream& f, const RunInfo& info);

// ---------------------------------------------------------------------------
// Operands (kernel_bench_problem.cpp)

// q, k, v, dout of [B, H, T, D] and our kernel's outputs, with its params.
struct Problem {
  at::Tensor q, k, v, dout;
  at::Tensor out, lse, dq, dk, dv;
  k::AttentionKernelParams p;
};

Problem make_problem(int64_t B, int64_t H, int64_t T, int64_t D, at::ScalarType dt, bool causal, bool backward);

// Runs our kernel as the torch backend does: on at::parallel_for.
k::ParallelFor aten_parallel_for();

// ---------------------------------------------------------------------------
// The modes; each returns the exit status.

// The timed grid (kernel_bench_grid.cpp): 1 when an implementation
// disagrees with ATen beyond tolerance.
int grid_mode(const Options& o, RunInfo info);
// --memory (kernel_bench_memory.cpp): runs memory_child in fresh processes.
int memory_mode(const Options& o, RunInfo info);
// --memory-child=ours|ours-bias-htk|ours-bias-tk|aten: one measurement, printed as a "MEMORY ..." line.
int memory_child(const Options& o);

}  // namespace dimattn::bench::kernel_bench
