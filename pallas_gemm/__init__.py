"""pallas_gemm: GEMM kernels for JAX, from a teaching ladder to production.

    import pallas_gemm
    out = pallas_gemm.matmul(a, b)                    # automatic kernel choice
    out = pallas_gemm.matmul(a, b, kernel="triton/02_k_loop")
    pallas_gemm.list_kernels()                        # every registered kernel
"""

from pallas_gemm import xla_backend  # noqa: F401  (registers "xla")
from pallas_gemm import triton_backend  # noqa: F401
from pallas_gemm.api import dot_general, matmul
from pallas_gemm.devices import DeviceInfo, device_info
from pallas_gemm.primitive import pallas_gemm_p
from pallas_gemm.problem import ACTIVATIONS, Epilogue, GemmProblem
from pallas_gemm.registry import get_kernel, list_kernels, select_kernel
from pallas_gemm.triton_backend.common import TritonConfig

__version__ = "0.1.0"

__all__ = [
    "ACTIVATIONS", "DeviceInfo", "Epilogue", "GemmProblem", "TritonConfig",
    "device_info", "dot_general", "get_kernel", "list_kernels", "matmul",
    "pallas_gemm_p", "select_kernel",
]
