// The tuning sweep: times every registered candidate (csrc/sweep.cuh) and
// the shipped launchers at large square sizes, after checking each one.
//
//   ffi_sweep [--sizes 4096,8192] [--filter text] [--iters 20] [--json FILE]
//   ffi_sweep --ceiling
//
// Per size and input type: A and B are drawn from a normal distribution on
// the device. Each candidate runs once on a NaN-poisoned output, which must
// come back with no NaN left (every element written) and with 1024 sampled
// entries within tolerance of a float64 host reference; only then is it
// timed: 2 warm-up launches, then --iters launches each between two CUDA
// events, and the median is reported. A candidate that fails its check is
// reported FAILED and not timed. Exit status 1 if any check failed.
//
// --ceiling instead measures what mma.sync.m16n8k16 (bf16, f32 accumulate)
// can issue on this GPU with no memory traffic at all: every warp keeps a
// 64x64 (or 64x32) tile of accumulators and fragments in registers and
// issues independent mma.sync back to back, at 4 to 32 warps per SM. No
// GEMM built on mma.sync can beat the best of these rates.
//
// This program is for choosing what to ship; the numbers quoted as results
// come from gpu_check.py beside it (CUPTI, through JAX, against jnp.dot in
// the same process). programs.py builds it with the kernel sources compiled
// with -DPALLAS_GEMM_SWEEP, so their sweep-only candidates exist.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "gemm_params.cuh"
#include "host_check.cuh"
#include "mma_sync_common.cuh"
#include "sweep.cuh"

using pallas_gemm::ElementType;
using pallas_gemm::GemmParams;
using pallas_gemm::LaunchFn;

namespace pallas_gemm {
namespace sweep {
std::vector<Candidate>& Candidates() {
  static std::vector<Candidate> candidates;
  return candidates;
}
}  // namespace sweep
}  // namespace pallas_gemm

// The launchers of every kernel in kernels.def (linked from the kernel
// objects), declared from the list.
#define PALLAS_GEMM_SGEMM(id, align, description) \
  cudaError_t pallas_gemm_launch_##id(const GemmParams&, cudaStream_t);
#define PALLAS_GEMM_MMA(id, bm, bn, bk, warps, stages, pipelined, tma,  \
                        workspace)                                      \
  cudaError_t pallas_gemm_launch_##id(const GemmParams&, cudaStream_t);
extern "C" {
#include "kernels.def"
}

namespace {

__device__ uint32_t Hash(uint64_t x) {
  x ^= x >> 33; x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33; x *= 0xc4ceb9fe1a85ec53ULL;
  x ^= x >> 33;
  return static_cast<uint32_t>(x);
}

// Standard normal values (Box-Muller on two hashed uniforms), stored as T.
template <typename T>
__global__ void FillNormal(T* out, size_t count, uint64_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < count;
       i += size_t(gridDim.x) * blockDim.x) {
    const float u1 = (Hash(seed * 0x9E3779B97F4A7C15ULL + 2 * i) + 1.0f) *
                     2.3283064e-10f;  // (0, 1]
    const float u2 = Hash(seed * 0x9E3779B97F4A7C15ULL + 2 * i + 1) *
                     2.3283064e-10f;
    const float z = sqrtf(-2.f * logf(u1)) * cospif(2.f * u2);
    out[i] = static_cast<T>(z);
  }
}

template <typename T>
__global__ void CountNan(const T* values, size_t count,
                         unsigned long long* nans) {
  unsigned long long local = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < count;
       i += size_t(gridDim.x) * blockDim.x) {
    local += isnan(static_cast<float>(values[i])) ? 1 : 0;
  }
  if (local) atomicAdd(nans, local);
}

float BitsToFloat(const unsigned char* p, ElementType t) {
  if (t == ElementType::kF32) {
    float x;
    std::memcpy(&x, p, 4);
    return x;
  }
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return pallas_gemm::FromBits(bits, t);
}

struct Problem {
  int size;
  ElementType in_type, out_type;
  void* a;
  void* b;
  void* out;
  std::vector<unsigned char> a_host, b_host;
  size_t in_width, out_width;
};

Problem MakeProblem(int size, ElementType in_type, uint64_t seed) {
  Problem p;
  p.size = size;
  p.in_type = in_type;
  // Tensor-core candidates write bf16, as the benchmarks do; SIMT writes f32.
  p.out_type = in_type;
  p.in_width = in_type == ElementType::kF32 ? 4 : 2;
  p.out_width = p.in_width;
  const size_t count = size_t(size) * size;
  CHECK_CUDA(cudaMalloc(&p.a, count * p.in_width));
  CHECK_CUDA(cudaMalloc(&p.b, count * p.in_width));
  CHECK_CUDA(cudaMalloc(&p.out, count * p.out_width));
  void* operands[2] = {p.a, p.b};
  for (int i = 0; i < 2; ++i) {
    if (in_type == ElementType::kF32) {
      FillNormal<<<1024, 256>>>(static_cast<float*>(operands[i]), count,
                                seed + i);
    } else {
      FillNormal<<<1024, 256>>>(static_cast<__nv_bfloat16*>(operands[i]),
                                count, seed + i);
    }
    CHECK_CUDA(cudaGetLastError());
  }
  p.a_host.resize(count * p.in_width);
  p.b_host.resize(count * p.in_width);
  CHECK_CUDA(cudaMemcpy(p.a_host.data(), p.a, p.a_host.size(),
                        cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(p.b_host.data(), p.b, p.b_host.size(),
                        cudaMemcpyDeviceToHost));
  return p;
}

void FreeProblem(Problem& p) {
  CHECK_CUDA(cudaFree(p.a));
  CHECK_CUDA(cudaFree(p.b));
  CHECK_CUDA(cudaFree(p.out));
}

// Returns the relative error over sampled entries, or NaN when an element
// was left unwritten (poison survived) or the launch failed.
double Check(const Problem& p, LaunchFn launch, const GemmParams& params) {
  const size_t count = size_t(p.size) * p.size;
  CHECK_CUDA(cudaMemset(p.out, 0xFF, count * p.out_width));  // NaN
  if (launch(params, nullptr) != cudaSuccess) return NAN;
  if (cudaDeviceSynchronize() != cudaSuccess) {
    std::fprintf(stderr, "kernel failed: %s\n",
                 cudaGetErrorString(cudaGetLastError()));
    std::exit(2);
  }
  unsigned long long* nans;
  CHECK_CUDA(cudaMalloc(&nans, sizeof(*nans)));
  CHECK_CUDA(cudaMemset(nans, 0, sizeof(*nans)));
  if (p.out_type == ElementType::kF32) {
    CountNan<<<1024, 256>>>(static_cast<const float*>(p.out), count, nans);
  } else {
    CountNan<<<1024, 256>>>(static_cast<const __nv_bfloat16*>(p.out), count,
                            nans);
  }
  unsigned long long nan_count = 0;
  CHECK_CUDA(cudaMemcpy(&nan_count, nans, sizeof(nan_count),
                        cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaFree(nans));
  if (nan_count) return NAN;

  unsigned seed = 97u + p.size;
  double error = 0, norm = 0;
  for (int sample = 0; sample < 1024; ++sample) {
    const int i = rand_r(&seed) % p.size, j = rand_r(&seed) % p.size;
    double ref = 0;
    for (int kk = 0; kk < p.size; ++kk) {
      ref += double(BitsToFloat(&p.a_host[(size_t(i) * p.size + kk) * p.in_width],
                                p.in_type)) *
             BitsToFloat(&p.b_host[(size_t(kk) * p.size + j) * p.in_width],
                         p.in_type);
    }
    unsigned char got_bits[4];
    CHECK_CUDA(cudaMemcpy(got_bits,
                          static_cast<unsigned char*>(p.out) +
                              (size_t(i) * p.size + j) * p.out_width,
                          p.out_width, cudaMemcpyDeviceToHost));
    const double got = BitsToFloat(got_bits, p.out_type);
    error += (got - ref) * (got - ref);
    norm += ref * ref;
  }
  return std::sqrt(error / norm);
}

// Registers only: kTilesN independent accumulators per row of kTilesM, as
// in a kTilesM*16 x kTilesN*8 warp tile; the fragments change a little each
// round so the compiler cannot fold the loop.
template <int kTilesM, int kTilesN>
__global__ void MmaSyncCeiling(int rounds, float* sink) {
  uint32_t a[kTilesM][4], b[kTilesN][2];
#pragma unroll
  for (int i = 0; i < kTilesM; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) a[i][j] = 0x3c003c00u ^ (threadIdx.x + i + j);
#pragma unroll
  for (int i = 0; i < kTilesN; ++i)
#pragma unroll
    for (int j = 0; j < 2; ++j) b[i][j] = 0x3c003c00u ^ (threadIdx.x * 3 + i + j);
  float acc[kTilesM][kTilesN][4] = {};
  for (int round = 0; round < rounds; ++round) {
#pragma unroll
    for (int mi = 0; mi < kTilesM; ++mi)
#pragma unroll
      for (int ni = 0; ni < kTilesN; ++ni)
        pallas_gemm::mma_sync::Mma<__nv_bfloat16>::Run(acc[mi][ni], a[mi],
                                                       b[ni]);
    a[0][0] ^= 1u;
  }
  float total = 0.f;
#pragma unroll
  for (int mi = 0; mi < kTilesM; ++mi)
#pragma unroll
    for (int ni = 0; ni < kTilesN; ++ni)
#pragma unroll
      for (int e = 0; e < 4; ++e) total += acc[mi][ni][e];
  if (total == 1234.5f) sink[threadIdx.x] = total;  // keeps the work alive
}

template <int kTilesM, int kTilesN>
void RunCeiling(const char* label, int warps_per_block, int blocks_per_sm,
                int num_sms, float* sink) {
  const int rounds = 4096;
  const int blocks = num_sms * blocks_per_sm;
  auto kernel = MmaSyncCeiling<kTilesM, kTilesN>;
  kernel<<<blocks, 32 * warps_per_block>>>(rounds, sink);  // warm-up
  CHECK_CUDA(cudaGetLastError());
  CHECK_CUDA(cudaDeviceSynchronize());
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  std::vector<float> times;
  for (int i = 0; i < 10; ++i) {
    CHECK_CUDA(cudaEventRecord(start));
    kernel<<<blocks, 32 * warps_per_block>>>(rounds, sink);
    CHECK_CUDA(cudaEventRecord(stop));
    CHECK_CUDA(cudaEventSynchronize(stop));
    float ms;
    CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
    times.push_back(ms);
  }
  std::sort(times.begin(), times.end());
  const double flops = 2.0 * 16 * 8 * 16 * kTilesM * kTilesN * double(rounds) *
                       warps_per_block * 32 / 32 * blocks;
  std::printf("%-44s %3d warps/SM %9.3f ms %8.1f TFLOP/s\n", label,
              warps_per_block * blocks_per_sm, times[5],
              flops / times[5] / 1e9);
}

float MedianMs(LaunchFn launch, const GemmParams& params, int iters) {
  for (int i = 0; i < 2; ++i) CHECK_CUDA(launch(params, nullptr));
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  std::vector<float> times;
  for (int i = 0; i < iters; ++i) {
    CHECK_CUDA(cudaEventRecord(start));
    CHECK_CUDA(launch(params, nullptr));
    CHECK_CUDA(cudaEventRecord(stop));
    CHECK_CUDA(cudaEventSynchronize(stop));
    float ms;
    CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
    times.push_back(ms);
  }
  CHECK_CUDA(cudaEventDestroy(start));
  CHECK_CUDA(cudaEventDestroy(stop));
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

std::vector<int> ParseSizes(const char* text) {
  std::vector<int> sizes;
  for (const char* p = text; *p;) {
    sizes.push_back(std::atoi(p));
    const char* comma = std::strchr(p, ',');
    if (!comma) break;
    p = comma + 1;
  }
  return sizes;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int> sizes = {4096, 8192};
  const char* filter = nullptr;
  const char* json_path = nullptr;
  int iters = 20;
  bool ceiling = false;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const bool has_value = i + 1 < argc;
    if (arg == "--ceiling") ceiling = true;
    else if (arg == "--sizes" && has_value) sizes = ParseSizes(argv[++i]);
    else if (arg == "--filter" && has_value) filter = argv[++i];
    else if (arg == "--iters" && has_value) iters = std::atoi(argv[++i]);
    else if (arg == "--json" && has_value) json_path = argv[++i];
    else {
      std::fprintf(stderr, "unknown or incomplete argument: %s\n", argv[i]);
      return 2;
    }
  }
  if (ceiling) {
    cudaDeviceProp props;
    CHECK_CUDA(cudaGetDeviceProperties(&props, 0));
    float* sink;
    CHECK_CUDA(cudaMalloc(&sink, 1024 * sizeof(float)));
    std::printf("mma.sync.m16n8k16 bf16 issue ceiling on %s (%d SMs)\n",
                props.name, props.multiProcessorCount);
    const int sms = props.multiProcessorCount;
    RunCeiling<4, 8>("64x64 warp tile, 8 warps a block", 8, 1, sms, sink);
    RunCeiling<4, 8>("64x64 warp tile, 4 warps a block", 4, 1, sms, sink);
    RunCeiling<4, 8>("64x64 warp tile, 4 warps a block, 2/SM", 4, 2, sms, sink);
    RunCeiling<4, 4>("64x32 warp tile, 16 warps a block", 16, 1, sms, sink);
    RunCeiling<4, 4>("64x32 warp tile, 8 warps a block, 2/SM", 8, 2, sms, sink);
    RunCeiling<4, 4>("64x32 warp tile, 8 warps a block, 4/SM", 8, 4, sms, sink);
    RunCeiling<2, 4>("32x32 warp tile, 8 warps a block, 4/SM", 8, 4, sms, sink);
    CHECK_CUDA(cudaFree(sink));
    return 0;
  }
  using pallas_gemm::sweep::Candidate;
  // Every shipped kernel of kernels.def but the scalar-load SIMT rungs
  // (align 1), which take seconds a launch at these sizes and are far from
  // anything a candidate explores; the sweep-only candidates follow.
  std::vector<Candidate> candidates;
#define PALLAS_GEMM_SGEMM(id, align, description)                       \
  if (align > 1) {                                                      \
    candidates.push_back(                                               \
        {"shipped " #id, pallas_gemm_launch_##id, ElementType::kF32});  \
  }
#define PALLAS_GEMM_MMA(id, bm, bn, bk, warps, stages, pipelined, tma,  \
                        workspace)                                      \
  candidates.push_back(                                                 \
      {"shipped " #id, pallas_gemm_launch_##id, ElementType::kBF16});
#include "kernels.def"
  for (const Candidate& c : pallas_gemm::sweep::Candidates()) {
    candidates.push_back(c);
  }
  FILE* json = json_path ? std::fopen(json_path, "w") : nullptr;
  if (json) std::fprintf(json, "[\n");
  bool first_row = true, all_ok = true;
  cudaDeviceProp props;
  CHECK_CUDA(cudaGetDeviceProperties(&props, 0));
  std::printf("device: %s, %d SMs\n", props.name, props.multiProcessorCount);
  std::printf("%-48s %6s %9s %8s %10s\n", "candidate", "size", "ms",
              "TFLOP/s", "rel_err");
  constexpr size_t kWorkspaceBytes = size_t(256) << 20;
  void* workspace = nullptr;
  CHECK_CUDA(cudaMalloc(&workspace, kWorkspaceBytes));
  for (ElementType in_type : {ElementType::kF32, ElementType::kBF16}) {
    for (int size : sizes) {
      bool any = false;
      for (const Candidate& c : candidates) {
        any |= c.in_type == in_type &&
               (!filter || std::strstr(c.name, filter));
      }
      if (!any) continue;
      Problem problem = MakeProblem(size, in_type, 1000 + size);
      GemmParams params{};
      params.a = problem.a;
      params.b = problem.b;
      params.c = nullptr;
      params.out = problem.out;
      params.batch = 1;
      params.m = params.n = params.k = size;
      params.alpha = 1.f;
      params.beta = 0.f;
      params.in_type = problem.in_type;
      params.out_type = problem.out_type;
      // Shared by every candidate; those with a stream-K tail use it when
      // it is large enough and launch their plain grid otherwise.
      params.workspace = workspace;
      params.workspace_bytes = kWorkspaceBytes;
      const double tolerance = in_type == ElementType::kF32 ? 1e-5 : 1e-2;
      for (const Candidate& c : candidates) {
        if (c.in_type != in_type) continue;
        if (filter && !std::strstr(c.name, filter)) continue;
        const double error = Check(problem, c.launch, params);
        const bool ok = std::isfinite(error) && error <= tolerance;
        float ms = NAN;
        if (ok) ms = MedianMs(c.launch, params, iters);
        all_ok &= ok;
        const double tflops = 2.0 * size * size * double(size) / ms / 1e9;
        std::printf("%-48s %6d %9.3f %8.1f %10.2e%s\n", c.name, size, ms,
                    ok ? tflops : 0.0, error, ok ? "" : "  FAILED");
        std::fflush(stdout);
        if (json) {
          std::fprintf(json,
                       "%s  {\"candidate\": \"%s\", \"size\": %d, "
                       "\"median_ms\": %s, \"tflops\": %.2f, "
                       "\"rel_err\": %.3e, \"ok\": %s}",
                       first_row ? "" : ",\n", c.name, size,
                       ok ? std::to_string(ms).c_str() : "null",
                       ok ? tflops : 0.0, std::isfinite(error) ? error : -1.0,
                       ok ? "true" : "false");
          first_row = false;
        }
      }
      FreeProblem(problem);
    }
  }
  CHECK_CUDA(cudaFree(workspace));
  if (json) {
    std::fprintf(json, "\n]\n");
    std::fclose(json);
  }
  return all_ok ? 0 : 1;
}
