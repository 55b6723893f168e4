// Host helpers of the kernels that load with the TMA (mma_sync_pipelined.cu's
// TMA tilings, fp8_nn_wgmma.cu): the driver's descriptor encoder, and the
// current device's attributes they size their grids by.
#pragma once

#include <cuda.h>  // CUtensorMap (types only; no libcuda link)
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

namespace pallas_gemm {

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
