// SGEMM rung 01: naive, one thread per output element.
//
// The baseline every later rung is measured against. Each thread walks the
// whole K extent of one row of A and one column of B straight from global
// memory. Lanes of a warp are laid out along M (threadIdx.x picks the row),
// so at every k the 32 lanes read 32 different rows of A (32 separate memory
// transactions) and store to 32 different rows of the output: the memory
// system serves a warp one sector per lane. Exact fp32 FFMA throughout.
#include "gemm_params.cuh"

namespace pallas_gemm {
namespace {

constexpr int kTile = 32;

__global__ void SgemmNaive(GemmParams p) {
  const int row = blockIdx.x * kTile + threadIdx.x;
  const int col = blockIdx.y * kTile + threadIdx.y;
  const int batch = blockIdx.z;
  if (row >= p.m || col >= p.n) return;
  const float* a = BatchSlice<float>(p.a, batch, 1LL * p.m * p.k);
  const float* b = BatchSlice<float>(p.b, batch, 1LL * p.k * p.n);
  const float* c =
      p.c ? BatchSlice<float>(p.c, batch, 1LL * p.m * p.n) : nullptr;
  float* out = BatchSliceMut<float>(p.out, batch, 1LL * p.m * p.n);
  float acc = 0.0f;
  for (int kk = 0; kk < p.k; ++kk) {
    acc = fmaf(a[1LL * row * p.k + kk], b[1LL * kk * p.n + col], acc);
  }
  const long long index = 1LL * row * p.n + col;
  out[index] = AlphaBeta(p, acc, c, index);
}

}  // namespace
}  // namespace pallas_gemm

extern "C" cudaError_t pallas_gemm_launch_sgemm_01_naive(
    const pallas_gemm::GemmParams& p, cudaStream_t stream) {
  using namespace pallas_gemm;
  dim3 block(kTile, kTile);
  dim3 grid(CeilDiv(p.m, kTile), CeilDiv(p.n, kTile), p.batch);
  SgemmNaive<<<grid, block, 0, stream>>>(p);
  return cudaGetLastError();
}
