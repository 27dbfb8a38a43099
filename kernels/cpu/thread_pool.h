#pragma once
// The parallel loop CPU kernels run their tasks on, and a small default pool.
//
// Kernels take a ParallelFor rather than owning threads, so that each backend
// runs them on its own pool: the torch backend passes at::parallel_for, the
// Eigen backend its device's pool, tests a ThreadPool of a chosen size.
#include <cstdint>
#include <functional>
#include <memory>

namespace dimattn::kernels {

using ParallelBody = std::function<void(int64_t begin, int64_t end)>;

// pf(begin, end, body) calls body on disjoint subranges that together cover
// [begin, end), possibly concurrently, and returns when every call has
// returned (rethrowing an exception one of them threw). How the range is split
// is the implementation's choice: kernels make every task's result
// independent of it, so results are bitwise equal for any split.
using ParallelFor = std::function<void(int64_t begin, int64_t end, const ParallelBody& body)>;

// Runs the whole range on the calling thread.
ParallelFor serial_parallel_for();

// A fixed set of worker threads. The calling thread takes part in each loop,
// so a pool of n threads starts n - 1 workers. Subranges are handed out
// dynamically in chunks of about a quarter of a thread's share, which evens
// out tasks of unequal cost (causal attention's triangular blocks).
class ThreadPool {
 public:
  // num_threads <= 0: std::thread::hardware_concurrency().
  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const;

  // A call from inside a body of this pool (nested) runs serially; calls from
  // several outside threads take turns.
  void parallel_for(int64_t begin, int64_t end, const ParallelBody& body);

  // A ParallelFor that runs on this pool. pre: the pool outlives it.
  ParallelFor as_parallel_for();

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace dimattn::kernels
