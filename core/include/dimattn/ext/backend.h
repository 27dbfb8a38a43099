#pragma once
// The Backend interface: raw primitives over positional axes, plus the
// attention hook. Backends never reason about names; the frontend maps names
// to axes before it calls them and after they return.
//
// Conventions for every primitive:
// - shapes are row-major, axis 0 outermost; a rank-0 tensor has shape {};
// - binary ops and where() take operands of equal rank and broadcast axes of
//   size 1 (numpy rules);
// - results are new tensors or views; callers never write into operands.
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dimattn/ext/attention_call.h"
#include "dimattn/ext/kernel_table.h"
#include "dimattn/ext/process_group.h"
#include "dimattn/dtype.h"
#include "dimattn/selection.h"
#include "dimattn/tensor.h"

namespace dimattn {

using Shape = std::vector<int64_t>;

enum class BinaryOp { add, sub, mul, div, maximum, minimum, eq, ne, lt, le, gt, ge, logical_and, logical_or };
enum class UnaryOp { neg, exp, log, sqrt, abs, logical_not, tanh };
enum class ReduceOp { sum, max, min, mean, logsumexp };
enum class RandomKind { normal, uniform };

const char* op_name(BinaryOp);
const char* op_name(UnaryOp);
const char* op_name(ReduceOp);

// A CPU tensor's memory as raw-pointer kernels read it.
struct HostView {
  void* data = nullptr;  // first element
  Shape sizes;
  std::vector<int64_t> strides;  // in elements
  DType dtype = DType::float32;
};

// Backend::apply_custom_function's function. forward: the outputs, and the
// tensors backward needs (the backend saves them). backward: from those and
// the outputs' gradients (over each output's dims; zeros where unused), the
// inputs' gradients, each over its input's dims in its order.
struct CustomFunction {
  struct Result {
    std::vector<Tensor> outputs, saved;
  };
  std::function<Result(const std::vector<Tensor>& inputs)> forward;
  std::function<std::vector<Tensor>(const std::vector<Tensor>& saved, const std::vector<Tensor>& grad_outputs)>
      backward;
};

class Backend {
 public:
  virtual ~Backend() = default;

  virtual std::string name() const = 0;
  virtual bool supports(Device device) const = 0;
  virtual bool has_autograd() const { return false; }

  // --- creation and host transfer (data row-major, as double) ---
  virtual RawPtr full(const Shape& shape, double value, DType dtype, Device device) = 0;
  virtual RawPtr from_host(const Shape& shape, const std::vector<double>& data, DType dtype, Device device) = 0;
  virtual std::vector<double> to_host(const RawPtr& x) = 0;
  // Same seed, shape and dtype give the same values on the same backend.
  virtual RawPtr random(const Shape& shape, RandomKind kind, double a, double b, uint64_t seed, DType dtype,
                        Device device) = 0;
  virtual RawPtr arange(int64_t n, DType dtype, Device device) = 0;

  // --- introspection ---
  virtual Shape shape(const RawPtr& x) = 0;

  // --- layout ---
  virtual RawPtr cast(const RawPtr& x, DType dtype) = 0;
  virtual RawPtr to_device(const RawPtr& x, Device device) = 0;
  virtual RawPtr permute(const RawPtr& x, const std::vector<int>& perm) = 0;
  // pre: product of shape equals x's element count.
  virtual RawPtr reshape(const RawPtr& x, const Shape& shape) = 0;
  // Broadcast size-1 axes to `shape` (same rank); may be a zero-stride view.
  virtual RawPtr expand(const RawPtr& x, const Shape& shape) = 0;
  virtual RawPtr concat(const std::vector<RawPtr>& xs, int axis) = 0;
  virtual RawPtr slice(const RawPtr& x, int axis, int64_t start, int64_t end) = 0;
  // take_along_axis: idx (int64) has x's rank and x's sizes except on `axis`;
  // out[..., i, ...] = x[..., idx[..., i, ...], ...].
  virtual RawPtr gather(const RawPtr& x, int axis, const RawPtr& idx) = 0;
  // x itself when dense row-major, else a dense row-major copy.
  virtual RawPtr contiguous(const RawPtr& x) = 0;
  // x's memory when it lives on the host and the backend exposes it; kernels
  // in kernels/cpu read and write through it. Default: not exposed.
  virtual std::optional<HostView> host_view(const RawPtr& x);

  // --- math ---
  virtual RawPtr binary(BinaryOp op, const RawPtr& a, const RawPtr& b) = 0;
  virtual RawPtr unary(UnaryOp op, const RawPtr& x) = 0;
  virtual RawPtr where(const RawPtr& cond, const RawPtr& a, const RawPtr& b) = 0;
  // Removes `axes` (sorted, unique).
  virtual RawPtr reduce(ReduceOp op, const RawPtr& x, const std::vector<int>& axes) = 0;
  virtual RawPtr softmax(const RawPtr& x, int axis, bool log) = 0;
  // Batched matrix product: a [B, M, K] x b [B, K, N] -> [B, M, N].
  virtual RawPtr bmm(const RawPtr& a, const RawPtr& b) = 0;

  // --- autograd (only where has_autograd()) ---
  virtual void set_requires_grad(const RawPtr& x, bool on);
  virtual bool requires_grad(const RawPtr& x);
  virtual RawPtr grad(const RawPtr& x);  // nullptr when none
  virtual void backward(const RawPtr& scalar);

  // A function the frontend computes itself, with a backward pass it
  // computes itself (context parallelism's ring). Backends with autograd
  // record it as one node; default: forward's outputs, untracked.
  virtual std::vector<Tensor> apply_custom_function(const std::vector<Tensor>& inputs,
                                                    std::shared_ptr<const CustomFunction> fn);

  // --- collectives ---
  // The process group of that name (ProcessGroup), each wait bounded by
  // timeout_seconds when set. Default: throws, naming the backend.
  virtual std::unique_ptr<ProcessGroup> process_group(const std::string& name,
                                                      std::optional<double> timeout_seconds);

  // --- attention ---
  // dot_attention owns the choice between its reference path (frontend) and
  // a fused kernel: it asks plan_attention, runs the reference path itself
  // when that is the decision, and else asks run_attention to run the plan.
  // Both read the backend's kernel table.
  //
  // Every attention kernel of this backend, devices mixed, each device's in
  // priority order ending with the reference entry (kernel_table.h).
  // Default: the reference path alone.
  virtual const KernelTable& attention_table() const;
  // The selection fields of a call on this backend: the layout class is
  // detected from the views its kernels would read. Default: `separate`,
  // no gradients.
  virtual AttentionParams attention_params_of(const AttentionCall& call);
  // The plan for `call` and `use` (kernel_table.h's KernelUse): its
  // decision, with every rejected candidate's reason, and what the backend
  // derived to reach it. Default: attention_params_of and select_kernel over
  // attention_table().
  virtual AttentionPlanPtr plan_attention(const AttentionCall& call, KernelUse use);
  // plan_attention(call, KernelUse::run)'s decision.
  Decision decide_attention(const AttentionCall& call);
  // Runs the fused kernel `plan` chose for `call` (never the reference
  // path); returns the output (dims as AttentionCall says).
  // pre: plan = plan_attention(call, KernelUse::run) on this backend.
  Tensor run_attention(const AttentionCall& call, const AttentionPlan& plan);
  // The call as one block of a longer attention (dot_attention_block): its
  // output and lse from the block function of the kernel that
  // plan_attention(call, KernelUse::block) chose. Throws when no kernel of
  // the table (or none forced) gives the lse, with each one's reason.
  AttentionBlockResult attention_block(const AttentionCall& call);
  // Gradients of the call's output with respect to query, keys and values
  // for an upstream gradient over the output's dims, outside autograd, from
  // the backward function of the kernel that selection chose for it: for
  // backends without autograd (dot_attention_backward), and for blocks of a
  // longer attention on any backend. `merged` null: recomputes the forward
  // pass; else the call is one block and `merged` holds the output and lse
  // of the whole attention for the call's query rows (their gradients summed
  // over the blocks are the whole attention's). Throws as attention_block.
  AttentionCallGrads attention_backward(const AttentionCall& call, const Tensor& grad_output,
                                        const AttentionBlockResult* merged);
  // The names of attention_table()'s kernels on a device, in priority order.
  std::vector<std::string> attention_kernels(Device device) const;
};

// x's raw tensor with its dims permuted into their order in `order` and a
// size-1 axis for each dim of `order` that x lacks (broadcast to the dim's
// extent when `expand`): the name -> axis mapping every op and adapter uses.
// Throws, naming `op`, when x has a dim that `order` lacks.
RawPtr raw_in_order(const char* op, const Tensor& x, const Dims& order, bool expand);
// A tensor's values over `order` (dims it lacks broadcast), row-major, on the
// host: integers (lengths, offsets) and floats (ALiBi slopes, sinks).
// pre: t's dims are in order.
std::vector<int64_t> host_ints(const Tensor& t, const Dims& order);
std::vector<double> host_values(const Tensor& t, const Dims& order);

}  // namespace dimattn
