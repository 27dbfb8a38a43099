#pragma once
// Dim: a named dimension with identity. Copies of one Dim compare equal; two
// Dims made separately never do, whatever their names and sizes.
//
// A Dim is static (a size) or dynamic: a Tensor of per-entry lengths over its
// own dims (e.g. [batch]). A dynamic Dim's extent is the largest length; raw
// tensors are laid out with that extent, and positions past an entry's length
// are padding that ops such as softmax and reduce mask out.
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace dimattn {

class Tensor;

class Dim {
 public:
  // A static dim. pre: size >= 0.
  Dim(std::string name, int64_t size);
  // A dynamic dim whose lengths are `lengths` (an integer tensor over its own
  // dims). pre: 0 <= every length; extent = max length (or `extent` if given,
  // which must be >= every length; lets a dim keep a fixed raw size).
  static Dim dynamic(std::string name, const Tensor& lengths,
                     std::optional<int64_t> extent = std::nullopt);

  const std::string& name() const;
  bool is_dynamic() const;
  int64_t extent() const;                    // static size, or the max length
  std::optional<int64_t> static_size() const;
  const Tensor& lengths() const;             // pre: is_dynamic()
  std::string repr() const;                  // "time[7]" or "time[<=7 over batch]"

  // The product dim of two static dims, as used to merge heads: the same
  // object each time for the same factors, so `heads * per_head` compares
  // equal to itself across calls.
  Dim operator*(const Dim& other) const;
  // The dim d with `factor * d == *this`: the original factor when *this was
  // made as such a product, else a new static dim, cached, so repeated calls
  // return the same Dim. Throws if the extent is not divisible.
  Dim divide_by(const Dim& factor) const;

  bool operator==(const Dim& o) const { return impl_ == o.impl_; }
  bool operator!=(const Dim& o) const { return impl_ != o.impl_; }
  // An order for containers; stable within one process run.
  bool operator<(const Dim& o) const { return impl_ < o.impl_; }

  struct Impl;

 private:
  explicit Dim(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<Impl> impl_;
};

using Dims = std::vector<Dim>;

// "(batch[3], time[<=7 over batch])"
std::string repr(const Dims& dims);
bool contains(const Dims& dims, const Dim& d);
int index_of(const Dims& dims, const Dim& d);  // -1 when absent
// The extents of dims, in order (the shape of a tensor over them).
std::vector<int64_t> extents(const Dims& dims);
// The product of their extents (elements of a tensor over them).
int64_t product(const Dims& dims);

}  // namespace dimattn
