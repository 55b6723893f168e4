// SGEMM rung 02: coalesced global accesses.
//
// Same arithmetic as rung 01; only the thread-to-element map changes.
// threadIdx.x now walks N, so at every k the 32 lanes of a warp read 32
// consecutive floats of one row of B (one 128-byte transaction) and all read
// the same element of A (a broadcast), and the final stores are 128 contiguous
// bytes. The traffic per warp drops by about 32x, and the kernel moves from
// transaction-bound to L1/L2-bandwidth bound.
#include "gemm_params.cuh"

namespace pallas_gemm {
namespace {

constexpr int kTile = 32;

__global__ void SgemmCoalesced(GemmParams p) {
  // Row tiles on grid x (no 65535 limit): M grows with vmap and batching.
  const int row = blockIdx.x * kTile + threadIdx.y;
  const int col = blockIdx.y * kTile + threadIdx.x;
  const int batch = blockIdx.z;
  if (row >= p.m || col >= p.n) return;
  const float* a = BatchSlice<float>(p.a, batch, 1LL * p.m * p.k);
  const float* b = BatchSlice<float>(p.b, batch, 1LL * p.k * p.n);
  const float* c =
      p.c ? BatchSlice<float>(p.c, batch, 1LL * p.m * p.n) : nullptr;
  float* out = BatchSliceMut<float>(p.out, batch, 1LL * p.m * p.n);
  const float* a_row = a + 1LL * row * p.k;
  float acc = 0.0f;
  for (int kk = 0; kk < p.k; ++kk) {
    acc = fmaf(a_row[kk], b[1LL * kk * p.n + col], acc);
  }
  const long long index = 1LL * row * p.n + col;
  out[index] = AlphaBeta(p, acc, c, index);
}

}  // namespace
}  // namespace pallas_gemm

extern "C" cudaError_t pallas_gemm_launch_sgemm_02_coalesced(
    const pallas_gemm::GemmParams& p, cudaStream_t stream) {
  using namespace pallas_gemm;
  dim3 block(kTile, kTile);
  dim3 grid(CeilDiv(p.m, kTile), CeilDiv(p.n, kTile), p.batch);
  SgemmCoalesced<<<grid, block, 0, stream>>>(p);
  return cudaGetLastError();
}
