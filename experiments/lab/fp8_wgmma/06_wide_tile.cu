// Block-wise fp8, step 06: step 02 on a 128 x 192 tile.
//
// The one change from step 02: each consumer owns 64 x 192 (m64n192k32
// wgmmas) instead of 64 x 128. Per flop that reads 11 % less shared memory
// in the wgmmas and 19 % fewer TMA bytes, and a running sum plus one
// partial product still fit (2 x 96 registers); step 04's second partial
// product does not (288). A tile now straddles two 128-column blocks of B's
// scales, so the fold picks one of two scales per 8-column group. This is
// the tile DeepGEMM's block-wise kernel tops out at on Hopper.
// -DFP8_BLOCK_N=128 builds step 02 again, for an A/B in one run.
// -DFP8_ORDERED=1 makes the two consumers take turns issuing their K
// blocks' wgmmas (named barriers), so that one consumer's fold runs while
// the tensor cores work through the other's wgmmas.
//
// Build and run as step 01 (README.md in this folder).

#include "fp8_host.cuh"
#include "hopper_ptx.cuh"

namespace fp8_steps {
namespace {

constexpr int kBlockM = 128;
#ifndef FP8_BLOCK_N
#define FP8_BLOCK_N 192
#endif
constexpr int kBlockN = FP8_BLOCK_N;
static_assert(kBlockN == 128 || kBlockN == 192, "m64n128 or m64n192");
#ifndef FP8_ORDERED
#define FP8_ORDERED 0
#endif
constexpr bool kOrdered = FP8_ORDERED;
// Named barriers 4 + c: consumer c's turn to issue (ids 2, 3 are the
// consumers' epilogue barriers, 0 is __syncthreads).
constexpr int kTurnBarrier = 4;
constexpr int kBlockK = 128;  // bytes of one fp8 row of a tile: the swizzle span
constexpr int kStages = kBlockN == 128 ? 5 : 4;
constexpr int kConsumers = 2;
constexpr int kGroupM = 16;  // tile rows per group of the walk
constexpr int kThreads = 128 * (1 + kConsumers);
constexpr int kTileBytes = kBlockM * kBlockK;  // A's tile: 16 KB
constexpr int kStageBytes = kTileBytes + kBlockN * kBlockK;
// Row pitch of the staged output tile, in bf16: 8 past the 128 columns, so
// that the fragment's writes (rows 8 apart in a warp) fall in other banks.
constexpr int kStagedRowElems = kBlockN + 8;
constexpr int kStagingBytes = kConsumers * 64 * kStagedRowElems * 2;
constexpr int kSmemBytes =
    kStages * kStageBytes + kStagingBytes + 1024;  // + alignment slack

struct TileWalk {
  int m_tiles, n_tiles;
  __device__ int count() const { return m_tiles * n_tiles; }
  // Tile t's (row, column) in tiles: groups of kGroupM rows, each walked
  // column by column.
  __device__ void coords(int t, int& tile_m, int& tile_n) const {
    const int group_tiles = kGroupM * n_tiles;
    const int first_m = (t / group_tiles) * kGroupM;
    const int rows = min(kGroupM, m_tiles - first_m);
    const int r = t % group_tiles;
    tile_m = first_m + r % rows;
    tile_n = r / rows;
  }
};

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
  const int k_blocks = (problem.k + kBlockK - 1) / kBlockK;
  const TileWalk walk{(problem.m + kBlockM - 1) / kBlockM,
                      (problem.n + kBlockN - 1) / kBlockN};

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
      int it = 0;  // K blocks loaded so far, over all of this CTA's tiles
      for (int t = blockIdx.x; t < walk.count(); t += gridDim.x) {
        int tile_m, tile_n;
        walk.coords(t, tile_m, tile_n);
        for (int kb = 0; kb < k_blocks; ++kb, ++it) {
          const int stage = it % kStages;
          if (it >= kStages) barrier_wait(&empty[stage], ((it / kStages) - 1) & 1);
          uint8_t* a_tile = smem + stage * kStageBytes;
          uint8_t* b_tile = a_tile + kTileBytes;
          barrier_expect_bytes(&full[stage], kStageBytes);
          tma_load_2d(a_tile, &a_map, &full[stage], kb * kBlockK,
                      tile_m * kBlockM);
          tma_load_2d(b_tile, &b_map, &full[stage], kb * kBlockK,
                      tile_n * kBlockN);
        }
      }
    }
    return;
  }

  set_max_registers_increase<232>();
  const int consumer = warpgroup - 1;
  const int warp = lane_in_group / 32, lane = lane_in_group % 32;
  const int local_row = warp * 16 + lane / 4;  // in the consumer's 64 rows
  __nv_bfloat16* staged =
      reinterpret_cast<__nv_bfloat16*>(smem + kStages * kStageBytes) +
      consumer * 64 * kStagedRowElems;
  const int named_barrier = 2 + consumer;  // this consumer's 128 threads

  constexpr int kAcc = kBlockN / 2;  // accumulator registers per thread
  float total[kAcc];
  float partial[kAcc];  // overwritten by each K block's first wgmma
#pragma unroll
  for (int i = 0; i < kAcc; ++i) partial[i] = 0.f;
  const int scale_columns = (problem.n + kScaleBlock - 1) / kScaleBlock;

  int it = 0;
  for (int t = blockIdx.x; t < walk.count(); t += gridDim.x) {
    int tile_m, tile_n;
    walk.coords(t, tile_m, tile_n);
    // This thread's two accumulator rows (the m64nN f32 fragment).
    const int row0 = tile_m * kBlockM + consumer * 64 + local_row;
    const int rows[2] = {row0, row0 + 8};
    // The tile's columns fall in one or two 128-column blocks of B's
    // scales: 8-column groups j < split in the first, the rest in the next.
    const int first_column = tile_n * kBlockN;
    const int column_block = first_column / kScaleBlock;
    const int split = (kScaleBlock - first_column % kScaleBlock) / 8;
    const float* b_scale_first =
        problem.b_scale + static_cast<size_t>(column_block) * k_blocks;
    const float* b_scale_second =
        problem.b_scale +
        static_cast<size_t>(min(column_block + 1, scale_columns - 1)) *
            k_blocks;
    auto row_scale = [&](int r, int kb) {
      return rows[r] < problem.m
                 ? __ldg(problem.a_scale +
                         static_cast<size_t>(rows[r]) * k_blocks + kb)
                 : 0.f;
    };
    // scale[r][c]: row r's scale times column block c's, for K block kb.
    auto scales_of = [&](int kb, float (&scale)[2][2]) {
      const float first = __ldg(b_scale_first + kb);
      const float second = __ldg(b_scale_second + kb);
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const float row = row_scale(r, kb);
        scale[r][0] = row * first;
        scale[r][1] = row * second;
      }
    };
#pragma unroll
    for (int i = 0; i < kAcc; ++i) total[i] = 0.f;
    float scale_now[2][2] = {{0.f, 0.f}, {0.f, 0.f}};
    if constexpr (kPromote) scales_of(0, scale_now);

    for (int kb = 0; kb < k_blocks; ++kb, ++it) {
      // The next block's scales are read a whole block early.
      float scale_next[2][2] = {{0.f, 0.f}, {0.f, 0.f}};
      if (kPromote && kb + 1 < k_blocks) scales_of(kb + 1, scale_next);
      const int stage = it % kStages;
      barrier_wait(&full[stage], (it / kStages) & 1);
      const uint8_t* a_tile = smem + stage * kStageBytes + consumer * 64 * kBlockK;
      const uint8_t* b_tile = smem + stage * kStageBytes + kTileBytes;
      const uint64_t desc_a = smem_descriptor(a_tile);
      const uint64_t desc_b = smem_descriptor(b_tile);
      // Consumer 0 takes the very first turn unasked.
      if (kOrdered && (consumer == 1 || it > 0)) {
        asm volatile("bar.sync %0, 256;" ::"r"(kTurnBarrier + consumer)
                     : "memory");
      }
      if constexpr (kPromote) {
        fence_registers(partial);
        wgmma_fence();
#pragma unroll
        for (int k = 0; k < kBlockK / 32; ++k) {
          // 32 bytes further along K in the swizzled row: +2 in 16-byte units.
          wgmma_m64nNk32<kBlockN>(partial, desc_a + 2 * k, desc_b + 2 * k,
                                  k > 0);
        }
        wgmma_commit();
        if constexpr (kOrdered) {
          asm volatile("bar.arrive %0, 256;" ::"r"(kTurnBarrier + 1 - consumer)
                       : "memory");
        }
        wgmma_wait_all();
        fence_registers(partial);
      } else {
        fence_registers(total);
        wgmma_fence();
#pragma unroll
        for (int k = 0; k < kBlockK / 32; ++k) {
          wgmma_m64nNk32<kBlockN>(total, desc_a + 2 * k, desc_b + 2 * k,
                                  kb + k > 0);
        }
        wgmma_commit();
        if constexpr (kOrdered) {
          asm volatile("bar.arrive %0, 256;" ::"r"(kTurnBarrier + 1 - consumer)
                       : "memory");
        }
        wgmma_wait_all();
        fence_registers(total);
      }
      // wgmma.wait_group completes this warp's share only: every consumer
      // warp releases the stage for itself.
      if (lane == 0) barrier_arrive(&empty[stage]);
      if constexpr (kPromote) {
#pragma unroll
        for (int j = 0; j < kBlockN / 8; ++j) {
          // Fragment registers {4j, 4j+1} are row `rows[0]`, {4j+2, 4j+3}
          // row `rows[1]`, columns 8j + 2 (lane % 4) + {0, 1}.
          // Selects, not an index: a register array indexed at run time
          // would go to local memory.
          const bool first = j < split;
          const float scale0 = first ? scale_now[0][0] : scale_now[0][1];
          const float scale1 = first ? scale_now[1][0] : scale_now[1][1];
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            total[4 * j + e] = fmaf(partial[4 * j + e], e < 2 ? scale0 : scale1,
                                    total[4 * j + e]);
          }
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          scale_now[r][0] = scale_next[r][0];
          scale_now[r][1] = scale_next[r][1];
        }
      }
    }

    // Epilogue: the fragment to this consumer's staging rows, then whole
    // 16-byte pieces of rows to global memory. The barrier after the stores
    // keeps the next tile's fragment from overwriting rows still being read.
#pragma unroll
    for (int j = 0; j < kBlockN / 8; ++j) {
      const int col = 8 * j + 2 * (lane % 4);
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        *reinterpret_cast<__nv_bfloat162*>(
            staged + (local_row + 8 * r) * kStagedRowElems + col) =
            __floats2bfloat162_rn(total[4 * j + 2 * r],
                                  total[4 * j + 2 * r + 1]);
      }
    }
    asm volatile("bar.sync %0, 128;" ::"r"(named_barrier) : "memory");
    const int first_row = tile_m * kBlockM + consumer * 64;
    const int first_col = tile_n * kBlockN;
    const bool aligned = (problem.n % 8 == 0);
    constexpr int kPieces = kBlockN / 8;  // 16-byte pieces per row
#pragma unroll
    for (int q = lane_in_group; q < 64 * kPieces; q += 128) {
      const int row = first_row + q / kPieces;
      const int col = first_col + (q % kPieces) * 8;
      if (row >= problem.m || col >= problem.n) continue;
      const __nv_bfloat16* piece =
          staged + (q / kPieces) * kStagedRowElems + (q % kPieces) * 8;
      __nv_bfloat16* out =
          problem.out + static_cast<size_t>(row) * problem.n + col;
      if (aligned && col + 8 <= problem.n) {
        *reinterpret_cast<uint4*>(out) = *reinterpret_cast<const uint4*>(piece);
      } else {
        for (int e = 0; e < 8 && col + e < problem.n; ++e) out[e] = piece[e];
      }
    }
    asm volatile("bar.sync %0, 128;" ::"r"(named_barrier) : "memory");
  }
  // Consumer 1's last hand-over has no turn after it: take it, so that no
  // barrier is left half-arrived.
  if (kOrdered && consumer == 0 && it > 0) {
    asm volatile("bar.sync %0, 256;" ::"r"(kTurnBarrier) : "memory");
  }
}

int sm_count() {
  static int count = 0;
  if (count == 0) {
    int device;
    CHECK_CUDA(cudaGetDevice(&device));
    CHECK_CUDA(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount,
                                      device));
  }
  return count;
}

void launch(const CUtensorMap& a_map, const CUtensorMap& b_map,
            const Problem& problem, bool promote) {
  const int tiles = ((problem.m + kBlockM - 1) / kBlockM) *
                    ((problem.n + kBlockN - 1) / kBlockN);
  auto kernel =
      promote ? fp8_blockwise_kernel<true> : fp8_blockwise_kernel<false>;
  static bool configured[2] = {false, false};
  if (!configured[promote]) {
    CHECK_CUDA(cudaFuncSetAttribute(
        kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
    configured[promote] = true;
  }
  kernel<<<std::min(tiles, sm_count()), kThreads, kSmemBytes>>>(a_map, b_map,
                                                                problem);
}

}  // namespace
}  // namespace fp8_steps

int main(int argc, char** argv) {
  return fp8_steps::run_program(argc, argv, fp8_steps::kOrdered
                                    ? (fp8_steps::kBlockN == 192
                                           ? "06_wide_tile_ordered"
                                           : "06_wide_tile_n128_ordered")
                                    : (fp8_steps::kBlockN == 192
                                           ? "06_wide_tile"
                                           : "06_wide_tile_n128"), fp8_steps::launch,
                                fp8_steps::kBlockM, fp8_steps::kBlockN);
}
