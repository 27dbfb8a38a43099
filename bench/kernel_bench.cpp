// Kernel-level attention benchmark (issue 5, DESIGN.md §9).
//
// In one run, side by side on the same operands and thread count:
//   ours  dimattn's CPU kernel, kernels::flash_attention_{forward,backward}_cpu
//         called with AttentionKernelParams, on at::parallel_for (the pool the
//         torch backend runs it on) or, with --pool=own, on kernels::ThreadPool;
//   aten  LibTorch's at::_scaled_dot_product_flash_attention_for_cpu and its
//         _backward;
//   ref   dimattn::dot_attention on the torch backend forced to "reference"
//         (ForceKernels), backward through ATen autograd; only up to --ref-max-T
//         because it materialises the [B, H, T, T] weights;
// plus the machine's fp32 GEMM rate (at::mm, same threads): n = 2048 before
// and after the grid, and n = 1024 timed in every configuration's rounds,
// which is what %GEMM divides by (the machine may be shared: the rate of the
// moment, not of the start).
//
// Timing: per configuration every variant runs once as warm-up, then in
// rounds that run every variant once each (interleaved, so that load from
// other processes hits all variants alike); the figure is the median over the
// rounds. A variant whose warm-up call took longer than --single-run seconds is
// not repeated: its warm-up time is its figure (listed as "once" in the reps
// column).
//
// FLOPs (DESIGN.md §9): forward 4·B·H·T²·D, halved for causal; backward 2.5x
// that; forward+backward 3.5x.
//
// --memory runs T = 32768, B·H = 8, D = 64, float32 forward of each
// implementation in a fresh child process, which resets its peak RSS
// (/proc/self/clear_refs) after creating inputs and outputs and reports the
// peak growth during the forward call.
//
// The parts: kernel_bench.h lists them; bench_util.h has the clocks, tables
// and JSON helpers other bench programs share.
#include <ATen/Parallel.h>
#include <torch/version.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernel_bench.h"

namespace dimattn::bench::kernel_bench {
namespace {

// ---------------------------------------------------------------------------
// Options

const char* kUsage =
    "usage: kernel_bench [options]\n"
    "  --threads=N         threads for every implementation and the GEMM (default 2)\n"
    "  --T=a,b,...         sequence lengths (default 128,512,1024,4096)\n"
    "  --D=a,b             head dims (default 64,128)\n"
    "  --dtype=LIST        float32,bfloat16 (default both)\n"
    "  --causal=LIST       0,1 (default both)\n"
    "  --isa=LIST          our kernel's code paths to time side by side: best, generic, avx2,\n"
    "                      avx512, avx512_bf16 (default best: DIMATTN_CPU_ISA or the CPU's best)\n"
    "  --batch=B --heads=H batch and heads (default 1 and 16: B*H = 16)\n"
    "  --no-backward       forward only\n"
    "  --no-ref            skip the reference path\n"
    "  --window=N          causal configurations: also time ours with a window of N past positions\n"
    "                      (forward; its time ratio against full causal vs its FLOP ratio)\n"
    "  --softcap=C         also time ours with soft-capping at C (forward and backward on the first\n"
    "                      --isa path; its time ratio against the plain run)\n"
    "  --ref-max-T=N       reference path only for T <= N (default 1024)\n"
    "  --pool=aten|own     pool for our kernel: at::parallel_for (default) or kernels::ThreadPool\n"
    "  --clock=wall|cpu    time by wall clock (default) or by the process's CPU time: with\n"
    "                      --threads=1, GFLOP per CPU-second, robust to other load on the machine\n"
    "  --budget=S          seconds of timed rounds per configuration (default 3)\n"
    "  --min-reps=N --max-reps=N   timed rounds per configuration (default 3, 25)\n"
    "  --single-run=S      a variant whose warm-up took > S seconds is not repeated (default 10)\n"
    "  --gemm=N            fp32 GEMM size before and after the grid, 0 = skip (default 2048)\n"
    "  --gemm-round=N      fp32 GEMM size timed in each configuration's rounds, the %GEMM\n"
    "                      denominator, 0 = use the --gemm figures (default 1024)\n"
    "  --quick             smoke subset: T=128,512, D=64, budget 0.3 s, 2-5 reps, GEMM 1024 and 512\n"
    "  --json=PATH         also write the results as JSON\n"
    "  --memory            peak memory of the T=32768, B*H=8, D=64 float32 forward, each\n"
    "                      implementation in a fresh child process (no grid)\n"
    "  --memory-T=N --memory-bh=N --memory-D=N   its size\n"
    "  --memory-no-aten    measure ours only\n"
    "  --memory-bias       also ours with a float32 bias over {heads, T, T} and over {T, T}\n";

}  // namespace

[[noreturn]] void usage_error(const std::string& msg) {
  std::fprintf(stderr, "kernel_bench: %s\n%s", msg.c_str(), kUsage);
  std::exit(2);
}

namespace {

Options parse(int argc, char** argv) {
  Options o;
  bool quick = false;
  std::vector<std::string> args(argv + 1, argv + argc);
  // --quick first, so that explicit options override its choices.
  for (const std::string& a : args)
    if (a == "--quick") quick = true;
  if (quick) {
    o.T = {128, 512};
    o.D = {64};
    o.budget_s = 0.3;
    o.min_reps = 2;
    o.max_reps = 5;
    o.gemm_n = 1024;
    o.gemm_round_n = 512;
  }
  for (const std::string& a : args) {
    std::optional<std::string> v;
    try {
      if (a == "--quick") continue;
      if (a == "--help" || a == "-h") {
        std::fputs(kUsage, stdout);
        std::exit(0);
      }
      if (a == "--no-backward") o.backward = false;
      else if (a == "--no-ref") o.reference = false;
      else if (a == "--memory") o.memory = true;
      else if (a == "--memory-no-aten") o.mem_aten = false;
      else if (a == "--memory-bias") o.mem_bias = true;
      else if ((v = value_of(a, "--threads"))) o.threads = std::stoi(*v);
      else if ((v = value_of(a, "--T"))) o.T = split_ints(*v);
      else if ((v = value_of(a, "--D"))) o.D = split_ints(*v);
      else if ((v = value_of(a, "--dtype"))) o.dtypes = split(*v);
      else if ((v = value_of(a, "--causal"))) o.causal = split_ints(*v);
      else if ((v = value_of(a, "--isa"))) o.isas = split(*v);
      else if ((v = value_of(a, "--batch"))) o.batch = std::stoll(*v);
      else if ((v = value_of(a, "--heads"))) o.heads = std::stoll(*v);
      else if ((v = value_of(a, "--ref-max-T"))) o.ref_max_T = std::stoll(*v);
      else if ((v = value_of(a, "--window"))) o.window = std::stoll(*v);
      else if ((v = value_of(a, "--softcap"))) o.softcap = std::stod(*v);
      else if ((v = value_of(a, "--pool"))) {
        if (*v != "aten" && *v != "own") usage_error("--pool is aten or own, got " + *v);
        o.own_pool = *v == "own";
      } else if ((v = value_of(a, "--clock"))) {
        if (*v != "wall" && *v != "cpu") usage_error("--clock is wall or cpu, got " + *v);
        o.cpu_clock = *v == "cpu";
      } else if ((v = value_of(a, "--budget"))) o.budget_s = std::stod(*v);
      else if ((v = value_of(a, "--min-reps"))) o.min_reps = std::stoi(*v);
      else if ((v = value_of(a, "--max-reps"))) o.max_reps = std::stoi(*v);
      else if ((v = value_of(a, "--single-run"))) o.single_run_s = std::stod(*v);
      else if ((v = value_of(a, "--gemm-round"))) o.gemm_round_n = std::stoll(*v);
      else if ((v = value_of(a, "--gemm"))) o.gemm_n = std::stoll(*v);
      else if ((v = value_of(a, "--json"))) o.json = *v;
      else if ((v = value_of(a, "--memory-T"))) o.mem_T = std::stoll(*v);
      else if ((v = value_of(a, "--memory-bh"))) o.mem_bh = std::stoll(*v);
      else if ((v = value_of(a, "--memory-D"))) o.mem_D = std::stoll(*v);
      else if ((v = value_of(a, "--memory-child"))) o.memory_child = *v;
      else usage_error("unknown option " + a);
    } catch (const std::logic_error&) {  // stoi and friends
      usage_error("bad value in " + a);
    }
  }
  for (const std::string& d : o.dtypes)
    if (d != "float32" && d != "bfloat16") usage_error("--dtype takes float32 and bfloat16, got " + d);
  for (int64_t c : o.causal)
    if (c != 0 && c != 1) usage_error("--causal takes 0 and 1");
  for (const std::string& isa : o.isas) {
    try {
      if (isa != "best") k::cpu_isa_from_name(isa, k::cpu_features(), "--isa");
    } catch (const std::invalid_argument& e) {
      usage_error(e.what());
    }
  }
  if (!(o.softcap >= 0)) usage_error("--softcap must be >= 0 (0 = off)");
  if (o.threads < 1 || o.min_reps < 1 || o.max_reps < o.min_reps || o.batch < 1 || o.heads < 1)
    usage_error("--threads, --min-reps, --batch, --heads must be >= 1 and --max-reps >= --min-reps");
  return o;
}

}  // namespace

// ---------------------------------------------------------------------------
// Output shared by the modes

void write_json_header(std::ofstream& f, const RunInfo& info) {
  f << "{\n  \"command\": " << json_string(info.command) << ",\n  \"cpu\": " << json_string(info.cpu)
    << ",\n  \"cpu_flags\": " << json_string(info.flags) << ",\n  \"date\": " << json_string(info.date)
    << ",\n  \"torch\": " << json_string(TORCH_VERSION) << ",\n  \"threads\": " << info.threads
    << ",\n  \"clock\": " << json_string(info.clock) << ",\n  \"ours_isa\": " << json_string(info.isa) << ",\n  \"ours_pool\": " << json_string(info.pool)
    << ",\n  \"load_before\": " << json_string(info.load_before) << ",\n  \"load_after\": " << json_string(info.load_after)
    << ",\n  \"wall_s\": " << json_number(info.wall_s);
}

}  // namespace dimattn::bench::kernel_bench

int main(int argc, char** argv) {
  using namespace dimattn::bench;
  using namespace dimattn::bench::kernel_bench;
  const Options o = parse(argc, argv);
  at::set_num_threads(o.threads);
  if (!o.memory_child.empty()) return memory_child(o);
  use_cpu_clock(o.cpu_clock);

  RunInfo info;
  for (int i = 0; i < argc; ++i) info.command += std::string(i ? " " : "") + argv[i];
  info.cpu = cpu_model();
  info.flags = cpu_flags();
  info.date = today();
  info.threads = at::get_num_threads();
  try {
    info.isa = k::cpu_isa_name(k::cpu_flash_best_isa());
  } catch (const std::invalid_argument& e) {  // DIMATTN_CPU_ISA unknown or beyond this CPU
    usage_error(e.what());
  }
  info.pool = o.own_pool ? "kernels::ThreadPool" : "at::parallel_for";
  info.clock = o.cpu_clock ? "process CPU" : "wall";
  info.load_before = load_average();
  info.gemm_n = o.gemm_n;
  info.gemm_round_n = o.gemm_round_n;
  std::printf("kernel_bench: %s\nCPU: %s (%ld online), flags: %s; %s\ntorch %s, %d threads; ours: isa %s on %s\n"
              "load average before: %s\n",
              info.command.c_str(), info.cpu.c_str(), sysconf(_SC_NPROCESSORS_ONLN), info.flags.c_str(),
              info.date.c_str(), TORCH_VERSION, info.threads, info.isa.c_str(), info.pool.c_str(),
              info.load_before.c_str());
  if (o.memory) return memory_mode(o, info);
  return grid_mode(o, info);
}
