// Tensor-core GEMM with mma.sync, software-pipelined: fp16 or bf16 in, f32
// accumulate. Same building blocks as mma_sync.cu (multi-stage cp.async with
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
//  * Those loads are interleaved with the mma.sync rather than issued in a
//    burst: one A and one B ldmatrix before each row of 8 mma.sync, and the
//    rows alternate direction so each turn reuses a B fragment. A burst of
//    8 ldmatrix per warp, all 8 warps at once, queued behind each other in
//    the shared-memory pipe while the tensor cores waited; spread out, they
//    hide under the mma.sync (a gain of a few percent at 8192^3 with
//    64-wide K tiles).
//  * One __syncthreads per K tile, placed just before the first read of the
//    next tile. It also proves every warp is done with the stage read one
//    tile ago, which is the stage the next cp.async batch overwrites, so no
//    second barrier is needed. 64-wide K tiles halve how often warps meet.
//  * Global addresses are computed once; per tile only k advances.
//  * When the tiles leave the last wave of a plain grid half empty (8192^3:
//    2048 tiles of 128x256 on 132 SMs is 15.5 waves), a second kernel
//    shares the last wave's tiles out evenly over all SMs (stream-K; see
//    TailPlan), with partial sums in an XLA scratch workspace.
//  * On Hopper the default tiling loads with the TMA (Tiling::kTma): one
//    thread issues each stage as 3-D boxes with the 128-byte swizzle (the
//    same XOR the ldmatrix addressing uses) and a per-stage mbarrier says
//    when they have landed. The main loop sheds every thread's cp.async and
//    its address arithmetic (about a quarter of its PTX instructions per K
//    tile), which made it the fastest tiling at 4096^3 and 8192^3.
//
// What did not help, measured with the tuning sweep
// (experiments/lab/ffi/sweep_driver.cu) on an H200: replacing the block
// barrier by a ring of per-stage mbarriers (slower: the arrivals and polls
// cost more than the meetings), 16 warps of 64x32 tiles (more ldmatrix per
// mma.sync; much slower), spreading a tile's cp.async over its slices,
// 128-wide K tiles with two stages. The sweep program's --ceiling measures
// the register-only rate of mma.sync.m16n8k16, the roof for this kernel.
//
// Compiled variants (csrc/kernels.def; block M x N x K, stages, blocks per
// SM): 128x256x32 and 256x128x32 with 8 warps, 4 stages; 128x256x64 with 8
// warps, 3 stages (with cp.async, the default before Hopper; at 8192^3 the
// H200 reaches its power cap and lowers the clock; with TMA loads, the
// default on Hopper); 128x128x32 (4 stages) and 128x128x64 (3 stages) with
// 4 warps and two blocks per SM. Measured numbers for all of the above:
// experiments/results/nvidia_h200/ffi/README.md, "Numbers the CUDA sources cite".
#include <cuda.h>  // CUtensorMap (types only; no libcuda link)
#include <cudaTypedefs.h>

#include <algorithm>
#include <type_traits>

#include "gemm_params.cuh"
#include "tma.cuh"
#include "mma_sync_common.cuh"
#include "sweep.cuh"

namespace pallas_gemm {
namespace mma_sync_pipelined {

using mma_sync::CpAsync16;
using mma_sync::CpAsyncCommit;
using mma_sync::CpAsyncWait;
using mma_sync::LdMatrixX4;
using mma_sync::LdMatrixX4Trans;
using mma_sync::Mma;
using mma_sync::SliceBatch;
using mma_sync::StoreWithBetaC8;
using mma_sync::SwizzledChunk;

constexpr int kWarpM = 64, kWarpN = 64;
constexpr int kMmaTilesM = kWarpM / 16, kMmaTilesN = kWarpN / 8;

template <int kBlockM_, int kBlockN_, int kBlockK_, int kStages_,
          int kMinBlocksPerSm_, int kGroupM_ = 8, bool kTma_ = false>
struct Tiling {
  // Operands reach shared memory by TMA (one thread issues whole tiles,
  // mbarriers signal arrival) instead of by every thread's cp.async.
  static constexpr bool kTma = kTma_;
  static constexpr int kBlockM = kBlockM_, kBlockN = kBlockN_,
                       kBlockK = kBlockK_, kStages = kStages_,
                       kMinBlocksPerSm = kMinBlocksPerSm_;
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
  // TMA's 128-byte swizzle repeats every 1024 bytes and is computed from
  // the shared address, so stages start on 1024-byte boundaries (the base
  // is rounded up at run time); the stage barriers follow the data.
  static constexpr int kTmaBoxN = 64;  // 128 bytes of B per TMA box row
  static constexpr int kSmemBytes =
      kTma ? kDataBytes + 1024 + 8 * kStages : kDataBytes;

  static_assert(kBlockM % kWarpM == 0 && kBlockN % kWarpN == 0, "warp grid");
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
  static_assert(!kTma || (kBlockK == 64 && kBlockN % kTmaBoxN == 0),
                "TMA boxes are 128 bytes wide: K tiles of 64, N of 64s");
};

// TMA descriptors for A (k, m, batch) and B (n, k, batch); zero when the
// tiling copies with cp.async.
struct TmaMaps {
  CUtensorMap a, b;
};

// How the grid shares out the output tiles (computed by MakeTailPlan).
//
// The tiles, taken in the grouped order, are one flat sequence of K tiles:
// tile t owns K tiles [t * k_tiles, (t + 1) * k_tiles). Blocks below
// whole_tiles compute one tile each, as a plain grid would. The
// tail_blocks blocks after them split the K tiles of the last tail_tiles
// tiles evenly between them (stream-K), so the last, partial wave of a
// plain grid becomes a full one of shorter blocks:
//
//   plain, 8192^3 on 132 SMs:  15 waves of 128x256 tiles, then 68 tiles
//                              on 132 SMs (the other 64 SMs idle)
//   with the tail plan:        15 waves, then 132 blocks of 68/132 of a
//                              tile each: the last wave ends ~half a
//                              tile sooner (a few percent of the
//                              whole in theory, less measured)
//
// A tail block's range covers parts of at most a few tiles. Every share of
// a tile writes its float32 partial sums to its own slot; the share that
// arrives last (an atomic count per tile) adds the slots in slot order, so
// the result does not depend on which block finished first, and runs the
// ordinary epilogue.
struct TailPlan {
  int whole_tiles;  // blocks [0, whole_tiles) own one tile each
  int tail_tiles;   // the last tail_tiles tiles are shared
  int tail_blocks;  // blocks after the whole tiles, one K range each
  int k_tiles;      // K tiles per output tile
  int max_shares;   // partial-sum slots per tail tile
  int* arrivals;    // [tail_tiles], zeroed before the launch
  float* partials;  // [tail_tiles][max_shares][block M * block N]
};

// The tail block whose K range holds flat K tile x (tail-relative): the
// largest b with floor(b * work / blocks) <= x.
__host__ __device__ inline int TailBlockOf(long long x, long long work,
                                           int blocks) {
  return static_cast<int>(((x + 1) * blocks + work - 1) / work) - 1;
}

// kTailBlocks false: block x computes whole tile x (grid: whole_tiles x
// batch). true: block x is tail block x (grid: tail_blocks). Two kernels
// rather than one, so the whole tiles' main loop compiles exactly as it
// would without a tail (one shared loop added integer work to every K tile
// and measured slower).
template <typename T, typename TOut, typename Tile, bool kTailBlocks>
__global__ void __launch_bounds__(Tile::kThreads, Tile::kMinBlocksPerSm)
MmaSyncPipelinedGemm(GemmParams p, TailPlan plan,
                     const __grid_constant__ TmaMaps maps) {
  constexpr int kStages = Tile::kStages, kBlockK = Tile::kBlockK;
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ int arrival_rank;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int warp_m = warp / Tile::kWarpsN, warp_n = warp % Tile::kWarpsN;
  const int blocks_m = CeilDiv(p.m, Tile::kBlockM);
  const int blocks_n = CeilDiv(p.n, Tile::kBlockN);

  const int batch = blockIdx.y;
  const auto operands = SliceBatch<T, TOut>(p, batch);

  uint32_t smem_base = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  if constexpr (Tile::kTma) smem_base = (smem_base + 1023) & ~1023u;
  // Stage s's "full" barrier: its TMA bytes have landed.
  auto full_barrier = [&](int stage) {
    return smem_base + Tile::kDataBytes + 8 * stage;
  };
  if constexpr (Tile::kTma) {
    if (tid == 0) {
      for (int s = 0; s < kStages; ++s) MbarrierInit(full_barrier(s), 1);
      // The async proxy (TMA) must see the initialised barriers.
      FenceProxyAsync();
    }
    __syncthreads();
  }

  // Per-thread copy positions inside a tile, fixed up front.
  const int a_row = tid / Tile::kAChunksPerRow;
  const int a_col = (tid % Tile::kAChunksPerRow) * 8;
  const int b_row = tid / Tile::kBChunksPerRow;
  const int b_col = (tid % Tile::kBChunksPerRow) * 8;
  const uint32_t a_smem_offset =
      SwizzledChunk<Tile::kAChunksPerRow>(a_row, a_col / 8) * 16;
  const uint32_t b_smem_offset = Tile::kAStageBytes +
      SwizzledChunk<Tile::kBChunksPerRow>(b_row, b_col / 8) * 16;
  const long long a_row_step = 1LL * Tile::kARowStep * p.k;
  const long long b_row_step = 1LL * Tile::kBRowStep * p.n;

  // ---- shared -> registers (ldmatrix; see the x4 matrix order).
  const int lane_row = (lane & 7) + ((lane >> 3) & 1) * 8;
  const int lane_chunk = lane >> 4;
  uint32_t a_frag[2][kMmaTilesM][4];
  uint32_t b_frag[2][kMmaTilesN][2];

  // ldmatrix of one k16 slice: A rows mi (x4) and B column pairs nj (x4
  // .trans), each into fragment buffer `buffer`.
  auto load_a_fragment = [&](int buffer, uint32_t a_base, int slice, int mi) {
    const int r = warp_m * kWarpM + mi * 16 + lane_row;
    LdMatrixX4(a_frag[buffer][mi],
               a_base + SwizzledChunk<Tile::kAChunksPerRow>(
                            r, slice * 2 + lane_chunk) * 16);
  };
  auto load_b_fragments = [&](int buffer, uint32_t b_base, int slice,
                              int nj) {
    const int r = slice * 16 + lane_row;
    const int chunk = (warp_n * kWarpN + nj * 16) / 8 + lane_chunk;
    uint32_t t[4];
    if constexpr (Tile::kTma) {
      // B arrives as kBlockN / 64 boxes of (K tile x 64 columns), each row
      // 128 bytes with TMA's 128-byte swizzle: chunk c of row r sits at
      // c ^ (r % 8).
      LdMatrixX4Trans(t, b_base + (chunk >> 3) * (Tile::kBlockK * 128) +
                             r * 128 + (((chunk & 7) ^ (r & 7)) << 4));
    } else {
      LdMatrixX4Trans(
          t, b_base + SwizzledChunk<Tile::kBChunksPerRow>(r, chunk) * 16);
    }
    b_frag[buffer][2 * nj][0] = t[0];
    b_frag[buffer][2 * nj][1] = t[1];
    b_frag[buffer][2 * nj + 1][0] = t[2];
    b_frag[buffer][2 * nj + 1][1] = t[3];
  };
  auto stage_a = [&](int stage) { return smem_base + stage * Tile::kStageBytes; };
  auto stage_b = [&](int stage) { return stage_a(stage) + Tile::kAStageBytes; };

  float acc[kMmaTilesM][kMmaTilesN][4];
  // The mma.sync of one slice (fragment buffer `current`), with the
  // ldmatrix of the next slice (buffer `next`, from `stage`) interleaved:
  // before row mi of mma.sync, A row mi and B column pair mi load. Odd rows
  // run right to left, so consecutive mma.sync share a B fragment.
  static_assert(kMmaTilesM == kMmaTilesN / 2, "one A and one B load per row");
  auto load_next_and_mma = [&](int next, int stage, int next_slice,
                               int current) {
#pragma unroll
    for (int mi = 0; mi < kMmaTilesM; ++mi) {
      load_a_fragment(next, stage_a(stage), next_slice, mi);
      load_b_fragments(next, stage_b(stage), next_slice, mi);
#pragma unroll
      for (int j = 0; j < kMmaTilesN; ++j) {
        const int ni = (mi & 1) ? kMmaTilesN - 1 - j : j;
        Mma<T>::Run(acc[mi][ni], a_frag[current][mi], b_frag[current][ni]);
      }
    }
  };

  // acc = the tile at (row0, col0) summed over k in [k_start, k_stop):
  // k_start a multiple of kBlockK, k_stop one too or p.k. Whole tiles pass
  // (0, p.k), which folds to the same main loop as a kernel without tails.
  auto accumulate = [&](int row0, int col0, int k_start, int k_stop) {
    const int k_tiles = CeilDiv(k_stop - k_start, kBlockK);
#pragma unroll
    for (int mi = 0; mi < kMmaTilesM; ++mi)
#pragma unroll
      for (int ni = 0; ni < kMmaTilesN; ++ni)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[mi][ni][e] = 0.f;
    const T* a_first = operands.a + 1LL * (row0 + a_row) * p.k + a_col;
    const T* b_first = operands.b + 1LL * b_row * p.n + col0 + b_col;
    uint32_t a_rows_in_range = 0;  // bit j: chunk row j is inside M
#pragma unroll
    for (int j = 0; j < Tile::kAChunksPerThread; ++j) {
      if (row0 + a_row + j * Tile::kARowStep < p.m) a_rows_in_range |= 1u << j;
    }
    const bool b_col_in_range = col0 + b_col < p.n;
    auto load_tile = [&](int stage, int k0) {
      const uint32_t stage_base = smem_base + stage * Tile::kStageBytes;
      if constexpr (Tile::kTma) {
        if (tid == 0) {
          FenceProxyAsync();  // this stage's ldmatrix reads came first
          MbarrierExpectTx(full_barrier(stage), Tile::kStageBytes);
          TmaLoad3d(stage_base, &maps.a, k0, row0, batch,
                    full_barrier(stage));
#pragma unroll
          for (int j = 0; j < Tile::kBlockN / Tile::kTmaBoxN; ++j) {
            TmaLoad3d(stage_base + Tile::kAStageBytes +
                          j * Tile::kBlockK * Tile::kTmaBoxN * 2,
                      &maps.b, col0 + j * Tile::kTmaBoxN, k0, batch,
                      full_barrier(stage));
          }
        }
        return;
      }
      const bool a_col_in_range = k0 + a_col < p.k;
#pragma unroll
      for (int j = 0; j < Tile::kAChunksPerThread; ++j) {
        const bool valid = a_col_in_range && ((a_rows_in_range >> j) & 1);
        const T* src = valid ? a_first + j * a_row_step + k0 : operands.a;
        CpAsync16(stage_base + a_smem_offset +
                      j * Tile::kARowStep * Tile::kAChunksPerRow * 16,
                  src, valid);
      }
      const T* b_tile = b_first + 1LL * k0 * p.n;
#pragma unroll
      for (int j = 0; j < Tile::kBChunksPerThread; ++j) {
        const bool valid =
            b_col_in_range && k0 + b_row + j * Tile::kBRowStep < p.k;
        const T* src = valid ? b_tile + j * b_row_step : operands.b;
        CpAsync16(stage_base + b_smem_offset +
                      j * Tile::kBRowStep * Tile::kBChunksPerRow * 16,
                  src, valid);
      }
    };

    // A previous range's epilogue may still be reading shared memory.
    __syncthreads();
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
      if (s < k_tiles) load_tile(s, k_start + s * kBlockK);
      CpAsyncCommit();  // empty groups keep the wait counts uniform
    }
    if constexpr (Tile::kTma) {
      if (k_tiles > 0) MbarrierWait(full_barrier(0), 0);
    } else {
      CpAsyncWait<kStages - 2>();
      __syncthreads();  // the first tile is visible
    }

    int read_stage = 0, write_stage = kStages - 1;
    int next_k = k_start + (kStages - 1) * kBlockK;  // the next tile's k
#pragma unroll
    for (int mi = 0; mi < kMmaTilesM; ++mi) {
      load_a_fragment(0, stage_a(0), 0, mi);
      load_b_fragments(0, stage_b(0), 0, mi);
    }

    for (int kt = 0; kt < k_tiles; ++kt) {
#pragma unroll
      for (int slice = 0; slice < Tile::kSlices; ++slice) {
        if (slice == 0) {
          // The stage written here was last read during tile kt - 1, before
          // the previous iteration's barrier.
          if (next_k < k_stop) load_tile(write_stage, next_k);
          CpAsyncCommit();
          write_stage = write_stage + 1 == kStages ? 0 : write_stage + 1;
          next_k += kBlockK;
        }
        if (slice == Tile::kSlices - 1) {
          // One group is committed per tile, so at most kStages - 2 pending
          // means tile kt + 1 has landed. After the barrier every warp has
          // also finished reading stage kt, which the next iteration's
          // copies overwrite. On the last tile this loads fragments nobody
          // uses, from a stage no copy is writing.
          if constexpr (Tile::kTma) {
            __syncthreads();  // every warp is done with stage kt
            read_stage = read_stage + 1 == kStages ? 0 : read_stage + 1;
            // Stage s holds tile t = kt + 1 on its (t / kStages)-th use.
            if (kt + 1 < k_tiles) {
              MbarrierWait(full_barrier(read_stage),
                           ((kt + 1) / kStages) & 1);
            }
          } else {
            CpAsyncWait<kStages - 2>();
            __syncthreads();
            read_stage = read_stage + 1 == kStages ? 0 : read_stage + 1;
          }
        }
        load_next_and_mma((slice + 1) & 1, read_stage,
                          (slice + 1) % Tile::kSlices, slice & 1);
      }
    }
    CpAsyncWait<0>();  // only empty groups remain; leave none behind
  };

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
  float* staged = reinterpret_cast<float*>(
      smem + (smem_base - static_cast<uint32_t>(__cvta_generic_to_shared(smem))));
  auto stage_acc = [&]() {
    __syncthreads();  // every warp is done with the pipeline's shared memory
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
  };
  auto read_staged = [&](int r, int col, float (&v)[8]) {
    // col is a multiple of 8, so its two chunks share the flip bit.
    const float4 lo = *reinterpret_cast<const float4*>(
        &staged[staged_offset(r, col)]);
    const float4 hi = *reinterpret_cast<const float4*>(
        &staged[staged_offset(r, col + 4)]);
    v[0] = lo.x; v[1] = lo.y; v[2] = lo.z; v[3] = lo.w;
    v[4] = hi.x; v[5] = hi.y; v[6] = hi.z; v[7] = hi.w;
  };
  // Thread tid's j-th 8-wide chunk of the tile: row r, column col.
  constexpr int kOutChunksPerRow = Tile::kBlockN / 8;
  constexpr int kOutChunksPerThread =
      Tile::kBlockM * kOutChunksPerRow / Tile::kThreads;
  static_assert(Tile::kBlockM * kOutChunksPerRow % Tile::kThreads == 0,
                "even split");
  auto out_chunk = [&](int j, int& r, int& col) {
    const int i = tid + j * Tile::kThreads;
    r = i / kOutChunksPerRow;
    col = (i % kOutChunksPerRow) * 8;
  };
  // fn(r, col, index) for each 8-wide chunk of the tile inside the output:
  // row r, column col of the tile, element `index` of out.
  auto for_each_out_chunk = [&](int row0, int col0, auto&& fn) {
#pragma unroll 4
    for (int j = 0; j < kOutChunksPerThread; ++j) {
      int r, col;
      out_chunk(j, r, col);
      const int out_row = row0 + r, out_col = col0 + col;
      if (out_row >= p.m || out_col >= p.n) continue;  // n % 8 == 0
      fn(r, col, 1LL * out_row * p.n + out_col);
    }
  };
  auto store = [&](int row0, int col0) {
    stage_acc();
    for_each_out_chunk(row0, col0, [&](int r, int col, long long index) {
      float v[8];
      read_staged(r, col, v);
      StoreWithBetaC8(v, operands, index, p.beta);
    });
  };

  // A tail tile's partial sums: one row-major block M x N float32 slot per
  // share, holding alpha times the share's sum, copied from the staged tile
  // in 8-wide chunks.
  // .cg keeps the slots out of L1: other SMs write and read them.
  constexpr int kTileFloats = Tile::kBlockM * Tile::kBlockN;
  auto store_share = [&](int row0, int col0, float* slots, int share,
                         int shares, int tail_tile) {
    stage_acc();
    for_each_out_chunk(row0, col0, [&](int r, int col, long long) {
      float v[8];
      read_staged(r, col, v);
      float4* dst = reinterpret_cast<float4*>(
          slots + 1LL * share * kTileFloats + r * Tile::kBlockN + col);
      __stcg(dst, make_float4(v[0], v[1], v[2], v[3]));
      __stcg(dst + 1, make_float4(v[4], v[5], v[6], v[7]));
    });
    __threadfence();  // the slot is visible before the arrival counts
    __syncthreads();
    if (tid == 0) arrival_rank = atomicAdd(&plan.arrivals[tail_tile], 1);
    __syncthreads();
    if (arrival_rank != shares - 1) return;
    __threadfence();  // read the other shares only after seeing them count
    // The last share adds every slot in share order (its own from shared
    // memory), so the sum is the same whichever block finished last. Shares
    // form the outer loop and a batch of kBatch chunks the inner one, so
    // each share's loads go out together instead of one L2 round trip per
    // chunk; the batch bounds the registers they need.
    constexpr int kBatch = 2;
    static_assert(kOutChunksPerThread % kBatch == 0, "whole batches");
#pragma unroll 1
    for (int first = 0; first < kOutChunksPerThread; first += kBatch) {
      float v[kBatch][8];
#pragma unroll 1
      for (int s = 0; s < shares; ++s) {
#pragma unroll
        for (int j = 0; j < kBatch; ++j) {
          int r, col;
          out_chunk(first + j, r, col);
          float part[8];
          if (row0 + r >= p.m || col0 + col >= p.n) continue;  // never written
          if (s == share) {
            read_staged(r, col, part);
          } else {
            const float4* src = reinterpret_cast<const float4*>(
                slots + 1LL * s * kTileFloats + r * Tile::kBlockN + col);
            const float4 lo = __ldcg(src), hi = __ldcg(src + 1);
            part[0] = lo.x; part[1] = lo.y; part[2] = lo.z; part[3] = lo.w;
            part[4] = hi.x; part[5] = hi.y; part[6] = hi.z; part[7] = hi.w;
          }
#pragma unroll
          for (int e = 0; e < 8; ++e)
            v[j][e] = s == 0 ? part[e] : v[j][e] + part[e];
        }
      }
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        int r, col;
        out_chunk(first + j, r, col);
        const int out_row = row0 + r, out_col = col0 + col;
        if (out_row >= p.m || out_col >= p.n) continue;
        StoreWithBetaC8(v[j], operands, 1LL * out_row * p.n + out_col,
                        p.beta);
      }
    }
  };

  // Grouped order: kGroupM block-rows walk each block-column band together,
  // so their A rows and B columns stay in L2.
  auto tile_origin = [&](int tile, int& row0, int& col0) {
    const int blocks_per_group = Tile::kGroupM * blocks_n;
    const int group = tile / blocks_per_group;
    const int first_block_m = group * Tile::kGroupM;
    const int group_rows = min(blocks_m - first_block_m, Tile::kGroupM);
    const int in_group = tile % blocks_per_group;
    row0 = (first_block_m + in_group % group_rows) * Tile::kBlockM;
    col0 = (in_group / group_rows) * Tile::kBlockN;
  };

  if constexpr (!kTailBlocks) {
    int row0, col0;
    tile_origin(blockIdx.x, row0, col0);
    accumulate(row0, col0, 0, p.k);
    store(row0, col0);
  } else {
    // This block's range of the tail's flat K tiles (see TailPlan); it
    // covers parts of one to a few tiles.
    const long long k_tiles = plan.k_tiles;
    const long long tail_work = 1LL * plan.tail_tiles * k_tiles;
    const int tail_block = blockIdx.x;
    long long begin = tail_work * tail_block / plan.tail_blocks;
    const long long end = tail_work * (tail_block + 1) / plan.tail_blocks;
#pragma unroll 1
    while (begin < end) {
      const int tail_tile = static_cast<int>(begin / k_tiles);
      const int kt_begin = static_cast<int>(begin - tail_tile * k_tiles);
      const int kt_end = static_cast<int>(
          min(k_tiles, static_cast<long long>(kt_begin) + (end - begin)));
      begin += kt_end - kt_begin;
      int row0, col0;
      tile_origin(plan.whole_tiles + tail_tile, row0, col0);
      accumulate(row0, col0, kt_begin * kBlockK,
                 min(p.k, kt_end * kBlockK));
      const long long tile_start = 1LL * tail_tile * k_tiles;
      const int first_share =
          TailBlockOf(tile_start, tail_work, plan.tail_blocks);
      const int shares = TailBlockOf(tile_start + k_tiles - 1, tail_work,
                                     plan.tail_blocks) -
                         first_share + 1;
      store_share(
          row0, col0,
          plan.partials + 1LL * tail_tile * plan.max_shares * kTileFloats,
          tail_block - first_share, shares, tail_tile);
    }
  }
}

// When a launch shares out its last wave.
enum class Tail { kNever, kWhenWorthIt, kAlways };

// The tail plan for `p` on `sms` SMs: the plain grid's last, partial wave
// of tiles becomes stream-K. Returns the plain grid's plan (no tail) when
// sms is 0, when there is no partial wave, when p is batched, when the
// saving is too small (below),
// or when the ranges would be too short for the pipeline to fill (fewer
// than kMinKTilesPerBlock K tiles).
template <typename Tile, Tail kTail = Tail::kWhenWorthIt>
TailPlan MakeTailPlan(const GemmParams& p, int sms) {
  constexpr int kMinKTilesPerBlock = 4;
  TailPlan plan{};
  const long long tiles = 1LL * CeilDiv(p.m, Tile::kBlockM) *
                          CeilDiv(p.n, Tile::kBlockN);
  // k = 0 still runs one (zero-filled) K tile, so every output is written.
  plan.k_tiles = std::max(1, CeilDiv(p.k, Tile::kBlockK));
  plan.whole_tiles = static_cast<int>(tiles);
  const int resident = sms * Tile::kMinBlocksPerSm;
  if (p.batch != 1 || resident <= 0) return plan;
  const int partial_wave = static_cast<int>(tiles % resident);
  if (partial_wave == 0) return plan;
  // Sharing saves the idle part of the last wave, (1 - partial_wave /
  // resident) of a tile's K loop; it costs each tail block a second
  // pipeline fill and every tail tile a round trip of partial sums through
  // L2. Measured on an H200 with the tail forced: a gain for a last wave
  // about half full (8192^3 with 128x256 tiles), losses for one nearly full
  // (4096^3, 12288^3; numbers: experiments/results/nvidia_h200/ffi/README.md,
  // "Numbers the CUDA sources cite"). So only a last wave at most three
  // quarters full is shared.
  if (kTail == Tail::kWhenWorthIt && 4LL * partial_wave > 3LL * resident) {
    return plan;
  }
  const long long work = 1LL * partial_wave * plan.k_tiles;
  const long long blocks =
      std::min<long long>(resident, work / kMinKTilesPerBlock);
  if (blocks <= partial_wave) return plan;  // no better than whole tiles
  plan.whole_tiles = static_cast<int>(tiles - partial_wave);
  plan.tail_tiles = partial_wave;
  plan.tail_blocks = static_cast<int>(blocks);
  for (int t = 0; t < plan.tail_tiles; ++t) {
    const long long start = 1LL * t * plan.k_tiles;
    const int shares =
        TailBlockOf(start + plan.k_tiles - 1, work, plan.tail_blocks) -
        TailBlockOf(start, work, plan.tail_blocks) + 1;
    plan.max_shares = std::max(plan.max_shares, shares);
  }
  return plan;
}

// Workspace layout: the arrival counts, then the partial-sum slots.
constexpr size_t kArrivalsBytes(int tail_tiles) {
  return (static_cast<size_t>(tail_tiles) * sizeof(int) + 255) / 256 * 256;
}
template <typename Tile>
size_t TailWorkspaceBytes(const TailPlan& plan) {
  if (plan.tail_tiles == 0) return 0;
  return kArrivalsBytes(plan.tail_tiles) +
         sizeof(float) * plan.tail_tiles * plan.max_shares * Tile::kBlockM *
             Tile::kBlockN;
}

// The A and B descriptors of a TMA tiling: 3-D (minor dim first), boxes of
// one K tile by a block's rows (A) or by 64 columns (B), 128-byte swizzle,
// zero fill past every edge.
template <typename T, typename Tile>
cudaError_t MakeTmaMaps(const GemmParams& p, TmaMaps* maps) {
  const auto encode = TensorMapEncoder();
  if (encode == nullptr) return cudaErrorNotSupported;
  const CUtensorMapDataType type = std::is_same_v<T, __half>
                                       ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16
                                       : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  const cuuint32_t unit_strides[3] = {1, 1, 1};
  auto make = [&](CUtensorMap* map, const void* base, cuuint64_t cols,
                  cuuint64_t rows, cuuint32_t box_cols, cuuint32_t box_rows) {
    const cuuint64_t dims[3] = {cols, rows, static_cast<cuuint64_t>(p.batch)};
    const cuuint64_t strides[2] = {cols * sizeof(T), rows * cols * sizeof(T)};
    const cuuint32_t box[3] = {box_cols, box_rows, 1};
    return encode(map, type, 3, const_cast<void*>(base), dims, strides, box,
                  unit_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                  CU_TENSOR_MAP_SWIZZLE_128B,
                  CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                  CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  };
  if (make(&maps->a, p.a, p.k, p.m, Tile::kBlockK, Tile::kBlockM) !=
          CUDA_SUCCESS ||
      make(&maps->b, p.b, p.n, p.k, Tile::kTmaBoxN, Tile::kBlockK) !=
          CUDA_SUCCESS) {
    return cudaErrorInvalidValue;
  }
  return cudaSuccess;
}

// Whether the current device has the TMA (compute capability 9.0+).
inline bool DeviceHasTma() {
  return CurrentDeviceAttribute(cudaDevAttrComputeCapabilityMajor) >= 9;
}

inline int SmCount() {
  return CurrentDeviceAttribute(cudaDevAttrMultiProcessorCount);
}

// Uses the tail plan when kTail allows and p.workspace is large enough for
// it; otherwise launches the plain grid.
template <typename T, typename TOut, typename Tile, Tail kTail>
cudaError_t Launch(const GemmParams& p, cudaStream_t stream) {
  const long long tiles = 1LL * CeilDiv(p.m, Tile::kBlockM) *
                          CeilDiv(p.n, Tile::kBlockN);
  if (tiles > 2147483647LL) return cudaErrorInvalidConfiguration;
  // The TMA path tracks barrier phases over one K range per block.
  static_assert(!Tile::kTma || kTail == Tail::kNever, "TMA has no tail");
  TmaMaps maps{};
  if constexpr (Tile::kTma) {
    const cudaError_t made = MakeTmaMaps<T, Tile>(p, &maps);
    if (made != cudaSuccess) return made;
  }
  // With 0 SMs MakeTailPlan returns the plain grid's plan.
  TailPlan plan =
      MakeTailPlan<Tile, kTail>(p, kTail == Tail::kNever ? 0 : SmCount());
  if (plan.tail_tiles > 0 &&
      (p.workspace == nullptr ||
       p.workspace_bytes < TailWorkspaceBytes<Tile>(plan))) {
    plan = MakeTailPlan<Tile, kTail>(p, 0);
  }
  cudaError_t status = cudaSuccess;
  if (plan.whole_tiles > 0) {
    auto kernel = MmaSyncPipelinedGemm<T, TOut, Tile, false>;
    // Over 48 KiB of dynamic shared memory needs an explicit opt-in.
    status = cudaFuncSetAttribute(
        kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Tile::kSmemBytes);
    if (status != cudaSuccess) return status;
    dim3 grid(static_cast<unsigned>(plan.whole_tiles), p.batch);
    kernel<<<grid, Tile::kThreads, Tile::kSmemBytes, stream>>>(p, plan,
                                                               maps);
    status = cudaGetLastError();
    if (status != cudaSuccess) return status;
  }
  if constexpr (kTail != Tail::kNever) {
    if (plan.tail_tiles == 0) return status;
    // Stream order runs the tail after the whole tiles: their last wave is
    // full, so only the launch gap separates the two.
    plan.arrivals = static_cast<int*>(p.workspace);
    plan.partials = reinterpret_cast<float*>(
        static_cast<unsigned char*>(p.workspace) +
        kArrivalsBytes(plan.tail_tiles));
    status = cudaMemsetAsync(plan.arrivals, 0,
                             sizeof(int) * plan.tail_tiles, stream);
    if (status != cudaSuccess) return status;
    auto kernel = MmaSyncPipelinedGemm<T, TOut, Tile, true>;
    status = cudaFuncSetAttribute(
        kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Tile::kSmemBytes);
    if (status != cudaSuccess) return status;
    kernel<<<plan.tail_blocks, Tile::kThreads, Tile::kSmemBytes, stream>>>(
        p, plan, maps);
    status = cudaGetLastError();
  }
  return status;
}

template <typename Tile, Tail kTail>
size_t WorkspaceBytes(const GemmParams& p) {
  if (kTail == Tail::kNever) return 0;
  return TailWorkspaceBytes<Tile>(MakeTailPlan<Tile, kTail>(p, SmCount()));
}

template <typename Tile, Tail kTail>
cudaError_t Dispatch(const GemmParams& p, cudaStream_t stream) {
  using E = ElementType;
  if constexpr (Tile::kTma) {
    // Before Hopper: the same tiling with every thread's cp.async.
    if (!DeviceHasTma()) {
      return Dispatch<Tiling<Tile::kBlockM, Tile::kBlockN, Tile::kBlockK,
                             Tile::kStages, Tile::kMinBlocksPerSm,
                             Tile::kGroupM, false>,
                      kTail>(p, stream);
    }
  }
  if (p.in_type == E::kBF16 && p.out_type == E::kF32)
    return Launch<__nv_bfloat16, float, Tile, kTail>(p, stream);
  if (p.in_type == E::kBF16 && p.out_type == E::kBF16)
    return Launch<__nv_bfloat16, __nv_bfloat16, Tile, kTail>(p, stream);
  if (p.in_type == E::kF16 && p.out_type == E::kF32)
    return Launch<__half, float, Tile, kTail>(p, stream);
  if (p.in_type == E::kF16 && p.out_type == E::kF16)
    return Launch<__half, __half, Tile, kTail>(p, stream);
  return cudaErrorInvalidValue;
}

}  // namespace mma_sync_pipelined
}  // namespace pallas_gemm

// Launchers, named block M x N x K; the stage count, blocks per SM and
// tail policy are fixed per shape (see the file comment). Each comes with
// the size of the workspace its tail plan needs for p (0: none); without
// it, it launches the plain grid. The two-blocks-per-SM tilings never use
// a tail: it measured slower for them at every size from 2048^3 to
// 12288^3, and their tail kernel would need more than 255 registers.
#define PALLAS_GEMM_PIPELINED_LAUNCHER(name, bm, bn, bk, stages, per_sm, \
                                       tail, tma)                        \
  extern "C" cudaError_t pallas_gemm_launch_##name(                      \
      const pallas_gemm::GemmParams& p, cudaStream_t stream) {           \
    return pallas_gemm::mma_sync_pipelined::Dispatch<                    \
        pallas_gemm::mma_sync_pipelined::Tiling<bm, bn, bk, stages,      \
                                                per_sm, 8, tma>,         \
        pallas_gemm::mma_sync_pipelined::Tail::tail>(p, stream);         \
  }                                                                      \
  extern "C" size_t pallas_gemm_workspace_##name(                        \
      const pallas_gemm::GemmParams& p) {                                \
    return pallas_gemm::mma_sync_pipelined::WorkspaceBytes<              \
        pallas_gemm::mma_sync_pipelined::Tiling<bm, bn, bk, stages,      \
                                                per_sm, 8, tma>,         \
        pallas_gemm::mma_sync_pipelined::Tail::tail>(p);                 \
  }

PALLAS_GEMM_PIPELINED_LAUNCHER(mma_pipe_128x256x32, 128, 256, 32, 4, 1, kWhenWorthIt, false)
PALLAS_GEMM_PIPELINED_LAUNCHER(mma_pipe_256x128x32, 256, 128, 32, 4, 1, kWhenWorthIt, false)
PALLAS_GEMM_PIPELINED_LAUNCHER(mma_pipe_128x256x64, 128, 256, 64, 3, 1, kWhenWorthIt, false)
PALLAS_GEMM_PIPELINED_LAUNCHER(mma_pipe_128x128x32, 128, 128, 32, 4, 2, kNever, false)
PALLAS_GEMM_PIPELINED_LAUNCHER(mma_pipe_128x128x64, 128, 128, 64, 3, 2, kNever, false)
// The default on Hopper: 128x256x64 with TMA loads (cp.async before sm_90).
PALLAS_GEMM_PIPELINED_LAUNCHER(mma_pipe_128x256x64_tma, 128, 256, 64, 3, 1, kNever, true)
#undef PALLAS_GEMM_PIPELINED_LAUNCHER

// Sweep-only candidates (bf16 in and out; see sweep.cuh): the default
// tiling without a tail and with one at every size, and the stage count
// and group size around it.
namespace pallas_gemm {
namespace mma_sync_pipelined {
template <Tail tail, int bm, int bn, int bk, int stages, int per_sm,
          int group_m = 8, bool tma = false>
constexpr LaunchFn kSweepLaunch =
    &Launch<__nv_bfloat16, __nv_bfloat16,
            Tiling<bm, bn, bk, stages, per_sm, group_m, tma>, tail>;

#define PALLAS_GEMM_MMA_SWEEP(id, label, ...)                  \
  PALLAS_GEMM_SWEEP_CANDIDATE(id, label, ElementType::kBF16,   \
                              (kSweepLaunch<__VA_ARGS__>))
PALLAS_GEMM_MMA_SWEEP(plain_128x256x64, "mma 128x256x64 s3 g8 plain grid", Tail::kNever, 128, 256, 64, 3, 1)
PALLAS_GEMM_MMA_SWEEP(always_128x256x64, "mma 128x256x64 s3 g8 tail always", Tail::kAlways, 128, 256, 64, 3, 1)
PALLAS_GEMM_MMA_SWEEP(s4_128x256x64, "mma 128x256x64 s4 g8", Tail::kWhenWorthIt, 128, 256, 64, 4, 1)
PALLAS_GEMM_MMA_SWEEP(g16_128x256x64, "mma 128x256x64 s3 g16", Tail::kWhenWorthIt, 128, 256, 64, 3, 1, 16)
PALLAS_GEMM_MMA_SWEEP(tma_s4_128x256x64, "mma 128x256x64 s4 g8 TMA", Tail::kNever, 128, 256, 64, 4, 1, 8, true)
#undef PALLAS_GEMM_MMA_SWEEP
}  // namespace mma_sync_pipelined
}  // namespace pallas_gemm
