// What context parallelism (context_parallel_attention, frontend/src/
// context_parallel*.cpp) needs of the
// torch backend: c10d's process groups, resolved by name through c10d's
// group registry (torch.distributed registers every group it creates there),
// and the ring as one autograd node (apply_custom_function). The only file
// that sees c10d's headers.
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <chrono>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "torch_backend.h"
#include "torch_raw.h"

namespace dimattn::torch_backend {
namespace {

constexpr const char* kOp = "context_parallel_attention";

// Runs a c10d call, turning its errors (c10::Error, gloo's, timeouts) into
// dimattn::Error naming what was under way.
template <class F>
decltype(auto) collective(const std::string& what, F&& body) {
  try {
    return body();
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    detail::fail(kOp, what, " failed: ", e.what());
  }
}

class C10dWork final : public CollectiveWork {
 public:
  C10dWork(c10::intrusive_ptr<c10d::Work> work, std::string what, std::optional<std::chrono::milliseconds> timeout,
           std::vector<at::Tensor> buffers)
      : work_(std::move(work)), what_(std::move(what)), timeout_(timeout), buffers_(std::move(buffers)) {}

  void wait() override {
    collective(what_, [&] {
      const bool done = timeout_ ? work_->wait(*timeout_) : work_->wait();
      DIMATTN_CHECK(done, kOp, what_, " did not complete in time");
    });
  }

 private:
  c10::intrusive_ptr<c10d::Work> work_;
  std::string what_;
  std::optional<std::chrono::milliseconds> timeout_;
  std::vector<at::Tensor> buffers_;  // alive until the transfer is done
};

class C10dGroup final : public ProcessGroup {
 public:
  C10dGroup(c10::intrusive_ptr<c10d::ProcessGroup> pg, std::string name, std::optional<double> timeout_seconds)
      : pg_(std::move(pg)), name_(std::move(name)) {
    if (timeout_seconds)
      timeout_ = std::chrono::milliseconds(static_cast<int64_t>(*timeout_seconds * 1000.0));
  }

  int rank() const override { return pg_->getRank(); }
  int size() const override { return pg_->getSize(); }

  CollectiveWorkPtr all_gather(const RawPtr& x, std::vector<RawPtr>& out) override {
    std::vector<at::Tensor> in{as_aten(x)};
    std::vector<std::vector<at::Tensor>> outs(1);
    for (int r = 0; r < size(); ++r) outs[0].push_back(at::empty_like(in[0]));
    out.clear();
    for (const at::Tensor& t : outs[0]) out.push_back(wrap(t));
    std::vector<at::Tensor> keep = outs[0];
    keep.push_back(in[0]);
    return start("all_gather", [&] { return pg_->allgather(outs, in); }, std::move(keep));
  }

  CollectiveWorkPtr all_reduce_sum(const RawPtr& x) override {
    std::vector<at::Tensor> t{as_aten(x)};
    return start("all_reduce", [&] { return pg_->allreduce(t); }, t);
  }

  CollectiveWorkPtr send(const RawPtr& x, int peer, int tag) override {
    std::vector<at::Tensor> t{as_aten(x)};
    return start("send to rank " + std::to_string(peer), [&] { return pg_->send(t, peer, tag); }, t);
  }

  CollectiveWorkPtr recv(const RawPtr& into, int peer, int tag) override {
    std::vector<at::Tensor> t{as_aten(into)};
    return start("receive from rank " + std::to_string(peer), [&] { return pg_->recv(t, peer, tag); }, t);
  }

 private:
  template <class F>
  CollectiveWorkPtr start(const std::string& op, F&& body, std::vector<at::Tensor> buffers) {
    const std::string what = op + " in group '" + name_ + "'";
    c10::intrusive_ptr<c10d::Work> work = collective(what, body);
    return std::make_unique<C10dWork>(std::move(work), what, timeout_, std::move(buffers));
  }

  c10::intrusive_ptr<c10d::ProcessGroup> pg_;
  std::string name_;
  std::optional<std::chrono::milliseconds> timeout_;
};

// apply_custom_function's node: the function and the dims of what crosses
// it, so that raw ATen tensors become dimattn Tensors again on each side.
struct CustomInfo : torch::CustomClassHolder {
  TorchBackend* be = nullptr;
  std::shared_ptr<const CustomFunction> fn;
  std::vector<Dims> input_dims;
  std::vector<Dims> output_dims, saved_dims;
};

Tensor rewrap(TorchBackend* be, const Dims& dims, const at::Tensor& t) {
  return Tensor(dims, dimattn_dtype(t.scalar_type()), dimattn_device(t.device()), wrap(t), be);
}

class CustomNode : public torch::autograd::Function<CustomNode> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, at::TensorList raws,
                                                c10::intrusive_ptr<CustomInfo> info) {
    std::vector<Tensor> in;
    for (size_t i = 0; i < raws.size(); ++i) in.push_back(rewrap(info->be, info->input_dims[i], raws[i]));
    const CustomFunction::Result r = info->fn->forward(in);
    torch::autograd::variable_list outs, saved;
    for (const Tensor& t : r.outputs) {
      outs.push_back(as_aten(t.raw()));
      info->output_dims.push_back(t.dims());
    }
    for (const Tensor& t : r.saved) {
      saved.push_back(as_aten(t.raw()));
      info->saved_dims.push_back(t.dims());
    }
    ctx->save_for_backward(saved);
    ctx->saved_data["info"] = at::IValue::make_capsule(std::move(info));
    return outs;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto info = c10::static_intrusive_pointer_cast<CustomInfo>(ctx->saved_data["info"].toCapsule());
    const torch::autograd::variable_list raws = ctx->get_saved_variables();
    std::vector<Tensor> saved, grad_outputs;
    for (size_t i = 0; i < raws.size(); ++i) saved.push_back(rewrap(info->be, info->saved_dims[i], raws[i]));
    for (size_t i = 0; i < grads.size(); ++i) {
      const at::Tensor g = grads[i].defined() ? grads[i] : at::zeros_like(raws.at(i));
      grad_outputs.push_back(rewrap(info->be, info->output_dims[i], g));
    }
    const std::vector<Tensor> g = info->fn->backward(saved, grad_outputs);
    torch::autograd::variable_list out;
    for (size_t i = 0; i < g.size(); ++i) {
      DIMATTN_CHECK(g[i].dims() == info->input_dims[i], kOp, "internal error: the gradient of input ", i, " has dims ",
                    repr(g[i].dims()), ", not its input's ", repr(info->input_dims[i]));
      out.push_back(as_aten(g[i].raw()));
    }
    out.emplace_back();  // the info
    return out;
  }
};

}  // namespace

std::vector<Tensor> TorchBackend::apply_custom_function(const std::vector<Tensor>& inputs,
                                                        std::shared_ptr<const CustomFunction> fn) {
  auto info = c10::make_intrusive<CustomInfo>();
  info->be = this;
  info->fn = std::move(fn);
  std::vector<at::Tensor> raws;
  for (const Tensor& t : inputs) {
    raws.push_back(as_aten(t.raw()));
    info->input_dims.push_back(t.dims());
  }
  const c10::intrusive_ptr<CustomInfo> keep = info;
  const torch::autograd::variable_list outs = CustomNode::apply(at::TensorList(raws), std::move(info));
  std::vector<Tensor> result;
  for (size_t i = 0; i < outs.size(); ++i) result.push_back(rewrap(this, keep->output_dims[i], outs[i]));
  return result;
}

std::unique_ptr<ProcessGroup> TorchBackend::process_group(const std::string& name,
                                                          std::optional<double> timeout_seconds) {
  if (timeout_seconds)
    DIMATTN_CHECK(*timeout_seconds > 0, kOp, "timeout must be > 0 seconds, got ", *timeout_seconds,
                  "; leave it unset for the group's own");
  c10::intrusive_ptr<c10d::ProcessGroup> pg;
  try {
    pg = c10d::resolve_process_group(name);
  } catch (const std::exception& e) {
    detail::fail(kOp, "no process group named '", name, "' in c10d's registry (", e.what(),
                 "); create it with torch.distributed (init_process_group, new_group) and pass its group_name");
  }
  return std::make_unique<C10dGroup>(std::move(pg), name, timeout_seconds);
}

}  // namespace dimattn::torch_backend
