// SGEMM rung 10: a software pipeline from global memory to the FMA pipes.
//
// On Hopper an SM sub-partition issues one warp instruction per clock, and
// its 32 FP32 lanes retire one warp-wide FFMA per clock. So every
// instruction that is not an FFMA takes an issue slot from the FMA pipe, and
// so does every cycle in which no warp has an FFMA ready. Rung 09 loses both
// ways. Per K tile (1024 FFMAs per thread) it issues about 165 other
// instructions: 64 LDS.128, and some 100 of copy bookkeeping (bounds tests
// and 64-bit address arithmetic redone for every global load, four scalar
// STS per float4 of A). And every tile boundary is a stall: STS, wait,
// barrier, then each warp's first FFMAs wait for LDS issued after the
// barrier. This rung keeps rung 09's warp tiles of broadcast-friendly 4x4
// quadrants and pipelines every level:
//  1. Fragments are double-buffered in registers: the LDS.128s for step
//     kk + 1 are issued before the FFMAs of step kk, across the K-tile
//     boundary too, so shared-memory latency always hides behind math.
//  2. Both operands go global -> shared by cp.async, into a ring of kStages
//     tiles issued kStages - 1 tiles ahead. A, which must be transposed to
//     [k][m], is copied one float at a time (4-byte cp.async): the copy does
//     the transpose, and with rows padded to 4 mod 32 words a warp's 32
//     copies land in 32 different banks. No staging registers and no STS.
//     (kAsyncA = false keeps rung 09's LDG + STS path for A, to compare.)
//  3. One __syncthreads per K tile, placed inside the last step, just
//     before the first read of the next tile: it makes that tile visible and
//     proves every warp is done with the current one, whose stage the next
//     copies then refill. The last step's FFMAs cover the new tile's LDS.
//  4. No bounds tests in the steady state. Rows past m and columns past n
//     are clamped onto the last real row or column: they only feed
//     accumulators the epilogue never stores, so what they read does not
//     matter. K cannot be clamped (its products land in real outputs), so
//     only the partial last K tile takes a predicated path, whose
//     out-of-range copies zero-fill (src-size 0).
//  5. A bigger thread tile. 8x16 outputs per thread (64x64 warp tiles) do
//     128 FFMAs per six LDS.128, against 64 per four for rung 09's 8x8, so
//     a larger share of the inner loop's instructions are FFMAs.
// The shipped tiling is a 128x256 block of 256 threads (2x4 warps of 64x64),
// one block per SM: the fastest of the tilings swept on an H200, on a par
// with cuBLAS's exact SGEMM and clearly ahead of rung 09. The sweep
// variants separate the steps above: rung 09's 8x8 tiles with the new
// pipeline (which ties), A through registers, K steps of 16, 3 or 4 stages,
// 128x128 blocks of 4 warps two per SM, and 256x128. Measured numbers:
// experiments/results/nvidia_h200/ffi/README.md, "Numbers the CUDA sources cite".
#include "cp_async.cuh"
#include "gemm_params.cuh"
#include "sweep.cuh"

namespace pallas_gemm {
namespace sgemm_10 {

// A block of kWarpsM x kWarpsN warps; a warp's lanes form a kLanesM x
// (32 / kLanesM) grid and each lane owns kQuadsM x kQuadsN quadrants of 4x4
// outputs, kLanesM * 4 rows (and (32 / kLanesM) * 4 columns) apart.
template <int kWarpsM_, int kWarpsN_, int kLanesM_, int kQuadsM_,
          int kQuadsN_, int kBlockK_, int kStages_, bool kAsyncA_,
          int kMinBlocksPerSm_>
struct Tiling {
  static constexpr int kWarpsM = kWarpsM_, kWarpsN = kWarpsN_;
  static constexpr int kLanesM = kLanesM_, kLanesN = 32 / kLanesM_;
  static constexpr int kQuadsM = kQuadsM_, kQuadsN = kQuadsN_;
  static constexpr int kThreadM = 4 * kQuadsM, kThreadN = 4 * kQuadsN;
  static constexpr int kSubM = 4 * kLanesM, kSubN = 4 * kLanesN;
  static constexpr int kWarpM = kLanesM * kThreadM, kWarpN = kLanesN * kThreadN;
  static constexpr int kBlockM = kWarpsM * kWarpM, kBlockN = kWarpsN * kWarpN;
  static constexpr int kBlockK = kBlockK_, kStages = kStages_;
  static constexpr bool kAsyncA = kAsyncA_;
  static constexpr int kMinBlocksPerSm = kMinBlocksPerSm_;
  static constexpr int kThreads = 32 * kWarpsM * kWarpsN;

  // One stage: A as [k][m] rows of kStrideA floats, then B as [k][n]. A
  // stride of 4 mod 32 words keeps float4 reads aligned and makes both A
  // store patterns below conflict-free.
  static constexpr int kStrideA = kBlockM + 4, kStrideB = kBlockN;
  static constexpr int kAFloats = kBlockK * kStrideA;
  static constexpr int kStageFloats = kAFloats + kBlockK * kStrideB;
  static constexpr int kStageBytes = kStageFloats * 4;
  static constexpr int kSmemBytes = kStages * kStageBytes;

  // A copies. Async: 8 lanes cover one row's 8 consecutive k (a 32-byte
  // sector), 4 rows per warp; lane l writes bank 4 * (l % 8) + l / 8.
  // Registers: 2 lanes cover one row's 8 k as two float4, 16 rows per warp;
  // component e of lane l lands in bank 16 * (l % 2) + 4 * e + l / 2.
  // Either way a thread copies rows r + i * kARowStep at k = a_k + 8 * h.
  static constexpr int kALanesK = kAsyncA ? 8 : 2;
  static constexpr int kAFloatsPerCopy = kAsyncA ? 1 : 4;
  static constexpr int kARowStep = kThreads / kALanesK;
  static constexpr int kARows = kBlockM / kARowStep;
  static constexpr int kAKSteps = kBlockK / 8;
  // B copies: 16-byte chunks; a thread copies column chunk t % kBChunks of
  // rows t / kBChunks + l * kBRowStep.
  static constexpr int kBChunks = kBlockN / 4;
  static constexpr int kBRowStep = kThreads / kBChunks;
  static constexpr int kBRows = kBlockK / kBRowStep;

  static_assert(kLanesM * kLanesN == 32, "one warp");
  static_assert(kBlockK % 8 == 0, "A copies cover k in groups of 8");
  // The fragment buffer of step kk is kk % 2; it must restart at 0 on every
  // tile for the cross-tile prefetch to land in the right buffer.
  static_assert(kBlockK % 2 == 0, "even K step");
  static_assert(kStages >= 2, "the ring needs a stage to fill while computing");
  static_assert(kThreads % kALanesK == 0 && kBlockM % kARowStep == 0,
                "A copies split evenly over the threads");
  static_assert(kThreads % kBChunks == 0 && kBlockK % kBRowStep == 0,
                "B copies split evenly over the threads");
  static_assert(kStrideA % 32 == 4, "A padding");
  static_assert(kSmemBytes * kMinBlocksPerSm <= 227 * 1024, "shared memory");
};

__device__ __forceinline__ uint32_t SmemAddress(const void* pointer) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(pointer));
}

template <typename T>
__global__ void __launch_bounds__(T::kThreads, T::kMinBlocksPerSm)
SgemmPipelined(GemmParams p) {
  constexpr int kBlockM = T::kBlockM, kBlockN = T::kBlockN;
  constexpr int kBlockK = T::kBlockK, kStages = T::kStages;
  constexpr int kThreadM = T::kThreadM, kThreadN = T::kThreadN;
  constexpr int kStrideA = T::kStrideA, kStrideB = T::kStrideB;

  extern __shared__ float4 smem_float4[];
  float* smem = reinterpret_cast<float*>(smem_float4);

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int row0 = blockIdx.x * kBlockM, col0 = blockIdx.y * kBlockN;
  const int batch = blockIdx.z;
  const int m = p.m, n = p.n, k = p.k;
  const float* a = BatchSlice<float>(p.a, batch, 1LL * m * k);
  const float* b = BatchSlice<float>(p.b, batch, 1LL * k * n);
  const float* c =
      p.c ? BatchSlice<float>(p.c, batch, 1LL * m * n) : nullptr;
  float* out = BatchSliceMut<float>(p.out, batch, 1LL * m * n);

  // Copy assignment, fixed for the whole kernel. Clamped rows and columns
  // read real data that only reaches discarded outputs (file comment, 4).
  const int a_row = tid / T::kALanesK;
  const int a_k = (tid % T::kALanesK) * T::kAFloatsPerCopy;
  const float* a_src[T::kARows];
#pragma unroll
  for (int i = 0; i < T::kARows; ++i) {
    const int row = min(row0 + a_row + i * T::kARowStep, m - 1);
    a_src[i] = a + 1LL * row * k + a_k;
  }
  const int b_row = tid / T::kBChunks;
  const int b_chunk = (tid % T::kBChunks) * 4;
  const float* b_src = b + 1LL * b_row * n + min(col0 + b_chunk, n - 4);
  const uint32_t a_dst = SmemAddress(smem + a_k * kStrideA + a_row);
  const uint32_t b_dst =
      SmemAddress(smem + T::kAFloats + b_row * kStrideB + b_chunk);

  // Enqueues the copies of the tile at k0 into the stage at stage_bytes (the
  // caller commits). Tiles are enqueued in order; b_src follows along.
  auto copy_tile = [&](int k0, uint32_t stage_bytes) {
    if (k0 + kBlockK <= k) {  // a whole tile: nothing to test
      if constexpr (T::kAsyncA) {
#pragma unroll
        for (int i = 0; i < T::kARows; ++i)
#pragma unroll
          for (int h = 0; h < T::kAKSteps; ++h)
            CpAsync4(a_dst + stage_bytes +
                         (8 * h * kStrideA + i * T::kARowStep) * 4,
                     a_src[i] + k0 + 8 * h);
      }
#pragma unroll
      for (int l = 0; l < T::kBRows; ++l)
        CpAsync16(b_dst + stage_bytes + l * T::kBRowStep * kStrideB * 4,
                  b_src + 1LL * l * T::kBRowStep * n);
      b_src += 1LL * kBlockK * n;
    } else if (k0 < k) {  // the partial last tile: zero-fill k >= p.k
      if constexpr (T::kAsyncA) {
#pragma unroll
        for (int i = 0; i < T::kARows; ++i)
#pragma unroll
          for (int h = 0; h < T::kAKSteps; ++h) {
            const bool valid = k0 + a_k + 8 * h < k;
            CpAsync4(a_dst + stage_bytes +
                         (8 * h * kStrideA + i * T::kARowStep) * 4,
                     valid ? a_src[i] + k0 + 8 * h : a, valid);
          }
      }
#pragma unroll
      for (int l = 0; l < T::kBRows; ++l) {
        const bool valid = k0 + l * T::kBRowStep + b_row < k;
        CpAsync16(b_dst + stage_bytes + l * T::kBRowStep * kStrideB * 4,
                  valid ? b_src + 1LL * l * T::kBRowStep * n : b, valid);
      }
    }
    // Past the last tile: nothing to copy; that stage is never computed on.
  };

  // Register path for A (kAsyncA == false): rung 09's LDG + transposing STS.
  // k % 4 == 0, so a float4 along k is wholly in or out of range; past the
  // last tile every chunk is out and nothing is read.
  float4 a_next[T::kARows][T::kAKSteps];
  auto load_a = [&](int k0) {
    if (k0 + kBlockK <= k) {
#pragma unroll
      for (int i = 0; i < T::kARows; ++i)
#pragma unroll
        for (int h = 0; h < T::kAKSteps; ++h)
          a_next[i][h] =
              *reinterpret_cast<const float4*>(a_src[i] + k0 + 8 * h);
    } else {
#pragma unroll
      for (int i = 0; i < T::kARows; ++i)
#pragma unroll
        for (int h = 0; h < T::kAKSteps; ++h)
          a_next[i][h] = k0 + a_k + 8 * h < k
              ? *reinterpret_cast<const float4*>(a_src[i] + k0 + 8 * h)
              : make_float4(0.f, 0.f, 0.f, 0.f);
    }
  };
  auto store_a = [&](uint32_t stage_bytes) {
    float* dst = reinterpret_cast<float*>(
        reinterpret_cast<char*>(smem + a_k * kStrideA + a_row) + stage_bytes);
#pragma unroll
    for (int i = 0; i < T::kARows; ++i)
#pragma unroll
      for (int h = 0; h < T::kAKSteps; ++h) {
        float* d = dst + 8 * h * kStrideA + i * T::kARowStep;
        d[0 * kStrideA] = a_next[i][h].x;
        d[1 * kStrideA] = a_next[i][h].y;
        d[2 * kStrideA] = a_next[i][h].z;
        d[3 * kStrideA] = a_next[i][h].w;
      }
  };

  // Fragment reads: kQuadsM float4 of A and kQuadsN of B per step, each a
  // broadcast that a warp serves in one shared-memory wavefront.
  const int thread_row =
      (warp / T::kWarpsN) * T::kWarpM + (lane % T::kLanesM) * 4;
  const int thread_col =
      (warp % T::kWarpsN) * T::kWarpN + (lane / T::kLanesM) * 4;
  const char* a_read = reinterpret_cast<const char*>(smem + thread_row);
  const char* b_read =
      reinterpret_cast<const char*>(smem + T::kAFloats + thread_col);
  float a_frag[2][kThreadM], b_frag[2][kThreadN];
  auto load_frags = [&](float (&af)[kThreadM], float (&bf)[kThreadN],
                        uint32_t stage_bytes, int kk) {
    const float* a_at = reinterpret_cast<const float*>(a_read + stage_bytes);
    const float* b_at = reinterpret_cast<const float*>(b_read + stage_bytes);
#pragma unroll
    for (int q = 0; q < T::kQuadsM; ++q)
      *reinterpret_cast<float4*>(&af[4 * q]) = *reinterpret_cast<const float4*>(
          a_at + kk * kStrideA + q * T::kSubM);
#pragma unroll
    for (int q = 0; q < T::kQuadsN; ++q)
      *reinterpret_cast<float4*>(&bf[4 * q]) = *reinterpret_cast<const float4*>(
          b_at + kk * kStrideB + q * T::kSubN);
  };

  // Prologue: tiles 0 .. kStages - 1 in flight, one commit group per tile
  // (empty past the last tile, so the group count stays tile-aligned).
  if constexpr (!T::kAsyncA) {
    load_a(0);
    store_a(0);
  }
#pragma unroll
  for (int s = 0; s < kStages; ++s) {
    copy_tile(s * kBlockK, s * T::kStageBytes);
    CpAsyncCommit();
  }
  CpAsyncWait<kStages - 1>();  // tile 0 has landed
  __syncthreads();
  load_frags(a_frag[0], b_frag[0], 0, 0);

  float acc[kThreadM][kThreadN] = {};
  uint32_t stage_bytes = 0;  // the stage holding the tile being computed
  for (int k0 = 0; k0 < k; k0 += kBlockK) {
    if constexpr (!T::kAsyncA) load_a(k0 + kBlockK);
#pragma unroll
    for (int kk = 0; kk < kBlockK; ++kk) {
      if (kk + 1 < kBlockK) {
        load_frags(a_frag[(kk + 1) % 2], b_frag[(kk + 1) % 2], stage_bytes,
                   kk + 1);
      } else {
        // This step's fragments are already in registers: cross to the next
        // tile now, so its first reads overlap this step's FFMAs. On the
        // last tile this reads a stage no one computes on: harmless, and
        // cheaper than a branch on every tile.
        const uint32_t next_bytes =
            stage_bytes == (kStages - 1) * T::kStageBytes
                ? 0 : stage_bytes + T::kStageBytes;
        // Register path: A goes into the next tile's stage (its B copies
        // are already in flight). That stage last held the tile kStages - 1
        // back, whose reads all came before the previous barrier.
        if constexpr (!T::kAsyncA) store_a(next_bytes);
        // Committed so far: tiles up to this one + kStages - 1. The next
        // tile must be complete, so kStages - 2 younger groups may pend.
        CpAsyncWait<kStages - 2>();
        __syncthreads();
        // Everyone is past their last read of this stage: refill it with the
        // tile kStages ahead.
        copy_tile(k0 + kStages * kBlockK, stage_bytes);
        CpAsyncCommit();
        stage_bytes = next_bytes;
        load_frags(a_frag[0], b_frag[0], stage_bytes, 0);
      }
      const float* af = a_frag[kk % 2];
      const float* bf = b_frag[kk % 2];
#pragma unroll
      for (int i = 0; i < kThreadM; ++i)
#pragma unroll
        for (int jj = 0; jj < kThreadN; ++jj) {
          // Serpentine order: consecutive FFMAs share an operand at every
          // step, including row changes (operand-reuse cache).
          const int j = (i % 2) ? kThreadN - 1 - jj : jj;
          acc[i][j] = fmaf(af[i], bf[j], acc[i][j]);
        }
    }
  }
  // Copies are only ever enqueued for tiles below p.k, and each was waited
  // on before its tile was read, so none is outstanding here.

#pragma unroll
  for (int i = 0; i < kThreadM; ++i) {
    const int row = row0 + thread_row + (i % 4) + (i / 4) * T::kSubM;
    if (row >= m) continue;
#pragma unroll
    for (int q = 0; q < T::kQuadsN; ++q) {
      const int col = col0 + thread_col + q * T::kSubN;
      if (col >= n) continue;  // n % 4 == 0: a float4 is wholly in or out
      const long long index = 1LL * row * n + col;
      StoreAlphaBeta4(p, &acc[i][q * 4], c, out, index);
    }
  }
}

template <typename T>
cudaError_t Launch(const GemmParams& p, cudaStream_t stream) {
  if (p.m == 0 || p.n == 0 || p.batch == 0) return cudaSuccess;  // no grid
  auto kernel = SgemmPipelined<T>;
  if (T::kSmemBytes > 48 * 1024) {  // above 48 KiB needs an explicit opt-in
    const cudaError_t status = cudaFuncSetAttribute(
        kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, T::kSmemBytes);
    if (status != cudaSuccess) return status;
  }
  dim3 grid(CeilDiv(p.m, T::kBlockM), CeilDiv(p.n, T::kBlockN), p.batch);
  kernel<<<grid, T::kThreads, T::kSmemBytes, stream>>>(p);
  return cudaGetLastError();
}

// Tilings: warps M x N, lanes along M, quadrants M x N, block K, stages,
// A by cp.async, blocks per SM.
// 128x128, 128 threads, 8x16 per thread (64x64 warp tiles), two per SM.
using T128x128x8W4 = Tiling<2, 2, 8, 2, 4, 8, 4, true, 2>;
using T128x128x8W4Regs = Tiling<2, 2, 8, 2, 4, 8, 3, false, 2>;
using T128x128x8W4S3 = Tiling<2, 2, 8, 2, 4, 8, 3, true, 2>;
using T128x128x8W4T16x8 = Tiling<2, 2, 4, 4, 2, 8, 4, true, 2>;  // 16x8
using T128x128x16W4 = Tiling<2, 2, 8, 2, 4, 16, 3, true, 2>;
// 128x128, 256 threads, 8x8 per thread (rung 09's layout), two per SM.
using T128x128x8 = Tiling<2, 4, 8, 2, 2, 8, 4, true, 2>;
using T128x128x8Regs = Tiling<2, 4, 8, 2, 2, 8, 3, false, 2>;
using T128x128x16 = Tiling<2, 4, 8, 2, 2, 16, 3, true, 2>;
using T128x128x16Regs = Tiling<2, 4, 8, 2, 2, 16, 2, false, 2>;
// 256 threads, 64x64 warp tiles, one block per SM.
using T128x256x8 = Tiling<2, 4, 8, 2, 4, 8, 4, true, 1>;  // shipped
using T256x128x8 = Tiling<4, 2, 4, 4, 2, 8, 4, true, 1>;

}  // namespace sgemm_10
}  // namespace pallas_gemm

extern "C" cudaError_t pallas_gemm_launch_sgemm_10_pipelined(
    const pallas_gemm::GemmParams& p, cudaStream_t stream) {
  using namespace pallas_gemm::sgemm_10;
  return Launch<T128x256x8>(p, stream);
}

// Sweep-only candidates (sweep.cuh). Names: block MxNxK, threads, thread
// tile, stages, how A reaches shared memory, blocks per SM.
#define PALLAS_GEMM_SGEMM10_CANDIDATE(id, name, tiling)        \
  PALLAS_GEMM_SWEEP_CANDIDATE(                                 \
      id, name, ::pallas_gemm::ElementType::kF32,              \
      (&::pallas_gemm::sgemm_10::Launch<                       \
          ::pallas_gemm::sgemm_10::tiling>))

PALLAS_GEMM_SGEMM10_CANDIDATE(sgemm10_w4,
    "sgemm_10 128x128x8 128t 8x16 4st asyncA 2/SM", T128x128x8W4)
PALLAS_GEMM_SGEMM10_CANDIDATE(sgemm10_w4_regs,
    "sgemm_10 128x128x8 128t 8x16 3st regA 2/SM", T128x128x8W4Regs)
PALLAS_GEMM_SGEMM10_CANDIDATE(sgemm10_w4_s3,
    "sgemm_10 128x128x8 128t 8x16 3st asyncA 2/SM", T128x128x8W4S3)
PALLAS_GEMM_SGEMM10_CANDIDATE(sgemm10_w4_16x8,
    "sgemm_10 128x128x8 128t 16x8 4st asyncA 2/SM", T128x128x8W4T16x8)
PALLAS_GEMM_SGEMM10_CANDIDATE(sgemm10_w4_bk16,
    "sgemm_10 128x128x16 128t 8x16 3st asyncA 2/SM", T128x128x16W4)
PALLAS_GEMM_SGEMM10_CANDIDATE(sgemm10_8x8,
    "sgemm_10 128x128x8 256t 8x8 4st asyncA 2/SM", T128x128x8)
PALLAS_GEMM_SGEMM10_CANDIDATE(sgemm10_8x8_regs,
    "sgemm_10 128x128x8 256t 8x8 3st regA 2/SM", T128x128x8Regs)
PALLAS_GEMM_SGEMM10_CANDIDATE(sgemm10_8x8_bk16,
    "sgemm_10 128x128x16 256t 8x8 3st asyncA 2/SM", T128x128x16)
PALLAS_GEMM_SGEMM10_CANDIDATE(sgemm10_8x8_bk16_regs,
    "sgemm_10 128x128x16 256t 8x8 2st regA 2/SM (rung 09 + pipeline)",
    T128x128x16Regs)
PALLAS_GEMM_SGEMM10_CANDIDATE(sgemm10_128x256,
    "sgemm_10 128x256x8 256t 8x16 4st asyncA 1/SM (default)", T128x256x8)
PALLAS_GEMM_SGEMM10_CANDIDATE(sgemm10_256x128,
    "sgemm_10 256x128x8 256t 16x8 4st asyncA 1/SM", T256x128x8)
#undef PALLAS_GEMM_SGEMM10_CANDIDATE
