// Determinism of the CPU kernels (docs/reliability.md): the same inputs and
// seed give bitwise identical forward results (and, on the torch backend,
// gradients) across repeated runs, across processes, across threads and
// across ATen's intra-op thread counts.
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

#include "dimattn/attention.h"
#include "dimattn/forcing.h"
#include "dimattn/registry.h"
#include "dimattn/run_context.h"
#include "tests/common/test_util.h"

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
// case on one kernel, as one vector; empty when the kernel cannot run the
// case (the error goes to *why).
std::vector<double> run_case(const std::string& be, const std::string& kernel, const Case& c, bool backward,
                             std::string* why) {
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
std::vector<KernelCase> cpu_kernels() {
  std::vector<KernelCase> ks;
  for (const std::string& be : backend_names())
    for (const std::string& k : get_backend(be).attention_kernels(kCPU)) ks.push_back({be, k});
  return ks;
}

class Determinism : public ::testing::TestWithParam<KernelCase> {};

TEST_P(Determinism, RepeatedRunsAreBitwiseIdentical) {
  const auto& [be, kernel] = GetParam();
  int ran = 0;
  for (const Case& c : cases()) {
    std::string why;
    const std::vector<double> a = run_case(be, kernel, c, true, &why);
    if (a.empty()) continue;  // this kernel does not take this case (its gate says why)
    ++ran;
    reset_selection_cache();  // a fresh selection must not change the result either
    const std::vector<double> b = run_case(be, kernel, c, true, &why);
    EXPECT_EQ(digest(a), digest(b)) << c.name;
  }
  EXPECT_GT(ran, 0) << be << "/" << kernel << " ran no case";
}

TEST_P(Determinism, OtherThreadsGiveTheSameBits) {
  const auto& [be, kernel] = GetParam();
  for (const Case& c : cases()) {
    std::string why;
    const std::vector<double> main_thread = run_case(be, kernel, c, true, &why);
    if (main_thread.empty()) continue;
    std::vector<double> results[3];
    std::vector<std::thread> threads;
    for (auto& r : results) threads.emplace_back([&] {
      std::string w;
      r = run_case(be, kernel, c, true, &w);
    });
    for (auto& t : threads) t.join();
    for (const auto& r : results) EXPECT_EQ(digest(r), digest(main_thread)) << c.name;
  }
}

#ifdef DIMATTN_TEST_TORCH
// ATen's intra-op parallelism (at::set_num_threads) must not change the
// bits of the fused kernels, forward and backward, at 1, 2 and 4 threads.
// The torch backend's reference path is not claimed bitwise stable across
// thread counts (its matmuls and reductions are ATen's, blocked by thread
// count; docs/reliability.md): there, results must agree to float rounding.
TEST_P(Determinism, AtenThreadCountsGiveTheSameBits) {
  const auto& [be, kernel] = GetParam();
  if (be != "torch") GTEST_SKIP() << "only the torch backend runs ATen's thread pool";
  const int saved = at::get_num_threads();
  for (const Case& c : cases()) {
    std::string why;
    at::set_num_threads(1);
    const std::vector<double> one = run_case(be, kernel, c, true, &why);
    if (one.empty()) continue;
    for (int n : {2, 4}) {
      at::set_num_threads(n);
      const std::vector<double> other = run_case(be, kernel, c, true, &why);
      if (kernel != "reference") {
        EXPECT_EQ(digest(other), digest(one)) << c.name << " at " << n << " threads";
        continue;
      }
      ASSERT_EQ(other.size(), one.size());
      const double tol = c.dtype == DType::float64 ? 1e-12 : c.dtype == DType::float32 ? 1e-5 : 2e-2;
      double worst = 0;
      for (size_t i = 0; i < one.size(); ++i) worst = std::max(worst, std::abs(other[i] - one[i]));
      EXPECT_LE(worst, tol) << c.name << " at " << n << " threads";
    }
  }
  at::set_num_threads(saved);
}
#endif

#ifdef DIMATTN_TEST_CPU_THREADS
// dimattn's own CPU kernels on backends without a thread pool of their own
// (set_cpu_threads): 1, 2 and 4 threads give the same bits.
TEST_P(Determinism, CpuThreadCountsGiveTheSameBits) {
  const auto& [be, kernel] = GetParam();
  if (be == "torch") GTEST_SKIP() << "the torch backend runs its kernels on ATen's pool (AtenThreadCounts...)";
  for (const Case& c : cases()) {
    std::string why;
    set_cpu_threads(1);
    const std::vector<double> one = run_case(be, kernel, c, true, &why);
    if (one.empty()) continue;
    for (int n : {2, 4}) {
      set_cpu_threads(n);
      EXPECT_EQ(digest(run_case(be, kernel, c, true, &why)), digest(one)) << c.name << " at " << n << " threads";
    }
  }
  set_cpu_threads(0);
}
#endif

std::string kernel_case_name(const ::testing::TestParamInfo<KernelCase>& info) {
  return info.param.backend + "_" + info.param.kernel;
}
INSTANTIATE_TEST_SUITE_P(CpuKernels, Determinism, ::testing::ValuesIn(cpu_kernels()), kernel_case_name);

// Across processes: a child process (this binary, this test) computes the
// digest of every kernel and case; it must equal ours. Catches results that
// depend on addresses (ASLR), e.g. through an order of dims by pointer.
uint64_t all_digest() {
  uint64_t h = 1469598103934665603ULL;
  for (const KernelCase& kc : cpu_kernels())
    for (const Case& c : cases()) {
      std::string why;
      h = digest(run_case(kc.backend, kc.kernel, c, true, &why), h);
    }
  return h;
}

TEST(DeterminismAcrossProcesses, ChildProcessComputesTheSameBits) {
  if (const char* out = std::getenv("DIMATTN_DETERMINISM_CHILD_OUT")) {
    std::ofstream(out) << all_digest() << "\n";
    return;
  }
  const uint64_t mine = all_digest();
  const std::string file = ::testing::TempDir() + "dimattn_determinism_child.txt";
  std::remove(file.c_str());
  const std::string self = std::filesystem::read_symlink("/proc/self/exe").string();
  const std::string cmd = "DIMATTN_DETERMINISM_CHILD_OUT='" + file + "' '" + self +
                          "' --gtest_filter=DeterminismAcrossProcesses.* > /dev/null 2>&1";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  uint64_t theirs = 0;
  std::ifstream(file) >> theirs;
  EXPECT_EQ(theirs, mine);
}

}  // namespace
}  // namespace dimattn
