"""Pallas kernels lowered through Triton: a numbered optimisation ladder.

Each `kNN_*.py` file is one rung and registers itself as `triton/NN_name`:

  01_naive      one tile per program, whole K in one block
  02_k_loop     a K loop, fixed footprint
  03_pipelined  software pipelining (num_stages) and num_warps
  04_grouped    grouped program order for L2 reuse
  05_split_k    split-K with a deterministic reduction, for skinny outputs
  06_tuned      the production kernel: all of the above plus autotuned configs

The Pallas-Triton lowering is deprecated since JAX 0.11 but still works in
0.11.x and 0.12; this is the path for Ampere/Ada GPUs.
"""

from pallas_gemm.triton_backend import common  # noqa: F401
from pallas_gemm.triton_backend import k01_naive  # noqa: F401
from pallas_gemm.triton_backend import k02_k_loop  # noqa: F401
from pallas_gemm.triton_backend import k03_pipelined  # noqa: F401
from pallas_gemm.triton_backend import k04_grouped  # noqa: F401
from pallas_gemm.triton_backend import k05_split_k  # noqa: F401
from pallas_gemm.triton_backend import k06_tuned  # noqa: F401
