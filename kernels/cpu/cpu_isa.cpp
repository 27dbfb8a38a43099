#include "cpu/cpu_isa.h"

#include <cstdlib>
#include <stdexcept>
#include <string>
#include <utility>

#include "cpu/flash_attention_heuristics.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define DIMATTN_X86_CPUID 1
#include <cpuid.h>
#endif

namespace dimattn::kernels {

const char* cpu_isa_name(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::best: return "best";
    case CpuIsa::generic: return "generic";
    case CpuIsa::avx2: return "avx2";
    case CpuIsa::avx512: return "avx512";
    case CpuIsa::avx512_bf16: return "avx512_bf16";
  }
  return "invalid";
}

namespace {

CpuFeatures read_cpu_features() {
  CpuFeatures f;
#if DIMATTN_X86_CPUID
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid(0, &eax, &ebx, &ecx, &edx)) return f;
  f.amd = ebx == 0x68747541u && edx == 0x69746e65u && ecx == 0x444d4163u;  // "Auth" "enti" "cAMD"
  if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return f;
  const bool osxsave = ecx & bit_OSXSAVE;
  f.fma = ecx & bit_FMA;
  f.f16c = ecx & bit_F16C;
  // The OS must save the registers: XCR0 bits 1-2 (xmm, ymm) for AVX, and
  // 5-7 (opmask, zmm) for AVX-512.
  unsigned xcr0 = 0, xcr0_hi = 0;
  if (osxsave) __asm__("xgetbv" : "=a"(xcr0), "=d"(xcr0_hi) : "c"(0));
  const bool ymm = (xcr0 & 0x6u) == 0x6u, zmm = ymm && (xcr0 & 0xe0u) == 0xe0u;
  f.fma = f.fma && ymm;
  f.f16c = f.f16c && ymm;
  if (__get_cpuid_max(0, nullptr) < 7) return f;
  __cpuid_count(7, 0, eax, ebx, ecx, edx);
  const unsigned leaf7_max = eax;
  f.avx2 = ymm && (ebx & bit_AVX2);
  f.avx512f = zmm && (ebx & bit_AVX512F);
  f.avx512dq = zmm && (ebx & bit_AVX512DQ);
  f.avx512bw = zmm && (ebx & bit_AVX512BW);
  f.avx512vl = zmm && (ebx & bit_AVX512VL);
  if (leaf7_max >= 1) {
    __cpuid_count(7, 1, eax, ebx, ecx, edx);
    f.avx512_bf16 = zmm && (eax & (1u << 5));
  }
#endif
  return f;
}

}  // namespace

CpuFeatures cpu_features() {
  static const CpuFeatures f = read_cpu_features();
  return f;
}

bool cpu_flash::decode_prefetch_whole_rows() {
  static const bool on = !cpu_features().amd;
  return on;
}

std::string missing_cpu_flags(CpuIsa isa, const CpuFeatures& have) {
  std::string s;
  auto need = [&](bool ok, const char* flag) {
    if (!ok) s += s.empty() ? flag : std::string(" ") + flag;
  };
  if (isa == CpuIsa::avx2 || isa == CpuIsa::avx512 || isa == CpuIsa::avx512_bf16) {
    need(have.avx2, "avx2");
    need(have.fma, "fma");
    need(have.f16c, "f16c");
  }
  if (isa == CpuIsa::avx512 || isa == CpuIsa::avx512_bf16) {
    need(have.avx512f, "avx512f");
    need(have.avx512bw, "avx512bw");
    need(have.avx512dq, "avx512dq");
    need(have.avx512vl, "avx512vl");
  }
  if (isa == CpuIsa::avx512_bf16) need(have.avx512_bf16, "avx512_bf16");
  return s;
}

CpuIsa best_cpu_isa(const CpuFeatures& have) {
  CpuIsa best = CpuIsa::generic;
  for (CpuIsa isa : kCpuIsas)
    if (missing_cpu_flags(isa, have).empty()) best = isa;
  return best;
}

CpuIsa cpu_isa_from_name(const std::string& name, const CpuFeatures& have, const char* what) {
  CpuIsa isa = CpuIsa::best;
  for (CpuIsa c : kCpuIsas)
    if (name == cpu_isa_name(c)) isa = c;
  if (isa == CpuIsa::best)
    throw std::invalid_argument(std::string(what) + "=" + name +
                                " names no instruction set of cpu_flash; use generic, avx2, avx512 or avx512_bf16 (" +
                                "this CPU's best: " + cpu_isa_name(best_cpu_isa(have)) + ")");
  if (const std::string missing = missing_cpu_flags(isa, have); !missing.empty())
    throw std::invalid_argument(std::string(what) + "=" + name + " needs CPU flags this CPU lacks: " + missing +
                                "; use " + cpu_isa_name(best_cpu_isa(have)) + " or lower (generic, avx2, avx512, " +
                                "avx512_bf16 in increasing order), or unset it");
  return isa;
}

CpuIsa cpu_flash_best_isa() {
  // The cap, or why it is unusable, decided once: the environment of a
  // process is not expected to change under it.
  static const std::pair<CpuIsa, std::string> best = [] {
    const char* env = std::getenv("DIMATTN_CPU_ISA");
    if (env == nullptr || *env == '\0') return std::pair{best_cpu_isa(cpu_features()), std::string()};
    try {
      return std::pair{cpu_isa_from_name(env, cpu_features(), "DIMATTN_CPU_ISA"), std::string()};
    } catch (const std::invalid_argument& e) {
      return std::pair{CpuIsa::generic, std::string(e.what())};
    }
  }();
  if (!best.second.empty()) throw std::invalid_argument(best.second);
  return best.first;
}

CpuIsa cpu_flash_isa(ElementType dtype, CpuIsa requested) {
  CpuIsa isa = requested;
  if (isa == CpuIsa::best) {
    isa = cpu_flash_best_isa();
  } else if (const std::string missing = missing_cpu_flags(isa, cpu_features()); !missing.empty()) {
    throw std::invalid_argument(std::string("the ") + cpu_isa_name(isa) +
                                " code path needs CPU flags this CPU lacks: " + missing + "; use CpuIsa::best or " +
                                cpu_isa_name(best_cpu_isa(cpu_features())));
  }
  if (isa == CpuIsa::avx512_bf16 && dtype != ElementType::bfloat16) return CpuIsa::avx512;
  return isa;
}

}  // namespace dimattn::kernels
