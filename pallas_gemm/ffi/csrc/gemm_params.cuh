// Shared by every GEMM kernel: the launch parameters and small device
// helpers. Deliberately free of the XLA FFI headers, which are slow to parse:
// only ffi_handlers.cu includes them.
//
// Layout contract (the Python wrapper transposes and pads before the call):
//   a    (batch, m, k) row-major       in_type
//   b    (batch, k, n) row-major       in_type
//   c    (batch, m, n) row-major       out_type, optional
//   out  (batch, m, n) row-major       out_type
//   out = alpha * a @ b + beta * c     accumulated in float32
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>


namespace pallas_gemm {

enum class ElementType : int { kF32 = 0, kBF16 = 1, kF16 = 2 };

struct GemmParams {
  const void* a;
  const void* b;
  const void* c;  // nullptr when there is no beta * c term
  void* out;
  int batch, m, n, k;
  float alpha, beta;
  ElementType in_type, out_type;
  // Scratch device memory for kernels that ask for it (see the mma_pipe
  // launchers' workspace functions); nullptr/0 makes them fall back to a
  // plan that needs none.
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
};

// ffi/fp8_nn: out (m, n) bf16 = a_scale * b_scale * a @ b, with a (m, k) and
// b (k, n) fp8, row-major, unbatched; the two scales are one float32 each,
// in device memory.
struct Fp8Params {
  const void* a;
  const void* b;
  const float* a_scale;
  const float* b_scale;
  void* out;  // bf16 (m, n); f32 (k_splits, m, n) partials if k_splits > 1
  int m, n, k;
  int k_splits;  // K shares summed by separate CTAs (1: none)
  int tile_m;    // rows of out per tile: 256, or 64 for short M
  bool a_e5m2, b_e5m2;  // float8_e5m2 (else float8_e4m3fn)
};

// A kernel's launcher: enqueues the work on `stream` and returns the launch
// status (cudaGetLastError right after the launch).
using LaunchFn = cudaError_t (*)(const GemmParams&, cudaStream_t);
// The workspace bytes a launcher wants for these parameters (0: none).
using WorkspaceFn = size_t (*)(const GemmParams&);

constexpr int Bit(ElementType t) { return 1 << static_cast<int>(t); }

__host__ __device__ inline int CeilDiv(int a, int b) { return (a + b - 1) / b; }

template <typename T>
__device__ __forceinline__ const T* BatchSlice(const void* base, int batch,
                                              long long elements) {
  return static_cast<const T*>(base) + static_cast<long long>(batch) * elements;
}

template <typename T>
__device__ __forceinline__ T* BatchSliceMut(void* base, int batch,
                                           long long elements) {
  return static_cast<T*>(base) + static_cast<long long>(batch) * elements;
}

// BLAS epilogue for one float32 element of a float32 output.
__device__ __forceinline__ float AlphaBeta(const GemmParams& p, float acc,
                                           const float* c, long long index) {
  float value = p.alpha * acc;
  if (c != nullptr) value += p.beta * c[index];
  return value;
}

// The same for four consecutive outputs at out + index (16-byte aligned:
// n is a multiple of 4), as one 128-bit store.
__device__ __forceinline__ void StoreAlphaBeta4(const GemmParams& p,
                                                const float* acc,
                                                const float* c, float* out,
                                                long long index) {
  float4 v = make_float4(p.alpha * acc[0], p.alpha * acc[1], p.alpha * acc[2],
                         p.alpha * acc[3]);
  if (c != nullptr) {
    const float4 c4 = *reinterpret_cast<const float4*>(c + index);
    v.x += p.beta * c4.x; v.y += p.beta * c4.y;
    v.z += p.beta * c4.z; v.w += p.beta * c4.w;
  }
  *reinterpret_cast<float4*>(out + index) = v;
}

}  // namespace pallas_gemm
