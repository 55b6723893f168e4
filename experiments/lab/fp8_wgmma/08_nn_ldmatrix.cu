// fp8, step 08: step 07 with the B^T fragment loaded by ldmatrix.
//
// The one change from step 07: a K step's fragment comes from one
// `ldmatrix.x4.trans` (16-bit units, so each thread receives two K rows of
// a two-column pair) and four byte permutes, instead of eight 16-bit loads
// and eight permutes. The lanes choose the rows the four 8 x 8 matrices
// read so that thread (g, c) receives exactly K rows 4c .. 4c + 3 (and 16
// more) of columns 2g and 2g + 1, the pieces its registers need.
//
// Build and run as step 01 (README.md in this folder).

#include "fp8_host.cuh"
#include "hopper_ptx.cuh"

namespace fp8_steps {
namespace {

constexpr int kBlockM = 256;  // rows of D: the wgmma's N
constexpr int kBlockN = 128;  // columns of D: 64 per consumer, the wgmma's M
constexpr int kBlockK = 128;
constexpr int kStages = 4;
constexpr int kConsumers = 2;
constexpr int kGroupM = 8;  // tile rows per group of the walk
constexpr int kThreads = 128 * (1 + kConsumers);
constexpr int kATileBytes = kBlockM * kBlockK;  // 32 KB, K-major
constexpr int kBTileBytes = kBlockK * kBlockN;  // 16 KB, N-major
constexpr int kStageBytes = kATileBytes + kBTileBytes;
constexpr int kSmemBytes = kStages * kStageBytes + 1024;  // + alignment slack

struct TileWalk {
  int m_tiles, n_tiles;
  __device__ int count() const { return m_tiles * n_tiles; }
  __device__ void coords(int t, int& tile_m, int& tile_n) const {
    const int group_tiles = kGroupM * n_tiles;
    const int first_m = (t / group_tiles) * kGroupM;
    const int rows = min(kGroupM, m_tiles - first_m);
    const int r = t % group_tiles;
    tile_m = first_m + r % rows;
    tile_n = r / rows;
  }
};

// This thread's part of the 64 x 32 register fragment of B^T for K step
// `step` (32 deep) of a K block, from the N-major, 128-byte-swizzled B tile
// (row k at k * 128 bytes, its 16-byte chunk c at (c ^ (k % 8)) * 16).
// `warp_column` is the first of the warp's 16 columns (a multiple of 16).
// Rows g and g + 8 of the fragment (g = lane / 4) are D's columns
// warp_column + 2g and + 1; its K offsets are 4 (lane % 4) + {0..3} and 16
// more, as the hardware fixes them.
__device__ inline void build_b_fragment(const uint8_t* b_tile,
                                        int warp_column, int step, int lane,
                                        uint32_t (&a)[4]) {
  // Lane l gives the address of row l % 8 of matrix l / 8. Matrix q holds
  // K half q / 2 (0-15 or 16-31) and, for thread c, rows 4c + 2 (q % 2) and
  // one more: row r of the matrix is K row 4 (r / 2) + 2 (q % 2) + r % 2.
  const int q = lane / 8, r = lane % 8;
  const int k = step * 32 + (q / 2) * 16 + 4 * (r / 2) + 2 * (q % 2) + r % 2;
  const uint8_t* row =
      b_tile + k * 128 + (((warp_column >> 4) ^ (k & 7)) << 4);
  uint32_t m[4];  // m[q]: K rows (2 of them) of columns 2g, 2g + 1
  asm volatile(
      "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
      : "=r"(m[0]), "=r"(m[1]), "=r"(m[2]), "=r"(m[3])
      : "r"(smem_address(row))
      : "memory");
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    // m[2 half] = (k0: col, col+1 | k1: col, col+1), m[2 half + 1] the
    // same for k2, k3: one register per column, K ascending.
    a[2 * half] = __byte_perm(m[2 * half], m[2 * half + 1], 0x6420);
    a[2 * half + 1] = __byte_perm(m[2 * half], m[2 * half + 1], 0x7531);
  }
}

__global__ void __launch_bounds__(kThreads, 1)
    fp8_nn_kernel(const __grid_constant__ CUtensorMap a_map,
                  const __grid_constant__ CUtensorMap b_map,
                  Problem problem) {
  extern __shared__ uint8_t smem_raw[];
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
      int it = 0;
      for (int t = blockIdx.x; t < walk.count(); t += gridDim.x) {
        int tile_m, tile_n;
        walk.coords(t, tile_m, tile_n);
        for (int kb = 0; kb < k_blocks; ++kb, ++it) {
          const int stage = it % kStages;
          if (it >= kStages) barrier_wait(&empty[stage], ((it / kStages) - 1) & 1);
          uint8_t* a_tile = smem + stage * kStageBytes;
          uint8_t* b_tile = a_tile + kATileBytes;
          barrier_expect_bytes(&full[stage], kStageBytes);
          tma_load_2d(a_tile, &a_map, &full[stage], kb * kBlockK,
                      tile_m * kBlockM);
          // B's box: 128 bytes of N (inner) by 128 rows of K.
          tma_load_2d(b_tile, &b_map, &full[stage], tile_n * kBlockN,
                      kb * kBlockK);
        }
      }
    }
    return;
  }

  set_max_registers_increase<232>();
  const int consumer = warpgroup - 1;
  const int warp = lane_in_group / 32, lane = lane_in_group % 32;
  // This thread's two columns of D within the tile (rows g and g + 8 of its
  // warp's 16 rows of D^T).
  const int local_column = consumer * 64 + warp * 16 + 2 * (lane / 4);
  const float scale = problem.a_scale[0] * problem.b_scale[0];

  float acc[128];  // D^T: 64 rows (columns of D) x 256 columns (rows of D)
  uint32_t fragment_even[4][4], fragment_odd[4][4];  // [K step][piece]

  int it = 0;
  for (int t = blockIdx.x; t < walk.count(); t += gridDim.x) {
    int tile_m, tile_n;
    walk.coords(t, tile_m, tile_n);
    auto stage_of = [&](int kb) { return (it + kb) % kStages; };
    // Waits for K block kb and builds its B^T fragment.
    auto build = [&](int kb, uint32_t (&fragment)[4][4]) {
      const int stage = stage_of(kb);
      barrier_wait(&full[stage], ((it + kb) / kStages) & 1);
      const uint8_t* b_tile = smem + stage * kStageBytes + kATileBytes;
#pragma unroll
      for (int step = 0; step < 4; ++step) {
        build_b_fragment(b_tile, consumer * 64 + warp * 16, step, lane,
                         fragment[step]);
      }
    };
    // Issues K block kb's four wgmmas as one commit group.
    auto issue = [&](int kb, uint32_t (&fragment)[4][4]) {
      const uint64_t desc_a =
          smem_descriptor(smem + stage_of(kb) * kStageBytes);
      wgmma_fence();
#pragma unroll
      for (int step = 0; step < 4; ++step) {
        // 32 bytes further along K in A's swizzled rows: +2 in 16-byte units.
        wgmma_m64n256k32_register_a(acc, fragment[step], desc_a + 2 * step,
                                    kb + step > 0);
      }
      wgmma_commit();
    };
    auto release = [&](int kb) {
      if (lane == 0) barrier_arrive(&empty[stage_of(kb)]);
    };

    // As step 04's block-wise loop: one K block in flight at the loop's
    // head, its fragment kept live until its wgmmas are done.
    build(0, fragment_even);
    issue(0, fragment_even);
    for (int kb = 0;;) {
      if (kb + 1 == k_blocks) {
        wgmma_wait<0>();
        release(kb);
        break;
      }
      build(kb + 1, fragment_odd);
      issue(kb + 1, fragment_odd);
      wgmma_wait<1>();
      for (int s = 0; s < 4; ++s) fence_registers(fragment_even[s]);
      release(kb);
      ++kb;
      if (kb + 1 == k_blocks) {
        wgmma_wait<0>();
        release(kb);
        break;
      }
      build(kb + 1, fragment_even);
      issue(kb + 1, fragment_even);
      wgmma_wait<1>();
      for (int s = 0; s < 4; ++s) fence_registers(fragment_odd[s]);
      release(kb);
      ++kb;
    }
    wgmma_wait<0>();  // nothing in flight; for ptxas (see step 04)
    fence_registers(acc);
    it += k_blocks;

    // acc[4j + e]: row g (e < 2) or g + 8 of D^T, i.e. D's column
    // `column` or `column + 1`; column 8j + 2 (lane % 4) + (e % 2) of D^T,
    // i.e. D's row.
    const int column = tile_n * kBlockN + local_column;
    const bool pair_fits = column + 1 < problem.n && problem.n % 2 == 0;
#pragma unroll
    for (int j = 0; j < 32; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int row = tile_m * kBlockM + 8 * j + 2 * (lane % 4) + e;
        if (row >= problem.m || column >= problem.n) continue;
        __nv_bfloat16* out =
            problem.out + static_cast<size_t>(row) * problem.n + column;
        const float first = acc[4 * j + e] * scale;
        const float second = acc[4 * j + 2 + e] * scale;
        if (pair_fits) {
          *reinterpret_cast<__nv_bfloat162*>(out) =
              __floats2bfloat162_rn(first, second);
        } else {
          out[0] = __float2bfloat16_rn(first);
          if (column + 1 < problem.n) out[1] = __float2bfloat16_rn(second);
        }
      }
    }
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
  if (promote) {
    std::fprintf(stderr, "08_nn_ldmatrix is unscaled only: run `none`\n");
    std::exit(3);
  }
  const int tiles = ((problem.m + kBlockM - 1) / kBlockM) *
                    ((problem.n + kBlockN - 1) / kBlockN);
  static bool configured = false;
  if (!configured) {
    CHECK_CUDA(cudaFuncSetAttribute(
        fp8_nn_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
        kSmemBytes));
    configured = true;
  }
  fp8_nn_kernel<<<std::min(tiles, sm_count()), kThreads, kSmemBytes>>>(
      a_map, b_map, problem);
}

}  // namespace
}  // namespace fp8_steps

int main(int argc, char** argv) {
  return fp8_steps::run_program(argc, argv, "08_nn_ldmatrix",
                                fp8_steps::launch, fp8_steps::kBlockM,
                                fp8_steps::kBlockN, fp8_steps::BLayout::kKByN);
}
