#include "dimattn/testing/cases.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <sstream>

#include "dimattn/error.h"
#include "dimattn/ext/backend.h"
#include "dimattn/forcing.h"
#include "dimattn/ops.h"
#include "dimattn/selection.h"

namespace dimattn::testing {

const char* kind_name(Kind k) {
  switch (k) {
    case Kind::self: return "self";
    case Kind::cross: return "cross";
    case Kind::step: return "step";
  }
  return "?";
}

const char* layout_name(Layout l) {
  switch (l) {
    case Layout::separate: return "separate";
    case Layout::permuted: return "permuted";
    case Layout::packed_qkv: return "packed_qkv";
  }
  return "?";
}

double AttentionCase::softmax_scale() const {
  return scale.value_or(1.0 / std::sqrt(static_cast<double>(head_dim)));
}

double AttentionCase::logit_scale() const {
  if (!scale) return 1;  // exactly, not 1/sqrt(D) · sqrt(D) rounded
  return std::abs(*scale) * std::sqrt(static_cast<double>(head_dim));
}

double AttentionCase::flops() const {
  const double f = 4.0 * static_cast<double>(batch * keys_only * heads * query_rows() * seq_k * head_dim);
  return causal ? f / 2 : f;
}

namespace {
std::string join(const std::vector<int64_t>& xs) {
  std::string s;
  for (int64_t x : xs) {
    if (!s.empty()) s += ',';
    s += std::to_string(x);
  }
  return s;
}

std::vector<double> as_doubles(const std::vector<int64_t>& xs) { return {xs.begin(), xs.end()}; }

// The index along each of `dims` of element `flat` of a row-major tensor over them.
std::vector<int64_t> unravel(int64_t flat, const Dims& dims) {
  std::vector<int64_t> idx(dims.size());
  for (size_t a = dims.size(); a-- > 0;) {
    idx[a] = flat % dims[a].extent();
    flat /= dims[a].extent();
  }
  return idx;
}

// The case's kv lengths over the dims lengths_over names (AttentionCase says
// how they are drawn); `dims` are the dims of its letters b, h, g, t, e.
Tensor kv_lengths(const AttentionCase& c, const Dims& dims, const TensorOptions& ints) {
  if (c.lengths_over == "b") return from_host({dims[0]}, as_doubles(c.lengths), ints);
  Dims over;
  for (char x : c.lengths_over) over.push_back(dims[std::string("bhgte").find(x)]);
  const size_t bat = c.lengths_over.find('b');
  const int64_t n = product(over);
  std::vector<double> values(static_cast<size_t>(n));
  for (int64_t e = 0; e < n; ++e) {
    // Element e's batch index and flat index over the other dims.
    const std::vector<int64_t> idx = unravel(e, over);
    int64_t b = 0, x = 0, inner = 1;
    for (size_t a = over.size(); a-- > 0;) {
      if (a == bat) {
        b = idx[a];
      } else {
        x += idx[a] * inner;
        inner *= over[a].extent();
      }
    }
    const int64_t most = c.lengths[static_cast<size_t>(b)];
    int64_t step = 3;
    while (std::gcd(step, most + 1) != 1) step += 2;
    values[static_cast<size_t>(e)] = static_cast<double>(most - (step * x + b) % (most + 1));
  }
  return from_host(over, values, ints);
}
}  // namespace

std::string AttentionCase::describe() const {
  std::ostringstream os;
  os << (backend.empty() ? "default" : backend) << " " << device_name(device) << " " << dtype_name(dtype) << " "
     << kind_name(kind) << " B=" << batch << " H=" << heads;
  if (groups > 1) os << " " << group_name << "=" << groups;
  if (keys_only > 1) os << " extra=" << keys_only << "(keys only)";
  if (layout != Layout::separate) os << " layout=" << layout_name(layout);
  if (kind != Kind::step) os << " Tq=" << seq_q;
  os << " Tk=" << seq_k << " D=" << head_dim;
  if (head_dim_v != head_dim) os << " Dv=" << head_dim_v;
  if (causal) os << " causal";
  if (!offsets.empty()) os << " offsets=" << join(offsets);
  if (!lengths.empty()) os << " lengths=" << join(lengths) << (lengths_over == "b" ? "" : " over " + lengths_over);
  if (dropout > 0) os << " dropout=" << dropout << (broadcast_dropout ? "(broadcast)" : "");
  if (scale) os << " scale=" << *scale;
  os << variants.describe() << " seed=" << seed;
  return os.str();
}

std::string CaseVariants::describe() const {
  std::string s = scalars.describe();
  if (alibi) s += " alibi";
  if (sinks) s += " sinks";
  if (!bias.empty()) s += " bias=" + bias;
  if (!mask.empty()) s += " mask=" + mask;
  if (mask_docs > 0) s += " mask_docs=" + std::to_string(mask_docs);
  if (segment_docs > 0) s += " segments=" + std::to_string(segment_docs) + " over " + segments_over;
  if (rel_pos) s += " rel_pos=" + (rel_pos->empty() ? std::string("shared") : *rel_pos) + (rel_pos_biases ? "+uv" : "");
  return s;
}

std::optional<std::string> invalid_reason(const AttentionCase& c) {
  const std::string B = std::to_string(c.batch);
  if (c.batch < 1 || c.heads < 1 || c.groups < 1 || c.keys_only < 1)
    return "batch, heads, groups and keys_only must be at least 1";
  if (c.seq_q < 1 || c.seq_k < 1) return "sequence lengths must be at least 1";
  if (c.head_dim < 1 || c.head_dim_v < 1) return "head dims must be at least 1";
  if (c.kind == Kind::self && c.seq_q != c.seq_k)
    return "self-attention needs equal query and kv lengths; use cross-attention for different ones";
  if (c.kind == Kind::step && c.causal) return "a single step has no query spatial dim to be causal over";
  if (!c.lengths.empty() && static_cast<int64_t>(c.lengths.size()) != c.batch)
    return "give one kv length per batch entry (" + B + ")";
  for (int64_t l : c.lengths)
    if (l < 0 || l > c.seq_k) return "kv lengths must be in [0, " + std::to_string(c.seq_k) + "]";
  if (c.lengths_over.find('b') == std::string::npos) return "kv lengths vary over the batch dim (b) at least";
  for (char x : c.lengths_over) {
    if (std::string("bhgte").find(x) == std::string::npos)
      return std::string("kv lengths vary over letters of bhgte, got '") + x + "'";
    if (std::count(c.lengths_over.begin(), c.lengths_over.end(), x) > 1)
      return std::string("kv lengths dim '") + x + "' appears twice";
    if (x == 't' && c.kind != Kind::cross) return "kv lengths over the query's time dim need a separate kv dim (kind cross)";
    if (x == 'g' && c.groups == 1) return "kv lengths over the group dim need groups > 1";
    if (x == 'e' && c.keys_only == 1) return "kv lengths over the keys-only dim need keys_only > 1";
  }
  if (c.lengths_over != "b" && c.lengths.empty()) return "lengths_over needs lengths";
  const CaseVariants& v = c.variants;
  const bool positional = v.positional(c.kind);
  if (!c.offsets.empty() && !c.causal && !positional) return "causal offsets need causal attention, a window or ALiBi";
  if ((v.scalars.positional() || v.alibi) && c.kind == Kind::step)
    return "windows and ALiBi need the query's positional dim; a step has none";
  if (v.rel_pos)
    for (char x : *v.rel_pos)
      if (std::string("bhg").find(x) == std::string::npos || (x == 'g' && c.groups == 1))
        return std::string("rel_pos varies over letters of bhg (g with groups > 1), got '") + x + "'";
  if (v.rel_pos_biases && !v.rel_pos) return "rel_pos_biases need rel_pos";
  try {
    v.scalars.check_values("case", c.causal);
  } catch (const Error& e) {  // the library's own message, less its "[case] "
    const std::string why = e.what();
    return why.substr(why.find("] ") + 2);
  }
  if (v.sinks && v.scalars.sink_off_by_one) return "sinks and the off-by-one sink exclude each other";
  if (c.offsets.size() > 1 && static_cast<int64_t>(c.offsets.size()) != c.batch)
    return "give one causal offset, or one per batch entry (" + B + ")";
  if (c.causal && c.offsets.empty() && c.seq_q != c.seq_k)
    return "causal attention without offsets needs equal query and kv lengths";
  if (!(c.dropout >= 0 && c.dropout < 1)) return "dropout must be in [0, 1)";
  if (c.layout == Layout::packed_qkv &&
      (c.kind != Kind::self || c.groups > 1 || c.keys_only > 1 || c.head_dim != c.head_dim_v))
    return "packed q, k and v need self-attention without groups or keys-only dims, and equal head dims";
  for (const std::string* s : {&v.bias, &v.mask})
    for (char x : *s) {
      if (std::string("bhgtk").find(x) == std::string::npos)
        return std::string("bias and mask dims are letters of bhgtk, got '") + x + "'";
      if (x == 't' && c.kind != Kind::cross)
        return "a bias or mask over the query's time dim needs a separate kv dim (kind cross)";
      if (x == 'g' && c.groups == 1) return "a bias or mask over the group dim needs groups > 1";
    }
  if (v.mask_docs < 0 || (v.mask_docs > 0 && (v.mask.find('t') == std::string::npos ||
                                               v.mask.find('k') == std::string::npos)))
    return "a documents mask (mask_docs > 0) needs a mask over the t and k dims";
  if (v.segment_docs < 0) return "segment_docs must be >= 0";
  if (v.segment_docs > 0 && (c.kind == Kind::step || v.segments_over.find_first_not_of("bh") != std::string::npos))
    return "segments need a query time dim (kind self or cross) and vary over letters of bh";
  return std::nullopt;
}

Tensor random_operand(const Dims& dims, uint64_t seed, DType dtype, const std::string& backend, Device device) {
  const TensorOptions o{.dtype = is_floating(dtype) ? dtype : DType::float32, .device = device, .backend = backend};
  const Tensor x = random_normal(dims, seed, o);
  return is_floating(dtype) ? x : cast(x, dtype);
}

Operands make_operands(const AttentionCase& c, bool requires_grad) {
  const TensorOptions ints{.dtype = DType::int64, .device = c.device, .backend = c.backend};
  Dim batch("batch", c.batch), heads("heads", c.heads), group(c.group_name, c.groups), extra("extra", c.keys_only);
  Dim feat("feat", c.head_dim), vfeat("vfeat", c.head_dim_v);
  const char* kv_name = c.kind == Kind::self ? "time" : "kv";
  const Dim cross_time("time", c.seq_q);
  Dim kv = c.lengths.empty() ? Dim(kv_name, c.seq_k)
                             : Dim::dynamic(kv_name, kv_lengths(c, {batch, heads, group, cross_time, extra}, ints), c.seq_k);
  std::optional<Dim> time;
  if (c.kind == Kind::self) time = kv;
  if (c.kind == Kind::cross) time = cross_time;

  const bool packed = c.layout == Layout::packed_qkv;
  const Dim& value_feat = packed ? feat : vfeat;  // a packed buffer has one feature dim
  Dims qd = {batch, heads};
  if (c.groups > 1) qd.push_back(group);
  if (time) qd.push_back(*time);
  qd.push_back(feat);
  // The keys-only dim after the batch dims (heads among them): the kernels' order.
  Dims kd = c.keys_only > 1 ? Dims{batch, heads, extra, kv, feat} : Dims{batch, heads, kv, feat};
  Dims vd = kd;
  vd.back() = value_feat;
  // Permuted: the spatial dim drawn right after batch, as a [B, T, H, D] tensor lies.
  auto placed = [&](Dims d, const std::optional<Dim>& spatial) {
    if (c.layout == Layout::permuted && spatial) {
      d.erase(std::find(d.begin(), d.end(), *spatial));
      d.insert(d.begin() + 1, *spatial);
    }
    return d;
  };
  auto operand = [&](const Dims& dims, uint64_t seed) { return random_operand(dims, seed, c.dtype, c.backend, c.device); };
  std::optional<Tensor> buffer;
  if (packed) buffer = operand({batch, kv, Dim("qkv", 3), heads, feat}, c.seed);
  const PackedParts p = packed ? packed_parts(*buffer)
                               : PackedParts{operand(placed(qd, time), c.seed), operand(placed(kd, kv), c.seed + 1),
                                             operand(placed(vd, kv), c.seed + 2)};
  Operands ops{p.q,
               p.k,
               p.v,
               {.key_dim = feat,
                .axis = kv,
                .att_dropout = c.dropout,
                .att_dropout_broadcast = c.broadcast_dropout,
                .scale = c.scale},
               {},
               buffer};
  if (c.causal && time) ops.opts.causal_query_spatial_dim = *time;
  const CaseVariants& v = c.variants;
  if (!c.causal && time && v.positional(c.kind)) ops.opts.query_position_dim = *time;
  ops.opts.variants = v.scalars;
  const TensorOptions floats{.dtype = c.dtype, .device = c.device, .backend = c.backend};
  auto per_head = [&](auto value) {
    std::vector<double> v;
    for (int64_t h = 0; h < c.heads; ++h) v.push_back(value(h));
    return from_host({heads}, v, floats);
  };
  AttentionVariants& var = ops.opts.variants;
  if (v.alibi) var.alibi_slopes = per_head([](int64_t h) { return std::exp2(-static_cast<double>(h + 1)); });
  if (v.sinks) var.sinks = per_head([](int64_t h) { return static_cast<double>(h % 3) - 1.0; });
  // Bias and mask over the dims their letters name, in the order given.
  auto score_dims = [&](const std::string& letters) {
    Dims dims;
    for (char x : letters) dims.push_back(x == 'b' ? batch : x == 'h' ? heads : x == 'g' ? group : x == 't' ? *time : kv);
    return dims;
  };
  if (!v.bias.empty()) var.bias = operand(score_dims(v.bias), c.seed + 3);
  if (!v.mask.empty() && v.mask_docs > 0) {
    const Dims dims = score_dims(v.mask);
    const int64_t n = product(dims);
    std::vector<double> allowed(static_cast<size_t>(n));
    for (int64_t flat = 0; flat < n; ++flat) {
      const std::vector<int64_t> idx = unravel(flat, dims);
      int64_t t = 0, k = 0, shift = 0;
      for (size_t a = 0; a < dims.size(); ++a) {
        const char x = v.mask[a];
        if (x == 't') t = idx[a];
        if (x == 'k') k = idx[a];
        shift += idx[a] * (x == 'h' ? 13 : x == 'b' ? 29 : x == 'g' ? 7 : 0);
      }
      allowed[static_cast<size_t>(flat)] = (t + shift) / v.mask_docs == (k + shift) / v.mask_docs ? 1.0 : 0.0;
    }
    var.mask = compare(from_host(dims, allowed, {.device = c.device, .backend = c.backend}), Compare::ge, 0.5);
  } else if (!v.mask.empty()) {
    var.mask = compare(random_uniform(score_dims(v.mask), c.seed + 4, {.device = c.device, .backend = c.backend}),
                       Compare::ge, 0.25);
  }
  if (v.segment_docs > 0) {
    // Over (segments_over's dims, then one position dim): document ids.
    auto ids = [&](const Dim& position) {
      Dims dims;
      for (char x : v.segments_over) dims.push_back(x == 'b' ? batch : heads);
      dims.push_back(position);
      std::vector<double> out;
      const Dims outer(dims.begin(), dims.end() - 1);
      for (int64_t plane = 0; plane < product(outer); ++plane) {
        const std::vector<int64_t> idx = unravel(plane, outer);
        int64_t shift = 0;
        for (size_t a = 0; a < outer.size(); ++a) shift += idx[a] * (v.segments_over[a] == 'b' ? 29 : 13);
        const int64_t n = v.segment_docs;
        for (int64_t d = 0, x = 0; x < position.extent(); ++d)
          for (int64_t y = 0; y < std::max<int64_t>(1, n / 2 + (37 * d + shift) % n) && x < position.extent(); ++y, ++x)
            out.push_back(static_cast<double>(d));
      }
      return from_host(dims, out, ints);
    };
    var.query_segments = ids(*time);
    var.kv_segments = c.kind == Kind::self ? *var.query_segments : ids(kv);
  }
  if (v.rel_pos) {
    Dims dims;
    for (char x : *v.rel_pos) dims.push_back(x == 'b' ? batch : x == 'h' ? heads : group);
    dims.push_back(time ? Dim("rel", c.seq_q + c.seq_k - 1) : kv);
    dims.push_back(feat);
    var.pos_emb = operand(dims, c.seed + 5);
    if (v.rel_pos_biases) {
      var.pos_bias_u = operand({heads, feat}, c.seed + 6);
      var.pos_bias_v = operand({heads, feat}, c.seed + 7);
    }
  }
  if (c.offsets.size() == 1) ops.opts.causal_offset = scalar(static_cast<double>(c.offsets[0]), ints);
  if (c.offsets.size() > 1) ops.opts.causal_offset = from_host({batch}, as_doubles(c.offsets), ints);
  for (const Dim& d : qd) {
    if (d != feat) ops.out_order.push_back(d);
    if (d == heads && c.keys_only > 1) ops.out_order.push_back(extra);
  }
  ops.out_order.push_back(value_feat);
  if (requires_grad && ops.q.backend().has_autograd()) {
    if (ops.buffer) {  // the leaf is the buffer; q, k and v stay its views
      ops.buffer->requires_grad(true);
      const PackedParts p = packed_parts(*ops.buffer);
      ops.q = p.q, ops.k = p.k, ops.v = p.v;
    } else {
      for (Tensor* t : {&ops.q, &ops.k, &ops.v}) t->requires_grad(true);
    }
  }
  return ops;
}

PackedParts packed_parts(const Tensor& buffer) {
  const Dim three = buffer.dims().at(2), one("one", 1);
  auto part = [&](int64_t i) { return squeeze(slice(buffer, three, i, i + 1, one).first, one); };
  return {part(0), part(1), part(2)};
}

Tensor upstream_gradient(const AttentionCase& c, const Operands& ops) {
  const TensorOptions o{.dtype = ops.q.dtype(), .device = ops.q.device(), .backend = ops.q.backend().name()};
  Tensor w = random_normal(ops.out_order, c.seed + 98, o);
  for (const Dim& d : ops.out_order)
    if (d.is_dynamic()) w = where(sequence_mask(d, o), w, 0.0);
  return w;
}

std::optional<std::string> rejection(const Operands& ops, const std::string& kernel) {
  if (kernel == kReferenceKernel) return std::nullopt;
  // With the reference as a fallback, selection records the kernel's reason
  // instead of throwing.
  ForceKernels force(kernel + "," + kReferenceKernel);
  const Decision d = explain_attention(ops.q, ops.k, ops.v, ops.opts);
  if (d.kernel == kernel) return std::nullopt;
  for (const Rejection& r : d.rejected)
    if (r.kernel == kernel) return r.reason;
  return "not a kernel of the " + ops.q.backend().name() + " backend on " + device_name(ops.q.device());
}

Tensor run_forced(const Operands& ops, const std::string& spec) {
  ForceKernels force(spec);
  return dot_attention(ops.q, ops.k, ops.v, ops.opts);
}

double max_abs_diff(const Tensor& a, const Tensor& b, const Dims& order) {
  const std::vector<double> x = to_host(a, order), y = to_host(b, order);
  if (x.size() != y.size()) return INFINITY;
  double m = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    if (std::isnan(x[i]) || std::isnan(y[i])) return INFINITY;
    m = std::max(m, std::abs(x[i] - y[i]));
  }
  return m;
}

double max_abs(const Tensor& a) {
  double m = 0;
  for (double x : to_host(a))
    if (std::isfinite(x)) m = std::max(m, std::abs(x));
  return m;
}

bool same_dims(const Dims& a, const Dims& b) {
  if (a.size() != b.size()) return false;
  for (const Dim& d : a)
    if (!contains(b, d)) return false;
  return true;
}

}  // namespace dimattn::testing
