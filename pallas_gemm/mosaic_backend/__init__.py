"""Mosaic GPU (Hopper) backend: wgmma, TMA, warp specialisation.

Importing this package registers `mosaic/ws_persistent`, `mosaic/small_m`,
`mosaic/split_k` and `mosaic/fp8`.
Nothing here needs a GPU at import time; Mosaic lowers only when a kernel is
compiled for a CUDA device (on a CPU the kernels run in GPU interpret mode).
"""

from pallas_gemm.mosaic_backend import ws_persistent  # noqa: F401
from pallas_gemm.mosaic_backend import small_m  # noqa: F401
from pallas_gemm.mosaic_backend import split_k  # noqa: F401
from pallas_gemm.mosaic_backend import fp8  # noqa: F401
from pallas_gemm.mosaic_backend.config import (Dim, MosaicConfig,
                                               SmallMConfig, SplitKConfig)

__all__ = ["Dim", "MosaicConfig", "SmallMConfig", "SplitKConfig"]
