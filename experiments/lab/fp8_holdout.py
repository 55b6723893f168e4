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
import pathlib
from unittest import mock

from pallas_gemm import dispatch
from pallas_gemm.problem import FP8_DTYPES

from experiments.build_dispatch_table import read_measurements, to_problem
from experiments.lab.dispatch_holdout import (LOSS, hold_out, hopper_device,
                                              summary)


def resolve_with(problem, device, table):
  """`kernel=None`'s whole rule for `problem` with `table` as the device's
  own dispatch table (the sibling's as shipped)."""
  with mock.patch.object(dispatch, "dispatch_records",
                         lambda _device: table):
    dispatch.clear_cache()
    try:
      return dispatch._resolve(problem, device, None, None)
    finally:
      dispatch.clear_cache()


def is_fp8(row: dict) -> bool:
  return row["spec"]["in_dtype"] in FP8_DTYPES


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
    scored = hold_out(rows, hopper_device(device_kind), args.min_gain,
                      decide=resolve_with, keep=is_fp8)
    if not any(ratio is not None for _, _, ratio, _ in scored):
      print(f"## {device_kind}: no fp8 problem measured")
      continue
    s = summary(scored)
    print(f"## {device_kind}: {s['problems']} fp8 problems, leave-one-out "
          "through dispatch._resolve\n")
    print("| scored | geomean | min | below 0.97x | not xla | oracle |")
    print("|---|---|---|---|---|---|")
    print(f"| {sum(r is not None for _, _, r, _ in scored)} | "
          f"{s['geomean']:.3f} | {s['min']:.3f} | {s['losses']} | "
          f"{s['not_xla']} | {s['oracle_geomean']:.3f} |\n")
    if args.details:
      for row, kernel, ratio, source in scored:
        best = max(row["ms"]["xla"] / t for t in row["ms"].values())
        lost = ratio is not None and ratio < LOSS
        missed = kernel == "xla" and best > dispatch.CLASS_RULE_MARGIN
        if lost or missed:
          print(f"- {to_problem(row['spec']).describe()}: {kernel} "
                f"({source}) {'-' if ratio is None else f'{ratio:.3f}x'}, "
                f"best {best:.3f}x "
                f"{'**loss**' if lost else '(win given up)'}")
      print()
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
