#include "dimattn/selection.h"

#include "dimattn/ext/attention_call.h"

#include "dimattn/ext/kernel_table.h"

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <sstream>
#include <unordered_map>

#include "dimattn/error.h"
#include "dimattn/forcing.h"
#include "dimattn/internal/check.h"
#include "dimattn/internal/counters.h"

namespace dimattn {

const char* layout_name(LayoutClass c) {
  switch (c) {
    case LayoutClass::separate: return "separate";
    case LayoutClass::permuted: return "permuted";
    case LayoutClass::packed_qkv: return "packed_qkv";
    case LayoutClass::packed_kv: return "packed_kv";
    case LayoutClass::strided: return "strided";
  }
  return "?";
}

const char* padding_name(Padding p) {
  switch (p) {
    case Padding::none: return "none";
    case Padding::per_entry: return "per_entry";
    case Padding::per_row: return "per_row";
  }
  return "?";
}

std::string AttentionParams::describe() const {
  std::ostringstream os;
  os << "device=" << (device == DeviceType::cpu ? "cpu" : "cuda") << " dtype=" << dtype_name(dtype)
     << " head_dim=" << head_dim_qk << "/" << head_dim_v << " causal=" << causal
     << " offset=" << (offset == OffsetKind::none ? "none" : "nonzero") << " dropout=" << dropout
     << " broadcast_dropout=" << dropout_broadcast << " padding=" << padding_name(padding) << " gqa_ratio=" << gqa_ratio
     << " keys_only=" << keys_only << " layout=" << layout_name(layout) << " requires_grad=" << requires_grad
     << " deterministic=" << deterministic << " variants=" << variants.names() << " forced=" << forced;
  return os.str();
}

size_t AttentionParamsHash::operator()(const AttentionParams& p) const {
  size_t h = std::hash<std::string>()(p.forced);
  auto mix = [&h](uint64_t v) { h ^= std::hash<uint64_t>()(v) + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2); };
  mix(static_cast<uint64_t>(p.device));
  mix(static_cast<uint64_t>(p.dtype));
  mix(static_cast<uint64_t>(p.head_dim_qk));
  mix(static_cast<uint64_t>(p.head_dim_v));
  mix(static_cast<uint64_t>(p.gqa_ratio));
  mix(static_cast<uint64_t>(p.layout));
  mix(static_cast<uint64_t>(p.offset));
  mix(static_cast<uint64_t>(p.padding));
  mix((uint64_t{p.causal} << 0) | (uint64_t{p.dropout} << 1) | (uint64_t{p.dropout_broadcast} << 2) |
      (uint64_t{p.keys_only} << 3) | (uint64_t{p.requires_grad} << 4) | (uint64_t{p.deterministic} << 5) |
      (uint64_t{p.variants.bits} << 6));
  return h;
}

std::string Decision::explain() const {
  std::string s = "selected " + kernel + (isa.empty() ? "" : " (isa " + isa + ")");
  for (const auto& r : rejected) s += "\n  rejected " + r.kernel + ": " + r.reason;
  return s;
}

namespace {

struct Key {
  std::string backend;
  AttentionParams params;
  KernelUse use;
  bool operator==(const Key&) const = default;
};
struct KeyHash {
  size_t operator()(const Key& k) const {
    return AttentionParamsHash()(k.params) ^ std::hash<std::string>()(k.backend) ^ static_cast<size_t>(k.use);
  }
};

struct Cache {
  std::mutex mu;
  std::unordered_map<Key, Decision, KeyHash> decisions;
  uint64_t selections = 0;
  std::atomic<uint64_t> lookups{0}, copies{0}, epoch{0};
};
Cache& cache() {
  static Cache* c = new Cache;  // never destroyed: selection may run during static destruction
  return *c;
}

bool debug_enabled() {
  const char* env = std::getenv("DIMATTN_DEBUG");
  return env && *env && std::string(env) != "0";
}

// What a use asks, in words: "... can <this>".
const char* use_words(KernelUse use) {
  switch (use) {
    case KernelUse::run: return "run this call";
    case KernelUse::block: return "compute this call as a block (its output and each row's lse)";
    case KernelUse::backward:
    case KernelUse::block_backward: return "compute this call's gradients outside autograd";
  }
  return "?";
}

// The table's entries for params.device in priority order, each tried for
// `use`: forcing, then whether it serves the use, then its gate.
Decision decide(const std::string& backend, const AttentionParams& params, const KernelTable& table, KernelUse use) {
  const KernelForce force = parse_kernel_force(params.forced);
  Decision d;
  d.params = params;
  for (const KernelEntry& e : table) {
    if (e.device != params.device) continue;
    if (!force.allows(e.name)) {
      d.rejected.push_back({e.name, "not among the forced kernels (" + force.describe() + ")"});
      continue;
    }
    GateResult g = e.serves(use);
    if (g.ok) g = e.gate(params);
    if (g.ok) {
      d.kernel = e.name;
      return d;
    }
    d.rejected.push_back({e.name, g.reason});
  }
  std::string reasons;
  for (const auto& r : d.rejected) reasons += "\n  " + r.kernel + ": " + r.reason;
  for (const auto& k : force.kernels)
    if (!find_kernel(table, params.device, k)) reasons += "\n  " + k + ": not a kernel of this backend on this device";
  // Only forcing leaves dot_attention's own call without a kernel (the
  // reference path always can run it); blocks and gradients outside
  // autograd have no reference path.
  if (force.automatic)
    detail::fail(kernel_use_op(use), "no kernel of backend '", backend, "' on ",
                 params.device == DeviceType::cpu ? "cpu" : "cuda", " can ", use_words(use), " (", params.describe(),
                 "):", reasons, "\nChange the call or its backend.");
  detail::fail(kernel_use_op(use), "no forced kernel can ", use_words(use), " (forced: ", force.describe(), "; ",
               params.describe(), "):", reasons,
               use == KernelUse::run ? "\nForce 'auto' or 'reference', or change the call."
                                     : "\nForce 'auto' or a kernel that can, or change the call.");
}

}  // namespace

namespace {

// Cached per (backend, params, use): the gates run only on a miss, so a hit
// costs one lookup.
Decision cached_decision(const std::string& backend, const AttentionParams& params, const KernelTable& table,
                         KernelUse use) {
  Cache& c = cache();
  Key key{backend, params, use};
  {
    ++c.lookups;
    std::lock_guard lock(c.mu);
    if (auto it = c.decisions.find(key); it != c.decisions.end()) return it->second;
  }
  Decision d = decide(backend, params, table, use);  // gates run outside the lock; may throw
  std::lock_guard lock(c.mu);
  auto [it, inserted] = c.decisions.emplace(std::move(key), d);
  if (inserted) {
    ++c.selections;
    if (debug_enabled())
      std::fprintf(stderr, "[dimattn] %s: %s\n  for %s\n", backend.c_str(), d.explain().c_str(),
                   params.describe().c_str());
  }
  return it->second;
}

}  // namespace

Decision select_kernel(const std::string& backend, const AttentionParams& params, const KernelTable& table,
                       KernelUse use) {
  Decision d = cached_decision(backend, params, table, use);
  // The chosen entry names its code path; the cached decision is the gates' alone.
  if (const KernelEntry* e = find_kernel(table, params.device, d.kernel); e && e->isa) d.isa = e->isa(params);
  return d;
}

const char* kernel_use_op(KernelUse use) {
  switch (use) {
    case KernelUse::run: return "dot_attention";
    case KernelUse::block: return "dot_attention_block";
    case KernelUse::backward: return "dot_attention_backward";
    case KernelUse::block_backward: return "dot_attention_block_backward";
  }
  return "?";
}

GateResult KernelEntry::serves(KernelUse use) const {
  switch (use) {
    case KernelUse::run: return GateResult::pass();
    case KernelUse::block:
      if (block) return GateResult::pass();
      return GateResult::fail("gives no lse (each row's log-sum-exp), by which the blocks of a longer attention "
                              "merge; dimattn's own kernels give it");
    case KernelUse::backward:
    case KernelUse::block_backward:
      if (backward) return GateResult::pass();
      return GateResult::fail("has no backward pass of its own outside autograd, which dot_attention_backward and "
                              "the gradients of blocks need; dimattn's own kernels have one");
  }
  return GateResult::fail("?");
}

SelectionStats selection_stats() {
  Cache& c = cache();
  std::lock_guard lock(c.mu);
  return {c.lookups.load(), c.selections, c.decisions.size(), c.copies.load()};
}

void count_layout_copy() { ++cache().copies; }
void count_selection_lookup() { ++cache().lookups; }
uint64_t selection_epoch() { return cache().epoch.load(std::memory_order_acquire); }

void reset_selection_cache() {
  Cache& c = cache();
  std::lock_guard lock(c.mu);
  c.decisions.clear();
  c.lookups = 0;
  c.selections = 0;
  c.copies = 0;
  ++c.epoch;
}

Padding AttentionCall::padding() const {
  if (!kv_spatial.is_dynamic()) return Padding::none;
  for (const Dim& d : kv_spatial.lengths().dims())
    if (d == query_spatial || contains(query_groups, d)) return Padding::per_row;
  return Padding::per_entry;
}

AttentionParams attention_params(const AttentionCall& call, LayoutClass layout, bool requires_grad) {
  AttentionParams p;
  p.device = call.query.device().type;
  p.dtype = call.query.dtype();
  p.head_dim_qk = call.key_dim.extent();
  p.head_dim_v = product(call.value_feature);
  p.causal = call.causal;
  p.offset = call.causal_offset ? OffsetKind::nonzero : OffsetKind::none;
  p.dropout = call.dropout > 0;
  p.dropout_broadcast = p.dropout && call.dropout_broadcast;
  p.padding = call.padding();
  p.gqa_ratio = product(call.query_groups);
  p.keys_only = !call.keys_only.empty();
  p.variants = call.variants.set();
  p.layout = layout;
  p.requires_grad = requires_grad;
  p.deterministic = deterministic_algorithms();
  p.forced = current_kernel_force_spec();
  return p;
}

}  // namespace dimattn
