"""pallas_gemm: GEMM kernels for JAX, from a teaching ladder to production.

    import pallas_gemm
    out = pallas_gemm.matmul(a, b)                    # automatic kernel choice
    out = pallas_gemm.matmul(a, b, kernel="triton/02_k_loop")
    pallas_gemm.list_kernels()                        # every registered kernel
"""

import importlib as _importlib
import warnings as _warnings

from pallas_gemm import xla_backend  # noqa: F401  (registers "xla")
from pallas_gemm.api import dot_general, matmul
from pallas_gemm.devices import DeviceInfo, device_info
from pallas_gemm.dispatch import Resolution, resolve
from pallas_gemm.explain import Explanation, explain
from pallas_gemm.fp8 import dequantize_fp8, quantize_fp8
from pallas_gemm.jaxpr_tools import primitive_counts
from pallas_gemm.primitive import pallas_gemm_p
from pallas_gemm.problem import ACTIVATIONS, Epilogue, GemmProblem
from pallas_gemm.ragged_dot import ragged_dot, ragged_dot_general
from pallas_gemm.registry import get_kernel, list_kernels, select_kernel

# Backends register their kernels on import. One that fails to import (a
# missing optional dependency, a JAX without Mosaic GPU) must not take the
# others down: its error is kept, warned about, and shown by backend_errors().
_BACKENDS = ("pallas_gemm.triton_backend", "pallas_gemm.mosaic_backend",
             "pallas_gemm.ffi")
_BACKEND_ERRORS: dict[str, str] = {}
for _name in _BACKENDS:
  try:
    _importlib.import_module(_name)
  except Exception as _e:  # noqa: BLE001 - reported, not swallowed
    _BACKEND_ERRORS[_name] = f"{type(_e).__name__}: {_e}"
    _warnings.warn(f"pallas_gemm: backend {_name} failed to import: {_e}",
                   RuntimeWarning, stacklevel=2)


def backend_errors() -> dict[str, str]:
  """Backends that failed to import, with their errors (empty when all load)."""
  return dict(_BACKEND_ERRORS)


from pallas_gemm.triton_backend.common import TritonConfig  # noqa: E402
try:  # needs Mosaic GPU, as the backend above does
  from pallas_gemm.gated_linear_unit import (GluConfig,  # noqa: E402
                                             gated_linear_unit)
except Exception as _e:  # noqa: BLE001 - reported, not swallowed
  _BACKEND_ERRORS["pallas_gemm.gated_linear_unit"] = f"{type(_e).__name__}: {_e}"
  _warnings.warn(f"pallas_gemm: gated_linear_unit failed to import: {_e}",
                 RuntimeWarning, stacklevel=2)

__version__ = "0.1.0"

__all__ = [
    "ACTIVATIONS", "DeviceInfo", "Epilogue", "Explanation", "GemmProblem",
    "GluConfig", "Resolution", "TritonConfig", "backend_errors",
    "dequantize_fp8", "device_info", "dot_general", "explain",
    "gated_linear_unit", "get_kernel", "list_kernels", "matmul",
    "pallas_gemm_p", "primitive_counts", "quantize_fp8", "ragged_dot",
    "ragged_dot_general", "resolve", "select_kernel",
]
