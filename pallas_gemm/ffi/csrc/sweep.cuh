// Candidates for the tuning sweep (experiments/lab/ffi/sweep_driver.cu,
// built by experiments/lab/ffi/programs.py). A kernel file names extra
// instantiations with PALLAS_GEMM_SWEEP_CANDIDATE; they are compiled only
// into the sweep program (built with -DPALLAS_GEMM_SWEEP), never into the
// FFI library, so exploring a tile shape costs the library neither build
// time nor size.
#pragma once

#include "gemm_params.cuh"

#ifdef PALLAS_GEMM_SWEEP
#include <vector>

namespace pallas_gemm {
namespace sweep {

struct Candidate {
  const char* name;
  LaunchFn launch;
  ElementType in_type;  // kF32 (SIMT, exact) or kBF16 (tensor cores)
};

// Defined in sweep_driver.cu; a function-local static, so registration from
// other translation units' static initialisers is order-safe.
std::vector<Candidate>& Candidates();

struct Registrar {
  Registrar(const char* name, LaunchFn launch, ElementType in_type) {
    Candidates().push_back({name, launch, in_type});
  }
};

}  // namespace sweep
}  // namespace pallas_gemm

#define PALLAS_GEMM_SWEEP_CANDIDATE(id, name, in_type, launch)          \
  static ::pallas_gemm::sweep::Registrar pallas_gemm_sweep_##id(        \
      name, launch, in_type);
#else
#define PALLAS_GEMM_SWEEP_CANDIDATE(id, name, in_type, launch)
#endif
