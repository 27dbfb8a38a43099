#include "dimattn/trace.h"

#include <algorithm>

namespace dimattn {
namespace {
thread_local std::vector<TraceScope*> t_scopes;
}  // namespace

// Records are appended to a scope only from its own thread, so no locking.
TraceScope::TraceScope(bool capture_tensors) : capture_(capture_tensors) { t_scopes.push_back(this); }
TraceScope::~TraceScope() { std::erase(t_scopes, this); }

bool TraceScope::active() { return !t_scopes.empty(); }
bool TraceScope::capturing() {
  return std::any_of(t_scopes.begin(), t_scopes.end(), [](const TraceScope* s) { return s->capture_; });
}

void TraceScope::record(const AttentionTrace& trace) {
  for (TraceScope* s : t_scopes) {
    AttentionTrace t = trace;
    if (!s->capture_) {
      t.energy.reset();
      t.att_weights.reset();
    }
    s->records_.push_back(std::move(t));
  }
}

}  // namespace dimattn
