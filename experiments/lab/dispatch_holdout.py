"""How well does the dispatch rule decide for shapes it never measured?

Leave-one-out over a GPU's dispatch measurements
(`experiments/results/<gpu>/dispatch/measurements.jsonl`): for each measured
problem, the table is folded again from every *other* problem, the problem
is resolved against that table (`dispatch._from_table`, the rule `kernel=None`
runs), and the kernel it picks is scored with the problem's own
measurements: its time over xla's. A rule that generalises has a geomean
above 1 and no problem far below 1.

The same is repeated over a grid of the rule's margins
(`NEAREST_BUCKET_MARGIN`, `MARGIN_PER_OCTAVE`), so that their values rest
on held-out measurements rather than on the training problems themselves.
Needs no GPU:

    PYTHONPATH=. python3 experiments/lab/dispatch_holdout.py [--veto] \
        experiments/results/nvidia_h100/dispatch experiments/results/nvidia_h200/dispatch

`--veto` also tries the thresholds below which a neighbour's measurement
vetoes an unmeasured shape (`dispatch.VETO_BELOW`).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import pathlib

from pallas_gemm import dispatch
from pallas_gemm.devices import DeviceInfo

from experiments.build_dispatch_table import (fold, read_measurements,
                                               to_problem)

#: The margin grid tried: (nearest-bucket margin, margin per octave).
MARGIN_GRID = [(1.0, 0.0), (1.01, 0.05), (1.03, 0.14), (1.05, 0.14),
               (1.05, 0.25), (1.10, 0.25), (1.10, 0.40), (1.15, 0.25),
               (1.20, 0.25)]
#: A held-out problem below this fraction of xla counts as a loss.
LOSS = 0.97
#: The veto thresholds tried (`dispatch.VETO_BELOW`, shipped margins).
VETO_GRID = (1.0, 0.99, 0.98, 0.97)


@contextlib.contextmanager
def margins(base: float, per_octave: float, kernel: str | None = None):
  """The rule with (base, per_octave) margins for `kernel`, or for every
  kernel when None."""
  saved = (dispatch.NEAREST_BUCKET_MARGIN, dispatch.MARGIN_PER_OCTAVE,
           dict(dispatch.KERNEL_MARGINS))
  if kernel is None:
    dispatch.NEAREST_BUCKET_MARGIN, dispatch.MARGIN_PER_OCTAVE = base, per_octave
    dispatch.KERNEL_MARGINS.clear()
  else:
    dispatch.KERNEL_MARGINS[kernel] = (base, per_octave)
  try:
    yield
  finally:
    (dispatch.NEAREST_BUCKET_MARGIN, dispatch.MARGIN_PER_OCTAVE,
     margins_saved) = saved
    dispatch.KERNEL_MARGINS.clear()
    dispatch.KERNEL_MARGINS.update(margins_saved)


def hopper_device(device_kind: str) -> DeviceInfo:
  """The device a table measured on `device_kind` (an H100 or H200: 132 SMs,
  227 KB of shared memory per block) is resolved for, without that GPU."""
  return DeviceInfo("gpu", device_kind, (9, 0), 132, 227 * 1024)


def hold_out(rows: list[dict], device: DeviceInfo, min_gain: float,
             decide=dispatch._from_table, keep=lambda row: True):
  """[(row, chosen kernel, its measured ratio to xla, how it was chosen)]
  for each row `keep` accepts, chosen by `decide(problem, device, table)`.

  Leaving one problem out changes only its own bucket, so the table is
  folded once and, per problem, just that bucket is folded again from its
  other problems (or dropped): the same tables as folding all the others
  each time, in linear rather than quadratic time."""
  full = fold(rows, min_gain)
  keys = [dispatch.DispatchKey.for_problem(to_problem(row["spec"])).name
          for row in rows]
  members: dict[str, list[int]] = {}
  for i, key in enumerate(keys):
    members.setdefault(key, []).append(i)
  scored = []
  for i, row in enumerate(rows):
    if not keep(row):
      continue
    key = keys[i]
    others = [rows[j] for j in members[key] if j != i]
    table = dict(full)
    if others:
      table.update(fold(others, min_gain))
    else:
      del table[key]
    problem = to_problem(row["spec"])
    choice = decide(problem, device, table)
    ms = row["ms"]
    ratio = ms["xla"] / ms[choice.kernel] if choice.kernel in ms else None
    scored.append((row, choice.kernel, ratio, choice.kernel_source))
  return scored


def summary(scored) -> dict:
  ratios = [r for _, _, r, _ in scored if r is not None]
  oracle = [max(row["ms"]["xla"] / t for t in row["ms"].values())
            for row, _, _, _ in scored]
  return {
      "problems": len(scored),
      "geomean": math.exp(sum(map(math.log, ratios)) / len(ratios)),
      "min": min(ratios),
      "losses": sum(r < LOSS for r in ratios),
      "not_xla": sum(k != "xla" for _, k, _, _ in scored),
      "oracle_geomean": math.exp(sum(map(math.log, oracle)) / len(oracle)),
  }


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("dirs", nargs="+", type=pathlib.Path,
                      help="dispatch folders holding measurements.jsonl")
  parser.add_argument("--min_gain", type=float, default=1.01)
  parser.add_argument("--details", action="store_true",
                      help="one line per held-out problem (current margins)")
  parser.add_argument("--veto", action="store_true",
                      help="also try the nearby-loss veto's thresholds "
                      "(shipped margins), over all problems and the decode "
                      "ones (M <= 128)")
  parser.add_argument("--kernel", default=None,
                      help="vary the margins of this kernel only (the "
                      "others keep the shipped ones)")
  args = parser.parse_args()
  for folder in args.dirs:
    rows = read_measurements(folder / "measurements.jsonl")
    kind = rows[0]["device"]
    device = hopper_device(kind)
    which = args.kernel or "every kernel"
    print(f"## {kind}: {len(rows)} problems, leave-one-out, margins of "
          f"{which}\n")
    print("| margin | per octave | geomean | min | below "
          f"{LOSS} | not xla | oracle geomean |")
    print("|---|---|---|---|---|---|---|")
    shipped = dispatch.KERNEL_MARGINS.get(
        args.kernel, (dispatch.NEAREST_BUCKET_MARGIN,
                      dispatch.MARGIN_PER_OCTAVE))
    for base, per_octave in MARGIN_GRID:
      with margins(base, per_octave, args.kernel):
        s = summary(hold_out(rows, device, args.min_gain))
      current = (base, per_octave) == shipped
      print(f"| {base:.2f}{' (shipped)' if current else ''} | {per_octave:.2f} "
            f"| {s['geomean']:.3f} | {s['min']:.3f} | {s['losses']} "
            f"| {s['not_xla']} | {s['oracle_geomean']:.3f} |")
    if args.veto:
      print("\n| veto below | geomean | min | below 0.97 | not xla | decode "
            "geomean | decode min | decode not xla |")
      print("|---|---|---|---|---|---|---|---|")
      saved = dispatch.VETO_BELOW
      for threshold in VETO_GRID:
        dispatch.VETO_BELOW = threshold
        try:
          scored = hold_out(rows, device, args.min_gain)
        finally:
          dispatch.VETO_BELOW = saved
        s = summary(scored)
        d = summary([x for x in scored if x[0]["spec"]["m"] <= 128
                     and x[0]["spec"]["batch"] == 1])
        current = " (shipped)" if threshold == saved else ""
        print(f"| {threshold:.2f}{current} | {s['geomean']:.3f} | "
              f"{s['min']:.3f} | {s['losses']} | {s['not_xla']} | "
              f"{d['geomean']:.3f} | {d['min']:.3f} | {d['not_xla']} of "
              f"{d['problems']} |")
    if args.details:
      print()
      for row, kernel, ratio, source in hold_out(rows, device, args.min_gain):
        if kernel != "xla":
          flag = " **loss**" if ratio < LOSS else ""
          print(f"- {row['problem']}: {kernel} ({source}) {ratio:.3f}x{flag}")
    print()


if __name__ == "__main__":
  main()
