// cpu_flash's code paths: the instruction sets (cpu_isa.h) and their caps,
// determinism across thread counts, and the backward pass against finite
// differences.
#include <gtest/gtest.h>

#include <fstream>
#include <string>

#include "cpu_flash_check.h"

namespace dimattn::kernels {
namespace {

// ---------------------------------------------------------------------------
// Instruction sets (cpu_isa.h).

TEST(CpuIsa, CapNamesWhatIsMissing) {
  CpuFeatures avx2;  // an AVX2-only CPU
  avx2.avx2 = avx2.fma = avx2.f16c = true;
  CpuFeatures avx512 = avx2;  // AVX-512 without BF16 (Skylake-SP, Ice Lake)
  avx512.avx512f = avx512.avx512bw = avx512.avx512dq = avx512.avx512vl = true;
  CpuFeatures bf16 = avx512;
  bf16.avx512_bf16 = true;
  EXPECT_EQ(best_cpu_isa(CpuFeatures{}), CpuIsa::generic);
  EXPECT_EQ(best_cpu_isa(avx2), CpuIsa::avx2);
  EXPECT_EQ(best_cpu_isa(avx512), CpuIsa::avx512);
  EXPECT_EQ(best_cpu_isa(bf16), CpuIsa::avx512_bf16);
  EXPECT_EQ(cpu_isa_from_name("generic", CpuFeatures{}, "DIMATTN_CPU_ISA"), CpuIsa::generic);
  EXPECT_EQ(cpu_isa_from_name("avx2", bf16, "DIMATTN_CPU_ISA"), CpuIsa::avx2);
  EXPECT_EQ(cpu_isa_from_name("avx512_bf16", bf16, "DIMATTN_CPU_ISA"), CpuIsa::avx512_bf16);
  auto error = [](const std::string& name, const CpuFeatures& f) {
    try {
      cpu_isa_from_name(name, f, "DIMATTN_CPU_ISA");
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_EQ(error("avx512", avx2),
            "DIMATTN_CPU_ISA=avx512 needs CPU flags this CPU lacks: avx512f avx512bw avx512dq avx512vl; use avx2 or "
            "lower (generic, avx2, avx512, avx512_bf16 in increasing order), or unset it");
  EXPECT_NE(error("avx512_bf16", avx512).find("lacks: avx512_bf16;"), std::string::npos) << error("avx512_bf16", avx512);
  EXPECT_NE(error("avx2", CpuFeatures{}).find("lacks: avx2 fma f16c;"), std::string::npos);
  EXPECT_NE(error("AVX2", bf16).find("DIMATTN_CPU_ISA=AVX2 names no instruction set of cpu_flash; use generic, avx2, "
                                     "avx512 or avx512_bf16"),
            std::string::npos)
      << error("AVX2", bf16);
}

TEST(CpuIsa, VendorIsTheOneProcCpuinfoNames) {
  std::ifstream info("/proc/cpuinfo");
  std::string line, vendor;
  while (vendor.empty() && std::getline(info, line))
    if (line.rfind("vendor_id", 0) == 0) vendor = line.substr(line.find(':') + 2);
  if (vendor.empty()) GTEST_SKIP() << "/proc/cpuinfo names no vendor_id here";
  EXPECT_EQ(cpu_features().amd, vendor == "AuthenticAMD") << vendor;
  EXPECT_EQ(cpu_flash::decode_prefetch_whole_rows(), vendor != "AuthenticAMD") << vendor;
}

TEST(CpuIsa, Bf16PathRunsBfloat16Only) {
  const std::string missing = missing_cpu_flags(CpuIsa::avx512_bf16, cpu_features());
  if (!missing.empty()) GTEST_SKIP() << "avx512_bf16: this CPU lacks " << missing;
  EXPECT_EQ(cpu_flash_isa(ElementType::bfloat16, CpuIsa::avx512_bf16), CpuIsa::avx512_bf16);
  for (ElementType t : {ElementType::float32, ElementType::float64, ElementType::float16})
    EXPECT_EQ(cpu_flash_isa(t, CpuIsa::avx512_bf16), CpuIsa::avx512) << element_type_name(t);
  EXPECT_EQ(cpu_flash_isa(ElementType::bfloat16, CpuIsa::avx2), CpuIsa::avx2);
}

// Each code path on its own: a small case of every dtype through it, or, on
// a CPU without it, a skip naming the flags it lacks, after checking that
// asking for it is a clear error.
class CpuIsaPaths : public ::testing::TestWithParam<CpuIsa> {};

TEST_P(CpuIsaPaths, RunHereOrSkipNamingTheMissingFlags) {
  const CpuIsa isa = GetParam();
  const std::string missing = missing_cpu_flags(isa, cpu_features());
  if (!missing.empty()) {
    Case c = base("missing");
    c.Tq = c.Tk = 4;
    const Inputs in = make_inputs(c);
    KernelRun r = prepare(c, in);
    try {
      flash_attention_forward_cpu(r.p, serial_parallel_for(), isa);
      ADD_FAILURE() << cpu_isa_name(isa) << " ran on a CPU that lacks " << missing;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(missing), std::string::npos) << e.what();
    }
    GTEST_SKIP() << cpu_isa_name(isa) << ": this CPU lacks " << missing;
  }
  for (ElementType t : kAllTypes) {
    Case c = base(std::string("path ") + cpu_isa_name(isa), t);
    c.B = 2, c.H = 4, c.Hkv = 2, c.Tq = 45, c.Tk = 77, c.D = c.Dv = 24, c.causal = true, c.offsets = {32, 5};
    c.p = 0.1;
    check_case(c, true, {isa});
  }
}

INSTANTIATE_TEST_SUITE_P(Isa, CpuIsaPaths, ::testing::ValuesIn(kCpuIsas),
                         [](const ::testing::TestParamInfo<CpuIsa>& i) { return std::string(cpu_isa_name(i.param)); });

// Bitwise equal results with 1, 2 and 3 threads and the serial loop, for the
// forward pass and both backward schedules (one chunk, several chunks).
TEST(CpuFlash, DeterministicAcrossThreadCounts) {
  std::vector<Case> cases;
  {
    Case c = base("det one chunk");
    c.B = 2, c.H = 8, c.Hkv = 8, c.Tq = 150, c.Tk = 150, c.D = c.Dv = 32, c.causal = true, c.p = 0.2;
    cases.push_back(c);
  }
  {
    Case c = base("det chunks gqa");
    c.B = 1, c.H = 4, c.Hkv = 2, c.Tq = 100, c.Tk = 640, c.D = c.Dv = 16, c.causal = true, c.offsets = {540};
    c.p = 0.1;
    cases.push_back(c);
  }
  {
    Case c = base("det bf16", ElementType::bfloat16);
    c.B = 3, c.H = 2, c.Hkv = 1, c.Tq = 77, c.Tk = 300, c.D = c.Dv = 64, c.kv_lens = {300, 10, 170};
    cases.push_back(c);
  }
  for (const Case& c : cases) {
    const Inputs in = make_inputs(c);
    for (CpuIsa isa : isas()) {
      SCOPED_TRACE(c.name + " isa=" + cpu_isa_name(isa));
      std::vector<KernelRun> runs;
      for (int threads : {0, 1, 2, 3}) {
        KernelRun r = prepare(c, in);
        ThreadPool pool(std::max(threads, 1));
        const ParallelFor pf = threads == 0 ? serial_parallel_for() : pool.as_parallel_for();
        flash_attention_forward_cpu(r.p, pf, isa);
        flash_attention_backward_cpu(r.p, pf, isa);
        runs.push_back(std::move(r));
      }
      for (size_t i = 1; i < runs.size(); ++i) {
        EXPECT_EQ(runs[i].lse, runs[0].lse) << "lse, run " << i;
        for (size_t b = 0; b < runs[0].buffers.size(); ++b)
          EXPECT_TRUE(runs[i].buffers[b].bytes == runs[0].buffers[b].bytes) << "buffer " << b << ", run " << i;
      }
    }
  }
}

// The backward kernel is the gradient of the forward kernel: central finite
// differences of L = sum(dout * out) in float64, dropout and masks included.
TEST(CpuFlash, FiniteDifferences) {
  Case c = base("finite differences", ElementType::float64);
  c.B = 2, c.H = 2, c.Hkv = 1, c.Tq = 5, c.Tk = 7, c.D = 3, c.Dv = 2, c.causal = true, c.offsets = {2, -1};
  c.kv_lens = {7, 4};
  c.p = 0.2;
  const Inputs in = make_inputs(c);
  for (CpuIsa isa : isas()) {
    SCOPED_TRACE(cpu_isa_name(isa));
    const ParallelFor pf = serial_parallel_for();
    KernelRun r = prepare(c, in);
    flash_attention_forward_cpu(r.p, pf, isa);
    flash_attention_backward_cpu(r.p, pf, isa);
    auto loss = [&](const Inputs& x) {
      KernelRun t = prepare(c, x);
      flash_attention_forward_cpu(t.p, pf, isa);
      double l = 0;
      for (int64_t b = 0; b < c.B; ++b)
        for (int64_t h = 0; h < c.H; ++h)
          for (int64_t i = 0; i < c.Tq; ++i)
            for (int64_t e = 0; e < c.Dv; ++e) l += x.dout(b, h, i, e) * t.out.buf->get(t.out.at(b, h, i, e));
      return l;
    };
    const double eps = 1e-6;
    auto check_grad = [&](const char* name, Array4 Inputs::*member, const View& grad) {
      Inputs x = in;
      Array4& a = x.*member;
      double worst = 0;
      for (size_t idx = 0; idx < a.v.size(); ++idx) {
        const double orig = a.v[idx];
        a.v[idx] = orig + eps;
        const double up = loss(x);
        a.v[idx] = orig - eps;
        const double down = loss(x);
        a.v[idx] = orig;
        const double numeric = (up - down) / (2 * eps);
        int64_t rem = static_cast<int64_t>(idx);
        const int64_t d3 = rem % a.n[3];
        rem /= a.n[3];
        const int64_t d2 = rem % a.n[2];
        rem /= a.n[2];
        const int64_t d1 = rem % a.n[1];
        const int64_t d0 = rem / a.n[1];
        worst = std::max(worst, std::abs(numeric - grad.buf->get(grad.at(d0, d1, d2, d3))));
      }
      EXPECT_LT(worst, 1e-7) << name;
    };
    check_grad("dq", &Inputs::q, r.dq);
    check_grad("dk", &Inputs::k, r.dk);
    check_grad("dv", &Inputs::v, r.dv);
  }
}

}  // namespace
}  // namespace dimattn::kernels
