"""Pallas kernels lowered through Triton: a numbered optimisation ladder.

Each `kNN_*.py` file is one rung and registers itself as `triton/NN_name`:

  01_naive      one tile per program, whole K in one block
  02_k_loop     a K loop, fixed footprint
  03_pipelined  software pipelining (num_stages) and num_warps
  04_grouped    grouped program order for L2 reuse
  05_split_k    split-K with a deterministic reduction, for skinny outputs
  06_tuned      the production kernel: all of the above plus autotuned configs

One ladder philosophy, the CUDA ladder's: the teaching rungs (01-05) are
self-contained. Each file writes out its own loads, masks, K loop and
store, and its docstring names the one change it makes over the previous
rung. So each rung carries a copy of its predecessor's kernel code, and the
same lines stand in several rungs: those copies are deliberate (read one
file, see the whole kernel), and `duplicates` lists them. No rung imports
another rung.

Shared modules, and what they may hold:

  common          infrastructure, no GEMM code: `TritonConfig` (validated at
                  construction), `triton_supports`, `small_problem_config`,
                  `dot_precision`, the int32 index helpers, the grouped
                  program -> tile order (rungs 4-6 and the experiments use
                  it), and the BlockSpec / `pallas_call` / registration
                  plumbing every rung would otherwise copy verbatim;
  split_k_common  the skinny-output plan (tiles, split count) and the
                  fixed-order reduction of split-K partials, used by rungs 5
                  and 6;
  tuned_kernels   the production rung's kernels: one set of loads, K loop
                  and store (with the edge masks the shape needs) behind
                  the grouped, split-K and persistent launches. Only rung 6
                  uses it.

The kernels keep their index arithmetic in int32, the type of Triton's
program ids, also with `jax_enable_x64` on.

The Pallas-Triton lowering is deprecated since JAX 0.11 but still works in
0.11.x and 0.12; this is the path for Ampere/Ada GPUs.
"""

from pallas_gemm.triton_backend import common  # noqa: F401
from pallas_gemm.triton_backend import split_k_common  # noqa: F401
from pallas_gemm.triton_backend import tuned_kernels  # noqa: F401
from pallas_gemm.triton_backend import k01_naive  # noqa: F401
from pallas_gemm.triton_backend import k02_k_loop  # noqa: F401
from pallas_gemm.triton_backend import k03_pipelined  # noqa: F401
from pallas_gemm.triton_backend import k04_grouped  # noqa: F401
from pallas_gemm.triton_backend import k05_split_k  # noqa: F401
from pallas_gemm.triton_backend import k06_tuned  # noqa: F401
