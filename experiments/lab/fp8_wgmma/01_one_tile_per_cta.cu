// Block-wise fp8, step 01: one CTA per 128 x 128 output tile.
//
//   D (M x N, bf16) = sum over K blocks kb of
//       (A[:, kb] . B[:, kb]^T) * a_scale[m, kb] * b_scale[n / 128, kb]
//
// A is M x K and B is N x K, float8_e4m3fn stored K-major (the NT layout
// fp8 wgmma reads); a_scale is (M, ceil(K/128)) and b_scale is
// (ceil(N/128), ceil(K/128)), float32, row-major: the shapes
// `pallas_gemm.quantize_fp8` returns for 1x128 and 128x128 blocks.
//
// What Mosaic lacks and this has (experiments/results/nvidia_h200/
// fp8_profile): the first wgmma of each 128-deep K block runs with
// scale-d = 0, so its partial product overwrites the accumulator instead of
// being zeroed first, and the promotion is one FFMA per accumulator element.
//
//   warpgroup 0   producer: one thread issues the TMA loads of A's and B's
//                 128 x 128 byte tiles into a ring of kStages stages
//                 (128-byte swizzle), each stage's `full` barrier counting
//                 the bytes;
//   warpgroups 1-2 consumers: each owns 64 rows x 128 columns; per K block,
//                 four m64n128k32 wgmmas into `partial` (the first with
//                 scale-d = 0), wait, release the stage, then
//                 total += partial * a_scale[row] * b_scale; finally the
//                 bf16 tile is staged in the (then idle) ring and stored in
//                 16-byte pieces of rows.
//
// Build and run (README.md in this folder):
//   nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a \
//       -I experiments/lab/ffi -I pallas_gemm/ffi/csrc -o /tmp/fp8_01 \
//       experiments/lab/fp8_wgmma/01_one_tile_per_cta.cu
//   /tmp/fp8_01 4096 4096 4096 [block|none]

#include "fp8_host.cuh"
#include "hopper_ptx.cuh"

namespace fp8_steps {
namespace {

constexpr int kBlockM = 128;
constexpr int kBlockN = 128;
constexpr int kBlockK = 128;  // bytes of one fp8 row of a tile: the swizzle span
constexpr int kStages = 6;
constexpr int kConsumers = 2;
constexpr int kThreads = 128 * (1 + kConsumers);
constexpr int kTileBytes = kBlockM * kBlockK;  // A and B tiles are both 16 KB
constexpr int kStageBytes = 2 * kTileBytes;
constexpr int kSmemBytes = kStages * kStageBytes + 1024;  // + alignment slack
// Row pitch of the staged output tile, in bf16: 8 past the 128 columns, so
// that the fragment's writes (rows 8 apart in a warp) fall in other banks.
constexpr int kStagedRowElems = kBlockN + 8;
static_assert(kConsumers * 64 * kStagedRowElems * 2 <= kStages * kStageBytes,
              "the staged output tile reuses the ring");


template <bool kPromote>
__global__ void __launch_bounds__(kThreads, 1)
    fp8_blockwise_kernel(const __grid_constant__ CUtensorMap a_map,
                         const __grid_constant__ CUtensorMap b_map,
                         Problem problem) {
  extern __shared__ uint8_t smem_raw[];
  // 128-byte swizzled tiles need 1024-byte alignment.
  uint8_t* smem = reinterpret_cast<uint8_t*>(
      (reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  __shared__ alignas(8) uint64_t full[kStages];
  __shared__ alignas(8) uint64_t empty[kStages];

  const int warpgroup = threadIdx.x / 128;
  const int lane_in_group = threadIdx.x % 128;
  const int row0 = blockIdx.y * kBlockM;
  const int col0 = blockIdx.x * kBlockN;
  const int k_blocks = (problem.k + kBlockK - 1) / kBlockK;

  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      barrier_init(&full[s], 1);
      barrier_init(&empty[s], kConsumers * 4);  // one arrival per consumer warp
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  if (warpgroup == 0) {
    set_max_registers_decrease<40>();
    if (lane_in_group == 0) {
      for (int kb = 0; kb < k_blocks; ++kb) {
        int stage = kb % kStages;
        if (kb >= kStages) barrier_wait(&empty[stage], ((kb / kStages) - 1) & 1);
        uint8_t* a_tile = smem + stage * kStageBytes;
        uint8_t* b_tile = a_tile + kTileBytes;
        barrier_expect_bytes(&full[stage], kStageBytes);
        tma_load_2d(a_tile, &a_map, &full[stage], kb * kBlockK, row0);
        tma_load_2d(b_tile, &b_map, &full[stage], kb * kBlockK, col0);
      }
    }
    return;
  }

  set_max_registers_increase<232>();
  const int consumer = warpgroup - 1;
  const int warp = lane_in_group / 32, lane = lane_in_group % 32;
  // This thread's two accumulator rows (the m64nN f32 fragment): rows
  // warp * 16 + lane / 4 and the one 8 below, within the consumer's 64.
  const int my_row = row0 + consumer * 64 + warp * 16 + lane / 4;
  const int rows[2] = {my_row, my_row + 8};
  const float* b_scale_row =
      problem.b_scale + static_cast<size_t>(blockIdx.x) * k_blocks;

  float total[64];
  float partial[64];  // overwritten by each K block's first wgmma
#pragma unroll
  for (int i = 0; i < 64; ++i) total[i] = partial[i] = 0.f;

  for (int kb = 0; kb < k_blocks; ++kb) {
    // The scales are read before the stage is awaited, so their latency
    // overlaps the wait and the wgmmas.
    float row_scale[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      row_scale[r] = rows[r] < problem.m
                         ? __ldg(problem.a_scale +
                                 static_cast<size_t>(rows[r]) * k_blocks + kb)
                         : 0.f;
    }
    const float column_scale = __ldg(b_scale_row + kb);

    int stage = kb % kStages;
    barrier_wait(&full[stage], (kb / kStages) & 1);
    const uint8_t* a_tile = smem + stage * kStageBytes + consumer * 64 * kBlockK;
    const uint8_t* b_tile = smem + stage * kStageBytes + kTileBytes;
    uint64_t desc_a = smem_descriptor(a_tile);
    uint64_t desc_b = smem_descriptor(b_tile);
    if constexpr (kPromote) {
      fence_registers(partial);
      wgmma_fence();
#pragma unroll
      for (int k = 0; k < kBlockK / 32; ++k) {
        // 32 bytes further along K in the swizzled row: +2 in 16-byte units.
        wgmma_m64n128k32(partial, desc_a + 2 * k, desc_b + 2 * k, k > 0);
      }
      wgmma_commit();
      wgmma_wait_all();
      fence_registers(partial);
    } else {
      fence_registers(total);
      wgmma_fence();
#pragma unroll
      for (int k = 0; k < kBlockK / 32; ++k) {
        wgmma_m64n128k32(total, desc_a + 2 * k, desc_b + 2 * k, kb + k > 0);
      }
      wgmma_commit();
      wgmma_wait_all();
      fence_registers(total);
    }
    // wgmma.wait_group completes this warp's share only: every consumer
    // warp releases the stage for itself.
    if (lane == 0) barrier_arrive(&empty[stage]);

    if constexpr (kPromote) {
      const float scale0 = row_scale[0] * column_scale;
      const float scale1 = row_scale[1] * column_scale;
#pragma unroll
      for (int i = 0; i < 64; ++i) {
        // Fragment registers {4j, 4j+1} are row `rows[0]`, {4j+2, 4j+3} row
        // `rows[1]`, columns 8j + 2 (lane % 4) + {0, 1}.
        total[i] = fmaf(partial[i], (i % 4) < 2 ? scale0 : scale1, total[i]);
      }
    }
  }

  // Epilogue through shared memory, so that the global stores are whole
  // 16-byte pieces of rows: the fragment's own layout would store 4 bytes
  // per thread, 16 bytes per row per warp. Both consumers are past the main
  // loop before either overwrites the ring (named barrier 1 over their 256
  // threads; the producer's loads have all landed, as both awaited them).
  asm volatile("bar.sync 1, 256;" ::: "memory");
  __nv_bfloat16* staged = reinterpret_cast<__nv_bfloat16*>(smem) +
                          consumer * 64 * kStagedRowElems;
  const int local_row = warp * 16 + lane / 4;
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    const int col = 8 * j + 2 * (lane % 4);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      *reinterpret_cast<__nv_bfloat162*>(
          staged + (local_row + 8 * r) * kStagedRowElems + col) =
          __floats2bfloat162_rn(total[4 * j + 2 * r], total[4 * j + 2 * r + 1]);
    }
  }
  asm volatile("bar.sync %0, 128;" ::"r"(2 + consumer) : "memory");
  // 64 rows x 16 pieces of 8 columns, 8 pieces per thread.
  const int first_row = row0 + consumer * 64;
#pragma unroll
  for (int q = lane_in_group; q < 64 * 16; q += 128) {
    const int row = first_row + q / 16, col = col0 + (q % 16) * 8;
    if (row >= problem.m || col >= problem.n) continue;
    const __nv_bfloat16* piece = staged + (q / 16) * kStagedRowElems +
                                 (q % 16) * 8;
    __nv_bfloat16* out = problem.out + static_cast<size_t>(row) * problem.n +
                         col;
    const bool aligned = (problem.n % 8 == 0);
    if (aligned && col + 8 <= problem.n) {
      *reinterpret_cast<uint4*>(out) = *reinterpret_cast<const uint4*>(piece);
    } else {
      for (int e = 0; e < 8 && col + e < problem.n; ++e) out[e] = piece[e];
    }
  }
}

void launch(const CUtensorMap& a_map, const CUtensorMap& b_map,
            const Problem& problem, bool promote) {
  dim3 grid((problem.n + kBlockN - 1) / kBlockN,
            (problem.m + kBlockM - 1) / kBlockM);
  auto kernel = promote ? fp8_blockwise_kernel<true> : fp8_blockwise_kernel<false>;
  static bool configured[2] = {false, false};
  if (!configured[promote]) {
    CHECK_CUDA(cudaFuncSetAttribute(
        kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
    configured[promote] = true;
  }
  kernel<<<grid, kThreads, kSmemBytes>>>(a_map, b_map, problem);
}

}  // namespace
}  // namespace fp8_steps

int main(int argc, char** argv) {
  return fp8_steps::run_program(argc, argv, "01_one_tile_per_cta",
                                fp8_steps::launch, fp8_steps::kBlockM,
                                fp8_steps::kBlockN);
}
