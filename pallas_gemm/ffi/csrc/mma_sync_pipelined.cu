// Tensor-core GEMM with mma.sync, software-pipelined: fp16 or bf16 in, f32
// accumulate. Same building blocks as mma_sync.cu (4-stage cp.async with
// zero fill, swizzled shared memory, ldmatrix, grouped block order,
// smem-staged epilogue), with a main loop shaped so the tensor cores never
// wait on shared memory or on a barrier:
//
//  * Every warp owns a 64x64 tile (4 x 8 mma tiles, 128 f32 accumulators per
//    thread): 8 ldmatrix.x4 feed 32 mma.sync per k16 slice, the most reuse
//    the register file allows. By our count of bytes per mma, shared-memory
//    bandwidth is about as tight as the tensor cores for mma.sync on Hopper,
//    so this ratio matters.
//  * The ldmatrix fragments are double-buffered in registers: while the
//    mma.sync of slice s run, the fragments of slice s + 1 are already
//    loading, including across the K-tile boundary (the last slice of tile
//    kt loads the first slice of tile kt + 1).
//  * One __syncthreads per K tile, placed just before the first read of the
//    next tile. It also proves every warp is done with the stage read one
//    tile ago, which is the stage the next cp.async batch overwrites, so no
//    second barrier is needed.
//  * Global addresses are computed once; per tile only k advances.
//
// Compiled variants (block M x N x K, stages, blocks per SM): 128x256x32
// and 256x128x32 with 8 warps, 4 stages; 128x256x64 with 8 warps, 3 stages;
// 128x128x32 (4 stages) and 128x128x64 (3 stages) with 4 warps and two
// blocks per SM. On an H200 (bf16, 8192^3) these run 429-464 TFLOP/s
// against 363 for mma_sync.cu's best; numbers in
// experiments/results/nvidia_h200/ffi/README.md.
#include "gemm_params.cuh"
#include "mma_sync_common.cuh"
#include "sweep.cuh"

namespace pallas_gemm {
namespace mma_sync_pipelined {

using mma_sync::CpAsync16;
using mma_sync::CpAsyncCommit;
using mma_sync::CpAsyncWait;
using mma_sync::LdMatrixX4;
using mma_sync::LdMatrixX4Trans;
using mma_sync::Load8;
using mma_sync::Mma;
using mma_sync::Store8;
using mma_sync::SwizzledChunk;

// How the stage ring is handed between the copies and the tensor cores.
enum class Sync {
  // One __syncthreads per K tile (cp.async.wait_group, then the barrier):
  // simple, but every warp meets every other once per tile, so one late
  // warp stalls all eight and the tensor cores drain at each meeting.
  kBlockBarrier,
  // Two mbarriers per stage. "full": every thread's cp.async batch for the
  // stage arrives on it when it lands (cp.async.mbarrier.arrive.noinc);
  // readers wait for its phase. "empty": every warp arrives once it has
  // consumed the stage; a thread waits on it before copying into the stage
  // again. Copies run kStages - 2 tiles ahead, so a warp waits only when
  // another is more than a tile behind: warps drift instead of meeting.
  // Measured slower on an H200 (experiments/results/nvidia_h200/ffi/):
  // the 256 arrivals and polls per stage cost more than the meetings they
  // save, so it is a sweep-only option.
  kMbarrierRing,
};

template <int kBlockM_, int kBlockN_, int kBlockK_, int kStages_,
          int kMinBlocksPerSm_, Sync kSync_ = Sync::kBlockBarrier,
          int kGroupM_ = 8, int kWarpM_ = 64, int kWarpN_ = 64,
          bool kDoubleBufferFragments_ = true, bool kInterleave_ = false,
          bool kSpreadCopies_ = false>
struct Tiling {
  // true (with kInterleave): a K tile's cp.async are spread over the first
  // kSlices - 1 slices instead of issued in one burst.
  static constexpr bool kSpreadCopies = kSpreadCopies_;
  // true: the next slice's ldmatrix are spread between the current slice's
  // rows of mma.sync (one A and one B load per row) instead of issued in a
  // burst, and the rows alternate direction so a B fragment is reused
  // across each turn. Spreads shared-memory reads and register writes.
  static constexpr bool kInterleave = kInterleave_;
  // false: each k16 slice's fragments are loaded right before its mma.sync
  // (ldmatrix latency exposed, hidden only by other warps), which saves the
  // registers a 128-register, 16-warp block needs. Block barrier only.
  static constexpr bool kDoubleBufferFragments = kDoubleBufferFragments_;
  // A warp's output tile. 64x64 (128 accumulators a thread) gives the most
  // mma.sync per ldmatrix byte; 64x32 halves the registers so that 16
  // warps fit on an SM, trading shared-memory traffic for more warps to
  // hide each one's issue stalls.
  static constexpr int kWarpM = kWarpM_, kWarpN = kWarpN_;
  static constexpr int kMmaTilesM = kWarpM / 16, kMmaTilesN = kWarpN / 8;
  static constexpr int kBlockM = kBlockM_, kBlockN = kBlockN_,
                       kBlockK = kBlockK_, kStages = kStages_,
                       kMinBlocksPerSm = kMinBlocksPerSm_;
  static constexpr Sync kSync = kSync_;
  // Block-rows that walk each block-column band together (grouped order).
  static constexpr int kGroupM = kGroupM_;
  static constexpr int kWarpsM = kBlockM / kWarpM, kWarpsN = kBlockN / kWarpN;
  static constexpr int kThreads = 32 * kWarpsM * kWarpsN;
  static constexpr int kSlices = kBlockK / 16;  // k16 slices per K tile
  static constexpr int kAChunksPerRow = kBlockK / 8;  // 16-byte chunks
  static constexpr int kBChunksPerRow = kBlockN / 8;
  static constexpr int kAStageBytes = kBlockM * kBlockK * 2;
  static constexpr int kBStageBytes = kBlockK * kBlockN * 2;
  static constexpr int kStageBytes = kAStageBytes + kBStageBytes;
  // Thread t copies chunk column t % chunks_per_row of rows
  // t / chunks_per_row + j * row_step: the same columns every stage.
  static constexpr int kARowStep = kThreads / kAChunksPerRow;
  static constexpr int kBRowStep = kThreads / kBChunksPerRow;
  static constexpr int kAChunksPerThread = kBlockM / kARowStep;
  static constexpr int kBChunksPerThread = kBlockK / kBRowStep;
  static constexpr int kOutStride = kBlockN + 8;  // see mma_sync.cu
  static constexpr int kPipelineBytes = kStages * kStageBytes;
  static constexpr int kEpilogueBytes = kBlockM * kOutStride * 4;
  static constexpr int kDataBytes =
      kPipelineBytes > kEpilogueBytes ? kPipelineBytes : kEpilogueBytes;
  // The mbarriers sit past everything the epilogue overwrites.
  static constexpr int kBarrierBytes =
      kSync == Sync::kMbarrierRing ? 2 * kStages * 8 : 0;
  static constexpr int kSmemBytes = kDataBytes + kBarrierBytes;
  // Tiles the copies run ahead of the reads (see Sync::kMbarrierRing).
  static constexpr int kPrefetchTiles =
      kSync == Sync::kMbarrierRing ? kStages - 2 : kStages - 1;

  static_assert(kBlockM % kWarpM == 0 && kBlockN % kWarpN == 0, "warp grid");
  static_assert(kWarpN % 16 == 0, "B fragments load two n8 tiles at a time");
  // Fragment buffer (slice & 1) lines up across tiles only for even counts.
  static_assert(kSlices % 2 == 0, "block K must be a multiple of 32");
  static_assert(kThreads % kAChunksPerRow == 0 &&
                kThreads % kBChunksPerRow == 0 &&
                kBlockM % kARowStep == 0 && kBlockK % kBRowStep == 0,
                "tiles must split evenly over the threads");
  // Row steps that are multiples of 8 leave the swizzle pattern unchanged,
  // so each chunk's shared address is the first one plus a constant.
  static_assert(kARowStep % 8 == 0 && kBRowStep % 8 == 0, "row steps");
  static_assert(kAChunksPerRow == 4 || kAChunksPerRow % 8 == 0,
                "the swizzle handles 64-byte rows or multiples of 128 bytes");
  static_assert(kBChunksPerRow % 8 == 0, "B swizzle needs 128-byte rows");
  static_assert(kSmemBytes * kMinBlocksPerSm <= 227 * 1024, "shared memory");
  static_assert(kPrefetchTiles >= 1, "the mbarrier ring needs 3+ stages");
  static_assert(kDoubleBufferFragments || kSync == Sync::kBlockBarrier,
                "single-buffered fragments are written for the block barrier");
};

template <typename T, typename TOut, typename Tile>
__global__ void __launch_bounds__(Tile::kThreads, Tile::kMinBlocksPerSm)
MmaSyncPipelinedGemm(GemmParams p) {
  constexpr int kStages = Tile::kStages, kBlockK = Tile::kBlockK;
  constexpr int kWarpM = Tile::kWarpM, kWarpN = Tile::kWarpN;
  constexpr int kMmaTilesM = Tile::kMmaTilesM, kMmaTilesN = Tile::kMmaTilesN;
  extern __shared__ __align__(128) unsigned char smem[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int warp_m = warp / Tile::kWarpsN, warp_n = warp % Tile::kWarpsN;

  // Grouped order: kGroupM block-rows share each block-column band in L2.
  const int blocks_m = CeilDiv(p.m, Tile::kBlockM);
  const int blocks_n = CeilDiv(p.n, Tile::kBlockN);
  const int blocks_per_group = Tile::kGroupM * blocks_n;
  const int group = blockIdx.x / blocks_per_group;
  const int first_block_m = group * Tile::kGroupM;
  const int group_rows = min(blocks_m - first_block_m, Tile::kGroupM);
  const int in_group = blockIdx.x % blocks_per_group;
  const int row0 = (first_block_m + in_group % group_rows) * Tile::kBlockM;
  const int col0 = (in_group / group_rows) * Tile::kBlockN;

  const int batch = blockIdx.y;
  const T* a = BatchSlice<T>(p.a, batch, 1LL * p.m * p.k);
  const T* b = BatchSlice<T>(p.b, batch, 1LL * p.k * p.n);
  const TOut* c =
      p.c ? BatchSlice<TOut>(p.c, batch, 1LL * p.m * p.n) : nullptr;
  TOut* out = BatchSliceMut<TOut>(p.out, batch, 1LL * p.m * p.n);

  const uint32_t smem_base =
      static_cast<uint32_t>(__cvta_generic_to_shared(smem));

  // ---- global -> shared: per-thread addresses fixed up front.
  const int a_row = tid / Tile::kAChunksPerRow;
  const int a_col = (tid % Tile::kAChunksPerRow) * 8;
  const int b_row = tid / Tile::kBChunksPerRow;
  const int b_col = (tid % Tile::kBChunksPerRow) * 8;
  const uint32_t a_smem_offset =
      SwizzledChunk<Tile::kAChunksPerRow>(a_row, a_col / 8) * 16;
  const uint32_t b_smem_offset = Tile::kAStageBytes +
      SwizzledChunk<Tile::kBChunksPerRow>(b_row, b_col / 8) * 16;
  const T* a_first = a + 1LL * (row0 + a_row) * p.k + a_col;
  const long long a_row_step = 1LL * Tile::kARowStep * p.k;
  const T* b_first = b + 1LL * b_row * p.n + col0 + b_col;
  const long long b_row_step = 1LL * Tile::kBRowStep * p.n;
  uint32_t a_rows_in_range = 0;  // bit j: chunk row j is inside M
#pragma unroll
  for (int j = 0; j < Tile::kAChunksPerThread; ++j) {
    if (row0 + a_row + j * Tile::kARowStep < p.m) a_rows_in_range |= 1u << j;
  }
  const bool b_col_in_range = col0 + b_col < p.n;

  // Copies chunks j with j % parts == part (all of them by default).
  auto load_tile = [&](int stage, int k0, int part = 0, int parts = 1) {
    const uint32_t stage_base = smem_base + stage * Tile::kStageBytes;
    const bool a_col_in_range = k0 + a_col < p.k;
#pragma unroll
    for (int j = 0; j < Tile::kAChunksPerThread; ++j) {
      if (j % parts != part) continue;
      const bool valid = a_col_in_range && ((a_rows_in_range >> j) & 1);
      const T* src = valid ? a_first + j * a_row_step + k0 : a;
      CpAsync16(stage_base + a_smem_offset +
                    j * Tile::kARowStep * Tile::kAChunksPerRow * 16,
                src, valid);
    }
    const T* b_tile = b_first + 1LL * k0 * p.n;
#pragma unroll
    for (int j = 0; j < Tile::kBChunksPerThread; ++j) {
      if (j % parts != part) continue;
      const bool valid =
          b_col_in_range && k0 + b_row + j * Tile::kBRowStep < p.k;
      const T* src = valid ? b_tile + j * b_row_step : b;
      CpAsync16(stage_base + b_smem_offset +
                    j * Tile::kBRowStep * Tile::kBChunksPerRow * 16,
                src, valid);
    }
  };

  // ---- shared -> registers (ldmatrix; see the x4 matrix order).
  const int lane_row = (lane & 7) + ((lane >> 3) & 1) * 8;
  const int lane_chunk = lane >> 4;
  constexpr int kFragmentBuffers = Tile::kDoubleBufferFragments ? 2 : 1;
  uint32_t a_frag[kFragmentBuffers][kMmaTilesM][4];
  uint32_t b_frag[kFragmentBuffers][kMmaTilesN][2];

  auto load_fragments = [&](int buffer, int stage, int slice) {
    const uint32_t a_base = smem_base + stage * Tile::kStageBytes;
    const uint32_t b_base = a_base + Tile::kAStageBytes;
#pragma unroll
    for (int mi = 0; mi < kMmaTilesM; ++mi) {
      const int r = warp_m * kWarpM + mi * 16 + lane_row;
      LdMatrixX4(a_frag[buffer][mi],
                 a_base + SwizzledChunk<Tile::kAChunksPerRow>(
                              r, slice * 2 + lane_chunk) * 16);
    }
#pragma unroll
    for (int nj = 0; nj < kMmaTilesN / 2; ++nj) {
      const int r = slice * 16 + lane_row;
      const int chunk = (warp_n * kWarpN + nj * 16) / 8 + lane_chunk;
      uint32_t t[4];
      LdMatrixX4Trans(
          t, b_base + SwizzledChunk<Tile::kBChunksPerRow>(r, chunk) * 16);
      b_frag[buffer][2 * nj][0] = t[0];
      b_frag[buffer][2 * nj][1] = t[1];
      b_frag[buffer][2 * nj + 1][0] = t[2];
      b_frag[buffer][2 * nj + 1][1] = t[3];
    }
  };

  float acc[kMmaTilesM][kMmaTilesN][4] = {};
  auto mma_slice = [&](int buffer) {
#pragma unroll
    for (int mi = 0; mi < kMmaTilesM; ++mi) {
#pragma unroll
      for (int ni = 0; ni < kMmaTilesN; ++ni) {
        Mma<T>::Run(acc[mi][ni], a_frag[buffer][mi], b_frag[buffer][ni]);
      }
    }
  };
  // The interleaved form of load_fragments(next, ...) + mma_slice(current).
  auto load_next_and_mma = [&](int next, int stage, int next_slice,
                               int current) {
    const uint32_t a_base = smem_base + stage * Tile::kStageBytes;
    const uint32_t b_base = a_base + Tile::kAStageBytes;
    constexpr int kRows = kMmaTilesM > kMmaTilesN / 2 ? kMmaTilesM
                                                      : kMmaTilesN / 2;
#pragma unroll
    for (int mi = 0; mi < kRows; ++mi) {
      if (mi < kMmaTilesM) {
        const int r = warp_m * kWarpM + mi * 16 + lane_row;
        LdMatrixX4(a_frag[next][mi],
                   a_base + SwizzledChunk<Tile::kAChunksPerRow>(
                                r, next_slice * 2 + lane_chunk) * 16);
      }
      if (mi < kMmaTilesN / 2) {
        const int r = next_slice * 16 + lane_row;
        const int chunk = (warp_n * kWarpN + mi * 16) / 8 + lane_chunk;
        uint32_t t[4];
        LdMatrixX4Trans(
            t, b_base + SwizzledChunk<Tile::kBChunksPerRow>(r, chunk) * 16);
        b_frag[next][2 * mi][0] = t[0];
        b_frag[next][2 * mi][1] = t[1];
        b_frag[next][2 * mi + 1][0] = t[2];
        b_frag[next][2 * mi + 1][1] = t[3];
      }
      if (mi < kMmaTilesM) {
#pragma unroll
        for (int j = 0; j < kMmaTilesN; ++j) {
          const int ni = (mi & 1) ? kMmaTilesN - 1 - j : j;
          Mma<T>::Run(acc[mi][ni], a_frag[current][mi],
                      b_frag[current][ni]);
        }
      }
    }
  };
  const int k_tiles = CeilDiv(p.k, kBlockK);

  if constexpr (!Tile::kDoubleBufferFragments) {
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
      if (s < k_tiles) load_tile(s, s * kBlockK);
      CpAsyncCommit();  // empty groups keep the wait counts uniform
    }
    int read_stage = 0, write_stage = kStages - 1;
    int next_k = (kStages - 1) * kBlockK;  // first k of the next tile to fetch
    for (int kt = 0; kt < k_tiles; ++kt) {
      // kStages - 1 + kt groups committed; at most kStages - 2 pending means
      // tile kt has landed. The barrier also proves every warp is done with
      // tile kt - 1, whose stage the copy below overwrites.
      CpAsyncWait<kStages - 2>();
      __syncthreads();
      if (next_k < p.k) load_tile(write_stage, next_k);
      CpAsyncCommit();
      write_stage = write_stage + 1 == kStages ? 0 : write_stage + 1;
      next_k += kBlockK;
#pragma unroll
      for (int slice = 0; slice < Tile::kSlices; ++slice) {
        load_fragments(0, read_stage, slice);
        mma_slice(0);
      }
      read_stage = read_stage + 1 == kStages ? 0 : read_stage + 1;
    }
  } else if constexpr (Tile::kSync == Sync::kBlockBarrier) {
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
      if (s < k_tiles) load_tile(s, s * kBlockK);
      CpAsyncCommit();  // empty groups keep the wait counts uniform
    }
    CpAsyncWait<kStages - 2>();
    __syncthreads();  // tile 0 is visible

    int read_stage = 0, write_stage = kStages - 1;
    int next_k = (kStages - 1) * kBlockK;  // first k of the next tile to fetch
    load_fragments(0, read_stage, 0);

    for (int kt = 0; kt < k_tiles; ++kt) {
#pragma unroll
      for (int slice = 0; slice < Tile::kSlices; ++slice) {
        if (slice == Tile::kSlices - 1) {
          // Groups committed so far: kStages - 1 + kt + 1, one per tile; so
          // at most kStages - 2 pending means tile kt + 1 has landed. After
          // the barrier every warp has also finished reading stage kt, which
          // the next iteration's copies overwrite. On the last tile this
          // loads fragments nobody uses, from a stage no copy is writing.
          CpAsyncWait<kStages - 2>();
          __syncthreads();
          read_stage = read_stage + 1 == kStages ? 0 : read_stage + 1;
        }
        if constexpr (Tile::kInterleave && Tile::kSpreadCopies) {
          // Same stage and group count as below: the last part is
          // committed before the next iteration's wait.
          if (next_k < p.k && slice < Tile::kSlices - 1) {
            load_tile(write_stage, next_k, slice, Tile::kSlices - 1);
          }
          if (slice == Tile::kSlices - 2) {
            CpAsyncCommit();
            write_stage = write_stage + 1 == kStages ? 0 : write_stage + 1;
            next_k += kBlockK;
          }
          load_next_and_mma((slice + 1) & 1, read_stage,
                            (slice + 1) % Tile::kSlices, slice & 1);
          continue;
        }
        if constexpr (Tile::kInterleave) {
          if (slice == 0) {
            // The stage written here was last read during tile kt - 1,
            // before the previous iteration's barrier.
            if (next_k < p.k) load_tile(write_stage, next_k);
            CpAsyncCommit();
            write_stage = write_stage + 1 == kStages ? 0 : write_stage + 1;
            next_k += kBlockK;
          }
          load_next_and_mma((slice + 1) & 1, read_stage,
                            (slice + 1) % Tile::kSlices, slice & 1);
          continue;
        }
        load_fragments((slice + 1) & 1, read_stage,
                       (slice + 1) % Tile::kSlices);
        if (slice == 0) {
          // The stage written here was last read during tile kt - 1, before
          // the previous iteration's barrier.
          if (next_k < p.k) load_tile(write_stage, next_k);
          CpAsyncCommit();
          write_stage = write_stage + 1 == kStages ? 0 : write_stage + 1;
          next_k += kBlockK;
        }
        mma_slice(slice & 1);
      }
    }
  } else {
    // Tile t lives in stage t % kStages; its round r = t / kStages picks the
    // mbarrier phase: "full" phase r completes when tile t has landed,
    // "empty" phase r when every thread is done reading it.
    constexpr int kPrefetch = Tile::kPrefetchTiles;
    const uint32_t full_bars = smem_base + Tile::kDataBytes;
    const uint32_t empty_bars = full_bars + 8 * kStages;
    if (tid == 0) {
#pragma unroll
      for (int s = 0; s < kStages; ++s) {
        mma_sync::MbarrierInit(full_bars + 8 * s, Tile::kThreads);
        mma_sync::MbarrierInit(empty_bars + 8 * s, Tile::kThreads / 32);
      }
    }
    __syncthreads();  // the barriers are initialised before anyone uses them

#pragma unroll
    for (int t = 0; t < kPrefetch; ++t) {
      if (t < k_tiles) {
        load_tile(t, t * kBlockK);
        mma_sync::CpAsyncArriveOnMbarrier(full_bars + 8 * t);
      }
    }
    int read_stage = 0, read_parity = 0;  // the tile whose fragments load next
    int fetch_stage = kPrefetch, fetch_parity = 0;  // tile kt + kPrefetch
    int release_stage = 0;                          // tile kt
    mma_sync::MbarrierWait(full_bars, 0);
    load_fragments(0, read_stage, 0);

    for (int kt = 0; kt < k_tiles; ++kt) {
#pragma unroll
      for (int slice = 0; slice < Tile::kSlices; ++slice) {
        if (slice == Tile::kSlices - 1) {
          // The next fragments are tile kt + 1's first slice. On the last
          // tile they are loaded but never used; every copy has landed by
          // then (the waits above covered each thread's last batch).
          if (++read_stage == kStages) {
            read_stage = 0;
            read_parity ^= 1;
          }
          if (kt + 1 < k_tiles) {
            mma_sync::MbarrierWait(full_bars + 8 * read_stage, read_parity);
          }
        }
        load_fragments((slice + 1) & 1, read_stage,
                       (slice + 1) % Tile::kSlices);
        if (slice == 0) {
          const int t = kt + kPrefetch;
          if (t < k_tiles) {
            // Stage reuse: tile t - kStages must be released by all threads.
            if (t >= kStages) {
              mma_sync::MbarrierWait(empty_bars + 8 * fetch_stage,
                                     fetch_parity ^ 1);
            }
            load_tile(fetch_stage, t * kBlockK);
            mma_sync::CpAsyncArriveOnMbarrier(full_bars + 8 * fetch_stage);
          }
          if (++fetch_stage == kStages) {
            fetch_stage = 0;
            fetch_parity ^= 1;
          }
        }
        mma_slice(slice & 1);
      }
      // Every fragment of tile kt has been consumed by an mma.sync issued
      // above (they read the registers ldmatrix wrote), so its stage is
      // free. One arrival per warp: mma.sync is warp-wide, and __syncwarp
      // orders the other lanes' reads before lane 0's release.
      __syncwarp();
      if (lane == 0) mma_sync::MbarrierArrive(empty_bars + 8 * release_stage);
      release_stage = release_stage + 1 == kStages ? 0 : release_stage + 1;
    }
  }

  // Epilogue: fragments -> shared (f32) -> 8 contiguous outputs per thread.
  //
  // The read side gives thread t the 16-byte chunks 2t and 2t + 1 of a row,
  // so a quarter-warp's first loads would hit only even chunks: half the
  // bank groups, a 2-way conflict. Flipping bit 0 of the chunk index when
  // bit 3 is set sends chunks 8-15 of every 16 to the odd groups; the
  // fragment stores (two neighbouring chunks per row) stay conflict-free.
  auto staged_offset = [](int r, int col) {
    const int chunk = col >> 2;
    return r * Tile::kOutStride + ((chunk ^ ((chunk >> 3) & 1)) << 2) +
           (col & 3);
  };
  CpAsyncWait<0>();
  __syncthreads();  // every warp is done with the pipeline's shared memory
  float* staged = reinterpret_cast<float*>(smem);
  const int group_id = lane >> 2, quad = lane & 3;
#pragma unroll
  for (int mi = 0; mi < kMmaTilesM; ++mi) {
#pragma unroll
    for (int ni = 0; ni < kMmaTilesN; ++ni) {
      const int r = warp_m * kWarpM + mi * 16 + group_id;
      const int col = warp_n * kWarpN + ni * 8 + quad * 2;
      *reinterpret_cast<float2*>(&staged[staged_offset(r, col)]) =
          make_float2(p.alpha * acc[mi][ni][0], p.alpha * acc[mi][ni][1]);
      *reinterpret_cast<float2*>(&staged[staged_offset(r + 8, col)]) =
          make_float2(p.alpha * acc[mi][ni][2], p.alpha * acc[mi][ni][3]);
    }
  }
  __syncthreads();
  constexpr int kOutChunksPerRow = Tile::kBlockN / 8;
  constexpr int kOutChunks = Tile::kBlockM * kOutChunksPerRow;
  static_assert(kOutChunks % Tile::kThreads == 0, "even split");
#pragma unroll 4
  for (int j = 0; j < kOutChunks / Tile::kThreads; ++j) {
    const int i = tid + j * Tile::kThreads;
    const int r = i / kOutChunksPerRow, col = (i % kOutChunksPerRow) * 8;
    const int out_row = row0 + r, out_col = col0 + col;
    if (out_row >= p.m || out_col >= p.n) continue;  // n % 8 == 0
    float v[8];
    // col is a multiple of 8, so its two chunks share the flip bit.
    const float4 lo = *reinterpret_cast<const float4*>(
        &staged[staged_offset(r, col)]);
    const float4 hi = *reinterpret_cast<const float4*>(
        &staged[staged_offset(r, col + 4)]);
    v[0] = lo.x; v[1] = lo.y; v[2] = lo.z; v[3] = lo.w;
    v[4] = hi.x; v[5] = hi.y; v[6] = hi.z; v[7] = hi.w;
    const long long index = 1LL * out_row * p.n + out_col;
    if (c != nullptr) {
      float c_values[8];
      Load8(c + index, c_values);
#pragma unroll
      for (int e = 0; e < 8; ++e) v[e] += p.beta * c_values[e];
    }
    Store8(out + index, v);
  }
}

template <typename T, typename TOut, typename Tile>
cudaError_t Launch(const GemmParams& p, cudaStream_t stream) {
  auto kernel = MmaSyncPipelinedGemm<T, TOut, Tile>;
  // Over 48 KiB of dynamic shared memory needs an explicit opt-in.
  cudaError_t status = cudaFuncSetAttribute(
      kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Tile::kSmemBytes);
  if (status != cudaSuccess) return status;
  const long long blocks = 1LL * CeilDiv(p.m, Tile::kBlockM) *
                           CeilDiv(p.n, Tile::kBlockN);
  if (blocks > 2147483647LL) return cudaErrorInvalidConfiguration;
  dim3 grid(static_cast<unsigned>(blocks), p.batch);
  kernel<<<grid, Tile::kThreads, Tile::kSmemBytes, stream>>>(p);
  return cudaGetLastError();
}

template <typename Tile>
cudaError_t Dispatch(const GemmParams& p, cudaStream_t stream) {
  using E = ElementType;
  if (p.in_type == E::kBF16 && p.out_type == E::kF32)
    return Launch<__nv_bfloat16, float, Tile>(p, stream);
  if (p.in_type == E::kBF16 && p.out_type == E::kBF16)
    return Launch<__nv_bfloat16, __nv_bfloat16, Tile>(p, stream);
  if (p.in_type == E::kF16 && p.out_type == E::kF32)
    return Launch<__half, float, Tile>(p, stream);
  if (p.in_type == E::kF16 && p.out_type == E::kF16)
    return Launch<__half, __half, Tile>(p, stream);
  return cudaErrorInvalidValue;
}

}  // namespace mma_sync_pipelined
}  // namespace pallas_gemm

// Launchers, named block M x N x K; the stage count and blocks per SM are
// fixed per shape (see the file comment).
#define PALLAS_GEMM_PIPELINED_LAUNCHER(name, bm, bn, bk, stages, per_sm) \
  extern "C" cudaError_t pallas_gemm_launch_##name(                    \
      const pallas_gemm::GemmParams& p, cudaStream_t stream) {         \
    return pallas_gemm::mma_sync_pipelined::Dispatch<                  \
        pallas_gemm::mma_sync_pipelined::Tiling<bm, bn, bk, stages,    \
                                                per_sm>>(p, stream);   \
  }

PALLAS_GEMM_PIPELINED_LAUNCHER(mma_pipe_128x256x32, 128, 256, 32, 4, 1)
PALLAS_GEMM_PIPELINED_LAUNCHER(mma_pipe_256x128x32, 256, 128, 32, 4, 1)
PALLAS_GEMM_PIPELINED_LAUNCHER(mma_pipe_128x256x64, 128, 256, 64, 3, 1)
PALLAS_GEMM_PIPELINED_LAUNCHER(mma_pipe_128x128x32, 128, 128, 32, 4, 2)
PALLAS_GEMM_PIPELINED_LAUNCHER(mma_pipe_128x128x64, 128, 128, 64, 3, 2)
#undef PALLAS_GEMM_PIPELINED_LAUNCHER

// Sweep-only candidates (bf16 in and out; see sweep.cuh): stage counts,
// group sizes and block shapes around the shipped ones.
namespace pallas_gemm {
namespace mma_sync_pipelined {
template <int bm, int bn, int bk, int stages, int per_sm, Sync sync,
          int group_m = 8, int warp_m = 64, int warp_n = 64,
          bool double_buffer = true, bool interleave = false,
          bool spread = false>
constexpr LaunchFn kSweepLaunch =
    &Launch<__nv_bfloat16, __nv_bfloat16,
            Tiling<bm, bn, bk, stages, per_sm, sync, group_m, warp_m, warp_n,
                   double_buffer, interleave, spread>>;
[[maybe_unused]] constexpr Sync kBar = Sync::kBlockBarrier,
                                kRing = Sync::kMbarrierRing;

#define PALLAS_GEMM_MMA_SWEEP(id, label, ...)         \
  PALLAS_GEMM_SWEEP_CANDIDATE(id, label, ElementType::kBF16, \
                              (kSweepLaunch<__VA_ARGS__>))
// Round 3 winners, ldmatrix interleaved with serpentine mma.sync rows.
PALLAS_GEMM_MMA_SWEEP(il_128x256x64_s4, "mma il   128x256x64 s4 g8", 128, 256, 64, 4, 1, kBar, 8, 64, 64, true, true)
PALLAS_GEMM_MMA_SWEEP(il_128x256x64_s3, "mma il   128x256x64 s3 g8", 128, 256, 64, 3, 1, kBar, 8, 64, 64, true, true)
PALLAS_GEMM_MMA_SWEEP(il_256x128x64_s4, "mma il   256x128x64 s4 g8", 256, 128, 64, 4, 1, kBar, 8, 64, 64, true, true)
PALLAS_GEMM_MMA_SWEEP(il_128x256x32_s6, "mma il   128x256x32 s6 g8", 128, 256, 32, 6, 1, kBar, 8, 64, 64, true, true)
// Round 4: cp.async spread over the slices too.
PALLAS_GEMM_MMA_SWEEP(sp_128x256x64_s4, "mma ilsp 128x256x64 s4 g8", 128, 256, 64, 4, 1, kBar, 8, 64, 64, true, true, true)
PALLAS_GEMM_MMA_SWEEP(sp_128x256x64_s4_g4, "mma ilsp 128x256x64 s4 g4", 128, 256, 64, 4, 1, kBar, 4, 64, 64, true, true, true)
PALLAS_GEMM_MMA_SWEEP(sp_128x256x64_s4_g16, "mma ilsp 128x256x64 s4 g16", 128, 256, 64, 4, 1, kBar, 16, 64, 64, true, true, true)
PALLAS_GEMM_MMA_SWEEP(sp_128x256x64_s3, "mma ilsp 128x256x64 s3 g8", 128, 256, 64, 3, 1, kBar, 8, 64, 64, true, true, true)
PALLAS_GEMM_MMA_SWEEP(sp_256x128x64_s4, "mma ilsp 256x128x64 s4 g8", 256, 128, 64, 4, 1, kBar, 8, 64, 64, true, true, true)
PALLAS_GEMM_MMA_SWEEP(sp_128x256x32_s6, "mma ilsp 128x256x32 s6 g8", 128, 256, 32, 6, 1, kBar, 8, 64, 64, true, true, true)
PALLAS_GEMM_MMA_SWEEP(sp_128x128x64_s3_2sm, "mma ilsp 128x128x64 s3 g8 2/SM", 128, 128, 64, 3, 2, kBar, 8, 64, 64, true, true, true)
#undef PALLAS_GEMM_MMA_SWEEP
}  // namespace mma_sync_pipelined
}  // namespace pallas_gemm
