// The XLA FFI handlers: one exported symbol per kernel, each validating its
// buffers and then calling that kernel's launcher on XLA's CUDA stream.
// Python registers each symbol with jax.ffi.register_ffi_target.
//
// Kept apart from the kernels so that the heavy FFI headers are parsed once
// per build, not once per kernel file.
#include <cuda_runtime.h>

#include <optional>
#include <string>

#include "gemm_params.cuh"
#include "xla/ffi/api/ffi.h"

// Launchers (and workspace sizers) defined in the kernel files, one per
// entry of kernels.def.
#define PALLAS_GEMM_DECLARE_WORKSPACE_0(id)
#define PALLAS_GEMM_DECLARE_WORKSPACE_1(id) \
  size_t pallas_gemm_workspace_##id(const pallas_gemm::GemmParams& p);
#define PALLAS_GEMM_DECLARE(id, workspace)                                  \
  cudaError_t pallas_gemm_launch_##id(const pallas_gemm::GemmParams& p,     \
                                      cudaStream_t stream);                 \
  PALLAS_GEMM_DECLARE_WORKSPACE_##workspace(id)
#define PALLAS_GEMM_SGEMM(id, align, description) PALLAS_GEMM_DECLARE(id, 0)
#define PALLAS_GEMM_MMA(id, bm, bn, bk, warps, stages, pipelined, tma, \
                        workspace)                                     \
  PALLAS_GEMM_DECLARE(id, workspace)
#define PALLAS_GEMM_FP8(id, description)                                \
  cudaError_t pallas_gemm_launch_##id(const pallas_gemm::Fp8Params& p,  \
                                      cudaStream_t stream);
extern "C" {
#include "kernels.def"
}
#undef PALLAS_GEMM_DECLARE

namespace pallas_gemm {

// What the FFI handler checks before it calls a launcher.
struct KernelSpec {
  const char* name;
  int in_types_mask;   // bit (1 << ElementType)
  int out_types_mask;  // bit (1 << ElementType); c must match out
  bool out_f32_or_same_as_in;  // 16-bit kernels write f32 or their input type
  int align_k;         // k must be a multiple (vector loads along k)
  int align_n;         // n must be a multiple (vector loads/stores along n)
  LaunchFn launch;
  WorkspaceFn workspace = nullptr;  // scratch the launcher wants, if any
};


namespace ffi = ::xla::ffi;

inline bool ToElementType(ffi::DataType dtype, ElementType* out) {
  switch (dtype) {
    case ffi::DataType::F32: *out = ElementType::kF32; return true;
    case ffi::DataType::BF16: *out = ElementType::kBF16; return true;
    case ffi::DataType::F16: *out = ElementType::kF16; return true;
    default: return false;
  }
}

inline std::string ShapeString(const ffi::AnyBuffer& buffer) {
  std::string text = "(";
  auto dims = buffer.dimensions();
  for (size_t i = 0; i < dims.size(); ++i) {
    if (i) text += ", ";
    text += std::to_string(dims[i]);
  }
  return text + ")";
}

inline bool Aligned16(const void* pointer) {
  return (reinterpret_cast<uintptr_t>(pointer) & 15) == 0;
}

// Whether the (m, k), (k, n) and (m, n) matrices each index with int32.
inline bool FitsInt32Indexing(int64_t m, int64_t n, int64_t k) {
  constexpr int64_t kIntMax = 2147483647;
  return m * k <= kIntMax && k * n <= kIntMax && m * n <= kIntMax;
}

// A launcher's status as the handler's result.
inline ffi::Error LaunchResult(const std::string& who, cudaError_t status) {
  if (status != cudaSuccess) {
    return ffi::Error::Internal(who + "launch failed: " +
                                cudaGetErrorString(status));
  }
  return ffi::Error::Success();
}

// Validates every buffer and launches. Any mismatch becomes an ffi::Error
// naming the bad argument: a wrong call must never reach the kernel.
inline ffi::Error RunGemmFfi(const KernelSpec& spec, cudaStream_t stream,
                             ffi::ScratchAllocator& scratch,
                             ffi::AnyBuffer a, ffi::AnyBuffer b,
                             ffi::RemainingArgs extra,
                             ffi::Result<ffi::AnyBuffer> out, float alpha,
                             float beta) {
  const std::string who = std::string("pallas_gemm ffi/") + spec.name + ": ";
  auto invalid = [&](const std::string& message) {
    return ffi::Error::InvalidArgument(who + message);
  };
  if (a.dimensions().size() != 3 || b.dimensions().size() != 3 ||
      out->dimensions().size() != 3) {
    return invalid("a, b and out must be rank 3 (batch, rows, cols); got a" +
                   ShapeString(a) + ", b" + ShapeString(b) + ", out" +
                   ShapeString(*out));
  }
  if (extra.size() > 1) {
    return invalid("expected at most one extra operand (c), got " +
                   std::to_string(extra.size()));
  }
  const int64_t batch = a.dimensions()[0], m = a.dimensions()[1],
                k = a.dimensions()[2], n = b.dimensions()[2];
  if (b.dimensions()[0] != batch || b.dimensions()[1] != k) {
    return invalid("b" + ShapeString(b) + " does not match a" + ShapeString(a) +
                   ": b must be (batch, k, n)");
  }
  if (out->dimensions()[0] != batch || out->dimensions()[1] != m ||
      out->dimensions()[2] != n) {
    return invalid("out" + ShapeString(*out) + " must be (batch, m, n) = (" +
                   std::to_string(batch) + ", " + std::to_string(m) + ", " +
                   std::to_string(n) + ")");
  }
  ElementType a_type, b_type, out_type;
  if (!ToElementType(a.element_type(), &a_type) ||
      !ToElementType(b.element_type(), &b_type) || a_type != b_type ||
      !(spec.in_types_mask & Bit(a_type))) {
    return invalid("unsupported or mismatched input dtypes for a and b");
  }
  if (!ToElementType(out->element_type(), &out_type) ||
      !(spec.out_types_mask & Bit(out_type)) ||
      (spec.out_f32_or_same_as_in && out_type != ElementType::kF32 &&
       out_type != a_type)) {
    return invalid("unsupported output dtype for this input dtype");
  }
  const void* c_data = nullptr;
  if (extra.size() == 1) {
    auto c = extra.get<ffi::AnyBuffer>(0);
    if (!c.has_value()) return invalid("c must be a buffer");
    if (c->dimensions().size() != 3 || c->dimensions()[0] != batch ||
        c->dimensions()[1] != m || c->dimensions()[2] != n) {
      return invalid("c" + ShapeString(*c) + " must equal the output shape");
    }
    if (c->element_type() != out->element_type()) {
      return invalid("c must have the output dtype");
    }
    c_data = c->untyped_data();
    if (!Aligned16(c_data)) return invalid("c is not 16-byte aligned");
  }
  if (batch < 1 || batch > 65535) {
    return invalid("batch=" + std::to_string(batch) + " must be in [1, 65535]");
  }
  // Launchers put N tiles on grid y, which stops at 65535 blocks.
  if (n > 2000000) {
    return invalid("n=" + std::to_string(n) + " must be at most 2000000");
  }
  if (!FitsInt32Indexing(m, n, k)) {
    return invalid("each matrix must have fewer than 2^31 elements");
  }
  if (k % spec.align_k != 0 || n % spec.align_n != 0) {
    return invalid("k=" + std::to_string(k) + " must be a multiple of " +
                   std::to_string(spec.align_k) + " and n=" +
                   std::to_string(n) + " a multiple of " +
                   std::to_string(spec.align_n) +
                   " (the Python wrapper pads; call it through pallas_gemm)");
  }
  if (!Aligned16(a.untyped_data()) || !Aligned16(b.untyped_data()) ||
      !Aligned16(out->untyped_data())) {
    return invalid("a, b and out must be 16-byte aligned");
  }
  if (m == 0 || n == 0) return ffi::Error::Success();

  GemmParams params;
  params.a = a.untyped_data();
  params.b = b.untyped_data();
  params.c = c_data;
  params.out = out->untyped_data();
  params.batch = static_cast<int>(batch);
  params.m = static_cast<int>(m);
  params.n = static_cast<int>(n);
  params.k = static_cast<int>(k);
  params.alpha = alpha;
  params.beta = beta;
  params.in_type = a_type;
  params.out_type = out_type;
  if (spec.workspace != nullptr) {
    const size_t bytes = spec.workspace(params);
    if (bytes > 0) {
      // XLA's allocator, on this call's stream: freed when the call returns,
      // which is safe because later work on the stream runs after the kernel.
      // XLA's FFI accepts alignments up to 16; its allocations are 256-byte
      // aligned in practice, but 16 is all the kernels rely on.
      std::optional<void*> memory = scratch.Allocate(bytes, 16);
      if (!memory.has_value()) {
        return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                          who + "could not allocate a " +
                              std::to_string(bytes) + "-byte workspace");
      }
      params.workspace = *memory;
      params.workspace_bytes = bytes;
    }
  }
  return LaunchResult(who, spec.launch(params, stream));
}


using Fp8LaunchFn = cudaError_t (*)(const Fp8Params&, cudaStream_t);

// The fp8 kernels' handler: a (m, k) and b (k, n), each float8_e4m3fn or
// float8_e5m2, a_scale and b_scale one float32 each; out (m, n) bfloat16,
// or with k_splits > 1 the splits' scaled float32 partial sums
// (k_splits, m, n), which the caller adds. Every mismatch is an ffi::Error
// naming the argument, before anything is launched.
inline ffi::Error RunFp8Ffi(const char* name, Fp8LaunchFn launch,
                            cudaStream_t stream, ffi::AnyBuffer a,
                            ffi::AnyBuffer b, ffi::AnyBuffer a_scale,
                            ffi::AnyBuffer b_scale,
                            ffi::Result<ffi::AnyBuffer> out,
                            int32_t k_splits, int32_t tile_m) {
  const std::string who = std::string("pallas_gemm ffi/") + name + ": ";
  auto invalid = [&](const std::string& message) {
    return ffi::Error::InvalidArgument(who + message);
  };
  if (k_splits < 1) {
    return invalid("k_splits=" + std::to_string(k_splits) + " must be >= 1");
  }
  if (tile_m != 64 && tile_m != 256) {
    return invalid("tile_m=" + std::to_string(tile_m) + " must be 64 or 256");
  }
  const size_t out_rank = k_splits > 1 ? 3 : 2;
  if (a.dimensions().size() != 2 || b.dimensions().size() != 2 ||
      out->dimensions().size() != out_rank) {
    return invalid("a and b must be rank 2 and out rank " +
                   std::to_string(out_rank) + "; got a" + ShapeString(a) +
                   ", b" + ShapeString(b) + ", out" + ShapeString(*out));
  }
  const int64_t m = a.dimensions()[0], k = a.dimensions()[1],
                n = b.dimensions()[1];
  if (b.dimensions()[0] != k) {
    return invalid("b" + ShapeString(b) + " does not match a" +
                   ShapeString(a) + ": b must be (k, n)");
  }
  const auto out_dims = out->dimensions();
  if (out_dims[out_rank - 2] != m || out_dims[out_rank - 1] != n ||
      (k_splits > 1 && out_dims[0] != k_splits)) {
    return invalid("out" + ShapeString(*out) + " must be " +
                   (k_splits > 1 ? "(k_splits, m, n) = (" +
                                       std::to_string(k_splits) + ", "
                                 : std::string("(m, n) = (")) +
                   std::to_string(m) + ", " + std::to_string(n) + ")");
  }
  // Each split sums ceil(k_blocks / k_splits) 128-deep K blocks and none
  // may be left without any.
  const int64_t k_blocks = (k + 127) / 128;
  const int64_t share = (k_blocks + k_splits - 1) / k_splits;
  if (k_splits > 1 &&
      (k_blocks == 0 || (k_blocks + share - 1) / share != k_splits)) {
    return invalid("k_splits=" + std::to_string(k_splits) +
                   " does not cut k=" + std::to_string(k) +
                   " into that many non-empty shares of 128-deep blocks");
  }
  auto fp8 = [](ffi::DataType t) {
    return t == ffi::DataType::F8E4M3FN || t == ffi::DataType::F8E5M2;
  };
  if (!fp8(a.element_type()) || !fp8(b.element_type())) {
    return invalid("a and b must be float8_e4m3fn or float8_e5m2");
  }
  const ffi::DataType out_type =
      k_splits > 1 ? ffi::DataType::F32 : ffi::DataType::BF16;
  if (out->element_type() != out_type) {
    return invalid(k_splits > 1 ? "out must be float32 (partial sums)"
                                : "out must be bfloat16");
  }
  if (a_scale.element_type() != ffi::DataType::F32 ||
      a_scale.element_count() != 1 ||
      b_scale.element_type() != ffi::DataType::F32 ||
      b_scale.element_count() != 1) {
    return invalid("a_scale and b_scale must be one float32 each, got a_scale" +
                   ShapeString(a_scale) + ", b_scale" + ShapeString(b_scale));
  }
  if (!FitsInt32Indexing(m, n, k) || k_splits * m * n >= (int64_t(1) << 31)) {
    return invalid("each matrix must have fewer than 2^31 elements");
  }
  if (k % 16 != 0 || n % 16 != 0) {
    return invalid("k=" + std::to_string(k) + " and n=" + std::to_string(n) +
                   " must be multiples of 16 (TMA row strides are 16-byte "
                   "multiples)");
  }
  if (!Aligned16(a.untyped_data()) || !Aligned16(b.untyped_data()) ||
      !Aligned16(out->untyped_data())) {
    return invalid("a, b and out must be 16-byte aligned");
  }
  Fp8Params params;
  params.a = a.untyped_data();
  params.b = b.untyped_data();
  params.a_scale = static_cast<const float*>(a_scale.untyped_data());
  params.b_scale = static_cast<const float*>(b_scale.untyped_data());
  params.out = out->untyped_data();
  params.m = static_cast<int>(m);
  params.n = static_cast<int>(n);
  params.k = static_cast<int>(k);
  params.k_splits = k_splits;
  params.tile_m = tile_m;
  params.a_e5m2 = a.element_type() == ffi::DataType::F8E5M2;
  params.b_e5m2 = b.element_type() == ffi::DataType::F8E5M2;
  return LaunchResult(who, launch(params, stream));
}

}  // namespace pallas_gemm


// Defines the exported C symbol `Symbol`, an XLA FFI handler that runs `spec`
// on XLA's stream. Python registers it with jax.ffi.register_ffi_target.
#define PALLAS_GEMM_DEFINE_FFI_HANDLER(Symbol, spec)                         \
  static ::xla::ffi::Error Symbol##Impl(                                     \
      cudaStream_t stream, ::xla::ffi::ScratchAllocator scratch,             \
      ::xla::ffi::AnyBuffer a, ::xla::ffi::AnyBuffer b,                      \
      ::xla::ffi::RemainingArgs extra,                                       \
      ::xla::ffi::Result<::xla::ffi::AnyBuffer> out, float alpha,            \
      float beta) {                                                          \
    return ::pallas_gemm::RunGemmFfi(spec, stream, scratch, a, b, extra,     \
                                     out, alpha, beta);                      \
  }                                                                          \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(                                             \
      Symbol, Symbol##Impl,                                                  \
      ::xla::ffi::Ffi::Bind()                                                \
          .Ctx<::xla::ffi::PlatformStream<cudaStream_t>>()                   \
          .Ctx<::xla::ffi::ScratchAllocator>()                               \
          .Arg<::xla::ffi::AnyBuffer>()                                      \
          .Arg<::xla::ffi::AnyBuffer>()                                      \
          .RemainingArgs()                                                   \
          .Ret<::xla::ffi::AnyBuffer>()                                      \
          .Attr<float>("alpha")                                              \
          .Attr<float>("beta"))

// One handler per entry of kernels.def, exported as
// pallas_gemm_ffi_handler_<id> (build.py registers it as pallas_gemm_<id>).
#define PALLAS_GEMM_WORKSPACE_FN_0(id) nullptr
#define PALLAS_GEMM_WORKSPACE_FN_1(id) pallas_gemm_workspace_##id

// Every SIMT rung serves float32 in and out; k and n must be multiples of
// its vector width `align`.
#define PALLAS_GEMM_SGEMM(id, align, description)                          \
  PALLAS_GEMM_DEFINE_FFI_HANDLER(                                          \
      pallas_gemm_ffi_handler_##id,                                        \
      (::pallas_gemm::KernelSpec{                                          \
          #id, ::pallas_gemm::Bit(::pallas_gemm::ElementType::kF32),       \
          ::pallas_gemm::Bit(::pallas_gemm::ElementType::kF32), false,     \
          align, align, pallas_gemm_launch_##id}));

// Tensor-core kernels: fp16 or bf16 in; f32 or the input type out. k and n
// must be multiples of 8 (16-byte cp.async chunks); the wrapper pads.
#define PALLAS_GEMM_MMA(id, bm, bn, bk, warps, stages, pipelined, tma,     \
                        workspace)                                         \
  PALLAS_GEMM_DEFINE_FFI_HANDLER(                                          \
      pallas_gemm_ffi_handler_##id,                                        \
      (::pallas_gemm::KernelSpec{                                          \
          #id,                                                             \
          ::pallas_gemm::Bit(::pallas_gemm::ElementType::kBF16) |          \
              ::pallas_gemm::Bit(::pallas_gemm::ElementType::kF16),        \
          ::pallas_gemm::Bit(::pallas_gemm::ElementType::kF32) |           \
              ::pallas_gemm::Bit(::pallas_gemm::ElementType::kBF16) |      \
              ::pallas_gemm::Bit(::pallas_gemm::ElementType::kF16),        \
          true, 8, 8, pallas_gemm_launch_##id,                             \
          PALLAS_GEMM_WORKSPACE_FN_##workspace(id)}));

// fp8 kernels: their own operand list (RunFp8Ffi).
#define PALLAS_GEMM_FP8(id, description)                                     \
  static ::xla::ffi::Error pallas_gemm_ffi_handler_##id##Impl(               \
      cudaStream_t stream, ::xla::ffi::AnyBuffer a, ::xla::ffi::AnyBuffer b, \
      ::xla::ffi::AnyBuffer a_scale, ::xla::ffi::AnyBuffer b_scale,          \
      ::xla::ffi::Result<::xla::ffi::AnyBuffer> out, int32_t k_splits,       \
      int32_t tile_m) {                                                      \
    return ::pallas_gemm::RunFp8Ffi(#id, pallas_gemm_launch_##id, stream, a, \
                                    b, a_scale, b_scale, out, k_splits,      \
                                    tile_m);                                 \
  }                                                                          \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(                                             \
      pallas_gemm_ffi_handler_##id, pallas_gemm_ffi_handler_##id##Impl,      \
      ::xla::ffi::Ffi::Bind()                                                \
          .Ctx<::xla::ffi::PlatformStream<cudaStream_t>>()                   \
          .Arg<::xla::ffi::AnyBuffer>()                                      \
          .Arg<::xla::ffi::AnyBuffer>()                                      \
          .Arg<::xla::ffi::AnyBuffer>()                                      \
          .Arg<::xla::ffi::AnyBuffer>()                                      \
          .Ret<::xla::ffi::AnyBuffer>()                                      \
          .Attr<int32_t>("k_splits")                                         \
          .Attr<int32_t>("tile_m"));

#include "kernels.def"
