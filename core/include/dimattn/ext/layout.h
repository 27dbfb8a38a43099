#pragma once
// Memory layouts of q, k and v, detected from sizes, strides, storage and
// offsets — never taken from a name the caller gives (DESIGN.md §5). A
// mislabelled packed buffer once gave a max error of 6.19 where 0.002 was
// right; here a kernel reads the strides it is given, and its requirements on
// them are data checked before it runs.
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "dimattn/selection.h"

namespace dimattn {

// One view in a kernel's order ([B, H, T, D]); sizes and strides in elements.
struct ViewLayout {
  std::vector<int64_t> sizes, strides;
  const void* storage = nullptr;  // identity of the underlying buffer
  int64_t offset = 0;             // of the first element, in elements
  int64_t element_size = 4;       // bytes
  uintptr_t data_address = 0;     // of the first element
};

bool is_row_major_contiguous(const ViewLayout& v);
// The element range [first, last] a view can touch ([offset, offset - 1] when empty).
std::pair<int64_t, int64_t> element_span(std::span<const int64_t> sizes, std::span<const int64_t> strides,
                                         int64_t offset);
bool has_zero_strides(const ViewLayout& v);  // a broadcast axis of size > 1

LayoutClass classify_layout(const ViewLayout& q, const ViewLayout& k, const ViewLayout& v);

// What a kernel needs of each view, as data.
struct LayoutRequirements {
  bool last_dim_unit_stride = true;
  int64_t stride_multiple = 1;    // every stride but the last, in elements
  int64_t address_alignment = 1;  // bytes, of the first element
  bool zero_strides_ok = true;    // broadcast (stride-0) axes accepted as they are
};

// ok, or why the view needs a copy first.
GateResult check_layout(const ViewLayout& v, const LayoutRequirements& req, const char* which);

}  // namespace dimattn
