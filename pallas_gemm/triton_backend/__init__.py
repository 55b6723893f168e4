"""Pallas kernels lowered through Triton: a numbered optimisation ladder.

Each `kNN_*.py` file is one rung and registers itself as `triton/NN_name`.
The Pallas-Triton lowering is deprecated since JAX 0.11 but still works in
0.11.x and 0.12; this is the path for Ampere/Ada GPUs.
"""

from pallas_gemm.triton_backend import common  # noqa: F401
from pallas_gemm.triton_backend import k02_k_loop  # noqa: F401
