// The Hopper PTX the block-wise fp8 steps share: mbarriers, TMA loads,
// shared-memory matrix descriptors, and the m64n128k32 e4m3 wgmma with a
// scale-d operand. Each step's .cu file includes this and holds only its
// kernel and its `launch`.
#pragma once

#include <cuda.h>
#include <cstdint>

namespace fp8_steps {


__device__ inline uint32_t smem_address(const void* pointer) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(pointer));
}

__device__ inline void barrier_init(uint64_t* barrier, int arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(
                   smem_address(barrier)),
               "r"(arrivals));
}

__device__ inline void barrier_expect_bytes(uint64_t* barrier, int bytes) {
  asm volatile(
      "mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(
          smem_address(barrier)),
      "r"(bytes));
}

__device__ inline void barrier_arrive(uint64_t* barrier) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(
      smem_address(barrier)));
}

__device__ inline void barrier_wait(uint64_t* barrier, int parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "wait_loop:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait_loop;\n"
      "}\n" ::"r"(smem_address(barrier)),
      "r"(parity));
}

__device__ inline void tma_load_2d(void* destination, const CUtensorMap* map,
                                   uint64_t* barrier, int inner, int outer) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::"
      "bytes [%0], [%1, {%3, %4}], [%2];" ::"r"(smem_address(destination)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_address(barrier)),
      "r"(inner), "r"(outer)
      : "memory");
}

// A shared-memory matrix descriptor of a K-major tile with 128-byte
// swizzle: rows of 128 bytes, 8-row groups 1024 bytes apart.
__device__ inline uint64_t smem_descriptor(const void* tile) {
  uint64_t address = smem_address(tile);
  uint64_t descriptor = 0;
  descriptor |= (address & 0x3FFFF) >> 4;            // start address
  descriptor |= uint64_t(1) << 16;                   // leading offset (unused)
  descriptor |= uint64_t(1024 >> 4) << 32;           // stride: 8 rows
  descriptor |= uint64_t(1) << 62;                   // 128-byte swizzle
  return descriptor;
}

__device__ inline void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}
__device__ inline void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
// Waits until at most kPending committed wgmma groups are still running.
template <int kPending>
__device__ inline void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(kPending) : "memory");
}
__device__ inline void wgmma_wait_all() {
  asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
}

// Ties the accumulator registers to this point of the program: the
// compiler sees no data dependency between an asynchronous wgmma's results
// and the wait that completes it, so without this it may move reads of the
// registers above the wait.
__device__ inline void fence_registers(float (&d)[64]) {
#pragma unroll
  for (int i = 0; i < 64; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// One m64n128k32 e4m3 x e4m3 -> f32 wgmma; `accumulate` false overwrites d
// (scale-d = 0).
__device__ inline void wgmma_m64n128k32(float (&d)[64], uint64_t desc_a,
                                        uint64_t desc_b, bool accumulate) {
  int scale_d = accumulate ? 1 : 0;
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, "
      "%15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, "
      "%29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, "
      "%43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, "
      "%57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]),
        "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]),
        "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]),
        "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]),
        "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),
        "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),
        "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]),
        "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]),
        "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]),
        "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]),
        "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]),
        "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

template <int kCount>
__device__ inline void set_max_registers_increase() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kCount));
}
template <int kCount>
__device__ inline void set_max_registers_decrease() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kCount));
}

__device__ inline void barrier_arrive_cluster(uint64_t* barrier, int cta) {
  // Arrive on the barrier at the same offset in CTA `cta` of this cluster.
  asm volatile(
      "{\n"
      ".reg .b32 remote;\n"
      "mapa.shared::cluster.u32 remote, %0, %1;\n"
      "mbarrier.arrive.release.cluster.shared::cluster.b64 _, [remote];\n"
      "}\n" ::"r"(smem_address(barrier)),
      "r"(cta)
      : "memory");
}

// A TMA load whose data and completion land in every CTA of `cta_mask`
// (same shared-memory offsets in each).
__device__ inline void tma_load_2d_multicast(void* destination,
                                             const CUtensorMap* map,
                                             uint64_t* barrier, int inner,
                                             int outer, uint16_t cta_mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::"
      "bytes.multicast::cluster [%0], [%1, {%3, %4}], [%2], %5;" ::"r"(
          smem_address(destination)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_address(barrier)),
      "r"(inner), "r"(outer), "h"(cta_mask)
      : "memory");
}

__device__ inline uint32_t cluster_cta_rank() {
  uint32_t rank;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
  return rank;
}

// Every thread of every CTA in the cluster (not .aligned: the producer's
// lanes arrive at different times).
__device__ inline void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release; barrier.cluster.wait.acquire;"
               ::: "memory");
}

}  // namespace fp8_steps
