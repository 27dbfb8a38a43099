#include "problem.h"

#include <algorithm>
#include <cmath>
#include <sstream>

#include "cli_args.h"
#include "dimattn/ext/backend.h"
#include "dimattn/forcing.h"
#include "dimattn/ops.h"
#include "dimattn/selection.h"

namespace dimattn::cli {

const char* kind_name(Kind k) {
  switch (k) {
    case Kind::self: return "self";
    case Kind::cross: return "cross";
    case Kind::step: return "step";
  }
  return "?";
}

double Problem::flops() const {
  const double f = 4.0 * static_cast<double>(batch * heads * query_rows() * seq_k * head_dim);
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
}  // namespace

std::string Problem::describe() const {
  std::ostringstream os;
  os << backend << " " << device_name(device) << " " << dtype_name(dtype) << " " << kind_name(kind)
     << " B=" << batch << " H=" << heads;
  if (groups > 1) os << " " << group_name << "=" << groups;
  if (kind != Kind::step) os << " Tq=" << seq_q;
  os << " Tk=" << seq_k << " D=" << head_dim;
  if (head_dim_v != head_dim) os << " Dv=" << head_dim_v;
  if (causal) os << " causal";
  if (!offsets.empty()) os << " offsets=" << join(offsets);
  if (!lengths.empty()) os << " lengths=" << join(lengths);
  if (dropout > 0) os << " dropout=" << dropout << (broadcast_dropout ? "(broadcast)" : "");
  if (scale) os << " scale=" << *scale;
  os << " seed=" << seed;
  return os.str();
}

void validate(const Problem& p) {
  auto need = [](bool ok, const std::string& what) {
    if (!ok) throw UsageError(what);
  };
  need(p.batch >= 1 && p.heads >= 1 && p.groups >= 1, "batch, heads and groups must be at least 1");
  need(p.seq_q >= 1 && p.seq_k >= 1, "sequence lengths must be at least 1");
  need(p.head_dim >= 1 && p.head_dim_v >= 1, "head dims must be at least 1");
  need(p.kind != Kind::self || p.seq_q == p.seq_k,
       "self-attention needs equal query and kv lengths; use cross-attention for different ones");
  need(p.kind != Kind::step || !p.causal, "a single step has no query spatial dim to be causal over");
  need(p.lengths.empty() || static_cast<int64_t>(p.lengths.size()) == p.batch,
       "give one kv length per batch entry (" + std::to_string(p.batch) + ")");
  for (int64_t l : p.lengths)
    need(l >= 0 && l <= p.seq_k, "kv lengths must be in [0, " + std::to_string(p.seq_k) + "]");
  need(p.offsets.empty() || p.causal, "causal offsets need causal attention");
  need(p.offsets.empty() || static_cast<int64_t>(p.offsets.size()) == p.batch,
       "give one causal offset per batch entry (" + std::to_string(p.batch) + ")");
  for (int64_t o : p.offsets) need(o >= 0, "causal offsets must be at least 0");
  need(!p.causal || !p.offsets.empty() || p.seq_q == p.seq_k,
       "causal attention without offsets needs equal query and kv lengths");
  need(p.dropout >= 0 && p.dropout < 1, "dropout must be in [0, 1)");
}

void check_kernel_names(const std::string& option, const std::vector<std::string>& names) {
  const std::vector<std::string>& known = all_kernel_names();
  for (const std::string& k : names)
    if (k != "auto" && std::find(known.begin(), known.end(), k) == known.end()) {
      std::string list;
      for (const std::string& n : known) list += " " + n;
      throw UsageError("--" + option + ": unknown kernel '" + k + "'; kernels: auto" + list);
    }
}

Operands make_operands(const Problem& p, bool requires_grad) {
  const TensorOptions o{.dtype = p.dtype, .device = p.device, .backend = p.backend};
  const TensorOptions io{.dtype = DType::int64, .device = p.device, .backend = p.backend};
  Dim batch("batch", p.batch), heads("heads", p.heads), group(p.group_name, p.groups);
  Dim feat("feat", p.head_dim), vfeat("vfeat", p.head_dim_v);
  const char* kv_name = p.kind == Kind::self ? "time" : "kv";
  Dim kv = p.lengths.empty() ? Dim(kv_name, p.seq_k)
                             : Dim::dynamic(kv_name, from_host({batch}, as_doubles(p.lengths), io), p.seq_k);
  std::optional<Dim> time;
  if (p.kind == Kind::self) time = kv;
  if (p.kind == Kind::cross) time = Dim("time", p.seq_q);

  Dims qd = {batch, heads};
  if (p.groups > 1) qd.push_back(group);
  if (time) qd.push_back(*time);
  qd.push_back(feat);
  Operands ops{random_normal(qd, p.seed, o), random_normal({batch, heads, kv, feat}, p.seed + 1, o),
               random_normal({batch, heads, kv, vfeat}, p.seed + 2, o),
               {.key_dim = feat,
                .axis = kv,
                .att_dropout = p.dropout,
                .att_dropout_broadcast = p.broadcast_dropout,
                .scale = p.scale},
               {}};
  if (p.causal) ops.opts.causal_query_spatial_dim = *time;
  if (!p.offsets.empty()) ops.opts.causal_offset = from_host({batch}, as_doubles(p.offsets), io);
  for (const Dim& d : qd)
    if (d != feat) ops.out_order.push_back(d);
  ops.out_order.push_back(vfeat);
  if (requires_grad && ops.q.backend().has_autograd())
    for (Tensor* t : {&ops.q, &ops.k, &ops.v}) t->requires_grad(true);
  return ops;
}

std::optional<std::string> rejection(const Operands& ops, const std::string& kernel) {
  if (kernel == "reference") return std::nullopt;
  // With the reference as a fallback, selection records the kernel's reason
  // instead of throwing.
  ForceKernels force(kernel + ",reference");
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
  double m = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    if (std::isnan(x[i]) || std::isnan(y[i])) return INFINITY;
    m = std::max(m, std::abs(x[i] - y[i]));
  }
  return m;
}

double max_abs(const Tensor& a) {
  double m = 0;
  for (double x : to_host(a)) m = std::max(m, std::abs(x));
  return m;
}

void synchronize(const Tensor& x) {
  if (x.device().type == DeviceType::cpu) return;
  // Copying one element to the host waits for the work queued before it.
  Tensor one = x;
  for (const Dim& d : x.dims())
    if (!d.is_dynamic() && d.extent() > 1) one = slice(one, d, 0, 1).first;
  to_host(one);
}

}  // namespace dimattn::cli
