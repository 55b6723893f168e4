// Host-side pieces shared by the standalone programs (sanitizer_driver.cu,
// sweep_driver.cu): a CUDA status check that ends the program, and 16-bit
// float bits to float.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "gemm_params.cuh"

#define CHECK_CUDA(expr)                                                  \
  do {                                                                    \
    cudaError_t status_ = (expr);                                         \
    if (status_ != cudaSuccess) {                                         \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #expr,   \
                   cudaGetErrorString(status_));                          \
      std::exit(2);                                                       \
    }                                                                     \
  } while (0)

namespace pallas_gemm {

// The value of bf16 or f16 bits (t says which).
inline float FromBits(uint16_t bits, ElementType t) {
  if (t == ElementType::kBF16) {
    uint32_t wide = static_cast<uint32_t>(bits) << 16;
    float x;
    std::memcpy(&x, &wide, 4);
    return x;
  }
  __half h;
  std::memcpy(&h, &bits, 2);
  return __half2float(h);
}

}  // namespace pallas_gemm
