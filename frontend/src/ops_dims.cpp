// Ops that relabel, merge, split, add, remove, join, cut or pick along dims.
#include "op_util.h"
#include "dimattn/internal/check.h"

namespace dimattn {
using namespace detail;

namespace {

Tensor with_raw(const Tensor& like, Dims dims, RawPtr raw) {
  return Tensor(std::move(dims), like.dtype(), like.device(), std::move(raw), &like.backend());
}

}  // namespace

Tensor replace_dim(const Tensor& x, const Dim& old_dim, const Dim& new_dim) {
  check_has("replace_dim", x, old_dim, "dim");
  if (old_dim == new_dim) return x;
  DIMATTN_CHECK(!x.has(new_dim), "replace_dim", "new dim ", new_dim.repr(), " is already in ", repr(x.dims()));
  DIMATTN_CHECK(old_dim.extent() == new_dim.extent(), "replace_dim", "extents differ: ", old_dim.repr(), " vs ",
        new_dim.repr());
  Dims dims = x.dims();
  dims[x.axis_of(old_dim)] = new_dim;
  return with_raw(x, std::move(dims), x.raw());
}

std::pair<Tensor, Dim> merge_dims(const Tensor& x, const Dims& dims, const std::optional<Dim>& out) {
  DIMATTN_CHECK(!dims.empty(), "merge_dims", "needs at least one dim to merge");
  check_unique("merge_dims", dims);
  std::string name;
  for (const Dim& d : dims) {
    check_has("merge_dims", x, d, "dim");
    name += (name.empty() ? "" : "*") + d.name();
  }
  // Merged padding positions stay in the data; the merged dim is static.
  Dim merged = out.value_or(Dim(name, product(dims)));
  DIMATTN_CHECK(merged.extent() == product(dims), "merge_dims", "out dim ", merged.repr(), " does not have the extent ",
        product(dims), " of ", repr(dims));
  Dims rest = without(x.dims(), dims);
  DIMATTN_CHECK(!contains(rest, merged), "merge_dims", "out dim ", merged.repr(), " is already in ", repr(x.dims()));
  Dims order = rest;
  order.insert(order.end(), dims.begin(), dims.end());
  Shape shape = extents(rest);
  shape.push_back(merged.extent());
  rest.push_back(merged);
  RawPtr raw = x.backend().reshape(raw_in_order("merge_dims", x, order, false), shape);
  return {with_raw(x, rest, raw), merged};
}

Tensor split_dims(const Tensor& x, const Dim& axis, const Dims& dims) {
  check_has("split_dims", x, axis, "axis");
  check_unique("split_dims", dims);
  DIMATTN_CHECK(product(dims) == axis.extent(), "split_dims", "cannot split ", axis.repr(), " into ", repr(dims),
        ": extents multiply to ", product(dims));
  Dims out;
  for (const Dim& d : x.dims()) {
    if (d == axis) {
      out.insert(out.end(), dims.begin(), dims.end());
    } else {
      DIMATTN_CHECK(!contains(dims, d), "split_dims", "dim ", d.repr(), " is already in ", repr(x.dims()));
      out.push_back(d);
    }
  }
  return with_raw(x, out, x.backend().reshape(x.raw(), extents(out)));
}

Tensor expand_dim(const Tensor& x, const Dim& dim) {
  DIMATTN_CHECK(!x.has(dim), "expand_dim", "dim ", dim.repr(), " is already in ", repr(x.dims()));
  Dims out = {dim};
  out.insert(out.end(), x.dims().begin(), x.dims().end());
  return align(x, out);
}

Tensor squeeze(const Tensor& x, const Dim& dim) {
  check_has("squeeze", x, dim, "dim");
  DIMATTN_CHECK(dim.extent() == 1, "squeeze", "dim ", dim.repr(), " has extent ", dim.extent(), ", not 1");
  Dims out = without(x.dims(), {dim});
  return with_raw(x, out, x.backend().reshape(x.raw(), extents(out)));
}

std::pair<Tensor, Dim> concat(const std::vector<std::pair<Tensor, Dim>>& parts, const std::optional<Dim>& out_dim) {
  DIMATTN_CHECK(!parts.empty(), "concat", "needs at least one part");
  const Tensor& first = parts.front().first;
  const Dims others = without(first.dims(), {parts.front().second});
  std::vector<RawPtr> raws;
  std::string name;
  int64_t total_extent = 0;
  bool any_dynamic = false;
  for (const auto& [t, d] : parts) {
    common_backend("concat", {&first, &t});
    check_same_dtype("concat", {&first, &t});
    check_has("concat", t, d, "concat dim");
    Dims rest = without(t.dims(), {d});
    DIMATTN_CHECK(rest.size() == others.size() && without(rest, others).empty(), "concat",
          "parts must share every dim but the concat dim; ", repr(t.dims()), " vs ", repr(first.dims()));
    Dims order = others;
    order.push_back(d);
    raws.push_back(raw_in_order("concat", t, order, false));
    name += (name.empty() ? "" : "+") + d.name();
    total_extent += d.extent();
    any_dynamic = any_dynamic || d.is_dynamic();
  }
  Backend& be = first.backend();
  const int axis = static_cast<int>(others.size());
  RawPtr joined = be.concat(raws, axis);
  if (!any_dynamic) {
    Dim out = out_dim.value_or(Dim(name, total_extent));
    DIMATTN_CHECK(out.extent() == total_extent, "concat", "out dim ", out.repr(), " does not have the extent ",
          total_extent, " of the parts");
    Dims dims = others;
    dims.push_back(out);
    return {with_raw(first, dims, joined), out};
  }
  // Dynamic parts: entry b of the result holds the valid part of each input in
  // turn. Gather from the plain concatenation with per-entry indices.
  Dims jdims = others;
  Dim raw_axis(name + "_raw", total_extent);
  jdims.push_back(raw_axis);
  Tensor plain = with_raw(first, jdims, joined);
  const TensorOptions int_opts = options_like(first, DType::int64);
  auto length_of = [&](const Dim& d) {
    return d.is_dynamic() ? to_device(to_backend(cast(d.lengths(), DType::int64), be.name()), first.device())
                          : full({}, static_cast<double>(d.extent()), int_opts);
  };
  Tensor total_len = full({}, 0.0, int_opts);
  for (const auto& part : parts) total_len = add(total_len, length_of(part.second));
  Dim out = out_dim.value_or(Dim::dynamic(name, total_len));
  DIMATTN_CHECK(out.is_dynamic() || out.extent() == total_extent, "concat", "out dim ", out.repr(),
        " does not fit the parts");
  Tensor j = range_over_dim(out, int_opts);
  Tensor idx = j;  // part 0: offset 0, start 0
  Tensor offset = length_of(parts.front().second);
  int64_t start = parts.front().second.extent();
  for (size_t p = 1; p < parts.size(); ++p) {
    Tensor src = add(sub(j, offset), full({}, static_cast<double>(start), int_opts));
    idx = where(compare(j, Compare::ge, offset), src, idx);
    offset = add(offset, length_of(parts[p].second));
    start += parts[p].second.extent();
  }
  idx = minimum(idx, full({}, static_cast<double>(total_extent - 1), int_opts));
  Tensor gathered = gather(plain, raw_axis, idx);
  return {where(sequence_mask(out, options_like(first)), gathered, 0.0), out};
}

std::pair<Tensor, Dim> slice(const Tensor& x, const Dim& axis, int64_t start, int64_t end,
                             const std::optional<Dim>& out_dim) {
  check_has("slice", x, axis, "axis");
  DIMATTN_CHECK(0 <= start && start <= end && end <= axis.extent(), "slice", "range [", start, ", ", end,
        ") is outside ", axis.repr());
  Dim out = out_dim.value_or(Dim(axis.name() + "[" + std::to_string(start) + ":" + std::to_string(end) + "]",
                                 end - start));
  if (axis.is_dynamic() && !out_dim)
    out = Dim::dynamic(out.name(), window_lengths(axis.lengths(), start, end - start), end - start);
  DIMATTN_CHECK(out.extent() == end - start, "slice", "out dim ", out.repr(), " does not have the extent ", end - start);
  Dims dims = x.dims();
  dims[x.axis_of(axis)] = out;
  return {with_raw(x, dims, x.backend().slice(x.raw(), x.axis_of(axis), start, end)), out};
}

Tensor gather(const Tensor& x, const Dim& axis, const Tensor& indices) {
  common_backend("gather", {&x, &indices});
  check_has("gather", x, axis, "axis");
  DIMATTN_CHECK(indices.dtype() == DType::int32 || indices.dtype() == DType::int64, "gather",
        "indices must be int32 or int64, got ", indices.repr());
  DIMATTN_CHECK(!indices.has(axis), "gather", "indices ", repr(indices.dims()), " must not have the gathered axis ",
        axis.repr());
  Dims out = without(x.dims(), {axis});
  out = union_dims(out, indices.dims());
  Dims x_order = out;
  x_order.push_back(axis);
  Backend& be = x.backend();
  RawPtr xr = raw_in_order("gather", x, x_order, true);
  Shape idx_shape = extents(out);
  idx_shape.push_back(1);
  RawPtr ir = be.reshape(raw_in_order("gather", cast(indices, DType::int64), out, true), idx_shape);
  RawPtr r = be.reshape(be.gather(xr, static_cast<int>(out.size()), ir), extents(out));
  return with_raw(x, out, r);
}

}  // namespace dimattn
