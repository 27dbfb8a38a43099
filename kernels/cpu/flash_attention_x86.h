// The body of each x86 translation unit of the CPU flash attention kernel
// (flash_attention_avx2.cpp, flash_attention_avx512.cpp,
// flash_attention_avx512_bf16.cpp): flash_attention_impl.h compiled for one
// instruction set, with the primitives it asks of its includer. The includer
// defines, before including this file:
//   DIMATTN_X86_TARGET       the target string ("avx2,fma,f16c", ...)
//   DIMATTN_X86_NAMESPACE    the namespace of this copy (cpu_flash_avx2, ...)
//   DIMATTN_X86_BYTES        the vector width: 32 or 64
//   DIMATTN_X86_MICRO_ROWS   rows of the GEMM micro-kernel
//   DIMATTN_X86_PAIRS        (optional) the bfloat16 pair products, which need
//                            avx512bf16 in the target and 64-byte vectors
//                            (flash_impl/pairs.h)
// and afterwards its CpuFlashPath from the namespace's entry points when
// DIMATTN_X86 is 1 (null functions otherwise: not x86, or a compiler without
// target pragmas).
//
// The library is built for the baseline ISA; only the functions defined
// between the push and pop of the target below are compiled for the target
// (GCC's target pragma; clang's attribute pragma), and flash_attention.cpp
// calls them only after checking the CPU at run time (cpu_isa.h). Headers are
// included before the push, so standard-library code these functions call
// keeps its baseline definition and nothing of the target leaks into code
// shared with other translation units.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#include "common/attention_mask.h"
#include "common/attention_params.h"
#include "common/philox.h"
#include "cpu/flash_attention_heuristics.h"
#include "cpu/flash_attention_paths.h"
#include "cpu/thread_pool.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define DIMATTN_X86 1
#include <immintrin.h>

#define DIMATTN_PRAGMA(x) _Pragma(#x)
#if defined(__clang__)
#define DIMATTN_X86_PUSH(t) DIMATTN_PRAGMA(clang attribute push(__attribute__((target(t))), apply_to = function))
DIMATTN_X86_PUSH(DIMATTN_X86_TARGET)
#else
#define DIMATTN_X86_PUSH(t) DIMATTN_PRAGMA(GCC target(t))
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"
// GCC 12's _mm512_max_ps and friends pass _mm512_undefined_ps() through
// their mask, which -Wmaybe-uninitialized reports wherever they inline.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC push_options
DIMATTN_X86_PUSH(DIMATTN_X86_TARGET)
#endif

#define DIMATTN_INLINE inline __attribute__((always_inline))

namespace dimattn::kernels::DIMATTN_X86_NAMESPACE {

#if DIMATTN_X86_BYTES == 32
#define DIMATTN_MM(op) _mm256_##op
typedef __m256 mvf;
typedef __m256d mvd;
#elif DIMATTN_X86_BYTES == 64
#define DIMATTN_MM(op) _mm512_##op
typedef __m512 mvf;
typedef __m512d mvd;
#else
#error "define DIMATTN_X86_BYTES as 32 or 64"
#endif
typedef float vf __attribute__((vector_size(DIMATTN_X86_BYTES)));
typedef double vd __attribute__((vector_size(DIMATTN_X86_BYTES)));
typedef int32_t vi __attribute__((vector_size(DIMATTN_X86_BYTES)));
// Explicit FMA: whether the compiler would contract a * b + c depends on
// -ffp-contract, and the fused form is both faster and what we test.
DIMATTN_INLINE vf vfma(vf a, vf b, vf c) { return (vf)DIMATTN_MM(fmadd_ps)((mvf)a, (mvf)b, (mvf)c); }
DIMATTN_INLINE vd vfma(vd a, vd b, vd c) { return (vd)DIMATTN_MM(fmadd_pd)((mvd)a, (mvd)b, (mvd)c); }
// One instruction each (a compare-and-select is two).
DIMATTN_INLINE vf vmax(vf a, vf b) { return (vf)DIMATTN_MM(max_ps)((mvf)a, (mvf)b); }
DIMATTN_INLINE vd vmax(vd a, vd b) { return (vd)DIMATTN_MM(max_pd)((mvd)a, (mvd)b); }
DIMATTN_INLINE vf vmin(vf a, vf b) { return (vf)DIMATTN_MM(min_ps)((mvf)a, (mvf)b); }
DIMATTN_INLINE vd vmin(vd a, vd b) { return (vd)DIMATTN_MM(min_pd)((mvd)a, (mvd)b); }
#undef DIMATTN_MM

// 32 x 32 -> 64-bit products of the 8 lanes of a with m (m's lanes all equal).
DIMATTN_INLINE void mulhilo8(__m256i a, __m256i m, __m256i& hi, __m256i& lo) {
  const __m256i even = _mm256_mul_epu32(a, m);                         // lanes 0, 2, 4, 6
  const __m256i odd = _mm256_mul_epu32(_mm256_srli_epi64(a, 32), m);  // lanes 1, 3, 5, 7
  lo = _mm256_blend_epi32(even, _mm256_slli_epi64(odd, 32), 0xAA);
  hi = _mm256_blend_epi32(_mm256_srli_epi64(even, 32), odd, 0xAA);
}

// philox4x32_10 (philox.h) for 8 consecutive counters at once, one per lane;
// the same rounds and keys, so the same bits.
inline void philox_bits(uint64_t key, uint32_t k4, uint32_t c1, uint32_t c2, uint32_t c3, int64_t groups,
                        uint32_t* out) {
  const __m256i m0 = _mm256_set1_epi32(static_cast<int>(0xD2511F53u));
  const __m256i m1 = _mm256_set1_epi32(static_cast<int>(0xCD9E8D57u));
  __m256i rk0[10], rk1[10];
  {
    uint32_t k0 = static_cast<uint32_t>(key), k1 = static_cast<uint32_t>(key >> 32);
    for (int r = 0; r < 10; ++r, k0 += 0x9E3779B9u, k1 += 0xBB67AE85u) {
      rk0[r] = _mm256_set1_epi32(static_cast<int>(k0));
      rk1[r] = _mm256_set1_epi32(static_cast<int>(k1));
    }
  }
  int64_t g = 0;
  for (; g + 8 <= groups; g += 8) {
    __m256i x0 = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(k4 + static_cast<uint32_t>(g))),
                                  _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    __m256i x1 = _mm256_set1_epi32(static_cast<int>(c1));
    __m256i x2 = _mm256_set1_epi32(static_cast<int>(c2));
    __m256i x3 = _mm256_set1_epi32(static_cast<int>(c3));
    for (int r = 0; r < 10; ++r) {
      __m256i hi0, lo0, hi1, lo1;
      mulhilo8(x0, m0, hi0, lo0);
      mulhilo8(x2, m1, hi1, lo1);
      x0 = _mm256_xor_si256(_mm256_xor_si256(hi1, x1), rk0[r]);
      x1 = lo1;
      x2 = _mm256_xor_si256(_mm256_xor_si256(hi0, x3), rk1[r]);
      x3 = lo0;
    }
    // Lanes hold counters g..g+7; out wants each counter's 4 words together.
    const __m256i t0 = _mm256_unpacklo_epi32(x0, x1), t1 = _mm256_unpackhi_epi32(x0, x1);
    const __m256i t2 = _mm256_unpacklo_epi32(x2, x3), t3 = _mm256_unpackhi_epi32(x2, x3);
    const __m256i u0 = _mm256_unpacklo_epi64(t0, t2), u1 = _mm256_unpackhi_epi64(t0, t2);
    const __m256i u2 = _mm256_unpacklo_epi64(t1, t3), u3 = _mm256_unpackhi_epi64(t1, t3);
    __m256i* o = reinterpret_cast<__m256i*>(out + 4 * g);
    _mm256_storeu_si256(o + 0, _mm256_permute2x128_si256(u0, u1, 0x20));
    _mm256_storeu_si256(o + 1, _mm256_permute2x128_si256(u2, u3, 0x20));
    _mm256_storeu_si256(o + 2, _mm256_permute2x128_si256(u0, u1, 0x31));
    _mm256_storeu_si256(o + 3, _mm256_permute2x128_si256(u2, u3, 0x31));
  }
  for (; g < groups; ++g) {
    const Philox4 r = philox4x32_10(Philox4{{k4 + static_cast<uint32_t>(g), c1, c2, c3}}, key);
    for (int l = 0; l < 4; ++l) out[4 * g + l] = r.v[l];
  }
}

#ifdef DIMATTN_X86_PAIRS
// flash_impl/pairs.h's primitives (AVX512-BF16; DIMATTN_X86_BYTES 64).
DIMATTN_INLINE vf dot_pairs(vf acc, vi a, vi b) {
  return (vf)_mm512_dpbf16_ps((__m512)acc, (__m512bh)a, (__m512bh)b);
}
// vcvtne2ps2bf16: round to nearest even, NaN kept quiet; subnormal inputs
// become 0 (the weights P and dS it rounds lose nothing of use there).
DIMATTN_INLINE vi round_pairs(vf lo, vf hi) { return (vi)_mm512_cvtne2ps_pbh((__m512)hi, (__m512)lo); }
// Words of a and b zipped within each 128-bit lane (vpunpcklwd, vpunpckhwd):
// lo's lane 4L + i holds (a[8L + i], b[8L + i]), hi's (a[8L + 4 + i],
// b[8L + 4 + i]), i < 4.
DIMATTN_INLINE void zip_words(vi a, vi b, vi& lo, vi& hi) {
  lo = (vi)_mm512_unpacklo_epi16((__m512i)a, (__m512i)b);
  hi = (vi)_mm512_unpackhi_epi16((__m512i)a, (__m512i)b);
}
// Sums per lane in zip_words' order (lo's and hi's lanes) put back in word
// order: words 0..15 in first, 16..31 in second.
DIMATTN_INLINE void unzip_sums(vf lo, vf hi, vf& first, vf& second) {
  static const int32_t kFirst[16] = {0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23};
  static const int32_t kSecond[16] = {8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31};
  first = (vf)_mm512_permutex2var_ps((__m512)lo, _mm512_loadu_si512(kFirst), (__m512)hi);
  second = (vf)_mm512_permutex2var_ps((__m512)lo, _mm512_loadu_si512(kSecond), (__m512)hi);
}
DIMATTN_INLINE vi interleave_pairs(vf a, vf b) {
  // Words 0..15 are a's, 16..31 b's; word 2l takes a[l], word 2l + 1 b[l].
  static const uint16_t kOrder[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
                                      8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i order = _mm512_loadu_si512(kOrder);
  return (vi)_mm512_permutexvar_epi16(order, (__m512i)_mm512_cvtne2ps_pbh((__m512)b, (__m512)a));
}
#endif

// F16C: the same rounding as half_bits.h (nearest even; NaN stays quiet).
DIMATTN_INLINE float half_to_float(uint16_t h) { return _cvtsh_ss(h); }
DIMATTN_INLINE uint16_t float_to_half(float x) { return static_cast<uint16_t>(_cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT)); }
DIMATTN_INLINE void half8_to_float(const uint16_t* src, float* dst) {
  _mm256_storeu_ps(dst, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src))));
}
DIMATTN_INLINE vf halves_to_vf(const uint16_t* src) {
#if DIMATTN_X86_BYTES == 64
  return (vf)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
#else
  return (vf)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
#endif
}

constexpr int kMicroRows = DIMATTN_X86_MICRO_ROWS;
#include "cpu/flash_attention_impl.h"

}  // namespace dimattn::kernels::DIMATTN_X86_NAMESPACE

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#pragma GCC diagnostic pop
#endif

#else
#define DIMATTN_X86 0
#endif
