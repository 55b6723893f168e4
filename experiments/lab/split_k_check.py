"""Times the "rows" kernel's split reductions (`RaggedConfig.split_k`)
against the config the heuristic gave before them, and against
`jax.lax.ragged_dot`, each checked against float64.

    PYTHONPATH=. python3 experiments/lab/split_k_check.py \\
        [--cases "g1 m129 k512 n7488 zipf dlhs;..."] [--iterations 20] \\
        [--budget_s 0]

Each case is "gG mM kK nN routing direction", as `random_ragged_sweep.py`
labels its draws (routing: even, zipf, one_hot or random; direction:
forward, dlhs or drhs, of a layer whose forward is M x K times K x N).
The default cases are the heuristic's splits among the random draws that
ran slower than lax, and decode steps over few experts. Ways: lax, `auto`
(the automatic choice: split where `configs._split_where_few_tiles` says),
`split` (the Mosaic kernels at the heuristic's config) and `unsplit` (the
Mosaic kernels at `ragged_lab_common.unsplit_config`, what the heuristic
gave before the split). A case the heuristic does not split is reported
and skipped.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import jax
import jax.numpy as jnp

_ROOT = pathlib.Path(__file__).resolve().parents[2]
if str(_ROOT) not in sys.path:
  sys.path.insert(0, str(_ROOT))

import pallas_gemm  # noqa: E402
from experiments.lab import ragged_lab_common as common  # noqa: E402
from experiments.lab import random_ragged_sweep as sweep  # noqa: E402
from pallas_gemm import numerics  # noqa: E402
from pallas_gemm.devices import device_info  # noqa: E402
from pallas_gemm.ragged_dot import configs  # noqa: E402

DEFAULT_CASES = (
    # Random draws (experiments/results/nvidia_h200/random_ragged).
    "g1 m129 k512 n7488 zipf dlhs",
    "g1 m24 k1360 n2592 even dlhs",
    "g1 m41 k1096 n2448 one_hot dlhs",
    "g1 m33 k6427 n776 zipf dlhs",
    # Decode steps: Mixtral 8x7B's down projection and its up projection's
    # dlhs at one and four tokens (top-2), Qwen3-30B-A3B's down at one
    # token (top-8); one expert of 64 rows over a long reduction.
    "g8 m2 k14336 n4096 even forward",
    "g8 m2 k4096 n14336 even dlhs",
    "g8 m8 k14336 n4096 zipf forward",
    "g128 m8 k768 n2048 random forward",
    "g1 m64 k8192 n1024 even forward",
    "g2 m100 k4096 n896 zipf forward",
)
WAYS = ("lax", "auto", "split", "unsplit")
def mosaic_call(problem, config):
  numbers = problem.dimension_numbers
  out_dtype = jnp.dtype(problem.out_dtype)
  return jax.jit(lambda l, r, s: pallas_gemm.ragged_dot_general(
      l, r, s, numbers, preferred_element_type=out_dtype, kernel="mosaic",
      config=config))


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--cases", default=";".join(DEFAULT_CASES),
                      help="';'-separated 'gG mM kK nN routing direction'")
  parser.add_argument("--iterations", type=int, default=20)
  parser.add_argument("--budget_s", type=float, default=0.0,
                      help="start no new case after this long (0: no limit)")
  parser.add_argument("--seed", type=int, default=0,
                      help="seeds the routings' sizes and the operands")
  args = parser.parse_args(argv)
  if args.iterations < 1:
    raise SystemExit(f"--iterations={args.iterations} must be >= 1")
  cases = [sweep.parse_case(text, args.seed, flag="--cases")
           for text in args.cases.split(";") if text.strip()]
  device = device_info()
  on_gpu = common.print_header(
      WAYS, ("split_k", "split / unsplit", "auto / lax", "split error",
             "unsplit error"), args.iterations, f"seed {args.seed}")
  budget = common.Budget(args.budget_s)
  keys = jax.random.split(jax.random.key(args.seed), 2)
  for label, case, sizes in cases:
    if budget.spent():
      return 0
    problem = case.problem
    config = configs.heuristic(problem, device)
    if config.split_k == 1:
      print(f"# {label}: the heuristic does not split it", flush=True)
      continue
    unsplit = common.unsplit_config(problem, device)
    lhs = numerics.random_normal(keys[0], problem.lhs_shape, "bfloat16")
    rhs = numerics.random_normal(keys[1], problem.rhs_shape, "bfloat16")
    calls = {"lax": common.way_call("lax", problem),
             "auto": common.way_call("auto", problem),
             "split": mosaic_call(problem, config),
             "unsplit": mosaic_call(problem, unsplit)}
    times, results = common.time_ways(
        calls, (lhs, rhs, jnp.asarray(sizes)), iterations=args.iterations,
        on_gpu=on_gpu, label=label)
    errors = {way: sweep.sampled_error(problem, lhs, rhs, sizes, result)
              for way, result in results.items()}
    cells = [f"{times[w]:.1f}" if w in times else "-" for w in WAYS]
    ratio = lambda a, b: (f"{times[a] / times[b]:.2f}"
                          if a in times and b in times else "-")
    error = lambda w: f"{errors[w]:.1e}" if w in errors else "-"
    print(f"| {label} | " + " | ".join(cells)
          + f" | {config.split_k} | {ratio('split', 'unsplit')} | "
          f"{ratio('auto', 'lax')} | {error('split')} | {error('unsplit')} |",
          flush=True)
    tolerance = numerics.tolerance("bfloat16", "default", "bfloat16")
    for way, value in errors.items():
      if not value <= tolerance:
        print(f"# {label} {way}: WRONG, relative error {value:.1e} over "
              f"{tolerance:.0e} against float64", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
