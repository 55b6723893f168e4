"""Where do fixed costs decide a grouped GEMM? `pallas_gemm.ragged_dot`'s
automatic choice against `jax.lax.ragged_dot` on a grid of small problems
(groups x rows x k x n, every routing and direction), on a GPU.

XLA's ragged product does `groups` times the flops but is one fused GEMM;
the Mosaic path adds its work list's small kernels and a persistent
kernel's start. On large problems that is nothing; on problems of a few
microseconds it can be most of the time. Each row: CUPTI time of every
kernel of one call (median of `--iterations`), both ways in one process,
the group sizes an argument of the jitted call, and auto / lax.

    PYTHONPATH=. python3 experiments/lab/small_ragged_sweep.py \
        [--groups 2,4,8,16] [--rows 128,512,2048] [--dims 256,512,1024] \
        [--distributions even,one_hot] [--directions forward,dlhs,drhs] \
        [--dtype bfloat16] [--iterations 20] [--budget_s 200]

`--dims` gives k = n (a square expert).
"""

from __future__ import annotations

import argparse
import itertools
import sys

import jax
import jax.numpy as jnp

from pallas_gemm import numerics
from pallas_gemm.ragged_dot import arg_specs

from experiments.lab import ragged_lab_common as common

WAYS = ("lax", "auto")


def _ints(text: str, flag: str) -> list[int]:
  try:
    values = [int(v) for v in text.split(",")]
  except ValueError:
    raise SystemExit(f"{flag}={text!r} must be comma-separated integers")
  if any(v < 1 for v in values):
    raise SystemExit(f"{flag}={text!r} must be >= 1")
  return values


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--groups", default="2,4,8,16")
  parser.add_argument("--rows", default="128,512,2048")
  parser.add_argument("--dims", default="256,512,1024")
  parser.add_argument("--distributions", default="even,one_hot")
  parser.add_argument("--directions", default="forward,dlhs,drhs")
  parser.add_argument("--dtype", default="bfloat16",
                      choices=("bfloat16", "float16"))
  parser.add_argument("--iterations", type=int, default=20)
  parser.add_argument("--budget_s", type=float, default=0.0,
                      help="start no new case after this long (0: no limit)")
  args = parser.parse_args(argv)
  grid = itertools.product(_ints(args.groups, "--groups"),
                           _ints(args.rows, "--rows"),
                           _ints(args.dims, "--dims"),
                           args.distributions.split(","),
                           args.directions.split(","))
  on_gpu = common.print_header(WAYS, ("auto / lax",), args.iterations,
                               args.dtype)
  budget = common.Budget(args.budget_s)
  dtype = jnp.dtype(args.dtype)
  for groups, rows, dim, distribution, direction in grid:
    if direction not in arg_specs.DIRECTIONS:
      raise SystemExit(f"--directions: {direction!r} is not one of "
                       f"{list(arg_specs.DIRECTIONS)}")
    if budget.spent():
      return 0
    label = f"g{groups} m{rows} k=n{dim} {distribution} {direction}"
    case = arg_specs.MoeCase(arg_specs.MoeLayer(label, groups, rows, dim, dim),
                             distribution, direction, dtype=args.dtype,
                             out_dtype=args.dtype)
    problem = case.problem
    keys = jax.random.split(jax.random.key(0), 2)
    lhs = numerics.random_normal(keys[0], problem.lhs_shape, dtype)
    rhs = numerics.random_normal(keys[1], problem.rhs_shape, dtype)
    sizes = jnp.asarray(case.group_sizes())
    times, _ = common.time_ways(
        {way: common.way_call(way, problem) for way in WAYS},
        (lhs, rhs, sizes), iterations=args.iterations, on_gpu=on_gpu,
        label=label)
    common.print_row(label, WAYS, times, (("auto", "lax"),), {}, ())
  return 0


if __name__ == "__main__":
  sys.exit(main())
