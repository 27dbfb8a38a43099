// Construction, transfer and layout ops, and the operand helpers of op_util.h.
#include <cmath>

#include "dimattn/registry.h"
#include "dimattn/internal/check.h"
#include "op_util.h"

namespace dimattn {
namespace detail {

TensorOptions options_like(const Tensor& x, DType dtype) { return {dtype, x.device(), x.backend().name()}; }
TensorOptions options_like(const Tensor& x) { return options_like(x, x.dtype()); }

void check_has(const char* op, const Tensor& x, const Dim& d, const char* role) {
  DIMATTN_CHECK(x.has(d), op, role, " ", d.repr(), " is not a dim of ", repr(x.dims()));
}

Dims union_dims(const Dims& a, const Dims& b) {
  Dims out = a;
  for (const Dim& d : b)
    if (!contains(out, d)) out.push_back(d);
  return out;
}

Dims without(const Dims& dims, const Dims& remove) {
  Dims out;
  for (const Dim& d : dims)
    if (!contains(remove, d)) out.push_back(d);
  return out;
}

Tensor scalar_like(const Tensor& x, double value) { return full({}, value, options_like(x)); }

Tensor window_lengths(const Tensor& lengths, int64_t start, int64_t size) {
  const Tensor from = add(cast(lengths, DType::int64), -static_cast<double>(start));
  return minimum(maximum(from, scalar_like(from, 0)), scalar_like(from, static_cast<double>(size)));
}

}  // namespace detail

using namespace detail;

namespace {

Backend& backend_for(const TensorOptions& opts, const char* op) {
  // Checked here so that the message names the op, not get_backend.
  if (!opts.backend.empty() && !has_backend(opts.backend)) {
    std::string names;
    for (const std::string& n : backend_names()) names += (names.empty() ? "" : ", ") + n;
    detail::fail(op, "no backend named '", opts.backend, "'; registered: ", names.empty() ? "none" : names);
  }
  Backend& b = opts.backend.empty() ? default_backend() : get_backend(opts.backend);
  DIMATTN_CHECK(b.supports(opts.device), op, "backend '", b.name(), "' does not support device ", device_name(opts.device));
  return b;
}

}  // namespace

namespace {
// full, named as the op the user called (zeros, scalar) in its errors.
Tensor full_as(const char* op, const Dims& dims, double value, const TensorOptions& opts) {
  check_unique(op, dims);
  Backend& b = backend_for(opts, op);
  return Tensor(dims, opts.dtype, opts.device, b.full(extents(dims), value, opts.dtype, opts.device), &b);
}
}  // namespace

Tensor full(const Dims& dims, double value, const TensorOptions& opts) { return full_as("full", dims, value, opts); }
Tensor zeros(const Dims& dims, const TensorOptions& opts) { return full_as("zeros", dims, 0.0, opts); }
Tensor scalar(double value, const TensorOptions& opts) { return full_as("scalar", {}, value, opts); }

Tensor random_normal(const Dims& dims, uint64_t seed, const TensorOptions& opts, double mean, double stddev) {
  check_unique("random_normal", dims);
  DIMATTN_CHECK(is_floating(opts.dtype), "random_normal", "needs a floating dtype, got ", dtype_name(opts.dtype));
  DIMATTN_CHECK(std::isfinite(mean) && std::isfinite(stddev) && stddev >= 0, "random_normal",
        "needs finite mean and stddev >= 0, got mean ", mean, " stddev ", stddev);
  Backend& b = backend_for(opts, "random_normal");
  return Tensor(dims, opts.dtype, opts.device,
                b.random(extents(dims), RandomKind::normal, mean, stddev, seed, opts.dtype, opts.device), &b);
}

Tensor random_uniform(const Dims& dims, uint64_t seed, const TensorOptions& opts, double low, double high) {
  check_unique("random_uniform", dims);
  DIMATTN_CHECK(is_floating(opts.dtype), "random_uniform", "needs a floating dtype, got ", dtype_name(opts.dtype));
  DIMATTN_CHECK(std::isfinite(low) && std::isfinite(high) && low <= high, "random_uniform",
        "needs finite low <= high, got [", low, ", ", high, ")");
  Backend& b = backend_for(opts, "random_uniform");
  return Tensor(dims, opts.dtype, opts.device,
                b.random(extents(dims), RandomKind::uniform, low, high, seed, opts.dtype, opts.device), &b);
}

Tensor from_host(const Dims& dims, const std::vector<double>& data, const TensorOptions& opts) {
  check_unique("from_host", dims);
  const int64_t n = product(dims);
  DIMATTN_CHECK(static_cast<int64_t>(data.size()) == n, "from_host", "dims ", repr(dims), " hold ", n,
        " elements but ", data.size(), " values were given");
  Backend& b = backend_for(opts, "from_host");
  return Tensor(dims, opts.dtype, opts.device, b.from_host(extents(dims), data, opts.dtype, opts.device), &b);
}

std::vector<double> to_host(const Tensor& x, const std::optional<Dims>& order) {
  if (!order || *order == x.dims()) return x.backend().to_host(x.raw());
  // Checked here too so that the message names to_host, not copy_transpose.
  DIMATTN_CHECK(order->size() == x.dims().size() && without(x.dims(), *order).empty(), "to_host", "order ", repr(*order),
        " is not a permutation of ", repr(x.dims()));
  return x.backend().to_host(copy_transpose(x, *order).raw());
}

double item(const Tensor& x) {
  DIMATTN_CHECK(x.rank() == 0, "item", "needs a scalar (rank-0) tensor, got ", repr(x.dims()));
  return to_host(x)[0];
}

Tensor cast(const Tensor& x, DType dtype) {
  if (dtype == x.dtype()) return x;
  return Tensor(x.dims(), dtype, x.device(), x.backend().cast(x.raw(), dtype), &x.backend());
}

Tensor to_device(const Tensor& x, Device device) {
  if (device == x.device()) return x;
  DIMATTN_CHECK(x.backend().supports(device), "to_device", "backend '", x.backend().name(), "' does not support device ",
        device_name(device));
  return Tensor(x.dims(), x.dtype(), device, x.backend().to_device(x.raw(), device), &x.backend());
}

Tensor to_backend(const Tensor& x, const std::string& backend) {
  if (backend == x.backend().name()) return x;
  DIMATTN_CHECK(has_backend(backend), "to_backend", "no backend named '", backend, "' to move ", x.repr(), " to");
  Backend& b = get_backend(backend);
  Device device = x.device();
  if (!b.supports(device)) device = kCPU;  // e.g. eigen is CPU-only: land on its device
  return Tensor(x.dims(), x.dtype(), device, b.from_host(x.shape(), to_host(x), x.dtype(), device), &b);
}

Tensor copy_transpose(const Tensor& x, const Dims& order) {
  DIMATTN_CHECK(order.size() == x.dims().size() && without(x.dims(), order).empty(), "copy_transpose", "order ",
        repr(order), " is not a permutation of ", repr(x.dims()));
  check_unique("copy_transpose", order);
  return Tensor(order, x.dtype(), x.device(), raw_in_order("copy_transpose", x, order, false), &x.backend());
}

Tensor align(const Tensor& x, const Dims& order) {
  check_unique("align", order);  // else the Tensor constructor would report it as [Tensor]
  return Tensor(order, x.dtype(), x.device(), raw_in_order("align", x, order, true), &x.backend());
}

Tensor range_over_dim(const Dim& dim, const TensorOptions& opts) {
  // Checked here: the backends disagreed (eigen made 0, 1, 1, ..., torch refused).
  DIMATTN_CHECK(opts.dtype != DType::boolean, "range_over_dim", "needs a numeric dtype, got bool for ", dim.repr());
  Backend& b = backend_for(opts, "range_over_dim");
  return Tensor({dim}, opts.dtype, opts.device, b.arange(dim.extent(), opts.dtype, opts.device), &b);
}

Tensor sequence_mask(const Dim& dim, const TensorOptions& opts) {
  backend_for(opts, "sequence_mask");  // so that a bad backend or device is reported as [sequence_mask]
  TensorOptions bool_opts = opts;
  bool_opts.dtype = DType::boolean;
  if (!dim.is_dynamic()) return full({dim}, 1.0, bool_opts);
  TensorOptions int_opts = opts;
  int_opts.dtype = DType::int64;
  Tensor lengths = cast(dim.lengths(), DType::int64);
  Backend& b = opts.backend.empty() ? default_backend() : get_backend(opts.backend);
  lengths = to_device(to_backend(lengths, b.name()), opts.device);
  return compare(range_over_dim(dim, int_opts), Compare::lt, lengths);
}

Tensor sequence_mask(const Dims& dims, const TensorOptions& opts) {
  std::optional<Tensor> mask;
  for (const Dim& d : dims) {
    if (!d.is_dynamic()) continue;
    Tensor m = sequence_mask(d, opts);
    mask = mask ? logical_and(*mask, m) : m;
  }
  if (!mask) {
    TensorOptions bool_opts = opts;
    bool_opts.dtype = DType::boolean;
    return full({}, 1.0, bool_opts);
  }
  return *mask;
}

}  // namespace dimattn
