// kernel_bench's grid: every (dtype, D, T, causal) configuration timed side
// by side for ours, ATen and the reference path, with the GEMM rate, printed
// as a markdown table (and JSON with --json).
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu_backward.h>
#include <ATen/ops/empty_like.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <functional>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "dimattn/attention.h"
#include "dimattn/forcing.h"
#include "dimattn/ops.h"
#include "dimattn/testing/machine_peak.h"
#include "dimattn/torch_interop.h"
#include "kernel_bench.h"

namespace dimattn::bench::kernel_bench {
namespace {

at::ScalarType scalar_type(const std::string& name) { return name == "float32" ? at::kFloat : at::kBFloat16; }

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

// Our kernel on one code path: its own outputs, timed beside the others.
struct Ours {
  std::string isa;  // the path that ran (cpu_flash_isa)
  k::CpuIsa requested = k::CpuIsa::best;
  at::Tensor out, lse, dq, dk, dv;
  k::AttentionKernelParams p;
  double fwd = NAN, bwd = NAN;  // medians in seconds
  double err_out = NAN, err_grad = NAN, err_ref = NAN;  // vs ATen (grads relative to their max), vs ref
  bool ok = true;
};

struct Row {
  std::string dtype;
  int64_t D = 0, T = 0;
  bool causal = false;
  double flops_fwd = 0;
  std::vector<Ours> ours;  // one per code path, in --isa's order
  // medians in seconds; NAN = not run
  double aten_fwd = NAN, ref_fwd = NAN;
  double aten_bwd = NAN, ref_fwdbwd = NAN;
  int reps = 0;             // timed rounds
  std::string single_runs;  // variants timed once
  double gemm = NAN;  // GFLOP/s of the GEMM timed in the same rounds
  bool ok = true;     // every path agrees with ATen (and the reference)
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

// The code paths of --isa for a dtype, each once (avx512_bf16 runs float32
// on avx512's code: listed once, as avx512).
std::vector<std::pair<k::CpuIsa, std::string>> paths_for(const Options& o, k::ElementType dtype) {
  std::vector<std::pair<k::CpuIsa, std::string>> r;
  for (const std::string& name : o.isas) {
    const k::CpuIsa requested =
        name == "best" ? k::CpuIsa::best : k::cpu_isa_from_name(name, k::cpu_features(), "--isa");
    const std::string ran = k::cpu_isa_name(k::cpu_flash_isa(dtype, requested));
    if (std::none_of(r.begin(), r.end(), [&](const auto& x) { return x.second == ran; })) r.push_back({requested, ran});
  }
  return r;
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

  // Each path writes outputs of its own, compared with ATen's below.
  for (const auto& [requested, ran] : paths_for(o, pr.p.dtype)) {
    Ours u;
    u.isa = ran;
    u.requested = requested;
    u.p = pr.p;
    u.out = at::zeros_like(pr.out);
    u.lse = at::zeros_like(pr.lse);
    u.p.out = u.out.data_ptr();
    u.p.lse = u.lse.data_ptr();
    if (o.backward) {
      u.dq = at::zeros_like(pr.q);
      u.dk = at::zeros_like(pr.k);
      u.dv = at::zeros_like(pr.v);
      u.p.dq = u.dq.data_ptr();
      u.p.dk = u.dk.data_ptr();
      u.p.dv = u.dv.data_ptr();
    }
    row.ours.push_back(std::move(u));
  }

  at::Tensor aout, alse, adq, adk, adv;
  std::vector<Variant> vs;
  for (Ours& u : row.ours)
    vs.push_back({"ours fwd " + u.isa, [&] { k::flash_attention_forward_cpu(u.p, pf, u.requested); }});
  // A sliding window on the first path: the kv blocks outside the band are
  // skipped, so the time should follow the FLOPs (row i attends min(i, N) + 1
  // positions).
  k::AttentionKernelParams windowed = row.ours[0].p;
  const at::Tensor window_out = at::empty_like(pr.out);  // its own output: the path's is compared with ATen's
  if (causal && o.window > 0) {
    windowed.bounds.window_left = o.window;
    windowed.out = window_out.data_ptr();
    windowed.lse = nullptr;
    vs.push_back({"ours window fwd", [&] { k::flash_attention_forward_cpu(windowed, pf, row.ours[0].requested); }});
  }
  // Soft-capping on the first path, forward and backward on outputs of its
  // own: the same products, plus the cap's tanh per score (and 1 - tanh^2
  // per dS), so its time against the plain one is that per-element cost.
  k::AttentionKernelParams capped = row.ours[0].p;
  at::Tensor cap_out, cap_lse, cap_dq, cap_dk, cap_dv;
  if (o.softcap > 0) {
    capped.score.softcap = o.softcap;
    cap_out = at::empty_like(pr.out), cap_lse = at::empty_like(pr.lse);
    capped.out = cap_out.data_ptr(), capped.lse = cap_lse.data_ptr();
    vs.push_back({"ours softcap fwd", [&] { k::flash_attention_forward_cpu(capped, pf, row.ours[0].requested); }});
    if (o.backward) {
      cap_dq = at::empty_like(pr.q), cap_dk = at::empty_like(pr.k), cap_dv = at::empty_like(pr.v);
      capped.dq = cap_dq.data_ptr(), capped.dk = cap_dk.data_ptr(), capped.dv = cap_dv.data_ptr();
      vs.push_back({"ours softcap bwd", [&] { k::flash_attention_backward_cpu(capped, pf, row.ours[0].requested); }});
    }
  }
  vs.push_back({"aten fwd", [&] {
                  std::tie(aout, alse) = at::_scaled_dot_product_flash_attention_for_cpu(pr.q, pr.k, pr.v, 0.0, causal);
                }});
  if (o.backward) {
    for (Ours& u : row.ours)
      vs.push_back({"ours bwd " + u.isa, [&] { k::flash_attention_backward_cpu(u.p, pf, u.requested); }});
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
  for (Ours& u : row.ours) {
    u.fwd = med("ours fwd " + u.isa);
    u.bwd = med("ours bwd " + u.isa);
  }
  if (causal && o.window > 0) {
    const double n = static_cast<double>(std::min(o.window, T - 1)), t = static_cast<double>(T);
    const double pairs_window = t * (n + 1) - n * (n + 1) / 2, pairs_causal = t * (t + 1) / 2;
    const double full = row.ours[0].fwd;
    const double time_ratio = med("ours window fwd") / full, flop_ratio = pairs_window / pairs_causal;
    std::printf("window %lld, %s D=%lld T=%lld, isa %s: forward %.1f ms vs %.1f ms full causal: time ratio %.4f, "
                "FLOP ratio %.4f, time / FLOP ratio %.2f\n",
                static_cast<long long>(o.window), dtype.c_str(), static_cast<long long>(D), static_cast<long long>(T),
                row.ours[0].isa.c_str(), 1e3 * med("ours window fwd"), 1e3 * full, time_ratio, flop_ratio,
                time_ratio / flop_ratio);
  }
  if (o.softcap > 0) {
    std::printf("softcap %g, %s D=%lld T=%lld %s, isa %s: forward %.1f ms vs %.1f ms plain (%.2fx)", o.softcap,
                dtype.c_str(), static_cast<long long>(D), static_cast<long long>(T), causal ? "causal" : "full",
                row.ours[0].isa.c_str(), 1e3 * med("ours softcap fwd"), 1e3 * row.ours[0].fwd,
                med("ours softcap fwd") / row.ours[0].fwd);
    if (o.backward)
      std::printf("; backward %.1f ms vs %.1f ms plain (%.2fx)", 1e3 * med("ours softcap bwd"), 1e3 * row.ours[0].bwd,
                  med("ours softcap bwd") / row.ours[0].bwd);
    std::printf("\n");
  }
  row.aten_fwd = med("aten fwd");
  row.aten_bwd = med("aten bwd");
  row.ref_fwd = med("ref fwd");
  row.ref_fwdbwd = med("ref fwd+bwd");
  if (gemm) row.gemm = gemm->flops() / med("gemm") / 1e9;
  for (const Variant& v : vs)
    if (!v.repeat) row.single_runs += (row.single_runs.empty() ? "" : ", ") + v.name;

  // Agreement: each path against ATen (and the reference where it ran).
  // Loose bounds that catch a wrong setup, not rounding (bfloat16 stores ~3
  // digits; the avx512_bf16 path also rounds the weights to bfloat16).
  const bool f32 = dt == at::kFloat;
  const double tol_out = f32 ? 1e-4 : 5e-2, tol_grad = f32 ? 1e-3 : 5e-2;
  for (Ours& u : row.ours) {
    u.err_out = max_abs_diff(u.out, aout);
    if (o.backward) {
      u.err_grad = 0;
      const std::pair<at::Tensor, at::Tensor> grads[] = {{u.dq, adq}, {u.dk, adk}, {u.dv, adv}};
      for (const auto& [ours, theirs] : grads)
        u.err_grad = std::max(u.err_grad, max_abs_diff(ours, theirs) / std::max(max_abs(theirs), 1e-30));
    }
    if (ref_out.defined()) u.err_ref = max_abs_diff(u.out, ref_out);
    u.ok = u.err_out <= tol_out && (!o.backward || u.err_grad <= tol_grad) &&
           (std::isnan(u.err_ref) || u.err_ref <= tol_out);
    row.ok = row.ok && u.ok;
  }
  return row;
}

// ---------------------------------------------------------------------------
// Output

void print_table(const std::vector<Row>& rows, const RunInfo& info, bool backward) {
  const double gemm_global = std::fmax(info.gemm_before, info.gemm_after);  // NAN-safe
  std::vector<std::string> columns = {"dtype", "D", "T", "causal", "isa", "fwd ms ours / ATen / ref",
                                      "fwd GFLOP/s ours / ATen", "fwd speedup", "fwd %GEMM", "fwd %peak"};
  if (backward)
    columns.insert(columns.end(), {"bwd ms ours / ATen", "bwd GFLOP/s ours / ATen", "bwd speedup", "bwd %GEMM", "bwd %peak",
                                   "fwd+bwd ms ours / ATen / ref", "fwd+bwd speedup"});
  columns.insert(columns.end(), {"GEMM GFLOP/s", "reps"});
  std::printf("\n");
  print_table_header(columns);
  for (const Row& r : rows)
    for (const Ours& u : r.ours) {
      const double fb_ours = u.fwd + u.bwd, fb_aten = r.aten_fwd + r.aten_bwd;
      const double f = r.flops_fwd;
      const double gemm = std::isnan(r.gemm) ? gemm_global : r.gemm;
      const double peak = r.dtype == "float32" ? info.peak_float32 : info.peak_bfloat16;
      std::vector<std::string> cells = {
          r.dtype == "float32" ? "f32" : "bf16",
          std::to_string(r.D),
          std::to_string(r.T),
          r.causal ? "yes" : "no",
          u.isa,
          fmt_ms(u.fwd) + " / " + fmt_ms(r.aten_fwd) + " / " + fmt_ms(r.ref_fwd),
          fmt("%.1f", gflops(f, u.fwd)) + " / " + fmt("%.1f", gflops(f, r.aten_fwd)),
          fmt("%.2fx", r.aten_fwd / u.fwd),
          fmt("%.0f%%", 100 * gflops(f, u.fwd) / gemm),
          fmt("%.0f%%", 100 * gflops(f, u.fwd) / peak)};
      if (backward)
        cells.insert(cells.end(),
                     {fmt_ms(u.bwd) + " / " + fmt_ms(r.aten_bwd),
                      fmt("%.1f", gflops(2.5 * f, u.bwd)) + " / " + fmt("%.1f", gflops(2.5 * f, r.aten_bwd)),
                      fmt("%.2fx", r.aten_bwd / u.bwd), fmt("%.0f%%", 100 * gflops(2.5 * f, u.bwd) / gemm),
                      fmt("%.0f%%", 100 * gflops(2.5 * f, u.bwd) / peak),
                      fmt_ms(fb_ours) + " / " + fmt_ms(fb_aten) + " / " + fmt_ms(r.ref_fwdbwd),
                      fmt("%.2fx", fb_aten / fb_ours)});
      cells.insert(cells.end(), {fmt("%.1f", gemm), std::to_string(r.reps) + (r.single_runs.empty() ? "" : "; once: " + r.single_runs)});
      print_table_row(cells);
    }
  std::printf(
      "\nms: median %s time; fwd+bwd = forward + backward medians. speedup = ATen ms / ours ms (> 1: ours "
      "faster). GFLOP/s per DESIGN.md §9 (fwd 4·B·H·T²·D, causal half; bwd 2.5x). %%GEMM: ours over the GEMM "
      "column, the fp32 at::mm rate timed in the same rounds (else the higher of the before/after GEMM). %%peak: "
      "ours over the machine's arithmetic peak on these threads (float32: %.1f GFLOP/s FMA; bfloat16: %.1f, %s). isa: "
      "the code path of ours that ran. ref: dot_attention forced to \"reference\" (–: not run).\n",
      info.clock.c_str(), info.peak_float32, info.peak_bfloat16, testing::arithmetic_peak_name("bfloat16").c_str());
  bool all_ok = true;
  for (const Row& r : rows) all_ok = all_ok && r.ok;
  std::printf("agreement with ATen%s: %s\n", rows.empty() ? "" : " (max |Δout|, max rel |Δgrad|, max |Δout| vs ref)",
              all_ok ? "ok" : "FAILED");
  for (const Row& r : rows)
    for (const Ours& u : r.ours)
      std::printf("  %s D%ld T%ld %s %s: %s %s %s%s\n", r.dtype.c_str(), static_cast<long>(r.D),
                  static_cast<long>(r.T), r.causal ? "causal" : "full", u.isa.c_str(), fmt("%.1e", u.err_out).c_str(),
                  fmt("%.1e", u.err_grad).c_str(), fmt("%.1e", u.err_ref).c_str(), u.ok ? "" : "  <-- exceeds tolerance");
}

void write_json(const std::string& path, const std::vector<Row>& rows, const RunInfo& info) {
  std::ofstream f(path);
  write_json_header(f, info);
  f << ",\n  \"gemm\": {\"n\": " << info.gemm_n << ", \"round_n\": " << info.gemm_round_n << ", \"gflops_before\": " << json_number(info.gemm_before)
    << ", \"gflops_after\": " << json_number(info.gemm_after) << "},\n  \"peak_gflops\": {\"float32\": "
    << json_number(info.peak_float32) << ", \"bfloat16\": " << json_number(info.peak_bfloat16) << "},\n  \"rows\": [";
  bool first = true;
  for (const Row& r : rows)
    for (const Ours& u : r.ours) {
      const double f3 = 3.5 * r.flops_fwd;
      f << (first ? "" : ",") << "\n    {\"dtype\": " << json_string(r.dtype) << ", \"D\": " << r.D << ", \"T\": " << r.T
        << ", \"causal\": " << (r.causal ? "true" : "false") << ", \"isa\": " << json_string(u.isa)
        << ", \"flops_fwd\": " << json_number(r.flops_fwd) << ", \"gemm_gflops\": " << json_number(r.gemm)
        << ", \"reps\": " << r.reps << ", \"single_runs\": " << json_string(r.single_runs)
        << ",\n     \"ms\": {\"ours_fwd\": " << json_number(u.fwd * 1e3) << ", \"aten_fwd\": " << json_number(r.aten_fwd * 1e3)
        << ", \"ref_fwd\": " << json_number(r.ref_fwd * 1e3) << ", \"ours_bwd\": " << json_number(u.bwd * 1e3)
        << ", \"aten_bwd\": " << json_number(r.aten_bwd * 1e3) << ", \"ref_fwd_bwd\": " << json_number(r.ref_fwdbwd * 1e3)
        << "},\n     \"gflops\": {\"ours_fwd\": " << json_number(gflops(r.flops_fwd, u.fwd))
        << ", \"aten_fwd\": " << json_number(gflops(r.flops_fwd, r.aten_fwd))
        << ", \"ours_bwd\": " << json_number(gflops(2.5 * r.flops_fwd, u.bwd))
        << ", \"aten_bwd\": " << json_number(gflops(2.5 * r.flops_fwd, r.aten_bwd))
        << ", \"ours_fwd_bwd\": " << json_number(gflops(f3, u.fwd + u.bwd))
        << ", \"aten_fwd_bwd\": " << json_number(gflops(f3, r.aten_fwd + r.aten_bwd))
        << ", \"ref_fwd_bwd\": " << json_number(gflops(f3, r.ref_fwdbwd))
        << "},\n     \"max_abs_err_out_vs_aten\": " << json_number(u.err_out)
        << ", \"max_rel_err_grad_vs_aten\": " << json_number(u.err_grad)
        << ", \"max_abs_err_out_vs_ref\": " << json_number(u.err_ref) << ", \"ok\": " << (u.ok ? "true" : "false") << "}";
      first = false;
    }
  f << "\n  ]\n}\n";
}

}  // namespace

int grid_mode(const Options& o, RunInfo info) {
  if (o.cpu_clock && o.threads > 1)
    std::printf("note: --clock=cpu with %d threads counts the CPU time of every thread, spin-waiting included\n",
                o.threads);

  const double start = now_s();
  if (o.gemm_n > 0) {
    info.gemm_before = gemm_gflops(o.gemm_n);
    std::printf("fp32 GEMM at::mm %ld^3, %d threads: %.1f GFLOP/s\n", static_cast<long>(o.gemm_n), o.threads,
                info.gemm_before);
  }
  info.peak_float32 = testing::arithmetic_peak_gflops("float32", o.threads);
  info.peak_bfloat16 = testing::arithmetic_peak_gflops("bfloat16", o.threads);
  std::printf("arithmetic peak, %d threads: float32 %.1f GFLOP/s (FMA), bfloat16 %.1f GFLOP/s (%s)\n", o.threads,
              info.peak_float32, info.peak_bfloat16, testing::arithmetic_peak_name("bfloat16").c_str());
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
          std::string ours;
          for (const Ours& u : r.ours)
            ours += " " + u.isa + " " + fmt_ms(u.fwd) + " / " + fmt_ms(u.bwd) + " ms,";
          std::fprintf(stderr, "[%6.0f s] %s D%ld T%ld %s: fwd / bwd ours%s ATen %s / %s ms, GEMM %s GFLOP/s (%d reps, %.1f s)\n",
                       now_s() - start, dtype.c_str(), static_cast<long>(D), static_cast<long>(T),
                       c ? "causal" : "full", ours.c_str(), fmt_ms(r.aten_fwd).c_str(),
                       fmt_ms(r.aten_bwd).c_str(), fmt("%.1f", r.gemm).c_str(), r.reps, now_s() - t0);
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

}  // namespace dimattn::bench::kernel_bench
