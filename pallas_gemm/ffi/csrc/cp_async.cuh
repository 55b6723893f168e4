// cp.async (sm_80+): global -> shared copies that skip the registers, shared
// by the tensor-core kernels and SIMT rung 10. A copy whose `valid` is false
// reads nothing and fills its bytes with zeros (src-size 0); its source must
// still be a mapped address, so callers pass the matrix base.
#pragma once

#include <cstdint>

namespace pallas_gemm {

// 16 bytes, cached in L2 only (.cg): a block reads each chunk once.
__device__ __forceinline__ void CpAsync16(uint32_t dst, const void* src,
                                          bool valid = true) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst),
               "l"(src), "r"(valid ? 16 : 0));
}

// 4 bytes: copies under 16 bytes exist only in the L1-allocating form (.ca).
__device__ __forceinline__ void CpAsync4(uint32_t dst, const void* src,
                                         bool valid = true) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst),
               "l"(src), "r"(valid ? 4 : 0));
}

__device__ __forceinline__ void CpAsyncCommit() {
  asm volatile("cp.async.commit_group;\n" ::);
}

// Waits until at most kPending committed groups are still in flight. The
// memory clobber keeps the compiler from moving shared-memory reads above it.
template <int kPending>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

}  // namespace pallas_gemm
