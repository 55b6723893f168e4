// Does ptxas accept a transposed (MN-major) shared-memory operand for an
// fp8 wgmma? No GPU needed: compile for sm_90a and read the result.
//
//   nvcc -gencode arch=compute_90a,code=sm_90a -c transpose_operand_probe.cu
//       -> "Arguments mismatch for instruction 'wgmma.mma_async'"
//   nvcc -DBF16 ... (the same wgmma with bf16 operands) -> compiles
//
// The instruction's last two immediates (imm-trans-a, imm-trans-b) exist
// only in the f16/bf16 forms; e4m3/e5m2 operands must be K-major. So B
// stored K x N (the NN layout) has to be transposed somewhere before an
// fp8 wgmma reads it from shared memory.
#include <cstdint>

__global__ void probe(float* out, uint64_t desc_a, uint64_t desc_b) {
  float d0 = 0, d1 = 0, d2 = 0, d3 = 0;
#ifdef BF16
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3}, %4, %5, 1, 1, 1, 0, 1;"
#else
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 "
      "{%0, %1, %2, %3}, %4, %5, 1, 1, 1, 0, 1;"
#endif
      : "+f"(d0), "+f"(d1), "+f"(d2), "+f"(d3)
      : "l"(desc_a), "l"(desc_b));
  out[threadIdx.x] = d0 + d1 + d2 + d3;
}
