// Block-wise fp8, step 05: step 04 in clusters of two CTAs sharing B.
//
// The one change from step 04: CTAs run in clusters of two that take the
// two tiles of one column (tile rows 2p and 2p + 1) and B's tile reaches
// both through one TMA multicast, so L2 serves 24 KB per CTA and K block
// instead of 32 KB (Nsight Compute put step 04 at 69-76 % of L2
// throughput; a 128 x 256 tile, which reads 25 % less per flop, ran 12-20 %
// faster unscaled). A stage may be refilled only when the consumers of both
// CTAs have released it: every consumer warp arrives on the `empty` barrier
// of both. FP8_MULTICAST_HALVES=1 has each CTA multicast half of B's tile
// (step 03's way) instead of the first CTA all of it.
//
// Build and run as step 01 (README.md in this folder).

#include "fp8_host.cuh"
#include "hopper_ptx.cuh"

namespace fp8_steps {
namespace {

constexpr int kBlockM = 128;
constexpr int kBlockN = 128;
constexpr bool kCanPromote = true;
#ifndef FP8_MULTICAST_HALVES
#define FP8_MULTICAST_HALVES 0
#endif
constexpr bool kMulticastHalves = FP8_MULTICAST_HALVES;
constexpr int kClusterSize = 2;  // CTAs on consecutive tile rows
constexpr int kBlockK = 128;  // bytes of one fp8 row of a tile: the swizzle span
constexpr int kStages = 5;
constexpr int kConsumers = 2;
constexpr int kGroupM = 16;  // tile rows per group of the walk (even)
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
          constexpr uint16_t kBoth = (1 << kClusterSize) - 1;
          if constexpr (kMulticastHalves) {
            tma_load_2d_multicast(b_tile + rank * (kBlockN / 2) * kBlockK,
                                  &b_map, &full[stage], kb * kBlockK,
                                  tile_n * kBlockN + rank * (kBlockN / 2),
                                  kBoth);
          } else if (rank == 0) {
            tma_load_2d_multicast(b_tile, &b_map, &full[stage], kb * kBlockK,
                                  tile_n * kBlockN, kBoth);
          }
        }
      }
    }
  } else {
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
  // K block kb's partial product is in partial_even or partial_odd by kb's
  // parity (two named sets: register arrays must be indexed statically).
  float partial_even[kAcc], partial_odd[kAcc];
#pragma unroll
  for (int i = 0; i < kAcc; ++i) partial_even[i] = partial_odd[i] = 0.f;

  int it = 0;
  for (int t = cluster; t < walk.count(); t += clusters) {
    int pair_m, tile_n;
    walk.coords(t, pair_m, tile_n);
    const int tile_m = 2 * pair_m + rank;
    // This thread's two accumulator rows (the m64nN f32 fragment).
    const int row0 = tile_m * kBlockM + consumer * 64 + local_row;
    const float* b_scale_row =
        problem.b_scale + static_cast<size_t>(tile_n) * k_blocks;
    // The products of A's row scales and B's block scale for K block kb.
    auto scales_of = [&](int kb, float (&scale)[2]) {
      const float column = __ldg(b_scale_row + kb);
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = row0 + 8 * r;
        scale[r] = row < problem.m
                       ? __ldg(problem.a_scale +
                               static_cast<size_t>(row) * k_blocks + kb) *
                             column
                       : 0.f;
      }
    };
    // Waits for K block kb's stage and issues its four wgmmas into `acc`
    // (overwriting it first unless `accumulate`), as one commit group.
    auto issue = [&](int kb, float (&acc)[kAcc], bool accumulate) {
      const int stage = (it + kb) % kStages;
      barrier_wait(&full[stage], ((it + kb) / kStages) & 1);
      const uint8_t* a_tile = smem + stage * kStageBytes + consumer * 64 * kBlockK;
      const uint8_t* b_tile = smem + stage * kStageBytes + kTileBytes;
      const uint64_t desc_a = smem_descriptor(a_tile);
      const uint64_t desc_b = smem_descriptor(b_tile);
      fence_registers(acc);
      wgmma_fence();
#pragma unroll
      for (int k = 0; k < kBlockK / 32; ++k) {
        // 32 bytes further along K in the swizzled row: +2 in 16-byte units.
        wgmma_m64nNk32<kBlockN>(acc, desc_a + 2 * k, desc_b + 2 * k,
                         accumulate || k > 0);
      }
      wgmma_commit();
    };
    // wgmma.wait_group completes this warp's share only: every consumer
    // warp releases the stage for itself.
    auto release = [&](int kb) {
      if (lane == 0) {
        for (int cta = 0; cta < kClusterSize; ++cta) {
          barrier_arrive_cluster(&empty[(it + kb) % kStages], cta);
        }
      }
    };

#pragma unroll
    for (int i = 0; i < kAcc; ++i) total[i] = 0.f;
    if constexpr (kPromote && kCanPromote) {
      float scale_even[2], scale_odd[2];
      // Waits for K block kb's group (issued into `now`) and folds it into
      // the running sum.
      auto fold = [&](int kb, float (&now)[64], const float (&now_scale)[2]) {
        fence_registers(now);
        release(kb);
#pragma unroll
        for (int i = 0; i < 64; ++i) {
          // Fragment registers {4j, 4j+1} are row `row0`, {4j+2, 4j+3} row
          // `row0 + 8`, columns 8j + 2 (lane % 4) + {0, 1}.
          total[i] = fmaf(now[i], now_scale[(i % 4) / 2], total[i]);
        }
      };
      // Every path keeps one group in flight at the loop's head, so that
      // ptxas can see that no register set is touched while its wgmmas run
      // (a branchier loop made it serialize them all).
      scales_of(0, scale_even);
      issue(0, partial_even, false);
      for (int kb = 0;;) {
        // K block kb is in flight in partial_even.
        if (kb + 1 == k_blocks) {
          wgmma_wait<0>();
          fold(kb, partial_even, scale_even);
          break;
        }
        scales_of(kb + 1, scale_odd);
        issue(kb + 1, partial_odd, false);
        wgmma_wait<1>();
        fold(kb, partial_even, scale_even);
        ++kb;
        // K block kb is in flight in partial_odd.
        if (kb + 1 == k_blocks) {
          wgmma_wait<0>();
          fold(kb, partial_odd, scale_odd);
          break;
        }
        scales_of(kb + 1, scale_even);
        issue(kb + 1, partial_even, false);
        wgmma_wait<1>();
        fold(kb, partial_odd, scale_odd);
        ++kb;
      }
    } else {
      issue(0, total, false);
      for (int kb = 0; kb < k_blocks; ++kb) {
        if (kb + 1 < k_blocks) {
          issue(kb + 1, total, true);
          wgmma_wait<1>();
        } else {
          wgmma_wait<0>();
        }
        release(kb);
      }
      wgmma_wait<0>();  // as above: for ptxas
      fence_registers(total);
    }
    it += k_blocks;

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
    // Not every SM need pair with a neighbour: ask how many clusters fit at
    // once rather than assume sm_count() / 2, or the last clusters would
    // run as a second wave.
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3(sm_count());
    config.blockDim = dim3(kThreads);
    config.dynamicSmemBytes = kSmemBytes;
    CHECK_CUDA(cudaOccupancyMaxActiveClusters(&resident_clusters[promote],
                                              kernel, &config));
  }
  const int clusters = std::min(steps, resident_clusters[promote]);
  kernel<<<clusters * kClusterSize, kThreads, kSmemBytes>>>(a_map, b_map,
                                                            problem);
}

}  // namespace
}  // namespace fp8_steps

int main(int argc, char** argv) {
  return fp8_steps::run_program(argc, argv, fp8_steps::kMulticastHalves ? "05_multicast_halves" : "05_multicast_b", fp8_steps::launch,
                                fp8_steps::kBlockM,
                                fp8_steps::kMulticastHalves
                                    ? fp8_steps::kBlockN / 2
                                    : fp8_steps::kBlockN);
}
