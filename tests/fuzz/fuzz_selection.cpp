// Fuzzes kernel-selection keys (core/include/dimattn/selection.h):
// equal params ⇔ equal hash and decision.
//
// Part 1, on AttentionParams directly: a random params value and a copy with
// 0-3 fields changed.
// - equal params → equal hash, equal description, equal (cached) decision;
// - params differing in one field → different hash and description (the
//   description lists every field; a collision of a one-field change would
//   make the cache's buckets degenerate);
// - every cached decision equals a fresh, uncached decision over the same
//   candidates (the cache never hands one key's decision to another), and a
//   forced list that no candidate passes is an Error listing every candidate;
// - counters: one lookup per call; one selection per new key that decides.
// Part 2, through dot_attention's own path (explain_attention): calls that
// differ only in batch sizes, sequence lengths and dropout seeds give equal
// params, so the second call is a cache hit (no new selection).
#include <fuzzer/FuzzedDataProvider.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "dimattn/attention.h"
#include "dimattn/error.h"
#include "dimattn/forcing.h"
#include "dimattn/ops.h"
#include "dimattn/ext/backend.h"
#include "dimattn/registry.h"
#include "dimattn/run_context.h"
#include "dimattn/selection.h"

using namespace dimattn;

namespace {

[[noreturn]] void fail(const std::string& what, const AttentionParams& a, const AttentionParams& b) {
  std::fprintf(stderr, "fuzz_selection: %s\n  a: %s\n  b: %s\n", what.c_str(), a.describe().c_str(),
               b.describe().c_str());
  std::abort();
}

const char* const kForced[] = {"auto", "reference", "aten_math", "aten_flash_cpu,reference", "cpu_flash",
                               "cpu_flash,aten_math", "reference,aten_math", "cuda_flash"};
constexpr int kFields = 16;

// Sets field `f` of p from the input.
void set_field(AttentionParams& p, int f, FuzzedDataProvider& in) {
  switch (f) {
    case 0: p.device = in.ConsumeBool() ? DeviceType::cpu : DeviceType::cuda; break;
    case 1: p.dtype = static_cast<DType>(in.ConsumeIntegralInRange<int>(0, 6)); break;
    case 2: p.head_dim_qk = in.ConsumeIntegralInRange<int64_t>(0, 300); break;
    case 3: p.head_dim_v = in.ConsumeIntegralInRange<int64_t>(0, 300); break;
    case 4: p.causal = in.ConsumeBool(); break;
    case 5: p.offset = in.ConsumeBool() ? OffsetKind::none : OffsetKind::nonzero; break;
    case 6: p.dropout = in.ConsumeBool(); break;
    case 7: p.dropout_broadcast = in.ConsumeBool(); break;
    case 8: p.padding = static_cast<Padding>(in.ConsumeIntegralInRange<int>(0, 2)); break;
    case 9: p.gqa_ratio = in.ConsumeIntegralInRange<int64_t>(1, 16); break;
    case 10: p.keys_only = in.ConsumeBool(); break;
    case 11: p.layout = static_cast<LayoutClass>(in.ConsumeIntegralInRange<int>(0, 4)); break;
    case 12: p.requires_grad = in.ConsumeBool(); break;
    case 13: p.deterministic = in.ConsumeBool(); break;
    case 14: p.forced = kForced[in.ConsumeIntegralInRange<int>(0, 7)]; break;
    case 15:
      p.variants.bits = in.ConsumeIntegralInRange<uint32_t>(0, (1u << static_cast<unsigned>(VariantKind::count_)) - 1);
      break;
  }
}

struct Candidate {
  std::string name;
  std::function<GateResult(const AttentionParams&)> gate;
};

// The same candidates on every device (their gates read the device, as the
// real backends' tables list each device's own).
KernelTable on_every_device(const std::vector<Candidate>& candidates) {
  KernelTable t;
  for (const DeviceType device : {DeviceType::cpu, DeviceType::cuda})
    for (const Candidate& c : candidates) t.push_back({.name = c.name, .device = device, .gate = c.gate});
  return t;
}

// Candidates whose gates read many fields, as the real backends' do.
const KernelTable& candidates(int which) {
  static const KernelTable a = on_every_device({
      {"cpu_flash",
       [](const AttentionParams& p) {
         if (p.device != DeviceType::cpu) return GateResult::fail("cpu only");
         if (p.layout == LayoutClass::strided) return GateResult::fail("strided");
         if (p.head_dim_qk % 8 || p.head_dim_qk != p.head_dim_v) return GateResult::fail("head dims");
         return GateResult::pass();
       }},
      {"aten_flash_cpu",
       [](const AttentionParams& p) {
         if (p.dropout || (p.causal && p.gqa_ratio > 1)) return GateResult::fail("dropout or causal gqa");
         if (p.padding != Padding::none && p.offset == OffsetKind::nonzero) return GateResult::fail("mask");
         if (p.variants.any()) return GateResult::fail("variants");
         return GateResult::pass();
       }},
      {"aten_math",
       [](const AttentionParams& p) {
         if (p.dropout && !p.dropout_broadcast) return GateResult::fail("dropout");
         if (p.requires_grad && p.deterministic) return GateResult::fail("deterministic");
         return GateResult::pass();
       }},
      {"reference", [](const AttentionParams&) { return GateResult::pass(); }}});
  static const KernelTable b = on_every_device({
      {"cuda_flash",
       [](const AttentionParams& p) {
         if (p.device != DeviceType::cuda) return GateResult::fail("cuda only");
         if (p.dtype != DType::float16 && p.dtype != DType::bfloat16) return GateResult::fail("16-bit only");
         if (p.keys_only) return GateResult::fail("keys only");
         return GateResult::pass();
       }},
      {"reference", [](const AttentionParams&) { return GateResult::pass(); }}});
  return which == 0 ? a : b;
}

// The decision without any cache: the rule selection.h states.
struct Fresh {
  bool ok;
  std::string kernel;
};
Fresh decide_fresh(const AttentionParams& p, const KernelTable& table) {
  const KernelForce force = parse_kernel_force(p.forced);
  for (const KernelEntry& e : table)
    if (e.device == p.device && force.allows(e.name) && e.gate(p).ok) return {true, e.name};
  return {false, ""};
}

// Forcing knows the kernels of registered backends' tables only. The
// synthetic candidates' names (those of the torch backend, which this
// Eigen-only build lacks) are declared by a backend that has nothing but a
// kernel table; selection never runs its kernels.
class NamesOnlyBackend final : public Backend {
  [[noreturn]] static RawPtr none() { throw Error("[fuzz_selection] the names-only backend has no primitives"); }

 public:
  std::string name() const override { return "fuzz_names_only"; }
  bool supports(Device) const override { return false; }
  const KernelTable& attention_table() const override {
    static const KernelTable table = [] {
      KernelTable t;
      for (int which : {0, 1})
        for (const KernelEntry& e : candidates(which))
          if (e.device == (which == 0 ? DeviceType::cpu : DeviceType::cuda)) t.push_back(e);
      return t;
    }();
    return table;
  }
  RawPtr full(const Shape&, double, DType, Device) override { none(); }
  RawPtr from_host(const Shape&, const std::vector<double>&, DType, Device) override { none(); }
  std::vector<double> to_host(const RawPtr&) override { none(); }
  RawPtr random(const Shape&, RandomKind, double, double, uint64_t, DType, Device) override { none(); }
  RawPtr arange(int64_t, DType, Device) override { none(); }
  Shape shape(const RawPtr&) override { none(); }
  RawPtr cast(const RawPtr&, DType) override { none(); }
  RawPtr to_device(const RawPtr&, Device) override { none(); }
  RawPtr permute(const RawPtr&, const std::vector<int>&) override { none(); }
  RawPtr reshape(const RawPtr&, const Shape&) override { none(); }
  RawPtr expand(const RawPtr&, const Shape&) override { none(); }
  RawPtr concat(const std::vector<RawPtr>&, int) override { none(); }
  RawPtr slice(const RawPtr&, int, int64_t, int64_t) override { none(); }
  RawPtr gather(const RawPtr&, int, const RawPtr&) override { none(); }
  RawPtr contiguous(const RawPtr&) override { none(); }
  RawPtr binary(BinaryOp, const RawPtr&, const RawPtr&) override { none(); }
  RawPtr unary(UnaryOp, const RawPtr&) override { none(); }
  RawPtr where(const RawPtr&, const RawPtr&, const RawPtr&) override { none(); }
  RawPtr reduce(ReduceOp, const RawPtr&, const std::vector<int>&) override { none(); }
  RawPtr softmax(const RawPtr&, int, bool) override { none(); }
  RawPtr bmm(const RawPtr&, const RawPtr&) override { none(); }
};

std::set<std::string>& decided_keys() {
  static std::set<std::string> keys;
  return keys;
}

// select_kernel, checked against the fresh decision and the counters.
void check_select(const std::string& backend, int which, const AttentionParams& p) {
  const SelectionStats before = selection_stats();
  const Fresh want = decide_fresh(p, candidates(which));
  const std::string key = backend + "|" + p.describe();
  const bool is_new = !decided_keys().count(key);
  std::string got;
  try {
    got = select_kernel(backend, p, candidates(which), KernelUse::run).kernel;
  } catch (const Error& e) {
    if (want.ok) fail(std::string("select_kernel threw, a fresh decision picks ") + want.kernel + ": " + e.what(), p, p);
    const std::string msg = e.what();
    for (const KernelEntry& e : candidates(which))
      if (e.device == p.device && msg.find("\n  " + e.name + ": ") == std::string::npos)
        fail("the no-kernel error does not list candidate " + e.name + ": " + msg, p, p);
  }
  if (want.ok && got != want.kernel) fail("cached decision " + got + " differs from the fresh " + want.kernel, p, p);
  const SelectionStats after = selection_stats();
  if (after.lookups != before.lookups + 1) fail("lookups did not grow by one", p, p);
  const uint64_t new_selections = want.ok && is_new ? 1 : 0;
  if (after.selections != before.selections + new_selections)
    fail("selections grew by " + std::to_string(after.selections - before.selections) + ", expected " +
             std::to_string(new_selections),
         p, p);
  if (want.ok) decided_keys().insert(key);
}

void params_part(FuzzedDataProvider& in) {
  AttentionParams a;
  for (int f = 0; f < kFields; ++f) set_field(a, f, in);
  AttentionParams b = a;
  const int changes = in.ConsumeIntegralInRange<int>(0, 3);
  for (int i = 0; i < changes; ++i) set_field(b, in.ConsumeIntegralInRange<int>(0, kFields - 1), in);
  const AttentionParamsHash hash;
  if (a == b) {
    if (hash(a) != hash(b)) fail("equal params, different hashes", a, b);
    if (a.describe() != b.describe()) fail("equal params, different descriptions", a, b);
  } else {
    if (a.describe() == b.describe()) fail("different params, equal descriptions", a, b);
    int differing = 0;
    for (int f = 0; f < kFields; ++f) {
      AttentionParams c = a;
      // Count fields by copying each of b's fields in turn.
      switch (f) {
        case 0: c.device = b.device; break;
        case 1: c.dtype = b.dtype; break;
        case 2: c.head_dim_qk = b.head_dim_qk; break;
        case 3: c.head_dim_v = b.head_dim_v; break;
        case 4: c.causal = b.causal; break;
        case 5: c.offset = b.offset; break;
        case 6: c.dropout = b.dropout; break;
        case 7: c.dropout_broadcast = b.dropout_broadcast; break;
        case 8: c.padding = b.padding; break;
        case 9: c.gqa_ratio = b.gqa_ratio; break;
        case 10: c.keys_only = b.keys_only; break;
        case 11: c.layout = b.layout; break;
        case 12: c.requires_grad = b.requires_grad; break;
        case 13: c.deterministic = b.deterministic; break;
        case 14: c.forced = b.forced; break;
        case 15: c.variants = b.variants; break;
      }
      differing += !(c == a);
    }
    if (differing == 1 && hash(a) == hash(b)) fail("params differing in one field have equal hashes", a, b);
  }
  const int which = in.ConsumeIntegralInRange<int>(0, 1);
  const std::string backend = which == 0 ? "fuzz_a" : "fuzz_b";
  check_select(backend, which, a);
  check_select(backend, which, b);
  check_select(backend, which, a);
}

// Two calls with one configuration and different sizes, lengths and seeds.
void call_part(FuzzedDataProvider& in) {
  const bool dynamic = in.ConsumeBool(), causal = in.ConsumeBool(), groups = in.ConsumeBool(),
             keys_only = in.ConsumeBool(), train = in.ConsumeBool(), broadcast = in.ConsumeBool(),
             with_offset = in.ConsumeBool();
  const int64_t d = in.ConsumeIntegralInRange<int64_t>(1, 8), dv = in.ConsumeIntegralInRange<int64_t>(1, 8),
                g = in.ConsumeIntegralInRange<int64_t>(2, 3);
  const DType dt = in.ConsumeBool() ? DType::float32 : DType::float64;
  Decision first;
  for (int call = 0; call < 2; ++call) {
    // Two size changes rightly change the key (fuzz findings,
    // docs/reliability.md): a dim of size 1 makes its stride irrelevant, so
    // the layout class may differ; and the longest query-only dim is the
    // query's spatial dim, so time shorter than group swaps their roles and
    // gqa_ratio. Sizes here stay clear of both: at least 2, time > group.
    const int64_t batch_n = in.ConsumeIntegralInRange<int64_t>(2, 4), t_n = in.ConsumeIntegralInRange<int64_t>(4, 6);
    const TensorOptions opts{.dtype = dt, .backend = "eigen"};
    Dim batch("batch", batch_n), feat("feat", d), vfeat("vfeat", dv), group("group", g), extra("extra", 2);
    Dim time("time", t_n);
    Dim kv = time;
    if (dynamic) {
      std::vector<double> lens;
      for (int64_t b = 0; b < batch_n; ++b) lens.push_back(in.ConsumeIntegralInRange<int64_t>(0, t_n));
      kv = Dim::dynamic("kv", from_host({batch}, lens, {.dtype = DType::int64, .backend = "eigen"}), t_n);
    }
    Dims qd = {batch, time, feat}, kd = {batch, kv, feat}, vd = {batch, kv, vfeat};
    if (groups) qd.push_back(group);
    if (keys_only) kd.push_back(extra), vd.push_back(extra);
    AttentionOptions o{.key_dim = feat, .axis = kv, .att_dropout = 0.25, .att_dropout_broadcast = broadcast};
    if (causal) {
      o.causal_query_spatial_dim = time;
      if (with_offset) {
        std::vector<double> offs;
        for (int64_t b = 0; b < batch_n; ++b) offs.push_back(in.ConsumeIntegralInRange<int64_t>(0, 3));
        o.causal_offset = from_host({batch}, offs, {.dtype = DType::int64, .backend = "eigen"});
      }
    }
    const Tensor q = random_normal(qd, 1, opts), k = random_normal(kd, 2, opts), v = random_normal(vd, 3, opts);
    TrainFlagScope train_scope(train);
    set_random_seed(in.ConsumeIntegral<uint64_t>());
    const SelectionStats before = selection_stats();
    const Decision dec = explain_attention(q, k, v, o);
    const SelectionStats after = selection_stats();
    if (call == 0) {
      first = dec;
    } else {
      if (after.selections != before.selections)
        fail("a call differing only in sizes, lengths and seeds selected again", {}, {});
      if (dec.kernel != first.kernel) fail("equal configurations, different decisions", {}, {});
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const bool registered = [] {
    if (!has_backend("fuzz_names_only")) register_backend(std::make_unique<NamesOnlyBackend>());
    return true;
  }();
  (void)registered;
  FuzzedDataProvider in(data, size);
  if (in.ConsumeBool()) {
    params_part(in);
  } else if (has_backend("eigen")) {
    try {
      call_part(in);
    } catch (const Error& e) {
      // The configurations above are all valid: an error here is a bug.
      std::fprintf(stderr, "fuzz_selection: a valid call was rejected: %s\n", e.what());
      std::abort();
    }
  }
  return 0;
}
