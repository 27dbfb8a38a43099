// cuda_flash run in the host emulation: every CUDA case (tests/kernels/
// cuda_flash_cases.h) against the float64 oracle and cpu_flash, with the
// emulator's checks (races, uninitialised shared memory, divergence, launch
// limits) required to find nothing; and the launcher's edge cases.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <iostream>
#include <stdexcept>
#include <string>
#include <vector>

#include "cuda/flash_attention_cuda.h"
#include "cuda_emu/emulator.h"
#include "kernels/cuda_flash_cases.h"

namespace dimattn::kernels {
namespace {

std::string joined(const std::vector<std::string>& v) {
  std::string s;
  for (const std::string& x : v) s += "\n  " + x;
  return s;
}

// Host memory, the launches run by the emulation; every launch must leave no
// finding.
struct EmulatedRunner : test::CudaFlashRunner {
  void* alloc(size_t bytes) override {
    void* p = std::aligned_alloc(256, (bytes + 255) / 256 * 256);
    std::memset(p, 0xFF, bytes);
    return p;
  }
  void free(void* p) override { std::free(p); }
  void upload(void* dst, const void* src, size_t bytes) override { std::memcpy(dst, src, bytes); }
  void download(void* dst, const void* src, size_t bytes) override { std::memcpy(dst, src, bytes); }
  void forward(const AttentionKernelParams& p) override {
    cuda_flash_forward(p, nullptr);
    const auto found = cuda_emu::take_findings();
    EXPECT_TRUE(found.empty()) << "the forward pass:" << joined(found);
  }
  void backward(const AttentionKernelParams& p, void* workspace) override {
    cuda_flash_backward(p, workspace, nullptr);
    const auto found = cuda_emu::take_findings();
    EXPECT_TRUE(found.empty()) << "the backward pass:" << joined(found);
  }
};

class CudaFlashEmulated : public ::testing::TestWithParam<test::Case> {};

TEST_P(CudaFlashEmulated, MatchesTheOracleAndCpuFlash) {
  EmulatedRunner runner;
  const cuda_emu::Counts before = cuda_emu::counts();
  test::check_cuda_flash_case(GetParam(), runner);
  const cuda_emu::Counts after = cuda_emu::counts();
  EXPECT_GT(after.launches, before.launches) << "no kernel ran";
  std::cout << "[ emulated ] " << GetParam().name << ": " << after.launches - before.launches << " launches, "
            << after.blocks - before.blocks << " blocks, " << after.warp_collectives - before.warp_collectives
            << " warp collectives, " << after.barriers - before.barriers << " barriers\n";
}

INSTANTIATE_TEST_SUITE_P(Cases, CudaFlashEmulated, ::testing::ValuesIn(test::cuda_kernel_cases()),
                         [](const ::testing::TestParamInfo<test::Case>& i) { return i.param.name; });

// --- the launcher's edge cases ---

AttentionKernelParams no_query_rows() {
  AttentionKernelParams p;
  p.dtype = ElementType::bfloat16;
  p.batch = 1;
  p.heads = p.kv_heads = 1;
  p.seqlen_q = 0;
  p.seqlen_k = 70;
  p.head_dim = p.head_dim_v = 64;
  p.k_strides = p.v_strides = p.dk_strides = p.dv_strides = {70 * 64, 70 * 64, 64, 1};
  p.scale = 0.125;
  return p;
}

TEST(CudaFlashEmulatedLauncher, BackwardTakesANullWorkspaceWhenItNeedsZeroBytes) {
  std::vector<uint16_t> k(70 * 64, 0x3f80), v(70 * 64, 0x3f80), dk(70 * 64, 0xFFFF), dv(70 * 64, 0xFFFF);
  std::vector<float> lse(1);
  AttentionKernelParams p = no_query_rows();
  p.k = k.data(), p.v = v.data(), p.dk = dk.data(), p.dv = dv.data(), p.lse = lse.data();
  ASSERT_EQ(cuda_flash_backward_workspace_bytes(p), 0u);
  ASSERT_NO_THROW(cuda_flash_backward(p, nullptr, nullptr));
  EXPECT_TRUE(cuda_emu::take_findings().empty());
  for (size_t x = 0; x < dk.size(); ++x) {
    ASSERT_EQ(dk[x], 0) << "dk[" << x << "]: no query row attends it";
    ASSERT_EQ(dv[x], 0) << "dv[" << x << "]";
  }
}

TEST(CudaFlashEmulatedLauncher, BackwardRejectsANullWorkspaceWhenItNeedsOne) {
  AttentionKernelParams p = no_query_rows();
  p.seqlen_q = 3;
  p.q_strides = p.out_strides = p.dout_strides = p.dq_strides = {3 * 64, 3 * 64, 64, 1};
  auto fake = [](uintptr_t a) { return reinterpret_cast<void*>(a); };
  p.q = fake(0x1000), p.k = fake(0x2000), p.v = fake(0x3000), p.out = fake(0x4000), p.lse = fake(0x5000);
  p.dout = fake(0x6000), p.dq = fake(0x7000), p.dk = fake(0x8000), p.dv = fake(0x9000);
  const size_t bytes = cuda_flash_backward_workspace_bytes(p);
  ASSERT_GT(bytes, 0u);
  try {
    cuda_flash_backward(p, nullptr, nullptr);
    FAIL() << "a null workspace of " << bytes << " bytes was taken";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("workspace of " + std::to_string(bytes) + " bytes"), std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace dimattn::kernels
