#pragma once
// Threads of dimattn's own CPU kernels (cpu_flash) on backends without a pool
// of their own (Eigen). The torch backend runs them on LibTorch's pool
// (at::set_num_threads). Default: the DIMATTN_NUM_THREADS environment
// variable, else the number of hardware threads.
namespace dimattn {

void set_cpu_threads(int n);  // n <= 0: the default
int cpu_threads();

}  // namespace dimattn
