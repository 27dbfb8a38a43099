// The dual harness on CUDA: each case (written once as data) runs on every
// CUDA kernel of the torch backend that accepts it, cuda_flash included, and
// is compared with the reference path on the same device — outputs and the
// gradients of q, k and v. Dropout cases compare a fused kernel with the
// reference at the dtype's tolerance: only the identical Philox mask passes.
// Skips where LibTorch sees no CUDA device (CI); scripts/gpu-check runs it.
#include <iostream>

#include "dimattn/tolerance.h"
#include "dimattn/attention.h"
#include "dimattn/ext/backend.h"
#include "dimattn/forcing.h"
#include "dimattn/run_context.h"
#include "dimattn/selection.h"
#include "support/test_util.h"

namespace dimattn {
namespace {
using testing::error_of;

struct CudaCase {
  std::string name;
  DType dtype = DType::bfloat16;
  int64_t B = 2, H = 2, G = 1, Tq = 100, Tk = 130, D = 64;
  bool causal = false;
  bool self = false;            // the query's time dim is the kv axis (Tq = Tk)
  std::vector<double> lengths;  // kv lengths per batch entry; empty = static
  std::vector<double> offsets;  // causal offset per batch entry; empty = none
  double dropout = 0;
  bool broadcast_dropout = false;
};


std::vector<CudaCase> cases() {
  std::vector<CudaCase> out;
  for (DType dt : {DType::bfloat16, DType::float16})
    for (int64_t D : {64, 128}) {
      const std::string s = std::string("_") + dtype_name(dt) + "_d" + std::to_string(D);
      out.push_back({.name = "cross" + s, .dtype = dt, .D = D});
      out.push_back({.name = "causal_self" + s, .dtype = dt, .Tq = 130, .D = D, .causal = true, .self = true});
      out.push_back({.name = "lengths" + s, .dtype = dt, .D = D, .lengths = {130, 41}});
      out.push_back({.name = "causal_offset" + s, .dtype = dt, .D = D, .causal = true, .offsets = {30, -3}});
      out.push_back({.name = "gqa_causal_lengths" + s, .dtype = dt, .G = 4, .Tq = 130, .D = D, .causal = true,
                     .self = true, .lengths = {130, 77}});
      out.push_back({.name = "mqa" + s, .dtype = dt, .H = 1, .G = 8, .D = D});
      out.push_back({.name = "dropout" + s, .dtype = dt, .Tq = 130, .D = D, .causal = true, .self = true,
                     .lengths = {130, 90}, .dropout = 0.3});
      out.push_back({.name = "dropout_gqa" + s, .dtype = dt, .G = 2, .D = D, .dropout = 0.2});
      out.push_back({.name = "broadcast_dropout" + s, .dtype = dt, .D = D, .lengths = {120, 9}, .dropout = 0.5,
                     .broadcast_dropout = true});
    }
  return out;
}

bool torch_cuda_available() { return has_backend("torch") && get_backend("torch").supports(kCUDA); }

struct Operands {
  Tensor q, k, v;
  AttentionOptions opts;
  Dims out_order;
};

Operands make_operands(const CudaCase& c) {
  const TensorOptions o{.dtype = c.dtype, .device = kCUDA, .backend = "torch"};
  const TensorOptions ints{.dtype = DType::int64, .device = kCUDA, .backend = "torch"};
  Dim batch("batch", c.B), heads("kv_heads", c.H), group("group", c.G), feat("feat", c.D);
  Dim kv = c.lengths.empty() ? Dim("kv", c.Tk) : Dim::dynamic("kv", from_host({batch}, c.lengths, ints), c.Tk);
  Dim time = c.self ? kv : Dim("time", c.Tq);
  Dims qd = {batch, heads};
  if (c.G > 1) qd.push_back(group);
  qd.push_back(time);
  qd.push_back(feat);
  Operands ops{random_normal(qd, 1, o), random_normal({batch, heads, kv, feat}, 2, o),
               random_normal({batch, heads, kv, feat}, 3, o), {.key_dim = feat, .axis = kv}, {}};
  if (c.causal) ops.opts.causal_query_spatial_dim = time;
  if (!c.offsets.empty()) ops.opts.causal_offset = from_host({batch}, c.offsets, ints);
  ops.opts.att_dropout = c.dropout;
  ops.opts.att_dropout_broadcast = c.broadcast_dropout;
  for (const Dim& d : qd)
    if (d != feat) ops.out_order.push_back(d);
  ops.out_order.push_back(feat);
  return ops;
}

struct RunResult {
  std::string kernel;
  Tensor out;
  std::vector<Tensor> grads;
};

Tensor fresh_leaf(const Tensor& x) {
  return from_host(x.dims(), to_host(x), {.dtype = x.dtype(), .device = x.device(), .backend = "torch"});
}

RunResult run(Operands ops, const std::string& force) {
  ForceKernels guard(force);
  for (Tensor* t : {&ops.q, &ops.k, &ops.v}) *t = fresh_leaf(*t).requires_grad(true);
  TrainFlagScope train(ops.opts.att_dropout > 0);
  set_random_seed(1234);  // the same dropout seed for every kernel and the reference
  Tensor out = dot_attention(ops.q, ops.k, ops.v, ops.opts);
  RunResult r{force, out, {}};
  Tensor w = random_normal(ops.out_order, 99, {.dtype = out.dtype(), .device = kCUDA, .backend = "torch"});
  reduce_sum(mul(out, w), ops.out_order).backward();
  for (Tensor* t : {&ops.q, &ops.k, &ops.v}) r.grads.push_back(*t->grad());
  return r;
}

class CudaDual : public ::testing::TestWithParam<CudaCase> {};

TEST_P(CudaDual, EveryCudaKernelAgreesWithTheReference) {
  if (!torch_cuda_available()) GTEST_SKIP() << "LibTorch sees no CUDA device";
  const CudaCase& c = GetParam();
  const Operands ops = make_operands(c);
  const RunResult ref = run(ops, "reference");
  const double tol = reference_tolerance(c.dtype);
  bool cuda_flash_ran = false;
  for (const std::string& kernel : get_backend("torch").attention_kernels(kCUDA)) {
    if (kernel == "reference") continue;
    std::optional<RunResult> got;
    const std::string err = error_of([&] { got = run(ops, kernel); });
    if (!err.empty()) {
      std::string reason = err;
      {
        ForceKernels force(kernel + ",reference");
        TrainFlagScope train(ops.opts.att_dropout > 0);
        for (const Rejection& r : explain_attention(ops.q, ops.k, ops.v, ops.opts).rejected)
          if (r.kernel == kernel) reason = r.reason;
      }
      EXPECT_FALSE(reason.empty());
      EXPECT_NE(kernel, "cuda_flash") << c.name << ": cuda_flash should take every case here: " << reason;
      std::cout << "[ cuda dual ] " << c.name << " " << kernel << ": rejected: " << reason << "\n";
      continue;
    }
    cuda_flash_ran = cuda_flash_ran || kernel == "cuda_flash";
    const double e = testing::max_abs_diff(got->out, ref.out, ops.out_order);
    std::cout << "[ cuda dual ] " << c.name << " " << kernel << ": max abs err " << e;
    EXPECT_LE(e, tol) << c.name << " " << kernel;
    for (size_t i = 0; i < got->grads.size(); ++i) {
      const Tensor& g = got->grads[i];
      const double ge = testing::max_abs_diff(g, ref.grads[i], g.dims());
      std::cout << ", d" << "qkv"[i] << " " << ge;
      EXPECT_LE(ge, 2 * tol) << c.name << " " << kernel << " grad of " << "qkv"[i];
    }
    std::cout << "\n";
  }
  EXPECT_TRUE(cuda_flash_ran) << c.name;
}

INSTANTIATE_TEST_SUITE_P(Cases, CudaDual, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<CudaCase>& i) { return i.param.name; });

// q, k, v as views of one packed [T, B, 3, H, D] buffer reach cuda_flash
// without a copy.
TEST(CudaDualLayouts, PackedQkvIsZeroCopy) {
  if (!torch_cuda_available()) GTEST_SKIP() << "LibTorch sees no CUDA device";
  Dim time("time", 256), batch("batch", 2), three("qkv", 3), heads("heads", 4), feat("feat", 64);
  Dim one("one", 1);
  Tensor buffer = random_normal({time, batch, three, heads, feat}, 7,
                                {.dtype = DType::bfloat16, .device = kCUDA, .backend = "torch"});
  Tensor q = slice(buffer, three, 0, 1, one).first;
  Tensor k = slice(buffer, three, 1, 2, one).first;
  Tensor v = slice(buffer, three, 2, 3, one).first;
  AttentionOptions o{.key_dim = feat, .axis = time, .causal_query_spatial_dim = time};
  ForceKernels force("cuda_flash");
  const uint64_t copies_before = selection_stats().layout_copies;
  Tensor fast = dot_attention(q, k, v, o);
  EXPECT_EQ(selection_stats().layout_copies, copies_before) << "q, k and v reach the kernel as views";
  Tensor ref = [&] {
    ForceKernels ref_force("reference");
    return dot_attention(q, k, v, o);
  }();
  EXPECT_LE(testing::max_abs_diff(fast, ref, {time, batch, one, heads, feat}),
            reference_tolerance(DType::bfloat16));
}

}  // namespace
}  // namespace dimattn
