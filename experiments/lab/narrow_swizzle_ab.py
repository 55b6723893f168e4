"""Do the one-consumer kernels (`mosaic/split_k`, `mosaic/small_m`) gain
from reading rows of 16-element multiples with a narrower swizzle instead
of padding them to whole 128-byte rows? An A/B on the GPU.

`tma.widest_swizzle` picks the swizzle; with it forced to 128 bytes the
kernels pad exactly as before it existed (their jaxprs at aligned shapes
are unchanged). For seeded problems whose rows are 32- or 64-byte but not
128-byte multiples (few-tile problems like the dispatch builder's
`few_tiles` regime, and decode problems), each kernel's config as a call
resolves it is checked against float64 with the narrow swizzle, then timed
both ways the builder's way (`build_dispatch_table.time_kernel`: CUPTI
kernel time, median over operand sets rotated past L2), narrow, padded,
padded, narrow, against xla. One line per problem.

    PYTHONPATH=. python3 experiments/lab/narrow_swizzle_ab.py [--count 24] \\
        [--seed 5] [--max_seconds 200]

On a CPU it checks one problem per kernel in interpret mode and times
nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import math
import pathlib
import random
import sys

_ROOT = pathlib.Path(__file__).resolve().parents[2]
if str(_ROOT) not in sys.path:
  sys.path.insert(0, str(_ROOT))

import pallas_gemm  # noqa: E402
from experiments import build_dispatch_table as builder  # noqa: E402
from experiments.lab.split_k_probe import check, within_budget  # noqa: E402
from pallas_gemm import dispatch, numerics  # noqa: E402
from pallas_gemm.mosaic_backend import small_m, split_k, tma  # noqa: E402
from pallas_gemm.problem import GemmProblem  # noqa: E402


def narrow(problem: GemmProblem) -> bool:
  """Whether some row of the problem's operands or output would be read
  or written with a narrower swizzle than 128 bytes."""
  return (small_m.input_swizzle(problem) < tma.SWIZZLE_BYTES
          or small_m.output_swizzle(problem, problem.out_dtype)
          < tma.SWIZZLE_BYTES)


def draw(seed: int, count: int, device) -> list[tuple[str, GemmProblem]]:
  rng = random.Random(seed)
  log_uniform = functools.partial(builder._log_uniform, rng)
  out = []
  while len(out) < count:
    if len(out) % 3 == 2:  # decode
      kernel = small_m.NAME
      problem = GemmProblem(1, rng.choice((1, 8, 16, 32, 64, 128)),
                            log_uniform(1024, 16384, 16),
                            log_uniform(1024, 16384, 16),
                            "bfloat16", "bfloat16")
    else:
      kernel = split_k.NAME
      problem = GemmProblem(rng.choice((1, 1, 1, 2, 4, 8, 16)),
                            log_uniform(136, 2048, 16),
                            log_uniform(64, 2048, 16),
                            log_uniform(64, 4096, 16), "bfloat16", "bfloat16")
    supported = (split_k.supports(problem, device) if kernel == split_k.NAME
                 else small_m.supports(problem, device))
    if supported is None and narrow(problem):
      out.append((kernel, problem))
  return out


class _Padded:
  """Forces the 128-byte swizzle (the padding path) while active."""

  def __enter__(self):
    self._saved = tma.widest_swizzle
    tma.widest_swizzle = lambda dtype, *dims: tma.SWIZZLE_BYTES

  def __exit__(self, *exc):
    tma.widest_swizzle = self._saved


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--seed", type=int, default=5)
  parser.add_argument("--count", type=int, default=24)
  parser.add_argument("--iters", type=int, default=20)
  parser.add_argument("--max_seconds", type=float, default=200.0)
  args = parser.parse_args(argv)
  device = pallas_gemm.device_info()
  tolerance = numerics.tolerance("bfloat16", "default", "bfloat16")
  problems = draw(args.seed, args.count if device.is_gpu else 2, device)
  if not device.is_gpu:
    for kernel, problem in problems[:2]:
      config = dispatch.resolve(problem, device, kernel).config
      error = check(problem, kernel, config)
      print(f"{kernel} {problem.describe()}: relative error {error:.1e} "
            f"({'ok' if error <= tolerance else 'WRONG'}); timing needs a GPU")
    return
  gains = []
  for number, (kernel, problem) in within_budget(problems, args.max_seconds):
    config = dispatch.resolve(problem, device, kernel).config
    error = check(problem, kernel, config)
    if not error <= tolerance:
      print(f"[{number}] {kernel} {problem.describe()} [{config}]: WRONG, "
            f"relative error {error:.2e}", flush=True)
      continue
    xla_ms, _ = builder.time_kernel(problem, "xla", device, args.iters)
    times = {"narrow": [], "padded": []}
    for variant in ("narrow", "padded", "padded", "narrow"):
      with _Padded() if variant == "padded" else contextlib.nullcontext():
        ms, _ = builder.time_kernel(problem, kernel, device, args.iters,
                                    config)
      times[variant].append(ms)
    narrow_ms = min(times["narrow"])
    padded_ms = min(times["padded"])
    gains.append(padded_ms / narrow_ms)
    print(f"[{number}/{len(problems)}] {kernel} {problem.describe()}: xla "
          f"{xla_ms * 1e3:.1f} us; padded {xla_ms / padded_ms:.3f}x xla, "
          f"narrow {xla_ms / narrow_ms:.3f}x xla; narrow/padded time "
          f"{narrow_ms / padded_ms:.3f} (error {error:.1e})", flush=True)
  if gains:
    geomean = math.exp(sum(map(math.log, gains)) / len(gains))
    print(f"padded time / narrow time: geomean {geomean:.3f} over "
          f"{len(gains)} problems")


if __name__ == "__main__":
  main()
