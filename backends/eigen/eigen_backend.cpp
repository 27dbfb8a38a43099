// The Eigen backend: every Backend primitive on the CPU, over the strided raw
// tensor of eigen_raw.h. Contractions go through Eigen's GEMM; elementwise
// math runs Eigen array expressions over contiguous runs and a plain strided
// loop elsewhere. bfloat16 and float16 are stored as themselves and computed
// in float32, rounded (to nearest even) on store.
//
// The primitives live by family in eigen_creation.cpp, eigen_layout_ops.cpp,
// eigen_elementwise.cpp, eigen_reductions.cpp and eigen_matmul.cpp (declared
// in eigen_ops.h); this file is the Backend class that dispatches to them
// and registers it.
#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "adapters/cpu_flash_path.h"
#include "adapters/plan_cache.h"
#include "dimattn/ext/backend.h"
#include "dimattn/error.h"
#include "dimattn/registry.h"
#include "dimattn/internal/check.h"
#include "eigen_ops.h"
#include "eigen_strided.h"

namespace dimattn::eigen {
namespace {

class EigenBackend final : public Backend {
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
    DIMATTN_CHECK(static_cast<int64_t>(data.size()) == out->numel(), "eigen.from_host", "shape ", shape_str(shape), " has ",
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
    DIMATTN_CHECK(n >= 0, "eigen.arange", "n must be >= 0, got ", n);
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
  const KernelTable& attention_table() const override {
    static const KernelTable table = {detail::cpu_flash_entry(), reference_entry(DeviceType::cpu)};
    return table;
  }
  AttentionPlanPtr plan_attention(const AttentionCall& c, KernelUse use) override {
    return detail::plan_with_host_form(*this, c, use);
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

namespace dimattn::eigen {
namespace {
// After torch (priority 0): the default backend is torch when both are built.
const BuiltinBackend kRegistered(1, [] { return std::unique_ptr<Backend>(new EigenBackend); });
}  // namespace
}  // namespace dimattn::eigen
