// dot_attention_block and dot_attention_block_backward: a call cut into
// blocks (query chunks x kv chunks, placed by AttentionOptions::positions)
// and merged through the lse equals the whole call — output and gradients,
// dropout, windows, ALiBi and segments included — on every backend with a CPU kernel.
// The building blocks of context parallelism (docs/distributed.md).
#include <functional>
#include <optional>
#include <utility>

#include "dimattn/attention.h"
#include "dimattn/forcing.h"
#include "dimattn/registry.h"
#include "dimattn/ops.h"
#include "dimattn/run_context.h"
#include "support/test_util.h"

namespace dimattn {
namespace {

struct Variant {
  const char* name;
  bool causal;
  double dropout;
  bool window_alibi;
  bool segments = false;  // ids over [batch, time]; each block gets the slices of its rows and kv positions
};

// Where blocks run: each backend's CPU kernel in float64, and cuda_flash on
// CUDA tensors (bfloat16, head dim 64; skipped without a GPU). The whole call
// is always computed on the CPU in float64 from the same (rounded) values.
struct Place {
  std::string backend;
  Device device;
  DType dtype;
  int64_t head_dim;
  double tol;  // outputs; gradients twice it
};

TEST(Blocks, MergedBlocksEqualTheWholeCall) {
  const std::vector<Variant> variants = {{"plain", false, 0.0, false},       {"causal", true, 0.0, false},
                                         {"dropout", false, 0.3, false},     {"causal dropout", true, 0.3, false},
                                         {"window + ALiBi", true, 0.0, true}, {"window + ALiBi, no causal", false, 0, true},
                                         {"segments, causal dropout", true, 0.3, false, true},
                                         {"segments + window + ALiBi", false, 0.0, true, true}};
  const std::vector<std::pair<int64_t, int64_t>> q_chunks = {{0, 4}, {4, 10}}, kv_chunks = {{0, 3}, {3, 7}, {7, 10}};
  // bfloat16 (docs/numerics.md): each block's output is rounded before the merge.
  const std::vector<Place> places = {{"eigen", kCPU, DType::float64, 8, 1e-10},
                                     {"torch", kCPU, DType::float64, 8, 1e-10},
                                     {"torch", kCUDA, DType::bfloat16, 64, 2e-2}};
  int ran = 0, expected = 0;
  for (const Place& place : places) {
    if (!has_backend(place.backend) || !get_backend(place.backend).supports(place.device)) continue;
    expected += static_cast<int>(variants.size());
    const std::string backend = place.backend;
    for (const Variant& var : variants) {
      SCOPED_TRACE(backend + (place.device == kCUDA ? " cuda, " : ", ") + var.name);
      const TensorOptions o64{.dtype = DType::float64, .backend = backend};
      // To the place's device and dtype, and back to the CPU in float64.
      auto there = [&](const Tensor& x) { return to_device(cast(x, place.dtype), place.device); };
      auto back = [&](const Tensor& x) { return cast(to_device(x, kCPU), DType::float64); };
      Dim batch("batch", 2), heads("heads", 2), time("time", 10), feat("feat", place.head_dim),
          vfeat("vfeat", place.device == kCUDA ? place.head_dim : 4);
      const Tensor qx = there(random_normal({batch, heads, time, feat}, 1, o64));
      const Tensor kx = there(random_normal({batch, heads, time, feat}, 2, o64));
      const Tensor vx = there(random_normal({batch, heads, time, vfeat}, 3, o64));
      const Tensor doutx = there(random_normal({batch, heads, time, vfeat}, 4, o64));
      const Tensor q = back(qx), k = back(kx), v = back(vx), dout = back(doutx);
      // Documents of 3 and of 4 positions (entry 1 shifted by one).
      const Tensor ids = from_host({batch, time}, {0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2},
                                   {.dtype = DType::int64, .backend = backend});
      // The ids of positions [start, start + extent(d)) over d (time itself: all of them).
      auto ids_over = [&](const Dim& d, int64_t start, bool placed) {
        const Tensor x = d == time ? ids : slice(ids, time, start, start + d.extent(), d).first;
        return placed ? to_device(x, place.device) : x;
      };
      // placed: for the blocks (ALiBi's slopes on the place's device); qs, ks:
      // where the block's rows and kv positions start.
      auto options = [&](const Dim& qd, const Dim& kd, bool placed = false, int64_t qs = 0, int64_t ks = 0) {
        AttentionOptions o{.key_dim = feat, .axis = kd, .att_dropout = var.dropout};
        if (var.causal) o.causal_query_spatial_dim = qd;
        else o.query_position_dim = qd;
        if (var.window_alibi) {
          o.variants.window = AttentionWindow{.left = 3};
          const Tensor slopes = from_host({heads}, {0.5, 0.25}, o64);
          o.variants.alibi_slopes = placed ? to_device(slopes, place.device) : slopes;
        }
        if (var.segments) {
          o.variants.query_segments = ids_over(qd, qs, placed);
          o.variants.kv_segments = ids_over(kd, ks, placed);
        }
        return o;
      };
      const TrainFlagScope train(true);
      // The whole call: its output through the reference path, its gradients
      // through the backend's fused backward, from one seed.
      set_random_seed(5);
      const Tensor whole = [&] {
        const ForceKernels force("reference");
        return dot_attention(q, k, v, options(time, time));
      }();
      set_random_seed(5);
      const AttentionGrads g = dot_attention_backward(q, k, v, options(time, time), dout);

      std::vector<Tensor> dk_parts, dv_parts;
      for (const auto& [ks, ke] : kv_chunks) {
        Dim kd("kv", ke - ks);
        dk_parts.push_back(zeros({batch, heads, kd, feat}, o64));
        dv_parts.push_back(zeros({batch, heads, kd, vfeat}, o64));
      }
      for (const auto& [qs, qe] : q_chunks) {
        const auto [qc, qd] = slice(qx, time, qs, qe);
        const Tensor dout_c = slice(doutx, time, qs, qe, qd).first;
        // The forward blocks of this query chunk, merged through the lse.
        std::vector<AttentionBlock> blocks;
        std::vector<std::pair<Tensor, Tensor>> kvs;
        std::vector<AttentionOptions> opts;
        for (const auto& [ks, ke] : kv_chunks) {
          const auto [kc, kd] = slice(kx, time, ks, ke);
          const Tensor vc = slice(vx, time, ks, ke, kd).first;
          AttentionOptions o = options(qd, kd, true, qs, ks);
          o.positions = AttentionPositions{qs, ks};
          set_random_seed(5);
          const AttentionBlock b = dot_attention_block(qc, kc, vc, o);
          blocks.push_back({back(b.output), back(b.lse)});
          kvs.emplace_back(kc, vc);
          opts.push_back(o);
        }
        Tensor top = blocks[0].lse;
        for (const AttentionBlock& b : blocks) top = maximum(top, b.lse);  // every row has a finite block here
        Tensor sum = zeros(top.dims(), o64);
        for (const AttentionBlock& b : blocks) sum = sum + exp(b.lse - top);
        const Tensor lse = top + log(sum);
        Tensor out = zeros({batch, heads, qd, vfeat}, o64);
        for (const AttentionBlock& b : blocks) out = out + exp(b.lse - lse) * b.output;
        EXPECT_LT(testing::max_abs_diff(out, slice(whole, time, qs, qe, qd).first, out.dims()), place.tol) << "output";

        // The merged output and lse as the kernel takes them: the call's
        // dtype, float32 lse (float64 for float64), on the place's device.
        const AttentionBlock merged{there(out), to_device(cast(lse, place.dtype == DType::float64 ? DType::float64
                                                                                              : DType::float32),
                                                        place.device)};
        Tensor dq = zeros(qc.dims(), o64);
        for (size_t b = 0; b < blocks.size(); ++b) {
          set_random_seed(5);
          const AttentionGrads gb =
              dot_attention_block_backward(qc, kvs[b].first, kvs[b].second, opts[b], merged, dout_c);
          dq = dq + back(gb.query);
          // This chunk's kv dim is a slice of its own: renamed to the part's.
          dk_parts[b] = dk_parts[b] + replace_dim(back(gb.keys), opts[b].axis, dk_parts[b].dims()[2]);
          dv_parts[b] = dv_parts[b] + replace_dim(back(gb.values), opts[b].axis, dv_parts[b].dims()[2]);
        }
        EXPECT_LT(testing::max_abs_diff(dq, slice(g.query, time, qs, qe, qd).first, dq.dims()), 2 * place.tol)
            << "d(query)";
      }
      for (size_t b = 0; b < kv_chunks.size(); ++b) {
        const Dim kd = dk_parts[b].dims()[2];
        const auto [ks, ke] = kv_chunks[b];
        EXPECT_LT(testing::max_abs_diff(dk_parts[b], slice(g.keys, time, ks, ke, kd).first, dk_parts[b].dims()),
                  2 * place.tol)
            << "d(keys) block " << b;
        EXPECT_LT(testing::max_abs_diff(dv_parts[b], slice(g.values, time, ks, ke, kd).first, dv_parts[b].dims()),
                  2 * place.tol)
            << "d(values) block " << b;
      }
      ++ran;
    }
  }
  if (ran == 0) GTEST_SKIP() << "no backend with a CPU kernel";
  EXPECT_EQ(ran, expected);
}

// Dropout keyed by positions: the blocks of one sequence draw the single
// call's mask, so a block placed elsewhere draws another.
TEST(Blocks, PositionsKeyTheDropoutMask) {
  if (!has_backend("eigen")) GTEST_SKIP();
  const TensorOptions o64{.dtype = DType::float64, .backend = "eigen"};
  Dim time("time", 8), feat("feat", 4), vfeat("vfeat", 4);
  const Tensor x = random_normal({time, feat}, 1, o64), v = random_normal({time, vfeat}, 2, o64);
  const TrainFlagScope train(true);
  auto run = [&](int64_t q, int64_t kv) {
    AttentionOptions o{.key_dim = feat, .axis = time, .att_dropout = 0.5, .query_position_dim = time};
    o.positions = AttentionPositions{q, kv};
    set_random_seed(5);
    return dot_attention_block(x, x, v, o).output;
  };
  EXPECT_EQ(testing::max_abs_diff(run(3, 3), run(3, 3), {time, vfeat}), 0.0);
  EXPECT_GT(testing::max_abs_diff(run(3, 3), run(0, 0), {time, vfeat}), 1e-3) << "positions do not key the mask";
}

// AttentionOptions::dropout_seed gives the mask whatever the run context's
// seed (the blocks of one sequence share one), and draws nothing from it.
TEST(Blocks, DropoutSeedGivesTheMask) {
  for (const std::string backend : {"eigen", "torch"}) {
    if (!has_backend(backend)) continue;
    const TensorOptions o64{.dtype = DType::float64, .backend = backend};
    Dim time("time", 8), feat("feat", 4), vfeat("vfeat", 4);
    const Tensor x = random_normal({time, feat}, 1, o64), v = random_normal({time, vfeat}, 2, o64);
    const TrainFlagScope train(true);
    auto run = [&](uint64_t run_seed, std::optional<uint64_t> seed) {
      AttentionOptions o{.key_dim = feat, .axis = time, .att_dropout = 0.5, .query_position_dim = time};
      o.dropout_seed = seed;
      set_random_seed(run_seed);
      return dot_attention_block(x, x, v, o).output;
    };
    EXPECT_EQ(testing::max_abs_diff(run(1, 7), run(2, 7), {time, vfeat}), 0.0) << backend;
    EXPECT_GT(testing::max_abs_diff(run(1, 7), run(1, 8), {time, vfeat}), 1e-3) << backend << ": the seed is not used";
    EXPECT_GT(testing::max_abs_diff(run(1, std::nullopt), run(2, std::nullopt), {time, vfeat}), 1e-3) << backend;
    set_random_seed(3);
    const uint64_t first = next_random_seed();
    set_random_seed(3);
    run(3, 7);
    EXPECT_EQ(next_random_seed(), first) << backend << ": a call with its own seed drew one from the run context";
  }
}

// The reference path keys a block's dropout as the kernels do: a call placed
// by positions (odd, so the kernels' first group of four is unaligned) draws
// one mask on both.
TEST(Blocks, ReferenceAndKernelDrawOneMaskForABlock) {
  int ran = 0;
  for (const std::string backend : {"eigen", "torch"}) {
    if (!has_backend(backend)) continue;
    const TensorOptions o64{.dtype = DType::float64, .backend = backend};
    Dim batch("batch", 2), heads("heads", 3), tq("tq", 7), tk("tk", 13), feat("feat", 8), vfeat("vfeat", 4);
    const Tensor q = random_normal({batch, heads, tq, feat}, 1, o64);
    const Tensor k = random_normal({batch, heads, tk, feat}, 2, o64), v = random_normal({batch, heads, tk, vfeat}, 3, o64);
    const TrainFlagScope train(true);
    for (const bool broadcast : {false, true}) {
      AttentionOptions o{.key_dim = feat, .axis = tk, .att_dropout = 0.4, .att_dropout_broadcast = broadcast,
                         .causal_query_spatial_dim = tq};
      o.positions = AttentionPositions{.query = 21, .kv = 5};
      auto run = [&](const char* kernel) {
        const ForceKernels force(kernel);
        set_random_seed(9);
        return dot_attention(q, k, v, o);
      };
      EXPECT_LT(testing::max_abs_diff(run("reference"), run("cpu_flash"), {batch, heads, tq, vfeat}), 1e-12)
          << backend << (broadcast ? " broadcast" : "");
      ++ran;
    }
  }
  if (ran == 0) GTEST_SKIP() << "no backend with cpu_flash";
}

// Blocks and gradients outside autograd run from the backend's kernel
// table, so forcing reaches them: forced cpu_flash computes them, and every
// other CPU kernel forced (the reference path and ATen's give no lse and have
// no backward pass of their own) is an error naming it and why, never a
// silent fallback to cpu_flash.
TEST(Blocks, ForcingReachesBlocksAndGradients) {
  int ran = 0;
  for (const std::string backend : {"eigen", "torch"}) {
    if (!has_backend(backend)) continue;
    const TensorOptions o64{.dtype = DType::float64, .backend = backend};
    Dim time("time", 5), feat("feat", 4), heads("heads", 2);
    const Tensor x = random_normal({heads, time, feat}, 1, o64), dout = random_normal({heads, time, feat}, 2, o64);
    const AttentionOptions o{.key_dim = feat, .axis = time, .query_position_dim = time};
    const AttentionBlock merged = dot_attention_block(x, x, x, o);
    const auto block = [&] { dot_attention_block(x, x, x, o); };
    const auto grads = [&] { dot_attention_backward(x, x, x, o, dout); };
    const auto block_grads = [&] { dot_attention_block_backward(x, x, x, o, merged, dout); };
    {
      const ForceKernels force("cpu_flash");
      EXPECT_EQ(testing::error_of(block), "") << backend;
      EXPECT_EQ(testing::error_of(grads), "") << backend;
      EXPECT_EQ(testing::error_of(block_grads), "") << backend;
    }
    for (const std::string& kernel : get_backend(backend).attention_kernels(kCPU)) {
      if (kernel == "cpu_flash") continue;
      const ForceKernels force(kernel);
      const std::string why = backend + " forcing " + kernel;
      std::string msg = testing::error_of(block);
      EXPECT_EQ(msg.rfind("[dot_attention_block] no forced kernel can compute this call as a block", 0), 0u)
          << why << ": " << msg;
      EXPECT_NE(msg.find(kernel + ": gives no lse"), std::string::npos) << why << ": " << msg;
      for (const auto& [op, run] : {std::pair{"dot_attention_backward", std::function<void()>(grads)},
                                    std::pair{"dot_attention_block_backward", std::function<void()>(block_grads)}}) {
        msg = testing::error_of(run);
        EXPECT_EQ(msg.rfind("[" + std::string(op) + "] no forced kernel can compute this call's gradients", 0), 0u)
            << why << ": " << msg;
        EXPECT_NE(msg.find(kernel + ": has no backward pass of its own"), std::string::npos) << why << ": " << msg;
      }
      ++ran;
    }
  }
  if (ran == 0) GTEST_SKIP() << "no backend with cpu_flash";
}

TEST(Blocks, BadInputIsAnError) {
  if (!has_backend("eigen")) GTEST_SKIP();
  const TensorOptions eo{.backend = "eigen"};
  Dim time("time", 4), feat("feat", 8), heads("heads", 2);
  const Tensor x = random_normal({heads, time, feat}, 1, eo);
  std::string msg = testing::error_of([&] {
    AttentionOptions o{.key_dim = feat, .axis = time};
    o.positions = AttentionPositions{4, 0};
    dot_attention_block(x, x, x, o);
  });
  EXPECT_NE(msg.find("causal_query_spatial_dim or query_position_dim"), std::string::npos) << msg;
  msg = testing::error_of([&] {
    AttentionOptions o{.key_dim = feat, .axis = time, .query_position_dim = time};
    o.variants.sinks = from_host({heads}, {0.1, 0.2}, eo);
    dot_attention_block(x, x, x, o);
  });
  EXPECT_EQ(msg.rfind("[dot_attention_block]", 0), 0u) << msg;
  EXPECT_NE(msg.find("sinks"), std::string::npos) << msg;
  // A merged result over other dims than the block's output.
  msg = testing::error_of([&] {
    AttentionOptions o{.key_dim = feat, .axis = time, .query_position_dim = time};
    const Dim other("other", 3);
    dot_attention_block_backward(x, x, x, o, {random_normal({heads, other, feat}, 2, eo), zeros({heads, other}, eo)},
                                 random_normal({heads, time, feat}, 3, eo));
  });
  EXPECT_EQ(msg.rfind("[dot_attention_block_backward]", 0), 0u) << msg;
  EXPECT_NE(msg.find("the merged output has dims"), std::string::npos) << msg;
  EXPECT_NE(msg.find("other[3]"), std::string::npos) << msg;
}

}  // namespace
}  // namespace dimattn
