#pragma once
// Running cpu_flash on a kernel-level case (tests/support/kernel_case.h) on
// every code path this CPU has and comparing it with the float64 oracle
// (check_case); shared by tests/kernels/cpu_flash_*.cpp.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <string>
#include <vector>

#include "cpu/flash_attention.h"
#include "cpu/flash_attention_heuristics.h"
#include "cpu/thread_pool.h"
#include "support/kernel_case.h"

namespace dimattn::kernels {
namespace {

using namespace test;  // NOLINT(google-build-using-namespace): the case vocabulary, throughout

// Max abs error of a view against a reference array, relative to the
// reference's scale where values are large; NaN anywhere fails.
::testing::AssertionResult close(const char* what, const View& got, const Array4& want, double tol) {
  double scale = 1.0;
  for (double x : want.v) scale = std::max(scale, std::abs(x));
  double worst = 0;
  int64_t wi[4] = {0, 0, 0, 0};
  for (int64_t a = 0; a < want.n[0]; ++a)
    for (int64_t b = 0; b < want.n[1]; ++b)
      for (int64_t c = 0; c < want.n[2]; ++c)
        for (int64_t d = 0; d < want.n[3]; ++d) {
          const double g = got.buf->get(got.at(a, b, c, d));
          const double e = std::isnan(g) ? kInf : std::abs(g - want(a, b, c, d));
          if (e > worst) {
            worst = e;
            wi[0] = a, wi[1] = b, wi[2] = c, wi[3] = d;
          }
        }
  if (worst <= tol * scale) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << what << ": max abs error " << worst << " > " << tol << " * " << scale
                                       << " at [" << wi[0] << ", " << wi[1] << ", " << wi[2] << ", " << wi[3]
                                       << "]: got " << got.buf->get(got.at(wi[0], wi[1], wi[2], wi[3])) << ", want "
                                       << want(wi[0], wi[1], wi[2], wi[3]);
}

// Every code path this CPU runs (the ones it lacks are CpuIsaPaths' skips),
// or only DIMATTN_CPU_ISA's when that caps them.
std::vector<CpuIsa> isas() {
  const char* cap = std::getenv("DIMATTN_CPU_ISA");
  if (cap != nullptr && *cap != '\0') return {cpu_flash_best_isa()};
  std::vector<CpuIsa> r;
  for (CpuIsa isa : kCpuIsas)
    if (missing_cpu_flags(isa, cpu_features()).empty()) r.push_back(isa);
  return r;
}

// threads: the pool's; with 1 the kernel's task ranges hold every task.
void check_case(const Case& c, bool backward = true, const std::vector<CpuIsa>& on = isas(), int threads = 2) {
  const Inputs in = make_inputs(c);
  const Oracle ref = oracle(c, in);
  ThreadPool pool(threads);
  for (CpuIsa isa : on) {
    SCOPED_TRACE(c.name + " isa=" + cpu_isa_name(isa) + " dtype=" + element_type_name(c.dtype));
    KernelRun r = prepare(c, in);
    flash_attention_forward_cpu(r.p, pool.as_parallel_for(), isa);
    const double ft = fwd_tol(c.dtype);
    EXPECT_TRUE(close("out", r.out, ref.out, ft));
    for (int64_t i = 0; i < c.B * c.H * c.Tq; ++i) {
      const double want = ref.lse.v[i], got = lse_at(r, c, i);
      if (want == -kInf) {
        EXPECT_EQ(got, -kInf) << "lse row " << i;
      } else {
        EXPECT_NEAR(got, want, ft * std::max(1.0, std::abs(want))) << "lse row " << i;
      }
    }
    if (!backward) continue;
    // bfloat16's backward pass reads the forward's rounded output, as in
    // training; its gradients are still compared with the float64 reference.
    flash_attention_backward_cpu(r.p, pool.as_parallel_for(), isa);
    const double bt = bwd_tol(c.dtype);
    EXPECT_TRUE(close("dq", r.dq, ref.dq, bt));
    EXPECT_TRUE(close("dk", r.dk, ref.dk, bt));
    EXPECT_TRUE(close("dv", r.dv, ref.dv, bt));
    for (size_t x = 0; x < r.dsinks.size(); ++x)
      EXPECT_NEAR(r.dsinks[x], ref.dsinks[x], bt * std::max(1.0, std::abs(ref.dsinks[x]))) << "dsinks[" << x << "]";
    if (!c.bias.empty()) {
      Buffer got(ElementType::float64, static_cast<int64_t>(c.bias.size()));
      for (size_t x = 0; x < c.bias.size(); ++x) got.set(static_cast<int64_t>(x), r.dbias(x));
      Array4 want(1, 1, 1, static_cast<int64_t>(ref.dbias.size()));
      want.v = ref.dbias;
      EXPECT_TRUE(close("dbias", View{&got, 0, {0, 0, 0, 1}}, want, bt));
    }
  }
}

}  // namespace
}  // namespace dimattn::kernels
