// SGEMM rung 04: bank-conflict-free shared memory.
//
// Rung 03 with one change: each k-row of the transposed A tile is padded by
// one word (a_tile[32][33]). The transposed store a_tile[tx][ty] now has a
// stride of 33 words across the warp, so the 32 lanes hit 32 different banks
// and the store issues once instead of 32 times. The inner-loop reads stay
// conflict-free (a broadcast of a_tile[kk][ty], consecutive b_tile[kk][tx]).
// The arithmetic is unchanged; only shared-memory replays disappear.
#include "gemm_params.cuh"

namespace pallas_gemm {
namespace {

constexpr int kTile = 32;
constexpr int kPad = 1;  // the whole difference from rung 03

__global__ void SgemmSmemPadded(GemmParams p) {
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

extern "C" cudaError_t pallas_gemm_launch_sgemm_04_conflict_free(
    const pallas_gemm::GemmParams& p, cudaStream_t stream) {
  using namespace pallas_gemm;
  dim3 block(kTile, kTile);
  dim3 grid(CeilDiv(p.m, kTile), CeilDiv(p.n, kTile), p.batch);
  SgemmSmemPadded<<<grid, block, 0, stream>>>(p);
  return cudaGetLastError();
}
