// Fuzzes dot_attention's role inference: random dim sets, sizes (0
// included), dynamic lengths (negative, past the extent, float), options
// (dropout, scale, causal dim and offset), dtypes, train flag, tracing,
// forcing and the reference memory limit.
//
// Outcome: a result or a dimattn::Error that names the op called (not an
// internal function it reached), never anything else (any other exception
// escapes and libFuzzer reports it; sanitizers report the rest).
// For a result:
// - its dims are DESIGN.md §3's: values' dims without axis, plus the query's
//   dims without key_dim, plus keys' dims other than axis and key_dim (dims
//   keys/values have and the query lacks are broadcast into the result);
// - its dtype is the query's;
// - without active dropout, it equals an independent computation in plain
//   loops over named indices (masking by lengths and causal offset; a row
//   with no valid kv position gives 0), so it is never NaN for finite input;
// - trace records hold what docs/api.md says.
#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "dimattn/attention.h"
#include "dimattn/error.h"
#include "dimattn/forcing.h"
#include "dimattn/ops.h"
#include "dimattn/ext/backend.h"
#include "dimattn/registry.h"
#include "dimattn/run_context.h"
#include "dimattn/testing/cases.h"
#include "dimattn/trace.h"
#include "fuzz/fuzz_util.h"

using namespace dimattn;

namespace {

// The call being checked, described only on failure (formatting dims for
// every input took a tenth of the run time).
std::function<std::string()> describe_call;

[[noreturn]] void fail(const std::string& what) {
  std::fprintf(stderr, "fuzz_dot_attention: %s\n%s\n", what.c_str(), describe_call ? describe_call().c_str() : "");
  std::abort();
}

using fuzz::Host;
using fuzz::pick_dtype;

void add_unique(Dims& out, const Dims& in, const Dims& skip) {
  for (const Dim& d : in)
    if (!contains(skip, d) && !contains(out, d)) out.push_back(d);
}

// Dims picked from the pool by a bitmask, in an order the input chooses;
// rarely with one dim twice.
Dims pick_dims(FuzzedDataProvider& in, const Dims& pool) {
  Dims out;
  const uint32_t mask = in.ConsumeIntegral<uint32_t>();
  for (size_t i = 0; i < pool.size(); ++i)
    if (mask & (1u << i)) out.push_back(pool[i]);
  for (size_t i = out.size(); i > 1; --i) std::swap(out[i - 1], out[in.ConsumeIntegralInRange<size_t>(0, i - 1)]);
  if (!out.empty() && in.ConsumeIntegralInRange<int>(0, 63) == 0) out.push_back(out.front());
  return out;
}

}  // namespace

fuzz::Stats stats{"fuzz_dot_attention"};

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  bool calling = false;
  const std::vector<std::string> backends = backend_names();
  const std::string be = backends[in.ConsumeIntegralInRange<size_t>(0, backends.size() - 1)];
  const TensorOptions int_opts{.dtype = DType::int64, .backend = be};
  describe_call = [be] { return "backend " + be; };

  try {
    // --- a pool of dims: static (0..4) and dynamic over earlier static dims ---
    Dims pool;
    // Defaults (the bytes run out: zeros) give a plain valid call, so that
    // short inputs reach the kernels; the rare choices sit at the far ends.
    const int n = 2 + (in.ConsumeIntegralInRange<int>(0, 5) + 1) % 6;  // 2..7, default 3
    for (int i = 0; i < n; ++i) {
      const int raw = in.ConsumeIntegralInRange<int>(0, 15);
      const int64_t extent = raw == 15 ? 0 : 1 + (raw + 2) % 4;  // 0..4, default 3
      // Names repeat sometimes: identity, not name, makes a dim.
      const std::string name = "d" + std::to_string(in.ConsumeIntegralInRange<int>(0, 5) == 5 ? 0 : i);
      Dims statics;
      for (const Dim& d : pool)
        if (!d.is_dynamic()) statics.push_back(d);
      if (!statics.empty() && in.ConsumeIntegralInRange<int>(0, 3) == 3) {
        Dims over;
        for (const Dim& d : statics)
          if (in.ConsumeBool()) over.push_back(d);
        int64_t count = 1;
        for (const Dim& d : over) count *= d.extent();
        std::vector<double> lens;
        for (int64_t j = 0; j < count; ++j)
          lens.push_back(in.ConsumeIntegralInRange<int>(0, 15) == 15 ? in.ConsumeIntegralInRange<int>(-2, extent + 2)
                                                                      : extent - in.ConsumeIntegralInRange<int64_t>(0, extent));
        const int lk = in.ConsumeIntegralInRange<int>(0, 9);
        const DType ldt = lk == 9 ? DType::float32 : lk == 8 ? DType::int32 : DType::int64;
        const Tensor lengths = from_host(over, lens, {.dtype = ldt, .backend = be});
        const std::optional<int64_t> ext = in.ConsumeBool() ? std::optional<int64_t>(extent) : std::nullopt;
        pool.push_back(Dim::dynamic(name, lengths, ext));
      } else {
        pool.push_back(Dim(name, extent));
      }
    }

    // --- operands ---
    // Mostly by roles (batch, query-only, keys-only, value feature, unused),
    // so that most calls are valid and reach the kernels; else any subsets.
    AttentionOptions o{.key_dim = pool[in.ConsumeIntegralInRange<size_t>(0, pool.size() - 1)],
                       .axis = pool[in.ConsumeIntegralInRange<size_t>(0, pool.size() - 1)]};
    Dims qd, kd, vd;
    if (in.ConsumeIntegralInRange<int>(0, 3) != 3) {
      if (o.axis == o.key_dim && pool.size() > 1) o.axis = pool[(index_of(pool, o.key_dim) + 1) % pool.size()];
      Dims vfeat;
      for (const Dim& d : pool) {
        if (d == o.key_dim || d == o.axis) continue;
        switch (in.ConsumeIntegralInRange<int>(0, 4)) {
          case 0: qd.push_back(d), kd.push_back(d), vd.push_back(d); break;  // batch
          case 1: qd.push_back(d); break;                                      // the query's own
          case 2: kd.push_back(d), vd.push_back(d); break;                    // keys-only
          case 3: vfeat.push_back(d); break;                                   // value feature
          default: break;
        }
      }
      qd.push_back(o.key_dim);
      if (in.ConsumeIntegralInRange<int>(0, 3) == 3) qd.push_back(o.axis);  // self-attention
      kd.push_back(o.axis), kd.push_back(o.key_dim);
      vd.push_back(o.axis);
      if (vfeat.empty() || in.ConsumeIntegralInRange<int>(0, 7) == 0) vfeat.push_back(o.key_dim);
      vd.insert(vd.end(), vfeat.begin(), vfeat.end());
      for (Dims* ds : {&qd, &kd, &vd})
        for (size_t i = ds->size(); i > 1; --i) std::swap((*ds)[i - 1], (*ds)[in.ConsumeIntegralInRange<size_t>(0, i - 1)]);
    } else {
      qd = pick_dims(in, pool), kd = pick_dims(in, pool), vd = pick_dims(in, pool);
    }
    const DType dt = pick_dtype(in);
    const DType vdt = in.ConsumeIntegralInRange<int>(0, 31) == 31 ? pick_dtype(in) : dt;
    static const double kDropouts[] = {0, 0, 0, 0.1, 0.5, 0.99, -0.1, 1.0, NAN, INFINITY};
    o.att_dropout = kDropouts[in.ConsumeIntegralInRange<int>(0, 9)];
    o.att_dropout_broadcast = in.ConsumeBool();
    if (in.ConsumeIntegralInRange<int>(0, 2) == 2) {
      const Dims& from = in.ConsumeBool() && !qd.empty() ? qd : pool;
      o.causal_query_spatial_dim = from[in.ConsumeIntegralInRange<size_t>(0, from.size() - 1)];
    }
    if (in.ConsumeIntegralInRange<int>(0, 3) == 3) {
      Dims od;
      for (const Dim& d : qd)
        if (in.ConsumeBool()) od.push_back(d);
      int64_t count = 1;
      for (const Dim& d : od) count *= d.extent();
      std::vector<double> offs;
      for (int64_t j = 0; j < count && j < 4096; ++j) offs.push_back(in.ConsumeIntegralInRange<int>(-3, 6));
      if (static_cast<int64_t>(offs.size()) == count) {
        const int ok = in.ConsumeIntegralInRange<int>(0, 9);
        const DType odt = ok == 9 ? DType::float32 : ok == 8 ? DType::int32 : DType::int64;
        o.causal_offset = from_host(od, offs, {.dtype = odt, .backend = be});
      }
    }
    static const double kScales[] = {0.5, 1.0, 0.0, -2.0, 3.0, NAN, INFINITY, -INFINITY};
    if (in.ConsumeBool()) o.scale = kScales[in.ConsumeIntegralInRange<int>(0, 7)];
    const bool train = in.ConsumeBool();
    const int mode = in.ConsumeIntegralInRange<int>(0, 7);
    const bool low_limit = in.ConsumeIntegralInRange<int>(0, 15) == 15;
    // Variants (docs/api.md), from the input's last bytes (zeros: none):
    // a positional dim, a window, soft-capping, ALiBi slopes and sinks over
    // any dims of the pool (valid ones mostly over the query's), a bias and a
    // bool mask over any dims, positions (a block of a longer sequence;
    // negative ones are bad).
    const int variants = in.ConsumeIntegralInRange<int>(0, 255);
    auto maybe_bound = [&]() -> std::optional<int64_t> {
      const int b = in.ConsumeIntegralInRange<int>(0, 6);
      return b == 6 ? std::nullopt : std::optional<int64_t>(b - 1);  // -1 (bad) .. 4, or unbounded
    };
    auto some_dims = [&](int one_in) {
      const Dims& from = in.ConsumeBool() ? qd : pool;
      Dims dims;
      for (const Dim& d : from)
        if (in.ConsumeIntegralInRange<int>(0, one_in - 1) == 0) dims.push_back(d);
      return dims;
    };
    auto per_head = [&]() {
      const Dims dims = some_dims(4);
      const int kind = in.ConsumeIntegralInRange<int>(0, 7);
      return testing::random_operand(dims, 5 + kind, kind == 7 ? DType::int64 : dt, be);
    };
    if (variants & 1) {
      const Dims& from = in.ConsumeBool() && !qd.empty() ? qd : pool;
      o.query_position_dim = from[in.ConsumeIntegralInRange<size_t>(0, from.size() - 1)];
    }
    if (variants & 2) o.variants.window = AttentionWindow{maybe_bound(), maybe_bound()};
    static const double kSoftcaps[] = {2.0, 0.5, 30.0, 0.0, -1.0, NAN, INFINITY, 1e-30};
    if (variants & 4) o.variants.softcap = kSoftcaps[in.ConsumeIntegralInRange<int>(0, 7)];
    if (variants & 8) o.variants.alibi_slopes = per_head();
    if (variants & 16) {
      if (in.ConsumeBool())
        o.variants.sink_off_by_one = true;
      else
        o.variants.sinks = per_head();
    }
    if (variants & 32) {  // mostly float32 or the call's dtype; sometimes bool (bad)
      const Dims dims = some_dims(2);
      const int kind = in.ConsumeIntegralInRange<int>(0, 7);
      o.variants.bias = kind == 7 ? compare(testing::random_operand(dims, 13, DType::float32, be), Compare::gt, 0.0)
                         : testing::random_operand(dims, 13, kind < 4 ? dt : DType::float32, be);
    }
    if (variants & 64) {  // true with probability 3/4; sometimes float (bad)
      const Dims dims = some_dims(2);
      const Tensor u = testing::random_operand(dims, 14, DType::float32, be);
      o.variants.mask = in.ConsumeIntegralInRange<int>(0, 7) == 7 ? u : compare(u, Compare::gt, -0.67);
    }
    if (variants & 128)
      o.positions = AttentionPositions{in.ConsumeIntegralInRange<int64_t>(-1, 40),
                                       in.ConsumeIntegralInRange<int64_t>(-1, 40)};

    describe_call = [=] {
      return "backend " + be + " q" + repr(qd) + " k" + repr(kd) + " v" + repr(vd) + " dtype " + dtype_name(dt) + "/" +
                     dtype_name(vdt) + " key_dim " + o.key_dim.repr() + " axis " + o.axis.repr() + " dropout " +
                     std::to_string(o.att_dropout) + (o.att_dropout_broadcast ? " broadcast" : "") + " causal " +
                     (o.causal_query_spatial_dim ? o.causal_query_spatial_dim->repr() : "-") + " offset " +
                     (o.causal_offset ? o.causal_offset->repr() : "-") + " scale " +
                     (o.scale ? std::to_string(*o.scale) : "-") + " train " + std::to_string(train) + " mode " +
                     std::to_string(mode) + " low_limit " + std::to_string(low_limit) + " variants " +
                     std::to_string(variants) + " position " +
                     (o.query_position_dim ? o.query_position_dim->repr() : "-") + " window " +
                     (o.variants.window ? std::to_string(o.variants.window->left.value_or(-99)) + "," +
                                     std::to_string(o.variants.window->right.value_or(-99))
                               : "-") +
                     " softcap " + (o.variants.softcap ? std::to_string(*o.variants.softcap) : "-") + " alibi " +
                     (o.variants.alibi_slopes ? o.variants.alibi_slopes->repr() : "-") + " sinks " +
                     (o.variants.sinks ? o.variants.sinks->repr() : o.variants.sink_off_by_one ? "off-by-one" : "-") + " bias " +
                     (o.variants.bias ? o.variants.bias->repr() : "-") + " mask " + (o.variants.mask ? o.variants.mask->repr() : "-") + " positions " +
                     (o.positions ? std::to_string(o.positions->query) + "," + std::to_string(o.positions->kv) : "-");
    };

    // Any dims, any dtype (integer operands drawn as floats and cast): the
    // case library's operand builder.
    const Tensor q = testing::random_operand(qd, 1, dt, be), k = testing::random_operand(kd, 2, dt, be),
                 v = testing::random_operand(vd, 3, vdt, be);

    // --- the call ---
    TrainFlagScope train_scope(train);
    set_random_seed(42);
    struct LimitGuard {
      int64_t saved = reference_memory_limit();
      ~LimitGuard() { set_reference_memory_limit(saved); }
    } limit_guard;
    if (low_limit) set_reference_memory_limit(64);

    std::optional<Tensor> out;
    std::optional<TraceScope> trace;
    std::optional<ForceKernels> force;
    if (mode == 1) trace.emplace(true);
    if (mode == 2) trace.emplace(false);
    if (mode == 3) force.emplace("reference");
    if (mode == 4) force.emplace("cpu_flash");
    calling = true;  // errors from here on come from the calls checked
    if (mode == 5) {
      const Decision d = explain_attention(q, k, v, o);
      if (d.kernel.empty()) fail("explain_attention chose no kernel");
      return 0;
    }
    out = dot_attention(q, k, v, o);
    ++stats.results;
    if (mode == 6) {
      // Gradients through cpu_flash (backends without autograd): the input
      // dims, and finite wherever the inputs are (dropout included).
      const Tensor g_out = random_normal(out->dims(), 4, {.dtype = out->dtype(), .backend = be});
      set_random_seed(42);
      const AttentionGrads g = dot_attention_backward(q, k, v, o, g_out);
      const Tensor* ins[] = {&q, &k, &v};
      const Tensor* gs[] = {&g.query, &g.keys, &g.values};
      for (int i = 0; i < 3; ++i) {
        if (!testing::same_dims(gs[i]->dims(), ins[i]->dims()))
          fail("gradient dims " + repr(gs[i]->dims()) + " differ from the input's " + repr(ins[i]->dims()));
        for (double x : to_host(*gs[i]))
          if (!std::isfinite(x)) fail("a gradient is not finite for finite inputs");
      }
    }
    calling = false;

    // --- dims and dtype ---
    Dims expected;
    add_unique(expected, vd, {o.axis});
    add_unique(expected, qd, {o.key_dim});
    add_unique(expected, kd, {o.axis, o.key_dim});
    if (!testing::same_dims(out->dims(), expected))
      fail("result dims " + repr(out->dims()) + " are not the contract's " + repr(expected));
    if (out->dtype() != dt) fail(std::string("result dtype ") + dtype_name(out->dtype()) + " is not the query's");

    if (trace) {
      if (trace->records().size() != 1) fail("trace scope holds " + std::to_string(trace->records().size()) + " records");
      const AttentionTrace& r = trace->records()[0];
      if (!testing::same_dims(r.output.dims(), out->dims())) fail("traced output dims differ from the result's");
      if (mode == 1 && (r.kernel != "reference" || !r.energy || !r.att_weights))
        fail("a capturing trace did not record the reference path's energy and weights");
      if (mode == 2 && (r.energy || r.att_weights)) fail("a non-capturing trace recorded tensors");
    }

    // --- values, against plain loops ---
    const bool dropout_on = train && o.att_dropout > 0;
    if (dropout_on) {
      for (double x : to_host(*out))
        if (!std::isfinite(x)) fail("a result with dropout is not finite for finite inputs");
      return 0;
    }
    const double scale = o.scale.value_or(1.0 / std::sqrt(static_cast<double>(o.key_dim.extent())));
    const Host hq(q), hk(k), hv(v), ho(*out);
    std::optional<Host> hlen, hoff;
    if (o.axis.is_dynamic()) hlen.emplace(o.axis.lengths());
    if (o.causal_offset) hoff.emplace(*o.causal_offset);
    std::optional<Host> hslopes, hsinks;
    if (o.variants.alibi_slopes) hslopes.emplace(*o.variants.alibi_slopes);
    if (o.variants.sinks) hsinks.emplace(*o.variants.sinks);
    std::optional<Host> hbias, hmask;  // over the kv position as `axis`
    if (o.variants.bias) hbias.emplace(*o.variants.bias);
    if (o.variants.mask) hmask.emplace(cast(*o.variants.mask, DType::float32));
    const std::optional<Dim> position = o.causal_query_spatial_dim ? o.causal_query_spatial_dim : o.query_position_dim;
    const int64_t nk = o.axis.extent(), nd = o.key_dim.extent();
    const double tol = dt == DType::float64 ? 1e-9 : dt == DType::float32 ? 2e-4 : 5e-2;
    std::map<Dim, int64_t> idx;
    for (const Dim& d : ho.dims) idx[d] = 0;
    for (size_t flat = 0; flat < ho.data.size(); ++flat) {
      // idx: the output element's coordinates, in ho's row-major order.
      size_t rem = flat;
      for (int a = static_cast<int>(ho.dims.size()) - 1; a >= 0; --a) {
        const int64_t e = ho.dims[a].extent();
        idx[ho.dims[a]] = static_cast<int64_t>(rem % static_cast<size_t>(e));
        rem /= static_cast<size_t>(e);
      }
      int64_t len = nk;
      if (hlen) len = static_cast<int64_t>(hlen->at(idx));
      // The diagonal of row i: i + offset along the positional dim (a block
      // of a longer sequence: its rows and kv positions shifted by positions).
      const int64_t shift = o.positions ? o.positions->query - o.positions->kv : 0;
      const int64_t diag =
          position ? idx.at(*position) + (hoff ? static_cast<int64_t>(hoff->at(idx)) : 0) + shift : 0;
      std::vector<double> e;
      std::vector<int64_t> js;
      for (int64_t j = 0; j < nk; ++j) {
        if (j >= len || (o.causal_query_spatial_dim && j > diag)) continue;
        if (o.variants.window && o.variants.window->left && j < diag - *o.variants.window->left) continue;
        if (o.variants.window && o.variants.window->right && j > diag + *o.variants.window->right) continue;
        std::map<Dim, int64_t> qi = idx, ki = idx;
        ki[o.axis] = j;
        if (hmask && hmask->at(ki) == 0) continue;
        double s = 0;
        for (int64_t c = 0; c < nd; ++c) {
          qi[o.key_dim] = ki[o.key_dim] = c;
          s += hq.at(qi) * hk.at(ki);
        }
        s *= scale;
        if (o.variants.softcap) s = *o.variants.softcap * std::tanh(s / *o.variants.softcap);
        if (hbias) s += hbias->at(ki);
        if (hslopes) s -= hslopes->at(idx) * static_cast<double>(std::abs(diag - j));
        e.push_back(s);
        js.push_back(j);
      }
      const bool sink = hsinks || o.variants.sink_off_by_one;
      std::map<Dim, int64_t> vi = idx;
      const double want = fuzz::softmax_average(e, sink && !e.empty() ? std::optional<double>(hsinks ? hsinks->at(idx) : 0.0)
                                                                       : std::nullopt,
                                                [&](size_t t) {
                                                  vi[o.axis] = js[t];
                                                  return hv.at(vi);
                                                });
      const double got = ho.data[flat];
      if (!(std::abs(got - want) <= tol * std::max(1.0, std::abs(want))))
        fail("result element " + std::to_string(flat) + " is " + std::to_string(got) + ", plain loops give " +
             std::to_string(want));
    }
    ++stats.checked;
  } catch (const dimattn::Error& e) {
    // A clear error is a valid outcome for bad input: one that names the
    // op the caller called (not an internal function it reached).
    ++stats.errors;
    const std::string what = e.what();
    static const char* const kOps[] = {"[dot_attention]", "[explain_attention]", "[dot_attention_backward]"};
    if (calling && std::none_of(std::begin(kOps), std::end(kOps), [&](const char* op) { return what.rfind(op, 0) == 0; }))
      fail("an error that does not name the op called: " + what);
  }
  return 0;
}
