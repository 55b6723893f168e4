// SGEMM rung 05: 128-bit global loads and a 1-D thread tile.
//
// Rung 04 issues one shared-memory load per FFMA (a_tile and b_tile both
// feed every multiply-add), so it is bound by shared-memory bandwidth, not
// by the FMA units. Here each thread computes TM = 8 outputs down a column:
// one b value loaded from shared memory is reused for 8 FFMAs, and A's
// values come as a strip along M. The block tile grows to 64x64 with a
// K step of 16, so each loaded element feeds 64 outputs instead of 32.
// Global loads are float4 (one 128-bit instruction instead of four), which
// needs k and n to be multiples of 4: the Python wrapper pads them.
#include "gemm_params.cuh"

namespace pallas_gemm {
namespace {

constexpr int kBlockM = 64, kBlockN = 64, kBlockK = 16, kThreadM = 8;
constexpr int kThreads = kBlockM * kBlockN / kThreadM;  // 512
// Two words of padding per k-row make the transposed A store conflict-free:
// lanes with the same row and k a multiple of 4 apart land 8 banks apart.
constexpr int kPadA = 2;

__global__ void __launch_bounds__(kThreads)
SgemmVectorized1d(GemmParams p) {
  __shared__ float a_tile[kBlockK][kBlockM + kPadA];  // [k][m]
  __shared__ float b_tile[kBlockK][kBlockN];          // [k][n]
  const int tid = threadIdx.x;
  const int row0 = blockIdx.x * kBlockM, col0 = blockIdx.y * kBlockN;
  const int batch = blockIdx.z;
  const float* a = BatchSlice<float>(p.a, batch, 1LL * p.m * p.k);
  const float* b = BatchSlice<float>(p.b, batch, 1LL * p.k * p.n);
  const float* c =
      p.c ? BatchSlice<float>(p.c, batch, 1LL * p.m * p.n) : nullptr;
  float* out = BatchSliceMut<float>(p.out, batch, 1LL * p.m * p.n);

  // Half of the threads load A, the other half B: one float4 each.
  const bool loads_a = tid < 256;
  const int load_id = loads_a ? tid : tid - 256;
  const int a_row = load_id / 4, a_k = (load_id % 4) * 4;
  const int b_k = load_id / 16, b_col = (load_id % 16) * 4;

  const int thread_col = tid % kBlockN;
  const int thread_row = (tid / kBlockN) * kThreadM;
  float acc[kThreadM] = {};
  const float4 zero = make_float4(0.f, 0.f, 0.f, 0.f);

  for (int k0 = 0; k0 < p.k; k0 += kBlockK) {
    if (loads_a) {
      const int row = row0 + a_row, col = k0 + a_k;
      const float4 v = (row < p.m && col < p.k)
          ? *reinterpret_cast<const float4*>(a + 1LL * row * p.k + col) : zero;
      a_tile[a_k + 0][a_row] = v.x;
      a_tile[a_k + 1][a_row] = v.y;
      a_tile[a_k + 2][a_row] = v.z;
      a_tile[a_k + 3][a_row] = v.w;
    } else {
      const int row = k0 + b_k, col = col0 + b_col;
      const float4 v = (row < p.k && col < p.n)
          ? *reinterpret_cast<const float4*>(b + 1LL * row * p.n + col) : zero;
      *reinterpret_cast<float4*>(&b_tile[b_k][b_col]) = v;
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < kBlockK; ++kk) {
      const float b_value = b_tile[kk][thread_col];
#pragma unroll
      for (int i = 0; i < kThreadM; ++i) {
        acc[i] = fmaf(a_tile[kk][thread_row + i], b_value, acc[i]);
      }
    }
    __syncthreads();
  }
  const int col = col0 + thread_col;
  if (col >= p.n) return;
#pragma unroll
  for (int i = 0; i < kThreadM; ++i) {
    const int row = row0 + thread_row + i;
    if (row < p.m) {
      const long long index = 1LL * row * p.n + col;
      out[index] = AlphaBeta(p, acc[i], c, index);
    }
  }
}

}  // namespace
}  // namespace pallas_gemm

extern "C" cudaError_t pallas_gemm_launch_sgemm_05_vectorized_1d(
    const pallas_gemm::GemmParams& p, cudaStream_t stream) {
  using namespace pallas_gemm;
  dim3 grid(CeilDiv(p.m, kBlockM), CeilDiv(p.n, kBlockN), p.batch);
  SgemmVectorized1d<<<grid, kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}
