// Fuzzes layout detection (backends/include/dimattn/layout.h) against a
// brute-force check of which elements each view touches.
//
// Input → three views (q, k, v) with random ranks, sizes, strides (zero and
// negative included), offsets and storage (shared or not). Checked:
// - touched_elements equals an independent enumeration of every index;
// - is_row_major_contiguous / has_zero_strides equal their definitions;
// - classify_layout equals the class docs/layouts.md defines, with aliasing
//   decided by brute force. docs/layouts.md: exact for views of up to 65 536
//   elements together; above, a rule for the packed-buffer pattern, and only
//   that pattern is compared there (see below and docs/reliability.md for
//   where the rule is known to be inexact).
// - classification is symmetric in k and v where the definition is, and
//   deterministic.
#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <iterator>
#include <vector>

#include "dimattn/ext/layout.h"
#include "dimattn/internal/layout_probe.h"

using dimattn::LayoutClass;
using dimattn::ViewLayout;

namespace {

[[noreturn]] void fail(const char* what, const ViewLayout* views, int n) {
  std::fprintf(stderr, "fuzz_layout: %s\n", what);
  for (int i = 0; i < n; ++i) {
    const ViewLayout& v = views[i];
    std::fprintf(stderr, "  view %d: storage=%p offset=%lld sizes=[", i, v.storage, static_cast<long long>(v.offset));
    for (int64_t s : v.sizes) std::fprintf(stderr, " %lld", static_cast<long long>(s));
    std::fprintf(stderr, " ] strides=[");
    for (int64_t s : v.strides) std::fprintf(stderr, " %lld", static_cast<long long>(s));
    std::fprintf(stderr, " ]\n");
  }
  std::abort();
}

int64_t numel(const ViewLayout& v) {
  int64_t n = 1;
  for (int64_t s : v.sizes) n *= s;
  return n;
}

// Every element offset the view touches, by recursion over axes: an
// enumeration written independently of touched_elements. Sorted, unique.
void enumerate(const ViewLayout& v, size_t axis, int64_t base, std::vector<int64_t>& out) {
  if (axis == v.sizes.size()) {
    out.push_back(base);
    return;
  }
  for (int64_t i = 0; i < v.sizes[axis]; ++i) enumerate(v, axis + 1, base + i * v.strides[axis], out);
}

std::vector<int64_t> brute(const ViewLayout& v) {
  std::vector<int64_t> s;
  if (numel(v) > 0) enumerate(v, 0, v.offset, s);
  std::sort(s.begin(), s.end());
  s.erase(std::unique(s.begin(), s.end()), s.end());
  return s;
}

bool intersects(const std::vector<int64_t>& a, const std::vector<int64_t>& b) {
  size_t i = 0, j = 0;
  while (i < a.size() && j < b.size()) {
    if (a[i] == b[j]) return true;
    a[i] < b[j] ? ++i : ++j;
  }
  return false;
}

// Row-major contiguity by definition: the view's elements, in index order,
// are offset, offset+1, ... (axes of size 1 have no stride that matters).
bool contiguous_by_definition(const ViewLayout& v) {
  int64_t expected = 1;
  for (int a = static_cast<int>(v.sizes.size()) - 1; a >= 0; --a) {
    if (v.sizes[a] == 1) continue;
    if (v.strides[a] != expected) return false;
    expected *= v.sizes[a];
  }
  return true;
}

bool last_unit(const ViewLayout& v) { return v.sizes.empty() || v.sizes.back() == 1 || v.strides.back() == 1; }
bool zero_stride_axis(const ViewLayout& v) {
  for (size_t a = 0; a < v.sizes.size(); ++a)
    if (v.sizes[a] > 1 && v.strides[a] == 0) return true;
  return false;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  static int buffers[3];
  ViewLayout views[3];
  // Keep element offsets far from int64 overflow and brute force cheap:
  // at most 2^16 elements per view (two such views pass the exact limit of
  // 2^16 together), strides within ±4096; large views in 1 input of 32.
  const bool large = in.ConsumeIntegralInRange<int>(0, 31) == 0;
  for (ViewLayout& v : views) {
    const int rank = in.ConsumeIntegralInRange<int>(0, 4);
    int64_t n = 1;
    for (int a = 0; a < rank; ++a) {
      const int64_t max_size = large ? 64 : 6;
      int64_t s = in.ConsumeIntegralInRange<int64_t>(0, max_size);
      if (n * std::max<int64_t>(s, 1) > (int64_t{1} << 16)) s = 1;
      n *= std::max<int64_t>(s, 1);
      v.sizes.push_back(s);
    }
    // Strides: mostly the packed patterns real tensors have (row-major over
    // a parent buffer, permuted), sometimes anything, zero and negative included.
    const int mode = in.ConsumeIntegralInRange<int>(0, 3);
    if (mode <= 1) {
      // Row-major over a parent whose rows are `row` elements long (row >= D).
      int64_t stride = 1;
      const int64_t pad = in.ConsumeIntegralInRange<int64_t>(0, 8);
      for (int a = rank - 1; a >= 0; --a) {
        v.strides.insert(v.strides.begin(), stride);
        stride *= std::max<int64_t>(v.sizes[a], 1) + (a == rank - 1 ? pad : 0);
      }
      if (mode == 1 && rank >= 2) {  // a permuted view: swap two axes' strides
        const int a = in.ConsumeIntegralInRange<int>(0, rank - 2);
        std::swap(v.strides[a], v.strides[a + 1]);
      }
    } else {
      for (int a = 0; a < rank; ++a) v.strides.push_back(in.ConsumeIntegralInRange<int64_t>(mode == 2 ? 0 : -8, 4096));
    }
    v.offset = in.ConsumeIntegralInRange<int64_t>(0, 1 << 16);
    v.storage = &buffers[in.ConsumeIntegralInRange<int>(0, 2)];
    v.element_size = 4;
    v.data_address = 0x1000 + static_cast<uintptr_t>(v.offset) * 4;
  }
  // Often: k and v (and q) in one buffer, one packed row apart.
  if (in.ConsumeBool()) {
    views[1].storage = views[2].storage = views[0].storage;
    if (in.ConsumeBool()) {
      views[1].sizes = views[2].sizes = views[0].sizes;
      views[1].strides = views[2].strides = views[0].strides;
      const int64_t step = in.ConsumeIntegralInRange<int64_t>(0, 256);
      views[1].offset = views[0].offset + step;
      views[2].offset = views[0].offset + step * in.ConsumeIntegralInRange<int64_t>(0, 3);
    }
  }

  std::vector<int64_t> touched[3];
  for (int i = 0; i < 3; ++i) {
    const ViewLayout& v = views[i];
    touched[i] = brute(v);
    const std::vector<int64_t> t = dimattn::touched_elements(v);
    if (t != touched[i])
      fail("touched_elements differs from the brute-force enumeration", &v, 1);
    if (dimattn::is_row_major_contiguous(v) != contiguous_by_definition(v))
      fail("is_row_major_contiguous differs from its definition", &v, 1);
    if (dimattn::has_zero_strides(v) != zero_stride_axis(v)) fail("has_zero_strides differs from its definition", &v, 1);
  }

  const ViewLayout &q = views[0], &k = views[1], &v = views[2];
  auto alias = [&](int a, int b) {
    return views[a].storage == views[b].storage && intersects(touched[a], touched[b]);
  };
  const bool any_alias = alias(0, 1) || alias(0, 2) || alias(1, 2);

  LayoutClass expected;
  bool exact = numel(q) + numel(k) <= (1 << 16) && numel(q) + numel(v) <= (1 << 16) && numel(k) + numel(v) <= (1 << 16);
  if (!last_unit(q) || !last_unit(k) || !last_unit(v) || zero_stride_axis(q) || zero_stride_axis(k) ||
      zero_stride_axis(v)) {
    expected = LayoutClass::strided;
    exact = true;  // decided before any aliasing question
  } else if (any_alias) {
    expected = LayoutClass::strided;
  } else if (q.storage == k.storage && k.storage == v.storage) {
    expected = LayoutClass::packed_qkv;
  } else if (k.storage == v.storage) {
    expected = LayoutClass::packed_kv;
  } else if (!contiguous_by_definition(q) || !contiguous_by_definition(k) || !contiguous_by_definition(v)) {
    expected = LayoutClass::permuted;
  } else {
    expected = LayoutClass::separate;
  }

  const LayoutClass got = dimattn::classify_layout(q, k, v);
  if (!large) {  // (each call enumerates the views again: only for small ones)
    if (got != dimattn::classify_layout(q, k, v)) fail("classify_layout is not deterministic", views, 3);
    // k and v play symmetric roles in every rule.
    if (dimattn::classify_layout(q, v, k) != got)
      fail("classify_layout(q, k, v) != classify_layout(q, v, k)", views, 3);
  }

  if (!exact) {
    // Beyond the exact limit the rule is documented for the packed-buffer
    // pattern: views of one buffer with equal sizes and strides that are
    // disjoint, start at the same element, or start within one row of each
    // other. Pairs outside it (overlapping at a distance of a row or more, or
    // overlapping with different strides) are where the rule is known to be
    // inexact (docs/reliability.md); they are not compared.
    auto in_pattern = [&](int a, int b) {
      const ViewLayout &x = views[a], &y = views[b];
      if (x.storage != y.storage) return true;
      if (x.sizes != y.sizes || x.strides != y.strides || numel(x) == 0) return false;
      const int64_t row = x.sizes.empty() ? 1 : x.sizes.back();
      return !intersects(touched[a], touched[b]) || std::llabs(x.offset - y.offset) < row;
    };
    if (!(in_pattern(0, 1) && in_pattern(0, 2) && in_pattern(1, 2))) return 0;
  }
  if (got != expected) {
    char msg[160];
    std::snprintf(msg, sizeof msg, "classify_layout gave %s, the definition %s (exact regime: %d)",
                  dimattn::layout_name(got), dimattn::layout_name(expected), exact);
    fail(msg, views, 3);
  }
  return 0;
}
