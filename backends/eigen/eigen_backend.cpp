// The Eigen backend: every Backend primitive on the CPU, over the strided raw
// tensor of eigen_raw.h. Contractions go through Eigen's GEMM; elementwise
// math runs Eigen array expressions over contiguous runs and a plain strided
// loop elsewhere. bfloat16 and float16 are stored as themselves and computed
// in float32, rounded (to nearest even) on store.
#include <Eigen/Core>
#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <limits>
#include <optional>
#include <ostream>
#include <random>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "backends/eigen/eigen_raw.h"
#include "backends/src/cpu_flash_path.h"
#include "backends/src/builtin_backends.h"
#include "dimattn/backend.h"
#include "dimattn/error.h"
#include "dimattn/registry.h"

namespace dimattn::eigen {

std::vector<int64_t> contiguous_strides(const Shape& shape) {
  std::vector<int64_t> strides(shape.size());
  int64_t s = 1;
  for (int d = static_cast<int>(shape.size()) - 1; d >= 0; --d) {
    strides[d] = s;
    s *= std::max<int64_t>(shape[d], 1);
  }
  return strides;
}

namespace {

// Prints "[2, 3]" when streamed; cheap to pass to check(), which only
// formats its message on failure.
struct ShapeFmt {
  const Shape& shape;
};
std::ostream& operator<<(std::ostream& os, ShapeFmt f) {
  os << '[';
  for (size_t i = 0; i < f.shape.size(); ++i) os << (i ? ", " : "") << f.shape[i];
  return os << ']';
}
ShapeFmt shape_str(const Shape& shape) { return {shape}; }
std::string shape_string(const Shape& shape) {
  std::ostringstream os;
  os << shape_str(shape);
  return os.str();
}

}  // namespace

std::shared_ptr<EigenRaw> empty_raw(DType dtype, const Shape& shape) {
  int64_t n = 1;
  for (int64_t s : shape) {
    check(s >= 0, "eigen", "negative size in shape ", shape_str(shape));
    n *= s;
  }
  auto r = std::make_shared<EigenRaw>();
  r->dtype = dtype;
  r->shape = shape;
  r->strides = contiguous_strides(shape);
  r->storage = std::make_shared<Storage>(static_cast<std::size_t>(n) * dtype_size(dtype));
  return r;
}

const EigenRaw& as_eigen(const RawPtr& x) {
  check(x != nullptr, "eigen", "got a null tensor");
  const auto* r = dynamic_cast<const EigenRaw*>(x.get());
  check(r != nullptr, "eigen",
        "got a tensor made by another backend; move it with that backend's to_host and eigen's from_host");
  return *r;
}

namespace {

// ---------------------------------------------------------------------------
// Element types

template <class T>
struct Tag {
  using type = T;
};

// The one dtype switch: calls f(Tag<T>{}) with T the storage type of d.
template <class F>
decltype(auto) visit_dtype(DType d, F&& f) {
  switch (d) {
    case DType::float32: return f(Tag<float>{});
    case DType::float64: return f(Tag<double>{});
    case DType::bfloat16: return f(Tag<Eigen::bfloat16>{});
    case DType::float16: return f(Tag<Eigen::half>{});
    case DType::int32: return f(Tag<int32_t>{});
    case DType::int64: return f(Tag<int64_t>{});
    case DType::boolean: return f(Tag<bool>{});
  }
  detail::fail("eigen", "unknown dtype value ", static_cast<int>(d));
}

template <class T>
inline constexpr bool is_reduced_v = std::is_same_v<T, Eigen::bfloat16> || std::is_same_v<T, Eigen::half>;

// The type arithmetic runs in: float for the 16-bit floats, else T itself.
template <class T>
using compute_t = std::conditional_t<is_reduced_v<T>, float, T>;

template <class T>
inline constexpr bool is_float_v = std::is_floating_point_v<compute_t<T>>;

// double -> float rounding to odd. Rounding that result to a 16-bit float
// then gives the correctly rounded value (plain double -> float -> 16-bit
// would round twice and can be off by one ulp on ties).
inline float round_to_odd_float(double v) {
  float f = static_cast<float>(v);
  if (std::isfinite(f) && static_cast<double>(f) != v) {
    auto bits = std::bit_cast<uint32_t>(f);
    if (std::fabs(static_cast<double>(f)) > std::fabs(v)) bits -= 1;  // back toward zero
    f = std::bit_cast<float>(bits | 1u);
  }
  return f;
}

// Value conversion between storage types: float -> int truncates toward
// zero, anything -> bool is != 0, 16-bit floats round to nearest even.
template <class D, class S>
inline D convert(S v) {
  if constexpr (std::is_same_v<D, S>) {
    return v;
  } else if constexpr (is_reduced_v<S>) {
    return convert<D>(static_cast<float>(v));
  } else if constexpr (std::is_same_v<D, bool>) {
    return v != S(0);
  } else if constexpr (std::is_integral_v<D> && std::is_floating_point_v<S>) {
    // Saturating, NaN -> 0: a plain cast of an out-of-range value (e.g. a
    // -inf mask) would be undefined behaviour.
    constexpr S lo = static_cast<S>(std::numeric_limits<D>::lowest());
    constexpr S hi = static_cast<S>(std::numeric_limits<D>::max());
    if (!(v == v)) return D(0);
    if (v <= lo) return std::numeric_limits<D>::lowest();
    if (v >= hi) return std::numeric_limits<D>::max();
    return static_cast<D>(v);
  } else if constexpr (is_reduced_v<D>) {
    if constexpr (std::is_same_v<S, float>)
      return D(v);
    else
      return D(round_to_odd_float(static_cast<double>(v)));
  } else {
    return static_cast<D>(v);
  }
}

// ---------------------------------------------------------------------------
// Shapes, devices, views

void check_cpu(Device device, const char* op) {
  check(device.type == DeviceType::cpu, op, "device ", device_name(device),
        " is not supported by the eigen backend, which runs on the CPU only; use device cpu, or the torch "
        "backend for ",
        device_name(device));
}

int64_t numel_of(const Shape& shape) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

int normalize_axis(int axis, int rank, const char* op, const Shape& shape) {
  const int a = axis < 0 ? axis + rank : axis;
  check(a >= 0 && a < rank, op, "axis ", axis, " is out of range for shape ", shape_str(shape), " (rank ", rank, ")");
  return a;
}

std::shared_ptr<EigenRaw> view_of(const EigenRaw& x) { return std::make_shared<EigenRaw>(x); }

// y.shape[i] = x.shape[perm[i]].
EigenRaw permuted(const EigenRaw& x, const std::vector<int>& perm) {
  EigenRaw y = x;
  for (size_t i = 0; i < perm.size(); ++i) {
    y.shape[i] = x.shape[perm[i]];
    y.strides[i] = x.strides[perm[i]];
  }
  return y;
}

std::vector<int> inverse_permutation(const std::vector<int>& perm) {
  std::vector<int> inv(perm.size());
  for (size_t i = 0; i < perm.size(); ++i) inv[perm[i]] = static_cast<int>(i);
  return inv;
}

// Strides that read x as if expanded to `shape` (same rank, numpy rules
// already checked): 0 on axes where x has size 1 and `shape` does not.
std::vector<int64_t> broadcast_strides(const EigenRaw& x, const Shape& shape) {
  std::vector<int64_t> s = x.strides;
  for (size_t d = 0; d < shape.size(); ++d)
    if (x.shape[d] != shape[d]) s[d] = 0;
  return s;
}

// ---------------------------------------------------------------------------
// Strided iteration

// Calls run(offsets, n, steps) for every innermost run of `shape`, where
// offsets[k] is operand k's element offset of the run's first element and
// steps[k] its stride along the run. Axes of size 1 are dropped and axes that
// are nested contiguously in every operand are merged, so dense operands give
// one long run that the compiler (or Eigen) can vectorize.
template <size_t N, class Run>
void for_each_run(const Shape& shape, const std::array<const std::vector<int64_t>*, N>& strides, Run&& run) {
  using Steps = std::array<int64_t, N>;
  std::vector<int64_t> sizes;
  std::vector<Steps> steps;
  for (size_t d = 0; d < shape.size(); ++d) {
    if (shape[d] == 0) return;
    if (shape[d] == 1) continue;
    Steps s;
    for (size_t k = 0; k < N; ++k) s[k] = (*strides[k])[d];
    if (!sizes.empty()) {
      bool nested = true;
      for (size_t k = 0; k < N; ++k) nested = nested && steps.back()[k] == s[k] * shape[d];
      if (nested) {
        sizes.back() *= shape[d];
        steps.back() = s;
        continue;
      }
    }
    sizes.push_back(shape[d]);
    steps.push_back(s);
  }
  Steps offsets{};
  if (sizes.empty()) {
    run(offsets, int64_t{1}, Steps{});
    return;
  }
  const int outer = static_cast<int>(sizes.size()) - 1;
  const int64_t n = sizes.back();
  const Steps inner = steps.back();
  std::vector<int64_t> index(outer, 0);
  while (true) {
    run(offsets, n, inner);
    int d = outer - 1;
    for (; d >= 0; --d) {
      for (size_t k = 0; k < N; ++k) offsets[k] += steps[d][k];
      if (++index[d] < sizes[d]) break;
      for (size_t k = 0; k < N; ++k) offsets[k] -= steps[d][k] * sizes[d];
      index[d] = 0;
    }
    if (d < 0) return;
  }
}

// Copies the logical contents of src into dst (strides dst_strides over
// src's shape), converting the element type.
template <class D>
void copy_to(const EigenRaw& src, D* dst, const std::vector<int64_t>& dst_strides) {
  visit_dtype(src.dtype, [&](auto tag) {
    using S = typename decltype(tag)::type;
    const S* s = src.data<S>();
    for_each_run<2>(src.shape, {&src.strides, &dst_strides}, [&](auto off, int64_t n, auto step) {
      const S* ps = s + off[0];
      D* pd = dst + off[1];
      if (step[0] == 1 && step[1] == 1) {
        for (int64_t i = 0; i < n; ++i) pd[i] = convert<D>(ps[i]);
      } else {
        for (int64_t i = 0; i < n; ++i) pd[i * step[1]] = convert<D>(ps[i * step[0]]);
      }
    });
  });
}

// A dense copy of x with dtype `dtype`.
std::shared_ptr<EigenRaw> dense_copy(const EigenRaw& x, DType dtype) {
  auto out = empty_raw(dtype, x.shape);
  visit_dtype(dtype, [&](auto tag) {
    using D = typename decltype(tag)::type;
    copy_to(x, out->data<D>(), out->strides);
  });
  return out;
}

// The elements of x in logical order as a dense array of C: x's own memory
// when that already is one, else a converted copy held here.
template <class C>
class DenseAs {
 public:
  explicit DenseAs(const EigenRaw& x) {
    if (x.dtype == dtype_of() && x.is_contiguous()) {
      data_ = x.data<C>();
    } else {
      copy_ = std::make_unique<C[]>(static_cast<size_t>(x.numel()));
      copy_to(x, copy_.get(), contiguous_strides(x.shape));
      data_ = copy_.get();
    }
  }
  const C* data() const { return data_; }

 private:
  static DType dtype_of() {
    if constexpr (std::is_same_v<C, float>) return DType::float32;
    else if constexpr (std::is_same_v<C, double>) return DType::float64;
    else if constexpr (std::is_same_v<C, int32_t>) return DType::int32;
    else if constexpr (std::is_same_v<C, int64_t>) return DType::int64;
    else return DType::boolean;
  }
  std::unique_ptr<C[]> copy_;  // not std::vector: vector<bool> has no data()
  const C* data_ = nullptr;
};

// ---------------------------------------------------------------------------
// Elementwise

template <class F>
decltype(auto) visit_binary_op(BinaryOp op, F&& f) {
  using B = BinaryOp;
  switch (op) {
#define DIMATTN_CASE(name) \
  case B::name:            \
    return f(std::integral_constant<B, B::name>{});
    DIMATTN_CASE(add)
    DIMATTN_CASE(sub)
    DIMATTN_CASE(mul)
    DIMATTN_CASE(div)
    DIMATTN_CASE(maximum)
    DIMATTN_CASE(minimum)
    DIMATTN_CASE(eq)
    DIMATTN_CASE(ne)
    DIMATTN_CASE(lt)
    DIMATTN_CASE(le)
    DIMATTN_CASE(gt)
    DIMATTN_CASE(ge)
    DIMATTN_CASE(logical_and)
    DIMATTN_CASE(logical_or)
#undef DIMATTN_CASE
  }
  detail::fail("eigen.binary", "unknown op value ", static_cast<int>(op));
}

template <class F>
decltype(auto) visit_unary_op(UnaryOp op, F&& f) {
  using U = UnaryOp;
  switch (op) {
    case U::neg: return f(std::integral_constant<U, U::neg>{});
    case U::exp: return f(std::integral_constant<U, U::exp>{});
    case U::log: return f(std::integral_constant<U, U::log>{});
    case U::sqrt: return f(std::integral_constant<U, U::sqrt>{});
    case U::abs: return f(std::integral_constant<U, U::abs>{});
    case U::logical_not: return f(std::integral_constant<U, U::logical_not>{});
  }
  detail::fail("eigen.unary", "unknown op value ", static_cast<int>(op));
}

constexpr bool returns_bool(BinaryOp op) { return op >= BinaryOp::eq; }
constexpr bool arithmetic(BinaryOp op) {
  return op == BinaryOp::add || op == BinaryOp::sub || op == BinaryOp::mul || op == BinaryOp::div;
}

template <class C>
inline bool is_nan(C x) {
  if constexpr (std::is_floating_point_v<C>) return std::isnan(x);
  else return false;
}

// Integer add/sub/mul/neg wrap around (as in torch and numpy) instead of
// overflowing, which would be undefined for signed types.
template <class C>
struct Wrap {
  using type = C;
};
template <class C>
  requires(std::is_integral_v<C> && !std::is_same_v<C, bool>)
struct Wrap<C> {
  using type = std::make_unsigned_t<C>;
};
template <class C>
using wrap_t = typename Wrap<C>::type;

template <BinaryOp Op, class C>
inline auto scalar_binary(C x, C y) {
  using B = BinaryOp;
  using W = wrap_t<C>;
  if constexpr (Op == B::add) return static_cast<C>(static_cast<W>(x) + static_cast<W>(y));
  else if constexpr (Op == B::sub) return static_cast<C>(static_cast<W>(x) - static_cast<W>(y));
  else if constexpr (Op == B::mul) return static_cast<C>(static_cast<W>(x) * static_cast<W>(y));
  else if constexpr (Op == B::div) return static_cast<C>(x / y);
  // NaN propagates through maximum and minimum, as in numpy and torch.
  else if constexpr (Op == B::maximum) return (is_nan(x) || x > y) ? x : y;
  else if constexpr (Op == B::minimum) return (is_nan(x) || x < y) ? x : y;
  else if constexpr (Op == B::eq) return x == y;
  else if constexpr (Op == B::ne) return x != y;
  else if constexpr (Op == B::lt) return x < y;
  else if constexpr (Op == B::le) return x <= y;
  else if constexpr (Op == B::gt) return x > y;
  else if constexpr (Op == B::ge) return x >= y;
  else if constexpr (Op == B::logical_and) return x != C(0) && y != C(0);
  else return x != C(0) || y != C(0);
}

// Operand of an Eigen expression over a run of n elements: the run itself
// (step 1) or its single, broadcast element (step 0).
template <class T, class K>
void with_run_operand(const T* p, int64_t step, int64_t n, K&& k) {
  using C = compute_t<T>;
  if (step == 1)
    k(Eigen::Map<const Eigen::Array<T, Eigen::Dynamic, 1>>(p, n).template cast<C>());
  else
    k(Eigen::Array<C, Eigen::Dynamic, 1>::Constant(n, convert<C>(*p)));
}

template <BinaryOp Op, class T>
void binary_kernel(const EigenRaw& a, const EigenRaw& b, EigenRaw& out) {
  using C = compute_t<T>;
  using O = std::conditional_t<returns_bool(Op), bool, T>;
  const auto sa = broadcast_strides(a, out.shape), sb = broadcast_strides(b, out.shape);
  const T* pa = a.data<T>();
  const T* pb = b.data<T>();
  O* po = out.data<O>();
  for_each_run<3>(out.shape, {&sa, &sb, &out.strides}, [&](auto off, int64_t n, auto step) {
    const T* x = pa + off[0];
    const T* y = pb + off[1];
    O* o = po + off[2];
    if constexpr (is_float_v<T> && arithmetic(Op)) {
      // One Eigen expression per run, so that Eigen's packet math applies.
      if (step[2] == 1 && (step[0] == 0 || step[0] == 1) && (step[1] == 0 || step[1] == 1)) {
        Eigen::Map<Eigen::Array<T, Eigen::Dynamic, 1>> dst(o, n);
        with_run_operand(x, step[0], n, [&](const auto& vx) {
          with_run_operand(y, step[1], n, [&](const auto& vy) {
            if constexpr (Op == BinaryOp::add) dst = (vx + vy).template cast<T>();
            else if constexpr (Op == BinaryOp::sub) dst = (vx - vy).template cast<T>();
            else if constexpr (Op == BinaryOp::mul) dst = (vx * vy).template cast<T>();
            else dst = (vx / vy).template cast<T>();
          });
        });
        return;
      }
    }
    if (step[0] == 1 && step[1] == 1 && step[2] == 1) {
      for (int64_t i = 0; i < n; ++i) o[i] = convert<O>(scalar_binary<Op>(convert<C>(x[i]), convert<C>(y[i])));
    } else {
      for (int64_t i = 0; i < n; ++i)
        o[i * step[2]] = convert<O>(scalar_binary<Op>(convert<C>(x[i * step[0]]), convert<C>(y[i * step[1]])));
    }
  });
}

// The numpy broadcast of equal-rank shapes; `what` names the operands in the error.
Shape broadcast_shape(const std::vector<const Shape*>& shapes, const char* op, const std::string& what) {
  const Shape& first = *shapes.front();
  auto all_shapes = [&] {
    std::string s;
    for (size_t i = 0; i < shapes.size(); ++i) s += (i ? " and " : "") + shape_string(*shapes[i]);
    return s;
  };
  for (const Shape* s : shapes)
    if (s->size() != first.size())
      detail::fail(op, what, ": operands must have equal rank, got shapes ", all_shapes(),
                   "; add size-1 axes (reshape) to broadcast");
  Shape out(first.size());
  for (size_t d = 0; d < first.size(); ++d) {
    int64_t size = 1;
    for (const Shape* s : shapes) {
      const int64_t e = (*s)[d];
      if (e == 1) continue;
      if (size != 1 && size != e)
        detail::fail(op, what, ": cannot broadcast shapes ", all_shapes(), " (axis ", d, " has sizes ", size, " and ",
                     e, ")");
      size = e;
    }
    out[d] = size;
  }
  return out;
}

void check_same_dtype(const EigenRaw& a, const EigenRaw& b, const char* op, const char* what) {
  check(a.dtype == b.dtype, op, what, ": operands must have the same dtype, got ", dtype_name(a.dtype), " ",
        shape_str(a.shape), " and ", dtype_name(b.dtype), " ", shape_str(b.shape), "; cast one of them first");
}

RawPtr binary_impl(BinaryOp op, const EigenRaw& a, const EigenRaw& b) {
  const char* kOp = "eigen.binary";
  check_same_dtype(a, b, kOp, op_name(op));
  const Shape shape = broadcast_shape({&a.shape, &b.shape}, kOp, op_name(op));
  const bool floating = is_floating(a.dtype);
  check(floating || op != BinaryOp::div, kOp, "div on ", dtype_name(a.dtype), " operands ", shape_str(a.shape),
        " and ", shape_str(b.shape), " is not supported; cast them to a floating dtype first");
  check(a.dtype != DType::boolean || op != BinaryOp::sub, kOp,
        "sub on bool operands is not supported; use logical ops, or cast to an integer dtype first");
  auto out = empty_raw(returns_bool(op) ? DType::boolean : a.dtype, shape);
  visit_dtype(a.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    visit_binary_op(op, [&](auto op_tag) { binary_kernel<decltype(op_tag)::value, T>(a, b, *out); });
  });
  return out;
}

template <UnaryOp Op, class C>
inline auto scalar_unary(C x) {
  using U = UnaryOp;
  if constexpr (Op == U::logical_not) return x == C(0);
  else if constexpr (std::is_same_v<C, bool>) return x;  // excluded before dispatch
  else if constexpr (Op == U::neg) return static_cast<C>(-static_cast<wrap_t<C>>(x));
  else if constexpr (Op == U::abs && !std::is_floating_point_v<C>)
    return static_cast<C>(x < C(0) ? -static_cast<wrap_t<C>>(x) : x);
  else if constexpr (!std::is_floating_point_v<C>) return x;  // excluded before dispatch
  else if constexpr (Op == U::abs) return std::abs(x);
  else if constexpr (Op == U::exp) return std::exp(x);
  else if constexpr (Op == U::log) return std::log(x);
  else return std::sqrt(x);
}

template <UnaryOp Op, class T>
void unary_kernel(const EigenRaw& x, EigenRaw& out) {
  using C = compute_t<T>;
  using O = std::conditional_t<Op == UnaryOp::logical_not, bool, T>;
  const T* px = x.data<T>();
  O* po = out.data<O>();
  for_each_run<2>(x.shape, {&x.strides, &out.strides}, [&](auto off, int64_t n, auto step) {
    const T* s = px + off[0];
    O* o = po + off[1];
    if constexpr (is_float_v<T> && Op != UnaryOp::logical_not) {
      // Eigen vectorizes exp/log/sqrt; std:: calls in a loop would not be.
      if (step[0] == 1 && step[1] == 1) {
        Eigen::Map<Eigen::Array<T, Eigen::Dynamic, 1>> dst(o, n);
        auto v = Eigen::Map<const Eigen::Array<T, Eigen::Dynamic, 1>>(s, n).template cast<C>();
        if constexpr (Op == UnaryOp::neg) dst = (-v).template cast<T>();
        else if constexpr (Op == UnaryOp::exp) dst = v.exp().template cast<T>();
        else if constexpr (Op == UnaryOp::log) dst = v.log().template cast<T>();
        else if constexpr (Op == UnaryOp::sqrt) dst = v.sqrt().template cast<T>();
        else dst = v.abs().template cast<T>();
        return;
      }
    }
    for (int64_t i = 0; i < n; ++i) o[i * step[1]] = convert<O>(scalar_unary<Op>(convert<C>(s[i * step[0]])));
  });
}

RawPtr unary_impl(UnaryOp op, const EigenRaw& x) {
  const char* kOp = "eigen.unary";
  const bool transcendental = op == UnaryOp::exp || op == UnaryOp::log || op == UnaryOp::sqrt;
  check(!transcendental || is_floating(x.dtype), kOp, op_name(op), " of ", dtype_name(x.dtype), " ",
        shape_str(x.shape), " is not supported; cast to a floating dtype first");
  check(x.dtype != DType::boolean || op == UnaryOp::logical_not, kOp, op_name(op), " of bool ", shape_str(x.shape),
        " is not supported; use logical_not, or cast to an integer dtype first");
  auto out = empty_raw(op == UnaryOp::logical_not ? DType::boolean : x.dtype, x.shape);
  visit_dtype(x.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    visit_unary_op(op, [&](auto op_tag) { unary_kernel<decltype(op_tag)::value, T>(x, *out); });
  });
  return out;
}

RawPtr where_impl(const EigenRaw& cond, const EigenRaw& a, const EigenRaw& b) {
  const char* kOp = "eigen.where";
  check(cond.dtype == DType::boolean, kOp, "cond must be bool, got ", dtype_name(cond.dtype), " ",
        shape_str(cond.shape), "; compare it (ne 0) first");
  check_same_dtype(a, b, kOp, "where");
  const Shape shape = broadcast_shape({&cond.shape, &a.shape, &b.shape}, kOp, "cond, a, b");
  auto out = empty_raw(a.dtype, shape);
  const auto sc = broadcast_strides(cond, shape), sa = broadcast_strides(a, shape), sb = broadcast_strides(b, shape);
  visit_dtype(a.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const bool* pc = cond.data<bool>();
    const T* pa = a.data<T>();
    const T* pb = b.data<T>();
    T* po = out->data<T>();
    for_each_run<4>(shape, {&sc, &sa, &sb, &out->strides}, [&](auto off, int64_t n, auto step) {
      for (int64_t i = 0; i < n; ++i)
        po[off[3] + i * step[3]] = pc[off[0] + i * step[0]] ? pa[off[1] + i * step[1]] : pb[off[2] + i * step[2]];
    });
  });
  return out;
}

// ---------------------------------------------------------------------------
// Reductions and softmax

template <class C>
using RowArray = Eigen::Array<C, Eigen::Dynamic, 1>;

template <class C>
C row_sum(const C* p, int64_t n) {
  if constexpr (std::is_floating_point_v<C>) {
    return n == 0 ? C(0) : Eigen::Map<const RowArray<C>>(p, n).sum();
  } else {
    wrap_t<C> s = 0;
    for (int64_t i = 0; i < n; ++i) s += static_cast<wrap_t<C>>(p[i]);
    return static_cast<C>(s);
  }
}

// An empty row's max is the identity of max (-inf, or the lowest integer).
template <class C>
C row_max(const C* p, int64_t n) {
  if constexpr (std::is_floating_point_v<C>) {
    if (n == 0) return -std::numeric_limits<C>::infinity();
    return Eigen::Map<const RowArray<C>>(p, n).template maxCoeff<Eigen::PropagateNaN>();
  } else {
    C m = std::numeric_limits<C>::lowest();
    for (int64_t i = 0; i < n; ++i) m = std::max(m, p[i]);
    return m;
  }
}

template <class C>
C row_min(const C* p, int64_t n) {
  if constexpr (std::is_floating_point_v<C>) {
    if (n == 0) return std::numeric_limits<C>::infinity();
    return Eigen::Map<const RowArray<C>>(p, n).template minCoeff<Eigen::PropagateNaN>();
  } else {
    C m = std::numeric_limits<C>::max();
    for (int64_t i = 0; i < n; ++i) m = std::min(m, p[i]);
    return m;
  }
}

// Stable: subtracts the max. An all -inf (or empty) row gives -inf, not NaN.
template <class C>
C row_logsumexp(const C* p, int64_t n) {
  const C m = row_max(p, n);
  if (!std::isfinite(m)) return m;
  return m + std::log((Eigen::Map<const RowArray<C>>(p, n) - m).exp().sum());
}

std::vector<int> checked_axes(const std::vector<int>& axes, const EigenRaw& x, const char* op) {
  std::vector<int> out;
  for (int a : axes) out.push_back(normalize_axis(a, x.rank(), op, x.shape));
  std::sort(out.begin(), out.end());
  check(std::adjacent_find(out.begin(), out.end()) == out.end(), op, "axes repeat an axis, for shape ",
        shape_str(x.shape));
  return out;
}

// Identity of the reduction (the value of an empty reduction) for max/min.
template <class C>
C lowest_value() {
  if constexpr (std::is_floating_point_v<C>) return -std::numeric_limits<C>::infinity();
  else return std::numeric_limits<C>::lowest();
}
template <class C>
C highest_value() {
  if constexpr (std::is_floating_point_v<C>) return std::numeric_limits<C>::infinity();
  else return std::numeric_limits<C>::max();
}

// Reduction by accumulating into the output (numpy's way): x is walked in
// its own order with the accumulator's stride 0 on reduced axes. Chosen when
// the innermost axis is kept, so that the inner loop runs over contiguous
// accumulators and no transposing copy of x is needed.
template <class T, class C, class F>
std::unique_ptr<C[]> reduce_accumulate(const EigenRaw& x, const std::vector<int>& axes, C init, F f) {
  std::vector<int64_t> acc_strides(x.rank(), 0);
  int64_t s = 1;
  for (int d = x.rank() - 1; d >= 0; --d)
    if (!std::binary_search(axes.begin(), axes.end(), d)) {
      acc_strides[d] = s;
      s *= x.shape[d];
    }
  auto acc = std::make_unique<C[]>(static_cast<size_t>(s));  // not vector: vector<bool> has no data()
  std::fill_n(acc.get(), s, init);
  const T* px = x.data<T>();
  C* pa = acc.get();
  for_each_run<2>(x.shape, {&x.strides, &acc_strides}, [&](auto off, int64_t n, auto step) {
    const T* v = px + off[0];
    C* a = pa + off[1];
    if (step[0] == 1 && step[1] == 1) {
      for (int64_t i = 0; i < n; ++i) a[i] = f(a[i], convert<C>(v[i]));
    } else {
      for (int64_t i = 0; i < n; ++i) a[i * step[1]] = f(a[i * step[1]], convert<C>(v[i * step[0]]));
    }
  });
  return acc;
}

RawPtr reduce_impl(ReduceOp op, const EigenRaw& x, const std::vector<int>& axes_in) {
  const char* kOp = "eigen.reduce";
  const std::vector<int> axes = checked_axes(axes_in, x, kOp);
  const bool needs_float = op == ReduceOp::mean || op == ReduceOp::logsumexp;
  check(!needs_float || is_floating(x.dtype), kOp, op_name(op), " of ", dtype_name(x.dtype), " ",
        shape_str(x.shape), " is not supported; cast to a floating dtype first");
  check(x.dtype != DType::boolean || op == ReduceOp::max || op == ReduceOp::min, kOp, op_name(op), " of bool ",
        shape_str(x.shape), " is not supported; cast to an integer dtype first (max/min are any/all)");

  auto reduced = [&](int d) { return std::binary_search(axes.begin(), axes.end(), d); };
  std::vector<int> perm;  // kept axes first, reduced axes last
  Shape out_shape;
  for (int d = 0; d < x.rank(); ++d)
    if (!reduced(d)) {
      perm.push_back(d);
      out_shape.push_back(x.shape[d]);
    }
  int64_t inner = 1;
  for (int d : axes) {
    perm.push_back(d);
    inner *= x.shape[d];
  }
  const int64_t outer = numel_of(out_shape);
  auto out = empty_raw(x.dtype, out_shape);
  if (outer == 0) return out;

  int innermost = x.rank() - 1;  // the innermost axis that is iterated at all
  while (innermost >= 0 && x.shape[innermost] == 1) --innermost;
  const bool accumulate = op != ReduceOp::logsumexp && inner > 0 && innermost >= 0 && !reduced(innermost);

  visit_dtype(x.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    using C = compute_t<T>;
    T* o = out->data<T>();
    if (accumulate) {
      std::unique_ptr<C[]> acc;
      if (op == ReduceOp::max)
        acc = reduce_accumulate<T>(x, axes, lowest_value<C>(), scalar_binary<BinaryOp::maximum, C>);
      else if (op == ReduceOp::min)
        acc = reduce_accumulate<T>(x, axes, highest_value<C>(), scalar_binary<BinaryOp::minimum, C>);
      else if constexpr (!std::is_same_v<C, bool>)
        acc = reduce_accumulate<T>(x, axes, C(0), scalar_binary<BinaryOp::add, C>);
      const C scale = op == ReduceOp::mean ? C(inner) : C(1);
      for (int64_t i = 0; i < outer; ++i) o[i] = convert<T>(op == ReduceOp::mean ? C(acc[i] / scale) : acc[i]);
      return;
    }
    // Each output element reduces one dense row of the permuted x. C is
    // never a 16-bit float, so for those DenseAs<C> holds a float32 copy.
    const DenseAs<C> rows(permuted(x, perm));
    auto each_row = [&](auto&& f) {
      for (int64_t i = 0; i < outer; ++i) o[i] = convert<T>(f(rows.data() + i * inner, inner));
    };
    switch (op) {
      case ReduceOp::sum:
        if constexpr (!std::is_same_v<C, bool>) each_row([](const C* p, int64_t n) { return row_sum(p, n); });
        break;
      case ReduceOp::max: each_row([](const C* p, int64_t n) { return row_max(p, n); }); break;
      case ReduceOp::min: each_row([](const C* p, int64_t n) { return row_min(p, n); }); break;
      case ReduceOp::mean:
        if constexpr (std::is_floating_point_v<C>)
          each_row([](const C* p, int64_t n) {
            return n == 0 ? std::numeric_limits<C>::quiet_NaN() : row_sum(p, n) / C(n);
          });
        break;
      case ReduceOp::logsumexp:
        if constexpr (std::is_floating_point_v<C>) each_row([](const C* p, int64_t n) { return row_logsumexp(p, n); });
        break;
    }
  });
  return out;
}

RawPtr softmax_impl(const EigenRaw& x, int axis_in, bool log) {
  const char* kOp = "eigen.softmax";
  const int axis = normalize_axis(axis_in, x.rank(), kOp, x.shape);
  check(is_floating(x.dtype), kOp, (log ? "log_softmax" : "softmax"), " of ", dtype_name(x.dtype), " ",
        shape_str(x.shape), " is not supported; cast to a floating dtype first");

  // Computed with `axis` moved last so that rows are dense; the result is
  // that dense tensor viewed back in x's axis order.
  std::vector<int> perm;
  for (int d = 0; d < x.rank(); ++d)
    if (d != axis) perm.push_back(d);
  perm.push_back(axis);
  const EigenRaw xp = permuted(x, perm);
  auto out = empty_raw(x.dtype, xp.shape);
  const int64_t n = x.shape[axis];
  const int64_t outer = n == 0 ? 0 : x.numel() / n;

  visit_dtype(x.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    using C = compute_t<T>;
    if constexpr (std::is_floating_point_v<C>) {
      // In place on y; an all -inf row gives NaN (-inf - -inf), which the
      // frontend masks.
      auto softmax_row = [log](Eigen::Map<RowArray<C>> y) {
        const C m = y.template maxCoeff<Eigen::PropagateNaN>();
        if (log) {
          y -= m;
          y -= std::log(y.exp().sum());
        } else {
          y = (y - m).exp();
          y /= y.sum();
        }
      };
      // Rows of S (x's own dense memory, or a float copy), computed in the
      // output when that is float32/64, else in a row buffer and rounded.
      auto run = [&](const auto* src) {
        using S = std::remove_cv_t<std::remove_pointer_t<decltype(src)>>;
        T* dst = out->data<T>();
        RowArray<C> row(std::is_same_v<T, C> ? 0 : n);
        for (int64_t i = 0; i < outer; ++i) {
          Eigen::Map<const RowArray<S>> in(src + i * n, n);
          if constexpr (std::is_same_v<T, C>) {
            Eigen::Map<RowArray<C>> y(dst + i * n, n);
            y = in.template cast<C>();
            softmax_row(y);
          } else {
            Eigen::Map<RowArray<C>> y(row.data(), n);
            y = in.template cast<C>();
            softmax_row(y);
            Eigen::Map<RowArray<T>>(dst + i * n, n) = y.template cast<T>();
          }
        }
      };
      if (xp.is_contiguous()) {
        run(xp.data<T>());
      } else {
        const DenseAs<C> dense_rows(xp);
        run(dense_rows.data());
      }
    }
  });
  EigenRaw result = permuted(*out, inverse_permutation(perm));
  return std::make_shared<EigenRaw>(std::move(result));
}

// ---------------------------------------------------------------------------
// Batched matrix product

template <class T, int Order>
using MatMap = Eigen::Map<const Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Order>, 0, Eigen::OuterStride<>>;

// How one [B, rows, cols] operand is read by Eigen without a copy: row-major
// when the column stride is 1, column-major when the row stride is 1 (e.g. a
// transposed view), else not at all.
struct MatLayout {
  bool ok = false;
  bool row_major = true;
  int64_t outer_stride = 0;
};

MatLayout mat_layout(const EigenRaw& x) {
  const int64_t rows = x.shape[1], cols = x.shape[2];
  const int64_t sr = x.strides[1], sc = x.strides[2];
  if (cols <= 1 || sc == 1) {
    const int64_t outer = rows <= 1 ? std::max<int64_t>(cols, 1) : sr;
    if (outer >= cols) return {true, true, outer};
  }
  if (rows <= 1 || sr == 1) {
    const int64_t outer = cols <= 1 ? std::max<int64_t>(rows, 1) : sc;
    if (outer >= rows) return {true, false, outer};
  }
  return {};
}

template <class T, int OrderA, int OrderB>
void bmm_batches(const EigenRaw& a, const MatLayout& la, const EigenRaw& b, const MatLayout& lb, EigenRaw& out) {
  const int64_t B = a.shape[0], M = a.shape[1], K = a.shape[2], N = b.shape[2];
  const T* pa = a.data<T>();
  const T* pb = b.data<T>();
  T* po = out.data<T>();
  for (int64_t i = 0; i < B; ++i) {
    MatMap<T, OrderA> A(pa + i * a.strides[0], M, K, Eigen::OuterStride<>(la.outer_stride));
    MatMap<T, OrderB> Bm(pb + i * b.strides[0], K, N, Eigen::OuterStride<>(lb.outer_stride));
    Eigen::Map<Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>> O(po + i * M * N, M, N);
    O.noalias() = A * Bm;
  }
}

// pre: a and b have dtype T (float, double or an integer type).
template <class T>
void bmm_native(const EigenRaw& a_in, const EigenRaw& b_in, EigenRaw& out) {
  MatLayout la = mat_layout(a_in), lb = mat_layout(b_in);
  std::shared_ptr<EigenRaw> a_copy, b_copy;
  // Only the float types get the transposed (column-major) GEMM variants;
  // integer products are rare enough to go through one dense layout.
  constexpr bool kAllLayouts = std::is_floating_point_v<T>;
  if (!la.ok || (!kAllLayouts && !la.row_major)) {
    a_copy = dense_copy(a_in, a_in.dtype);
    la = mat_layout(*a_copy);
  }
  if (!lb.ok || (!kAllLayouts && !lb.row_major)) {
    b_copy = dense_copy(b_in, b_in.dtype);
    lb = mat_layout(*b_copy);
  }
  const EigenRaw& a = a_copy ? *a_copy : a_in;
  const EigenRaw& b = b_copy ? *b_copy : b_in;
  constexpr int R = Eigen::RowMajor, C = Eigen::ColMajor;
  if (la.row_major && lb.row_major) bmm_batches<T, R, R>(a, la, b, lb, out);
  else if constexpr (kAllLayouts) {
    if (la.row_major) bmm_batches<T, R, C>(a, la, b, lb, out);
    else if (lb.row_major) bmm_batches<T, C, R>(a, la, b, lb, out);
    else bmm_batches<T, C, C>(a, la, b, lb, out);
  }
}

RawPtr bmm_impl(const EigenRaw& a, const EigenRaw& b) {
  const char* kOp = "eigen.bmm";
  check(a.rank() == 3 && b.rank() == 3, kOp, "expects a [B, M, K] and b [B, K, N], got shapes ", shape_str(a.shape),
        " and ", shape_str(b.shape));
  check_same_dtype(a, b, kOp, "bmm");
  check(a.shape[0] == b.shape[0] && a.shape[2] == b.shape[1], kOp,
        "expects a [B, M, K] and b [B, K, N] with equal B and K, got shapes ", shape_str(a.shape), " and ",
        shape_str(b.shape));
  check(a.dtype != DType::boolean, kOp, "bmm of bool ", shape_str(a.shape),
        " is not supported; cast to a numeric dtype first");
  const int64_t B = a.shape[0], M = a.shape[1], K = a.shape[2], N = b.shape[2];
  auto out = empty_raw(a.dtype, {B, M, N});
  if (out->numel() == 0) return out;
  visit_dtype(a.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if constexpr (std::is_same_v<T, bool>) {
      // excluded above
    } else if (K == 0) {
      std::fill_n(out->data<T>(), out->numel(), T(0));
    } else if constexpr (is_reduced_v<T>) {
      // 16-bit floats: float32 GEMM (accumulating in float32), rounded once.
      auto af = dense_copy(a, DType::float32), bf = dense_copy(b, DType::float32);
      auto of = empty_raw(DType::float32, {B, M, N});
      bmm_native<float>(*af, *bf, *of);
      Eigen::Map<RowArray<T>>(out->data<T>(), out->numel()) =
          Eigen::Map<const RowArray<float>>(of->data<float>(), of->numel()).template cast<T>();
    } else {
      bmm_native<T>(a, b, *out);
    }
  });
  return out;
}

// ---------------------------------------------------------------------------
// Layout primitives

RawPtr permute_impl(const EigenRaw& x, const std::vector<int>& perm) {
  const char* kOp = "eigen.permute";
  std::vector<bool> seen(x.rank(), false);
  bool valid = static_cast<int>(perm.size()) == x.rank();
  for (int p : perm) {
    valid = valid && p >= 0 && p < x.rank() && !seen[p];
    if (valid) seen[p] = true;
  }
  if (!valid) {
    std::ostringstream os;
    for (size_t i = 0; i < perm.size(); ++i) os << (i ? ", " : "") << perm[i];
    detail::fail(kOp, "perm [", os.str(), "] is not a permutation of the axes of shape ", shape_str(x.shape));
  }
  return std::make_shared<EigenRaw>(permuted(x, perm));
}

// Strides viewing x as `shape` without a copy, when x's strides allow it
// (PyTorch's computeStride): every run of merged axes must be contiguous.
std::optional<std::vector<int64_t>> view_strides(const EigenRaw& x, const Shape& shape) {
  if (x.numel() == 0 || x.rank() == 0) return contiguous_strides(shape);
  std::vector<int64_t> strides(shape.size());
  int view_d = static_cast<int>(shape.size()) - 1;
  int64_t chunk_base = x.strides.back(), tensor_numel = 1, view_numel = 1;
  for (int d = x.rank() - 1; d >= 0; --d) {
    tensor_numel *= x.shape[d];
    if (d == 0 || (x.shape[d - 1] != 1 && x.strides[d - 1] != tensor_numel * chunk_base)) {
      while (view_d >= 0 && (view_numel < tensor_numel || shape[view_d] == 1)) {
        strides[view_d] = view_numel * chunk_base;
        view_numel *= shape[view_d];
        --view_d;
      }
      if (view_numel != tensor_numel) return std::nullopt;
      if (d > 0) {
        chunk_base = x.strides[d - 1];
        tensor_numel = 1;
        view_numel = 1;
      }
    }
  }
  if (view_d != -1) return std::nullopt;
  return strides;
}

RawPtr reshape_impl(const EigenRaw& x, const Shape& shape) {
  const char* kOp = "eigen.reshape";
  for (int64_t s : shape) check(s >= 0, kOp, "negative size in target shape ", shape_str(shape));
  check(numel_of(shape) == x.numel(), kOp, "cannot reshape ", shape_str(x.shape), " (", x.numel(),
        " elements) to ", shape_str(shape), " (", numel_of(shape), " elements)");
  if (auto strides = view_strides(x, shape)) {
    auto y = view_of(x);
    y->shape = shape;
    y->strides = *strides;
    return y;
  }
  auto y = dense_copy(x, x.dtype);
  y->shape = shape;
  y->strides = contiguous_strides(shape);
  return y;
}

RawPtr expand_impl(const EigenRaw& x, const Shape& shape) {
  const char* kOp = "eigen.expand";
  check(static_cast<int>(shape.size()) == x.rank(), kOp, "cannot expand ", shape_str(x.shape), " to ",
        shape_str(shape), ": ranks differ");
  auto y = view_of(x);
  for (int d = 0; d < x.rank(); ++d) {
    if (x.shape[d] == shape[d]) continue;
    check(x.shape[d] == 1 && shape[d] >= 0, kOp, "cannot expand ", shape_str(x.shape), " to ", shape_str(shape),
          ": axis ", d, " has size ", x.shape[d], ", only size-1 axes broadcast");
    y->shape[d] = shape[d];
    y->strides[d] = 0;
  }
  return y;
}

RawPtr slice_impl(const EigenRaw& x, int axis_in, int64_t start, int64_t end) {
  const char* kOp = "eigen.slice";
  const int axis = normalize_axis(axis_in, x.rank(), kOp, x.shape);
  check(0 <= start && start <= end && end <= x.shape[axis], kOp, "range [", start, ", ", end, ") is out of bounds for axis ",
        axis, " of size ", x.shape[axis], " (shape ", shape_str(x.shape), ")");
  auto y = view_of(x);
  y->shape[axis] = end - start;
  if (end > start) y->offset += start * x.strides[axis];
  return y;
}

RawPtr concat_impl(const std::vector<RawPtr>& raws, int axis_in) {
  const char* kOp = "eigen.concat";
  check(!raws.empty(), kOp, "needs at least one tensor");
  std::vector<const EigenRaw*> xs;
  for (const auto& r : raws) xs.push_back(&as_eigen(r));
  const EigenRaw& first = *xs.front();
  const int axis = normalize_axis(axis_in, first.rank(), kOp, first.shape);
  auto all_shapes = [&] {
    std::string s;
    for (size_t i = 0; i < xs.size(); ++i) s += (i ? ", " : "") + std::string(dtype_name(xs[i]->dtype)) + " " + shape_string(xs[i]->shape);
    return s;
  };
  Shape shape = first.shape;
  shape[axis] = 0;
  for (const EigenRaw* x : xs) {
    if (x->dtype != first.dtype) detail::fail(kOp, "tensors must have the same dtype, got ", all_shapes(), "; cast first");
    bool same = x->rank() == first.rank();
    for (int d = 0; same && d < first.rank(); ++d) same = d == axis || x->shape[d] == first.shape[d];
    if (!same) detail::fail(kOp, "tensors must have equal sizes except on axis ", axis, ", got ", all_shapes());
    shape[axis] += x->shape[axis];
  }
  auto out = empty_raw(first.dtype, shape);
  visit_dtype(first.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    int64_t start = 0;
    for (const EigenRaw* x : xs) {
      copy_to(*x, out->data<T>() + start * out->strides[axis], out->strides);
      start += x->shape[axis];
    }
  });
  return out;
}

RawPtr gather_impl(const EigenRaw& x, int axis_in, const EigenRaw& idx) {
  const char* kOp = "eigen.gather";
  const int axis = normalize_axis(axis_in, x.rank(), kOp, x.shape);
  check(idx.dtype == DType::int64 || idx.dtype == DType::int32, kOp, "indices must be int64 or int32, got ",
        dtype_name(idx.dtype), " ", shape_str(idx.shape));
  bool sizes_ok = idx.rank() == x.rank();
  for (int d = 0; sizes_ok && d < x.rank(); ++d) sizes_ok = d == axis || idx.shape[d] == x.shape[d];
  check(sizes_ok, kOp, "indices ", shape_str(idx.shape), " must have the rank and sizes of x ", shape_str(x.shape),
        " except on axis ", axis);
  auto out = empty_raw(x.dtype, idx.shape);
  // x read along idx's shape with the gathered axis held at 0; the index
  // then adds idx * stride on that axis.
  std::vector<int64_t> xs = x.strides;
  xs[axis] = 0;
  const int64_t extent = x.shape[axis], axis_stride = x.strides[axis];
  visit_dtype(x.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    visit_dtype(idx.dtype, [&](auto itag) {
      using I = typename decltype(itag)::type;
      if constexpr (std::is_same_v<I, int32_t> || std::is_same_v<I, int64_t>) {
        const T* px = x.data<T>();
        const I* pi = idx.data<I>();
        T* po = out->data<T>();
        for_each_run<3>(idx.shape, {&xs, &idx.strides, &out->strides}, [&](auto off, int64_t n, auto step) {
          for (int64_t i = 0; i < n; ++i) {
            const int64_t k = pi[off[1] + i * step[1]];
            if (k < 0 || k >= extent)
              detail::fail(kOp, "index ", k, " is out of range for axis ", axis, " of size ", extent, " (x ",
                           shape_str(x.shape), ", indices ", shape_str(idx.shape), ")");
            po[off[2] + i * step[2]] = px[off[0] + i * step[0] + k * axis_stride];
          }
        });
      }
    });
  });
  return out;
}

// ---------------------------------------------------------------------------
// Creation

RawPtr full_impl(const Shape& shape, double value, DType dtype) {
  auto out = empty_raw(dtype, shape);
  visit_dtype(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    std::fill_n(out->data<T>(), out->numel(), convert<T>(value));
  });
  return out;
}

// Uniform in [0, 1) with 53 random bits.
inline double unit_uniform(std::mt19937_64& gen) { return static_cast<double>(gen() >> 11) * 0x1.0p-53; }

RawPtr random_impl(const Shape& shape, RandomKind kind, double a, double b, uint64_t seed, DType dtype) {
  const char* kOp = "eigen.random";
  if (kind == RandomKind::normal)
    check(b >= 0, kOp, "normal needs stddev >= 0, got ", b);
  else
    check(a <= b, kOp, "uniform needs low <= high, got [", a, ", ", b, ")");
  auto out = empty_raw(dtype, shape);
  const int64_t n = out->numel();
  // Drawn as doubles, then converted: the same seed gives the same values
  // for every dtype, up to rounding.
  std::vector<double> v(static_cast<size_t>(n));
  std::mt19937_64 gen(seed);
  if (kind == RandomKind::normal) {
    // Box-Muller by hand: std::normal_distribution differs between standard libraries.
    constexpr double kTwoPi = 6.283185307179586476925286766559;
    for (int64_t i = 0; i < n; i += 2) {
      const double u1 = 1.0 - unit_uniform(gen);  // (0, 1]: log(u1) is finite
      const double u2 = unit_uniform(gen);
      const double r = std::sqrt(-2.0 * std::log(u1));
      v[i] = a + b * r * std::cos(kTwoPi * u2);
      if (i + 1 < n) v[i + 1] = a + b * r * std::sin(kTwoPi * u2);
    }
  } else {
    for (int64_t i = 0; i < n; ++i) v[i] = a + (b - a) * unit_uniform(gen);
  }
  visit_dtype(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    T* o = out->data<T>();
    for (int64_t i = 0; i < n; ++i) {
      double x = v[i];
      if constexpr (std::is_integral_v<T> && !std::is_same_v<T, bool>)
        if (kind == RandomKind::uniform) x = std::floor(x);
      T t = convert<T>(x);
      // Rounding to the dtype may reach the excluded upper bound.
      if (kind == RandomKind::uniform && b > a && convert<double>(t) >= b) t = convert<T>(a);
      o[i] = t;
    }
  });
  return out;
}

// ---------------------------------------------------------------------------

class EigenBackend final : public Backend {
  Decision decide(const AttentionCall& c, const detail::FlashInputs& in) {
    return select_kernel(name(), attention_params(c, detail::flash_layout_class(*this, in), false),
                         detail::cpu_flash_candidates());
  }

 public:
  std::string name() const override { return "eigen"; }
  bool supports(Device device) const override { return device.type == DeviceType::cpu; }

  RawPtr full(const Shape& shape, double value, DType dtype, Device device) override {
    check_cpu(device, "eigen.full");
    return full_impl(shape, value, dtype);
  }

  RawPtr from_host(const Shape& shape, const std::vector<double>& data, DType dtype, Device device) override {
    check_cpu(device, "eigen.from_host");
    auto out = empty_raw(dtype, shape);
    check(static_cast<int64_t>(data.size()) == out->numel(), "eigen.from_host", "shape ", shape_str(shape), " has ",
          out->numel(), " elements but ", data.size(), " values were given");
    visit_dtype(dtype, [&](auto tag) {
      using T = typename decltype(tag)::type;
      std::transform(data.begin(), data.end(), out->data<T>(), [](double v) { return convert<T>(v); });
    });
    return out;
  }

  std::vector<double> to_host(const RawPtr& raw) override {
    const EigenRaw& x = as_eigen(raw);
    std::vector<double> data(static_cast<size_t>(x.numel()));
    copy_to(x, data.data(), contiguous_strides(x.shape));
    return data;
  }

  RawPtr random(const Shape& shape, RandomKind kind, double a, double b, uint64_t seed, DType dtype,
                Device device) override {
    check_cpu(device, "eigen.random");
    return random_impl(shape, kind, a, b, seed, dtype);
  }

  RawPtr arange(int64_t n, DType dtype, Device device) override {
    check_cpu(device, "eigen.arange");
    check(n >= 0, "eigen.arange", "n must be >= 0, got ", n);
    auto out = empty_raw(dtype, {n});
    visit_dtype(dtype, [&](auto tag) {
      using T = typename decltype(tag)::type;
      T* o = out->data<T>();
      for (int64_t i = 0; i < n; ++i) o[i] = convert<T>(static_cast<double>(i));
    });
    return out;
  }

  Shape shape(const RawPtr& x) override { return as_eigen(x).shape; }

  RawPtr cast(const RawPtr& raw, DType dtype) override {
    const EigenRaw& x = as_eigen(raw);
    if (x.dtype == dtype) return raw;
    return dense_copy(x, dtype);
  }

  RawPtr to_device(const RawPtr& raw, Device device) override {
    as_eigen(raw);
    check_cpu(device, "eigen.to_device");
    return raw;
  }

  RawPtr permute(const RawPtr& x, const std::vector<int>& perm) override { return permute_impl(as_eigen(x), perm); }
  RawPtr reshape(const RawPtr& x, const Shape& shape) override { return reshape_impl(as_eigen(x), shape); }
  RawPtr contiguous(const RawPtr& x) override {
    const EigenRaw& e = as_eigen(x);
    return e.is_contiguous() ? x : dense_copy(e, e.dtype);
  }
  // The fast path: dimattn's own CPU kernel on the default pool.
  std::vector<std::string> attention_kernels(Device) const override { return {"cpu_flash", "reference"}; }
  Decision explain_attention(const AttentionCall& c) override {
    const auto layout = detail::flash_layout(c);
    return decide(c, detail::flash_inputs(*this, c, layout));
  }
  AttentionResult scaled_dot_product_attention(const AttentionCall& c) override {
    const auto layout = detail::flash_layout(c);
    const auto in = detail::flash_inputs(*this, c, layout);
    if (decide(c, in).kernel == "reference") return reference_path(c);
    const auto fwd = detail::flash_forward(*this, c, layout, in, detail::default_parallel_for());
    return {detail::flash_output(*this, c, layout, fwd.out), "cpu_flash"};
  }

  std::optional<HostView> host_view(const RawPtr& x) override {
    const EigenRaw& e = as_eigen(x);
    return HostView{e.bytes(), e.shape, e.strides, e.dtype};
  }
  RawPtr expand(const RawPtr& x, const Shape& shape) override { return expand_impl(as_eigen(x), shape); }
  RawPtr concat(const std::vector<RawPtr>& xs, int axis) override { return concat_impl(xs, axis); }
  RawPtr slice(const RawPtr& x, int axis, int64_t start, int64_t end) override {
    return slice_impl(as_eigen(x), axis, start, end);
  }
  RawPtr gather(const RawPtr& x, int axis, const RawPtr& idx) override {
    return gather_impl(as_eigen(x), axis, as_eigen(idx));
  }

  RawPtr binary(BinaryOp op, const RawPtr& a, const RawPtr& b) override {
    return binary_impl(op, as_eigen(a), as_eigen(b));
  }
  RawPtr unary(UnaryOp op, const RawPtr& x) override { return unary_impl(op, as_eigen(x)); }
  RawPtr where(const RawPtr& cond, const RawPtr& a, const RawPtr& b) override {
    return where_impl(as_eigen(cond), as_eigen(a), as_eigen(b));
  }
  RawPtr reduce(ReduceOp op, const RawPtr& x, const std::vector<int>& axes) override {
    return reduce_impl(op, as_eigen(x), axes);
  }
  RawPtr softmax(const RawPtr& x, int axis, bool log) override { return softmax_impl(as_eigen(x), axis, log); }
  RawPtr bmm(const RawPtr& a, const RawPtr& b) override { return bmm_impl(as_eigen(a), as_eigen(b)); }
};

}  // namespace
}  // namespace dimattn::eigen

namespace dimattn::detail {
void register_eigen_backend() { register_backend(std::make_unique<eigen::EigenBackend>()); }
}  // namespace dimattn::detail
