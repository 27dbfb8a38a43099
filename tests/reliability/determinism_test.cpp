// Determinism of the CPU kernels (docs/reliability.md): the same inputs and
// seed give bitwise identical forward results and gradients across repeated
// runs and across threads; across processes, bitwise where dimattn owns the
// arithmetic; across thread counts, bitwise there and to rounding where ATen
// does the arithmetic.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <unistd.h>

#include "dimattn/attention.h"
#include "dimattn/ext/backend.h"
#include "dimattn/forcing.h"
#include "dimattn/ext/backend.h"
#include "dimattn/registry.h"
#include "dimattn/run_context.h"
#include "dimattn/tolerance.h"
#include "support/test_util.h"

#ifdef DIMATTN_TEST_TORCH
#include <ATen/Parallel.h>
#endif
#if __has_include("dimattn/cpu_threads.h")
#include "dimattn/cpu_threads.h"
#define DIMATTN_TEST_CPU_THREADS 1
#endif

namespace dimattn {
namespace {

// FNV-1a over the bytes of the values: equal digests ⇔ (practically) bitwise equal.
uint64_t digest(const std::vector<double>& xs, uint64_t h = 1469598103934665603ULL) {
  for (double x : xs) {
    unsigned char b[sizeof x];
    std::memcpy(b, &x, sizeof x);
    for (unsigned char c : b) h = (h ^ c) * 1099511628211ULL;
  }
  return h;
}

struct Case {
  std::string name;
  bool causal = false, padding = false, dropout = false, broadcast = false;
  DType dtype = DType::float32;
};

const std::vector<Case>& cases() {
  static const std::vector<Case> cs = {
      {"plain"},
      {"causal_padded", true, true},
      {"dropout", false, true, true},
      {"dropout_broadcast_causal", true, false, true, true},
      {"float64_padded", false, true, false, false, DType::float64},
      {"bfloat16_causal", true, false, false, false, DType::bfloat16},
  };
  return cs;
}

// Forward values and, when `backward`, the gradients of q, k and v (torch:
// autograd; other backends: dot_attention_backward, for cpu_flash) for one
// case on one kernel, as one vector whose first *n_forward values are the
// forward result; empty when the kernel cannot run the case (the error goes
// to *why).
std::vector<double> run_case(const std::string& be, const std::string& kernel, const Case& c, bool backward,
                             std::string* why, size_t* n_forward = nullptr) {
  const TensorOptions o{.dtype = c.dtype, .backend = be};
  Dim batch("batch", 3), heads("heads", 2), time("time", 33), feat("feat", 16), vfeat("vfeat", 16);
  Dim kv = time;
  if (c.padding) kv = Dim::dynamic("kv", from_host({batch}, {33, 17, 1}, {.dtype = DType::int64, .backend = be}), 33);
  Tensor q = random_normal({batch, heads, time, feat}, 1, o);
  Tensor k = random_normal({batch, heads, kv, feat}, 2, o);
  Tensor v = random_normal({batch, heads, kv, vfeat}, 3, o);
  const bool autograd = backward && get_backend(be).has_autograd();
  const bool explicit_backward = backward && !autograd && kernel == "cpu_flash";
  if (autograd) q.requires_grad(true), k.requires_grad(true), v.requires_grad(true);
  AttentionOptions opts{.key_dim = feat, .axis = kv, .att_dropout = c.dropout ? 0.2 : 0.0,
                        .att_dropout_broadcast = c.broadcast};
  if (c.causal) {
    // Self-attention when kv is time itself, else a causal chunk with offsets.
    opts.causal_query_spatial_dim = time;
    if (kv != time) opts.causal_offset = from_host({batch}, {0, 0, 0}, {.dtype = DType::int64, .backend = be});
  }
  ForceKernels force(kernel);
  TrainFlagScope train(c.dropout);
  set_random_seed(2024);
  std::vector<double> all;
  try {
    Tensor out = dot_attention(q, k, v, opts);
    all = to_host(out);
    if (n_forward) *n_forward = all.size();
    const Tensor w = random_normal(out.dims(), 4, {.dtype = out.dtype(), .backend = be});
    std::vector<Tensor> grads;
    if (autograd) {
      reduce_sum(mul(out, w), out.dims()).backward();
      grads = {*q.grad(), *k.grad(), *v.grad()};
    } else if (explicit_backward) {
      set_random_seed(2024);  // the forward call's seed: the same dropout mask
      const AttentionGrads g = dot_attention_backward(q, k, v, opts, w);
      grads = {g.query, g.keys, g.values};
    }
    for (const Tensor& g : grads) {
      std::vector<double> h = to_host(g);
      all.insert(all.end(), h.begin(), h.end());
    }
  } catch (const Error& e) {
    *why = e.what();
    return {};
  }
  return all;
}

struct KernelCase {
  std::string backend, kernel;
};
void PrintTo(const KernelCase& k, std::ostream* os) { *os << k.backend << "/" << k.kernel; }
std::vector<KernelCase> cpu_kernels() {
  std::vector<KernelCase> ks;
  for (const std::string& be : backend_names())
    for (const std::string& k : get_backend(be).attention_kernels(kCPU)) ks.push_back({be, k});
  return ks;
}

// Which kernel runs which case, as their gates document it: ATen's kernels
// reject dropout (its mask would come from ATen's RNG, not the shared Philox
// stream); cpu_flash and the reference path run every case. A rejection of a
// case a kernel must run is a failure, never a skip.
bool must_run(const std::string& kernel, const Case& c) { return !(c.dropout && kernel.rfind("aten_", 0) == 0); }

size_t cases_to_run(const std::string& kernel) {
  return static_cast<size_t>(
      std::count_if(cases().begin(), cases().end(), [&](const Case& c) { return must_run(kernel, c); }));
}

// run_case, checked against must_run: the result of a case the kernel must
// run (nullopt and a failure when it does not), nullopt for a case its gate
// rejects as documented (and a failure when it runs it after all).
std::optional<std::vector<double>> run_checked(const std::string& be, const std::string& kernel, const Case& c,
                                               size_t* n_forward = nullptr) {
  std::string why;
  std::vector<double> r = run_case(be, kernel, c, true, &why, n_forward);
  if (!must_run(kernel, c)) {
    EXPECT_NE(why.find("no forced kernel can run"), std::string::npos)
        << be << "/" << kernel << " must reject " << c.name << " (dropout from ATen's RNG); got "
        << (why.empty() ? "a result" : why);
    return std::nullopt;
  }
  EXPECT_TRUE(why.empty()) << be << "/" << kernel << " must run " << c.name << ": " << why;
  if (!why.empty()) return std::nullopt;
  return r;
}

// Where dimattn owns the arithmetic, so that no thread count can change a
// bit: cpu_flash on every backend (each output block and each kv chunk of the
// backward pass is one task, partial dq sums are added in chunk order, and no
// block size depends on the thread count), and the Eigen backend's reference
// path (Eigen's GEMM, compiled into dimattn without OpenMP: one thread,
// whatever the settings). ATen's paths — aten_flash_cpu, aten_math and the
// torch backend's reference path, which runs ATen's matmuls and reductions —
// block their sums by ATen's thread count (MKL/oneDNN; on an AVX-512 Zen 4
// aten_math's bits changed between 1 and 4 threads), so there results agree
// to rounding only.
bool bitwise_across_thread_counts(const std::string& be, const std::string& kernel) {
  return kernel == "cpu_flash" || (be != "torch" && kernel == "reference");
}

// Agreement to rounding (DESIGN.md §6, dimattn/tolerance.h): the forward
// result within reference_tolerance(dtype), gradients within twice that, each
// relative to its largest magnitude where that is above 1.
void expect_rounding_close(const std::vector<double>& got, const std::vector<double>& want, size_t n_forward,
                           DType dtype, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  const auto worst = [&](size_t begin, size_t end, double tol) {
    double err = 0, scale = 1;
    for (size_t i = begin; i < end; ++i) {
      scale = std::max(scale, std::abs(want[i]));
      const double d = std::abs(got[i] - want[i]);
      err = std::isnan(d) ? INFINITY : std::max(err, d);
    }
    EXPECT_LE(err, tol * scale) << what << (begin == 0 ? " forward" : " gradients") << " (scale " << scale << ")";
  };
  worst(0, n_forward, reference_tolerance(dtype));
  worst(n_forward, want.size(), 2 * reference_tolerance(dtype));
}

class Determinism : public ::testing::TestWithParam<KernelCase> {};

TEST_P(Determinism, RepeatedRunsAreBitwiseIdentical) {
  const auto& [be, kernel] = GetParam();
  size_t ran = 0;
  for (const Case& c : cases()) {
    const std::optional<std::vector<double>> a = run_checked(be, kernel, c);
    if (!a) continue;
    ++ran;
    reset_selection_cache();  // a fresh selection must not change the result either
    std::string why;
    const std::vector<double> b = run_case(be, kernel, c, true, &why);
    EXPECT_EQ(digest(*a), digest(b)) << c.name << " " << why;
  }
  EXPECT_EQ(ran, cases_to_run(kernel)) << be << "/" << kernel;
}

TEST_P(Determinism, OtherThreadsGiveTheSameBits) {
  const auto& [be, kernel] = GetParam();
  size_t ran = 0;
  for (const Case& c : cases()) {
    const std::optional<std::vector<double>> main_thread = run_checked(be, kernel, c);
    if (!main_thread) continue;
    ++ran;
    std::vector<double> results[3];
    std::vector<std::thread> threads;
    for (auto& r : results) threads.emplace_back([&r, &c, be = be, kernel = kernel] {
      std::string w;
      r = run_case(be, kernel, c, true, &w);
    });
    for (auto& t : threads) t.join();
    for (const auto& r : results) EXPECT_EQ(digest(r), digest(*main_thread)) << c.name;
  }
  EXPECT_EQ(ran, cases_to_run(kernel)) << be << "/" << kernel;
}

#ifdef DIMATTN_TEST_TORCH
// ATen's intra-op thread count (at::set_num_threads 1, 2, 4), forward and
// gradients: bitwise where dimattn owns the arithmetic, to rounding on ATen's
// paths (bitwise_across_thread_counts). Backends other than torch do not use
// ATen's pool, so their results must not change at all.
TEST_P(Determinism, AtenThreadCountsGiveTheSameResult) {
  const auto& [be, kernel] = GetParam();
  const bool bitwise = bitwise_across_thread_counts(be, kernel);
  const int saved = at::get_num_threads();
  size_t ran = 0;
  for (const Case& c : cases()) {
    at::set_num_threads(1);
    size_t n_forward = 0;
    const std::optional<std::vector<double>> one = run_checked(be, kernel, c, &n_forward);
    if (!one) continue;
    ++ran;
    for (int n : {2, 4}) {
      at::set_num_threads(n);
      std::string why;
      const std::vector<double> other = run_case(be, kernel, c, true, &why);
      const std::string what = c.name + " at " + std::to_string(n) + " threads " + why;
      if (bitwise)
        EXPECT_EQ(digest(other), digest(*one)) << what;
      else
        expect_rounding_close(other, *one, n_forward, c.dtype, what);
    }
  }
  at::set_num_threads(saved);
  EXPECT_EQ(ran, cases_to_run(kernel)) << be << "/" << kernel;
}
#endif

#ifdef DIMATTN_TEST_CPU_THREADS
// dimattn's own pool (set_cpu_threads 1, 2, 4), which runs cpu_flash on
// backends without a pool of their own (Eigen): the same bits. The torch
// backend runs everything on ATen's pool, so its results must not change
// either.
TEST_P(Determinism, CpuThreadCountsGiveTheSameBits) {
  const auto& [be, kernel] = GetParam();
  size_t ran = 0;
  for (const Case& c : cases()) {
    set_cpu_threads(1);
    const std::optional<std::vector<double>> one = run_checked(be, kernel, c);
    if (!one) continue;
    ++ran;
    for (int n : {2, 4}) {
      set_cpu_threads(n);
      std::string why;
      EXPECT_EQ(digest(run_case(be, kernel, c, true, &why)), digest(*one)) << c.name << " at " << n << " threads " << why;
    }
  }
  set_cpu_threads(0);
  EXPECT_EQ(ran, cases_to_run(kernel)) << be << "/" << kernel;
}
#endif

std::string kernel_case_name(const ::testing::TestParamInfo<KernelCase>& info) {
  return info.param.backend + "_" + info.param.kernel;
}
INSTANTIATE_TEST_SUITE_P(CpuKernels, Determinism, ::testing::ValuesIn(cpu_kernels()), kernel_case_name);

// Across processes: a child process (this binary, this test) computes the
// result of every case on every kernel whose arithmetic dimattn owns
// (bitwise_across_thread_counts); it must equal ours bit for bit. Catches
// results that depend on addresses (ASLR), e.g. through an order of dims by
// pointer. ATen's paths make no such promise: on an Intel Xeon (family 6
// model 207) the torch backend's reference path (ATen's matmuls, softmax and
// reductions) computed one (batch, head) of the causal padded case up to
// 2.5e-5 apart (relative) in about one process of 35, beyond float32's
// reference tolerance; docs/reliability.md.
std::vector<KernelCase> owned_kernels() {
  std::vector<KernelCase> ks;
  for (const KernelCase& kc : cpu_kernels())
    if (bitwise_across_thread_counts(kc.backend, kc.kernel)) ks.push_back(kc);
  return ks;
}

// The digest of every owned kernel's every case; `listed` (if given) gets a
// line per kernel and case with that result's own digest.
uint64_t all_digest(std::string* listed = nullptr) {
  uint64_t h = 1469598103934665603ULL;
  for (const KernelCase& kc : owned_kernels())
    for (const Case& c : cases()) {
      std::string why;
      const std::vector<double> r = run_case(kc.backend, kc.kernel, c, true, &why);
      h = digest(r, h);
      if (listed) *listed += kc.backend + "/" + kc.kernel + " " + c.name + " " + std::to_string(digest(r)) + "\n";
    }
  return h;
}

TEST(DeterminismAcrossProcesses, ChildProcessComputesTheSameBits) {
  if (const char* out = std::getenv("DIMATTN_DETERMINISM_CHILD_OUT")) {
    std::ofstream(out) << all_digest() << "\n";
    return;
  }
  ASSERT_GE(owned_kernels().size(), 2u) << "cpu_flash on every backend, the Eigen backend's reference";
  std::string listed;
  const uint64_t mine = all_digest(&listed);
  const std::string file = ::testing::TempDir() + "dimattn_determinism_child_" + std::to_string(::getpid()) + ".txt";
  const std::string self = std::filesystem::read_symlink("/proc/self/exe").string();
  const std::string cmd = "DIMATTN_DETERMINISM_CHILD_OUT='" + file + "' '" + self +
                          "' --gtest_filter=DeterminismAcrossProcesses.* > /dev/null 2>&1";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  uint64_t theirs = 0;
  std::ifstream(file) >> theirs;
  std::remove(file.c_str());
  EXPECT_EQ(theirs, mine) << "our digests per kernel and case:\n" << listed;
}

}  // namespace
}  // namespace dimattn
