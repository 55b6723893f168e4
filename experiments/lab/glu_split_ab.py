"""Which CTA tile and contraction split the GLU kernel wants where its
output has few tiles (decode batches, narrow widths), against XLA's form.

    PYTHONPATH=. python3 experiments/lab/glu_split_ab.py \
        --shapes 16x768x2048,64x1500x4096 [--max_seconds 300]

For each shape (tokens x width x hidden, pair weights, bfloat16, silu): the
package's `kernel="xla"`, the heuristic's config, then every CTA tile of
`CTA_TILE_CHOICES` at every split of the contraction `GluConfig.k_splits`
allows (1, 2, 4, 8 where they divide the k-steps and leave runs of at
least MIN_SPLIT_STEPS), each at the deepest ring that fits. One line per
candidate: CUPTI median (operand sets rotated past L2, as the benchmark),
the output tiles times the splits (CTAs of work), and x xla. Each
candidate's output is checked against XLA's first (an error above 2e-2 is
printed). On a CPU: one tiny shape in interpret mode (timings mean nothing).
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys
import time

_ROOT = pathlib.Path(__file__).resolve().parents[2]
if str(_ROOT) not in sys.path:
  sys.path.insert(0, str(_ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from pallas_gemm import numerics, timing  # noqa: E402
from pallas_gemm.devices import device_info  # noqa: E402
from pallas_gemm.gated_linear_unit import (GluConfig,  # noqa: E402
                                           gated_linear_unit)
from pallas_gemm.gated_linear_unit.configs import (  # noqa: E402
    CTA_TILE_CHOICES, MIN_SPLIT_STEPS, deepest_ring, epilogue_width,
    glu_heuristic, k_steps, output_tiles)
from pallas_gemm.gated_linear_unit.problem import GluProblem  # noqa: E402
from pallas_gemm.shapes import parse_shapes  # noqa: E402

from experiments.bench.output import git_revision  # noqa: E402
from experiments.bench_glu import _operand_sets, _set_count  # noqa: E402

SPLITS = (1, 2, 4, 8)


def candidates(problem: GluProblem, num_sms: int):
  """(label, config): the heuristic's, then each tile at each split."""
  found = [("heuristic", glu_heuristic(problem, num_sms))]
  for tile_m, tile_n, wg_dim, _ in CTA_TILE_CHOICES:
    for splits in SPLITS:
      base = GluConfig(tile_m=tile_m, tile_n=tile_n, wg_dimension=wg_dim,
                       k_splits=splits)
      steps = k_steps(problem, base)
      if steps % splits or (splits > 1 and steps // splits < MIN_SPLIT_STEPS):
        continue
      config = deepest_ring(dataclasses.replace(
          base, epi_tile_n=epilogue_width(base, problem)), problem)
      if config.misfit(problem) is None:
        found.append((f"cta {config.cta_tile_m}x{config.cta_tile_n} "
                      f"split {splits}", config))
  return found


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--shapes", default="16x768x2048,64x1500x4096")
  parser.add_argument("--max_seconds", type=float, default=300)
  parser.add_argument("--iters", type=int, default=10)
  args = parser.parse_args(argv)
  device = device_info()
  on_gpu = device.is_gpu
  shapes = parse_shapes(args.shapes) if on_gpu else [(8, 64, 512)]
  start = time.monotonic()
  print(f"# {device.device_kind}, jax {jax.__version__}, git "
        f"{git_revision()}, pair weights, bfloat16, silu", flush=True)
  for m, n, k in shapes:
    problem = GluProblem(m=m, n=n, k=k, in_dtype="bfloat16",
                         out_dtype="bfloat16")
    sets = [s[:2] for s in _operand_sets(m, n, k, False,
                                         _set_count(m, n, k, on_gpu), 0)]
    x, w = sets[0]
    label = f"{m}x{n}x{k}"
    reference = jax.jit(lambda x, w: gated_linear_unit(x, w, kernel="xla"))(
        x, w).astype(jnp.float32)
    xla_us = None
    for name, config in [("xla", None)] + candidates(problem,
                                                     device.planning_sms):
      if time.monotonic() - start > args.max_seconds:
        print(f"{label} | {name} | skipped (budget)", flush=True)
        continue
      if config is None:
        fn = lambda x, w: gated_linear_unit(x, w, kernel="xla")  # noqa: E731
      else:
        fn = (lambda x, w, config=config: gated_linear_unit(
            x, w, kernel="mosaic", config=config))
      try:
        error = numerics.relative_error(jax.jit(fn)(x, w), reference)
        us = timing.time_over_sets(fn, sets, iterations=args.iters,
                                   on_gpu=on_gpu) * 1e3
      except Exception as e:  # noqa: BLE001 - a failing candidate is a result
        print(f"{label} | {name} | ERROR {type(e).__name__}: "
              f"{str(e).splitlines()[0][:200]}", flush=True)
        continue
      if config is None:
        xla_us = us
      work = ("" if config is None else
              f"ctas {output_tiles(problem, config) * config.k_splits:4d} | ")
      versus = f"x xla {xla_us / us:.3f}" if xla_us else ""
      flag = f" ERROR {error:.1e}" if error > 2e-2 else ""
      print(f"{label} | {name:22s} | {work}{us:8.1f} us | {versus}{flag}",
            flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
