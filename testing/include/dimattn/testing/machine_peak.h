#pragma once
// The machine's own limits, which the benchmarks set their figures against
// (DESIGN.md §9): float32 FMA throughput, bfloat16 dot-product throughput
// (AVX512_BF16's vdpbf16ps) and read bandwidth, on a given number of threads.
// Needs nothing but the compiler: bench/peak_probe prints them all,
// kernel_bench and `dimattn bench` divide their GFLOP/s by them.
#include <cstddef>
#include <string>

namespace dimattn::testing {

// GFLOP/s of a register-only loop of 12 independent FMA chains per thread,
// best of 3 runs, on `threads` threads. `isa`: "avx2" (ymm) or "avx512"
// (zmm); 0 where the CPU lacks it. `work` scales the loop (1 = about 0.5 s
// per run at 115 GFLOP/s per thread; 0.1 for a quick estimate).
double fma_f32_gflops(const std::string& isa, int threads, double work = 1.0);

// The same for vdpbf16ps (one counts 64 FLOP); 0 without AVX512_BF16.
double dot_bf16_gflops(int threads, double work = 1.0);

// GB/s of summing `bytes_per_thread` (far past any last-level cache) on each
// of `threads` threads, best of `rounds`; 0 without AVX2.
double read_gbps(int threads, size_t bytes_per_thread = size_t{512} << 20, int rounds = 5);

// The arithmetic peak a kernel of this dtype ("float32", "bfloat16",
// "float16") is set against: the bfloat16 dot rate for bfloat16 where the CPU
// has one (cpu_flash's products then run through it), else the best float32
// FMA rate of the CPU's vector widths (float16 is widened to float32).
// Measured once per (dtype class, threads) in the process, quickly (work 0.25).
double arithmetic_peak_gflops(const std::string& dtype, int threads);

// Which limit arithmetic_peak_gflops(dtype, ...) is ("float32 FMA" or
// "bfloat16 dot, vdpbf16ps"), for table footnotes.
std::string arithmetic_peak_name(const std::string& dtype);

}  // namespace dimattn::testing
