// The contracts of cpu_flash's parameters a caller can get wrong
// (AttentionKernelParams::validate), and its thread pool.
#include <gtest/gtest.h>

#include "cpu_flash_check.h"

namespace dimattn::kernels {
namespace {

// ---------------------------------------------------------------------------
// Contracts a caller can get wrong.

AttentionKernelParams valid_params(std::vector<float>& storage) {
  storage.assign(256, 0.5f);
  AttentionKernelParams p;
  p.dtype = ElementType::float32;
  p.batch = 1, p.heads = 2, p.kv_heads = 2, p.seqlen_q = 3, p.seqlen_k = 3, p.head_dim = 8, p.head_dim_v = 8;
  const ElementStrides st{2 * 3 * 8, 3 * 8, 8, 1};
  p.q = p.k = p.v = p.dout = storage.data();
  p.out = p.dq = storage.data() + 48;
  p.dk = storage.data() + 96;
  p.dv = storage.data() + 144;
  p.q_strides = p.k_strides = p.v_strides = p.out_strides = p.dout_strides = p.dq_strides = p.dk_strides =
      p.dv_strides = st;
  p.lse = storage.data() + 192;  // 6 floats
  p.lse_batch_stride = 6, p.lse_head_stride = 3;
  return p;
}

void expect_rejected(const AttentionKernelParams& p, bool backward, const std::string& fragment) {
  const std::string err = backward ? p.validate(true) : p.validate(false);
  const std::string host = p.validate_host_arrays();
  EXPECT_NE((err + host).find(fragment), std::string::npos) << "validate: '" << err << "' host: '" << host << "'";
  try {
    if (backward)
      flash_attention_backward_cpu(p, serial_parallel_for());
    else
      flash_attention_forward_cpu(p, serial_parallel_for());
    ADD_FAILURE() << "no exception for " << fragment;
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("[cpu_flash]"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
  }
}

TEST(CpuFlashParams, ValidParamsPass) {
  std::vector<float> s;
  const AttentionKernelParams p = valid_params(s);
  EXPECT_EQ(p.validate(false), "");
  EXPECT_EQ(p.validate(true), "");
  EXPECT_EQ(p.validate_host_arrays(), "");
}

TEST(CpuFlashParams, RejectsWhatCallersGetWrong) {
  std::vector<float> s;
  {
    AttentionKernelParams p = valid_params(s);
    p.heads = 3;
    expect_rejected(p, false, "not a multiple of kv_heads");
  }
  {
    AttentionKernelParams p = valid_params(s);
    p.kv_heads = 0;
    expect_rejected(p, false, "kv_heads must be >= 1");
  }
  {
    AttentionKernelParams p = valid_params(s);
    p.k_strides.last = 2;
    expect_rejected(p, false, "k needs a contiguous last dim");
  }
  {
    AttentionKernelParams p = valid_params(s);
    p.v = nullptr;
    expect_rejected(p, false, "v is null");
  }
  {
    AttentionKernelParams p = valid_params(s);
    p.dk = nullptr;
    expect_rejected(p, true, "dk is null");
  }
  {
    AttentionKernelParams p = valid_params(s);
    p.lse = nullptr;
    expect_rejected(p, true, "lse (from the forward pass) is required");
  }
  {
    AttentionKernelParams p = valid_params(s);
    p.seqlen_k = -1;
    expect_rejected(p, false, "sizes must be >= 0");
  }
  {
    AttentionKernelParams p = valid_params(s);
    p.dropout_p = 1.5;
    expect_rejected(p, false, "dropout_p must be in [0, 1]");
  }
  {
    AttentionKernelParams p = valid_params(s);
    p.dropout_p = std::nan("");
    expect_rejected(p, false, "dropout_p must be in [0, 1]");
  }
  {
    AttentionKernelParams p = valid_params(s);
    p.scale = kInf;
    expect_rejected(p, false, "scale must be finite");
  }
  {
    AttentionKernelParams p = valid_params(s);
    p.out_strides.row = 4;  // rows of 8 elements 4 apart: overlapping writes
    expect_rejected(p, false, "overlapping strides");
  }
  {
    AttentionKernelParams p = valid_params(s);
    p.q_strides.head = -24;
    expect_rejected(p, false, "negative stride");
  }
  {
    AttentionKernelParams p = valid_params(s);
    const int64_t lens[1] = {4};
    p.kv_lengths = lens;
    expect_rejected(p, false, "kv_lengths[0] = 4 is outside [0, seqlen_k=3]");
  }
  {
    AttentionKernelParams p = valid_params(s);
    const int64_t lens[1] = {-1};
    p.q_lengths = lens;
    expect_rejected(p, false, "q_lengths[0] = -1");
  }
  {
    AttentionKernelParams p = valid_params(s);
    const int64_t entry[1] = {2}, rows[3] = {2, 3, 1}, offsets[2] = {0, 0};
    p.kv_lengths = entry;
    p.kv_row_lengths = {rows, offsets, 1, 0};
    expect_rejected(p, false, "kv_row_lengths of batch entry 0, head 0, row 1 = 3 is outside [0, kv_lengths[b]=2]");
    p.kv_row_lengths.offsets = nullptr;
    expect_rejected(p, false, "kv_row_lengths needs offsets");
  }
  {
    AttentionKernelParams p = valid_params(s);
    p.dtype = static_cast<ElementType>(9);
    expect_rejected(p, false, "unsupported element type");
  }
}

TEST(CpuFlashParams, BroadcastInputsWithZeroStridesAreAccepted) {
  // MQA expressed as k, v expanded over heads (head stride 0) is a valid input.
  std::vector<float> s;
  AttentionKernelParams p = valid_params(s);
  p.k_strides.head = 0;
  p.v_strides.head = 0;
  EXPECT_EQ(p.validate(true), "");
}

TEST(CpuFlashThreadPool, CoversRangeOnceAndPropagatesExceptions) {
  ThreadPool pool(3);
  EXPECT_EQ(pool.num_threads(), 3);
  std::vector<int> hits(1000, 0);
  pool.parallel_for(0, 1000, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) ++hits[i];
  });
  EXPECT_EQ(std::count(hits.begin(), hits.end(), 1), 1000);
  EXPECT_THROW(pool.parallel_for(0, 100,
                                 [](int64_t b, int64_t) {
                                   if (b >= 50) throw std::runtime_error("boom");
                                 }),
               std::runtime_error);
  // Nested loops run serially instead of deadlocking.
  std::atomic<int> total{0};
  pool.parallel_for(0, 4, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) pool.parallel_for(0, 10, [&](int64_t x, int64_t y) { total += int(y - x); });
  });
  EXPECT_EQ(total.load(), 40);
}

}  // namespace
}  // namespace dimattn::kernels
