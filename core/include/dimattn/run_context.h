#pragma once
// The run context: per-thread state that ops read instead of taking as
// arguments, as in RETURNN's run_ctx. Scoped guards restore on exit.
#include <cstdint>

namespace dimattn {

// Dropout acts only while this is true. Default: false (inference).
bool train_flag();
class TrainFlagScope {
 public:
  explicit TrainFlagScope(bool on);
  ~TrainFlagScope();
  TrainFlagScope(const TrainFlagScope&) = delete;
  TrainFlagScope& operator=(const TrainFlagScope&) = delete;

 private:
  bool saved_;
};

// Seeds for random ops that take none (dropout): a per-thread counter started
// from set_random_seed, so a run is reproducible from one seed.
void set_random_seed(uint64_t seed);
uint64_t next_random_seed();

}  // namespace dimattn
