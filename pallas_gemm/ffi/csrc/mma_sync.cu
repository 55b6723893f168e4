// Tensor-core GEMM with mma.sync: fp16 or bf16 in, f32 accumulate.
//
// What it adds over the SIMT ladder: the multiply-adds run on the tensor
// cores (HMMA, mma.sync.aligned.m16n8k16), which on Hopper give an order of
// magnitude more 16-bit FLOP/s than FFMA. Everything else in the kernel
// exists to feed them:
//
//  * cp.async (16-byte, L2-only .cg) copies global tiles straight into shared
//    memory without passing through registers, kStages = 4 K-tiles deep, so
//    three tiles are in flight while the warps compute on the fourth.
//    Out-of-range chunks are zero-filled (src-size 0): any M, and K/N that
//    are multiples of 8 (the wrapper pads the rest).
//  * ldmatrix.x4 loads a whole 16x16 A fragment per instruction, and
//    ldmatrix.x4.trans loads B, which is stored k-major (row-major K x N),
//    straight into the column-major fragment mma.sync wants.
//  * Shared memory is XOR-swizzled at 16-byte granularity so the eight row
//    addresses of each ldmatrix phase (and the cp.async stores) land on eight
//    different bank groups: no bank conflicts and no padding.
//  * Warp tiles of 64 x WN (WN = 32 or 64): per 16-wide K step a warp
//    issues 4 ldmatrix.x4 for A and WN/16 ldmatrix.x4.trans for B, then
//    4 x WN/8 mma.sync, each fragment reused across a row or column of the
//    warp tile.
//  * Grouped block order: consecutive blocks walk 8 block-rows down one
//    block-column band, so the A and B tiles they share are still in L2.
//  * The epilogue stages alpha * acc through shared memory (f32, padded rows)
//    so each thread stores 8 contiguous outputs (128-bit stores for 16-bit
//    outputs), reads C the same way for beta * C, and rounds once.
//
// Compiled variants (block 128 x BN x BK, 4 stages): 128x128x32 with 8 warps
// (warp tile 64x32) or with 4 warps (64x64, two blocks per SM, the fastest of
// these on an H200: one block's barrier wait overlaps the other's math), 128x256x32
// and 128x256x64 with 8 warps (64x64). mma_sync_pipelined.cu is faster.
#include "gemm_params.cuh"
#include "mma_sync_common.cuh"

namespace pallas_gemm {
namespace mma_sync {

constexpr int kBlockM = 128, kStages = 4, kWarpsM = 2;
constexpr int kGroupM = 8;

// kWarpsN = 4: 8 warps, one block per SM. kWarpsN = 2: 4 warps with 64x64
// warp tiles and two blocks per SM, so one block's barrier wait overlaps the
// other block's math.
template <int kBlockN, int kBlockK, int kWarpsN>
struct Tiling {
  static constexpr int kThreads = kWarpsM * kWarpsN * 32;
  static constexpr int kMinBlocksPerSm = kWarpsN == 2 ? 2 : 1;
  static constexpr int kWarpM = kBlockM / kWarpsM;  // 64
  static constexpr int kWarpN = kBlockN / kWarpsN;  // 32 or 64
  static constexpr int kMmaTilesM = kWarpM / 16;
  static constexpr int kMmaTilesN = kWarpN / 8;
  static constexpr int kAChunksPerRow = kBlockK / 8;  // 16-byte chunks
  static constexpr int kBChunksPerRow = kBlockN / 8;
  static constexpr int kAStageBytes = kBlockM * kBlockK * 2;
  static constexpr int kBStageBytes = kBlockK * kBlockN * 2;
  static constexpr int kStageBytes = kAStageBytes + kBStageBytes;
  // Every thread issues the same number of cp.async chunks per stage.
  static constexpr int kAChunksPerThread = kBlockM * kAChunksPerRow / kThreads;
  static constexpr int kBChunksPerThread = kBlockK * kBChunksPerRow / kThreads;
  static_assert(kAChunksPerThread * kThreads == kBlockM * kAChunksPerRow &&
                kBChunksPerThread * kThreads == kBlockK * kBChunksPerRow,
                "tiles must split evenly over the threads");
  // Epilogue rows padded by 8 floats: the float2 fragment writes of a
  // half-warp (4 rows x 32 bytes) then fall in distinct banks.
  static constexpr int kOutStride = kBlockN + 8;
  static constexpr int kPipelineBytes = kStages * kStageBytes;
  static constexpr int kEpilogueBytes = kBlockM * kOutStride * 4;
  static constexpr int kSmemBytes =
      kPipelineBytes > kEpilogueBytes ? kPipelineBytes : kEpilogueBytes;
  static_assert(kAChunksPerRow == 4 || kAChunksPerRow % 8 == 0,
                "the swizzle handles 64-byte rows or multiples of 128 bytes");
  static_assert(kBChunksPerRow % 8 == 0, "B swizzle needs 128-byte rows");
};

// One operand's tile of a pipeline stage: the rows starting at row0 and
// kChunksPerRow * 8 columns starting at col0 of the row-major rows x cols
// matrix `src`, copied by 16-byte cp.async chunks split evenly over the
// block's threads into the swizzled tile at shared address `dst`. Chunks
// outside the matrix are zero-filled.
template <int kChunksPerRow, int kChunksPerThread, int kThreads, typename T>
__device__ __forceinline__ void LoadTileAsync(uint32_t dst, const T* src,
                                              int rows, int cols, int row0,
                                              int col0, int tid) {
#pragma unroll
  for (int j = 0; j < kChunksPerThread; ++j) {
    const int i = tid + j * kThreads;
    const int r = i / kChunksPerRow, chunk = i % kChunksPerRow;
    const int row = row0 + r, col = col0 + chunk * 8;
    const bool valid = row < rows && col < cols;
    const T* from = valid ? src + 1LL * row * cols + col : src;
    CpAsync16(dst + SwizzledChunk<kChunksPerRow>(r, chunk) * 16, from, valid);
  }
}

template <typename T, typename TOut, int kBlockN, int kBlockK, int kWarpsN>
__global__ void __launch_bounds__(Tiling<kBlockN, kBlockK, kWarpsN>::kThreads,
                                  Tiling<kBlockN, kBlockK, kWarpsN>::kMinBlocksPerSm)
MmaSyncGemm(GemmParams p) {
  using Tile = Tiling<kBlockN, kBlockK, kWarpsN>;
  constexpr int kThreads = Tile::kThreads;
  extern __shared__ __align__(128) unsigned char smem[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int warp_m = warp / kWarpsN, warp_n = warp % kWarpsN;

  // Grouped order: kGroupM block-rows share each block-column band.
  const int blocks_m = CeilDiv(p.m, kBlockM), blocks_n = CeilDiv(p.n, kBlockN);
  const int blocks_per_group = kGroupM * blocks_n;
  const int group = blockIdx.x / blocks_per_group;
  const int first_block_m = group * kGroupM;
  const int group_rows = min(blocks_m - first_block_m, kGroupM);
  const int in_group = blockIdx.x % blocks_per_group;
  const int row0 = (first_block_m + in_group % group_rows) * kBlockM;
  const int col0 = (in_group / group_rows) * kBlockN;

  const auto operands = SliceBatch<T, TOut>(p, blockIdx.y);

  const uint32_t smem_base =
      static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  auto a_stage = [&](int s) { return smem_base + s * Tile::kStageBytes; };
  auto b_stage = [&](int s) {
    return smem_base + s * Tile::kStageBytes + Tile::kAStageBytes;
  };

  auto load_stage = [&](int stage, int k0) {
    LoadTileAsync<Tile::kAChunksPerRow, Tile::kAChunksPerThread, kThreads>(
        a_stage(stage), operands.a, p.m, p.k, row0, k0, tid);
    LoadTileAsync<Tile::kBChunksPerRow, Tile::kBChunksPerThread, kThreads>(
        b_stage(stage), operands.b, p.k, p.n, k0, col0, tid);
  };

  float acc[Tile::kMmaTilesM][Tile::kMmaTilesN][4] = {};
  const int k_tiles = CeilDiv(p.k, kBlockK);
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < k_tiles) load_stage(s, s * kBlockK);
    CpAsyncCommit();  // empty groups keep the wait counts uniform
  }

  // ldmatrix row/chunk each lane addresses (see the x4 matrix order).
  const int lane_row = (lane & 7) + ((lane >> 3) & 1) * 8;
  const int lane_chunk = lane >> 4;

  for (int kt = 0; kt < k_tiles; ++kt) {
    CpAsyncWait<kStages - 2>();
    __syncthreads();  // tile kt visible; the stage reloaded below is free
    const int next = kt + kStages - 1;
    if (next < k_tiles) load_stage(next % kStages, next * kBlockK);
    CpAsyncCommit();

    const int stage = kt % kStages;
#pragma unroll
    for (int kk = 0; kk < kBlockK / 16; ++kk) {
      uint32_t a_frag[Tile::kMmaTilesM][4];
      uint32_t b_frag[Tile::kMmaTilesN][2];
#pragma unroll
      for (int mi = 0; mi < Tile::kMmaTilesM; ++mi) {
        const int r = warp_m * Tile::kWarpM + mi * 16 + lane_row;
        LdMatrixX4(a_frag[mi],
                   a_stage(stage) + SwizzledChunk<Tile::kAChunksPerRow>(
                                        r, kk * 2 + lane_chunk) * 16);
      }
#pragma unroll
      for (int nj = 0; nj < Tile::kMmaTilesN / 2; ++nj) {
        const int r = kk * 16 + lane_row;
        const int chunk = (warp_n * Tile::kWarpN + nj * 16) / 8 + lane_chunk;
        uint32_t t[4];
        LdMatrixX4Trans(
            t, b_stage(stage) +
                   SwizzledChunk<Tile::kBChunksPerRow>(r, chunk) * 16);
        b_frag[2 * nj][0] = t[0];
        b_frag[2 * nj][1] = t[1];
        b_frag[2 * nj + 1][0] = t[2];
        b_frag[2 * nj + 1][1] = t[3];
      }
#pragma unroll
      for (int mi = 0; mi < Tile::kMmaTilesM; ++mi) {
#pragma unroll
        for (int ni = 0; ni < Tile::kMmaTilesN; ++ni) {
          Mma<T>::Run(acc[mi][ni], a_frag[mi], b_frag[ni]);
        }
      }
    }
  }

  // Epilogue: fragments -> shared (f32) -> 8 contiguous outputs per thread.
  CpAsyncWait<0>();
  __syncthreads();
  float* staged = reinterpret_cast<float*>(smem);
  const int group_id = lane >> 2, quad = lane & 3;
#pragma unroll
  for (int mi = 0; mi < Tile::kMmaTilesM; ++mi) {
#pragma unroll
    for (int ni = 0; ni < Tile::kMmaTilesN; ++ni) {
      const int r = warp_m * Tile::kWarpM + mi * 16 + group_id;
      const int col = warp_n * Tile::kWarpN + ni * 8 + quad * 2;
      *reinterpret_cast<float2*>(&staged[r * Tile::kOutStride + col]) =
          make_float2(p.alpha * acc[mi][ni][0], p.alpha * acc[mi][ni][1]);
      *reinterpret_cast<float2*>(&staged[(r + 8) * Tile::kOutStride + col]) =
          make_float2(p.alpha * acc[mi][ni][2], p.alpha * acc[mi][ni][3]);
    }
  }
  __syncthreads();
  constexpr int kOutChunksPerRow = kBlockN / 8;
  static_assert(kBlockM * kOutChunksPerRow % kThreads == 0, "even split");
#pragma unroll 4
  for (int j = 0; j < kBlockM * kOutChunksPerRow / kThreads; ++j) {
    const int i = tid + j * kThreads;
    const int r = i / kOutChunksPerRow, col = (i % kOutChunksPerRow) * 8;
    const int out_row = row0 + r, out_col = col0 + col;
    if (out_row >= p.m || out_col >= p.n) continue;  // n % 8 == 0
    float v[8];
    Load8(&staged[r * Tile::kOutStride + col], v);
    StoreWithBetaC8(v, operands, 1LL * out_row * p.n + out_col, p.beta);
  }
}

template <typename T, typename TOut, int kBlockN, int kBlockK, int kWarpsN>
cudaError_t Launch(const GemmParams& p, cudaStream_t stream) {
  using Tile = Tiling<kBlockN, kBlockK, kWarpsN>;
  auto kernel = MmaSyncGemm<T, TOut, kBlockN, kBlockK, kWarpsN>;
  // Over 48 KiB of dynamic shared memory needs an explicit opt-in.
  cudaError_t status = cudaFuncSetAttribute(
      kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Tile::kSmemBytes);
  if (status != cudaSuccess) return status;
  const long long blocks =
      1LL * CeilDiv(p.m, kBlockM) * CeilDiv(p.n, kBlockN);
  if (blocks > 2147483647LL) return cudaErrorInvalidConfiguration;
  dim3 grid(static_cast<unsigned>(blocks), p.batch);
  kernel<<<grid, Tile::kThreads, Tile::kSmemBytes, stream>>>(p);
  return cudaGetLastError();
}

template <int kBlockN, int kBlockK, int kWarpsN = 4>
cudaError_t Dispatch(const GemmParams& p, cudaStream_t stream) {
  using E = ElementType;
  if (p.in_type == E::kBF16 && p.out_type == E::kF32)
    return Launch<__nv_bfloat16, float, kBlockN, kBlockK, kWarpsN>(p, stream);
  if (p.in_type == E::kBF16 && p.out_type == E::kBF16)
    return Launch<__nv_bfloat16, __nv_bfloat16, kBlockN, kBlockK, kWarpsN>(p, stream);
  if (p.in_type == E::kF16 && p.out_type == E::kF32)
    return Launch<__half, float, kBlockN, kBlockK, kWarpsN>(p, stream);
  if (p.in_type == E::kF16 && p.out_type == E::kF16)
    return Launch<__half, __half, kBlockN, kBlockK, kWarpsN>(p, stream);
  return cudaErrorInvalidValue;
}

}  // namespace mma_sync
}  // namespace pallas_gemm

extern "C" cudaError_t pallas_gemm_launch_mma_sync_bn128(
    const pallas_gemm::GemmParams& p, cudaStream_t stream) {
  return pallas_gemm::mma_sync::Dispatch<128, 32>(p, stream);
}

extern "C" cudaError_t pallas_gemm_launch_mma_sync_bn256(
    const pallas_gemm::GemmParams& p, cudaStream_t stream) {
  return pallas_gemm::mma_sync::Dispatch<256, 32>(p, stream);
}

// A K step of 64: half the barriers and pipeline bookkeeping per FLOP, at
// twice the shared memory per stage (4 x 48 KiB).
extern "C" cudaError_t pallas_gemm_launch_mma_sync_bn256_bk64(
    const pallas_gemm::GemmParams& p, cudaStream_t stream) {
  return pallas_gemm::mma_sync::Dispatch<256, 64>(p, stream);
}

// 128x128x32 with 4 warps of 64x64 and two blocks per SM.
extern "C" cudaError_t pallas_gemm_launch_mma_sync_bn128_w4(
    const pallas_gemm::GemmParams& p, cudaStream_t stream) {
  return pallas_gemm::mma_sync::Dispatch<128, 32, 2>(p, stream);
}
