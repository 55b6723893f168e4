"""How well does `kernel=None` decide fp8 problems it never measured?

Leave-one-out over a GPU's fp8 dispatch measurements, through the whole
rule (`dispatch._resolve`: buckets in reach, the layout's nearest problems,
the class rule, the sibling's table, the aligned twin, the order), not only
the table's own decision as `dispatch_holdout.py` replays it: each fp8
problem is resolved against the table folded without it, and the kernel
chosen is scored with the problem's own measurements (its time over xla's;
a kernel the row did not time is left out of the geomean). The sibling
GPU's shipped table is read as it ships. Needs no GPU:

    PYTHONPATH=. python3 experiments/lab/fp8_holdout.py \\
        experiments/results/nvidia_h200/dispatch [--details]
"""

from __future__ import annotations

import argparse
import math
import pathlib
from unittest import mock

from pallas_gemm import dispatch
from pallas_gemm.problem import FP8_DTYPES

from experiments.build_dispatch_table import (fold, read_measurements,
                                               to_problem)
from experiments.lab.dispatch_holdout import LOSS, hopper_device


def hold_out(rows: list[dict], device, min_gain: float):
  """[(problem, resolution, its ratio to xla or None, best ratio)] for
  each fp8 row, its bucket folded from the other problems in it."""
  full = fold(rows, min_gain)
  keys = [dispatch.DispatchKey.for_problem(to_problem(r["spec"])).name
          for r in rows]
  scored = []
  for i, row in enumerate(rows):
    problem = to_problem(row["spec"])
    if problem.in_dtype not in FP8_DTYPES:
      continue
    others = [r for j, r in enumerate(rows) if keys[j] == keys[i] and j != i]
    table = dict(full)
    if others:
      table.update(fold(others, min_gain))
    else:
      del table[keys[i]]
    with mock.patch.object(dispatch, "dispatch_records",
                           lambda _device, table=table: table):
      dispatch.clear_cache()
      chosen = dispatch._resolve(problem, device, None, None)
    dispatch.clear_cache()
    ms = row["ms"]
    ratio = ms["xla"] / ms[chosen.kernel] if chosen.kernel in ms else None
    best = max(ms["xla"] / t for t in ms.values())
    scored.append((problem, chosen, ratio, best))
  return scored


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("dirs", nargs="+", type=pathlib.Path,
                      help="dispatch result folders (measurements.jsonl)")
  parser.add_argument("--min_gain", type=float, default=1.01)
  parser.add_argument("--details", action="store_true",
                      help="list every loss and every kernel win given up")
  args = parser.parse_args(argv)
  for folder in args.dirs:
    rows = read_measurements(folder / "measurements.jsonl")
    device_kind = rows[0]["device"] if rows else folder.parent.name
    scored = hold_out(rows, hopper_device(device_kind), args.min_gain)
    ratios = [r for _, _, r, _ in scored if r is not None]
    if not ratios:
      print(f"## {device_kind}: no fp8 problem measured")
      continue
    geomean = math.exp(sum(map(math.log, ratios)) / len(ratios))
    oracle = math.exp(sum(math.log(b) for *_, b in scored) / len(scored))
    print(f"## {device_kind}: {len(scored)} fp8 problems, leave-one-out "
          "through dispatch._resolve\n")
    print("| scored | geomean | min | below 0.97x | not xla | oracle |")
    print("|---|---|---|---|---|---|")
    print(f"| {len(ratios)} | {geomean:.3f} | {min(ratios):.3f} | "
          f"{sum(r < LOSS for r in ratios)} | "
          f"{sum(c.kernel != 'xla' for _, c, _, _ in scored)} | "
          f"{oracle:.3f} |\n")
    if args.details:
      for problem, chosen, ratio, best in scored:
        lost = ratio is not None and ratio < LOSS
        missed = chosen.kernel == "xla" and best > dispatch.CLASS_RULE_MARGIN
        if lost or missed:
          print(f"- {problem.describe()}: {chosen.kernel} "
                f"({chosen.kernel_source}) "
                f"{'-' if ratio is None else f'{ratio:.3f}x'}, best "
                f"{best:.3f}x {'**loss**' if lost else '(win given up)'}")
      print()
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
