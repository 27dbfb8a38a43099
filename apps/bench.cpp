// `dimattn bench`: every eligible kernel, the reference path and `auto`, timed
// side by side on the default suite (DESIGN.md §9), as a table, JSON and SVG.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>

#include "cli_args.h"
#include "commands.h"
#include "dimattn/ext/backend.h"
#include "dimattn/error.h"
#include "dimattn/forcing.h"
#include "dimattn/registry.h"
#include "dimattn/testing/json.h"
#include "dimattn/testing/machine_peak.h"
#include "dimattn/trace.h"
#include "problem.h"

namespace dimattn::cli {
namespace {

const char* const kSummary =
    "usage: dimattn bench [options]\n"
    "\n"
    "Times every eligible attention kernel (each forced in turn), the reference path and\n"
    "`auto` (what kernel selection picks) on the default suite: self-attention, causal\n"
    "self-attention and cross-attention with a beam dim (query {batch, heads, beam=4,\n"
    "time=T/4, feat} vs encoder {batch, heads, enc=T, feat}); B=8, 8 heads, D=64, on every\n"
    "available device and registered backend. Prints a table on stdout (progress on stderr\n"
    "when it is a terminal). Kernels that cannot run a config are listed with the reason.\n"
    "Variant options (--window, --alibi, --bias, ...) apply to every config that can\n"
    "take them; a config that cannot (a bias over the query time in self-attention, a right\n"
    "window with causal) is left out.";

const std::vector<Option> kOptions = with_variant_options({
    {"quick", "", "short run (< 1 min on 2 cores): float32 only, T 32,256, 5 repeats"},
    {"kernels", "a,b", "time only these kernels (the reference and auto always run)"},
    {"device", "cpu|cuda", "one device (default: cpu, and cuda where a backend runs on it)"},
    {"dtype", "LIST", "dtypes (default float32,bfloat16)"},
    {"seq", "LIST", "sequence lengths T (default 32,1024)"},
    {"backend", "LIST", "backends (default: every registered one)"},
    {"threads", "N", "CPU threads (sets OMP_NUM_THREADS, MKL_NUM_THREADS, DIMATTN_NUM_THREADS)"},
    {"repeats", "N", "timed runs per kernel, at most (default 20; stops after 2 s once 3 ran)"},
    {"warmup", "N", "untimed runs before timing (default 2; 1 for calls slower than 2 s)"},
    {"json", "FILE", "write every record as JSON (schema: docs/cli.md)"},
    {"plot", "FILE.svg", "write time vs T per kernel, one panel per kind, as SVG"},
});

struct Settings {
  std::vector<Device> devices;
  std::vector<std::string> backends, kernels;  // kernels empty: all
  std::vector<DType> dtypes;
  std::vector<int64_t> seqs;
  int warmup = 2, repeats = 20;
  int threads = 1;      // CPU threads the kernels run on (--threads, else every online CPU)
  double budget_s = 2;  // per timed row, once 3 runs are done
  testing::CaseVariants variants;  // the variant options, applied to every config that can take them
};

struct Config {
  std::string kind;  // self, causal, cross
  AttentionCase problem;
};

struct Timing {
  double median_ms = 0, min_ms = 0;
  int repeats = 0;
};

struct Record {
  const Config* config;
  std::string kernel;  // a kernel name, "reference" or "auto"
  std::string auto_kernel;
  std::optional<std::string> rejected_reason;  // a gate's reason, or a library error when `failed`
  bool failed = false;
  Timing t;
  double gflops = 0, speedup = 0, max_abs_err = 0;
  double of_peak = NAN;  // gflops over the machine's arithmetic peak for the dtype (CPU rows)
  bool selected = false;
  std::string isa;  // the code path of the kernel that ran (trace record), "" when it has one
};

// --- settings ---

void set_threads(int64_t n) {
  // No library call sets LibTorch's pool from outside backends/torch; these
  // variables are read when the pools start (LibTorch's and MKL's at the
  // first parallel op, dimattn's own CPU kernels' at their first use), so
  // they are set before any backend runs anything.
  const std::string s = std::to_string(n);
  for (const char* var : {"OMP_NUM_THREADS", "MKL_NUM_THREADS", "DIMATTN_NUM_THREADS"}) setenv(var, s.c_str(), 1);
}

Settings parse_settings(const Args& a) {
  const bool quick = a.flag("quick");
  Settings s;
  s.dtypes = a.dtypes("dtype", quick ? std::vector{DType::float32} : std::vector{DType::float32, DType::bfloat16});
  s.seqs = a.integers("seq", quick ? std::vector<int64_t>{32, 256} : std::vector<int64_t>{32, 1024}, 4);
  s.repeats = static_cast<int>(a.integer("repeats", quick ? 5 : 20, 1));
  s.warmup = static_cast<int>(a.integer("warmup", quick ? 1 : 2, 1));
  if (quick) s.budget_s = 0.3;
  s.threads = static_cast<int>(sysconf(_SC_NPROCESSORS_ONLN));
  if (a.value("threads")) {
    s.threads = static_cast<int>(a.integer("threads", 0, 1));
    set_threads(s.threads);
  }
  apply_variants(a, s.variants);

  s.backends = a.texts("backend", backend_names());
  for (const std::string& b : s.backends)
    if (!has_backend(b)) a.fail("backend", "unknown backend '" + b + "'");
  s.kernels = a.texts("kernels", {});
  check_kernel_names("kernels", s.kernels);

  auto runs_on = [&](Device d) {
    return std::any_of(s.backends.begin(), s.backends.end(), [&](const std::string& b) {
      return get_backend(b).supports(d);
    });
  };
  if (const auto d = a.value("device")) {
    if (*d != "cpu" && *d != "cuda") a.fail("device", "expected cpu or cuda, got '" + *d + "'");
    const Device dev = *d == "cpu" ? kCPU : kCUDA;
    if (!runs_on(dev))
      throw Error("no backend among " + a.text("backend", "the registered ones") + " runs on " + *d + " here");
    s.devices = {dev};
  } else {
    s.devices = {kCPU};
    if (runs_on(kCUDA)) s.devices.push_back(kCUDA);
  }
  return s;
}

std::vector<Config> suite(const Settings& s) {
  std::vector<Config> out;
  for (Device device : s.devices)
    for (const std::string& backend : s.backends) {
      if (!get_backend(backend).supports(device)) continue;
      for (DType dtype : s.dtypes)
        for (const char* kind : {"self", "causal", "cross"})
          for (int64_t T : s.seqs) {
            const bool cross = std::string(kind) == "cross";
            AttentionCase p{.backend = backend, .device = device, .dtype = dtype, .kind = cross ? Kind::cross : Kind::self,
                      .batch = 8, .heads = 8, .groups = cross ? 4 : 1, .group_name = "beam",
                      .seq_q = cross ? std::max<int64_t>(1, T / 4) : T, .seq_k = T, .head_dim = 64,
                      .head_dim_v = 64, .causal = std::string(kind) == "causal"};
            p.variants = s.variants;
            if (testing::invalid_reason(p)) continue;  // e.g. a bias over the query time in self-attention
            out.push_back({kind, p});
          }
    }
  return out;
}

// The kernels timed for a config, in the backend's priority order; the
// reference and auto are added by the caller.
std::vector<std::string> kernels_of(const AttentionCase& p, const Settings& s) {
  std::vector<std::string> out;
  for (const std::string& k : get_backend(p.backend).attention_kernels(p.device))
    if (k != kReferenceKernel && (s.kernels.empty() || std::count(s.kernels.begin(), s.kernels.end(), k))) out.push_back(k);
  for (const std::string& k : s.kernels)  // asked for, but not a kernel here: listed as rejected
    if (k != kReferenceKernel && k != "auto" && !std::count(out.begin(), out.end(), k)) out.push_back(k);
  return out;
}

// --- measuring ---

class Progress {
 public:
  explicit Progress(int total) : total_(total), on_(isatty(STDERR_FILENO)) {}
  void step(const std::string& what) {
    ++done_;
    if (on_) std::fprintf(stderr, "\r\033[K[%d/%d] %s", done_, total_, what.c_str());
  }
  void clear() const {
    if (on_) std::fprintf(stderr, "\r\033[K");
  }

 private:
  int total_, done_ = 0;
  bool on_;
};

// Warm-up runs, then timed runs: at least min(3, repeats), and more until
// `repeats` or the row's time budget. A call slower than the budget gets one
// warm-up run only.
Timing time_runs(const Operands& ops, const std::string& spec, const Settings& s) {
  using clock = std::chrono::steady_clock;
  auto seconds_since = [](clock::time_point t) { return std::chrono::duration<double>(clock::now() - t).count(); };
  ForceKernels force(spec);
  const auto warm_start = clock::now();
  for (int i = 0; i < s.warmup && seconds_since(warm_start) <= s.budget_s; ++i)
    synchronize(dot_attention(ops.q, ops.k, ops.v, ops.opts));
  std::vector<double> ms;
  const auto start = clock::now();
  while (static_cast<int>(ms.size()) < s.repeats) {
    const auto t0 = clock::now();
    synchronize(dot_attention(ops.q, ops.k, ops.v, ops.opts));
    ms.push_back(1e3 * seconds_since(t0));
    if (ms.size() >= 3 && seconds_since(start) > s.budget_s) break;
  }
  std::sort(ms.begin(), ms.end());
  const size_t n = ms.size();
  return {n % 2 ? ms[n / 2] : (ms[n / 2 - 1] + ms[n / 2]) / 2, ms.front(), static_cast<int>(n)};
}

// One timed row. Its first run gives the output compared with the
// reference's (when there is one) and, if asked, that output. A library error
// (a kernel failing, the reference's memory limit) becomes the row's reason
// instead of ending the run.
Record measure(const Config& c, const Operands& ops, const std::string& kernel, const std::string& auto_kernel,
               const std::optional<Tensor>& ref, const Settings& s, std::optional<Tensor>* output = nullptr) {
  Record r{&c, kernel, auto_kernel};
  r.selected = kernel == auto_kernel;
  try {
    TraceScope trace(false);                     // names the kernel and its code path, captures nothing
    const Tensor out = run_forced(ops, kernel);  // `kernel` is also the forcing spec ("auto", "reference", a name)
    if (!trace.records().empty()) r.isa = trace.records().back().isa;
    r.max_abs_err = ref ? max_abs_diff(out, *ref, ops.out_order) : NAN;
    if (output) *output = out;
    r.t = time_runs(ops, kernel, s);
    r.gflops = c.problem.flops() / (r.t.median_ms * 1e6);
  } catch (const Error& e) {
    r.rejected_reason = one_line(e.what());
    r.failed = true;
  }
  return r;
}

std::vector<Record> bench_config(const Config& c, const Settings& s, Progress& progress) {
  const AttentionCase& p = c.problem;
  const Operands ops = make_operands(p);
  const std::string label = c.kind + " " + p.backend + " " + device_name(p.device) + " " + dtype_name(p.dtype) +
                            " T=" + std::to_string(p.seq_k) + " ";
  const std::string auto_kernel = [&] {
    ForceKernels force("auto");
    return explain_attention(ops.q, ops.k, ops.v, ops.opts).kernel;
  }();
  progress.step(label + "reference");
  std::optional<Tensor> ref;
  Record ref_row = measure(c, ops, "reference", auto_kernel, std::nullopt, s, &ref);
  if (ref) ref_row.max_abs_err = 0;

  std::vector<Record> out;
  for (const std::string& k : kernels_of(p, s)) {
    progress.step(label + k);
    if (auto why = rejection(ops, k))
      out.push_back({&c, k, auto_kernel, why});
    else
      out.push_back(measure(c, ops, k, auto_kernel, ref, s));
  }
  out.push_back(ref_row);
  progress.step(label + "auto");
  out.push_back(measure(c, ops, "auto", auto_kernel, ref, s));  // not `selected`: that marks the kernel auto runs
  for (Record& r : out)
    r.speedup = r.rejected_reason || ref_row.rejected_reason ? NAN : ref_row.t.median_ms / r.t.median_ms;
  return out;
}

// --- output ---

std::string rows_label(const AttentionCase& p) {
  return p.groups > 1 ? std::to_string(p.groups) + "x" + std::to_string(p.seq_q) : std::to_string(p.seq_q);
}

void print_header() {
  std::printf("%-6s %-7s %-6s %-8s %6s %5s  %-22s %10s %10s %8s %6s %7s %11s %s\n", "kind", "backend", "device",
              "dtype", "Tq", "Tk", "kernel", "median_ms", "min_ms", "GFLOP/s", "%peak", "vs_ref", "max_abs_err",
              "selected");
}

void print_row(const Record& r) {
  const AttentionCase& p = r.config->problem;
  const std::string kernel = r.kernel == "auto" ? "auto (" + r.auto_kernel + ")" : r.kernel;
  std::printf("%-6s %-7s %-6s %-8s %6s %5lld  %-22s ", r.config->kind.c_str(), p.backend.c_str(),
              device_name(p.device).c_str(), dtype_name(p.dtype), rows_label(p).c_str(),
              static_cast<long long>(p.seq_k), kernel.c_str());
  // NaN: no reference output or time to compare with.
  auto num = [](const char* format, double x) {
    char buf[32];
    std::snprintf(buf, sizeof buf, format, x);
    return std::isfinite(x) ? std::string(buf) : std::string("-");
  };
  if (r.rejected_reason)
    std::printf("%s: %s\n", r.failed ? "failed" : "rejected", r.rejected_reason->c_str());
  else
    std::printf("%10.3f %10.3f %8.1f %6s %7s %11s %s\n", r.t.median_ms, r.t.min_ms, r.gflops,
                num("%.0f%%", 100 * r.of_peak).c_str(), num("%.2fx", r.speedup).c_str(), num("%.2e", r.max_abs_err).c_str(), r.selected ? "*" : "");
  std::fflush(stdout);
}

void write_json(const std::string& path, const std::vector<Record>& records) {
  std::ofstream f(path);
  if (!f) throw Error("cannot write " + path);
  f << "[\n";
  for (size_t i = 0; i < records.size(); ++i) {
    const Record& r = records[i];
    const AttentionCase& p = r.config->problem;
    f << "  {\"config\": {\"kind\": " << testing::json_string(r.config->kind) << ", \"device\": "
      << testing::json_string(device_name(p.device)) << ", \"dtype\": " << testing::json_string(dtype_name(p.dtype))
      << ", \"backend\": " << testing::json_string(p.backend) << ", \"B\": " << p.batch << ", \"H\": " << p.heads
      << ", \"G\": " << p.groups << ", \"Tq\": " << p.seq_q << ", \"Tk\": " << p.seq_k << ", \"D\": " << p.head_dim
      << ", \"causal\": " << (p.causal ? "true" : "false") << "},\n   \"kernel\": " << testing::json_string(r.kernel)
      << ", \"auto_kernel\": " << testing::json_string(r.auto_kernel) << ", \"isa\": " << testing::json_string(r.isa)
      << ", \"selected\": " << (r.selected ? "true" : "false");
    if (r.rejected_reason) {
      f << ", \"rejected_reason\": " << testing::json_string((r.failed ? "failed: " : "") + *r.rejected_reason)
        << ", \"median_ms\": null, \"min_ms\": null, \"repeats\": 0, \"gflops\": null, "
           "\"of_peak\": null, \"speedup_vs_reference\": null, \"max_abs_err\": null";
    } else {
      f << ",\n   \"median_ms\": " << testing::json_number(r.t.median_ms) << ", \"min_ms\": " << testing::json_number(r.t.min_ms)
        << ", \"repeats\": " << r.t.repeats << ", \"gflops\": " << testing::json_number(r.gflops)
        << ", \"of_peak\": " << testing::json_number(r.of_peak)
        << ", \"speedup_vs_reference\": " << testing::json_number(r.speedup)
        << ", \"max_abs_err\": " << testing::json_number(r.max_abs_err);
    }
    f << "}" << (i + 1 < records.size() ? "," : "") << "\n";
  }
  f << "]\n";
  if (!f) throw Error("cannot write " + path);
}

void write_plot(const std::string& path, const std::vector<Record>& records) {
  std::vector<PlotPoint> points;
  for (const Record& r : records) {
    if (r.rejected_reason) continue;
    const AttentionCase& p = r.config->problem;
    const std::string kernel = p.backend + "/" + device_name(p.device) + " " + r.kernel;
    points.push_back({r.config->kind, kernel + " " + dtype_name(p.dtype), static_cast<double>(p.seq_k), r.t.median_ms,
                      kernel, dtype_name(p.dtype)});
  }
  write_svg_plot(path, "dot_attention forward, B=8 H=8 D=64: median time per call (color: kernel, line: dtype)", "T",
                 "ms", points);
}

}  // namespace

int run_bench(int argc, char** argv, int first) {
  const Args args("bench", kSummary, kOptions, argc, argv, first);
  if (args.help()) {
    std::printf("%s", args.usage().c_str());
    return 0;
  }
  const Settings s = parse_settings(args);
  for (const char* option : {"json", "plot"})  // fail before the run, not after it
    if (const auto path = args.value(option))
      if (!std::ofstream(*path)) throw Error("cannot write " + *path);
  const std::vector<Config> configs = suite(s);
  if (const std::string v = s.variants.describe(); !v.empty())
    std::printf("variants on every config:%s\n", v.c_str());
  int steps = 0;
  for (const Config& c : configs) steps += static_cast<int>(kernels_of(c.problem, s).size()) + 2;
  Progress progress(steps);
  const auto start = std::chrono::steady_clock::now();
  // Measured before any kernel runs, on the threads the kernels get.
  const double peak_f32 = testing::arithmetic_peak_gflops("float32", s.threads);
  const double peak_bf16 = testing::arithmetic_peak_gflops("bfloat16", s.threads);
  std::printf("machine peak on %d threads: float32 %.0f GFLOP/s (FMA), bfloat16 %.0f GFLOP/s (%s)\n", s.threads,
              peak_f32, peak_bf16, testing::arithmetic_peak_name("bfloat16").c_str());
  std::vector<Record> records;
  print_header();
  for (const Config& c : configs) {
    std::vector<Record> rs = bench_config(c, s, progress);
    progress.clear();
    for (Record& r : rs)
      if (c.problem.device.type == DeviceType::cpu && c.problem.dtype != DType::float64 && !r.rejected_reason)
        r.of_peak = r.gflops / (c.problem.dtype == DType::bfloat16 ? peak_bf16 : peak_f32);
    for (const Record& r : rs) print_row(r);
    records.insert(records.end(), rs.begin(), rs.end());
  }
  std::printf("%zu configs, %zu rows in %.1f s. %%peak: GFLOP/s over the machine peak above for the row's "
              "dtype (CPU rows); vs_ref: reference median / median; selected (*): the kernel auto picks\n",
              configs.size(), records.size(),
              std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  if (const auto path = args.value("json")) write_json(*path, records);
  if (const auto path = args.value("plot")) write_plot(*path, records);
  return 0;
}

}  // namespace dimattn::cli
