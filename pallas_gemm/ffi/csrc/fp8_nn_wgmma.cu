// ffi/fp8_nn: per-tensor scaled fp8 GEMM (e4m3 or e5m2, either operand) with
// B stored (k, n), the NN
// layout, on Hopper, without a transpose pass.
//
// An fp8 wgmma reads only K-major operands from shared memory, and B
// stored (k, n) is N-major (experiments/lab/fp8_wgmma/
// transpose_operand_probe.cu shows ptxas refusing the transpose). But a
// wgmma's A operand may come from registers, where any layout can be built.
// So the kernel computes the transposed product
//
//   out^T (n x m) = B^T (n x k) . A^T (k x m)
//
// with B^T as the register operand and A as the shared-memory operand
// (A stored (m, k) is K-major, as a wgmma's B operand must be). This is
// step 08 of experiments/lab/fp8_wgmma/, where the steps before it and the
// measurements are.
//
// CTA: a producer warpgroup streams A's 256 x 128 and B's 128 x 128 byte
// tiles through a TMA ring (128-byte swizzle) over a persistent, grouped
// walk of output tiles; two consumer warpgroups each own 64 columns of the
// 256 x 128 output tile. Per 128-deep K block a consumer builds its B^T
// fragment (per 32-deep K step: one ldmatrix.x4.trans, whose lanes pick the
// K rows so that each thread receives the four it needs, then four byte
// permutes) while the previous block's four m64n256k32 wgmmas run. Its two
// rows of out^T are two neighbouring columns of out, so the epilogue
// stores bf16 pairs straight from the accumulators.
//
// Short M leaves fewer tiles than SMs, and each tile's CTA streams its
// strip of B alone. With k_splits > 1 the walk is over K shares of the
// tiles instead, so that the idle SMs stream B too; each share stores its
// float32 partial sum, and the caller adds the k_splits partials.
//
// Needs sm_90a (wgmma, setmaxnreg); built for any other architecture the
// kernel traps, and Python never calls it there (ffi/fp8_nn's supports()).
#include <cuda.h>  // CUtensorMap (types only; no libcuda link)
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "gemm_params.cuh"
#include "tma.cuh"

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define PALLAS_GEMM_FP8_WGMMA 1
#else
#define PALLAS_GEMM_FP8_WGMMA 0
#endif

namespace pallas_gemm {
namespace fp8_nn {

// Rows of out per tile, the wgmma's N: 256, or 64 for short M, where a
// 256-row tile would spend three quarters of its tensor time on rows past
// M (csrc's one knob; ffi/fp8.py's Fp8NnConfig.tile_m picks it).
constexpr int kTallRows = 256;
constexpr int kShortRows = 64;
constexpr int kBlockN = 128;  // columns of out: 64 per consumer, the wgmma's M
constexpr int kBlockK = 128;  // bytes of K per stage: the swizzle span
constexpr int kStages = 4;
constexpr int kConsumers = 2;
[[maybe_unused]] constexpr int kGroupM = 8;  // tile rows per group of the walk
constexpr int kThreads = 128 * (1 + kConsumers);
constexpr int kBTileBytes = kBlockK * kBlockN;  // 16 KB, N-major
// A's tile (kRows x 128 bytes, K-major) then B's, per stage.
__host__ __device__ constexpr int StageBytes(int rows) {
  return rows * kBlockK + kBTileBytes;
}
__host__ __device__ constexpr int SmemBytes(int rows) {
  return kStages * StageBytes(rows) + 1024;  // + alignment slack
}

struct Maps {
  CUtensorMap a, b;
};

// The fp8 formats by their wgmma names: kE4M3 or kE5M2.
enum Format : int { kE4M3 = 0, kE5M2 = 1 };

#if PALLAS_GEMM_FP8_WGMMA

__device__ __forceinline__ uint32_t SmemAddress(const void* pointer) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(pointer));
}

// A shared-memory matrix descriptor of a K-major tile with 128-byte
// swizzle: rows of 128 bytes, 8-row groups 1024 bytes apart.
__device__ __forceinline__ uint64_t SmemDescriptor(const void* tile) {
  const uint64_t address = SmemAddress(tile);
  return ((address & 0x3FFFF) >> 4) | (uint64_t(1) << 16) |
         (uint64_t(1024 >> 4) << 32) | (uint64_t(1) << 62);
}

// Tie registers to this point of the program: the compiler does not know
// that an issued wgmma still reads (or writes) them until it is waited for.
template <int kCount>
__device__ __forceinline__ void FenceRegisters(float (&r)[kCount]) {
#pragma unroll
  for (int i = 0; i < kCount; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
template <int kCount>
__device__ __forceinline__ void FenceRegisters(uint32_t (&r)[kCount]) {
#pragma unroll
  for (int i = 0; i < kCount; ++i) asm volatile("" : "+r"(r[i])::"memory");
}

template <int kPending>
__device__ __forceinline__ void WgmmaWait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(kPending) : "memory");
}

// The first 32 accumulator registers as read-write asm operands, shared by
// both wgmma shapes' operand lists.
#define PALLAS_GEMM_ACCUMULATORS_0_31(d)                                  \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),  \
      "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]),         \
      "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),     \
      "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),     \
      "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]),     \
      "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]),     \
      "+f"(d[31])

// One m64n256k32 fp8 wgmma: A (64 x 32) from this thread's four registers
// (laid out as mma.m16n8k32's A operand, per warp), B (256 rows of 32 K)
// from shared memory; `accumulate` false overwrites d (scale-d = 0). The
// instruction names both formats, so each pair is its own asm statement.
#define PALLAS_GEMM_FP8_WGMMA_ASM(TYPES)                                      \
  asm volatile(                                                               \
      "{\n"                                                                   \
      ".reg .pred p;\n"                                                       \
      "setp.ne.b32 p, %133, 0;\n"                                             \
      "wgmma.mma_async.sync.aligned.m64n256k32.f32" TYPES " {"                \
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "\
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, "\
      "%30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, "\
      "%44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, "\
      "%58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, "\
      "%72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, "\
      "%86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, "\
      "%100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, "    \
      "%111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, "    \
      "%122, %123, %124, %125, %126, %127}, {%128, %129, %130, %131}, %132, " \
      "p, 1, 1;\n"                                                            \
      "}\n"                                                                   \
      : PALLAS_GEMM_ACCUMULATORS_0_31(d), "+f"(d[32]), "+f"(d[33]),           \
        "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]),      \
        "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]),      \
        "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),      \
        "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]),      \
        "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]),      \
        "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),      \
        "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]),      \
        "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]),      \
        "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]),      \
        "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]),      \
        "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]),      \
        "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]),      \
        "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]),      \
        "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),  \
        "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), \
        "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), \
        "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), \
        "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), \
        "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])                \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b),              \
        "r"(accumulate ? 1 : 0));

// ASM(".<register format>.<shared format>") for the formats of the
// template parameters kRegisterFormat and kSharedFormat.
#define PALLAS_GEMM_FP8_BY_FORMATS(ASM)                               \
  if constexpr (kRegisterFormat == kE4M3 && kSharedFormat == kE4M3) { \
    ASM(".e4m3.e4m3");                                                \
  } else if constexpr (kRegisterFormat == kE4M3) {                    \
    ASM(".e4m3.e5m2");                                                \
  } else if constexpr (kSharedFormat == kE4M3) {                      \
    ASM(".e5m2.e4m3");                                                \
  } else {                                                            \
    ASM(".e5m2.e5m2");                                                \
  }

template <int kRegisterFormat, int kSharedFormat>
__device__ __forceinline__ void Wgmma(float (&d)[128], const uint32_t (&a)[4],
                                      uint64_t desc_b, bool accumulate) {
  PALLAS_GEMM_FP8_BY_FORMATS(PALLAS_GEMM_FP8_WGMMA_ASM)
}
#undef PALLAS_GEMM_FP8_WGMMA_ASM

// The same with 64 rows of B (m64n64k32): the short tile's wgmma.
#define PALLAS_GEMM_FP8_WGMMA_N64_ASM(TYPES)                                  \
  asm volatile(                                                               \
      "{\n"                                                                   \
      ".reg .pred p;\n"                                                       \
      "setp.ne.b32 p, %37, 0;\n"                                              \
      "wgmma.mma_async.sync.aligned.m64n64k32.f32" TYPES " {"                 \
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "\
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, "\
      "%30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1;\n"                      \
      "}\n"                                                                   \
      : PALLAS_GEMM_ACCUMULATORS_0_31(d)                                      \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b),              \
        "r"(accumulate ? 1 : 0));

template <int kRegisterFormat, int kSharedFormat>
__device__ __forceinline__ void Wgmma(float (&d)[32], const uint32_t (&a)[4],
                                      uint64_t desc_b, bool accumulate) {
  PALLAS_GEMM_FP8_BY_FORMATS(PALLAS_GEMM_FP8_WGMMA_N64_ASM)
}
#undef PALLAS_GEMM_FP8_WGMMA_N64_ASM
#undef PALLAS_GEMM_FP8_BY_FORMATS
#undef PALLAS_GEMM_ACCUMULATORS_0_31

// This thread's part of the 64 x 32 register fragment of B^T for 32-deep K
// step `step` of a stage, from the N-major B tile (row k at k * 128 bytes,
// its 16-byte chunk c at (c ^ (k % 8)) * 16). `warp_column` is the first of
// the warp's 16 columns (a multiple of 16). Fragment rows g and g + 8
// (g = lane / 4) are columns warp_column + 2g and + 1; its K offsets,
// 4 (lane % 4) + {0..3} and 16 more, are fixed by the hardware.
__device__ __forceinline__ void BuildFragment(const uint8_t* b_tile,
                                              int warp_column, int step,
                                              int lane, uint32_t (&a)[4]) {
  // Lane l addresses row l % 8 of 8 x 8 matrix l / 8. Matrix q holds K half
  // q / 2 and gives thread c the rows 4c + 2 (q % 2) and one more, so row r
  // of the matrix is K row 4 (r / 2) + 2 (q % 2) + r % 2 of that half.
  const int q = lane / 8, r = lane % 8;
  const int k = step * 32 + (q / 2) * 16 + 4 * (r / 2) + 2 * (q % 2) + r % 2;
  const uint8_t* row =
      b_tile + k * 128 + (((warp_column >> 4) ^ (k & 7)) << 4);
  uint32_t m[4];  // m[q]: two K rows of columns 2g and 2g + 1
  asm volatile(
      "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
      : "=r"(m[0]), "=r"(m[1]), "=r"(m[2]), "=r"(m[3])
      : "r"(SmemAddress(row))
      : "memory");
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    // (k0: c, c+1 | k1: c, c+1) and (k2 | k3) -> one register per column.
    a[2 * half] = __byte_perm(m[2 * half], m[2 * half + 1], 0x6420);
    a[2 * half + 1] = __byte_perm(m[2 * half], m[2 * half + 1], 0x7531);
  }
}

#endif  // PALLAS_GEMM_FP8_WGMMA

// kAFormat, kBFormat: a's and b's fp8 formats. B^T is the wgmma's register
// operand and A its shared-memory one. kBlockM: rows of out per tile.
template <int kAFormat, int kBFormat, int kBlockM>
__global__ void __launch_bounds__(kThreads, 1)
    Fp8NnKernel(const __grid_constant__ Maps maps, Fp8Params p) {
#if PALLAS_GEMM_FP8_WGMMA
  constexpr int kATileBytes = kBlockM * kBlockK;
  constexpr int kStageBytes = StageBytes(kBlockM);
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>(
      (reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  __shared__ alignas(8) uint64_t full[kStages];
  __shared__ alignas(8) uint64_t empty[kStages];

  const int warpgroup = threadIdx.x / 128;
  const int lane_in_group = threadIdx.x % 128;
  const int k_blocks = CeilDiv(p.k, kBlockK);
  const int m_tiles = CeilDiv(p.m, kBlockM), n_tiles = CeilDiv(p.n, kBlockN);
  // A unit of work is one output tile's share of K: with k_splits > 1 the
  // k_splits units of a tile each sum `split_blocks` K blocks (the last
  // what is left, never none: the launcher sees to it) into partials.
  const int split_blocks = CeilDiv(k_blocks, p.k_splits);
  const int units = m_tiles * n_tiles * p.k_splits;
  auto k_range = [&](int unit, int& first_block, int& blocks) {
    first_block = (unit % p.k_splits) * split_blocks;
    blocks = min(split_blocks, k_blocks - first_block);
  };
  // Tile t: groups of kGroupM tile rows, each walked column by column.
  auto coords = [&](int t, int& tile_m, int& tile_n) {
    const int group_tiles = kGroupM * n_tiles;
    const int first_m = (t / group_tiles) * kGroupM;
    const int rows = min(kGroupM, m_tiles - first_m);
    tile_m = first_m + (t % group_tiles) % rows;
    tile_n = (t % group_tiles) / rows;
  };

  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      MbarrierInit(SmemAddress(&full[s]), 1);
      // One arrival per consumer warp.
      MbarrierInit(SmemAddress(&empty[s]), kConsumers * 4);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  if (warpgroup == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    if (lane_in_group == 0) {
      int it = 0;  // K blocks loaded so far, over all of this CTA's units
      for (int u = blockIdx.x; u < units; u += gridDim.x) {
        int tile_m, tile_n, first_block, blocks;
        coords(u / p.k_splits, tile_m, tile_n);
        k_range(u, first_block, blocks);
        for (int kb = first_block; kb < first_block + blocks; ++kb, ++it) {
          const int stage = it % kStages;
          if (it >= kStages) {
            MbarrierWait(SmemAddress(&empty[stage]), ((it / kStages) - 1) & 1);
          }
          uint8_t* a_tile = smem + stage * kStageBytes;
          const uint32_t full_stage = SmemAddress(&full[stage]);
          MbarrierExpectTx(full_stage, kStageBytes);
          TmaLoad2d(SmemAddress(a_tile), &maps.a, kb * kBlockK,
                    tile_m * kBlockM, full_stage);
          // B's box: 128 bytes of N (inner) by 128 rows of K.
          TmaLoad2d(SmemAddress(a_tile + kATileBytes), &maps.b,
                    tile_n * kBlockN, kb * kBlockK, full_stage);
        }
      }
    }
    return;
  }

  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
  const int consumer = warpgroup - 1;
  const int warp = lane_in_group / 32, lane = lane_in_group % 32;
  const int warp_column = consumer * 64 + warp * 16;
  const float scale = p.a_scale[0] * p.b_scale[0];

  float acc[kBlockM / 2];  // out^T: 64 rows (columns of out) x kBlockM
  uint32_t fragment_even[4][4], fragment_odd[4][4];  // [K step][register]

  int it = 0;
  for (int u = blockIdx.x; u < units; u += gridDim.x) {
    int tile_m, tile_n, first_block, blocks;
    coords(u / p.k_splits, tile_m, tile_n);
    k_range(u, first_block, blocks);
    // kb below counts this unit's K blocks from 0.
    auto stage_of = [&](int kb) { return (it + kb) % kStages; };
    // Waits for K block kb's stage and builds its B^T fragment.
    auto build = [&](int kb, uint32_t (&fragment)[4][4]) {
      MbarrierWait(SmemAddress(&full[stage_of(kb)]), ((it + kb) / kStages) & 1);
      const uint8_t* b_tile = smem + stage_of(kb) * kStageBytes + kATileBytes;
#pragma unroll
      for (int step = 0; step < 4; ++step) {
        BuildFragment(b_tile, warp_column, step, lane, fragment[step]);
      }
    };
    // K block kb's four wgmmas, as one commit group.
    auto issue = [&](int kb, uint32_t (&fragment)[4][4]) {
      const uint64_t desc_a = SmemDescriptor(smem + stage_of(kb) * kStageBytes);
      asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
      for (int step = 0; step < 4; ++step) {
        // 32 bytes further along K in A's swizzled rows: +2 in 16-byte units.
        Wgmma<kBFormat, kAFormat>(acc, fragment[step], desc_a + 2 * step,
                                  kb + step > 0);
      }
      asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
    };
    // wgmma.wait_group completes this warp's share only: every consumer
    // warp releases the stage for itself.
    auto release = [&](int kb) {
      if (lane == 0) MbarrierArrive(SmemAddress(&empty[stage_of(kb)]));
    };

    // One K block in flight at the loop's head on every path, its fragment
    // kept live until its wgmmas are done: a loop ptxas can see through
    // (a branchier one made it serialize the wgmmas).
    build(0, fragment_even);
    issue(0, fragment_even);
    for (int kb = 0;;) {
      if (kb + 1 == blocks) {
        WgmmaWait<0>();
        release(kb);
        break;
      }
      build(kb + 1, fragment_odd);
      issue(kb + 1, fragment_odd);
      WgmmaWait<1>();
      for (int s = 0; s < 4; ++s) FenceRegisters(fragment_even[s]);
      release(kb);
      ++kb;
      if (kb + 1 == blocks) {
        WgmmaWait<0>();
        release(kb);
        break;
      }
      build(kb + 1, fragment_even);
      issue(kb + 1, fragment_even);
      WgmmaWait<1>();
      for (int s = 0; s < 4; ++s) FenceRegisters(fragment_odd[s]);
      release(kb);
      ++kb;
    }
    WgmmaWait<0>();  // nothing is in flight; for ptxas, as above
    FenceRegisters(acc);
    it += blocks;

    // acc[4j + e]: row g (e < 2) or g + 8 of out^T, i.e. out's column
    // `column` or `column + 1`; column 8j + 2 (lane % 4) + e % 2 of out^T,
    // i.e. out's row.
    const int column = tile_n * kBlockN + warp_column + 2 * (lane / 4);
    if (column >= p.n) continue;  // n is even: column + 1 < n too
    if (p.k_splits > 1) {  // float32 partials, out[split][row][column]
      float* partials = static_cast<float*>(p.out) +
                        static_cast<long long>(u % p.k_splits) * p.m * p.n;
#pragma unroll
      for (int j = 0; j < kBlockM / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int row = tile_m * kBlockM + 8 * j + 2 * (lane % 4) + e;
          if (row >= p.m) continue;
          *reinterpret_cast<float2*>(
              partials + static_cast<long long>(row) * p.n + column) =
              make_float2(acc[4 * j + e] * scale, acc[4 * j + 2 + e] * scale);
        }
      }
      continue;
    }
#pragma unroll
    for (int j = 0; j < kBlockM / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int row = tile_m * kBlockM + 8 * j + 2 * (lane % 4) + e;
        if (row >= p.m) continue;
        *reinterpret_cast<__nv_bfloat162*>(
            static_cast<__nv_bfloat16*>(p.out) +
            static_cast<long long>(row) * p.n + column) =
            __floats2bfloat162_rn(acc[4 * j + e] * scale,
                                  acc[4 * j + 2 + e] * scale);
      }
    }
  }
#else
  __trap();  // not built for sm_90a: supports() keeps Python from calling
#endif
}

// A (rows x cols) byte matrix, cols contiguous, read in (box_rows x 128)
// boxes with 128-byte swizzle; boxes past an edge read zeros.
inline CUresult ByteMap(CUtensorMap* map, const void* base, int rows,
                        int cols, int box_rows) {
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols),
                              static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(cols)};
  const cuuint32_t box[2] = {128, static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t unit[2] = {1, 1};
  return TensorMapEncoder()(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2,
                   const_cast<void*>(base), dims, strides, box, unit,
                   CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                   CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                   CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
}

// Launches the kRows-row tile's kernel for p's formats on a persistent grid
// of at most one CTA per SM.
template <int kRows>
cudaError_t LaunchTiles(const Fp8Params& p, cudaStream_t stream) {
  Maps maps{};
  if (ByteMap(&maps.a, p.a, p.m, p.k, kRows) != CUDA_SUCCESS ||
      ByteMap(&maps.b, p.b, p.k, p.n, kBlockK) != CUDA_SUCCESS) {
    return cudaErrorInvalidValue;
  }
  const long long units =
      1LL * CeilDiv(p.m, kRows) * CeilDiv(p.n, kBlockN) * p.k_splits;
  const int sms = CurrentDeviceAttribute(cudaDevAttrMultiProcessorCount);
  const int grid = static_cast<int>(units < sms ? units : sms);
  using Kernel = void (*)(const Maps, Fp8Params);
  // [a is e5m2][b is e5m2]: one instantiation per format pair, each given
  // its shared memory once.
  static const Kernel kernels[2][2] = {
      {Fp8NnKernel<kE4M3, kE4M3, kRows>, Fp8NnKernel<kE4M3, kE5M2, kRows>},
      {Fp8NnKernel<kE5M2, kE4M3, kRows>, Fp8NnKernel<kE5M2, kE5M2, kRows>}};
  static bool configured[2][2] = {{false, false}, {false, false}};
  const Kernel kernel = kernels[p.a_e5m2][p.b_e5m2];
  bool& ready = configured[p.a_e5m2][p.b_e5m2];
  if (!ready) {
    if (cudaFuncSetAttribute(kernel,
                             cudaFuncAttributeMaxDynamicSharedMemorySize,
                             SmemBytes(kRows)) != cudaSuccess) {
      return cudaErrorInvalidConfiguration;
    }
    ready = true;
  }
  kernel<<<grid > 0 ? grid : 1, kThreads, SmemBytes(kRows), stream>>>(maps,
                                                                      p);
  return cudaGetLastError();
}

}  // namespace fp8_nn
}  // namespace pallas_gemm

// The handler (ffi_handlers.cu) has checked shapes, dtypes, alignment,
// that n and k are multiples of 16 (TMA row strides), tile_m and k_splits.
extern "C" cudaError_t pallas_gemm_launch_fp8_nn(
    const pallas_gemm::Fp8Params& p, cudaStream_t stream) {
  namespace k8 = pallas_gemm::fp8_nn;
  if (p.m == 0 || p.n == 0) return cudaSuccess;
  if (p.k == 0) {  // an empty sum: zeros (bf16 out, or f32 partials)
    const long long bytes = p.k_splits > 1 ? 4LL * p.k_splits : 2LL;
    return cudaMemsetAsync(p.out, 0, bytes * p.m * p.n, stream);
  }
  using pallas_gemm::CurrentDeviceAttribute;
  if (CurrentDeviceAttribute(cudaDevAttrComputeCapabilityMajor) != 9) {
    return cudaErrorNotSupported;
  }
  if (pallas_gemm::TensorMapEncoder() == nullptr) return cudaErrorNotSupported;
  return p.tile_m == k8::kShortRows ? k8::LaunchTiles<k8::kShortRows>(p, stream)
                                    : k8::LaunchTiles<k8::kTallRows>(p, stream);
}
