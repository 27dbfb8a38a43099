#include "dimattn/ext/backend.h"

#include "dimattn/error.h"
#include "dimattn/internal/check.h"

namespace dimattn {

const char* op_name(BinaryOp op) {
  constexpr const char* names[] = {"add", "sub", "mul", "div", "maximum", "minimum", "eq",
                                   "ne",  "lt",  "le",  "gt",  "ge",      "logical_and", "logical_or"};
  return names[static_cast<int>(op)];
}
const char* op_name(UnaryOp op) {
  constexpr const char* names[] = {"neg", "exp", "log", "sqrt", "abs", "logical_not", "tanh"};
  return names[static_cast<int>(op)];
}
const char* op_name(ReduceOp op) {
  constexpr const char* names[] = {"sum", "max", "min", "mean", "logsumexp"};
  return names[static_cast<int>(op)];
}

std::optional<HostView> Backend::host_view(const RawPtr&) { return std::nullopt; }

// Backends without autograd: requests for gradients are errors, queries are "no".
void Backend::set_requires_grad(const RawPtr&, bool on) {
  DIMATTN_CHECK(!on, "requires_grad", "backend '", name(), "' has no autograd; use the torch backend for gradients");
}
bool Backend::requires_grad(const RawPtr&) { return false; }
RawPtr Backend::grad(const RawPtr&) { return nullptr; }
void Backend::backward(const RawPtr&) {
  detail::fail("backward", "backend '", name(), "' has no autograd; use the torch backend for gradients");
}

KernelEntry reference_entry(DeviceType device) {
  return {kReferenceKernel, device, [](const AttentionParams&) { return GateResult::pass(); }, {}, {}};
}

const KernelTable& Backend::attention_table() const {
  static const KernelTable table = {reference_entry(DeviceType::cpu), reference_entry(DeviceType::cuda)};
  return table;
}

AttentionParams Backend::attention_params_of(const AttentionCall& call) {
  return attention_params(call, LayoutClass::separate, false);
}

const KernelEntry* find_kernel(const KernelTable& table, DeviceType device, const std::string& name) {
  for (const KernelEntry& e : table)
    if (e.device == device && e.name == name) return &e;
  return nullptr;
}

AttentionPlanPtr Backend::plan_attention(const AttentionCall& call, KernelUse use) {
  auto plan = std::make_shared<AttentionPlan>();
  const KernelTable& table = attention_table();
  plan->decision = select_kernel(name(), attention_params_of(call), table, use);
  plan->entry = find_kernel(table, call.query.device().type, plan->decision.kernel);
  return plan;
}

Decision Backend::decide_attention(const AttentionCall& call) { return plan_attention(call, KernelUse::run)->decision; }

Tensor Backend::run_attention(const AttentionCall& call, const AttentionPlan& plan) {
  if (plan.entry && plan.entry->run) return plan.entry->run(*this, call, plan);
  detail::fail("dot_attention", "backend '", name(), "' has no attention kernel '", plan.decision.kernel, "' on ",
               device_name(call.query.device()), " to run");
}

std::vector<Tensor> Backend::apply_custom_function(const std::vector<Tensor>& inputs,
                                                   std::shared_ptr<const CustomFunction> fn) {
  return fn->forward(inputs).outputs;
}

std::unique_ptr<ProcessGroup> Backend::process_group(const std::string& group, std::optional<double>) {
  detail::fail("context_parallel_attention", "no process group named '", group, "' on backend '", name(),
               "', which has none; context parallelism runs on the torch backend over torch.distributed's groups");
}

AttentionBlockResult Backend::attention_block(const AttentionCall& call) {
  const AttentionPlanPtr plan = plan_attention(call, KernelUse::block);
  DIMATTN_CHECK(plan->entry && plan->entry->block, "dot_attention_block", "internal error: backend '", name(),
                "' chose kernel '", plan->decision.kernel, "', which has no block function, for a block");
  return plan->entry->block(*this, call, *plan);
}

AttentionCallGrads Backend::attention_backward(const AttentionCall& call, const Tensor& grad_output,
                                               const AttentionBlockResult* merged) {
  const KernelUse use = merged ? KernelUse::block_backward : KernelUse::backward;
  const AttentionPlanPtr plan = plan_attention(call, use);
  DIMATTN_CHECK(plan->entry && plan->entry->backward, kernel_use_op(use), "internal error: backend '", name(),
                "' chose kernel '", plan->decision.kernel, "', which has no backward function, for gradients");
  return plan->entry->backward(*this, call, *plan, grad_output, merged);
}

std::vector<std::string> Backend::attention_kernels(Device device) const {
  std::vector<std::string> names;
  for (const KernelEntry& e : attention_table())
    if (e.device == device.type) names.push_back(e.name);
  return names;
}

RawPtr raw_in_order(const char* op, const Tensor& x, const Dims& order, bool expand) {
  for (const Dim& d : x.dims())
    DIMATTN_CHECK(contains(order, d), op, "dim ", d.repr(), " of ", repr(x.dims()), " is missing from ", repr(order));
  Backend& b = x.backend();
  RawPtr raw = x.raw();
  // Permute x's own dims into the order they take in `order`.
  std::vector<int> perm;
  for (const Dim& d : order)
    if (int a = x.axis_of(d); a >= 0) perm.push_back(a);
  bool identity = true;
  for (size_t i = 0; i < perm.size(); ++i) identity = identity && perm[i] == static_cast<int>(i);
  if (!identity) raw = b.permute(raw, perm);
  if (order.size() == x.dims().size()) return raw;
  Shape ones, full_shape;
  for (const Dim& d : order) {
    ones.push_back(x.has(d) ? d.extent() : 1);
    full_shape.push_back(d.extent());
  }
  raw = b.reshape(raw, ones);
  return expand ? b.expand(raw, full_shape) : raw;
}

std::vector<double> host_values(const Tensor& t, const Dims& order) {
  return t.backend().to_host(raw_in_order("host_values", t, order, true));
}

std::vector<int64_t> host_ints(const Tensor& t, const Dims& order) {
  const std::vector<double> values = host_values(t, order);
  return std::vector<int64_t>(values.begin(), values.end());
}

}  // namespace dimattn
