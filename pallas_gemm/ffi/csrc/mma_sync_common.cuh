// Building blocks shared by the mma.sync kernels (mma_sync.cu and
// mma_sync_pipelined.cu): cp.async (from cp_async.cuh), ldmatrix, the
// m16n8k16 MMA for bf16 and f16, the 16-byte shared-memory swizzle, each
// batch's slices of the operands, and 8-wide epilogue loads/stores.
#pragma once

#include <type_traits>

#include "cp_async.cuh"
#include "gemm_params.cuh"

namespace pallas_gemm {
namespace mma_sync {

// The 16-byte slot a (row, chunk) of a row-major tile lives in. Rows of 128
// bytes or more: XOR the low 3 bits of the chunk with the row, so the 8 rows
// an ldmatrix phase reads (same logical chunk) hit 8 different bank groups.
// 64-byte rows (A with a K step of 32): two rows share one 128-byte line, so
// XOR with the row-pair index instead, with the same effect.
template <int kChunksPerRow>
__device__ __forceinline__ int SwizzledChunk(int row, int chunk) {
  if constexpr (kChunksPerRow == 4) {
    return row * 4 + (chunk ^ ((row >> 1) & 3));
  } else {
    return row * kChunksPerRow + (chunk ^ (row & 7));
  }
}

using ::pallas_gemm::CpAsync16;
using ::pallas_gemm::CpAsyncCommit;
using ::pallas_gemm::CpAsyncWait;

__device__ __forceinline__ void LdMatrixX4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile(
      "ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
      : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
      : "r"(addr));
}

__device__ __forceinline__ void LdMatrixX4Trans(uint32_t (&r)[4],
                                                uint32_t addr) {
  asm volatile(
      "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
      : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
      : "r"(addr));
}

// d += a * b, one m16n8k16 MMA with f32 accumulators. The asm template must
// be a string literal, so the input type's PTX name ("bf16" or "f16") is
// pasted in by this macro.
#define PALLAS_GEMM_MMA_M16N8K16(ptx_type, d, a, b)                         \
  asm volatile(                                                             \
      "mma.sync.aligned.m16n8k16.row.col.f32." ptx_type "." ptx_type        \
      ".f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n" \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                     \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]))

template <typename T>
struct Mma {
  static_assert(std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>,
                "mma.sync takes bf16 or f16 inputs");
  static __device__ __forceinline__ void Run(float (&d)[4],
                                             const uint32_t (&a)[4],
                                             const uint32_t (&b)[2]) {
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      PALLAS_GEMM_MMA_M16N8K16("bf16", d, a, b);
    } else {
      PALLAS_GEMM_MMA_M16N8K16("f16", d, a, b);
    }
  }
};

#undef PALLAS_GEMM_MMA_M16N8K16

// Eight consecutive outputs: load (for C) and store in the output type.
__device__ __forceinline__ void Load8(const float* src, float (&v)[8]) {
  const float4 lo = reinterpret_cast<const float4*>(src)[0];
  const float4 hi = reinterpret_cast<const float4*>(src)[1];
  v[0] = lo.x; v[1] = lo.y; v[2] = lo.z; v[3] = lo.w;
  v[4] = hi.x; v[5] = hi.y; v[6] = hi.z; v[7] = hi.w;
}
__device__ __forceinline__ void Store8(float* dst, const float (&v)[8]) {
  reinterpret_cast<float4*>(dst)[0] = make_float4(v[0], v[1], v[2], v[3]);
  reinterpret_cast<float4*>(dst)[1] = make_float4(v[4], v[5], v[6], v[7]);
}

// 16-bit outputs move as packed pairs (__nv_bfloat162 / __half2), 8 values
// in one 16-byte access; these overloads convert a pair to and from floats,
// so one Load8 and one Store8 serve both types.
template <typename T>
using PairOf =
    std::conditional_t<std::is_same_v<T, __half>, __half2, __nv_bfloat162>;
__device__ __forceinline__ float2 ToFloat2(__nv_bfloat162 pair) {
  return __bfloat1622float2(pair);
}
__device__ __forceinline__ float2 ToFloat2(__half2 pair) {
  return __half22float2(pair);
}
__device__ __forceinline__ void FromFloats(float x, float y,
                                           __nv_bfloat162& pair) {
  pair = __floats2bfloat162_rn(x, y);
}
__device__ __forceinline__ void FromFloats(float x, float y, __half2& pair) {
  pair = __floats2half2_rn(x, y);
}

template <typename T>
__device__ __forceinline__ void Load8(const T* src, float (&v)[8]) {
  static_assert(sizeof(T) == 2, "16-bit types; floats have their overload");
  const uint4 raw = *reinterpret_cast<const uint4*>(src);
  const PairOf<T>* pairs = reinterpret_cast<const PairOf<T>*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = ToFloat2(pairs[i]);
    v[2 * i] = f.x; v[2 * i + 1] = f.y;
  }
}
template <typename T>
__device__ __forceinline__ void Store8(T* dst, const float (&v)[8]) {
  static_assert(sizeof(T) == 2, "16-bit types; floats have their overload");
  uint4 raw;
  PairOf<T>* pairs = reinterpret_cast<PairOf<T>*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) FromFloats(v[2 * i], v[2 * i + 1], pairs[i]);
  *reinterpret_cast<uint4*>(dst) = raw;
}

// One batch's slices of the operands (GemmParams' layout contract); c is
// null when there is no beta * c term.
template <typename T, typename TOut>
struct BatchOperands {
  const T* a;
  const T* b;
  const TOut* c;
  TOut* out;
};

template <typename T, typename TOut>
__device__ __forceinline__ BatchOperands<T, TOut> SliceBatch(
    const GemmParams& p, int batch) {
  return {BatchSlice<T>(p.a, batch, 1LL * p.m * p.k),
          BatchSlice<T>(p.b, batch, 1LL * p.k * p.n),
          p.c ? BatchSlice<TOut>(p.c, batch, 1LL * p.m * p.n) : nullptr,
          BatchSliceMut<TOut>(p.out, batch, 1LL * p.m * p.n)};
}

// The epilogue's last step for 8 consecutive outputs: out = v + beta * c at
// `index` (v already holds alpha * acc).
template <typename T, typename TOut>
__device__ __forceinline__ void StoreWithBetaC8(
    float (&v)[8], const BatchOperands<T, TOut>& operands, long long index,
    float beta) {
  if (operands.c != nullptr) {
    float c_values[8];
    Load8(operands.c + index, c_values);
#pragma unroll
    for (int e = 0; e < 8; ++e) v[e] += beta * c_values[e];
  }
  Store8(operands.out + index, v);
}

}  // namespace mma_sync
}  // namespace pallas_gemm
