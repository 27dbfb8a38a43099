#pragma once
// Probes of a view's memory for tests and fuzzing (tests/core/layout_test.cpp,
// tests/fuzz/fuzz_layout.cpp). Internal: not installed.
#include <cstdint>
#include <vector>

#include "dimattn/ext/layout.h"

namespace dimattn {

// Element offsets (relative to storage start) that the view touches, sorted
// and unique. Cost: the view's element count.
std::vector<int64_t> touched_elements(const ViewLayout& v);

}  // namespace dimattn
