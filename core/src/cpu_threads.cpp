#include "dimattn/cpu_threads.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <thread>

namespace dimattn {

namespace {
std::atomic<int> g_threads{0};
}  // namespace

void set_cpu_threads(int n) { g_threads = n; }

int cpu_threads() {
  if (const int n = g_threads; n > 0) return n;
  if (const char* env = std::getenv("DIMATTN_NUM_THREADS"); env && std::atoi(env) > 0) return std::atoi(env);
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

}  // namespace dimattn
