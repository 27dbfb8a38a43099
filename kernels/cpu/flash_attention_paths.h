#pragma once
// The code paths of cpu_flash, one per instruction set (cpu_isa.h), each
// defined by the translation unit that compiles flash_attention_impl.h for
// its target. flash_attention.cpp picks one after checking the CPU.
#include "common/attention_params.h"
#include "cpu/thread_pool.h"

namespace dimattn::kernels {

struct CpuFlashPath {
  // pre: p validated, and (for avx512_bf16) p.dtype is bfloat16. Null where
  // this architecture or compiler has no such path.
  void (*forward)(const AttentionKernelParams& p, const ParallelFor& pf);
  void (*backward)(const AttentionKernelParams& p, const ParallelFor& pf);
};

extern const CpuFlashPath kCpuFlashGeneric;     // flash_attention.cpp
extern const CpuFlashPath kCpuFlashAvx2;        // flash_attention_avx2.cpp
extern const CpuFlashPath kCpuFlashAvx512;      // flash_attention_avx512.cpp
extern const CpuFlashPath kCpuFlashAvx512Bf16;  // flash_attention_avx512_bf16.cpp

}  // namespace dimattn::kernels
