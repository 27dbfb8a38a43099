#include "adapters/cuda_flash_gate.h"

#include <string>

#include "cuda/flash_attention_cuda.h"

namespace dimattn::detail {

GateResult cuda_flash_gate(const AttentionParams& p, bool compiled) {
  if (p.device != DeviceType::cuda) return GateResult::fail("runs on CUDA only");
  if (!compiled) return GateResult::fail("dimattn was built without CUDA (DIMATTN_WITH_CUDA=OFF or no nvcc)");
  if (p.dtype != DType::bfloat16 && p.dtype != DType::float16)
    return GateResult::fail(std::string("does not take ") + dtype_name(p.dtype) + "; bfloat16 or float16");
  if (p.head_dim_qk != p.head_dim_v)
    return GateResult::fail("needs equal qk and v head dims, got " + std::to_string(p.head_dim_qk) + " and " +
                            std::to_string(p.head_dim_v));
  if (p.head_dim_qk != 64 && p.head_dim_qk != 128)
    return GateResult::fail("takes head dim 64 or 128, got " + std::to_string(p.head_dim_qk));
  if (p.requires_grad && p.deterministic)
    return GateResult::fail("backward is not deterministic (dq is summed with float32 atomics)");
  // DESIGN.md §8: no new variant before the kernel has run on a GPU.
  if (p.variants.has(VariantKind::rel_pos))
    return GateResult::fail("does not take relative positions (pos_emb) until it has run on a GPU; the reference "
                            "path computes them");
  // Every layout class is taken: views whose strides or alignment the kernel
  // cannot read (last-dim stride != 1, rows not 16-byte aligned) are copied
  // once by the adapter, and counted.
  return GateResult::pass();
}

GateResult cuda_flash_gate(const AttentionParams& p) { return cuda_flash_gate(p, kernels::cuda_flash_compiled()); }

}  // namespace dimattn::detail
