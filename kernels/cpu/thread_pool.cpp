#include "cpu/thread_pool.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace dimattn::kernels {

ParallelFor serial_parallel_for() {
  return [](int64_t begin, int64_t end, const ParallelBody& body) {
    if (begin < end) body(begin, end);
  };
}

namespace {
// The pool whose body the current thread is running, if any: a nested call
// must not wait for workers that are busy running its caller.
thread_local const void* tl_running_pool = nullptr;
}  // namespace

struct ThreadPool::State {
  int num_threads = 1;
  std::vector<std::thread> workers;

  std::mutex call_mutex;  // one loop at a time

  std::mutex mutex;  // guards everything below
  std::condition_variable wake;  // workers: a new loop or stop
  std::condition_variable done;  // caller: the last worker left the loop
  uint64_t generation = 0;
  bool stop = false;
  int busy_workers = 0;

  // The current loop.
  const ParallelBody* body = nullptr;
  int64_t end = 0, chunk = 1;
  std::atomic<int64_t> next{0};
  std::exception_ptr error;

  void run_chunks() {
    const void* outer = tl_running_pool;
    tl_running_pool = this;
    for (;;) {
      const int64_t b = next.fetch_add(chunk, std::memory_order_relaxed);
      if (b >= end) break;
      try {
        (*body)(b, std::min(end, b + chunk));
      } catch (...) {
        std::lock_guard<std::mutex> lock(mutex);
        if (!error) error = std::current_exception();
        next.store(end, std::memory_order_relaxed);  // the others stop early
      }
    }
    tl_running_pool = outer;
  }

  void worker_main() {
    uint64_t seen = 0;
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(mutex);
        wake.wait(lock, [&] { return stop || generation != seen; });
        if (stop) return;
        seen = generation;
      }
      run_chunks();
      std::lock_guard<std::mutex> lock(mutex);
      if (--busy_workers == 0) done.notify_one();
    }
  }
};

ThreadPool::ThreadPool(int num_threads) : state_(std::make_unique<State>()) {
  if (num_threads <= 0) num_threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  state_->num_threads = num_threads;
  state_->workers.reserve(num_threads - 1);
  for (int i = 1; i < num_threads; ++i) state_->workers.emplace_back([s = state_.get()] { s->worker_main(); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    state_->stop = true;
  }
  state_->wake.notify_all();
  for (std::thread& t : state_->workers) t.join();
}

int ThreadPool::num_threads() const { return state_->num_threads; }

void ThreadPool::parallel_for(int64_t begin, int64_t end, const ParallelBody& body) {
  if (begin >= end) return;
  State& s = *state_;
  const int64_t n = end - begin;
  if (s.workers.empty() || n == 1 || tl_running_pool == &s) {
    body(begin, end);
    return;
  }
  std::lock_guard<std::mutex> call_lock(s.call_mutex);
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    s.body = &body;
    s.end = end;
    s.chunk = std::max<int64_t>(1, n / (4 * static_cast<int64_t>(s.num_threads)));
    s.next.store(begin, std::memory_order_relaxed);
    s.error = nullptr;
    s.busy_workers = static_cast<int>(s.workers.size());
    ++s.generation;
  }
  s.wake.notify_all();
  s.run_chunks();
  std::exception_ptr error;
  {
    std::unique_lock<std::mutex> lock(s.mutex);
    s.done.wait(lock, [&] { return s.busy_workers == 0; });
    error = s.error;
    s.body = nullptr;
  }
  if (error) std::rethrow_exception(error);
}

ParallelFor ThreadPool::as_parallel_for() {
  return [this](int64_t begin, int64_t end, const ParallelBody& body) { parallel_for(begin, end, body); };
}

}  // namespace dimattn::kernels
