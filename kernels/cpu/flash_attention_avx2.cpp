// The AVX2 + FMA copy of the CPU flash attention kernel. The library is built
// for the baseline ISA; only the functions defined between push_options and
// pop_options below are compiled for AVX2 (GCC's target pragma; clang's
// attribute pragma), and flash_attention.cpp calls them only after checking
// the CPU at run time. Standard-library code these functions call keeps its
// baseline definition, so nothing AVX2 leaks into code shared with other
// translation units.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>

#include "kernels/common/attention_params.h"
#include "kernels/common/philox.h"
#include "kernels/cpu/flash_attention_heuristics.h"
#include "kernels/cpu/thread_pool.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define DIMATTN_HAVE_AVX2_PATH 1
#include <immintrin.h>
#endif

namespace dimattn::kernels {

#if DIMATTN_HAVE_AVX2_PATH

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma"))), apply_to = function)
#else
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#endif

#define DIMATTN_INLINE inline __attribute__((always_inline))

namespace cpu_flash_avx2 {
typedef float vf __attribute__((vector_size(32)));
typedef double vd __attribute__((vector_size(32)));
typedef int32_t vi __attribute__((vector_size(32)));
// Explicit FMA: whether the compiler would contract a * b + c depends on
// -ffp-contract, and the fused form is both faster and what we test.
DIMATTN_INLINE vf vfma(vf a, vf b, vf c) { return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c); }
DIMATTN_INLINE vd vfma(vd a, vd b, vd c) { return (vd)_mm256_fmadd_pd((__m256d)a, (__m256d)b, (__m256d)c); }
#include "kernels/cpu/flash_attention_impl.h"
}  // namespace cpu_flash_avx2

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#pragma GCC diagnostic pop
#endif

// Baseline entry points: callable from any TU without a target attribute.
namespace cpu_flash_avx2_entry {
bool available() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}
void forward(const AttentionKernelParams& p, const ParallelFor& pf) { cpu_flash_avx2::run_forward(p, pf); }
void backward(const AttentionKernelParams& p, const ParallelFor& pf) { cpu_flash_avx2::run_backward(p, pf); }
}  // namespace cpu_flash_avx2_entry

#else  // no AVX2 path on this architecture or compiler

namespace cpu_flash_avx2_entry {
bool available() { return false; }
void forward(const AttentionKernelParams&, const ParallelFor&) {}
void backward(const AttentionKernelParams&, const ParallelFor&) {}
}  // namespace cpu_flash_avx2_entry

#endif

}  // namespace dimattn::kernels
