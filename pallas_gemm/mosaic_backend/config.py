"""The names kernel code imports from one place, re-exported.

The Mosaic backend keeps its configs and their shared memory in
`configs.py`, the TMA tiling, swizzles and padding in `tma.py`, and the
heuristics, cost model and search spaces in `heuristics.py`. Kernels built
on this backend (other ops included) import these names from here.
"""

from pallas_gemm.mosaic_backend.configs import (HOPPER_SMEM_BYTES,
                                                MOSAIC_INPUT_DTYPES,
                                                SMEM_SLACK_BYTES, Dim,
                                                MosaicConfig, SmallMConfig,
                                                SplitKConfig, small_m_tile_m)
from pallas_gemm.mosaic_backend.heuristics import (CTA_TILE_CHOICES,
                                                   SATURATING_SM_SHARE,
                                                   cta_waves,
                                                   small_m_candidates,
                                                   small_m_cost,
                                                   small_m_heuristic,
                                                   split_k_cost,
                                                   split_k_heuristic,
                                                   waves, ws_candidates,
                                                   ws_heuristic)
from pallas_gemm.mosaic_backend.tma import (SWIZZLE_BYTES,
                                            TMA_STRIDE_ALIGN_BYTES,
                                            check_full_swizzle, pad_to_tiling,
                                            pad_vector, padded_dims,
                                            swizzle_elems, tiled_transforms,
                                            tma_tiling, unpad_output)

__all__ = [
    "CTA_TILE_CHOICES", "Dim", "HOPPER_SMEM_BYTES", "MOSAIC_INPUT_DTYPES",
    "MosaicConfig", "SATURATING_SM_SHARE", "SMEM_SLACK_BYTES",
    "SWIZZLE_BYTES", "SmallMConfig", "SplitKConfig", "TMA_STRIDE_ALIGN_BYTES",
    "check_full_swizzle", "cta_waves", "pad_to_tiling", "pad_vector",
    "padded_dims", "small_m_candidates", "small_m_cost", "small_m_heuristic",
    "small_m_tile_m", "split_k_cost", "split_k_heuristic", "swizzle_elems",
    "tiled_transforms", "tma_tiling",
    "unpad_output", "waves", "ws_candidates", "ws_heuristic",
]
