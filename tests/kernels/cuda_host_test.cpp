// cuda_flash on the host side: the Philox stream nvcc compiles equals the one
// g++ compiles (and, on a GPU, the device's); the kernel gate and the
// selection gate accept and reject with reasons. With a GPU (sm_80+), the
// kernels themselves against the CPU kernel on the same inputs, dropout
// masks included, on the cases the host emulation runs in CI
// (kernels/cuda_flash_cases.h); without one those tests skip.
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
#include "kernels/cuda_flash_cases.h"
#include "kernels/cuda_test_support.h"
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
  p.padding = Padding::per_row;
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

// --- the kernels against the oracle and the CPU kernel (GPU only) ---

// Device memory; the passes on the default stream.
struct DeviceRunner : test::CudaFlashRunner {
  void* alloc(size_t bytes) override {
    void* p = testing::cuda::device_alloc(bytes);
    testing::cuda::device_fill_bytes(p, 0xFF, bytes);
    return p;
  }
  void free(void* p) override { testing::cuda::device_free(p); }
  void upload(void* dst, const void* src, size_t bytes) override { testing::cuda::copy_to_device(dst, src, bytes); }
  void download(void* dst, const void* src, size_t bytes) override {
    testing::cuda::device_synchronize();
    testing::cuda::copy_to_host(dst, src, bytes);
  }
  void forward(const AttentionKernelParams& p) override { cuda_flash_forward(p, nullptr); }
  void backward(const AttentionKernelParams& p, void* workspace) override {
    cuda_flash_backward(p, workspace, nullptr);
  }
};

// The cases the emulation runs in CI (tests/cuda_emu), here on the GPU.
class CudaFlashKernel : public ::testing::TestWithParam<test::Case> {};

TEST_P(CudaFlashKernel, MatchesTheOracleAndCpuFlash) {
  if (std::string why = testing::cuda::device_unavailable(); !why.empty()) GTEST_SKIP() << why;
  DeviceRunner runner;
  test::check_cuda_flash_case(GetParam(), runner);
}

INSTANTIATE_TEST_SUITE_P(Cases, CudaFlashKernel, ::testing::ValuesIn(test::cuda_kernel_cases()),
                         [](const ::testing::TestParamInfo<test::Case>& i) { return i.param.name; });

#endif  // DIMATTN_TEST_WITH_CUDA

}  // namespace
}  // namespace dimattn::kernels
