#include "dimattn/run_context.h"

namespace dimattn {
namespace {
thread_local bool t_train = false;
thread_local uint64_t t_seed = 0x5eed;
}  // namespace

bool train_flag() { return t_train; }
TrainFlagScope::TrainFlagScope(bool on) : saved_(t_train) { t_train = on; }
TrainFlagScope::~TrainFlagScope() { t_train = saved_; }

void set_random_seed(uint64_t seed) { t_seed = seed; }
uint64_t next_random_seed() {
  // splitmix64 step: consecutive calls give well-spread seeds.
  uint64_t z = (t_seed += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

}  // namespace dimattn
