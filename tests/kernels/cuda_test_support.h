#pragma once
// What tests/kernels/cuda_host_test.cpp needs from nvcc-compiled code
// (cuda_test_support.cu), as plain C++: the Philox functions of
// kernels/common/philox.h compiled by nvcc and called on the host and, where
// a GPU is present, on the device; 16-bit float conversions; device memory.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace dimattn::testing::cuda {

// dropout_uniform(seed, offset, bh, q, k0 + c) for c < n (or the broadcast
// form), from philox.h as nvcc compiles it for the host.
std::vector<float> nvcc_host_uniforms(uint64_t seed, uint32_t offset, uint32_t bh, uint32_t q, uint32_t k0, int n,
                                      bool broadcast);
// The same computed by a kernel. Returns "" or why it could not run.
std::string device_uniforms(uint64_t seed, uint32_t offset, uint32_t bh, uint32_t q, uint32_t k0, int n,
                            bool broadcast, std::vector<float>& out);

// "" when a CUDA device of compute capability >= 8.0 is usable, else why not.
std::string device_unavailable();

uint16_t float_to_half_bits(float x);  // round to nearest even
float half_bits_to_float(uint16_t h);

void* device_alloc(size_t bytes);  // throws std::runtime_error
void device_free(void* p);
void copy_to_device(void* dst, const void* src, size_t bytes);
void copy_to_host(void* dst, const void* src, size_t bytes);
void device_fill_bytes(void* dst, int byte, size_t bytes);
void device_synchronize();  // throws on an asynchronous error

}  // namespace dimattn::testing::cuda
