// The host side every block-wise fp8 step shares: random inputs and scales,
// TMA maps, a float64 check of sampled outputs and CUDA-event timing. A step
// provides `launch(a_map, b_map, problem, promote)` and calls `run_program`.
//
//   program M N K [block|none]
//
// `block` (default) draws scales in [0.5, 2) and checks the block-wise sum;
// `none` sets every scale to 1 and asks the step for its unscaled form
// (promote = false: one accumulator over all of K), the ceiling the
// promotion is measured against. A step that reads B stored K x N (the NN
// layout) says so through `b_layout`.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "host_check.cuh"  // CHECK_CUDA (experiments/lab/ffi/)

namespace fp8_steps {

constexpr int kScaleBlock = 128;  // K and N extent of one scale

struct Problem {
  int m, n, k;
  const float* a_scale;  // (m, k_blocks)
  const float* b_scale;  // (ceil(n / 128), k_blocks)
  __nv_bfloat16* out;    // (m, n)
};

using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t,
                                 void*, const cuuint64_t*, const cuuint64_t*,
                                 const cuuint32_t*, const cuuint32_t*,
                                 CUtensorMapInterleave, CUtensorMapSwizzle,
                                 CUtensorMapL2promotion,
                                 CUtensorMapFloatOOBfill);

// The driver's tensor-map encoder through the runtime (no libcuda link).
inline EncodeTiled encoder() {
  void* function = nullptr;
  cudaDriverEntryPointQueryResult found;
  CHECK_CUDA(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled",
                                              &function, 12000,
                                              cudaEnableDefault, &found));
  if (found != cudaDriverEntryPointSuccess || function == nullptr) {
    std::fprintf(stderr, "cuTensorMapEncodeTiled not found\n");
    std::exit(1);
  }
  return reinterpret_cast<EncodeTiled>(function);
}

// A (rows x cols) byte matrix, cols contiguous, read in (box_rows x 128)
// boxes with 128-byte swizzle; boxes past an edge read zeros. A and B
// stored (n, k) are K-major (cols = k); B stored (k, n) is N-major.
inline CUtensorMap byte_map(const void* data, int rows, int cols,
                            int box_rows) {
  CUtensorMap map;
  cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols),
                        static_cast<cuuint64_t>(rows)};
  cuuint64_t strides[1] = {static_cast<cuuint64_t>(cols)};  // bytes, dim 1
  cuuint32_t box[2] = {128, static_cast<cuuint32_t>(box_rows)};
  cuuint32_t element_strides[2] = {1, 1};
  CUresult status = encoder()(
      &map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, const_cast<void*>(data), dims,
      strides, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
      CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (status != CUDA_SUCCESS) {
    std::fprintf(stderr, "cuTensorMapEncodeTiled failed: %d\n", int(status));
    std::exit(1);
  }
  return map;
}

using Launch = void (*)(const CUtensorMap& a_map, const CUtensorMap& b_map,
                        const Problem& problem, bool promote);

enum class BLayout { kNByK, kKByN };  // NT (K-major) or NN (N-major)

inline int run_program(int argc, char** argv, const char* step, Launch launch,
                       int a_box_rows, int b_box_rows,
                       BLayout b_layout = BLayout::kNByK) {
  const bool nn = b_layout == BLayout::kKByN;
  const int m = argc > 1 ? std::atoi(argv[1]) : 4096;
  const int n = argc > 2 ? std::atoi(argv[2]) : 4096;
  const int k = argc > 3 ? std::atoi(argv[3]) : 4096;
  const bool promote = !(argc > 4 && std::strcmp(argv[4], "none") == 0);
  if (m < 1 || n < 1 || k < 1 || k % 16 != 0 || (nn && n % 16 != 0)) {
    std::fprintf(stderr, "M=%d N=%d K=%d: need positive sizes and K (and, "
                 "for B stored K x N, N) a multiple of 16: a TMA row stride "
                 "is 16-byte aligned\n", m, n, k);
    return 1;
  }
  const int k_blocks = (k + kScaleBlock - 1) / kScaleBlock;
  const int n_blocks = (n + kScaleBlock - 1) / kScaleBlock;

  // Random fp8 values and positive scales, reproducible (seed 0).
  std::mt19937 rng(0);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::uniform_real_distribution<float> uniform(0.5f, 2.f);
  std::vector<__nv_fp8_e4m3> a(static_cast<size_t>(m) * k),
      b(static_cast<size_t>(n) * k);
  for (auto& x : a) x = __nv_fp8_e4m3(normal(rng));
  for (auto& x : b) x = __nv_fp8_e4m3(normal(rng));
  std::vector<float> a_scale(static_cast<size_t>(m) * k_blocks),
      b_scale(static_cast<size_t>(n_blocks) * k_blocks);
  for (auto& x : a_scale) x = promote ? uniform(rng) : 1.f;
  for (auto& x : b_scale) x = promote ? uniform(rng) : 1.f;

  void *a_dev, *b_dev;
  float *a_scale_dev, *b_scale_dev;
  __nv_bfloat16* out_dev;
  CHECK_CUDA(cudaMalloc(&a_dev, a.size()));
  CHECK_CUDA(cudaMalloc(&b_dev, b.size()));
  CHECK_CUDA(cudaMalloc(&a_scale_dev, a_scale.size() * sizeof(float)));
  CHECK_CUDA(cudaMalloc(&b_scale_dev, b_scale.size() * sizeof(float)));
  CHECK_CUDA(cudaMalloc(&out_dev, static_cast<size_t>(m) * n * 2));
  CHECK_CUDA(cudaMemcpy(a_dev, a.data(), a.size(), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(b_dev, b.data(), b.size(), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(a_scale_dev, a_scale.data(),
                        a_scale.size() * sizeof(float),
                        cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(b_scale_dev, b_scale.data(),
                        b_scale.size() * sizeof(float),
                        cudaMemcpyHostToDevice));
  // Poisoned output: an element the kernel never writes shows up as NaN.
  CHECK_CUDA(cudaMemset(out_dev, 0xFF, static_cast<size_t>(m) * n * 2));

  CUtensorMap a_map = byte_map(a_dev, m, k, a_box_rows);
  // B stored (k, n) is read in 128 rows of K by 128 bytes of N.
  CUtensorMap b_map = nn ? byte_map(b_dev, k, n, 128)
                         : byte_map(b_dev, n, k, b_box_rows);
  Problem problem{m, n, k, a_scale_dev, b_scale_dev, out_dev};
  launch(a_map, b_map, problem, promote);
  CHECK_CUDA(cudaGetLastError());
  CHECK_CUDA(cudaDeviceSynchronize());

  // Sampled outputs (the four corners first) against float64 sums of the
  // dequantized inputs, block by block as the scales apply.
  std::vector<__nv_bfloat16> out(static_cast<size_t>(m) * n);
  CHECK_CUDA(cudaMemcpy(out.data(), out_dev, out.size() * 2,
                        cudaMemcpyDeviceToHost));
  double error2 = 0, norm2 = 0;
  int nan_count = 0;
  std::uniform_int_distribution<int> pick_row(0, m - 1), pick_col(0, n - 1);
  for (int sample = 0; sample < 4096; ++sample) {
    int i = sample < 4 ? (sample % 2) * (m - 1) : pick_row(rng);
    int j = sample < 4 ? (sample / 2) * (n - 1) : pick_col(rng);
    double want = 0;
    for (int kb = 0; kb < k_blocks; ++kb) {
      double block = 0;
      for (int kk = kb * kScaleBlock; kk < std::min(k, (kb + 1) * kScaleBlock);
           ++kk) {
        const size_t b_index = nn ? size_t(kk) * n + j : size_t(j) * k + kk;
        block += double(float(a[size_t(i) * k + kk])) *
                 double(float(b[b_index]));
      }
      want += block * a_scale[size_t(i) * k_blocks + kb] *
              b_scale[size_t(j / kScaleBlock) * k_blocks + kb];
    }
    double got = __bfloat162float(out[size_t(i) * n + j]);
    if (std::isnan(got)) ++nan_count;
    error2 += (got - want) * (got - want);
    norm2 += want * want;
  }
  const double relative = std::sqrt(error2 / std::max(norm2, 1e-30));
  std::printf("%s %s%s M=%d N=%d K=%d: relative error %.3e on 4096 sampled "
              "outputs, %d NaN (bf16 rounding alone gives about 2e-3)\n",
              step, promote ? "block" : "none", nn ? " NN" : "", m, n, k,
              relative, nan_count);

  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  for (int i = 0; i < 3; ++i) launch(a_map, b_map, problem, promote);
  constexpr int kTimed = 20;
  CHECK_CUDA(cudaEventRecord(start));
  for (int i = 0; i < kTimed; ++i) launch(a_map, b_map, problem, promote);
  CHECK_CUDA(cudaEventRecord(stop));
  CHECK_CUDA(cudaEventSynchronize(stop));
  float ms = 0;
  CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
  const double seconds = ms / 1e3 / kTimed;
  std::printf("%s %s%s M=%d N=%d K=%d: %.1f us per call, %.1f TFLOP/s (CUDA "
              "events, mean of %d)\n",
              step, promote ? "block" : "none", nn ? " NN" : "", m, n, k,
              seconds * 1e6,
              2.0 * m * n * k / seconds / 1e12, kTimed);
  return (relative < 1e-2 && nan_count == 0) ? 0 : 2;
}

}  // namespace fp8_steps
