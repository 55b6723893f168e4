// The TMA pieces the kernels that load with it share (mma_sync_pipelined.cu's
// TMA tilings, fp8_nn_wgmma.cu): mbarrier and TMA-load PTX on the device;
// the driver's descriptor encoder and current-device attributes on the host.
#pragma once

#include <cuda.h>  // CUtensorMap (types only; no libcuda link)
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace pallas_gemm {

// The device helpers exist only on sm_90+. No launcher runs a TMA kernel on
// an older GPU, so there their bodies compile to nothing. Shared-memory
// addresses (`bar`, `dst`) are 32-bit shared-window addresses.
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
#define PALLAS_GEMM_HAS_TMA 1
#else
#define PALLAS_GEMM_HAS_TMA 0
#endif

__device__ __forceinline__ void MbarrierInit(uint32_t bar, int count) {
#if PALLAS_GEMM_HAS_TMA
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar),
               "r"(count));
#endif
}
__device__ __forceinline__ void MbarrierExpectTx(uint32_t bar, int bytes) {
#if PALLAS_GEMM_HAS_TMA
  asm volatile(
      "mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar),
      "r"(bytes)
      : "memory");
#endif
}
__device__ __forceinline__ void MbarrierArrive(uint32_t bar) {
#if PALLAS_GEMM_HAS_TMA
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar)
               : "memory");
#endif
}
__device__ __forceinline__ void MbarrierWait(uint32_t bar, uint32_t parity) {
#if PALLAS_GEMM_HAS_TMA
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n"
      "}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
#endif
}
// Orders this thread's earlier generic-proxy accesses to shared memory
// before later async-proxy (TMA) ones.
__device__ __forceinline__ void FenceProxyAsync() {
#if PALLAS_GEMM_HAS_TMA
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}
// Loads one box of a 2-D (x, y) or 3-D (x, y, z) tensor map into shared
// memory at dst, completing `bar`'s transaction bytes.
__device__ __forceinline__ void TmaLoad2d(uint32_t dst, const CUtensorMap* map,
                                          int x, int y, uint32_t bar) {
#if PALLAS_GEMM_HAS_TMA
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile"
      ".mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(x), "r"(y), "r"(bar)
      : "memory");
#endif
}
__device__ __forceinline__ void TmaLoad3d(uint32_t dst, const CUtensorMap* map,
                                          int x, int y, int z, uint32_t bar) {
#if PALLAS_GEMM_HAS_TMA
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile"
      ".mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(
          dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(x), "r"(y), "r"(z), "r"(bar)
      : "memory");
#endif
}


// An attribute of the current device, 0 if it cannot be read.
inline int CurrentDeviceAttribute(cudaDeviceAttr attribute) {
  int device = 0, value = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&value, attribute, device) != cudaSuccess) {
    return 0;
  }
  return value;
}


// cuTensorMapEncodeTiled through the runtime's driver entry point, so the
// library needs no libcuda at link time; nullptr if the driver lacks it.
inline PFN_cuTensorMapEncodeTiled_v12000 TensorMapEncoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 encoder = [] {
    void* function = nullptr;
    cudaDriverEntryPointQueryResult found;
#if CUDART_VERSION >= 12050
    const cudaError_t status = cudaGetDriverEntryPointByVersion(
        "cuTensorMapEncodeTiled", &function, 12000, cudaEnableDefault, &found);
#else  // CUDA 12.0-12.4: the by-version query does not exist yet
    const cudaError_t status = cudaGetDriverEntryPoint(
        "cuTensorMapEncodeTiled", &function, cudaEnableDefault, &found);
#endif
    if (status != cudaSuccess || found != cudaDriverEntryPointSuccess) {
      return static_cast<PFN_cuTensorMapEncodeTiled_v12000>(nullptr);
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(function);
  }();
  return encoder;
}

}  // namespace pallas_gemm
