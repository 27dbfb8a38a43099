// cuda_flash's kernels and launchers, kernels/cuda/flash_attention_cuda.cu
// unchanged, compiled for the host: this target defines
// DIMATTN_CUDA_EMULATION, so cuda/primitives.cuh resolves to the emulation's
// primitives (primitives_host.h). The test binary links this in place of the
// library's launchers.
#include "cuda/flash_attention_cuda.cu"
