"""Raw CUDA GEMM kernels bridged to JAX with jax.ffi (`ffi/*` in the registry).

    ffi/sgemm_01_naive ... ffi/sgemm_10_pipelined  exact fp32 SIMT ladder
    ffi/mma_sync                                   fp16/bf16 tensor cores
    ffi/fp8_nn                                     fp8, B stored (k, n), Hopper

csrc/kernels.def lists every kernel once; the FFI handlers, this package's
registry entries and the developer drivers are expanded from it. The CUDA
sources in csrc/ are compiled with nvcc the first time one of these kernels
is lowered (or ahead of time with `python -m pallas_gemm.ffi build`);
importing this package compiles nothing and needs neither nvcc nor a GPU.
See toolchain.py for where nvcc comes from, build.py for the cache and
environment switches, kernels.py for what each wrapper does around the FFI
call.
"""

from pallas_gemm.ffi import fp8  # noqa: F401  (registers ffi/fp8_nn)
from pallas_gemm.ffi import kernels  # noqa: F401  (registers ffi/*)
from pallas_gemm.ffi.build import (BuildError, NvccNotFoundError,
                                   compile_library, find_nvcc, load_library)
from pallas_gemm.ffi.kernels import MmaSyncConfig

__all__ = ["BuildError", "MmaSyncConfig", "NvccNotFoundError",
           "compile_library", "find_nvcc", "load_library"]
