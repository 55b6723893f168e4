// Block-wise fp8, step 03: pairs of CTAs share B's tile (TMA multicast).
//
// The one change from step 02: CTAs run in clusters of two that take the
// two tiles of one column (tile rows 2p and 2p + 1). Each loads its own A
// tile and one half of the shared B tile, multicast into both CTAs, so L2
// serves 24 KB per CTA and K block instead of 32 KB. A stage may be refilled
// only when the consumers of both CTAs have released it: every consumer
// warp arrives on the `empty` barrier of both CTAs.
//
// Build and run as step 01 (README.md in this folder).

#include "fp8_host.cuh"
#include "hopper_ptx.cuh"

namespace fp8_steps {
namespace {

constexpr int kBlockM = 128;
constexpr int kBlockN = 128;
constexpr int kBlockK = 128;  // bytes of one fp8 row of a tile: the swizzle span
constexpr int kStages = 5;
constexpr int kConsumers = 2;
constexpr int kGroupM = 16;  // tile rows per group of the walk (even)
constexpr int kClusterSize = 2;  // CTAs on consecutive tile rows
constexpr int kThreads = 128 * (1 + kConsumers);
constexpr int kTileBytes = kBlockM * kBlockK;  // A and B tiles are both 16 KB
constexpr int kStageBytes = 2 * kTileBytes;
// Row pitch of the staged output tile, in bf16: 8 past the 128 columns, so
// that the fragment's writes (rows 8 apart in a warp) fall in other banks.
constexpr int kStagedRowElems = kBlockN + 8;
constexpr int kStagingBytes = kConsumers * 64 * kStagedRowElems * 2;
constexpr int kSmemBytes =
    kStages * kStageBytes + kStagingBytes + 1024;  // + alignment slack

struct TileWalk {
  int m_tiles, n_tiles;
  // The walk is over pairs of tile rows: one step per cluster.
  __device__ int pair_rows() const { return (m_tiles + 1) / 2; }
  __device__ int count() const { return pair_rows() * n_tiles; }
  // Step t's (pair row, column): groups of kGroupM / 2 pair rows, each
  // walked column by column.
  __device__ void coords(int t, int& pair_m, int& tile_n) const {
    const int group_rows = kGroupM / 2;
    const int group_tiles = group_rows * n_tiles;
    const int first = (t / group_tiles) * group_rows;
    const int rows = min(group_rows, pair_rows() - first);
    const int r = t % group_tiles;
    pair_m = first + r % rows;
    tile_n = r / rows;
  }
};

// The consumer warpgroups' part of the kernel.
template <bool kPromote>
__device__ inline void consume(const Problem& problem, const TileWalk& walk,
                               int k_blocks, int cluster, int clusters,
                               int rank, int consumer, int lane_in_group,
                               uint8_t* smem, uint64_t* full, uint64_t* empty) {
  set_max_registers_increase<232>();
  const int warp = lane_in_group / 32, lane = lane_in_group % 32;
  const int local_row = warp * 16 + lane / 4;  // in the consumer's 64 rows
  __nv_bfloat16* staged =
      reinterpret_cast<__nv_bfloat16*>(smem + kStages * kStageBytes) +
      consumer * 64 * kStagedRowElems;
  const int named_barrier = 2 + consumer;  // this consumer's 128 threads

  float total[64];
  float partial[64];  // overwritten by each K block's first wgmma
#pragma unroll
  for (int i = 0; i < 64; ++i) partial[i] = 0.f;

  int it = 0;
  for (int t = cluster; t < walk.count(); t += clusters) {
    int pair_m, tile_n;
    walk.coords(t, pair_m, tile_n);
    const int tile_m = 2 * pair_m + rank;
    // This thread's two accumulator rows (the m64nN f32 fragment).
    const int row0 = tile_m * kBlockM + consumer * 64 + local_row;
    const int rows[2] = {row0, row0 + 8};
    const float* b_scale_row =
        problem.b_scale + static_cast<size_t>(tile_n) * k_blocks;
    auto row_scale = [&](int r, int kb) {
      return rows[r] < problem.m
                 ? __ldg(problem.a_scale +
                         static_cast<size_t>(rows[r]) * k_blocks + kb)
                 : 0.f;
    };
#pragma unroll
    for (int i = 0; i < 64; ++i) total[i] = 0.f;
    float scale_now[2] = {0.f, 0.f};
    if constexpr (kPromote) {
      const float column = __ldg(b_scale_row);
      scale_now[0] = row_scale(0, 0) * column;
      scale_now[1] = row_scale(1, 0) * column;
    }

    for (int kb = 0; kb < k_blocks; ++kb, ++it) {
      // The next block's scales are read a whole block early.
      float scale_next[2] = {0.f, 0.f};
      if (kPromote && kb + 1 < k_blocks) {
        const float column = __ldg(b_scale_row + kb + 1);
        scale_next[0] = row_scale(0, kb + 1) * column;
        scale_next[1] = row_scale(1, kb + 1) * column;
      }
      const int stage = it % kStages;
      barrier_wait(&full[stage], (it / kStages) & 1);
      const uint8_t* a_tile = smem + stage * kStageBytes + consumer * 64 * kBlockK;
      const uint8_t* b_tile = smem + stage * kStageBytes + kTileBytes;
      const uint64_t desc_a = smem_descriptor(a_tile);
      const uint64_t desc_b = smem_descriptor(b_tile);
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
      if (lane == 0) {
        for (int cta = 0; cta < kClusterSize; ++cta) {
          barrier_arrive_cluster(&empty[stage], cta);
        }
      }
      if constexpr (kPromote) {
#pragma unroll
        for (int i = 0; i < 64; ++i) {
          // Fragment registers {4j, 4j+1} are row `rows[0]`, {4j+2, 4j+3}
          // row `rows[1]`, columns 8j + 2 (lane % 4) + {0, 1}.
          total[i] = fmaf(partial[i], scale_now[(i % 4) / 2], total[i]);
        }
        scale_now[0] = scale_next[0];
        scale_now[1] = scale_next[1];
      }
    }

    // Epilogue: the fragment to this consumer's staging rows, then whole
    // 16-byte pieces of rows to global memory. The barrier after the stores
    // keeps the next tile's fragment from overwriting rows still being read.
#pragma unroll
    for (int j = 0; j < 16; ++j) {
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
#pragma unroll
    for (int q = lane_in_group; q < 64 * 16; q += 128) {
      const int row = first_row + q / 16, col = first_col + (q % 16) * 8;
      if (row >= problem.m || col >= problem.n) continue;
      const __nv_bfloat16* piece =
          staged + (q / 16) * kStagedRowElems + (q % 16) * 8;
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
}

template <bool kPromote>
__global__ void __cluster_dims__(kClusterSize, 1, 1)
    __launch_bounds__(kThreads, 1)
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
  const int rank = static_cast<int>(cluster_cta_rank());
  const int cluster = blockIdx.x / kClusterSize;
  const int clusters = gridDim.x / kClusterSize;
  const TileWalk walk{(problem.m + kBlockM - 1) / kBlockM,
                      (problem.n + kBlockN - 1) / kBlockN};

  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      barrier_init(&full[s], 1);
      // One arrival per consumer warp of both CTAs.
      barrier_init(&empty[s], kClusterSize * kConsumers * 4);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  // The peer's multicasts and arrivals may start as soon as it passes this.
  cluster_sync();

  if (warpgroup == 0) {
    set_max_registers_decrease<40>();
    if (lane_in_group == 0) {
      int it = 0;  // K blocks loaded so far, over all of this CTA's tiles
      for (int t = cluster; t < walk.count(); t += clusters) {
        int pair_m, tile_n;
        walk.coords(t, pair_m, tile_n);
        // A tile row past M (odd tile rows) loads zeros and stores nothing.
        const int tile_m = 2 * pair_m + rank;
        for (int kb = 0; kb < k_blocks; ++kb, ++it) {
          const int stage = it % kStages;
          if (it >= kStages) barrier_wait(&empty[stage], ((it / kStages) - 1) & 1);
          uint8_t* a_tile = smem + stage * kStageBytes;
          uint8_t* b_tile = a_tile + kTileBytes;
          barrier_expect_bytes(&full[stage], kStageBytes);
          tma_load_2d(a_tile, &a_map, &full[stage], kb * kBlockK,
                      tile_m * kBlockM);
          // This CTA's half of B's tile, into the same rows of both CTAs.
          tma_load_2d_multicast(b_tile + rank * (kBlockN / 2) * kBlockK,
                                &b_map, &full[stage], kb * kBlockK,
                                tile_n * kBlockN + rank * (kBlockN / 2),
                                (1 << kClusterSize) - 1);
        }
      }
    }
  } else {
    consume<kPromote>(problem, walk, k_blocks, cluster, clusters, rank,
                      warpgroup - 1, lane_in_group, smem, full, empty);
  }
  // Neither CTA may leave while the other can still arrive on its barriers.
  cluster_sync();
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
  const int steps = ((problem.m + kBlockM - 1) / kBlockM + 1) / 2 *
                    ((problem.n + kBlockN - 1) / kBlockN);
  auto kernel =
      promote ? fp8_blockwise_kernel<true> : fp8_blockwise_kernel<false>;
  static int resident_clusters[2] = {0, 0};
  if (resident_clusters[promote] == 0) {
    CHECK_CUDA(cudaFuncSetAttribute(
        kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
    // Not every SM can pair with a neighbour (the GPCs' SM counts are not
    // all even): ask how many clusters fit at once rather than assume
    // sm_count() / 2, or the last clusters would run as a second wave.
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3(sm_count());
    config.blockDim = dim3(kThreads);
    config.dynamicSmemBytes = kSmemBytes;
    CHECK_CUDA(cudaOccupancyMaxActiveClusters(&resident_clusters[promote],
                                              kernel, &config));
    std::printf("03_multicast_b: %d clusters of %d resident\n",
                resident_clusters[promote], kClusterSize);
  }
  const int clusters = std::min(steps, resident_clusters[promote]);
  kernel<<<clusters * kClusterSize, kThreads, kSmemBytes>>>(a_map, b_map,
                                                            problem);
}

}  // namespace
}  // namespace fp8_steps

int main(int argc, char** argv) {
  return fp8_steps::run_program(argc, argv, "03_multicast_b", fp8_steps::launch,
                                fp8_steps::kBlockM, fp8_steps::kBlockN / 2);
}
