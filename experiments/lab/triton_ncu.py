"""Run one `triton/06_tuned` kernel so that Nsight Compute can profile it.

The SASS that `triton_sass.py` reads comes from pip Triton, not from the
Triton inside jaxlib that XLA runs, and XLA writes no PTX for Pallas kernels.
Profiling the launch XLA makes is the way to see the binary that is timed:
its registers, occupancy, which tensor pipe (wgmma or mma.sync) executes, and
where the warps stall. `triton_ncu.sh` wraps this script in `ncu`.

    PYTHONPATH=. python3 experiments/lab/triton_ncu.py --case tf32:NN \\
        --block 128x128x32 --num-warps 4 --num-stages 4 --k-major

The kernel runs twice (compile, then the launch to profile) on fresh normal
inputs and is checked against jnp.dot, so a profile of a wrong kernel says so.
"""

from __future__ import annotations

import argparse
import warnings

warnings.filterwarnings("ignore", category=DeprecationWarning)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from experiments.lab import triton_sass  # noqa: E402
from pallas_gemm import timing  # noqa: E402
from pallas_gemm.triton_backend import common, k06_tuned  # noqa: E402
from pallas_gemm.triton_backend.common import TritonConfig  # noqa: E402


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--case", default="tf32:NN",
                      help="FAMILY:LAYOUT, FAMILY in bf16, tf32, ieee")
  parser.add_argument("--size", default="4096",
                      help="N for an N^3 problem, or MxNxK")
  parser.add_argument("--block", default="128x128x32")
  parser.add_argument("--num-warps", type=int, default=4)
  parser.add_argument("--num-stages", type=int, default=4)
  parser.add_argument("--group-m", type=int, default=8)
  parser.add_argument("--k-major", action="store_true")
  parser.add_argument("--programs-per-sm", type=int, default=0)
  args = parser.parse_args(argv)

  try:
    dims = [int(x) for x in args.size.split("x")]
    if len(dims) == 1:
      dims *= 3
    if len(dims) != 3:
      raise ValueError(f"--size={args.size!r} must be N or MxNxK")
    problem = triton_sass.case_problem(args.case, dims)
    bm, bn, bk = (int(x) for x in args.block.split("x"))
    config = TritonConfig(bm, bn, bk, num_warps=args.num_warps,
                          num_stages=args.num_stages, group_m=args.group_m,
                          k_major=args.k_major,
                          programs_per_sm=args.programs_per_sm)
  except (TypeError, ValueError) as err:
    parser.error(f"{err} (--size={args.size!r}, --block={args.block!r})")
  a, b, _, _ = timing.random_operands(problem)
  kernel = jax.jit(lambda a, b: k06_tuned.tuned_matmul(
      a, b, None, None, problem=problem, config=config, interpret=False))
  out = jax.block_until_ready(kernel(a, b))  # compile and a first launch
  jax.block_until_ready(kernel(a, b))  # the launch a `-s 1 -c 1` ncu profiles

  a_nn = jnp.swapaxes(a, 1, 2) if problem.transpose_a else a
  b_nn = jnp.swapaxes(b, 1, 2) if problem.transpose_b else b
  ref = jnp.matmul(a_nn, b_nn, precision=common.dot_precision(problem),
                   preferred_element_type=jnp.float32)
  err = float(jnp.linalg.norm(out.astype(jnp.float32) - ref)
              / jnp.linalg.norm(ref))
  print(f"{problem.describe()} {config} rel_err_vs_jnp={err:.2e} "
        f"{'ok' if err < 1e-2 else 'WRONG'}")
  return 0 if err < 1e-2 else 1


if __name__ == "__main__":
  raise SystemExit(main())
