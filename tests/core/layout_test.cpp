// Layout detection from strides (backends/src/layout.cpp).
#include <gtest/gtest.h>

#include <algorithm>
#include <iterator>

#include "dimattn/ext/layout.h"
#include "dimattn/internal/layout_probe.h"

namespace dimattn {
namespace {

int storage_a, storage_b, storage_c;  // identities of three buffers

ViewLayout view(std::vector<int64_t> sizes, std::vector<int64_t> strides, const void* storage, int64_t offset = 0) {
  return {std::move(sizes), std::move(strides), storage, offset, 4, 0};
}

// Row-major strides of `sizes`.
std::vector<int64_t> rm(const std::vector<int64_t>& sizes) {
  std::vector<int64_t> s(sizes.size(), 1);
  for (int i = static_cast<int>(sizes.size()) - 2; i >= 0; --i) s[i] = s[i + 1] * sizes[i + 1];
  return s;
}

TEST(Layout, SeparateContiguous) {
  auto q = view({2, 4, 8, 16}, rm({2, 4, 8, 16}), &storage_a), k = view({2, 4, 8, 16}, rm({2, 4, 8, 16}), &storage_b),
       v = view({2, 4, 8, 16}, rm({2, 4, 8, 16}), &storage_c);
  EXPECT_EQ(classify_layout(q, k, v), LayoutClass::separate);
}

TEST(Layout, PermutedViewOfBTHD) {
  // [B, T, H, D] memory read as [B, H, T, D].
  auto q = view({2, 4, 8, 16}, {8 * 4 * 16, 16, 4 * 16, 1}, &storage_a);
  auto k = view({2, 4, 8, 16}, rm({2, 4, 8, 16}), &storage_b), v = view({2, 4, 8, 16}, rm({2, 4, 8, 16}), &storage_c);
  EXPECT_EQ(classify_layout(q, k, v), LayoutClass::permuted);
}

TEST(Layout, FusedGqaBufferIsPackedQkv) {
  // One [T, B, Hq + 2*Hkv, D] buffer, Hq = 16, Hkv = 1, read as [B, H, T, D].
  const int64_t T = 32, B = 1, D = 64, Hall = 18;
  auto q = view({B, 16, T, D}, {Hall * D, D, B * Hall * D, 1}, &storage_a, 0);
  auto k = view({B, 1, T, D}, {Hall * D, D, B * Hall * D, 1}, &storage_a, 16 * D);
  auto v = view({B, 1, T, D}, {Hall * D, D, B * Hall * D, 1}, &storage_a, 17 * D);
  EXPECT_EQ(classify_layout(q, k, v), LayoutClass::packed_qkv);
  // The views touch disjoint elements.
  auto tq = touched_elements(q), tk = touched_elements(k);
  std::vector<int64_t> common;
  std::set_intersection(tq.begin(), tq.end(), tk.begin(), tk.end(), std::back_inserter(common));
  EXPECT_TRUE(common.empty());
}

TEST(Layout, PackedKv) {
  auto q = view({1, 2, 8, 4}, rm({1, 2, 8, 4}), &storage_a);
  auto k = view({1, 2, 8, 4}, {2 * 8 * 8, 8 * 8, 8, 1}, &storage_b, 0);
  auto v = view({1, 2, 8, 4}, {2 * 8 * 8, 8 * 8, 8, 1}, &storage_b, 4);
  EXPECT_EQ(classify_layout(q, k, v), LayoutClass::packed_kv);
}

TEST(Layout, AliasingOrBroadcastOrStridedLastDimIsStrided) {
  auto a = view({1, 2, 8, 4}, rm({1, 2, 8, 4}), &storage_a);
  EXPECT_EQ(classify_layout(a, a, a), LayoutClass::strided) << "q, k and v are the same memory";
  auto bcast = view({1, 2, 8, 4}, {0, 0, 4, 1}, &storage_b);
  EXPECT_EQ(classify_layout(a, bcast, view({1, 2, 8, 4}, rm({1, 2, 8, 4}), &storage_c)), LayoutClass::strided);
  auto col = view({1, 2, 8, 4}, {64, 32, 1, 8}, &storage_b);
  EXPECT_EQ(classify_layout(a, col, view({1, 2, 8, 4}, rm({1, 2, 8, 4}), &storage_c)), LayoutClass::strided);
}

TEST(Layout, RequirementsAreCheckedAsData) {
  auto col = view({1, 2, 8, 4}, {64, 32, 1, 8}, &storage_a);
  GateResult g = check_layout(col, {.last_dim_unit_stride = true}, "query");
  EXPECT_FALSE(g.ok);
  EXPECT_NE(g.reason.find("query has last-dim stride 8"), std::string::npos) << g.reason;
  auto odd = view({1, 2, 8, 4}, {2 * 8 * 6, 8 * 6, 6, 1}, &storage_a);
  EXPECT_FALSE(check_layout(odd, {.stride_multiple = 4}, "keys").ok);
  EXPECT_TRUE(check_layout(odd, {.stride_multiple = 2}, "keys").ok);
  ViewLayout misaligned = odd;
  misaligned.data_address = 4;
  EXPECT_FALSE(check_layout(misaligned, {.address_alignment = 16}, "values").ok);
}

}  // namespace
}  // namespace dimattn
