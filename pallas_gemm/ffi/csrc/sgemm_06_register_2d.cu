// SGEMM rung 06: a 2-D register tile (64x64 block, 4x4 per thread).
//
// Rung 05 reuses each b value 8 times but still loads one a value per FFMA
// pair. With a 4x4 outer product per thread, one float4 of A (4 rows) and
// one float4 of B (4 columns) from shared memory feed 16 FFMAs: 2 loads per
// 16 FMAs instead of 9 per 8. Shared-memory reads are 128-bit, the output is
// written as float4 rows, and 256 threads (fewer, fatter ones) leave more
// registers per thread for the accumulators.
#include "gemm_params.cuh"

namespace pallas_gemm {
namespace {

constexpr int kBlockM = 64, kBlockN = 64, kBlockK = 16, kThreadM = 4,
              kThreadN = 4;
constexpr int kThreads = (kBlockM / kThreadM) * (kBlockN / kThreadN);  // 256
// Rows of the transposed A tile stay 16-byte aligned for float4 reads.
constexpr int kPadA = 4;

__global__ void __launch_bounds__(kThreads)
SgemmRegister2d(GemmParams p) {
  __shared__ __align__(16) float a_tile[kBlockK][kBlockM + kPadA];  // [k][m]
  __shared__ __align__(16) float b_tile[kBlockK][kBlockN];          // [k][n]
  const int tid = threadIdx.x;
  const int row0 = blockIdx.x * kBlockM, col0 = blockIdx.y * kBlockN;
  const int batch = blockIdx.z;
  const float* a = BatchSlice<float>(p.a, batch, 1LL * p.m * p.k);
  const float* b = BatchSlice<float>(p.b, batch, 1LL * p.k * p.n);
  const float* c =
      p.c ? BatchSlice<float>(p.c, batch, 1LL * p.m * p.n) : nullptr;
  float* out = BatchSliceMut<float>(p.out, batch, 1LL * p.m * p.n);

  const int a_row = tid / 4, a_k = (tid % 4) * 4;
  const int b_k = tid / 16, b_col = (tid % 16) * 4;
  const int thread_row = (tid / 16) * kThreadM;
  const int thread_col = (tid % 16) * kThreadN;
  float acc[kThreadM][kThreadN] = {};
  const float4 zero = make_float4(0.f, 0.f, 0.f, 0.f);

  for (int k0 = 0; k0 < p.k; k0 += kBlockK) {
    {
      const int row = row0 + a_row, col = k0 + a_k;
      const float4 v = (row < p.m && col < p.k)
          ? *reinterpret_cast<const float4*>(a + 1LL * row * p.k + col) : zero;
      a_tile[a_k + 0][a_row] = v.x;
      a_tile[a_k + 1][a_row] = v.y;
      a_tile[a_k + 2][a_row] = v.z;
      a_tile[a_k + 3][a_row] = v.w;
    }
    {
      const int row = k0 + b_k, col = col0 + b_col;
      const float4 v = (row < p.k && col < p.n)
          ? *reinterpret_cast<const float4*>(b + 1LL * row * p.n + col) : zero;
      *reinterpret_cast<float4*>(&b_tile[b_k][b_col]) = v;
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < kBlockK; ++kk) {
      const float4 a4 = *reinterpret_cast<const float4*>(&a_tile[kk][thread_row]);
      const float4 b4 = *reinterpret_cast<const float4*>(&b_tile[kk][thread_col]);
      const float a_values[4] = {a4.x, a4.y, a4.z, a4.w};
      const float b_values[4] = {b4.x, b4.y, b4.z, b4.w};
#pragma unroll
      for (int i = 0; i < kThreadM; ++i) {
#pragma unroll
        for (int j = 0; j < kThreadN; ++j) {
          acc[i][j] = fmaf(a_values[i], b_values[j], acc[i][j]);
        }
      }
    }
    __syncthreads();
  }
  const int col = col0 + thread_col;
  if (col >= p.n) return;  // n % 4 == 0: a float4 is wholly in or out
#pragma unroll
  for (int i = 0; i < kThreadM; ++i) {
    const int row = row0 + thread_row + i;
    if (row >= p.m) continue;
    const long long index = 1LL * row * p.n + col;
    StoreAlphaBeta4(p, acc[i], c, out, index);
  }
}

}  // namespace
}  // namespace pallas_gemm

extern "C" cudaError_t pallas_gemm_launch_sgemm_06_register_2d(
    const pallas_gemm::GemmParams& p, cudaStream_t stream) {
  using namespace pallas_gemm;
  dim3 grid(CeilDiv(p.m, kBlockM), CeilDiv(p.n, kBlockN), p.batch);
  SgemmRegister2d<<<grid, kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}
