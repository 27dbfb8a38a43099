// cuda_flash's launchers in a build without CUDA (DIMATTN_WITH_CUDA=OFF):
// they exist so that the torch backend links either way; its gate rejects
// every call first (cuda_flash_compiled()).
#include <stdexcept>

#include "cuda/flash_attention_cuda.h"

namespace dimattn::kernels {

void cuda_flash_forward(const AttentionKernelParams&, CUstream_st*) {
  throw std::runtime_error("[cuda_flash] this build has no CUDA kernels (DIMATTN_WITH_CUDA=OFF)");
}
void cuda_flash_backward(const AttentionKernelParams&, void*, CUstream_st*) {
  throw std::runtime_error("[cuda_flash backward] this build has no CUDA kernels (DIMATTN_WITH_CUDA=OFF)");
}

}  // namespace dimattn::kernels
