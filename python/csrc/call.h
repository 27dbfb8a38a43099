#pragma once
// One call of the ops (python/csrc/torch_ops.cpp) made into dimattn's terms:
// the names become Dims (CallPlan, kept per thread by the call's structure;
// DimTable, with the call's dynamic dims), the arguments AttentionOptions
// (Call), the run context (RunScope), and the result ATen again (in_order,
// run). What the ops' kernels (torch_ops.cpp) and their autograd
// (autograd.cpp) share.
#include <ATen/core/Tensor.h>
#include <ATen/core/stack.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dimattn/attention.h"
#include "dimattn/context_parallel.h"
#include "dimattn/forcing.h"
#include "dimattn/run_context.h"
#include "dimattn/torch_interop.h"
#include "op_args.h"

namespace dimattn::python {

using Names = std::vector<std::string>;

// Throws dimattn::Error "[dot_attention] msg".
[[noreturn]] void fail(const std::string& msg);
// "(a, b, c)".
std::string join(const Names& names);
// The call's lengths tensors, one per dynamic dim (lengths_of's order).
std::vector<at::Tensor> lengths_of(const OpArgs& a);

// What a call's Dims are, from its names and its tensors' shapes alone: each
// dim's name, the static Dims, and how the dynamic ones are made. Checking
// the shapes against the names and making the Dims is most of the op's own
// work on a small call, and a model makes the same few calls every step, so
// plans are kept per thread (plan_for) and a repeated call reuses its Dims.
// Only structure is kept: a dynamic dim's lengths are that call's tensor and
// change per step, so dynamic Dims (and the operands' Dims that hold one) are
// made per call (DimTable), never kept.
struct CallPlan {
  Names names;  // slot -> name
  Dims dims;    // slot -> Dim; a placeholder in a dynamic dim's slot
  struct Dynamic {
    size_t slot;
    size_t lengths;            // index into the lengths argument
    std::vector<size_t> over;  // the lengths' dims
    std::optional<int64_t> extent;
  };
  std::vector<Dynamic> dynamic;  // in an order that makes the dims of a dim's lengths first
  Names q_names, k_names, v_names, out_names;
  Names lse_names;  // out_names without the value features: each row's lse (dot_attention_lse)
  Dims q, k, v;  // the operands' Dims, for a call without dynamic dims

  explicit CallPlan(const OpArgs& a) : CallPlan(a, a.operand_names()) {}
  CallPlan(const OpArgs& a, OpArgs::OperandNames n);

  // The slot of a dim of the call; fails naming it otherwise.
  size_t slot(const std::string& name) const;

 private:
  Dims of(const Names& ns) const;
  static void take_sizes(std::map<std::string, int64_t>& sizes, const std::string& what, const Names& names,
                         const at::Tensor& t);
};

// The plans of this thread by structure key (OpArgs::structure_key: the
// names, options and shapes; not the data), the most recent 256.
std::shared_ptr<const CallPlan> plan_for(const OpArgs& a);

// One call's Dims by name: the plan's, with this call's dynamic dims.
class DimTable {
 public:
  DimTable(std::shared_ptr<const CallPlan> plan, const OpArgs& a) : plan_(std::move(plan)) {
    if (plan_->dynamic.empty()) return;
    bound_ = plan_->dims;
    Dims& dims = *bound_;
    const std::vector<at::Tensor> lengths = lengths_of(a);
    for (const CallPlan::Dynamic& d : plan_->dynamic) {
      Dims over;
      for (const size_t i : d.over) over.push_back(dims[i]);
      dims[d.slot] = Dim::dynamic(plan_->names[d.slot], from_aten(lengths[d.lengths], over), d.extent);
    }
  }

  const Dim& operator[](const std::string& name) const { return all()[plan_->slot(name)]; }
  Dims dims(const Names& names) const {
    Dims out;
    for (const std::string& n : names) out.push_back((*this)[n]);
    return out;
  }
  bool has(const Dim& d) const {
    for (const Dim& e : all())
      if (e == d) return true;
    return false;
  }
  // The operands' Dims: the plan's own when no dim is dynamic.
  Dims operand(const Dims& planned, const Names& names) const { return bound_ ? dims(names) : planned; }

 private:
  const Dims& all() const { return bound_ ? *bound_ : plan_->dims; }

  std::shared_ptr<const CallPlan> plan_;
  std::optional<Dims> bound_;  // with this call's dynamic dims, for a call that has some
};

struct Call {
  Call(std::shared_ptr<const CallPlan> p, const OpArgs& a)
      : plan(std::move(p)), table(plan, a), opts{table[a[Arg::key_dim].toStringRef()], table[a[Arg::axis].toStringRef()]} {}

  std::shared_ptr<const CallPlan> plan;
  DimTable table;
  AttentionOptions opts;
  std::optional<Tensor> q, k, v;
  std::optional<ContextParallel> cp;  // with cp_group

  // dot_attention, or context_parallel_attention with cp_group.
  Tensor attend() const {
    return cp ? context_parallel_attention(*q, *k, *v, opts, *cp) : dot_attention(*q, *k, *v, opts);
  }
};

// The call's Dims, operands, options and context-parallel spec.
Call make_call(const OpArgs& a);

// The run context a call asks for: forcing (else DIMATTN_SDPA), the train
// flag, and the seed its dropout draws from.
class RunScope {
 public:
  explicit RunScope(const OpArgs& a) : train_(flag_of(a[Arg::train])) {
    const Names force = names_of(a[Arg::force]);
    if (!force.empty()) {
      std::string spec;
      for (const std::string& k : force) spec += (spec.empty() ? "" : ",") + k;
      force_.emplace(spec);
    }
    if (!a[Arg::seed].isNone()) set_random_seed(static_cast<uint64_t>(a[Arg::seed].toTensor().item<int64_t>()));
  }

 private:
  std::optional<ForceKernels> force_;
  TrainFlagScope train_;
};

// x's data with its dims in the order `names` gives, as a new contiguous
// tensor that aliases no input (a custom op's output must not).
at::Tensor in_order(const Tensor& x, const Names& names, const DimTable& t, const char* what, const OpArgs& a);

// The call's result, in out_dims' order.
at::Tensor run(const OpArgs& a);

// The learnable tensors of a call (AttentionVariants::learnable), in field
// order: their argument positions (relative to the query).
std::vector<size_t> learnable_args(const OpArgs& a);

// A boxed kernel's call: its arguments, the last `extra` of which follow the
// groups up to `parts`.
inline OpArgs call_on(torch::jit::Stack* stack, Parts parts, size_t extra = 0) {
  return OpArgs(&*(stack->end() - static_cast<std::ptrdiff_t>(OpArgs::count(parts) + extra)), parts);
}

}  // namespace dimattn::python
