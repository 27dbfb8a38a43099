#pragma once
// The LibTorch backend ("torch"): every primitive maps to ATen ops, autograd
// is ATen's. Declared here, free of ATen headers, so that a fast-path file can
// add the attention kernels without re-reading the primitives.
// ATen errors (c10::Error) never leave a primitive: they are rethrown as
// dimattn::Error "[torch.<primitive>] ...".
#include <string>
#include <vector>

#include "dimattn/ext/backend.h"

namespace dimattn::torch_backend {

class TorchBackend : public Backend {
 public:
  std::string name() const override { return "torch"; }
  // cpu always; cuda:i when LibTorch sees a CUDA device with index i.
  bool supports(Device device) const override;
  bool has_autograd() const override { return true; }

  RawPtr full(const Shape& shape, double value, DType dtype, Device device) override;
  RawPtr from_host(const Shape& shape, const std::vector<double>& data, DType dtype, Device device) override;
  std::vector<double> to_host(const RawPtr& x) override;
  // Drawn on the CPU in float64 from a generator seeded with `seed`, then cast
  // and moved: the same seed gives the same values on cpu and cuda.
  RawPtr random(const Shape& shape, RandomKind kind, double a, double b, uint64_t seed, DType dtype,
                Device device) override;
  RawPtr arange(int64_t n, DType dtype, Device device) override;

  Shape shape(const RawPtr& x) override;

  RawPtr cast(const RawPtr& x, DType dtype) override;
  RawPtr to_device(const RawPtr& x, Device device) override;
  RawPtr permute(const RawPtr& x, const std::vector<int>& perm) override;
  RawPtr reshape(const RawPtr& x, const Shape& shape) override;
  RawPtr expand(const RawPtr& x, const Shape& shape) override;
  RawPtr concat(const std::vector<RawPtr>& xs, int axis) override;
  RawPtr slice(const RawPtr& x, int axis, int64_t start, int64_t end) override;
  RawPtr gather(const RawPtr& x, int axis, const RawPtr& idx) override;
  RawPtr contiguous(const RawPtr& x) override;
  std::optional<HostView> host_view(const RawPtr& x) override;

  RawPtr binary(BinaryOp op, const RawPtr& a, const RawPtr& b) override;
  RawPtr unary(UnaryOp op, const RawPtr& x) override;
  RawPtr where(const RawPtr& cond, const RawPtr& a, const RawPtr& b) override;
  RawPtr reduce(ReduceOp op, const RawPtr& x, const std::vector<int>& axes) override;
  RawPtr softmax(const RawPtr& x, int axis, bool log) override;
  RawPtr bmm(const RawPtr& a, const RawPtr& b) override;

  void set_requires_grad(const RawPtr& x, bool on) override;
  bool requires_grad(const RawPtr& x) override;
  RawPtr grad(const RawPtr& x) override;
  void backward(const RawPtr& scalar) override;

  // The fast paths (torch_attention.cpp): ATen's SDPA kernels and dimattn's
  // own, behind kernel selection; blocks of a longer attention and gradients
  // outside autograd on dimattn's own (cpu_flash, cuda_flash).
  const KernelTable& attention_table() const override;
  AttentionPlanPtr plan_attention(const AttentionCall& call, KernelUse use) override;
  // Context parallelism (torch_context_parallel.cpp): c10d's groups by name,
  // and the ring as one autograd node.
  std::vector<Tensor> apply_custom_function(const std::vector<Tensor>& inputs,
                                            std::shared_ptr<const CustomFunction> fn) override;
  std::unique_ptr<ProcessGroup> process_group(const std::string& name, std::optional<double> timeout_seconds) override;
};

}  // namespace dimattn::torch_backend
