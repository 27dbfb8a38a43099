// cuda_flash on the host side: the Philox stream nvcc compiles equals the one
// g++ compiles (and, on a GPU, the device's); the kernel gate and the
// selection gate accept and reject with reasons. With a GPU (sm_80+), the
// kernels themselves against the CPU kernel on the same inputs, dropout
// masks included; without one those tests skip.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <random>
#include <string>
#include <vector>

#include "adapters/cuda_flash_gate.h"
#include "common/attention_params.h"
#include "common/philox.h"
#include "cpu/flash_attention.h"
#include "cpu/thread_pool.h"
#include "cuda/flash_attention_cuda.h"
#if defined(DIMATTN_TEST_WITH_CUDA)
#include "bf16_bits.h"
#include "cuda_test_support.h"
#endif

namespace dimattn::kernels {
namespace {

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

TEST(CudaFlashBuild, CompiledMatchesTheBuildOption) {
#if defined(DIMATTN_TEST_WITH_CUDA)
  EXPECT_TRUE(cuda_flash_compiled());
#else
  EXPECT_FALSE(cuda_flash_compiled());
#endif
}

// --- the kernel gate (AttentionKernelParams) ---

// A valid bf16 problem over fake, 16-byte aligned addresses (the gate never
// dereferences them).
AttentionKernelParams gate_params(int64_t D = 64) {
  AttentionKernelParams p;
  p.dtype = ElementType::bfloat16;
  p.batch = 2;
  p.heads = 4;
  p.kv_heads = 2;
  p.seqlen_q = 100;
  p.seqlen_k = 130;
  p.head_dim = p.head_dim_v = D;
  auto fake = [](uintptr_t a) { return reinterpret_cast<void*>(a); };
  p.q = fake(0x10000);
  p.k = fake(0x20000);
  p.v = fake(0x30000);
  p.out = fake(0x40000);
  p.lse = fake(0x50000);
  p.dout = fake(0x60000);
  p.dq = fake(0x70000);
  p.dk = fake(0x80000);
  p.dv = fake(0x90000);
  auto dense = [&](int64_t h, int64_t t) { return ElementStrides{h * t * D, t * D, D, 1}; };
  p.q_strides = p.out_strides = p.dout_strides = p.dq_strides = dense(p.heads, p.seqlen_q);
  p.k_strides = p.v_strides = p.dk_strides = p.dv_strides = dense(p.kv_heads, p.seqlen_k);
  p.lse_batch_stride = p.heads * p.seqlen_q;
  p.lse_head_stride = p.seqlen_q;
  p.scale = 0.125;
  return p;
}

TEST(CudaFlashGate, AcceptsBf16AndF16WithHeadDims64And128) {
  for (ElementType t : {ElementType::bfloat16, ElementType::float16})
    for (int64_t D : {64, 128})
      for (bool bwd : {false, true}) {
        AttentionKernelParams p = gate_params(D);
        p.dtype = t;
        p.causal = true;
        p.dropout_p = 0.25;
        EXPECT_EQ(cuda_flash_gate(p, bwd), "") << element_type_name(t) << " D=" << D << " backward=" << bwd;
      }
}

TEST(CudaFlashGate, RejectsWithReasons) {
  struct Bad {
    const char* what;
    void (*edit)(AttentionKernelParams&);
    const char* reason;
  };
  const Bad bad[] = {
      {"float32", [](AttentionKernelParams& p) { p.dtype = ElementType::float32; }, "does not take float32"},
      {"float64", [](AttentionKernelParams& p) { p.dtype = ElementType::float64; }, "it takes bfloat16, float16"},
      {"head dim 32", [](AttentionKernelParams& p) { p.head_dim = p.head_dim_v = 32; }, "head dim 64 or 128, got 32"},
      {"head dim 48", [](AttentionKernelParams& p) { p.head_dim = p.head_dim_v = 48; }, "got 48"},
      {"D != Dv", [](AttentionKernelParams& p) { p.head_dim_v = 32; }, "equal q/k and v head dims"},
      {"unaligned k", [](AttentionKernelParams& p) { p.k = reinterpret_cast<void*>(0x20002); },
       "k must start on a 16-byte boundary"},
      {"odd row stride", [](AttentionKernelParams& p) { p.v_strides.row = 68; }, "v's strides"},
      {"odd head stride", [](AttentionKernelParams& p) { p.q_strides.head += 4; }, "q's strides"},
      {"batch grid", [](AttentionKernelParams& p) { p.batch = 70000; }, "at most 65535"},
      {"non-unit last stride", [](AttentionKernelParams& p) { p.q_strides.last = 2; }, "contiguous last dim"},
      {"GQA mismatch", [](AttentionKernelParams& p) { p.kv_heads = 3; }, "not a multiple of kv_heads"},
  };
  for (const Bad& b : bad) {
    AttentionKernelParams p = gate_params();
    b.edit(p);
    const std::string why = cuda_flash_gate(p, false);
    EXPECT_TRUE(contains(why, b.reason)) << b.what << ": " << why;
  }
  AttentionKernelParams p = gate_params();
  p.lse = nullptr;
  EXPECT_EQ(cuda_flash_gate(p, false), "") << "lse is optional in the forward pass";
  EXPECT_TRUE(contains(cuda_flash_gate(p, true), "lse (from the forward pass) is required"));
  p = gate_params();
  p.dk = reinterpret_cast<void*>(0x80008);
  EXPECT_EQ(cuda_flash_gate(p, false), "") << "the forward pass reads no gradient";
  EXPECT_TRUE(contains(cuda_flash_gate(p, true), "dk must start on a 16-byte boundary"));
}

TEST(CudaFlashGate, KernelsRejectElementTypesOutsideTheirSetWithAReason) {
  AttentionKernelParams p = gate_params();
  p.dtype = ElementType::float16;
  EXPECT_EQ(p.validate(false), "") << "the CPU kernel takes float16";
  p.dtype = ElementType::float32;
  EXPECT_TRUE(contains(cuda_flash_gate(p, false), "this kernel does not take float32; it takes bfloat16, float16"))
      << cuda_flash_gate(p, false);
}

TEST(CudaFlashGate, BackwardWorkspaceHoldsDqAndRowSums) {
  const AttentionKernelParams p = gate_params(128);
  const size_t rows = 2 * 4 * 100;
  EXPECT_EQ(cuda_flash_backward_workspace_bytes(p), rows * 128 * 4 + rows * 4);
}

// --- the selection gate (AttentionParams) ---

AttentionParams selection_params() {
  AttentionParams p;
  p.device = DeviceType::cuda;
  p.dtype = DType::bfloat16;
  p.head_dim_qk = p.head_dim_v = 128;
  return p;
}

TEST(CudaFlashSelectionGate, AcceptsWhatTheKernelComputes) {
  AttentionParams p = selection_params();
  p.causal = true;
  p.offset = OffsetKind::nonzero;
  p.dropout = p.dropout_broadcast = true;
  p.padding = true;
  p.gqa_ratio = 4;
  p.layout = LayoutClass::packed_qkv;
  p.requires_grad = true;
  EXPECT_TRUE(dimattn::detail::cuda_flash_gate(p, true).ok) << dimattn::detail::cuda_flash_gate(p, true).reason;
  p.dtype = DType::float16;
  p.head_dim_qk = p.head_dim_v = 64;
  p.layout = LayoutClass::strided;  // copied once by the adapter
  EXPECT_TRUE(dimattn::detail::cuda_flash_gate(p, true).ok) << dimattn::detail::cuda_flash_gate(p, true).reason;
}

TEST(CudaFlashSelectionGate, RejectsWithReasons) {
  struct Bad {
    const char* what;
    void (*edit)(AttentionParams&);
    bool compiled;
    const char* reason;
  };
  const Bad bad[] = {
      {"cpu", [](AttentionParams& p) { p.device = DeviceType::cpu; }, true, "runs on CUDA only"},
      {"not compiled", [](AttentionParams&) {}, false, "built without CUDA"},
      {"float32", [](AttentionParams& p) { p.dtype = DType::float32; }, true, "does not take float32"},
      {"head dim 80", [](AttentionParams& p) { p.head_dim_qk = p.head_dim_v = 80; }, true, "head dim 64 or 128, got 80"},
      {"Dv", [](AttentionParams& p) { p.head_dim_v = 64; }, true, "equal qk and v head dims"},
      {"deterministic",
       [](AttentionParams& p) {
         p.requires_grad = true;
         p.deterministic = true;
       },
       true, "not deterministic"},
  };
  for (const Bad& b : bad) {
    AttentionParams p = selection_params();
    b.edit(p);
    const GateResult g = dimattn::detail::cuda_flash_gate(p, b.compiled);
    EXPECT_FALSE(g.ok) << b.what;
    EXPECT_TRUE(contains(g.reason, b.reason)) << b.what << ": " << g.reason;
  }
  AttentionParams p = selection_params();
  p.deterministic = true;  // forward only: deterministic
  EXPECT_TRUE(dimattn::detail::cuda_flash_gate(p, true).ok);
}

TEST(CudaFlashSelectionGate, ThisBuildsGateNamesTheMissingKernelsOrPasses) {
  const GateResult g = dimattn::detail::cuda_flash_gate(selection_params());
  EXPECT_EQ(g.ok, cuda_flash_compiled()) << g.reason;
}

#if defined(DIMATTN_TEST_WITH_CUDA)

// --- Philox: one header, three compilations ---

TEST(CudaPhilox, NvccHostStreamEqualsGccStream) {
  const uint64_t seeds[] = {0, 1, 1234, 0xDEADBEEFCAFEF00Dull, ~0ull};
  const uint32_t offsets[] = {0, 7, 0xFFFFFFFFu};
  for (uint64_t seed : seeds)
    for (uint32_t off : offsets)
      for (bool broadcast : {false, true})
        for (uint32_t k0 : {0u, 3u, 1000001u}) {
          const uint32_t bh = 5, q = 77;
          const std::vector<float> nv = testing::cuda::nvcc_host_uniforms(seed, off, bh, q, k0, 257, broadcast);
          for (int c = 0; c < 257; ++c) {
            const float gcc = broadcast ? dropout_uniform_broadcast(seed, off, k0 + c)
                                        : dropout_uniform(seed, off, bh, q, k0 + c);
            ASSERT_EQ(std::memcmp(&gcc, &nv[c], 4), 0) << "seed " << seed << " offset " << off << " k " << k0 + c;
          }
        }
}

TEST(CudaPhilox, DeviceStreamEqualsHostStream) {
  for (bool broadcast : {false, true}) {
    std::vector<float> dev;
    const std::string why = testing::cuda::device_uniforms(1234, 7, 3, 11, 5, 4099, broadcast, dev);
    if (!why.empty()) GTEST_SKIP() << why;
    for (int c = 0; c < 4099; ++c) {
      const float host = broadcast ? dropout_uniform_broadcast(1234, 7, 5 + c) : dropout_uniform(1234, 7, 3, 11, 5 + c);
      ASSERT_EQ(std::memcmp(&host, &dev[c], 4), 0) << "k " << 5 + c;
    }
  }
}

// --- the kernels against the CPU kernel (GPU only) ---

using test::bf16_round;
using test::bf16_value;

struct GpuCase {
  std::string name;
  ElementType dtype = ElementType::bfloat16;
  int64_t B = 2, H = 4, Hkv = 2, Tq = 100, Tk = 130, D = 64;
  bool causal = false;
  std::vector<int64_t> kv_lens, offsets;
  double p = 0;
  bool broadcast = false;
};

// Device buffer of n 16-bit elements, poisoned with NaN.
struct DeviceBuf {
  void* ptr = nullptr;
  size_t bytes = 0;
  explicit DeviceBuf(size_t b) : ptr(testing::cuda::device_alloc(b)), bytes(b) {
    testing::cuda::device_fill_bytes(ptr, 0xFF, b);
  }
  ~DeviceBuf() { testing::cuda::device_free(ptr); }
  DeviceBuf(const DeviceBuf&) = delete;
  DeviceBuf& operator=(const DeviceBuf&) = delete;
};

void check_against_cpu(const GpuCase& c) {
  SCOPED_TRACE(c.name);
  namespace tc = testing::cuda;
  const bool half = c.dtype == ElementType::float16;
  const int64_t nq = c.B * c.H * c.Tq * c.D, nk = c.B * c.Hkv * c.Tk * c.D, rows = c.B * c.H * c.Tq;
  std::mt19937_64 rng(42);
  std::normal_distribution<float> normal;
  // 16-bit inputs, and their exact float32 values for the CPU kernel.
  auto make = [&](int64_t n, std::vector<uint16_t>& bits, std::vector<float>& vals) {
    bits.resize(n);
    vals.resize(n);
    for (int64_t i = 0; i < n; ++i) {
      const float x = normal(rng);
      bits[i] = half ? tc::float_to_half_bits(x) : bf16_round(x);
      vals[i] = half ? tc::half_bits_to_float(bits[i]) : bf16_value(bits[i]);
    }
  };
  std::vector<uint16_t> qb, kb, vb, db;
  std::vector<float> qf, kf, vf, df;
  make(nq, qb, qf);
  make(nk, kb, kf);
  make(nk, vb, vf);
  make(nq, db, df);

  AttentionKernelParams p;
  p.batch = c.B;
  p.heads = c.H;
  p.kv_heads = c.Hkv;
  p.seqlen_q = c.Tq;
  p.seqlen_k = c.Tk;
  p.head_dim = p.head_dim_v = c.D;
  const ElementStrides qs{c.H * c.Tq * c.D, c.Tq * c.D, c.D, 1}, ks{c.Hkv * c.Tk * c.D, c.Tk * c.D, c.D, 1};
  p.q_strides = p.out_strides = p.dout_strides = p.dq_strides = qs;
  p.k_strides = p.v_strides = p.dk_strides = p.dv_strides = ks;
  p.lse_batch_stride = c.H * c.Tq;
  p.lse_head_stride = c.Tq;
  p.causal = c.causal;
  p.scale = 1.0 / std::sqrt(static_cast<double>(c.D));
  p.dropout_p = c.p;
  p.dropout_broadcast = c.broadcast;
  p.seed = 99;
  p.rng_offset = 3;

  // CPU: bf16 runs as bf16 (the same bits), f16 as float32 of the same values.
  AttentionKernelParams cp = p;
  cp.kv_lengths = c.kv_lens.empty() ? nullptr : c.kv_lens.data();
  cp.causal_offset = c.offsets.empty() ? nullptr : c.offsets.data();
  std::vector<float> cpu_out(nq), cpu_lse(rows), cpu_dq(nq), cpu_dk(nk), cpu_dv(nk);
  std::vector<uint16_t> cpu_out16(nq), cpu_dq16(nq), cpu_dk16(nk), cpu_dv16(nk);
  ThreadPool pool(2);
  if (half) {
    cp.dtype = ElementType::float32;
    cp.q = qf.data(), cp.k = kf.data(), cp.v = vf.data(), cp.dout = df.data();
    cp.out = cpu_out.data(), cp.dq = cpu_dq.data(), cp.dk = cpu_dk.data(), cp.dv = cpu_dv.data();
  } else {
    cp.dtype = ElementType::bfloat16;
    cp.q = qb.data(), cp.k = kb.data(), cp.v = vb.data(), cp.dout = db.data();
    cp.out = cpu_out16.data(), cp.dq = cpu_dq16.data(), cp.dk = cpu_dk16.data(), cp.dv = cpu_dv16.data();
  }
  cp.lse = cpu_lse.data();
  flash_attention_forward_cpu(cp, pool.as_parallel_for());
  flash_attention_backward_cpu(cp, pool.as_parallel_for());
  auto cpu_value = [&](const std::vector<float>& f, const std::vector<uint16_t>& b, int64_t i) {
    return half ? f[i] : bf16_value(b[i]);
  };

  // GPU.
  DeviceBuf q(nq * 2), k(nk * 2), v(nk * 2), dout(nq * 2), out(nq * 2), lse(rows * 4), dq(nq * 2), dk(nk * 2),
      dv(nk * 2), lens(8 * c.B + 8), offs(8 * c.B + 8);
  tc::copy_to_device(q.ptr, qb.data(), nq * 2);
  tc::copy_to_device(k.ptr, kb.data(), nk * 2);
  tc::copy_to_device(v.ptr, vb.data(), nk * 2);
  tc::copy_to_device(dout.ptr, db.data(), nq * 2);
  p.dtype = c.dtype;
  p.q = q.ptr, p.k = k.ptr, p.v = v.ptr, p.dout = dout.ptr;
  p.out = out.ptr, p.lse = lse.ptr, p.dq = dq.ptr, p.dk = dk.ptr, p.dv = dv.ptr;
  if (!c.kv_lens.empty()) {
    tc::copy_to_device(lens.ptr, c.kv_lens.data(), 8 * c.B);
    p.kv_lengths = static_cast<const int64_t*>(lens.ptr);
  }
  if (!c.offsets.empty()) {
    tc::copy_to_device(offs.ptr, c.offsets.data(), 8 * c.B);
    p.causal_offset = static_cast<const int64_t*>(offs.ptr);
  }
  ASSERT_EQ(cuda_flash_gate(p, true), "");
  DeviceBuf ws(cuda_flash_backward_workspace_bytes(p));
  cuda_flash_forward(p, nullptr);
  cuda_flash_backward(p, ws.ptr, nullptr);
  tc::device_synchronize();
  std::vector<uint16_t> g_out(nq), g_dq(nq), g_dk(nk), g_dv(nk);
  std::vector<float> g_lse(rows);
  tc::copy_to_host(g_out.data(), out.ptr, nq * 2);
  tc::copy_to_host(g_dq.data(), dq.ptr, nq * 2);
  tc::copy_to_host(g_dk.data(), dk.ptr, nk * 2);
  tc::copy_to_host(g_dv.data(), dv.ptr, nk * 2);
  tc::copy_to_host(g_lse.data(), lse.ptr, rows * 4);
  auto gpu_value = [&](const std::vector<uint16_t>& b, int64_t i) {
    return half ? tc::half_bits_to_float(b[i]) : bf16_value(b[i]);
  };

  const double tol = half ? 2e-3 : 2e-2;
  auto compare = [&](const char* what, const std::vector<float>& cf, const std::vector<uint16_t>& cb,
                     const std::vector<uint16_t>& g, int64_t n, double t) {
    double worst = 0;
    for (int64_t i = 0; i < n; ++i) {
      const double a = cpu_value(cf, cb, i), b = gpu_value(g, i);
      ASSERT_FALSE(std::isnan(b)) << what << "[" << i << "] is NaN (unwritten or wrong)";
      // Relative to the scale of the values where they are large (gradients).
      worst = std::max(worst, std::abs(a - b) / std::max(1.0, std::abs(a)));
    }
    std::cout << "[ cuda ] " << c.name << " " << what << ": max err " << worst << "\n";
    EXPECT_LE(worst, t) << what;
  };
  compare("out", cpu_out, cpu_out16, g_out, nq, tol);
  compare("dq", cpu_dq, cpu_dq16, g_dq, nq, 2 * tol);
  compare("dk", cpu_dk, cpu_dk16, g_dk, nk, 2 * tol);
  compare("dv", cpu_dv, cpu_dv16, g_dv, nk, 2 * tol);
  for (int64_t r = 0; r < rows; ++r) {
    if (std::isinf(cpu_lse[r])) {
      EXPECT_TRUE(std::isinf(g_lse[r]) && g_lse[r] < 0) << "lse row " << r;
    } else {
      EXPECT_NEAR(g_lse[r], cpu_lse[r], 1e-3 * std::max(1.0f, std::abs(cpu_lse[r]))) << "lse row " << r;
    }
  }
}

std::vector<GpuCase> gpu_cases() {
  std::vector<GpuCase> out;
  for (ElementType t : {ElementType::bfloat16, ElementType::float16})
    for (int64_t D : {64, 128}) {
      const std::string s = std::string("_") + element_type_name(t) + "_d" + std::to_string(D);
      out.push_back({.name = "plain" + s, .dtype = t, .D = D});
      out.push_back({.name = "causal" + s, .dtype = t, .Tq = 130, .D = D, .causal = true});
      out.push_back({.name = "causal_offsets_lengths" + s, .dtype = t, .D = D, .causal = true, .kv_lens = {130, 57},
                     .offsets = {30, -5}});
      out.push_back({.name = "mqa_lengths" + s, .dtype = t, .Hkv = 1, .D = D, .kv_lens = {0, 65}});
      out.push_back({.name = "dropout" + s, .dtype = t, .D = D, .causal = true, .offsets = {30, 30}, .p = 0.3});
      out.push_back({.name = "broadcast_dropout" + s, .dtype = t, .D = D, .kv_lens = {100, 7}, .p = 0.5,
                     .broadcast = true});
    }
  return out;
}

// DIMATTN_CUDA_TEST_CASE=<part of a name> runs only the matching cases (one
// small case under compute-sanitizer, scripts/gpu-check).
TEST(CudaFlashKernel, ForwardAndBackwardMatchTheCpuKernel) {
  if (std::string why = testing::cuda::device_unavailable(); !why.empty()) GTEST_SKIP() << why;
  const char* only = std::getenv("DIMATTN_CUDA_TEST_CASE");
  int ran = 0;
  for (const GpuCase& c : gpu_cases())
    if (!only || contains(c.name, only)) {
      check_against_cpu(c);
      ++ran;
    }
  EXPECT_GT(ran, 0) << "no case matches DIMATTN_CUDA_TEST_CASE=" << only;
}

#endif  // DIMATTN_TEST_WITH_CUDA

}  // namespace
}  // namespace dimattn::kernels
