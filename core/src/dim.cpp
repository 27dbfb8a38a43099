#include "dimattn/dim.h"

#include <algorithm>
#include <mutex>

#include "dimattn/error.h"
#include "dimattn/ext/backend.h"
#include "dimattn/tensor.h"
#include "dimattn/internal/check.h"

namespace dimattn {

struct Dim::Impl {
  std::string name;
  int64_t extent = 0;
  std::shared_ptr<const Tensor> lengths;  // set for dynamic dims
  // Made as left * right: weak, since the factor's cache holds the product.
  std::weak_ptr<Impl> left, right;
  std::mutex mu;  // guards the caches below
  std::vector<std::pair<std::weak_ptr<Impl>, Dim>> products;   // this * key
  std::vector<std::pair<std::weak_ptr<Impl>, Dim>> quotients;  // this / key
};

Dim::Dim(std::string name, int64_t size) : impl_(std::make_shared<Impl>()) {
  DIMATTN_CHECK(size >= 0, "Dim", "dim '", name, "' has negative size ", size);
  impl_->name = std::move(name);
  impl_->extent = size;
}

Dim Dim::dynamic(std::string name, const Tensor& lengths, std::optional<int64_t> extent) {
  DIMATTN_CHECK(lengths.dtype() == DType::int32 || lengths.dtype() == DType::int64, "Dim",
        "lengths of dynamic dim '", name, "' must be int32 or int64, got ", dtype_name(lengths.dtype()));
  for (const Dim& d : lengths.dims())
    DIMATTN_CHECK(d.static_size().has_value(), "Dim", "lengths of dynamic dim '", name,
          "' must be over static dims; got ", dimattn::repr(lengths.dims()));
  int64_t max_len = 0;
  for (double v : lengths.backend().to_host(lengths.raw())) {
    DIMATTN_CHECK(v >= 0, "Dim", "dynamic dim '", name, "' has a negative length ", static_cast<int64_t>(v),
          " in lengths over ", dimattn::repr(lengths.dims()));
    max_len = std::max(max_len, static_cast<int64_t>(v));
  }
  if (extent)
    DIMATTN_CHECK(*extent >= max_len, "Dim", "dynamic dim '", name, "' has extent ", *extent,
          " below its longest length ", max_len);
  Dim d(std::move(name), extent.value_or(max_len));
  d.impl_->lengths = std::make_shared<const Tensor>(lengths);
  return d;
}

const std::string& Dim::name() const { return impl_->name; }
bool Dim::is_dynamic() const { return impl_->lengths != nullptr; }
int64_t Dim::extent() const { return impl_->extent; }
std::optional<int64_t> Dim::static_size() const {
  if (is_dynamic()) return std::nullopt;
  return impl_->extent;
}

const Tensor& Dim::lengths() const {
  DIMATTN_CHECK(is_dynamic(), "Dim", "dim ", repr(), " is static and has no lengths");
  return *impl_->lengths;
}

std::string Dim::repr() const {
  if (!is_dynamic()) return impl_->name + "[" + std::to_string(impl_->extent) + "]";
  std::string over;
  for (const Dim& d : impl_->lengths->dims()) over += (over.empty() ? "" : ",") + d.name();
  return impl_->name + "[<=" + std::to_string(impl_->extent) + " over " + (over.empty() ? "()" : over) + "]";
}

namespace {
// Finds the cached Dim for `key` in a cache, dropping expired entries.
std::optional<Dim> lookup(std::vector<std::pair<std::weak_ptr<Dim::Impl>, Dim>>& cache,
                          const std::shared_ptr<Dim::Impl>& key) {
  std::erase_if(cache, [](const auto& e) { return e.first.expired(); });
  for (auto& [k, d] : cache)
    if (k.lock() == key) return d;
  return std::nullopt;
}
}  // namespace

Dim Dim::operator*(const Dim& other) const {
  DIMATTN_CHECK(!is_dynamic() && !other.is_dynamic(), "Dim", "cannot multiply dynamic dims ", repr(), " * ",
        other.repr(), "; merge_dims handles dynamic dims");
  std::lock_guard lock(impl_->mu);
  if (auto d = lookup(impl_->products, other.impl_)) return *d;
  Dim product(impl_->name + "*" + other.impl_->name, impl_->extent * other.impl_->extent);
  product.impl_->left = impl_;
  product.impl_->right = other.impl_;
  impl_->products.emplace_back(other.impl_, product);
  return product;
}

Dim Dim::divide_by(const Dim& factor) const {
  if (auto l = impl_->left.lock(); l == factor.impl_) {
    if (auto r = impl_->right.lock()) return Dim(r);
  }
  if (auto r = impl_->right.lock(); r == factor.impl_) {
    if (auto l = impl_->left.lock()) return Dim(l);
  }
  DIMATTN_CHECK(!is_dynamic() && !factor.is_dynamic(), "Dim", "cannot divide dynamic dims ", repr(), " / ",
        factor.repr());
  DIMATTN_CHECK(factor.extent() > 0 && impl_->extent % factor.extent() == 0, "Dim", "cannot split ", repr(),
        " into ", factor.repr(), " parts: ", impl_->extent, " is not divisible by ", factor.extent());
  std::lock_guard lock(impl_->mu);
  if (auto d = lookup(impl_->quotients, factor.impl_)) return *d;
  Dim q(impl_->name + "/" + factor.impl_->name, impl_->extent / factor.extent());
  impl_->quotients.emplace_back(factor.impl_, q);
  return q;
}

std::string repr(const Dims& dims) {
  std::string s = "(";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + dims[i].repr();
  return s + ")";
}

bool contains(const Dims& dims, const Dim& d) { return index_of(dims, d) >= 0; }

int index_of(const Dims& dims, const Dim& d) {
  for (size_t i = 0; i < dims.size(); ++i)
    if (dims[i] == d) return static_cast<int>(i);
  return -1;
}

std::vector<int64_t> extents(const Dims& dims) {
  std::vector<int64_t> s;
  for (const Dim& d : dims) s.push_back(d.extent());
  return s;
}

int64_t product(const Dims& dims) {
  int64_t n = 1;
  for (const Dim& d : dims) n *= d.extent();
  return n;
}

}  // namespace dimattn
