// `dimattn check`: random attention calls through every eligible kernel of
// every backend, each compared with the reference path on the same backend.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <random>

#include "cli_args.h"
#include "commands.h"
#include "dimattn/tolerance.h"
#include "dimattn/ext/backend.h"
#include "dimattn/error.h"
#include "dimattn/registry.h"
#include "dimattn/run_context.h"
#include "problem.h"

namespace dimattn::cli {
namespace {

const char* const kSummary =
    "usage: dimattn check [--cases N] [--seed S]\n"
    "\n"
    "Runs random attention calls (self, cross and single-step; query groups and beams;\n"
    "keys-only dims; separate, permuted and packed q/k/v; kv lengths including 0; causal\n"
    "with and without offsets; dropout; float32, float64 and bfloat16) through every\n"
    "eligible kernel of every backend and device, and compares each output with the\n"
    "reference path's (tolerances of DESIGN.md §6, scaled by the output's magnitude when\n"
    "it exceeds 1). Exit status 1 on any disagreement.";

const std::vector<Option> kOptions = {
    {"cases", "N", "random calls (default 200)"},
    {"seed", "S", "seed of the case generator (default 1)"},
};


// A random small call; the backend and device are filled in per run.
AttentionCase random_problem(std::mt19937_64& rng) {
  auto pick = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); };
  auto chance = [&](double p) { return std::uniform_real_distribution<double>(0, 1)(rng) < p; };
  AttentionCase p;
  p.dtype = std::vector{DType::float32, DType::float64, DType::bfloat16}[pick(0, 2)];
  const int64_t k = pick(0, 9);
  p.kind = k < 4 ? Kind::self : k < 8 ? Kind::cross : Kind::step;
  p.batch = pick(1, 3);
  p.heads = pick(1, 3);
  if (chance(0.4)) {
    p.groups = pick(2, 4);
    p.group_name = chance(0.5) ? "beam" : "group";
  }
  p.seq_k = pick(1, 12);
  p.seq_q = p.kind == Kind::self ? p.seq_k : p.kind == Kind::cross ? pick(1, 10) : 1;
  const std::vector<int64_t> head_dims = {1, 3, 8, 16, 32, 64};
  p.head_dim = head_dims[pick(0, 5)];
  p.head_dim_v = chance(0.7) ? p.head_dim : head_dims[pick(0, 5)];
  if (p.kind != Kind::step && chance(0.5)) {
    p.causal = true;
    if (p.kind == Kind::cross && chance(0.6))
      for (int64_t b = 0; b < p.batch; ++b) p.offsets.push_back(pick(0, p.seq_k));
    else if (p.kind == Kind::cross)
      p.seq_q = p.seq_k;  // causal without offsets needs equal extents
  }
  if (chance(0.4)) {
    for (int64_t b = 0; b < p.batch; ++b) p.lengths.push_back(pick(0, p.seq_k));
    if (chance(0.3)) p.lengths[static_cast<size_t>(pick(0, p.batch - 1))] = 0;
  }
  if (chance(0.2)) {
    p.dropout = chance(0.5) ? 0.1 : 0.3;
    p.broadcast_dropout = chance(0.5);
  }
  if (chance(0.15)) p.scale = std::uniform_real_distribution<double>(0.1, 1.0)(rng);
  if (chance(0.15)) p.keys_only = pick(2, 3);
  if (chance(0.2)) p.layout = Layout::permuted;
  if (p.kind == Kind::self && p.groups == 1 && p.keys_only == 1 && p.head_dim == p.head_dim_v && chance(0.3))
    p.layout = Layout::packed_qkv;
  p.seed = rng();
  return p;
}

struct ErrorStat {
  int runs = 0;
  double max_err = 0, worst_ratio = 0;  // worst_ratio: error / its tolerance
};

struct Summary {
  int cases = 0, runs = 0;
  std::map<std::pair<std::string, DType>, ErrorStat> errors;  // (backend/kernel, dtype)
  std::map<std::string, int> rejections;                      // "backend/kernel: reason" -> count
  std::vector<std::string> disagreements;
};

// Every eligible kernel of one backend and device on p, against the reference.
void check_on(AttentionCase p, const std::string& backend, Device device, int case_index, Summary& s) {
  p.backend = backend;
  p.device = device;
  TrainFlagScope train(p.dropout > 0);
  const Operands ops = make_operands(p);
  // Each run draws the same dropout seed, so every kernel sees the same mask.
  auto run = [&](const std::string& kernel) {
    set_random_seed(p.seed);
    return run_forced(ops, kernel);
  };
  const Tensor ref = run("reference");
  const double tol = reference_tolerance(p.dtype) * std::max(1.0, max_abs(ref));
  for (const std::string& kernel : get_backend(backend).attention_kernels(device)) {
    if (kernel == "reference") continue;
    const std::string name = backend + "/" + kernel + (device == kCPU ? "" : "@" + device_name(device));
    if (const auto why = rejection(ops, kernel)) {
      ++s.rejections[name + ": " + *why];
      continue;
    }
    ++s.runs;
    const std::string where = "case " + std::to_string(case_index) + " (" + p.describe() + ") " + name;
    double err;
    try {
      err = max_abs_diff(run(kernel), ref, ops.out_order);
    } catch (const Error& e) {
      s.disagreements.push_back(where + ": failed: " + e.what());
      continue;
    }
    ErrorStat& e = s.errors[{name, p.dtype}];
    ++e.runs;
    e.max_err = std::max(e.max_err, err);
    e.worst_ratio = std::max(e.worst_ratio, err / tol);
    if (!(err <= tol)) {
      char buf[96];
      std::snprintf(buf, sizeof buf, ": max abs err %.3g > tolerance %.3g", err, tol);
      s.disagreements.push_back(where + buf);
    }
  }
}

void print_summary(const Summary& s, uint64_t seed, double seconds) {
  std::printf("check: %d cases (seed %llu), %d kernel runs compared with the reference, %zu disagreements, %.1f s\n",
              s.cases, static_cast<unsigned long long>(seed), s.runs, s.disagreements.size(), seconds);
  std::printf("\nmax abs error vs the reference, per kernel and dtype (tolerance x max(1, |reference|)):\n");
  std::printf("  %-28s %-9s %5s %12s %10s %14s\n", "kernel", "dtype", "runs", "max_abs_err", "tolerance",
              "worst_err/tol");
  for (const auto& [key, e] : s.errors)
    std::printf("  %-28s %-9s %5d %12.3g %10.0e %14.3f\n", key.first.c_str(), dtype_name(key.second), e.runs,
                e.max_err, reference_tolerance(key.second), e.worst_ratio);
  std::printf("\nrejections by reason:\n");
  if (s.rejections.empty()) std::printf("  none\n");
  for (const auto& [reason, n] : s.rejections) std::printf("  %5d  %s\n", n, reason.c_str());
  if (!s.disagreements.empty()) {
    std::printf("\nDISAGREEMENTS:\n");
    for (const std::string& d : s.disagreements) std::printf("  %s\n", d.c_str());
  }
}

}  // namespace

int run_check(int argc, char** argv, int first) {
  const Args args("check", kSummary, kOptions, argc, argv, first);
  if (args.help()) {
    std::printf("%s", args.usage().c_str());
    return 0;
  }
  const int64_t cases = args.integer("cases", 200, 0);
  const uint64_t seed = static_cast<uint64_t>(args.integer("seed", 1, 0));
  const auto start = std::chrono::steady_clock::now();
  std::mt19937_64 rng(seed);
  Summary s;
  for (int64_t i = 0; i < cases; ++i) {
    const AttentionCase p = random_problem(rng);
    for (const std::string& backend : backend_names())
      for (Device device : {kCPU, kCUDA})
        if (get_backend(backend).supports(device)) check_on(p, backend, device, static_cast<int>(i), s);
    ++s.cases;
  }
  print_summary(s, seed, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  return s.disagreements.empty() ? 0 : 1;
}

}  // namespace dimattn::cli
