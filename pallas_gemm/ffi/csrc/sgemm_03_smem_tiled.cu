// SGEMM rung 03: shared-memory tiling.
//
// Rung 02 reads every element of A and B from L1/L2 once per output that
// uses it. Here a 32x32 block stages a 32x32 tile of A and of B in shared
// memory once per K step, and each of those 2*32*32 loads feeds 32 FFMAs,
// so global/L2 traffic drops by 32x. Every thread still computes one output.
//
// A is kept k-major in shared memory (a_tile[k][m]) because the inner loop
// and the next rungs read a strip of A along M for a fixed k. Writing that
// transposed tile naively is the flaw this rung keeps on purpose: the 32
// lanes of a warp store a_tile[tx][ty] with a stride of 32 words, so all 32
// land in the same bank and the store is replayed 32 times. Rung 04 fixes it.
#include "gemm_params.cuh"

namespace pallas_gemm {
namespace {

constexpr int kTile = 32;
constexpr int kPad = 0;  // rung 04 sets this to 1

__global__ void SgemmSmemTiled(GemmParams p) {
  __shared__ float a_tile[kTile][kTile + kPad];  // [k][m]
  __shared__ float b_tile[kTile][kTile];         // [k][n]
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int row0 = blockIdx.x * kTile, col0 = blockIdx.y * kTile;
  const int batch = blockIdx.z;
  const float* a = BatchSlice<float>(p.a, batch, 1LL * p.m * p.k);
  const float* b = BatchSlice<float>(p.b, batch, 1LL * p.k * p.n);
  const float* c =
      p.c ? BatchSlice<float>(p.c, batch, 1LL * p.m * p.n) : nullptr;
  float* out = BatchSliceMut<float>(p.out, batch, 1LL * p.m * p.n);

  float acc = 0.0f;
  for (int k0 = 0; k0 < p.k; k0 += kTile) {
    // Coalesced global reads (lanes along k for A, along n for B); ragged
    // edges load zeros, which add nothing to the dot products.
    const int a_row = row0 + ty, a_col = k0 + tx;
    a_tile[tx][ty] = (a_row < p.m && a_col < p.k)
                         ? a[1LL * a_row * p.k + a_col] : 0.0f;
    const int b_row = k0 + ty, b_col = col0 + tx;
    b_tile[ty][tx] = (b_row < p.k && b_col < p.n)
                         ? b[1LL * b_row * p.n + b_col] : 0.0f;
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < kTile; ++kk) {
      acc = fmaf(a_tile[kk][ty], b_tile[kk][tx], acc);
    }
    __syncthreads();
  }
  const int row = row0 + ty, col = col0 + tx;
  if (row < p.m && col < p.n) {
    const long long index = 1LL * row * p.n + col;
    out[index] = AlphaBeta(p, acc, c, index);
  }
}

}  // namespace
}  // namespace pallas_gemm

extern "C" cudaError_t pallas_gemm_launch_sgemm_03_smem_tiled(
    const pallas_gemm::GemmParams& p, cudaStream_t stream) {
  using namespace pallas_gemm;
  dim3 block(kTile, kTile);
  dim3 grid(CeilDiv(p.m, kTile), CeilDiv(p.n, kTile), p.batch);
  SgemmSmemTiled<<<grid, block, 0, stream>>>(p);
  return cudaGetLastError();
}
