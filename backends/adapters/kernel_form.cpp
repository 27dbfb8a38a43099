#include "adapters/kernel_form.h"

#include <algorithm>
#include <functional>
#include <tuple>

#include "dimattn/ext/layout.h"
#include "dimattn/internal/check.h"
#include "dimattn/internal/counters.h"

namespace dimattn::detail {

Dims join(std::initializer_list<Dims> parts) {
  Dims out;
  for (const Dims& p : parts) out.insert(out.end(), p.begin(), p.end());
  return out;
}

namespace {

constexpr const char* kOp = "dot_attention";

HostView host(Backend& be, const RawPtr& x) {
  std::optional<HostView> v = be.host_view(x);
  DIMATTN_CHECK(v.has_value(), kOp, "backend '", be.name(), "' does not expose host memory for cpu_flash");
  return *v;
}

// An aligned input reshaped to `shape`: a view where strides allow, with a
// unit last stride (kernels load rows as vectors); each copy is counted. The
// form tells without asking the backend when it is the view as it is.
RawPtr kernel_view(Backend& be, const MemoryView& mem, const RawPtr& aligned, const OperandForm& f, const Shape& shape) {
  if (f.sizes == shape && (shape.back() <= 1 || f.strides.back() == 1)) return aligned;  // the common case
  const HostView before = mem(aligned);
  if (before.sizes == shape && (shape.back() <= 1 || before.strides.back() == 1)) return aligned;
  RawPtr r = be.reshape(aligned, shape);
  const HostView after = mem(r);
  if (after.data != before.data) count_layout_copy();
  if (!after.strides.empty() && after.sizes.back() > 1 && after.strides.back() != 1) {
    r = be.contiguous(r);
    count_layout_copy();
  }
  return r;
}

// The dims of one operand in the kernel's order, as consecutive lists.
using Order = std::initializer_list<std::span<const Dim>>;
std::span<const Dim> one(const Dim& d) { return {&d, 1}; }

OperandForm operand_form(const Tensor& x, Order order, const OperandMemory& m) {
  OperandForm f;
  bool in_order = true, lacks = false;
  for (std::span<const Dim> part : order)
    for (const Dim& d : part) {
      const int a = x.axis_of(d);
      const int64_t n = d.extent();
      f.sizes.push_back(n);
      f.ones.push_back(a >= 0 ? n : 1);
      f.strides.push_back(a < 0 || n == 1 ? 0 : m.strides[static_cast<size_t>(a)]);
      if (a >= 0) {
        in_order = in_order && a == static_cast<int>(f.perm.size());
        f.perm.push_back(a);
      } else {
        lacks = true;
      }
    }
  DIMATTN_CHECK(f.perm.size() == x.dims().size(), kOp, "internal error: a dim of ", repr(x.dims()),
                " has no role in the kernel form");
  if (in_order) f.perm.clear();
  if (!lacks) f.ones.clear();
  return f;
}

// What selection classifies: the aligned views' layouts.
LayoutClass form_layout_class(const KernelForm& f, const OperandMemory (&m)[3]) {
  const OperandForm* forms[3] = {&f.q, &f.k, &f.v};
  ViewLayout views[3];
  for (int i = 0; i < 3; ++i)
    views[i] = ViewLayout{forms[i]->sizes, forms[i]->strides, m[i].storage, m[i].offset, m[i].element_size,
                          static_cast<uintptr_t>(m[i].offset * m[i].element_size)};
  if (m[0].storage && m[1].storage && m[2].storage) return classify_layout(views[0], views[1], views[2]);
  // Host views carry addresses, not storages: one buffer is one address
  // range. Offsets are measured from the lowest address so that
  // classify_layout sees views of one buffer as such; views that can touch
  // each other's elements share storage, others do not.
  const int64_t base = std::min({m[0].offset, m[1].offset, m[2].offset});
  for (ViewLayout& x : views) x.offset -= base;
  auto span_end = [](const ViewLayout& x) {
    int64_t hi = x.offset;
    for (size_t a = 0; a < x.sizes.size(); ++a) hi += (x.sizes[a] - 1) * x.strides[a];
    return hi;
  };
  static const int kStorage[3] = {0, 1, 2};
  for (int i = 0; i < 3; ++i) views[i].storage = &kStorage[i];
  for (int i = 0; i < 3; ++i)
    for (int j = 0; j < i; ++j)
      if (views[i].offset <= span_end(views[j]) && views[j].offset <= span_end(views[i]))
        views[i].storage = views[j].storage;
  return classify_layout(views[0], views[1], views[2]);
}

RawPtr aligned_input(Backend& be, const Tensor& x, const OperandForm& f) {
  RawPtr raw = x.raw();
  if (!f.perm.empty()) raw = be.permute(raw, f.perm);
  if (!f.ones.empty()) raw = be.expand(be.reshape(raw, f.ones), f.sizes);
  return raw;
}

}  // namespace

kernels::ElementStrides strides4(const HostView& v) {
  return {v.strides[0], v.strides[1], v.strides[2], v.sizes[3] > 1 ? v.strides[3] : 1};
}

kernels::RowBounds row_bounds_of(const std::optional<AttentionWindow>& w) {
  return w ? kernels::RowBounds{w->left.value_or(-1), w->right.value_or(-1)} : kernels::RowBounds{};
}

kernels::ElementType kernel_element_type(DType d) {
  switch (d) {
    case DType::float32: return kernels::ElementType::float32;
    case DType::float64: return kernels::ElementType::float64;
    case DType::bfloat16: return kernels::ElementType::bfloat16;
    case DType::float16: return kernels::ElementType::float16;
    default: fail(kOp, "the fused attention kernels do not take ", dtype_name(d));
  }
}

MemoryView host_memory(Backend& be) {
  return [&be](const RawPtr& x) { return host(be, x); };
}

namespace {

// Where each flat (b, h) index (row-major over per_head_dims(c)) lands in a
// tensor over some of those dims, from each dim's stride there (0 where the
// tensor lacks it).
std::vector<int64_t> per_head_offsets(const AttentionCall& c, const std::function<int64_t(const Dim&)>& stride_of) {
  const Dims flat = per_head_dims(c);
  const int64_t n = product(flat);
  std::vector<int64_t> offsets(static_cast<size_t>(n), 0);
  int64_t inner = 1;
  for (size_t a = flat.size(); a-- > 0;) {
    const int64_t extent = flat[a].extent(), stride = stride_of(flat[a]);
    if (stride != 0)
      for (int64_t x = 0; x < n; ++x) offsets[static_cast<size_t>(x)] += (x / inner) % extent * stride;
    inner *= extent;
  }
  return offsets;
}

// `t` (over a subset of the call's per-head dims and its query and kv
// positions; `v` is its memory) as the kernels' planes: where each (b, h)
// plane starts (into `offsets`, which the result points at), from its
// strides, and its row and column strides.
kernels::ScorePlanes score_planes(const AttentionCall& c, const Tensor& t, const HostView& v,
                                  std::vector<int64_t>& offsets) {
  auto stride_of = [&](const Dim& d) {
    const int a = t.axis_of(d);
    return a < 0 || d.extent() == 1 ? int64_t{0} : v.strides[static_cast<size_t>(a)];
  };
  offsets = per_head_offsets(c, stride_of);
  return {v.data, offsets.data(), stride_of(c.query_spatial), stride_of(c.kv_spatial)};
}

// Lengths that vary over the query's own dims: their host copy (dense, over
// their own dims) as per-(b, h) planes of row lengths, and each entry's
// maximum over its rows as its kv length. B holds every batch and keys-only
// dim they vary over (flash_layout), so each plane's rows are one entry's.
void kv_row_lengths(FlashParams& pr, const AttentionCall& c, const FlashLayout& l) {
  kernels::AttentionKernelParams& p = pr.p;
  const Tensor& len = c.kv_spatial.lengths();
  pr.kv_rows = host_ints(len, len.dims());
  HostView dense{pr.kv_rows.data(), {}, std::vector<int64_t>(len.dims().size()), DType::int64};
  int64_t n = 1;
  for (size_t a = len.dims().size(); a-- > 0;) dense.strides[a] = n, n *= len.dims()[a].extent();
  p.kv_row_lengths = score_planes(c, len, dense, pr.kv_row_offsets);
  const int64_t H = l.Hkv * l.G;
  pr.kv_len.assign(static_cast<size_t>(l.B), 0);
  for (int64_t b = 0; b < l.B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      const int64_t* rows = p.kv_row_lengths.plane<int64_t>(b * H + h);
      for (int64_t i = 0; i < l.Tq; ++i)
        pr.kv_len[b] = std::max(pr.kv_len[b], rows[i * p.kv_row_lengths.row_stride]);
    }
  p.kv_lengths = pr.kv_len.data();
}

}  // namespace

void flash_params(FlashParams& pr, const AttentionCall& c, const FlashLayout& l, const HostView& q, const HostView& k,
                  const HostView& v) {
  kernels::AttentionKernelParams& p = pr.p;
  p.dtype = kernel_element_type(q.dtype);
  p.q = q.data;
  p.k = k.data;
  p.v = v.data;
  p.batch = l.B;
  p.heads = l.Hkv * l.G;
  p.kv_heads = l.Hkv;
  p.seqlen_q = l.Tq;
  p.seqlen_k = l.Tk;
  p.head_dim = l.D;
  p.head_dim_v = l.Dv;
  p.q_strides = strides4(q);
  p.k_strides = strides4(k);
  p.v_strides = strides4(v);
  if (c.padding() == Padding::per_row) {
    kv_row_lengths(pr, c, l);
  } else if (c.kv_spatial.is_dynamic()) {
    pr.kv_len = host_ints(c.kv_spatial.lengths(), outer_dims(c, l));
    p.kv_lengths = pr.kv_len.data();
  }
  p.causal = c.causal;
  if (c.causal_offset) {
    pr.offset = host_ints(*c.causal_offset, outer_dims(c, l));
    p.causal_offset = pr.offset.data();
  }
  p.scale = c.scale;
  p.dropout_p = c.dropout;
  p.dropout_broadcast = c.dropout_broadcast;
  p.seed = c.dropout_seed;
  p.rng_offset = static_cast<uint32_t>(c.dropout_offset);
  p.dropout_q_position = c.dropout_q_position;
  p.dropout_kv_position = c.dropout_kv_position;
  p.bounds = row_bounds_of(c.variants.window);
  p.score.softcap = c.variants.softcap.value_or(0.0);
  const int64_t H = l.Hkv * l.G;
  auto per_head = [&](const Tensor& t, std::vector<double>& out) {
    out = host_values(t, per_head_dims(c));
    return kernels::HeadValues{out.data(), H, 1};
  };
  if (c.variants.alibi_slopes) p.score.alibi = per_head(*c.variants.alibi_slopes, pr.slopes);
  if (c.variants.sinks) {
    p.score.sinks = per_head(*c.variants.sinks, pr.sinks);
    pr.dsinks.assign(static_cast<size_t>(l.B * H), 0.0);
    p.score.dsinks = pr.dsinks.data();
  }
  if (c.rel_pos) {  // the table's planes come with score_operands
    kernels::RelPosParams& r = p.score.rel_pos;
    r.rows = c.rel_pos->dim.extent(), r.center = c.rel_pos->center, r.step = c.rel_pos->step;
    Dims order = per_head_dims(c);
    order.push_back(c.key_dim);
    auto per_head_rows = [&](const std::optional<Tensor>& t, std::vector<double>& values, std::vector<double>& grad) {
      if (!t) return std::pair<const double*, double*>{nullptr, nullptr};
      values = host_values(*t, order);
      grad.assign(values.size(), 0.0);
      return std::pair<const double*, double*>{values.data(), grad.data()};
    };
    std::tie(r.u, r.du) = per_head_rows(c.variants.pos_bias_u, pr.pos_u, pr.dpos_u);
    std::tie(r.v, r.dv) = per_head_rows(c.variants.pos_bias_v, pr.pos_v, pr.dpos_v);
  }
}

DType accumulation_dtype(const AttentionCall& c) {
  return c.query.dtype() == DType::float64 ? DType::float64 : DType::float32;
}

ScoreOperands score_operands(Backend& be, const AttentionCall& c, FlashParams& pr, const MemoryView& mem,
                             bool dense_bias) {
  ScoreOperands s;
  kernels::AttentionKernelParams& p = pr.p;
  if (c.variants.bias) {
    const DType acc = accumulation_dtype(c);
    s.bias = c.variants.bias->dtype() == acc ? c.variants.bias->raw() : be.cast(c.variants.bias->raw(), acc);
    if (dense_bias) s.bias = be.contiguous(s.bias);
    p.score.bias = score_planes(c, *c.variants.bias, mem(s.bias), pr.bias_offsets);
  }
  if (c.variants.mask) {
    s.mask = c.variants.mask->raw();
    p.score.mask = score_planes(c, *c.variants.mask, mem(s.mask), pr.mask_offsets);
  }
  if (c.variants.query_segments) {
    auto ids = [&](const Tensor& t, RawPtr& raw, std::vector<int64_t>& offsets) {
      raw = t.dtype() == DType::int64 ? t.raw() : be.cast(t.raw(), DType::int64);
      return score_planes(c, t, mem(raw), offsets);
    };
    p.score.query_segments = ids(*c.variants.query_segments, s.query_segments, pr.qseg_offsets);
    p.score.kv_segments = ids(*c.variants.kv_segments, s.kv_segments, pr.kvseg_offsets);
  }
  if (c.rel_pos) {
    const Tensor& t = *c.variants.pos_emb;
    const Dims order = rel_pos_table_order(c);
    RawPtr raw = raw_in_order(kOp, t, order, false);
    if (t.dtype() != c.query.dtype()) raw = be.cast(raw, c.query.dtype());
    s.pos_emb = be.contiguous(raw);
    const HostView v = mem(s.pos_emb);
    auto stride_of = [&](const Dim& d) {
      const auto at = std::find(order.begin(), order.end(), d);
      return at == order.end() || d.extent() == 1 ? int64_t{0} : v.strides[static_cast<size_t>(at - order.begin())];
    };
    pr.table_offsets = per_head_offsets(c, stride_of);
    p.score.rel_pos.table = {v.data, pr.table_offsets.data(), stride_of(c.rel_pos->dim), 1};
  }
  return s;
}

Dims rel_pos_table_order(const AttentionCall& c) {
  Dims order;
  for (const Dim& d : c.variants.pos_emb->dims())
    if (d != c.rel_pos->dim && d != c.key_dim) order.push_back(d);
  order.push_back(c.rel_pos->dim);
  order.push_back(c.key_dim);
  return order;
}

RawPtr rel_pos_gradient_buffer(Backend& be, FlashParams& pr, const AttentionCall& c, const MemoryView& mem,
                               Device device) {
  Shape shape;
  for (const Dim& d : rel_pos_table_order(c)) shape.push_back(d.extent());
  RawPtr dtable = be.full(shape, 0.0, accumulation_dtype(c), device);
  pr.p.score.rel_pos.dtable = mem(dtable).data;  // laid out as the contiguous table of score_operands
  return dtable;
}

RawPtr bias_gradient_buffer(Backend& be, FlashParams& pr, const AttentionCall& c, const MemoryView& mem,
                            Device device) {
  Shape shape;
  int64_t n = 1;
  for (const Dim& d : c.variants.bias->dims()) shape.push_back(d.extent()), n *= d.extent();
  RawPtr dbias = be.full(shape, 0.0, accumulation_dtype(c), device);
  // Laid out as the contiguous bias of score_operands: its offsets and strides hold.
  kernels::AttentionKernelParams& p = pr.p;
  p.score.dbias = mem(dbias).data;
  p.score.dbias_shared = n < p.batch * p.heads * p.seqlen_q * p.seqlen_k;
  return dbias;
}

Tensor bias_gradient(Backend& be, const AttentionCall& c, const RawPtr& dbias) {
  const Tensor& bias = *c.variants.bias;
  const RawPtr g = bias.dtype() == accumulation_dtype(c) ? dbias : be.cast(dbias, bias.dtype());
  return Tensor(bias.dims(), bias.dtype(), bias.device(), g, &be);
}

Dims per_head_dims(const AttentionCall& c) { return join({batch_head_dims(c), c.query_groups}); }

Tensor per_head_gradient(Backend& be, const AttentionCall& c, const Tensor& like, const std::vector<double>& g,
                         const Dims& inner) {
  // Each flat index's position in like's own row-major order, then each
  // inner index's (0 along a dim like lacks).
  Shape shape;
  for (const Dim& d : like.dims()) shape.push_back(d.extent());
  std::vector<int64_t> dense(shape.size());
  int64_t n = 1;
  for (size_t a = shape.size(); a-- > 0;) dense[a] = n, n *= shape[a];
  auto stride_of = [&](const Dim& d) {
    const int a = like.axis_of(d);
    return a < 0 ? int64_t{0} : dense[static_cast<size_t>(a)];
  };
  const std::vector<int64_t> at = per_head_offsets(c, stride_of);
  std::vector<int64_t> in(1, 0);  // inner offsets, row-major over `inner`
  for (const Dim& d : inner) {
    std::vector<int64_t> next;
    for (const int64_t o : in)
      for (int64_t i = 0; i < d.extent(); ++i) next.push_back(o + i * stride_of(d));
    in = std::move(next);
  }
  std::vector<double> grad(static_cast<size_t>(n), 0.0);
  for (size_t x = 0; x < at.size(); ++x)
    for (size_t e = 0; e < in.size(); ++e) grad[static_cast<size_t>(at[x] + in[e])] += g[x * in.size() + e];
  return Tensor(like.dims(), like.dtype(), like.device(), be.from_host(shape, grad, like.dtype(), like.device()), &be);
}

void set_forward_outputs(kernels::AttentionKernelParams& p, const HostView& out, const HostView& lse) {
  p.out = out.data;
  p.out_strides = strides4(out);
  p.lse = lse.data;
  p.lse_batch_stride = lse.strides[0];
  p.lse_head_stride = lse.strides[1];
}

void set_backward_tensors(kernels::AttentionKernelParams& p, const HostView& dout, const HostView& dq,
                          const HostView& dk, const HostView& dv) {
  p.dout = dout.data;
  p.dout_strides = strides4(dout);
  p.dq = dq.data;
  p.dk = dk.data;
  p.dv = dv.data;
  p.dq_strides = strides4(dq);
  p.dk_strides = strides4(dk);
  p.dv_strides = strides4(dv);
}

FlashLayout flash_layout(const AttentionCall& c) {
  // The batch dims, then the keys-only dims (more kv heads; the query is
  // broadcast over them, a copy of the query, never of keys or values): the
  // canonical order of the flat batch index of philox.h. B takes a prefix,
  // the kv heads the rest: the last batch dim and the keys-only dims, unless
  // kv lengths or offsets vary over them (the kernels' per-entry arrays are
  // indexed by B alone), so that [B, H, T, D] buffers keep B and H as they are.
  const Dims* lengths = c.kv_spatial.is_dynamic() ? &c.kv_spatial.lengths().dims() : nullptr;
  const Dims* offsets = c.causal_offset ? &c.causal_offset->dims() : nullptr;
  const size_t nb = c.batch.size(), n = nb + c.keys_only.size();
  auto at = [&](size_t i) -> const Dim& { return i < nb ? c.batch[i] : c.keys_only[i - nb]; };
  FlashLayout l;
  l.split = nb == 0 ? 0 : nb - 1;
  for (size_t i = 0; i < n; ++i)
    if ((lengths && contains(*lengths, at(i))) || (offsets && contains(*offsets, at(i)))) l.split = std::max(l.split, i + 1);
  for (size_t i = 0; i < n; ++i) (i < l.split ? l.B : l.Hkv) *= at(i).extent();
  l.G = product(c.query_groups);
  l.Tq = c.query_spatial.extent();
  l.Tk = c.kv_spatial.extent();
  l.D = c.key_dim.extent();
  l.Dv = product(c.value_feature);
  return l;
}

Dims batch_head_dims(const AttentionCall& c) { return join({c.batch, c.keys_only}); }

Dims outer_dims(const AttentionCall& c, const FlashLayout& l) {
  Dims all = batch_head_dims(c);
  all.erase(all.begin() + static_cast<std::ptrdiff_t>(l.split), all.end());
  return all;
}

KernelForm kernel_form(const AttentionCall& c, const OperandMemory (&m)[3]) {
  KernelForm f;
  f.layout = flash_layout(c);
  f.q = operand_form(c.query, {c.batch, c.keys_only, c.query_groups, one(c.query_spatial), one(c.key_dim)}, m[0]);
  f.k = operand_form(c.keys, {c.batch, c.keys_only, one(c.kv_spatial), one(c.key_dim)}, m[1]);
  f.v = operand_form(c.values, {c.batch, c.keys_only, one(c.kv_spatial), c.value_feature}, m[2]);
  f.layout_class = form_layout_class(f, m);
  f.requires_grad = m[0].requires_grad || m[1].requires_grad || m[2].requires_grad;
  return f;
}

void host_operand_memory(Backend& be, const AttentionCall& c, HostView (&h)[3], OperandMemory (&m)[3]) {
  const Tensor* x[3] = {&c.query, &c.keys, &c.values};
  for (int i = 0; i < 3; ++i) {
    h[i] = host(be, x[i]->raw());
    const int64_t size = dtype_size(h[i].dtype);
    m[i] = {h[i].sizes, h[i].strides, nullptr, static_cast<int64_t>(reinterpret_cast<uintptr_t>(h[i].data) / size), size,
            x[i]->requires_grad()};
  }
}

KernelForm host_kernel_form(Backend& be, const AttentionCall& c) {
  HostView h[3];
  OperandMemory m[3];
  host_operand_memory(be, c, h, m);
  return kernel_form(c, m);
}

FlashInputs aligned_inputs(Backend& be, const AttentionCall& c, const KernelForm& f) {
  return {aligned_input(be, c.query, f.q), aligned_input(be, c.keys, f.k), aligned_input(be, c.values, f.v)};
}

FlashInputs flash_inputs(Backend& be, const AttentionCall& c, const KernelForm& f) {
  return flash_inputs(be, f, aligned_inputs(be, c, f), host_memory(be));
}

FlashInputs flash_inputs(Backend& be, const KernelForm& f, const FlashInputs& aligned, const MemoryView& mem,
                         QueryForm form) {
  const FlashLayout& l = f.layout;
  const Shape q_shape = form == QueryForm::heads ? Shape{l.B, l.Hkv * l.G, l.Tq, l.D} : Shape{l.B, l.Hkv, l.G * l.Tq, l.D};
  return {kernel_view(be, mem, aligned.q, f.q, q_shape), kernel_view(be, mem, aligned.k, f.k, {l.B, l.Hkv, l.Tk, l.D}),
          kernel_view(be, mem, aligned.v, f.v, {l.B, l.Hkv, l.Tk, l.Dv})};
}

Tensor flash_output(Backend& be, const AttentionCall& c, const RawPtr& out4) {
  Dims dims = join({c.batch, c.keys_only, c.query_groups});
  dims.push_back(c.query_spatial);
  dims.insert(dims.end(), c.value_feature.begin(), c.value_feature.end());
  Shape shape;
  for (const Dim& d : dims) shape.push_back(d.extent());
  const bool same = be.shape(out4) == shape;  // [B, H, Tq, Dv] with one dim each: no reshape
  return Tensor(std::move(dims), c.query.dtype(), c.query.device(), same ? out4 : be.reshape(out4, shape), &be);
}

// --- blocks of a longer attention and fused backward passes ---

namespace {

// The call's output order as the kernel lays it out: B's dims and the kv
// heads', the query groups, the query position, then (with_features) the
// value features.
Dims kernel_output_order(const AttentionCall& c, bool with_features) {
  return join({batch_head_dims(c), c.query_groups, {c.query_spatial}, with_features ? c.value_feature : Dims{}});
}

Tensor named(Backend& be, const AttentionCall& c, const RawPtr& raw, Dims dims, DType dtype) {
  Shape shape;
  for (const Dim& d : dims) shape.push_back(d.extent());
  return Tensor(std::move(dims), dtype, c.query.device(), be.reshape(raw, shape), &be);
}

}  // namespace

DType lse_dtype_of(const AttentionCall& c) {
  return c.query.dtype() == DType::float64 ? DType::float64 : DType::float32;
}

RawPtr in_kernel_form(Backend& be, const AttentionCall& c, const FlashLayout& l, const Tensor& t, const char* what,
                      bool with_features, DType dtype, const char* op) {
  const Dims order = kernel_output_order(c, with_features);
  Dims missing, extra;
  for (const Dim& d : order)
    if (!t.has(d)) missing.push_back(d);
  for (const Dim& d : t.dims())
    if (!contains(order, d)) extra.push_back(d);
  DIMATTN_CHECK(missing.empty() && extra.empty(), op, what, " has dims ", repr(t.dims()), "; it must have ",
                repr(order));
  DIMATTN_CHECK(t.dtype() == dtype, op, what, " has dtype ", dtype_name(t.dtype()), "; this call's is ",
                dtype_name(dtype));
  Shape shape{l.B, l.Hkv * l.G, l.Tq};
  if (with_features) shape.push_back(l.Dv);
  return be.contiguous(be.reshape(raw_in_order(op, t, order, false), shape));
}

AttentionBlockResult block_result(Backend& be, const AttentionCall& c, const RawPtr& out4, const RawPtr& lse3) {
  return {flash_output(be, c, out4), named(be, c, lse3, kernel_output_order(c, false), lse_dtype_of(c))};
}

AttentionVariants variant_grads(Backend& be, const AttentionCall& c, const FlashGrads& g) {
  const AttentionVariants& v = c.variants;
  AttentionVariants out;
  if (v.sinks) out.sinks = per_head_gradient(be, c, *v.sinks, g.dsinks);
  if (v.bias && g.dbias) out.bias = bias_gradient(be, c, g.dbias);
  if (c.rel_pos && g.dpos_emb) {
    const Tensor& t = *v.pos_emb;
    const RawPtr d = t.dtype() == accumulation_dtype(c) ? g.dpos_emb : be.cast(g.dpos_emb, t.dtype());
    out.pos_emb = Tensor(rel_pos_table_order(c), t.dtype(), t.device(), d, &be);
  }
  if (v.pos_bias_u) out.pos_bias_u = per_head_gradient(be, c, *v.pos_bias_u, g.dpos_u, {c.key_dim});
  if (v.pos_bias_v) out.pos_bias_v = per_head_gradient(be, c, *v.pos_bias_v, g.dpos_v, {c.key_dim});
  return out;
}

AttentionCallGrads call_grads(Backend& be, const AttentionCall& c, const FlashGrads& g) {
  const Dims kv_heads = batch_head_dims(c);
  const DType dt = c.query.dtype();
  return {named(be, c, g.inputs.q, join({kv_heads, c.query_groups, {c.query_spatial, c.key_dim}}), dt),
          named(be, c, g.inputs.k, join({kv_heads, {c.kv_spatial, c.key_dim}}), dt),
          named(be, c, g.inputs.v, join({kv_heads, {c.kv_spatial}, c.value_feature}), dt), variant_grads(be, c, g)};
}

}  // namespace dimattn::detail
