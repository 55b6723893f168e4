// SGEMM rung 09: two blocks per SM.
//
// Rung 08 needs 140 registers per thread, so only one 256-thread block fits
// in an SM's 64K registers: while that block waits at its barrier or for
// its global loads, the FMA pipes idle. Here __launch_bounds__(256, 2) caps
// the kernel at 128 registers so two blocks share each SM and one's stalls
// overlap the other's math. To make room, B no longer passes through
// registers: cp.async copies it straight into the free shared-memory buffer
// (it needs no transpose, unlike A). Tiles, warp layout and the FFMA loop
// are rung 08's.
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

__global__ void __launch_bounds__(kThreads, 2)
SgemmTwoBlocksPerSm(GemmParams p) {
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

  float4 next_a[kLoadsPerThread];
  auto load_a = [&](int k0) {
#pragma unroll
    for (int l = 0; l < kLoadsPerThread; ++l) {
      const int id = tid + l * kThreads;
      const int a_row = row0 + id / 4, a_col = k0 + (id % 4) * 4;
      next_a[l] = (a_row < p.m && a_col < p.k)
          ? *reinterpret_cast<const float4*>(a + 1LL * a_row * p.k + a_col)
          : zero;
    }
  };
  auto store_a = [&](int buffer) {
#pragma unroll
    for (int l = 0; l < kLoadsPerThread; ++l) {
      const int id = tid + l * kThreads;
      const int a_row = id / 4, a_k = (id % 4) * 4;
      a_tile[buffer][a_k + 0][a_row] = next_a[l].x;
      a_tile[buffer][a_k + 1][a_row] = next_a[l].y;
      a_tile[buffer][a_k + 2][a_row] = next_a[l].z;
      a_tile[buffer][a_k + 3][a_row] = next_a[l].w;
    }
  };
  // Out-of-range chunks are zero-filled (src-size 0; nothing is read).
  auto copy_b = [&](int buffer, int k0) {
#pragma unroll
    for (int l = 0; l < kLoadsPerThread; ++l) {
      const int id = tid + l * kThreads;
      const int b_row = k0 + id / 32, b_col = col0 + (id % 32) * 4;
      const bool valid = b_row < p.k && b_col < p.n;
      const float* src = valid ? b + 1LL * b_row * p.n + b_col : b;
      const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(
          &b_tile[buffer][id / 32][(id % 32) * 4]));
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                   ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
    }
    asm volatile("cp.async.commit_group;\n" ::);
  };
  auto wait_b = [] { asm volatile("cp.async.wait_group 0;\n" ::); };

  float acc[8][8] = {};
  copy_b(0, 0);
  load_a(0);
  store_a(0);
  wait_b();
  __syncthreads();
  int buffer = 0;
  for (int k0 = 0; k0 < p.k; k0 += kBlockK) {
    const bool has_next = k0 + kBlockK < p.k;
    if (has_next) {
      // The other buffer was last read before the previous barrier.
      copy_b(buffer ^ 1, k0 + kBlockK);
      load_a(k0 + kBlockK);
    }
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
    if (has_next) {
      store_a(buffer ^ 1);
      wait_b();
    }
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

extern "C" cudaError_t pallas_gemm_launch_sgemm_09_two_blocks_per_sm(
    const pallas_gemm::GemmParams& p, cudaStream_t stream) {
  using namespace pallas_gemm;
  dim3 grid(CeilDiv(p.m, kBlockM), CeilDiv(p.n, kBlockN), p.batch);
  SgemmTwoBlocksPerSm<<<grid, kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}
