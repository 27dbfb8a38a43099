#include "dimattn/ext/layout.h"
#include "dimattn/internal/layout_probe.h"

#include <algorithm>
#include <cstdlib>
#include <iterator>
#include <optional>

namespace dimattn {

std::vector<int64_t> touched_elements(const ViewLayout& v) {
  int64_t n = 1;
  for (int64_t s : v.sizes) n *= s;
  std::vector<int64_t> out;
  if (n == 0) return out;
  out.reserve(static_cast<size_t>(n));
  std::vector<int64_t> idx(v.sizes.size(), 0);
  for (int64_t i = 0; i < n; ++i) {
    int64_t off = v.offset;
    for (size_t a = 0; a < idx.size(); ++a) off += idx[a] * v.strides[a];
    out.push_back(off);
    for (int a = static_cast<int>(idx.size()) - 1; a >= 0; --a) {
      if (++idx[a] < v.sizes[a]) break;
      idx[a] = 0;
    }
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

bool is_row_major_contiguous(const ViewLayout& v) {
  int64_t expected = 1;
  for (int a = static_cast<int>(v.sizes.size()) - 1; a >= 0; --a) {
    if (v.sizes[a] != 1 && v.strides[a] != expected) return false;
    expected *= v.sizes[a];
  }
  return true;
}

std::pair<int64_t, int64_t> element_span(std::span<const int64_t> sizes, std::span<const int64_t> strides,
                                         int64_t offset) {
  int64_t lo = offset, hi = offset;
  for (size_t a = 0; a < sizes.size(); ++a) {
    if (sizes[a] == 0) return {offset, offset - 1};
    const int64_t reach = (sizes[a] - 1) * strides[a];
    (reach < 0 ? lo : hi) += reach;
  }
  return {lo, hi};
}

bool has_zero_strides(const ViewLayout& v) {
  for (size_t a = 0; a < v.sizes.size(); ++a)
    if (v.sizes[a] > 1 && v.strides[a] == 0) return true;
  return false;
}

namespace {

bool last_unit(const ViewLayout& v) { return v.sizes.empty() || v.sizes.back() == 1 || v.strides.back() == 1; }

std::pair<int64_t, int64_t> span(const ViewLayout& v) { return element_span(v.sizes, v.strides, v.offset); }

int64_t numel(const ViewLayout& v) {
  int64_t n = 1;
  for (int64_t s : v.sizes) n *= s;
  return n;
}

// Two views with equal sizes and strides whose offsets differ by d touch a
// common element iff d = sum_a i_a * stride_a with |i_a| < size_a. Searched
// depth-first over the axes by decreasing |stride|, trying only the i that
// leave a remainder the smaller axes can still reach: one or two per axis for
// the layouts tensors have, so microseconds where enumerating the elements
// took milliseconds per call (4 096-element packed views: 1.6 ms). nullopt
// when the search would exceed its budget (strides that overlap heavily).
std::optional<bool> offset_reachable(int64_t d, const ViewLayout& v) {
  struct Axis {
    int64_t stride, size;
  };
  std::vector<Axis> axes;
  for (size_t i = 0; i < v.sizes.size(); ++i)
    if (v.sizes[i] > 1 && v.strides[i] != 0) axes.push_back({std::llabs(v.strides[i]), v.sizes[i]});
  std::sort(axes.begin(), axes.end(), [](const Axis& x, const Axis& y) { return x.stride > y.stride; });
  std::vector<int64_t> reach(axes.size() + 1, 0);  // of axes k.. together
  for (size_t k = axes.size(); k-- > 0;) reach[k] = reach[k + 1] + (axes[k].size - 1) * axes[k].stride;
  int64_t budget = 1 << 14;
  auto floor_div = [](int64_t x, int64_t y) { return x / y - ((x % y != 0) && ((x < 0) != (y < 0))); };
  auto search = [&](auto& self, size_t k, int64_t r) -> std::optional<bool> {
    if (std::llabs(r) > reach[k]) return false;
    if (k == axes.size()) return r == 0;
    if (--budget < 0) return std::nullopt;
    const Axis& ax = axes[k];
    const int64_t lo = std::max(-(ax.size - 1), -floor_div(reach[k + 1] - r, ax.stride));
    const int64_t hi = std::min(ax.size - 1, floor_div(r + reach[k + 1], ax.stride));
    for (int64_t i = lo; i <= hi; ++i) {
      const std::optional<bool> found = self(self, k + 1, r - i * ax.stride);
      if (!found || *found) return found;
    }
    return false;
  };
  return search(search, 0, d);
}

// Two views of one buffer that touch a common element. Exact for views with
// equal sizes and strides (the packed-buffer case) and for views of up to
// kExactLimit elements together; above, the same offset, or equal strides
// with offsets closer than one row, count as aliasing, and other overlapping
// spans as interleaved.
constexpr int64_t kExactLimit = 1 << 16;
bool may_alias(const ViewLayout& a, const ViewLayout& b) {
  if (a.storage != b.storage) return false;
  auto [a0, a1] = span(a);
  auto [b0, b1] = span(b);
  if (a1 < b0 || b1 < a0) return false;
  if (a.sizes == b.sizes && a.strides == b.strides)
    if (const std::optional<bool> hit = offset_reachable(b.offset - a.offset, a)) return *hit;
  if (numel(a) + numel(b) <= kExactLimit) {
    std::vector<int64_t> x = touched_elements(a), y = touched_elements(b), common;
    std::set_intersection(x.begin(), x.end(), y.begin(), y.end(), std::back_inserter(common));
    return !common.empty();
  }
  if (a.offset == b.offset) return true;
  // Interleaved heads of a packed buffer: same strides, rows of D elements
  // that start at different offsets within one row of the parent.
  if (a.strides == b.strides && !a.sizes.empty() && a.sizes.back() == b.sizes.back()) {
    const int64_t d = std::llabs(a.offset - b.offset);
    return d < a.sizes.back();
  }
  return false;  // spans overlap but views are strided differently: treated as interleaved
}

}  // namespace

LayoutClass classify_layout(const ViewLayout& q, const ViewLayout& k, const ViewLayout& v) {
  for (const ViewLayout* x : {&q, &k, &v})
    if (!last_unit(*x) || has_zero_strides(*x)) return LayoutClass::strided;
  if (may_alias(q, k) || may_alias(q, v) || may_alias(k, v)) return LayoutClass::strided;
  if (q.storage == k.storage && k.storage == v.storage) return LayoutClass::packed_qkv;
  if (k.storage == v.storage) return LayoutClass::packed_kv;
  for (const ViewLayout* x : {&q, &k, &v})
    if (!is_row_major_contiguous(*x)) return LayoutClass::permuted;
  return LayoutClass::separate;
}

GateResult check_layout(const ViewLayout& v, const LayoutRequirements& req, const char* which) {
  if (req.last_dim_unit_stride && !last_unit(v))
    return GateResult::fail(std::string(which) + " has last-dim stride " + std::to_string(v.strides.back()) +
                            ", the kernel needs 1");
  if (!req.zero_strides_ok && has_zero_strides(v))
    return GateResult::fail(std::string(which) + " has a broadcast (stride-0) axis");
  for (size_t a = 0; a + 1 < v.strides.size(); ++a)
    if (v.sizes[a] > 1 && v.strides[a] % req.stride_multiple != 0)
      return GateResult::fail(std::string(which) + " stride " + std::to_string(v.strides[a]) + " of axis " +
                              std::to_string(a) + " is not a multiple of " + std::to_string(req.stride_multiple));
  if (v.data_address % static_cast<uintptr_t>(req.address_alignment) != 0)
    return GateResult::fail(std::string(which) + " data is not aligned to " + std::to_string(req.address_alignment) +
                            " bytes");
  return GateResult::pass();
}

}  // namespace dimattn
