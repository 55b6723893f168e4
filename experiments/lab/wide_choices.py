"""Which kernel does `kernel=None` pick for each `wide` problem on a GPU,
from the committed dispatch table alone, and which picks differ from a
committed wide run's?

A rule or table change that alters no pick leaves a committed run's
numbers standing; one that alters a few says which problems to measure
again. The run's own pick is read from its results file: `auto` compiled
to jnp.dot's program (`same_program_as_baseline`) means xla, anything else
a kernel. Needs no GPU:

    PYTHONPATH=. python3 experiments/lab/wide_choices.py nvidia_h100 \
        [--against experiments/results/nvidia_h100/wide/results.json]
"""

from __future__ import annotations

import argparse
import json
import pathlib

from pallas_gemm import autotune, dispatch, shapes

from experiments.bench.cases import parse_dtypes
from experiments.bench.checks import make_problem
from experiments.lab.dispatch_holdout import hopper_device

#: The GPUs with a shipped dispatch table.
GPUS = ("nvidia_h100", "nvidia_h200")


def choices(gpu: str) -> dict[str, dispatch.Resolution]:
  """`GemmProblem.describe()` -> the resolution `kernel=None` gets for each
  wide problem under the GPU's shipped dispatch table, resolved for the
  device the table was measured on (its "meta")."""
  if gpu not in GPUS:
    raise ValueError(f"gpu={gpu!r} is not one of {GPUS}")
  path = autotune.shipped_path(gpu)
  device = hopper_device(autotune.read_section(path, "meta")["device"])
  table = autotune.read_section(path, "dispatch")
  picked = {}
  for suite_problem in shapes.WIDE:
    case = parse_dtypes([suite_problem.dtype], ("tf32",))[0]
    problem = make_problem(suite_problem.shape, case, suite_problem.layout,
                           suite_problem.batch)
    picked[problem.describe()] = dispatch._from_table(problem, device, table)
  return picked


def run_picks(results_json: pathlib.Path) -> dict[str, bool]:
  """Shape label -> whether that run's `auto` ran a kernel (not xla)."""
  rows = json.loads(results_json.read_text())["results"]
  return {row["shape"]: not row["same_program_as_baseline"]
          for row in rows if row["kernel"] == "auto"}


def shape_label(description: str) -> str:
  """The results files' shape label ("BxMxNxK", batch only above 1) of a
  `describe()` text."""
  return description.split()[0]


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("gpu", choices=GPUS)
  parser.add_argument("--against", type=pathlib.Path, default=None,
                      help="a wide run's results.json to compare with")
  parser.add_argument("--json", action="store_true",
                      help="print every pick as JSON instead")
  args = parser.parse_args(argv)
  picked = choices(args.gpu)
  if args.json:
    print(json.dumps({d: [r.kernel, r.reason] for d, r in picked.items()},
                     indent=1))
    return 0
  kernels = {d: r for d, r in picked.items() if r.kernel != "xla"}
  print(f"{args.gpu}: {len(kernels)} of {len(picked)} wide problems run a "
        "kernel")
  for description, resolution in kernels.items():
    print(f"  {description}: {resolution.kernel}")
  if args.against is not None:
    ran = run_picks(args.against)
    differ = [d for d in picked
              if shape_label(d) in ran
              and ran[shape_label(d)] != (picked[d].kernel != "xla")]
    print(f"{len(differ)} pick(s) differ from {args.against}")
    for description in differ:
      print(f"  {description}: now {picked[description].kernel} "
            f"({picked[description].reason})")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
