// The LibTorch backend: every primitive maps onto ATen ops, plus the public
// interop (dimattn/torch_interop.h). The only TU of the backend's primitives:
// LibTorch headers are slow to compile, so they are parsed once.
#include "torch_backend.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>
#include <ATen/detail/CUDAHooksInterface.h>
// The operator declarations only: ATen/ops/<op>.h would pull in Context.h,
// DeviceGuard.h, TensorUtils.h, ... (about 5 s of parsing for this TU). cat
// through its alias concat, whose TensorList argument needs no IListRef.h
// (another 4 s).
#include <ATen/ops/arange_ops.h>
#include <ATen/ops/concat_ops.h>
#include <ATen/ops/empty_ops.h>
#include <ATen/ops/full_ops.h>

#include <algorithm>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <memory>
#include <new>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "dimattn/error.h"
#include "dimattn/registry.h"
#include "dimattn/torch_interop.h"
#include "dimattn/internal/check.h"
#include "torch_raw.h"

namespace dimattn::torch_backend {
namespace {

// --- messages ---

std::string sizes_str(at::IntArrayRef sizes) {
  std::ostringstream os;
  os << '[';
  for (size_t i = 0; i < sizes.size(); ++i) os << (i ? ", " : "") << sizes[i];
  os << ']';
  return os.str();
}

std::string dtype_str(at::ScalarType s) {
  return has_dimattn_dtype(s) ? dtype_name(dimattn_dtype(s)) : c10::toString(s);
}

// "float32[2, 3] on cpu"
std::string desc(const at::Tensor& t) {
  if (!t.defined()) return "undefined";
  return dtype_str(t.scalar_type()) + sizes_str(t.sizes()) + " on " + t.device().str();
}

// Describes raw operands for an error message; tolerates foreign raws.
template <class It>
std::string desc_raws(It begin, It end) {
  std::string s;
  for (It it = begin; it != end; ++it) {
    const auto* raw = dynamic_cast<const TorchRaw*>(it->get());
    s += (s.empty() ? "" : ", ") + (raw ? desc(raw->t) : std::string(*it ? "foreign raw" : "null"));
  }
  return s;
}

template <class It>
[[noreturn]] void fail_from_aten(const char* op, std::string msg, It begin, It end) {
  while (!msg.empty() && (msg.back() == '\n' || msg.back() == ' ')) msg.pop_back();
  if (begin == end) detail::fail(op, "LibTorch error: ", msg);
  detail::fail(op, "LibTorch error: ", msg, " (operands: ", desc_raws(begin, end), ")");
}

// Runs a primitive's body; an ATen error leaves as dimattn::Error "[op] ..."
// naming the operands, so users never see a raw c10::Error. ATen also throws
// plain std::runtime_error (c10's overflow checks in Scalar conversions).
template <class It, class F>
decltype(auto) guarded_impl(const char* op, It begin, It end, F&& body) {
  try {
    return body();
  } catch (const Error&) {
    throw;
  } catch (const c10::Error& e) {
    fail_from_aten(op, e.what_without_backtrace(), begin, end);
  } catch (const std::bad_alloc&) {
    throw;
  } catch (const std::exception& e) {
    fail_from_aten(op, e.what(), begin, end);
  }
}

template <class F>
decltype(auto) guarded(const char* op, F&& body) {
  const RawPtr* none = nullptr;
  return guarded_impl(op, none, none, std::forward<F>(body));
}

template <class F>
decltype(auto) guarded(const char* op, std::initializer_list<RawPtr> operands, F&& body) {
  return guarded_impl(op, operands.begin(), operands.end(), std::forward<F>(body));
}

template <class F>
decltype(auto) guarded(const char* op, const std::vector<RawPtr>& operands, F&& body) {
  return guarded_impl(op, operands.begin(), operands.end(), std::forward<F>(body));
}

// --- factories (what at::full, at::empty, ... do inline, on the _ops headers) ---

at::Tensor make_full(at::IntArrayRef size, const at::Scalar& value, at::ScalarType dtype, c10::Device device) {
  return at::_ops::full::call(c10::fromIntArrayRefSlow(size), value, dtype, at::kStrided, device, std::nullopt);
}

at::Tensor make_empty_cpu_double(at::IntArrayRef size) {
  return at::_ops::empty_memory_format::call(c10::fromIntArrayRefSlow(size), at::kDouble, at::kStrided,
                                             c10::Device(c10::DeviceType::CPU), std::nullopt, std::nullopt);
}

at::Tensor make_arange(int64_t n, at::ScalarType dtype, c10::Device device) {
  return at::_ops::arange::call(at::Scalar(n), dtype, at::kStrided, device, std::nullopt);
}

// --- argument checks ---

// What at::hasCUDA() and at::getNumGPUs() return, without ATen/Context.h.
bool has_cuda() { return at::detail::getCUDAHooks().hasCUDA(); }
int64_t cuda_device_count() { return has_cuda() ? at::detail::getCUDAHooks().deviceCount() : 0; }

bool device_available(Device d) {
  if (d.type == DeviceType::cpu) return true;
  return d.index >= 0 && d.index < cuda_device_count();
}

void check_device(const char* op, Device d) {
  if (device_available(d)) return;
  if (!has_cuda())
    detail::fail(op, "device ", device_name(d), " is not available: LibTorch sees no CUDA device; use cpu");
  detail::fail(op, "device ", device_name(d), " is not available: LibTorch sees ", cuda_device_count(),
               " CUDA device(s)");
}

void check_shape(const char* op, const Shape& shape) {
  for (int64_t s : shape)
    if (s < 0) detail::fail(op, "sizes must be >= 0, got ", sizes_str(shape));
}

int64_t numel_of(const char* op, const Shape& shape) {
  check_shape(op, shape);
  int64_t n = 1;
  for (int64_t s : shape) {
    if (s != 0 && n > std::numeric_limits<int64_t>::max() / s)
      detail::fail(op, "shape ", sizes_str(shape), " has too many elements");
    n *= s;
  }
  return n;
}

void check_axis(const char* op, int axis, const at::Tensor& x) {
  if (axis < 0 || axis >= x.dim()) detail::fail(op, "axis ", axis, " is out of range for ", desc(x));
}

// `what` (e.g. the binary op's name) prefixes the message when given.
void check_same_dtype(const char* op, const at::Tensor& a, const at::Tensor& b, const char* what = nullptr) {
  if (a.scalar_type() == b.scalar_type()) return;
  detail::fail(op, what ? what : "", what ? ": " : "", "operand dtypes differ: ", desc(a), " vs ", desc(b),
               "; cast one operand first");
}

void check_same_device(const char* op, const at::Tensor& a, const at::Tensor& b) {
  if (a.device() != b.device())
    detail::fail(op, "operands are on different devices: ", desc(a), " vs ", desc(b),
                 "; move one with to_device first");
}

void check_floating(const char* op, const at::Tensor& x, const char* what) {
  if (!at::isFloatingType(x.scalar_type()))
    detail::fail(op, what, " needs a floating dtype, got ", desc(x), "; cast first");
}

std::string desc_all(std::initializer_list<const at::Tensor*> ts) {
  std::string s;
  for (const at::Tensor* t : ts) s += (s.empty() ? "" : ", ") + desc(*t);
  return s;
}

// numpy broadcasting over equal ranks: per axis, the sizes other than 1 agree.
void check_broadcastable(const char* op, std::initializer_list<const at::Tensor*> ts) {
  const at::Tensor& first = **ts.begin();
  for (const at::Tensor* t : ts)
    if (t->dim() != first.dim()) detail::fail(op, "operands must have equal rank, got ", desc_all(ts));
  for (int64_t i = 0; i < first.dim(); ++i) {
    int64_t size = 1;
    for (const at::Tensor* t : ts) {
      int64_t s = t->size(i);
      if (s == 1) continue;
      if (size != 1 && size != s) detail::fail(op, "sizes do not broadcast on axis ", i, ": ", desc_all(ts));
      size = s;
    }
  }
}

std::vector<int64_t> to_i64(const std::vector<int>& v) { return {v.begin(), v.end()}; }

// The identity of max (lowest) or min (highest) for x's dtype: the value of a
// reduction over an empty axis.
at::Scalar reduce_identity(ReduceOp op, at::ScalarType s) {
  const bool is_max = op == ReduceOp::max;
  switch (s) {
    case at::kBool: return at::Scalar(!is_max);
    case at::kInt:
      return at::Scalar(static_cast<int64_t>(is_max ? std::numeric_limits<int32_t>::lowest()
                                                    : std::numeric_limits<int32_t>::max()));
    case at::kLong:
      return at::Scalar(is_max ? std::numeric_limits<int64_t>::lowest() : std::numeric_limits<int64_t>::max());
    default:
      return at::Scalar(is_max ? -std::numeric_limits<double>::infinity() : std::numeric_limits<double>::infinity());
  }
}

}  // namespace

bool TorchBackend::supports(Device device) const {
  try {
    return device_available(device);
  } catch (const c10::Error&) {
    return false;
  }
}

// --- creation and host transfer ---

RawPtr TorchBackend::full(const Shape& shape, double value, DType dtype, Device device) {
  const char* op = "torch.full";
  return guarded(op, [&] {
    check_shape(op, shape);
    check_device(op, device);
    return wrap(make_full(shape, value, aten_dtype(dtype), aten_device(device)));
  });
}

namespace {

// float64 -> 16-bit floats, rounded once. ATen converts through float32,
// which can round twice (onto a float32 tie, then to even). Rounding to
// float32 by round-to-odd keeps the information the second rounding needs.
at::Tensor to_dtype_rounded_once(const at::Tensor& x, at::ScalarType dst) {
  if (x.scalar_type() != at::kDouble || (dst != at::kBFloat16 && dst != at::kHalf)) return x.to(dst);
  at::Tensor f = x.to(at::kFloat);
  at::Tensor back = f.to(at::kDouble);
  at::Tensor inexact = back.ne(x).to(at::kInt);
  at::Tensor rounded_away = back.abs().gt(x.abs()).to(at::kInt);
  // One float32 ulp toward zero where nearest rounded away: the truncation;
  // then the lowest bit set where inexact: round-to-odd.
  at::Tensor odd = f.view(at::kInt).sub(rounded_away).bitwise_or(inexact);
  return odd.view(at::kFloat).to(dst);
}

}  // namespace

RawPtr TorchBackend::from_host(const Shape& shape, const std::vector<double>& data, DType dtype, Device device) {
  const char* op = "torch.from_host";
  return guarded(op, [&] {
    const int64_t n = numel_of(op, shape);
    if (static_cast<int64_t>(data.size()) != n)
      detail::fail(op, "shape ", sizes_str(shape), " has ", n, " elements but ", data.size(), " values were given");
    check_device(op, device);
    at::Tensor host = make_empty_cpu_double(shape);
    if (n > 0) std::memcpy(host.mutable_data_ptr<double>(), data.data(), sizeof(double) * n);
    return wrap(to_dtype_rounded_once(host, aten_dtype(dtype)).to(aten_device(device)));
  });
}

std::vector<double> TorchBackend::to_host(const RawPtr& rx) {
  const char* op = "torch.to_host";
  return guarded(op, {rx}, [&] {
    const at::Tensor& x = as_aten(rx, op);
    // contiguous() after the copy: any view (permuted, expanded, sliced)
    // comes back in logical row-major order.
    at::Tensor host = x.detach().to(at::kCPU, at::kDouble).contiguous();
    const double* p = host.const_data_ptr<double>();
    return std::vector<double>(p, p + host.numel());
  });
}

RawPtr TorchBackend::random(const Shape& shape, RandomKind kind, double a, double b, uint64_t seed, DType dtype,
                            Device device) {
  const char* op = "torch.random";
  return guarded(op, [&] {
    check_shape(op, shape);
    check_device(op, device);
    DIMATTN_CHECK(is_floating(dtype), op, "random values need a floating dtype, got ", dtype_name(dtype),
          "; draw floats and cast");
    if (kind == RandomKind::normal)
      DIMATTN_CHECK(b >= 0, op, "normal: the standard deviation must be >= 0, got ", b);
    else
      DIMATTN_CHECK(a <= b, op, "uniform: needs low <= high, got [", a, ", ", b, ")");
    // One CPU generator in float64 whatever the target: the same seed gives
    // the same values for every dtype (up to rounding) and device.
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
    at::Tensor t = make_empty_cpu_double(shape);
    if (kind == RandomKind::normal)
      t.normal_(a, b, gen);
    else
      t.uniform_(a, b, gen);
    if (dtype != DType::float64) {
      t = t.to(aten_dtype(dtype));
      // Rounding to a narrower dtype can reach `high`; keep the range [a, b).
      if (kind == RandomKind::uniform && a < b) {
        const c10::Device cpu(c10::DeviceType::CPU);
        at::Tensor hi = make_full({}, b, t.scalar_type(), cpu);
        double below = hi.nextafter(make_full({}, a, t.scalar_type(), cpu)).item<double>();
        t.clamp_max_(below);
      }
    }
    return wrap(t.to(aten_device(device)));
  });
}

RawPtr TorchBackend::arange(int64_t n, DType dtype, Device device) {
  const char* op = "torch.arange";
  return guarded(op, [&] {
    DIMATTN_CHECK(n >= 0, op, "n must be >= 0, got ", n);
    DIMATTN_CHECK(dtype != DType::boolean, op, "arange has no bool form; use int64 and compare");
    check_device(op, device);
    return wrap(make_arange(n, aten_dtype(dtype), aten_device(device)));
  });
}

// --- introspection ---

Shape TorchBackend::shape(const RawPtr& rx) {
  return as_aten(rx, "torch.shape").sizes().vec();
}

// --- layout ---

RawPtr TorchBackend::cast(const RawPtr& rx, DType dtype) {
  const char* op = "torch.cast";
  return guarded(op, {rx}, [&] { return wrap(to_dtype_rounded_once(as_aten(rx, op), aten_dtype(dtype))); });
}

RawPtr TorchBackend::to_device(const RawPtr& rx, Device device) {
  const char* op = "torch.to_device";
  return guarded(op, {rx}, [&] {
    const at::Tensor& x = as_aten(rx, op);
    check_device(op, device);
    return wrap(x.to(aten_device(device)));
  });
}

RawPtr TorchBackend::permute(const RawPtr& rx, const std::vector<int>& perm) {
  const char* op = "torch.permute";
  return guarded(op, {rx}, [&] {
    const at::Tensor& x = as_aten(rx, op);
    std::vector<int> sorted = perm;
    std::sort(sorted.begin(), sorted.end());
    bool is_perm = static_cast<int64_t>(perm.size()) == x.dim();
    for (size_t i = 0; is_perm && i < sorted.size(); ++i) is_perm = sorted[i] == static_cast<int>(i);
    if (!is_perm) detail::fail(op, "perm ", sizes_str(to_i64(perm)), " is not a permutation of the axes of ", desc(x));
    return wrap(x.permute(to_i64(perm)));
  });
}

RawPtr TorchBackend::contiguous(const RawPtr& rx) {
  const at::Tensor& x = as_aten(rx, "torch.contiguous");
  return x.is_contiguous() ? rx : wrap(x.contiguous());
}

std::optional<HostView> TorchBackend::host_view(const RawPtr& rx) {
  const at::Tensor& x = as_aten(rx, "torch.host_view");
  if (!x.device().is_cpu() || !has_dimattn_dtype(x.scalar_type())) return std::nullopt;
  // Kernels write outputs through this view; autograd sees them as the
  // results of the op that made them.
  return HostView{x.data_ptr(), x.sizes().vec(), x.strides().vec(), dimattn_dtype(x.scalar_type())};
}

RawPtr TorchBackend::reshape(const RawPtr& rx, const Shape& shape) {
  const char* op = "torch.reshape";
  return guarded(op, {rx}, [&] {
    const at::Tensor& x = as_aten(rx, op);
    if (numel_of(op, shape) != x.numel())
      detail::fail(op, "cannot reshape ", desc(x), " (", x.numel(), " elements) to ", sizes_str(shape));
    return wrap(x.reshape(shape));
  });
}

RawPtr TorchBackend::expand(const RawPtr& rx, const Shape& shape) {
  const char* op = "torch.expand";
  return guarded(op, {rx}, [&] {
    const at::Tensor& x = as_aten(rx, op);
    check_shape(op, shape);
    bool ok = static_cast<int64_t>(shape.size()) == x.dim();
    for (size_t i = 0; ok && i < shape.size(); ++i) ok = x.size(i) == shape[i] || x.size(i) == 1;
    if (!ok)
      detail::fail(op, "cannot expand ", desc(x), " to ", sizes_str(shape),
                   ": ranks must be equal and only size-1 axes can grow");
    return wrap(x.expand(shape));
  });
}

RawPtr TorchBackend::concat(const std::vector<RawPtr>& xs, int axis) {
  const char* op = "torch.concat";
  return guarded(op, xs, [&] {
    DIMATTN_CHECK(!xs.empty(), op, "needs at least one tensor");
    std::vector<at::Tensor> ts;
    ts.reserve(xs.size());
    for (const auto& r : xs) ts.push_back(as_aten(r, op));
    const at::Tensor& first = ts.front();
    check_axis(op, axis, first);
    for (const auto& t : ts) {
      bool ok = t.dim() == first.dim();
      for (int64_t i = 0; ok && i < t.dim(); ++i) ok = i == axis || t.size(i) == first.size(i);
      if (!ok)
        detail::fail(op, "along axis ", axis, " the tensors must agree on every other axis: ", desc(first), " vs ",
                     desc(t));
      check_same_dtype(op, first, t);
      check_same_device(op, first, t);
    }
    return wrap(at::_ops::concat::call(ts, axis));
  });
}

RawPtr TorchBackend::slice(const RawPtr& rx, int axis, int64_t start, int64_t end) {
  const char* op = "torch.slice";
  return guarded(op, {rx}, [&] {
    const at::Tensor& x = as_aten(rx, op);
    check_axis(op, axis, x);
    if (start < 0 || start > end || end > x.size(axis))
      detail::fail(op, "range [", start, ", ", end, ") is not within axis ", axis, " of ", desc(x));
    return wrap(x.slice(axis, start, end));
  });
}

RawPtr TorchBackend::gather(const RawPtr& rx, int axis, const RawPtr& ridx) {
  const char* op = "torch.gather";
  return guarded(op, {rx, ridx}, [&] {
    const at::Tensor& x = as_aten(rx, op);
    const at::Tensor& idx = as_aten(ridx, op);
    check_axis(op, axis, x);
    if (idx.scalar_type() != at::kLong && idx.scalar_type() != at::kInt)
      detail::fail(op, "indices must be int32 or int64, got ", desc(idx));
    bool ok = idx.dim() == x.dim();
    for (int64_t i = 0; ok && i < x.dim(); ++i) ok = i == axis || idx.size(i) == x.size(i);
    if (!ok)
      detail::fail(op, "indices ", desc(idx), " must have the rank and sizes of ", desc(x), " except on axis ", axis);
    check_same_device(op, x, idx);
    return wrap(x.gather(axis, idx.to(at::kLong)));
  });
}

// --- math ---

RawPtr TorchBackend::binary(BinaryOp bop, const RawPtr& ra, const RawPtr& rb) {
  const char* op = "torch.binary";
  return guarded(op, {ra, rb}, [&] {
    const at::Tensor& a = as_aten(ra, op);
    const at::Tensor& b = as_aten(rb, op);
    check_broadcastable(op, {&a, &b});
    check_same_dtype(op, a, b, op_name(bop));
    check_same_device(op, a, b);
    switch (bop) {
      case BinaryOp::add: return wrap(a.add(b));
      case BinaryOp::sub: return wrap(a.sub(b));
      case BinaryOp::mul: return wrap(a.mul(b));
      // Integer division truncates (C++ semantics) and keeps the dtype.
      case BinaryOp::div:
        return wrap(at::isIntegralType(a.scalar_type(), /*includeBool=*/true) ? a.div(b, "trunc") : a.div(b));
      case BinaryOp::maximum: return wrap(a.maximum(b));
      case BinaryOp::minimum: return wrap(a.minimum(b));
      case BinaryOp::eq: return wrap(a.eq(b));
      case BinaryOp::ne: return wrap(a.ne(b));
      case BinaryOp::lt: return wrap(a.lt(b));
      case BinaryOp::le: return wrap(a.le(b));
      case BinaryOp::gt: return wrap(a.gt(b));
      case BinaryOp::ge: return wrap(a.ge(b));
      case BinaryOp::logical_and: return wrap(a.logical_and(b));
      case BinaryOp::logical_or: return wrap(a.logical_or(b));
    }
    detail::fail(op, "unknown binary op ", static_cast<int>(bop));
  });
}

RawPtr TorchBackend::unary(UnaryOp uop, const RawPtr& rx) {
  const char* op = "torch.unary";
  return guarded(op, {rx}, [&] {
    const at::Tensor& x = as_aten(rx, op);
    switch (uop) {
      case UnaryOp::neg:
        DIMATTN_CHECK(x.scalar_type() != at::kBool, op, "neg of a bool tensor; use logical_not");
        return wrap(x.neg());
      case UnaryOp::exp: check_floating(op, x, "exp"); return wrap(x.exp());
      case UnaryOp::log: check_floating(op, x, "log"); return wrap(x.log());
      case UnaryOp::sqrt: check_floating(op, x, "sqrt"); return wrap(x.sqrt());
      case UnaryOp::tanh: check_floating(op, x, "tanh"); return wrap(x.tanh());
      case UnaryOp::abs: return wrap(x.scalar_type() == at::kBool ? x : x.abs());
      case UnaryOp::logical_not: return wrap(x.logical_not());
    }
    detail::fail(op, "unknown unary op ", static_cast<int>(uop));
  });
}

RawPtr TorchBackend::where(const RawPtr& rcond, const RawPtr& ra, const RawPtr& rb) {
  const char* op = "torch.where";
  return guarded(op, {rcond, ra, rb}, [&] {
    const at::Tensor& cond = as_aten(rcond, op);
    const at::Tensor& a = as_aten(ra, op);
    const at::Tensor& b = as_aten(rb, op);
    if (cond.scalar_type() != at::kBool) detail::fail(op, "the condition must be bool, got ", desc(cond));
    check_broadcastable(op, {&cond, &a, &b});
    check_same_dtype(op, a, b);
    check_same_device(op, a, b);
    check_same_device(op, cond, a);
    return wrap(a.where(cond, b));
  });
}

RawPtr TorchBackend::reduce(ReduceOp rop, const RawPtr& rx, const std::vector<int>& axes) {
  const char* op = "torch.reduce";
  return guarded(op, {rx}, [&] {
    const at::Tensor& x = as_aten(rx, op);
    for (size_t i = 0; i < axes.size(); ++i) {
      check_axis(op, axes[i], x);
      if (i > 0 && axes[i - 1] >= axes[i])
        detail::fail(op, op_name(rop), ": axes ", sizes_str(to_i64(axes)), " must be sorted and unique");
    }
    // ATen reads an empty axis list as "all axes"; ours removes nothing.
    if (axes.empty()) return wrap(x);
    const std::vector<int64_t> dims = to_i64(axes);
    const bool integral = at::isIntegralType(x.scalar_type(), /*includeBool=*/true);
    switch (rop) {
      case ReduceOp::sum:
        // Keeps the dtype (ATen would widen integers to int64); bool sums to "any".
        return wrap(x.sum(dims, false, integral ? std::optional<at::ScalarType>(x.scalar_type()) : std::nullopt));
      case ReduceOp::max:
      case ReduceOp::min: {
        if (x.numel() == 0) {  // ATen's amax/amin reject empty axes
          std::vector<int64_t> out;
          for (int64_t i = 0; i < x.dim(); ++i)
            if (!std::binary_search(dims.begin(), dims.end(), i)) out.push_back(x.size(i));
          return wrap(make_full(out, reduce_identity(rop, x.scalar_type()), x.scalar_type(), x.device()));
        }
        return wrap(rop == ReduceOp::max ? x.amax(dims) : x.amin(dims));
      }
      case ReduceOp::mean: check_floating(op, x, "mean"); return wrap(x.mean(dims));
      case ReduceOp::logsumexp: check_floating(op, x, "logsumexp"); return wrap(x.logsumexp(dims));
    }
    detail::fail(op, "unknown reduce op ", static_cast<int>(rop));
  });
}

RawPtr TorchBackend::softmax(const RawPtr& rx, int axis, bool log) {
  const char* op = log ? "torch.log_softmax" : "torch.softmax";
  return guarded(op, {rx}, [&] {
    const at::Tensor& x = as_aten(rx, op);
    check_axis(op, axis, x);
    check_floating(op, x, log ? "log_softmax" : "softmax");
    return wrap(log ? x.log_softmax(axis) : x.softmax(axis));
  });
}

RawPtr TorchBackend::bmm(const RawPtr& ra, const RawPtr& rb) {
  const char* op = "torch.bmm";
  return guarded(op, {ra, rb}, [&] {
    const at::Tensor& a = as_aten(ra, op);
    const at::Tensor& b = as_aten(rb, op);
    if (a.dim() != 3 || b.dim() != 3 || a.size(0) != b.size(0) || a.size(2) != b.size(1))
      detail::fail(op, "needs a [B, M, K] and b [B, K, N], got ", desc(a), " and ", desc(b));
    check_same_dtype(op, a, b);
    check_same_device(op, a, b);
    return wrap(a.bmm(b));
  });
}

// --- autograd ---

void TorchBackend::set_requires_grad(const RawPtr& rx, bool on) {
  const char* op = "torch.set_requires_grad";
  guarded(op, {rx}, [&] {
    const at::Tensor& x = as_aten(rx, op);
    if (on) check_floating(op, x, "requires_grad");
    if (!x.is_leaf())
      detail::fail(op, "only leaf tensors (not results of differentiable ops) can change requires_grad; got ",
                   desc(x));
    x.set_requires_grad(on);
  });
}

bool TorchBackend::requires_grad(const RawPtr& rx) {
  return as_aten(rx, "torch.requires_grad").requires_grad();
}

RawPtr TorchBackend::grad(const RawPtr& rx) {
  const char* op = "torch.grad";
  return guarded(op, {rx}, [&]() -> RawPtr {
    const at::Tensor& x = as_aten(rx, op);
    // Non-leaf tensors keep no grad (and ATen warns on asking): none.
    if (!x.is_leaf() && !x.retains_grad()) return nullptr;
    const at::Tensor& g = x.grad();
    if (!g.defined()) return nullptr;
    return wrap(g);
  });
}

void TorchBackend::backward(const RawPtr& rscalar) {
  const char* op = "torch.backward";
  guarded(op, {rscalar}, [&] {
    const at::Tensor& s = as_aten(rscalar, op);
    if (s.dim() != 0) detail::fail(op, "needs a rank-0 (scalar) tensor, got ", desc(s), "; reduce it first");
    if (!s.requires_grad())
      detail::fail(op, "the tensor ", desc(s), " does not depend on any tensor that requires grad");
    s.backward();
  });
}

}  // namespace dimattn::torch_backend

// --- registration ---

namespace dimattn::torch_backend {
namespace {
const BuiltinBackend kRegistered(0, [] { return std::unique_ptr<Backend>(new TorchBackend); });
}  // namespace
}  // namespace dimattn::torch_backend

// --- public interop (dimattn/torch_interop.h) ---

namespace dimattn {

Tensor from_aten(const at::Tensor& t, const Dims& dims) {
  using namespace torch_backend;
  const char* op = "from_aten";
  DIMATTN_CHECK(t.defined(), op, "the ATen tensor is undefined");
  if (t.dim() != static_cast<int64_t>(dims.size()))
    detail::fail(op, "the ATen tensor has rank ", t.dim(), " (sizes ", sizes_str(t.sizes()), ") but ", dims.size(),
                 " dims were given: ", repr(dims));
  for (size_t i = 0; i < dims.size(); ++i) {
    const int64_t size = t.size(static_cast<int64_t>(i));
    if (size != dims[i].extent())
      detail::fail(op, "axis ", i, " has size ", size, " but dim ", dims[i].repr(), " has extent ", dims[i].extent(),
                   "; sizes ", sizes_str(t.sizes()), " vs dims ", repr(dims));
    for (size_t j = 0; j < i; ++j)
      if (dims[j] == dims[i])
        detail::fail(op, "dim ", dims[i].repr(), " appears twice in ", repr(dims), "; give each axis its own Dim");
  }
  DType dtype = dimattn_dtype(t.scalar_type(), op);
  Device device = dimattn_device(t.device(), op);
  // Backends are never unregistered: one lookup serves every call (the op
  // makes three of these per call).
  static Backend* const torch = &get_backend("torch");
  return Tensor(dims, dtype, device, wrap(t), torch);
}

const at::Tensor& to_aten(const Tensor& x) {
  if (dynamic_cast<const torch_backend::TorchBackend*>(&x.backend()) == nullptr)
    detail::fail("to_aten", "tensor ", x.repr(), " is on backend '", x.backend().name(),
                 "', not 'torch'; convert it first with to_backend(x, \"torch\")");
  return torch_backend::as_aten(x.raw(), "to_aten");
}

}  // namespace dimattn
