// SGEMM rung 07: 128x128 block tile, 8x8 per thread, double-buffered shared
// memory with a register prefetch.
//
// Two changes over rung 06. (1) Bigger tiles: a 128x128 block with an 8x8
// thread tile does 64 FFMAs per 4 float4 shared loads (rung 06: 16 per 2),
// and every global element is reused 128 times per block. The 8x8 tile is
// four 4x4 quadrants 64 rows/columns apart, so a warp's float4 reads of B
// cover contiguous 256-byte runs. (2) Latency hiding: while the block
// computes on one shared-memory buffer, each thread already holds the next
// K step's global loads in registers and stores them into the other buffer
// afterwards. One __syncthreads per K step instead of two, and the global
// load latency overlaps the FFMAs.
#include "gemm_params.cuh"

namespace pallas_gemm {
namespace {

constexpr int kBlockM = 128, kBlockN = 128, kBlockK = 8;
constexpr int kThreads = 256;
constexpr int kPadA = 4;  // keeps float4 rows aligned; transposed store conflict-free
constexpr int kHalf = 64;  // distance between the quadrants of a thread tile

__global__ void __launch_bounds__(kThreads)
SgemmDoubleBuffered(GemmParams p) {
  __shared__ __align__(16) float a_tile[2][kBlockK][kBlockM + kPadA];  // [k][m]
  __shared__ __align__(16) float b_tile[2][kBlockK][kBlockN];          // [k][n]
  const int tid = threadIdx.x;
  const int row0 = blockIdx.x * kBlockM, col0 = blockIdx.y * kBlockN;
  const int batch = blockIdx.z;
  const float* a = BatchSlice<float>(p.a, batch, 1LL * p.m * p.k);
  const float* b = BatchSlice<float>(p.b, batch, 1LL * p.k * p.n);
  const float* c =
      p.c ? BatchSlice<float>(p.c, batch, 1LL * p.m * p.n) : nullptr;
  float* out = BatchSliceMut<float>(p.out, batch, 1LL * p.m * p.n);

  const int a_row = tid / 2, a_k = (tid % 2) * 4;
  const int b_k = tid / 32, b_col = (tid % 32) * 4;
  const int thread_row = (tid / 16) * 4, thread_col = (tid % 16) * 4;
  const float4 zero = make_float4(0.f, 0.f, 0.f, 0.f);

  auto load_a = [&](int k0) {
    const int row = row0 + a_row, col = k0 + a_k;
    return (row < p.m && col < p.k)
        ? *reinterpret_cast<const float4*>(a + 1LL * row * p.k + col) : zero;
  };
  auto load_b = [&](int k0) {
    const int row = k0 + b_k, col = col0 + b_col;
    return (row < p.k && col < p.n)
        ? *reinterpret_cast<const float4*>(b + 1LL * row * p.n + col) : zero;
  };
  auto store_tiles = [&](int buffer, float4 av, float4 bv) {
    a_tile[buffer][a_k + 0][a_row] = av.x;
    a_tile[buffer][a_k + 1][a_row] = av.y;
    a_tile[buffer][a_k + 2][a_row] = av.z;
    a_tile[buffer][a_k + 3][a_row] = av.w;
    *reinterpret_cast<float4*>(&b_tile[buffer][b_k][b_col]) = bv;
  };

  float acc[8][8] = {};
  store_tiles(0, load_a(0), load_b(0));
  __syncthreads();
  int buffer = 0;
  for (int k0 = 0; k0 < p.k; k0 += kBlockK) {
    const bool has_next = k0 + kBlockK < p.k;
    float4 next_a = zero, next_b = zero;
    if (has_next) {
      next_a = load_a(k0 + kBlockK);
      next_b = load_b(k0 + kBlockK);
    }
#pragma unroll
    for (int kk = 0; kk < kBlockK; ++kk) {
      float a_values[8], b_values[8];
      *reinterpret_cast<float4*>(&a_values[0]) =
          *reinterpret_cast<const float4*>(&a_tile[buffer][kk][thread_row]);
      *reinterpret_cast<float4*>(&a_values[4]) =
          *reinterpret_cast<const float4*>(&a_tile[buffer][kk][thread_row + kHalf]);
      *reinterpret_cast<float4*>(&b_values[0]) =
          *reinterpret_cast<const float4*>(&b_tile[buffer][kk][thread_col]);
      *reinterpret_cast<float4*>(&b_values[4]) =
          *reinterpret_cast<const float4*>(&b_tile[buffer][kk][thread_col + kHalf]);
#pragma unroll
      for (int i = 0; i < 8; ++i) {
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          acc[i][j] = fmaf(a_values[i], b_values[j], acc[i][j]);
        }
      }
    }
    if (has_next) store_tiles(buffer ^ 1, next_a, next_b);
    __syncthreads();
    buffer ^= 1;
  }

#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int row = row0 + thread_row + (i % 4) + (i / 4) * kHalf;
    if (row >= p.m) continue;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int col = col0 + thread_col + half * kHalf;
      if (col >= p.n) continue;  // n % 4 == 0: a float4 is wholly in or out
      const long long index = 1LL * row * p.n + col;
      StoreAlphaBeta4(p, &acc[i][half * 4], c, out, index);
    }
  }
}

}  // namespace
}  // namespace pallas_gemm

extern "C" cudaError_t pallas_gemm_launch_sgemm_07_double_buffered(
    const pallas_gemm::GemmParams& p, cudaStream_t stream) {
  using namespace pallas_gemm;
  dim3 grid(CeilDiv(p.m, kBlockM), CeilDiv(p.n, kBlockN), p.batch);
  SgemmDoubleBuffered<<<grid, kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}
