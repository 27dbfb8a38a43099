// nvcc-compiled half of the CUDA host tests (cuda_test_support.h).
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <stdexcept>

#include "common/philox.h"
#include "cuda_test_support.h"

namespace dimattn::testing::cuda {
namespace {

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

__global__ void uniforms_kernel(uint64_t seed, uint32_t offset, uint32_t bh, uint32_t q, uint32_t k0, int n,
                                bool broadcast, float* out) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= n) return;
  out[c] = broadcast ? kernels::dropout_uniform_broadcast(seed, offset, k0 + c)
                     : kernels::dropout_uniform(seed, offset, bh, q, k0 + c);
}

}  // namespace

std::vector<float> nvcc_host_uniforms(uint64_t seed, uint32_t offset, uint32_t bh, uint32_t q, uint32_t k0, int n,
                                      bool broadcast) {
  std::vector<float> out(n);
  for (int c = 0; c < n; ++c)
    out[c] = broadcast ? kernels::dropout_uniform_broadcast(seed, offset, k0 + c)
                       : kernels::dropout_uniform(seed, offset, bh, q, k0 + c);
  return out;
}

std::string device_unavailable() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    cudaGetLastError();  // clear the sticky "no device" error
    return "no CUDA device";
  }
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  if (prop.major < 8) return std::string("device ") + prop.name + " is older than sm_80";
  return {};
}

std::string device_uniforms(uint64_t seed, uint32_t offset, uint32_t bh, uint32_t q, uint32_t k0, int n,
                            bool broadcast, std::vector<float>& out) {
  if (std::string why = device_unavailable(); !why.empty()) return why;
  float* d = static_cast<float*>(device_alloc(sizeof(float) * n));
  uniforms_kernel<<<(n + 127) / 128, 128>>>(seed, offset, bh, q, k0, n, broadcast, d);
  check(cudaGetLastError(), "launch");
  out.resize(n);
  copy_to_host(out.data(), d, sizeof(float) * n);
  device_free(d);
  return {};
}

uint16_t float_to_half_bits(float x) { return __half_as_ushort(__float2half_rn(x)); }
float half_bits_to_float(uint16_t h) { return __half2float(__ushort_as_half(h)); }

void* device_alloc(size_t bytes) {
  void* p = nullptr;
  check(cudaMalloc(&p, bytes ? bytes : 1), "cudaMalloc");
  return p;
}
void device_free(void* p) { cudaFree(p); }
void copy_to_device(void* dst, const void* src, size_t bytes) {
  check(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice), "cudaMemcpy to device");
}
void copy_to_host(void* dst, const void* src, size_t bytes) {
  check(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost), "cudaMemcpy to host");
}
void device_fill_bytes(void* dst, int byte, size_t bytes) { check(cudaMemset(dst, byte, bytes), "cudaMemset"); }
void device_synchronize() { check(cudaDeviceSynchronize(), "cudaDeviceSynchronize"); }

}  // namespace dimattn::testing::cuda
