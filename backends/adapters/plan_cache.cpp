#include "adapters/plan_cache.h"

#include <string>
#include <vector>

#include "dimattn/forcing.h"
#include "dimattn/internal/counters.h"

namespace dimattn::detail {
namespace {

struct Entry {
  const Backend* backend;
  uint64_t epoch;
  size_t hash;
  std::vector<int64_t> key;
  std::string forced;
  std::shared_ptr<const FormPlan> plan;
};

// Per thread: no lock on the hot path, and a bounded size (a thread that sees
// many structures evicts the oldest). Plans hold no Dims or tensors, so an
// entry keeps nothing of a call alive.
struct ThreadCache {
  std::vector<Entry> entries;
  size_t next = 0;  // the entry to replace when full
  uint64_t hits = 0, misses = 0;
};
thread_local ThreadCache t_cache;

// A dim's role in the call as a number: its role list and place in it.
int64_t role_of(const AttentionCall& c, const Dim& d) {
  if (d == c.query_spatial) return 4000;
  if (d == c.kv_spatial) return 4001;
  if (d == c.key_dim) return 4002;
  const Dims* lists[4] = {&c.batch, &c.keys_only, &c.query_groups, &c.value_feature};
  for (int64_t r = 0; r < 4; ++r)
    if (const int i = index_of(*lists[r], d); i >= 0) return 1000 * r + i;
  return -1;
}

std::pair<int64_t, int64_t> span_of(const OperandMemory& m) { return element_span(m.sizes, m.strides, m.offset); }

void structure_key(const AttentionCall& c, const OperandMemory (&m)[3], std::vector<int64_t>& key) {
  key.clear();
  auto push = [&key](int64_t x) { key.push_back(x); };
  push(static_cast<int64_t>(c.batch.size()));
  push(static_cast<int64_t>(c.keys_only.size()));
  push(static_cast<int64_t>(c.query_groups.size()));
  push(static_cast<int64_t>(c.value_feature.size()));
  const Tensor* x[3] = {&c.query, &c.keys, &c.values};
  for (int i = 0; i < 3; ++i) {
    const Dims& dims = x[i]->dims();
    push(static_cast<int64_t>(dims.size()));
    for (size_t a = 0; a < dims.size(); ++a) {
      push(role_of(c, dims[a]));
      push(m[i].sizes[a]);
      push(m[i].strides[a]);
    }
    push(m[i].element_size);
    push(m[i].requires_grad);
  }
  // Which operands are views of one buffer, and how far apart.
  for (int i = 0; i < 3; ++i)
    for (int j = i + 1; j < 3; ++j) {
      bool related;
      if (m[i].storage && m[j].storage) {
        related = m[i].storage == m[j].storage;
      } else {
        const auto [a0, a1] = span_of(m[i]);
        const auto [b0, b1] = span_of(m[j]);
        related = a0 <= b1 && b0 <= a1;
      }
      push(related);
      if (related) push(m[j].offset - m[i].offset);
    }
  const Device dev = c.query.device();
  push(static_cast<int64_t>(dev.type));
  push(dev.index);
  push(static_cast<int64_t>(c.query.dtype()));
  push(c.causal);
  push(c.dropout > 0);
  push(c.dropout_broadcast);
  // Which variants are on (AttentionParams' bits: gates read them), never
  // their sizes or values, which the kernels read from the call at run time.
  push(c.variants.set().bits);
  push(deterministic_algorithms());
  // The dims the per-entry arrays vary over decide which dims form B.
  push(c.kv_spatial.is_dynamic() ? static_cast<int64_t>(c.kv_spatial.lengths().dims().size()) : -1);
  if (c.kv_spatial.is_dynamic())
    for (const Dim& d : c.kv_spatial.lengths().dims()) push(role_of(c, d));
  push(c.causal_offset ? static_cast<int64_t>(c.causal_offset->dims().size()) : -1);
  if (c.causal_offset)
    for (const Dim& d : c.causal_offset->dims()) push(role_of(c, d));
}

size_t hash_of(const std::vector<int64_t>& key) {
  uint64_t h = 1469598103934665603ULL;
  for (int64_t w : key) h = (h ^ static_cast<uint64_t>(w)) * 1099511628211ULL;
  return static_cast<size_t>(h);
}

}  // namespace

std::shared_ptr<const FormPlan> plan_with_form(Backend& be, const AttentionCall& c, const OperandMemory (&m)[3],
                                               KernelUse use) {
  ThreadCache& tc = t_cache;
  thread_local std::vector<int64_t> key;
  structure_key(c, m, key);
  key.push_back(static_cast<int64_t>(use));
  const size_t hash = hash_of(key);
  const uint64_t epoch = selection_epoch();
  std::string forced = current_kernel_force_spec();
  for (const Entry& e : tc.entries)
    if (e.hash == hash && e.backend == &be && e.epoch == epoch && e.key == key && e.forced == forced) {
      ++tc.hits;
      count_selection_lookup();
      return e.plan;
    }
  ++tc.misses;
  auto plan = std::make_shared<FormPlan>();
  plan->form = kernel_form(c, m);
  const KernelTable& table = be.attention_table();
  plan->decision =
      select_kernel(be.name(), attention_params(c, plan->form.layout_class, plan->form.requires_grad), table, use);
  plan->entry = find_kernel(table, c.query.device().type, plan->decision.kernel);
  Entry e{&be, epoch, hash, key, std::move(forced), plan};
  if (tc.entries.size() < kPlanCacheCapacity) {
    tc.entries.push_back(std::move(e));
  } else {
    tc.entries[tc.next] = std::move(e);
    tc.next = (tc.next + 1) % kPlanCacheCapacity;
  }
  return plan;
}

std::shared_ptr<const FormPlan> plan_with_host_form(Backend& be, const AttentionCall& c, KernelUse use) {
  HostView h[3];
  OperandMemory m[3];
  host_operand_memory(be, c, h, m);
  return plan_with_form(be, c, m, use);
}

const KernelForm* form_in(const AttentionPlan& plan) {
  const auto* p = dynamic_cast<const FormPlan*>(&plan);
  return p ? &p->form : nullptr;
}

PlanCacheStats plan_cache_stats() {
  const ThreadCache& tc = t_cache;
  return {tc.hits, tc.misses, tc.entries.size()};
}

}  // namespace dimattn::detail
