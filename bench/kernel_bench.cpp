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
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu_backward.h>
#include <c10/core/GradMode.h>
#include <malloc.h>
#include <torch/version.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <functional>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "dimattn/attention.h"
#include "dimattn/forcing.h"
#include "dimattn/ops.h"
#include "dimattn/torch_interop.h"
#include "kernels/cpu/flash_attention.h"

namespace {

namespace k = dimattn::kernels;

// ---------------------------------------------------------------------------
// Options

struct Options {
  int threads = 2;
  std::vector<int64_t> T = {128, 512, 1024, 4096};
  std::vector<int64_t> D = {64, 128};
  std::vector<std::string> dtypes = {"float32", "bfloat16"};
  std::vector<int64_t> causal = {0, 1};
  int64_t batch = 1, heads = 16;  // B·H = 16
  bool backward = true;           // also time the backward pass
  bool reference = true;
  int64_t ref_max_T = 1024;
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
  std::string memory_child;  // internal: "ours" or "aten"
};

const char* kUsage =
    "usage: kernel_bench [options]\n"
    "  --threads=N         threads for every implementation and the GEMM (default 2)\n"
    "  --T=a,b,...         sequence lengths (default 128,512,1024,4096)\n"
    "  --D=a,b             head dims (default 64,128)\n"
    "  --dtype=LIST        float32,bfloat16 (default both)\n"
    "  --causal=LIST       0,1 (default both)\n"
    "  --batch=B --heads=H batch and heads (default 1 and 16: B*H = 16)\n"
    "  --no-backward       forward only\n"
    "  --no-ref            skip the reference path\n"
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
    "  --memory-no-aten    measure ours only\n";

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  for (std::string item; std::getline(ss, item, ',');)
    if (!item.empty()) out.push_back(item);
  return out;
}

std::vector<int64_t> split_ints(const std::string& s) {
  std::vector<int64_t> out;
  for (const std::string& x : split(s)) out.push_back(std::stoll(x));
  return out;
}

// "--name=value": value, else nullopt.
std::optional<std::string> value_of(const std::string& arg, const char* name) {
  const std::string prefix = std::string(name) + "=";
  if (arg.rfind(prefix, 0) != 0) return std::nullopt;
  return arg.substr(prefix.size());
}

[[noreturn]] void usage_error(const std::string& msg) {
  std::fprintf(stderr, "kernel_bench: %s\n%s", msg.c_str(), kUsage);
  std::exit(2);
}

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
      else if ((v = value_of(a, "--threads"))) o.threads = std::stoi(*v);
      else if ((v = value_of(a, "--T"))) o.T = split_ints(*v);
      else if ((v = value_of(a, "--D"))) o.D = split_ints(*v);
      else if ((v = value_of(a, "--dtype"))) o.dtypes = split(*v);
      else if ((v = value_of(a, "--causal"))) o.causal = split_ints(*v);
      else if ((v = value_of(a, "--batch"))) o.batch = std::stoll(*v);
      else if ((v = value_of(a, "--heads"))) o.heads = std::stoll(*v);
      else if ((v = value_of(a, "--ref-max-T"))) o.ref_max_T = std::stoll(*v);
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
  if (o.threads < 1 || o.min_reps < 1 || o.max_reps < o.min_reps || o.batch < 1 || o.heads < 1)
    usage_error("--threads, --min-reps, --batch, --heads must be >= 1 and --max-reps >= --min-reps");
  return o;
}

// ---------------------------------------------------------------------------
// Clocks, statistics, machine facts

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

bool g_cpu_clock = false;  // --clock=cpu

double cpu_s() {
  timespec t;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

// Seconds f took, by the clock --clock chose.
double time_call(const std::function<void()>& f) {
  const double t0 = g_cpu_clock ? cpu_s() : now_s();
  f();
  return (g_cpu_clock ? cpu_s() : now_s()) - t0;
}

double median(std::vector<double> v) {
  if (v.empty()) return NAN;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

std::string read_file(const char* path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

std::string load_average() {
  std::string s = read_file("/proc/loadavg");
  // "0.52 0.58 0.59 1/123 4567": the three averages.
  std::stringstream ss(s);
  std::string a, b, c;
  ss >> a >> b >> c;
  return a + " " + b + " " + c;
}

std::string cpu_model() {
  std::stringstream ss(read_file("/proc/cpuinfo"));
  for (std::string line; std::getline(ss, line);)
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  return "unknown";
}

std::string cpu_flags() {
  std::stringstream ss(read_file("/proc/cpuinfo"));
  std::string flags;
  for (std::string line; std::getline(ss, line);)
    if (line.rfind("flags", 0) == 0) {
      flags = " " + line.substr(line.find(':') + 1) + " ";
      break;
    }
  std::string out;
  for (const char* f : {"avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16"})
    if (flags.find(std::string(" ") + f + " ") != std::string::npos) out += std::string(out.empty() ? "" : " ") + f;
  return out.empty() ? "none of avx2/fma/avx512" : out;
}

std::string today() {
  const std::time_t t = std::time(nullptr);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%d %H:%M", std::localtime(&t));
  return buf;
}

// VmRSS or VmHWM from /proc/self/status, in bytes.
int64_t status_bytes(const char* key) {
  std::stringstream ss(read_file("/proc/self/status"));
  for (std::string line; std::getline(ss, line);)
    if (line.rfind(key, 0) == 0) return std::stoll(line.substr(std::string(key).size() + 1)) * 1024;  // "kB"
  return -1;
}

// ---------------------------------------------------------------------------
// Operands

at::ScalarType scalar_type(const std::string& name) { return name == "float32" ? at::kFloat : at::kBFloat16; }

k::ElementStrides strides_of(const at::Tensor& t) {
  return {t.stride(0), t.stride(1), t.stride(2), t.stride(3)};
}

// q, k, v, dout of [B, H, T, D] and our kernel's outputs, with its params.
struct Problem {
  at::Tensor q, k, v, dout;
  at::Tensor out, lse, dq, dk, dv;
  k::AttentionKernelParams p;
};

at::Tensor random_tensor(std::vector<int64_t> shape, at::ScalarType dt) {
  // In place: no temporaries beyond the float32 staging for bfloat16.
  at::Tensor x = at::empty(shape, at::kFloat).normal_();
  return dt == at::kFloat ? x : x.to(dt);
}

Problem make_problem(int64_t B, int64_t H, int64_t T, int64_t D, at::ScalarType dt, bool causal, bool backward) {
  Problem pr;
  pr.q = random_tensor({B, H, T, D}, dt);
  pr.k = random_tensor({B, H, T, D}, dt);
  pr.v = random_tensor({B, H, T, D}, dt);
  pr.out = at::zeros({B, H, T, D}, dt);
  pr.lse = at::zeros({B, H, T}, at::kFloat);
  k::AttentionKernelParams& p = pr.p;
  p.dtype = dt == at::kFloat ? k::ElementType::float32 : k::ElementType::bfloat16;
  p.q = pr.q.data_ptr();
  p.k = pr.k.data_ptr();
  p.v = pr.v.data_ptr();
  p.out = pr.out.data_ptr();
  p.lse = pr.lse.data_ptr();
  p.batch = B;
  p.heads = H;
  p.kv_heads = H;
  p.seqlen_q = p.seqlen_k = T;
  p.head_dim = p.head_dim_v = D;
  p.q_strides = strides_of(pr.q);
  p.k_strides = strides_of(pr.k);
  p.v_strides = strides_of(pr.v);
  p.out_strides = strides_of(pr.out);
  p.lse_batch_stride = pr.lse.stride(0);
  p.lse_head_stride = pr.lse.stride(1);
  p.causal = causal;
  p.scale = 1.0 / std::sqrt(static_cast<double>(D));  // ATen's default scale
  if (backward) {
    pr.dout = random_tensor({B, H, T, D}, dt);
    pr.dq = at::zeros_like(pr.q);
    pr.dk = at::zeros_like(pr.k);
    pr.dv = at::zeros_like(pr.v);
    p.dout = pr.dout.data_ptr();
    p.dq = pr.dq.data_ptr();
    p.dk = pr.dk.data_ptr();
    p.dv = pr.dv.data_ptr();
    p.dout_strides = strides_of(pr.dout);
    p.dq_strides = strides_of(pr.dq);
    p.dk_strides = strides_of(pr.dk);
    p.dv_strides = strides_of(pr.dv);
  }
  return pr;
}

#if AT_PARALLEL_OPENMP && !defined(_OPENMP)
#error "compile with OpenMP (-fopenmp), or at::parallel_for runs serially"
#endif
k::ParallelFor aten_parallel_for() {
  // As the torch backend runs the kernel (backends/torch/torch_attention.cpp).
  return [](int64_t begin, int64_t end, const k::ParallelBody& body) {
    at::parallel_for(begin, end, 1, [&](int64_t b, int64_t e) { body(b, e); });
  };
}

double max_abs_diff(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kFloat) - b.to(at::kFloat)).abs().max().item<double>();
}

double max_abs(const at::Tensor& a) { return a.to(at::kFloat).abs().max().item<double>(); }

// ---------------------------------------------------------------------------
// GEMM rate

// c = a b, fp32, n x n x n.
struct Gemm {
  explicit Gemm(int64_t n) : n(n), a(at::randn({n, n})), b(at::randn({n, n})), c(at::empty({n, n})) {}
  void run() { at::mm_out(c, a, b); }
  double flops() const { return 2.0 * n * n * n; }
  int64_t n;
  at::Tensor a, b, c;
};

double gemm_gflops(int64_t n) {
  Gemm g(n);
  g.run();  // warm-up
  std::vector<double> t;
  const double budget = 2.0, start = now_s();
  while (t.size() < 5 || (t.size() < 15 && now_s() - start < budget)) t.push_back(time_call([&] { g.run(); }));
  return g.flops() / median(t) / 1e9;
}

// ---------------------------------------------------------------------------
// One configuration of the grid

struct Variant {
  std::string name;
  std::function<void()> run;
  std::vector<double> times;
  bool repeat = true;
};

struct Row {
  std::string dtype;
  int64_t D = 0, T = 0;
  bool causal = false;
  double flops_fwd = 0;
  // medians in seconds; NAN = not run
  double ours_fwd = NAN, aten_fwd = NAN, ref_fwd = NAN;
  double ours_bwd = NAN, aten_bwd = NAN, ref_fwdbwd = NAN;
  int reps = 0;             // timed rounds
  std::string single_runs;  // variants timed once
  double gemm = NAN;  // GFLOP/s of the GEMM timed in the same rounds
  double err_out = NAN, err_grad = NAN, err_ref = NAN;  // vs ATen (grads relative to their max), ours vs ref
  bool ok = true;
};

// Runs the variants: warm-up, then interleaved rounds.
int run_rounds(std::vector<Variant>& vs, const Options& o) {
  double round_s = 0;
  for (Variant& v : vs) {
    const double t = time_call(v.run);
    if (t > o.single_run_s) {
      v.repeat = false;
      v.times.push_back(t);
    } else {
      round_s += t;
    }
  }
  int reps = o.min_reps;
  if (round_s > 0) reps = static_cast<int>(std::clamp(std::floor(o.budget_s / round_s), double(o.min_reps), double(o.max_reps)));
  for (int r = 0; r < reps; ++r)
    for (Variant& v : vs)
      if (v.repeat) v.times.push_back(time_call(v.run));
  return reps;
}

Row run_config(const Options& o, const std::string& dtype, int64_t D, int64_t T, bool causal,
               const k::ParallelFor& pf, Gemm* gemm) {
  const at::ScalarType dt = scalar_type(dtype);
  const int64_t B = o.batch, H = o.heads;
  at::manual_seed(0);
  Problem pr = make_problem(B, H, T, D, dt, causal, o.backward);
  Row row;
  row.dtype = dtype;
  row.D = D;
  row.T = T;
  row.causal = causal;
  row.flops_fwd = 4.0 * B * H * T * T * D * (causal ? 0.5 : 1.0);

  at::Tensor aout, alse, adq, adk, adv;
  std::vector<Variant> vs;
  vs.push_back({"ours fwd", [&] { k::flash_attention_forward_cpu(pr.p, pf); }});
  vs.push_back({"aten fwd", [&] {
                  std::tie(aout, alse) = at::_scaled_dot_product_flash_attention_for_cpu(pr.q, pr.k, pr.v, 0.0, causal);
                }});
  if (o.backward) {
    vs.push_back({"ours bwd", [&] { k::flash_attention_backward_cpu(pr.p, pf); }});
    vs.push_back({"aten bwd", [&] {
                    std::tie(adq, adk, adv) = at::_scaled_dot_product_flash_attention_for_cpu_backward(
                        pr.dout, pr.q, pr.k, pr.v, aout, alse, 0.0, causal);
                  }});
  }

  // The reference path: dimattn::dot_attention forced to "reference" on the
  // torch backend, over the same memory.
  const bool ref = o.reference && T <= o.ref_max_T;
  dimattn::Dim bd("batch", B), hd("heads", H), td("time", T), fd("feat", D);
  const dimattn::Dims dims = {bd, hd, td, fd};
  dimattn::AttentionOptions ao{.key_dim = fd, .axis = td};
  if (causal) ao.causal_query_spatial_dim = td;
  at::Tensor ref_out, gq, gk, gv, ref_dout;
  if (ref) {
    vs.push_back({"ref fwd", [&] {
                    c10::AutoGradMode no_grad(false);
                    dimattn::ForceKernels force("reference");
                    const dimattn::Tensor out =
                        dimattn::dot_attention(dimattn::from_aten(pr.q, dims), dimattn::from_aten(pr.k, dims),
                                               dimattn::from_aten(pr.v, dims), ao);
                    ref_out = dimattn::to_aten(dimattn::align(out, dims));  // a view when already in order
                  }});
    if (o.backward) {
      gq = pr.q.detach().requires_grad_(true);
      gk = pr.k.detach().requires_grad_(true);
      gv = pr.v.detach().requires_grad_(true);
      vs.push_back({"ref fwd+bwd", [&] {
                      dimattn::ForceKernels force("reference");
                      for (at::Tensor* g : {&gq, &gk, &gv}) g->mutable_grad() = at::Tensor();
                      const dimattn::Tensor out =
                          dimattn::dot_attention(dimattn::from_aten(gq, dims), dimattn::from_aten(gk, dims),
                                                 dimattn::from_aten(gv, dims), ao);
                      at::Tensor o4 = dimattn::to_aten(out);
                      if (!ref_dout.defined()) ref_dout = at::randn(o4.sizes(), o4.options().requires_grad(false));
                      o4.backward(ref_dout);
                    }});
    }
  }

  // The GEMM rate under the same load as this configuration's variants.
  if (gemm) vs.push_back({"gemm", [&] { gemm->run(); }});

  row.reps = run_rounds(vs, o);
  auto med = [&](const std::string& name) {
    for (const Variant& v : vs)
      if (v.name == name) return median(v.times);
    return double(NAN);
  };
  row.ours_fwd = med("ours fwd");
  row.aten_fwd = med("aten fwd");
  row.ours_bwd = med("ours bwd");
  row.aten_bwd = med("aten bwd");
  row.ref_fwd = med("ref fwd");
  row.ref_fwdbwd = med("ref fwd+bwd");
  if (gemm) row.gemm = gemm->flops() / med("gemm") / 1e9;
  for (const Variant& v : vs)
    if (!v.repeat) row.single_runs += (row.single_runs.empty() ? "" : ", ") + v.name;

  // Agreement: ours against ATen (and the reference where it ran). Loose
  // bounds that catch a wrong setup, not rounding (bfloat16 stores ~3 digits).
  const bool f32 = dt == at::kFloat;
  row.err_out = max_abs_diff(pr.out, aout);
  if (o.backward) {
    row.err_grad = 0;
    const std::pair<at::Tensor, at::Tensor> grads[] = {{pr.dq, adq}, {pr.dk, adk}, {pr.dv, adv}};
    for (const auto& [ours, theirs] : grads)
      row.err_grad = std::max(row.err_grad, max_abs_diff(ours, theirs) / std::max(max_abs(theirs), 1e-30));
  }
  if (ref_out.defined()) row.err_ref = max_abs_diff(pr.out, ref_out);
  const double tol_out = f32 ? 1e-4 : 5e-2, tol_grad = f32 ? 1e-3 : 5e-2;
  row.ok = row.err_out <= tol_out && (!o.backward || row.err_grad <= tol_grad) &&
           (std::isnan(row.err_ref) || row.err_ref <= tol_out);
  return row;
}

// ---------------------------------------------------------------------------
// Output

std::string fmt(const char* f, double x) {
  if (std::isnan(x)) return "–";
  char buf[64];
  std::snprintf(buf, sizeof buf, f, x);
  return buf;
}

std::string fmt_ms(double s) {
  if (std::isnan(s)) return "–";
  const double ms = s * 1e3;
  return fmt(ms < 1 ? "%.3f" : ms < 100 ? "%.2f" : "%.0f", ms);
}

double gflops(double flops, double s) { return std::isnan(s) ? NAN : flops / s / 1e9; }

struct RunInfo {
  std::string command, cpu, flags, date, load_before, load_after, isa, pool, clock;
  int threads = 0;
  double gemm_before = NAN, gemm_after = NAN;
  int64_t gemm_n = 0, gemm_round_n = 0;
  double wall_s = 0;
};

void print_table(const std::vector<Row>& rows, const RunInfo& info, bool backward) {
  const double gemm_global = std::fmax(info.gemm_before, info.gemm_after);  // NAN-safe
  std::printf("\n| dtype | D | T | causal | fwd ms ours / ATen / ref | fwd GFLOP/s ours / ATen | fwd speedup | fwd %%GEMM");
  if (backward) std::printf(" | fwd+bwd ms ours / ATen / ref | fwd+bwd GFLOP/s ours / ATen | fwd+bwd speedup | bwd speedup | fwd+bwd %%GEMM");
  std::printf(" | GEMM GFLOP/s | reps |\n|---|---|---|---|---|---|---|---|---");
  if (backward) std::printf("|---|---|---|---|---");
  std::printf("|---|\n");
  for (const Row& r : rows) {
    const double fb_ours = r.ours_fwd + r.ours_bwd, fb_aten = r.aten_fwd + r.aten_bwd;
    const double f = r.flops_fwd;
    const double gemm = std::isnan(r.gemm) ? gemm_global : r.gemm;
    std::printf("| %s | %ld | %ld | %s | %s / %s / %s | %s / %s | %s | %s", r.dtype == "float32" ? "f32" : "bf16",
                static_cast<long>(r.D), static_cast<long>(r.T), r.causal ? "yes" : "no", fmt_ms(r.ours_fwd).c_str(),
                fmt_ms(r.aten_fwd).c_str(), fmt_ms(r.ref_fwd).c_str(), fmt("%.1f", gflops(f, r.ours_fwd)).c_str(),
                fmt("%.1f", gflops(f, r.aten_fwd)).c_str(), fmt("%.2fx", r.aten_fwd / r.ours_fwd).c_str(),
                r.dtype == "float32" ? fmt("%.0f%%", 100 * gflops(f, r.ours_fwd) / gemm).c_str() : "–");
    if (backward)
      std::printf(" | %s / %s / %s | %s / %s | %s | %s | %s", fmt_ms(fb_ours).c_str(), fmt_ms(fb_aten).c_str(),
                  fmt_ms(r.ref_fwdbwd).c_str(), fmt("%.1f", gflops(3.5 * f, fb_ours)).c_str(),
                  fmt("%.1f", gflops(3.5 * f, fb_aten)).c_str(), fmt("%.2fx", fb_aten / fb_ours).c_str(),
                  fmt("%.2fx", r.aten_bwd / r.ours_bwd).c_str(),
                  r.dtype == "float32" ? fmt("%.0f%%", 100 * gflops(3.5 * f, fb_ours) / gemm).c_str() : "–");
    std::printf(" | %s | %d%s |\n", fmt("%.1f", gemm).c_str(), r.reps, r.single_runs.empty() ? "" : ("; once: " + r.single_runs).c_str());
  }
  std::printf(
      "\nms: median %s time; fwd+bwd = forward + backward medians. speedup = ATen ms / ours ms (> 1: ours "
      "faster). GFLOP/s per DESIGN.md §9 (fwd 4·B·H·T²·D, causal half; fwd+bwd 3.5x). %%GEMM (float32 rows): "
      "ours over the GEMM column, the fp32 at::mm rate timed in the same rounds (else the higher of the "
      "before/after GEMM). ref: dot_attention forced to \"reference\" (–: not run).\n",
      info.clock.c_str());
  bool all_ok = true;
  for (const Row& r : rows) all_ok = all_ok && r.ok;
  std::printf("agreement with ATen%s: %s\n", rows.empty() ? "" : " (max |Δout|, max rel |Δgrad|, max |Δout| vs ref)",
              all_ok ? "ok" : "FAILED");
  for (const Row& r : rows)
    std::printf("  %s D%ld T%ld %s: %s %s %s%s\n", r.dtype.c_str(), static_cast<long>(r.D), static_cast<long>(r.T),
                r.causal ? "causal" : "full", fmt("%.1e", r.err_out).c_str(), fmt("%.1e", r.err_grad).c_str(),
                fmt("%.1e", r.err_ref).c_str(), r.ok ? "" : "  <-- exceeds tolerance");
}

std::string json_str(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    if (static_cast<unsigned char>(c) < 0x20) continue;
    out += c;
  }
  return out + "\"";
}

std::string json_num(double x) {
  if (!std::isfinite(x)) return "null";
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.6g", x);
  return buf;
}

void write_json_header(std::ofstream& f, const RunInfo& info) {
  f << "{\n  \"command\": " << json_str(info.command) << ",\n  \"cpu\": " << json_str(info.cpu)
    << ",\n  \"cpu_flags\": " << json_str(info.flags) << ",\n  \"date\": " << json_str(info.date)
    << ",\n  \"torch\": " << json_str(TORCH_VERSION) << ",\n  \"threads\": " << info.threads
    << ",\n  \"clock\": " << json_str(info.clock) << ",\n  \"ours_isa\": " << json_str(info.isa) << ",\n  \"ours_pool\": " << json_str(info.pool)
    << ",\n  \"load_before\": " << json_str(info.load_before) << ",\n  \"load_after\": " << json_str(info.load_after)
    << ",\n  \"wall_s\": " << json_num(info.wall_s);
}

void write_json(const std::string& path, const std::vector<Row>& rows, const RunInfo& info) {
  std::ofstream f(path);
  write_json_header(f, info);
  f << ",\n  \"gemm\": {\"n\": " << info.gemm_n << ", \"round_n\": " << info.gemm_round_n << ", \"gflops_before\": " << json_num(info.gemm_before)
    << ", \"gflops_after\": " << json_num(info.gemm_after) << "},\n  \"rows\": [";
  for (size_t i = 0; i < rows.size(); ++i) {
    const Row& r = rows[i];
    const double f3 = 3.5 * r.flops_fwd;
    f << (i ? "," : "") << "\n    {\"dtype\": " << json_str(r.dtype) << ", \"D\": " << r.D << ", \"T\": " << r.T
      << ", \"causal\": " << (r.causal ? "true" : "false") << ", \"flops_fwd\": " << json_num(r.flops_fwd)
      << ", \"gemm_gflops\": " << json_num(r.gemm) << ", \"reps\": " << r.reps << ", \"single_runs\": " << json_str(r.single_runs)
      << ",\n     \"ms\": {\"ours_fwd\": " << json_num(r.ours_fwd * 1e3) << ", \"aten_fwd\": " << json_num(r.aten_fwd * 1e3)
      << ", \"ref_fwd\": " << json_num(r.ref_fwd * 1e3) << ", \"ours_bwd\": " << json_num(r.ours_bwd * 1e3)
      << ", \"aten_bwd\": " << json_num(r.aten_bwd * 1e3) << ", \"ref_fwd_bwd\": " << json_num(r.ref_fwdbwd * 1e3)
      << "},\n     \"gflops\": {\"ours_fwd\": " << json_num(gflops(r.flops_fwd, r.ours_fwd))
      << ", \"aten_fwd\": " << json_num(gflops(r.flops_fwd, r.aten_fwd))
      << ", \"ours_bwd\": " << json_num(gflops(2.5 * r.flops_fwd, r.ours_bwd))
      << ", \"aten_bwd\": " << json_num(gflops(2.5 * r.flops_fwd, r.aten_bwd))
      << ", \"ours_fwd_bwd\": " << json_num(gflops(f3, r.ours_fwd + r.ours_bwd))
      << ", \"aten_fwd_bwd\": " << json_num(gflops(f3, r.aten_fwd + r.aten_bwd))
      << ", \"ref_fwd_bwd\": " << json_num(gflops(f3, r.ref_fwdbwd))
      << "},\n     \"max_abs_err_out_vs_aten\": " << json_num(r.err_out)
      << ", \"max_rel_err_grad_vs_aten\": " << json_num(r.err_grad)
      << ", \"max_abs_err_out_vs_ref\": " << json_num(r.err_ref) << ", \"ok\": " << (r.ok ? "true" : "false") << "}";
  }
  f << "\n  ]\n}\n";
}

// ---------------------------------------------------------------------------
// Memory mode

// In a fresh process: create inputs and outputs, warm up the pool on a small
// call, reset the peak RSS, run the forward, print the peak growth.
int memory_child(const Options& o) {
  const bool ours = o.memory_child == "ours";
  if (!ours && o.memory_child != "aten") usage_error("--memory-child is ours or aten");
  const int64_t T = o.mem_T, H = o.mem_bh, D = o.mem_D;
  {  // warm-up: thread pool, lazy initialisation
    Problem w = make_problem(1, H, 128, D, at::kFloat, false, false);
    if (ours) k::flash_attention_forward_cpu(w.p, aten_parallel_for());
    else at::_scaled_dot_product_flash_attention_for_cpu(w.q, w.k, w.v, 0.0, false);
  }
  at::manual_seed(0);
  Problem pr = make_problem(1, H, T, D, at::kFloat, false, false);
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
  const int64_t inputs = 3 * pr.q.nbytes(), outputs = pr.out.nbytes() + pr.lse.nbytes();
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
  std::printf("\n| implementation | peak RSS growth during the call | of which outputs it allocated | beyond inputs and "
              "outputs | goal < 256 MiB | time s | GFLOP/s |\n|---|---|---|---|---|---|---|\n");
  std::vector<std::string> impls = {"ours"};
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
      std::printf("| %s | failed | | | | | |\n", impl.c_str());
      ok = false;
      continue;
    }
    const double mib = 1024.0 * 1024.0;
    const double beyond = (peak - own) / mib;
    std::printf("| %s | %.1f MiB | %.1f MiB | %.1f MiB | %s | %.1f | %.1f |\n", impl == "ours" ? "ours (cpu_flash)" : "ATen CPU flash",
                peak / mib, own / mib, beyond, beyond < 256 ? "met" : "not met", t, flops / t / 1e9);
    json_rows += std::string(json_rows.empty() ? "" : ",") + "\n    {\"impl\": " + json_str(impl) +
                 ", \"peak_rss_growth_bytes\": " + std::to_string(peak) + ", \"outputs_allocated_bytes\": " +
                 std::to_string(own) + ", \"beyond_inputs_outputs_bytes\": " + std::to_string(peak - own) +
                 ", \"inputs_bytes\": " + std::to_string(inputs) + ", \"outputs_bytes\": " + std::to_string(outputs) +
                 ", \"seconds\": " + json_num(t) + "}";
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

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  at::set_num_threads(o.threads);
  if (!o.memory_child.empty()) return memory_child(o);
  g_cpu_clock = o.cpu_clock;

  RunInfo info;
  for (int i = 0; i < argc; ++i) info.command += std::string(i ? " " : "") + argv[i];
  info.cpu = cpu_model();
  info.flags = cpu_flags();
  info.date = today();
  info.threads = at::get_num_threads();
  info.isa = k::cpu_isa_name(k::cpu_flash_best_isa());
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
  if (o.cpu_clock && o.threads > 1)
    std::printf("note: --clock=cpu with %d threads counts the CPU time of every thread, spin-waiting included\n",
                o.threads);

  const double start = now_s();
  if (o.gemm_n > 0) {
    info.gemm_before = gemm_gflops(o.gemm_n);
    std::printf("fp32 GEMM at::mm %ld^3, %d threads: %.1f GFLOP/s\n", static_cast<long>(o.gemm_n), o.threads,
                info.gemm_before);
  }
  std::unique_ptr<Gemm> gemm;
  if (o.gemm_round_n > 0) {
    gemm = std::make_unique<Gemm>(o.gemm_round_n);
    std::printf("fp32 GEMM at::mm %ld^3 (timed in every configuration's rounds), %d threads: %.1f GFLOP/s\n",
                static_cast<long>(o.gemm_round_n), o.threads, gemm_gflops(o.gemm_round_n));
  }
  std::fflush(stdout);

  std::unique_ptr<k::ThreadPool> pool;
  k::ParallelFor pf = aten_parallel_for();
  if (o.own_pool) {
    pool = std::make_unique<k::ThreadPool>(o.threads);
    pf = pool->as_parallel_for();
  }

  std::vector<Row> rows;
  for (const std::string& dtype : o.dtypes)
    for (int64_t D : o.D)
      for (int64_t T : o.T)
        for (int64_t c : o.causal) {
          const double t0 = now_s();
          rows.push_back(run_config(o, dtype, D, T, c != 0, pf, gemm.get()));
          const Row& r = rows.back();
          std::fprintf(stderr, "[%6.0f s] %s D%ld T%ld %s: fwd ours %s ms ATen %s ms, bwd ours %s ms ATen %s ms, GEMM %s GFLOP/s (%d reps, %.1f s)\n",
                       now_s() - start, dtype.c_str(), static_cast<long>(D), static_cast<long>(T),
                       c ? "causal" : "full", fmt_ms(r.ours_fwd).c_str(), fmt_ms(r.aten_fwd).c_str(),
                       fmt_ms(r.ours_bwd).c_str(), fmt_ms(r.aten_bwd).c_str(), fmt("%.1f", r.gemm).c_str(), r.reps,
                       now_s() - t0);
        }

  if (o.gemm_n > 0) {
    info.gemm_after = gemm_gflops(o.gemm_n);
    std::printf("fp32 GEMM at::mm %ld^3 after the grid: %.1f GFLOP/s\n", static_cast<long>(o.gemm_n), info.gemm_after);
  }
  info.wall_s = now_s() - start;
  info.load_after = load_average();
  print_table(rows, info, o.backward);
  std::printf("load average after: %s; wall %.0f s\n", info.load_after.c_str(), info.wall_s);
  if (!o.json.empty()) write_json(o.json, rows, info);
  for (const Row& r : rows)
    if (!r.ok) return 1;
  return 0;
}
