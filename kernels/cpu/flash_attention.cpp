#include "cpu/flash_attention.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <stdexcept>
#include <type_traits>
#include <utility>
#include <vector>

#include "common/attention_mask.h"
#include "common/philox.h"
#include "cpu/flash_attention_heuristics.h"
#include "cpu/flash_attention_paths.h"
#include "cpu/half_bits.h"

// The transposing packer passes 32-byte vectors between inlined helpers; in
// this baseline (SSE2) translation unit compilers warn that such a function's
// ABI would differ from an AVX build. None of them is visible outside this
// file.
#if defined(__clang__)
#pragma clang diagnostic ignored "-Wpsabi"
#elif defined(__GNUC__)
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

#define DIMATTN_INLINE inline __attribute__((always_inline))

namespace dimattn::kernels {

// Portable path: plain 16-byte vector arithmetic, which every 64-bit target's
// baseline has (SSE2 on x86-64, NEON on arm64), lowered by the compiler.
namespace cpu_flash_generic {
typedef float vf __attribute__((vector_size(16)));
typedef double vd __attribute__((vector_size(16)));
typedef int32_t vi __attribute__((vector_size(16)));
DIMATTN_INLINE vf vfma(vf a, vf b, vf c) { return a * b + c; }
DIMATTN_INLINE vd vfma(vd a, vd b, vd c) { return a * b + c; }
DIMATTN_INLINE vf vmax(vf a, vf b) { return a > b ? a : b; }
DIMATTN_INLINE vd vmax(vd a, vd b) { return a > b ? a : b; }
DIMATTN_INLINE vf vmin(vf a, vf b) { return a < b ? a : b; }
DIMATTN_INLINE vd vmin(vd a, vd b) { return a < b ? a : b; }
inline void philox_bits(uint64_t key, uint32_t k4, uint32_t c1, uint32_t c2, uint32_t c3, int64_t groups,
                        uint32_t* out) {
  for (int64_t g = 0; g < groups; ++g) {
    const Philox4 r = philox4x32_10(Philox4{{k4 + static_cast<uint32_t>(g), c1, c2, c3}}, key);
    for (int l = 0; l < 4; ++l) out[4 * g + l] = r.v[l];
  }
}
DIMATTN_INLINE float half_to_float(uint16_t h) { return half_bits_to_float(h); }
DIMATTN_INLINE uint16_t float_to_half(float x) { return float_to_half_bits(x); }
DIMATTN_INLINE void half8_to_float(const uint16_t* src, float* dst) {
  for (int i = 0; i < 8; ++i) dst[i] = half_bits_to_float(src[i]);
}
DIMATTN_INLINE vf halves_to_vf(const uint16_t* src) {
  vf r;
  for (int i = 0; i < 4; ++i) r[i] = half_bits_to_float(src[i]);
  return r;
}
constexpr int kMicroRows = 6;  // 12 accumulators of SSE2's 16 registers
#include "cpu/flash_attention_impl.h"
}  // namespace cpu_flash_generic

const CpuFlashPath kCpuFlashGeneric = {cpu_flash_generic::run_forward, cpu_flash_generic::run_backward};

namespace {

const CpuFlashPath& path_of(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::avx2: return kCpuFlashAvx2;
    case CpuIsa::avx512: return kCpuFlashAvx512;
    case CpuIsa::avx512_bf16: return kCpuFlashAvx512Bf16;
    default: return kCpuFlashGeneric;
  }
}

void check(const AttentionKernelParams& p, bool backward) {
  std::string err = p.validate(backward);
  if (err.empty()) err = p.validate_host_arrays();
  if (!err.empty()) throw std::invalid_argument("[cpu_flash] " + err);
}

// The path for p on `isa` (cpu_flash_isa's choice).
const CpuFlashPath& path_for(const AttentionKernelParams& p, CpuIsa isa) {
  try {
    const CpuFlashPath& path = path_of(cpu_flash_isa(p.dtype, isa));
    if (path.forward == nullptr)  // the CPU has it, but this build for its architecture does not
      throw std::invalid_argument(std::string("this build has no ") + cpu_isa_name(isa) + " code path");
    return path;
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(std::string("[cpu_flash] ") + e.what());
  }
}

}  // namespace

void flash_attention_forward_cpu(const AttentionKernelParams& p, const ParallelFor& parallel_for, CpuIsa isa) {
  check(p, false);
  path_for(p, isa).forward(p, parallel_for);
}

void flash_attention_backward_cpu(const AttentionKernelParams& p, const ParallelFor& parallel_for, CpuIsa isa) {
  check(p, true);
  path_for(p, isa).backward(p, parallel_for);
}

}  // namespace dimattn::kernels
