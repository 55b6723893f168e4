"""Times the "rows"-mode work list alone: XLA's ops
(`mosaic_schedule.row_items`) against the Pallas-Triton kernel
(`work_list_kernel.row_items`) at a few launch shapes, on the moe suite's
layers and routings, each table checked against XLA's.

    PYTHONPATH=. python3 experiments/lab/work_list_kernel_sweep.py \
        [--compares 512,1024,2048] [--warps 1,2,4] [--iterations 50]

Prints, per layer and routing, the CUPTI median of each kernel the work
list launches (summed), in µs. GPU only.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

_ROOT = pathlib.Path(__file__).resolve().parents[2]
if str(_ROOT) not in sys.path:
  sys.path.insert(0, str(_ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_gemm import timing  # noqa: E402
from pallas_gemm.ragged_dot import arg_specs  # noqa: E402
from pallas_gemm.ragged_dot import mosaic_schedule, work_list_kernel  # noqa: E402


def _work_list(build, problem, tile_m, balanced):
  return jax.jit(lambda sizes, offset: build(
      sizes, offset, m=problem.m, tile_m=tile_m, row_align=8,
      balanced=balanced))


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--compares", default="512,1024,2048,8192")
  parser.add_argument("--warps", default="4")
  parser.add_argument("--iterations", type=int, default=50)
  parser.add_argument("--distributions", default="even,zipf,one_hot")
  args = parser.parse_args(argv)
  if jax.default_backend() != "gpu":
    raise SystemExit("work_list_kernel_sweep times GPU kernels; no GPU here")
  settings = [(int(c), int(w)) for c in args.compares.split(",")
              for w in args.warps.split(",")]
  print("layer distribution groups m tile_m | xla | "
        + " | ".join(f"compares={c} warps={w}" for c, w in settings),
        flush=True)
  seen = set()
  for layer in arg_specs.MOE_LAYERS:
    if (layer.groups, layer.rows) in seen:  # the same work list
      continue
    seen.add((layer.groups, layer.rows))
    for distribution in args.distributions.split(","):
      case = arg_specs.MoeCase(layer, distribution, "forward")
      problem = case.problem
      sizes = jnp.asarray(case.group_sizes(), jnp.int32)
      offset = jnp.zeros((1,), jnp.int32)
      row = []
      for tile_m, balanced in ((128, True),):
        want = _work_list(mosaic_schedule.row_items, problem, tile_m,
                          balanced)
        row.append(sum(us for _, us in timing.kernel_medians_us(
            want, (sizes, offset), iterations=args.iterations)))
        expected = np.asarray(want(sizes, offset))
        for compares, warps in settings:
          work_list_kernel.COMPARES_PER_PROGRAM = compares
          work_list_kernel.NUM_WARPS = warps
          got = _work_list(work_list_kernel.row_items, problem, tile_m,
                           balanced)
          if not np.array_equal(np.asarray(got(sizes, offset)), expected):
            raise SystemExit(f"{layer.name} {distribution}: the kernel's "
                             f"table differs at compares={compares}")
          row.append(sum(us for _, us in timing.kernel_medians_us(
              got, (sizes, offset), iterations=args.iterations)))
      print(f"{layer.name} {distribution} {problem.groups} {problem.m} 128 | "
            + " | ".join(f"{us:.2f}" for us in row), flush=True)


if __name__ == "__main__":
  main()
