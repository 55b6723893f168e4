// A standalone program that runs every kernel launcher once on small ragged
// shapes (partial tiles in M, N and K, batch 2, with and without beta * C)
// and checks it against a double-precision CPU reference. It exists so that
// compute-sanitizer (memcheck, racecheck) sees only our kernels instead of a
// whole JAX process. Exit status 0 means every check passed.
#include <cstdio>
#include <cstdlib>
#include <cmath>
#include <cstring>
#include <vector>

#include "gemm_params.cuh"  // from pallas_gemm/ffi/csrc
#include "host_check.cuh"

using pallas_gemm::ElementType;
using pallas_gemm::FromBits;
using pallas_gemm::GemmParams;
using pallas_gemm::LaunchFn;
using pallas_gemm::WorkspaceFn;

// The launchers of every kernel in kernels.def (linked from the kernel
// objects), declared from the list.
#define DECLARE_WORKSPACE_0(id)
#define DECLARE_WORKSPACE_1(id) size_t pallas_gemm_workspace_##id(const GemmParams&);
#define PALLAS_GEMM_SGEMM(id, align, description) \
  cudaError_t pallas_gemm_launch_##id(const GemmParams&, cudaStream_t);
#define PALLAS_GEMM_MMA(id, bm, bn, bk, warps, stages, pipelined, tma,       \
                        workspace)                                           \
  cudaError_t pallas_gemm_launch_##id(const GemmParams&, cudaStream_t);      \
  DECLARE_WORKSPACE_##workspace(id)
extern "C" {
#include "kernels.def"
}

namespace {

size_t ByteWidth(ElementType t) { return t == ElementType::kF32 ? 4 : 2; }

// Host-side conversions, so the driver needs no device intrinsics here.
uint16_t ToBits(float x, ElementType t) {
  if (t == ElementType::kBF16) {
    uint32_t bits;
    std::memcpy(&bits, &x, 4);
    bits += 0x7FFF + ((bits >> 16) & 1);  // round to nearest even
    return static_cast<uint16_t>(bits >> 16);
  }
  __half h = __float2half_rn(x);
  uint16_t bits;
  std::memcpy(&bits, &h, 2);
  return bits;
}


// Values rounded to `t`, kept both as the bytes to upload and as floats.
struct HostArray {
  std::vector<unsigned char> bytes;
  std::vector<float> values;
};

HostArray Random(size_t count, ElementType t, unsigned* seed) {
  HostArray array;
  array.bytes.resize(count * ByteWidth(t));
  array.values.resize(count);
  for (size_t i = 0; i < count; ++i) {
    // Sum of uniforms: roughly normal, never all zeros.
    float x = 0.f;
    for (int j = 0; j < 4; ++j) x += (rand_r(seed) / float(RAND_MAX)) - 0.5f;
    if (t == ElementType::kF32) {
      std::memcpy(&array.bytes[4 * i], &x, 4);
      array.values[i] = x;
    } else {
      const uint16_t bits = ToBits(x, t);
      std::memcpy(&array.bytes[2 * i], &bits, 2);
      array.values[i] = FromBits(bits, t);
    }
  }
  return array;
}

void* Upload(const std::vector<unsigned char>& bytes) {
  void* device = nullptr;
  CHECK_CUDA(cudaMalloc(&device, bytes.size()));
  CHECK_CUDA(cudaMemcpy(device, bytes.data(), bytes.size(),
                        cudaMemcpyHostToDevice));
  return device;
}

bool RunCase(const char* name, LaunchFn launch, WorkspaceFn workspace,
             int batch, int m, int n, int k, ElementType in_type,
             ElementType out_type, bool with_c, unsigned seed) {
  const float alpha = 0.75f, beta = with_c ? -0.5f : 0.f;
  HostArray a = Random(size_t(batch) * m * k, in_type, &seed);
  HostArray b = Random(size_t(batch) * k * n, in_type, &seed);
  HostArray c = Random(size_t(batch) * m * n, out_type, &seed);
  const size_t out_bytes = size_t(batch) * m * n * ByteWidth(out_type);
  GemmParams p;
  p.a = Upload(a.bytes);
  p.b = Upload(b.bytes);
  p.c = with_c ? Upload(c.bytes) : nullptr;
  CHECK_CUDA(cudaMalloc(&p.out, out_bytes));
  CHECK_CUDA(cudaMemset(p.out, 0xFF, out_bytes));  // NaN everywhere
  p.batch = batch; p.m = m; p.n = n; p.k = k;
  p.alpha = alpha; p.beta = beta;
  p.in_type = in_type; p.out_type = out_type;
  const size_t workspace_bytes = workspace ? workspace(p) : 0;
  if (workspace_bytes > 0) {
    // Poisoned too: a share that read a slot nobody wrote would show NaN.
    CHECK_CUDA(cudaMalloc(&p.workspace, workspace_bytes));
    CHECK_CUDA(cudaMemset(p.workspace, 0xFF, workspace_bytes));
    p.workspace_bytes = workspace_bytes;
  }
  CHECK_CUDA(launch(p, nullptr));
  CHECK_CUDA(cudaDeviceSynchronize());
  std::vector<unsigned char> out(out_bytes);
  CHECK_CUDA(cudaMemcpy(out.data(), p.out, out_bytes, cudaMemcpyDeviceToHost));

  double error = 0, norm = 0;
  for (int bi = 0; bi < batch; ++bi) {
    for (int i = 0; i < m; ++i) {
      for (int j = 0; j < n; ++j) {
        double ref = 0;
        for (int kk = 0; kk < k; ++kk) {
          ref += double(a.values[(size_t(bi) * m + i) * k + kk]) *
                 b.values[(size_t(bi) * k + kk) * n + j];
        }
        const size_t index = (size_t(bi) * m + i) * n + j;
        ref = alpha * ref + (with_c ? beta * c.values[index] : 0.0);
        float got;
        if (out_type == ElementType::kF32) {
          std::memcpy(&got, &out[4 * index], 4);
        } else {
          uint16_t bits;
          std::memcpy(&bits, &out[2 * index], 2);
          got = FromBits(bits, out_type);
        }
        error += (got - ref) * (got - ref);
        norm += ref * ref;
      }
    }
  }
  const double relative = std::sqrt(error / norm);
  const double tolerance = out_type == ElementType::kF32
      ? (in_type == ElementType::kF32 ? 1e-5 : 1e-4) : 1e-2;
  const bool ok = std::isfinite(relative) && relative <= tolerance;
  std::printf("%-26s batch=%d m=%d n=%d k=%d in=%d out=%d c=%d ws=%zu  rel_err=%.3e  %s\n",
              name, batch, m, n, k, int(in_type), int(out_type), int(with_c),
              workspace_bytes, relative, ok ? "ok" : "FAIL");
  CHECK_CUDA(cudaFree(const_cast<void*>(p.a)));
  CHECK_CUDA(cudaFree(const_cast<void*>(p.b)));
  if (p.c) CHECK_CUDA(cudaFree(const_cast<void*>(p.c)));
  CHECK_CUDA(cudaFree(p.out));
  if (p.workspace) CHECK_CUDA(cudaFree(p.workspace));
  return ok;
}

}  // namespace

int main(int argc, char** argv) {
  // Optional argument: run only kernels whose name contains it.
  const char* only = argc > 1 ? argv[1] : nullptr;
  struct Kernel {
    const char* name; LaunchFn launch; bool tensor_core; int align;
    WorkspaceFn workspace = nullptr;
  };
#define WORKSPACE_FN_0(id) nullptr
#define WORKSPACE_FN_1(id) pallas_gemm_workspace_##id
#define PALLAS_GEMM_SGEMM(id, align, description) \
  {#id, pallas_gemm_launch_##id, false, align},
#define PALLAS_GEMM_MMA(id, bm, bn, bk, warps, stages, pipelined, tma,  \
                        workspace)                                      \
  {#id, pallas_gemm_launch_##id, true, 8, WORKSPACE_FN_##workspace(id)},
  const Kernel kernels[] = {
#include "kernels.def"
  };
  bool all_ok = true;
  unsigned seed = 1234;
  for (const Kernel& kernel : kernels) {
    if (only && !std::strstr(kernel.name, only)) continue;
    // Partial tiles everywhere: m past one 128-row block, n and k ragged up
    // to the kernel's alignment.
    const int m = 131;
    const int n = kernel.align == 1 ? 67 : (kernel.align == 4 ? 68 : 264);
    // Tensor-core kernels get enough K tiles to wrap their stage ring.
    const int k = kernel.align == 1 ? 45 : (kernel.align == 4 ? 44 : 200);
    if (!kernel.tensor_core) {
      for (bool with_c : {false, true}) {
        all_ok &= RunCase(kernel.name, kernel.launch, kernel.workspace, 2, m, n, k,
                          ElementType::kF32, ElementType::kF32, with_c, ++seed);
      }
      all_ok &= RunCase(kernel.name, kernel.launch, kernel.workspace, 1, 1, n, k,
                        ElementType::kF32, ElementType::kF32, false, ++seed);
    } else {
      all_ok &= RunCase(kernel.name, kernel.launch, kernel.workspace, 2, m, n, k,
                        ElementType::kBF16, ElementType::kF32, false, ++seed);
      all_ok &= RunCase(kernel.name, kernel.launch, kernel.workspace, 2, m, n, k,
                        ElementType::kBF16, ElementType::kBF16, true, ++seed);
      all_ok &= RunCase(kernel.name, kernel.launch, kernel.workspace, 1, 1, 8, 8,
                        ElementType::kF16, ElementType::kF16, true, ++seed);
      all_ok &= RunCase(kernel.name, kernel.launch, kernel.workspace, 1, 17, n, k,
                        ElementType::kF16, ElementType::kF32, true, ++seed);
      // Unbatched, 6-15 output tiles of 32-63 K tiles: far fewer tiles than
      // SMs, so the one-block-per-SM pipelined kernels share them out
      // stream-K (their lines report ws > 0, the workspace they got).
      all_ok &= RunCase(kernel.name, kernel.launch, kernel.workspace, 1, 300,
                        520, 2000, ElementType::kBF16, ElementType::kBF16,
                        true, ++seed);
    }
  }
  std::printf(all_ok ? "ALL OK\n" : "SOME CHECKS FAILED\n");
  return all_ok ? 0 : 1;
}
