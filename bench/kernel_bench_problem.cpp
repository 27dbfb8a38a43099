// kernel_bench's operands: q, k, v (and dout) of [B, H, T, D] with the
// params our kernel reads them through, and the pool it runs on.
#include <ATen/Parallel.h>

#include <cmath>
#include <vector>

#include "kernel_bench.h"

namespace dimattn::bench::kernel_bench {
namespace {

k::ElementStrides strides_of(const at::Tensor& t) {
  return {t.stride(0), t.stride(1), t.stride(2), t.stride(3)};
}

at::Tensor random_tensor(std::vector<int64_t> shape, at::ScalarType dt) {
  // In place: no temporaries beyond the float32 staging for bfloat16.
  at::Tensor x = at::empty(shape, at::kFloat).normal_();
  return dt == at::kFloat ? x : x.to(dt);
}

}  // namespace

Problem make_problem(int64_t B, int64_t H, int64_t T, int64_t D, at::ScalarType dt, bool causal, bool backward) {
  Problem pr;
  pr.q = random_tensor({B, H, T, D}, dt);
  pr.k = random_tensor({B, H, T, D}, dt);
  pr.v = random_tensor({B, H, T, D}, dt);
  pr.out = at::zeros({B, H, T, D}, dt);
  pr.lse = at::zeros({B, H, T}, at::kFloat);
  k::AttentionKernelParams& p = pr.p;
  p.dtype = dt == at::kFloat ? k::ElementType::float32 : k::ElementType::bfloat16;
  p.q = pr.q.data_ptr();
  p.k = pr.k.data_ptr();
  p.v = pr.v.data_ptr();
  p.out = pr.out.data_ptr();
  p.lse = pr.lse.data_ptr();
  p.batch = B;
  p.heads = H;
  p.kv_heads = H;
  p.seqlen_q = p.seqlen_k = T;
  p.head_dim = p.head_dim_v = D;
  p.q_strides = strides_of(pr.q);
  p.k_strides = strides_of(pr.k);
  p.v_strides = strides_of(pr.v);
  p.out_strides = strides_of(pr.out);
  p.lse_batch_stride = pr.lse.stride(0);
  p.lse_head_stride = pr.lse.stride(1);
  p.causal = causal;
  p.scale = 1.0 / std::sqrt(static_cast<double>(D));  // ATen's default scale
  if (backward) {
    pr.dout = random_tensor({B, H, T, D}, dt);
    pr.dq = at::zeros_like(pr.q);
    pr.dk = at::zeros_like(pr.k);
    pr.dv = at::zeros_like(pr.v);
    p.dout = pr.dout.data_ptr();
    p.dq = pr.dq.data_ptr();
    p.dk = pr.dk.data_ptr();
    p.dv = pr.dv.data_ptr();
    p.dout_strides = strides_of(pr.dout);
    p.dq_strides = strides_of(pr.dq);
    p.dk_strides = strides_of(pr.dk);
    p.dv_strides = strides_of(pr.dv);
  }
  return pr;
}

#if AT_PARALLEL_OPENMP && !defined(_OPENMP)
#error "compile with OpenMP (-fopenmp), or at::parallel_for runs serially"
#endif
k::ParallelFor aten_parallel_for() {
  // As the torch backend runs the kernel (backends/torch/torch_attention.cpp).
  return [](int64_t begin, int64_t end, const k::ParallelBody& body) {
    at::parallel_for(begin, end, 1, [&](int64_t b, int64_t e) { body(b, e); });
  };
}

}  // namespace dimattn::bench::kernel_bench
