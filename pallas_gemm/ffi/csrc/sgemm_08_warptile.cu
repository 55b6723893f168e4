// SGEMM rung 08: warp tiling.
//
// Rung 07 spreads a warp's 32 thread tiles across the whole 128x128 block, so
// per K step a warp reads 16 distinct float4s of B (two shared-memory
// wavefronts) and its outputs are scattered. Here the block is cut into 8
// warp tiles of 64x32 (2 warps along M, 4 along N) and each warp's lanes form
// an 8x4 grid inside its own tile, each lane owning 2x2 quadrants of 4x4.
// Per K step a warp reads 8 distinct float4s of A and 4 of B, all served by
// broadcasts in one wavefront each, so shared-memory bandwidth per FFMA
// halves. The K step doubles to 16 (half the barriers per FLOP), and the
// double buffer with register prefetch from rung 07 stays. Warp tiles are
// also the unit the tensor-core kernel (mma_sync.cu) is organised around.
#include "gemm_params.cuh"

namespace pallas_gemm {
namespace {

constexpr int kBlockM = 128, kBlockN = 128, kBlockK = 16;
constexpr int kThreads = 256;
constexpr int kWarpM = 64, kWarpN = 32;            // 2 x 4 warps
constexpr int kLanesM = 8, kLanesN = 4;            // lane grid in a warp tile
static_assert(kLanesM * kLanesN == 32, "one warp");
static_assert(kLanesM * 4 * 2 == kWarpM && kLanesN * 4 * 2 == kWarpN,
              "2x2 quadrants of 4x4 per lane cover the warp tile");
constexpr int kSubM = kWarpM / 2, kSubN = kWarpN / 2;  // quadrant strides
constexpr int kPadA = 4;
constexpr int kLoadsPerThread = kBlockM * kBlockK / 4 / kThreads;  // 2 float4

__global__ void __launch_bounds__(kThreads)
SgemmWarptile(GemmParams p) {
  __shared__ __align__(16) float a_tile[2][kBlockK][kBlockM + kPadA];  // [k][m]
  __shared__ __align__(16) float b_tile[2][kBlockK][kBlockN];          // [k][n]
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int row0 = blockIdx.x * kBlockM, col0 = blockIdx.y * kBlockN;
  const int batch = blockIdx.z;
  const float* a = BatchSlice<float>(p.a, batch, 1LL * p.m * p.k);
  const float* b = BatchSlice<float>(p.b, batch, 1LL * p.k * p.n);
  const float* c =
      p.c ? BatchSlice<float>(p.c, batch, 1LL * p.m * p.n) : nullptr;
  float* out = BatchSliceMut<float>(p.out, batch, 1LL * p.m * p.n);

  const int thread_row = (warp / 4) * kWarpM + (lane % kLanesM) * 4;
  const int thread_col = (warp % 4) * kWarpN + (lane / kLanesM) * 4;
  const float4 zero = make_float4(0.f, 0.f, 0.f, 0.f);

  float4 next_a[kLoadsPerThread], next_b[kLoadsPerThread];
  auto load = [&](int k0) {
#pragma unroll
    for (int l = 0; l < kLoadsPerThread; ++l) {
      const int id = tid + l * kThreads;
      const int a_row = row0 + id / 4, a_col = k0 + (id % 4) * 4;
      next_a[l] = (a_row < p.m && a_col < p.k)
          ? *reinterpret_cast<const float4*>(a + 1LL * a_row * p.k + a_col)
          : zero;
      const int b_row = k0 + id / 32, b_col = col0 + (id % 32) * 4;
      next_b[l] = (b_row < p.k && b_col < p.n)
          ? *reinterpret_cast<const float4*>(b + 1LL * b_row * p.n + b_col)
          : zero;
    }
  };
  auto store = [&](int buffer) {
#pragma unroll
    for (int l = 0; l < kLoadsPerThread; ++l) {
      const int id = tid + l * kThreads;
      const int a_row = id / 4, a_k = (id % 4) * 4;
      a_tile[buffer][a_k + 0][a_row] = next_a[l].x;
      a_tile[buffer][a_k + 1][a_row] = next_a[l].y;
      a_tile[buffer][a_k + 2][a_row] = next_a[l].z;
      a_tile[buffer][a_k + 3][a_row] = next_a[l].w;
      *reinterpret_cast<float4*>(&b_tile[buffer][id / 32][(id % 32) * 4]) =
          next_b[l];
    }
  };

  float acc[8][8] = {};
  load(0);
  store(0);
  __syncthreads();
  int buffer = 0;
  for (int k0 = 0; k0 < p.k; k0 += kBlockK) {
    const bool has_next = k0 + kBlockK < p.k;
    if (has_next) load(k0 + kBlockK);
#pragma unroll
    for (int kk = 0; kk < kBlockK; ++kk) {
      float a_values[8], b_values[8];
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        *reinterpret_cast<float4*>(&a_values[4 * q]) =
            *reinterpret_cast<const float4*>(
                &a_tile[buffer][kk][thread_row + q * kSubM]);
        *reinterpret_cast<float4*>(&b_values[4 * q]) =
            *reinterpret_cast<const float4*>(
                &b_tile[buffer][kk][thread_col + q * kSubN]);
      }
#pragma unroll
      for (int i = 0; i < 8; ++i) {
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          acc[i][j] = fmaf(a_values[i], b_values[j], acc[i][j]);
        }
      }
    }
    if (has_next) store(buffer ^ 1);
    __syncthreads();
    buffer ^= 1;
  }

#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int row = row0 + thread_row + (i % 4) + (i / 4) * kSubM;
    if (row >= p.m) continue;
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      const int col = col0 + thread_col + q * kSubN;
      if (col >= p.n) continue;  // n % 4 == 0: a float4 is wholly in or out
      const long long index = 1LL * row * p.n + col;
      StoreAlphaBeta4(p, &acc[i][q * 4], c, out, index);
    }
  }
}

}  // namespace
}  // namespace pallas_gemm

extern "C" cudaError_t pallas_gemm_launch_sgemm_08_warptile(
    const pallas_gemm::GemmParams& p, cudaStream_t stream) {
  using namespace pallas_gemm;
  dim3 grid(CeilDiv(p.m, kBlockM), CeilDiv(p.n, kBlockN), p.batch);
  SgemmWarptile<<<grid, kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}
