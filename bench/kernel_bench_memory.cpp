// kernel_bench --memory: the peak memory of one large forward of each
// implementation, each measured in a fresh child process; with
// --memory-bias also ours with an additive bias over {heads, T, T} and one
// {T, T} plane broadcast to every head (the bias is an input: created before
// the peak is reset, so any growth is what the kernel adds).
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu.h>
#include <malloc.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "kernel_bench.h"

namespace dimattn::bench::kernel_bench {

// In a fresh process: create inputs and outputs, warm up the pool on a small
// call, reset the peak RSS, run the forward, print the peak growth.
int memory_child(const Options& o) {
  const std::string& child = o.memory_child;
  const bool ours = child.rfind("ours", 0) == 0;
  if (child != "ours" && child != "ours-bias-htk" && child != "ours-bias-tk" && child != "aten")
    usage_error("--memory-child is ours, ours-bias-htk, ours-bias-tk or aten");
  const int64_t T = o.mem_T, H = o.mem_bh, D = o.mem_D;
  {  // warm-up: thread pool, lazy initialisation
    Problem w = make_problem(1, H, 128, D, at::kFloat, false, false);
    if (ours) k::flash_attention_forward_cpu(w.p, aten_parallel_for());
    else at::_scaled_dot_product_flash_attention_for_cpu(w.q, w.k, w.v, 0.0, false);
  }
  at::manual_seed(0);
  Problem pr = make_problem(1, H, T, D, at::kFloat, false, false);
  // A bias over {heads, T, T}, or one {T, T} plane every head reads (offset 0).
  at::Tensor bias;
  std::vector<int64_t> bias_offsets(static_cast<size_t>(H), 0);
  if (child != "ours" && ours) {
    const bool per_head = child == "ours-bias-htk";
    bias = at::randn(per_head ? std::vector<int64_t>{H, T, T} : std::vector<int64_t>{T, T}) * 0.1;
    for (int64_t h = 0; h < H; ++h) bias_offsets[static_cast<size_t>(h)] = per_head ? h * T * T : 0;
    pr.p.score.bias = {bias.data_ptr(), bias_offsets.data(), T, 1};
  }
  malloc_trim(0);
  {
    std::ofstream clear("/proc/self/clear_refs");
    clear << "5";  // resets VmHWM to the current RSS
  }
  const int64_t rss0 = status_bytes("VmRSS:"), hwm0 = status_bytes("VmHWM:");
  if (hwm0 > rss0 + (4 << 20)) {
    std::fprintf(stderr, "kernel_bench: could not reset the peak RSS (VmHWM %ld > VmRSS %ld)\n",
                 static_cast<long>(hwm0), static_cast<long>(rss0));
    return 1;
  }
  at::Tensor aout, alse;
  const double t = time_call([&] {
    if (ours) k::flash_attention_forward_cpu(pr.p, aten_parallel_for());
    else std::tie(aout, alse) = at::_scaled_dot_product_flash_attention_for_cpu(pr.q, pr.k, pr.v, 0.0, false);
  });
  const int64_t peak = status_bytes("VmHWM:") - rss0;
  // Output bytes the call allocated itself (ATen returns new out and lse).
  const int64_t own_outputs = ours ? 0 : aout.nbytes() + alse.nbytes();
  const int64_t inputs = 3 * pr.q.nbytes() + (bias.defined() ? bias.nbytes() : 0),
                outputs = pr.out.nbytes() + pr.lse.nbytes();
  std::printf("MEMORY %s %ld %ld %ld %ld %.3f\n", o.memory_child.c_str(), static_cast<long>(peak),
              static_cast<long>(own_outputs), static_cast<long>(inputs), static_cast<long>(outputs), t);
  return 0;
}

int memory_mode(const Options& o, RunInfo info) {
  const double start = now_s();
  char exe[4096];
  const ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
  if (n <= 0) {
    std::fprintf(stderr, "kernel_bench: cannot find my executable\n");
    return 1;
  }
  exe[n] = 0;
  const double flops = 4.0 * o.mem_bh * o.mem_T * o.mem_T * o.mem_D;
  std::printf("\nMemory: T=%ld, B*H=%ld, D=%ld, float32 forward, non-causal, %d threads; each in a fresh process.\n",
              static_cast<long>(o.mem_T), static_cast<long>(o.mem_bh), static_cast<long>(o.mem_D), o.threads);
  std::printf("\n");
  print_table_header({"implementation", "peak RSS growth during the call", "of which outputs it allocated",
                      "beyond inputs and outputs", "goal < 256 MiB", "time s", "GFLOP/s"});
  std::vector<std::string> impls = {"ours"};
  if (o.mem_bias) impls.insert(impls.end(), {"ours-bias-htk", "ours-bias-tk"});
  if (o.mem_aten) impls.push_back("aten");
  std::string json_rows;
  bool ok = true;
  for (const std::string& impl : impls) {
    const std::string cmd = std::string("'") + exe + "' --memory-child=" + impl + " --threads=" +
                            std::to_string(o.threads) + " --memory-T=" + std::to_string(o.mem_T) +
                            " --memory-bh=" + std::to_string(o.mem_bh) + " --memory-D=" + std::to_string(o.mem_D);
    std::unique_ptr<FILE, int (*)(FILE*)> pipe(popen(cmd.c_str(), "r"), pclose);
    char line[512];
    long peak = -1, own = 0, inputs = 0, outputs = 0;
    double t = NAN;
    while (pipe && std::fgets(line, sizeof line, pipe.get()))
      if (std::sscanf(line, "MEMORY %*s %ld %ld %ld %ld %lf", &peak, &own, &inputs, &outputs, &t) == 5) break;
    if (peak < 0) {
      print_table_row({impl, "failed", "", "", "", "", ""});
      ok = false;
      continue;
    }
    const double mib = 1024.0 * 1024.0;
    const double beyond = (peak - own) / mib;
    const std::string name = impl == "ours"            ? "ours (cpu_flash)"
                             : impl == "ours-bias-htk" ? "ours, bias {heads, T, T}"
                             : impl == "ours-bias-tk"  ? "ours, bias {T, T} to every head"
                                                       : "ATen CPU flash";
    print_table_row({name, strprintf("%.1f MiB", peak / mib),
                     strprintf("%.1f MiB", own / mib), strprintf("%.1f MiB", beyond), beyond < 256 ? "met" : "not met",
                     strprintf("%.1f", t), strprintf("%.1f", flops / t / 1e9)});
    json_rows += std::string(json_rows.empty() ? "" : ",") + "\n    {\"impl\": " + json_string(impl) +
                 ", \"peak_rss_growth_bytes\": " + std::to_string(peak) + ", \"outputs_allocated_bytes\": " +
                 std::to_string(own) + ", \"beyond_inputs_outputs_bytes\": " + std::to_string(peak - own) +
                 ", \"inputs_bytes\": " + std::to_string(inputs) + ", \"outputs_bytes\": " + std::to_string(outputs) +
                 ", \"seconds\": " + json_number(t) + "}";
  }
  std::printf("\nInputs q, k, v: %.0f MiB; outputs out + lse: %.0f MiB (created before the peak is reset; ATen "
              "allocates its own outputs inside the call, subtracted in the 'beyond' column).\n",
              3.0 * o.mem_bh * o.mem_T * o.mem_D * 4 / (1024.0 * 1024.0),
              (o.mem_bh * o.mem_T * o.mem_D * 4.0 + o.mem_bh * o.mem_T * 4.0) / (1024.0 * 1024.0));
  info.load_after = load_average();
  info.wall_s = now_s() - start;
  std::printf("load average after: %s; wall %.0f s\n", info.load_after.c_str(), info.wall_s);
  if (!o.json.empty()) {
    std::ofstream f(o.json);
    write_json_header(f, info);
    f << ",\n  \"memory\": {\"T\": " << o.mem_T << ", \"bh\": " << o.mem_bh << ", \"D\": " << o.mem_D
      << ", \"rows\": [" << json_rows << "\n  ]}\n}\n";
  }
  return ok ? 0 : 1;
}

}  // namespace dimattn::bench::kernel_bench
