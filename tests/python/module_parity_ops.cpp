// The C++ attention modules (dimattn/modules.h) as one torch op, for
// tests/python/test_module_parity.py: it builds a C++ module with the
// parameters of a Python dimattn.nn module (by their state_dict names) and
// runs it on the torch backend, so that outputs and, through torch's
// autograd, gradients of the two implementations can be compared.
//
//   torch.ops.dimattn_parity.run(config, x, lengths, encoder, encoder_lengths, names, params)
//
// config: "key=value" tokens (kind self|causal|relpos|cross, heads, key,
// value, in, out, bias, window_left, window_right, softcap, alibi, sinks,
// off_by_one, rel_buckets, rel_max, linear_pos, pos_bias, learnable,
// clipping, per_head, enc_feat). x [B, T, in] with T dynamic (lengths [B]);
// encoder [B, S, enc_feat] (S dynamic, encoder_lengths) for cross. Returns
// the output [B, T, out], float64, padding zeroed by the caller.
#include <torch/library.h>

#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "dimattn/error.h"
#include "dimattn/modules.h"
#include "dimattn/ops.h"
#include "dimattn/torch_interop.h"

namespace {

using namespace dimattn;

struct Config {
  std::map<std::string, std::string> kv;
  double num(const std::string& k, double fallback) const {
    auto it = kv.find(k);
    return it == kv.end() ? fallback : std::stod(it->second);
  }
  int64_t integer(const std::string& k, int64_t fallback) const { return static_cast<int64_t>(num(k, fallback)); }
  bool flag(const std::string& k) const { return integer(k, 0) != 0; }
  std::string text(const std::string& k) const { return kv.at(k); }
};

Config parse(const std::string& s) {
  Config c;
  std::istringstream in(s);
  for (std::string tok; in >> tok;) {
    const auto eq = tok.find('=');
    if (eq == std::string::npos) throw Error("[module_parity] config token '" + tok + "' is not key=value");
    c.kv[tok.substr(0, eq)] = tok.substr(eq + 1);
  }
  return c;
}

// The parameters by state_dict name; each name must be used exactly once.
struct Params {
  std::map<std::string, at::Tensor> by_name;
  at::Tensor take(const std::string& name) {
    auto it = by_name.find(name);
    if (it == by_name.end()) throw Error("[module_parity] no parameter '" + name + "' given");
    at::Tensor t = it->second;
    by_name.erase(it);
    return t;
  }
  void done() const {
    for (const auto& [name, t] : by_name) throw Error("[module_parity] parameter '" + name + "' was not used");
  }
};

// Python's Linear weight is [out, in] (torch's order); the C++ one's {in, out}.
void load_linear(Linear& l, const std::string& prefix, Params& p) {
  l.weight = from_aten(p.take(prefix + ".weight").t(), {l.in_dim, l.out_dim});
  if (l.bias) l.bias = from_aten(p.take(prefix + ".bias"), {l.out_dim});
}

AttentionConfig attention_config(const Config& c) {
  AttentionConfig a{.in_dim = Dim("in", c.integer("in", 0)),
                    .proj_dim = Dim("out", c.integer("out", 0)),
                    .key_dim_total = Dim("key_total", c.integer("key", 0)),
                    .value_dim_total = Dim("value_total", c.integer("value", 0)),
                    .num_heads = c.integer("heads", 1),
                    .seed = 1,
                    .opts = {.dtype = DType::float64, .backend = "torch"}};
  if (c.kv.count("window_left") || c.kv.count("window_right")) {
    AttentionWindow w;
    if (c.kv.count("window_left")) w.left = c.integer("window_left", 0);
    if (c.kv.count("window_right")) w.right = c.integer("window_right", 0);
    a.variants.window = w;
  }
  if (c.kv.count("softcap")) a.variants.softcap = c.num("softcap", 0);
  a.variants.sink_off_by_one = c.flag("off_by_one");
  a.alibi = c.flag("alibi");
  a.sinks = c.flag("sinks");
  if (c.kv.count("rel_buckets"))
    a.relative_position = RelativePositionBuckets{c.integer("rel_buckets", 32), c.integer("rel_max", 128)};
  a.with_bias = c.integer("bias", 1) != 0;
  return a;
}

// Sinks and T5's bias of a self-attention module.
void load_self_extras(SelfAttention& m, Params& p) {
  if (m.sinks) m.sinks = from_aten(p.take("sinks"), {m.heads});
  if (m.relative_position_bias) {
    RelativePositionBias& r = *m.relative_position_bias;
    r.table = from_aten(p.take("relative_position_bias.table"), {r.buckets, r.heads});
  }
}

at::Tensor run(const std::string& config, const at::Tensor& x, const at::Tensor& lengths,
               const std::optional<at::Tensor>& encoder, const std::optional<at::Tensor>& encoder_lengths,
               const std::vector<std::string>& names, const std::vector<at::Tensor>& tensors) {
  const Config c = parse(config);
  const AttentionConfig a = attention_config(c);
  Params p;
  for (size_t i = 0; i < names.size(); ++i) p.by_name[names[i]] = tensors.at(i);
  const Dim batch("batch", x.size(0));
  const Dim time = Dim::dynamic("time", from_aten(lengths, {batch}), x.size(1));
  const Tensor input = from_aten(x, {batch, time, a.in_dim});
  const std::string kind = c.text("kind");
  Tensor y = [&] {
    if (kind == "self" || kind == "causal") {
      auto run_module = [&](auto module) {
        load_linear(module.qkv, "qkv", p);
        load_linear(module.proj, "proj", p);
        load_self_extras(module, p);
        p.done();
        return module(input, time);
      };
      return kind == "self" ? run_module(SelfAttention(a)) : run_module(CausalSelfAttention(a));
    }
    if (kind == "relpos") {
      RelPosConfig rel{.with_linear_pos = c.flag("linear_pos"),
                       .with_pos_bias = c.flag("pos_bias"),
                       .learnable_pos_emb = c.flag("learnable"),
                       .learnable_pos_emb_clipping = c.integer("clipping", 16),
                       .separate_pos_emb_per_head = c.flag("per_head")};
      RelPosSelfAttention m(a, rel);
      load_linear(m.qkv, "qkv", p);
      load_linear(m.proj, "proj", p);
      if (m.linear_pos) load_linear(*m.linear_pos, "linear_pos", p);
      if (m.learned_pos_emb) m.learned_pos_emb = from_aten(p.take("learned_pos_emb"), {m.clipped, m.pos_emb_feat_dim});
      if (m.pos_bias_u) m.pos_bias_u = from_aten(p.take("pos_bias_u"), {m.heads, m.key_dim_per_head});
      if (m.pos_bias_v) m.pos_bias_v = from_aten(p.take("pos_bias_v"), {m.heads, m.key_dim_per_head});
      p.done();
      return m(input, time);
    }
    if (kind == "cross") {
      if (!encoder || !encoder_lengths) throw Error("[module_parity] cross needs encoder and encoder_lengths");
      const Dim enc_feat("enc_feat", c.integer("enc_feat", 0));
      CrossAttention m(a, enc_feat);
      load_linear(m.query, "query", p);
      load_linear(m.kv, "kv", p);
      load_linear(m.proj, "proj", p);
      if (m.sinks) m.sinks = from_aten(p.take("sinks"), {m.heads});
      p.done();
      const Dim enc = Dim::dynamic("enc", from_aten(*encoder_lengths, {batch}), encoder->size(1));
      return m(input, m.transform_encoder(from_aten(*encoder, {batch, enc, enc_feat}), enc));
    }
    throw Error("[module_parity] unknown kind '" + kind + "'");
  }();
  return to_aten(copy_transpose(y, {batch, time, a.proj_dim}));
}

}  // namespace

TORCH_LIBRARY(dimattn_parity, m) {
  m.def("run(str config, Tensor x, Tensor lengths, Tensor? encoder, Tensor? encoder_lengths, str[] names, "
        "Tensor[] params) -> Tensor",
        &run);
}
