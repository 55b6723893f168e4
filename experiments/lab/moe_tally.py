"""How many `moe` cases meet issue 18's targets across several benchmark runs,
which miss, and which changed sides against an earlier set of runs?

    python3 experiments/lab/moe_tally.py \
        experiments/results/nvidia_h200/moe_0611906/suite/*/results.json \
        --against experiments/results/nvidia_h200/moe_a21e353/suite/*/results.json

A suite run on the GPU is usually split over several device calls (each has
a time limit), so its count is pieced together from several `results.json`
files written by `experiments/bench_moe.py`. This script does that piecing
the same way every time: only the `auto` rows count, and a case measured in
more than one file counts once, from the first file given (the repeats are
listed with their fractions, so the spread between calls stays visible).
With `--against`, the earlier files are pieced the same way and every case
that crossed its line, or whose time moved by more than `--moved`, is
listed. No GPU: it reads the files only.
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib
import statistics
import sys

#: Rows of the benchmark that count against the targets.
COUNTED_KERNEL = "auto"
#: A case this close to its line (in fraction of the roofline) can cross it
#: between two runs of one config; the tally lists them apart.
NEAR_LINE = 0.01


def load_cases(paths):
  """case label -> its measurements (the first file's first), `auto` rows
  only."""
  cases = collections.OrderedDict()
  for path in paths:
    data = json.loads(pathlib.Path(path).read_text())
    rows = data.get("results") if isinstance(data, dict) else None
    if not isinstance(rows, list):
      raise ValueError(f"{path}: no 'results' list (not a bench_moe.py "
                       "results.json)")
    for row in rows:
      if row.get("kernel") == COUNTED_KERNEL:
        cases.setdefault(row["case"], []).append(row)
  return cases


def passes(row) -> bool:
  return bool(row.get("meets_target")) and bool(row.get("correct", True))


def tally(cases):
  """Markdown lines: the count per direction, the misses per direction and
  routing, the cases near their line, and the repeats."""
  directions = collections.OrderedDict()
  misses = collections.OrderedDict()
  near, repeats, wrong = [], [], []
  for label, rows in cases.items():
    row = rows[0]
    met, total = directions.get(row["direction"], (0, 0))
    directions[row["direction"]] = (met + passes(row), total + 1)
    fraction = row["roofline_fraction"]
    if not row.get("correct", True):
      wrong.append(label)
    if not passes(row):
      misses.setdefault((row["direction"], row["distribution"]), []).append(
          f"{row['layer']} {fraction:.3f}")
    if abs(fraction - row["roofline_target"]) < NEAR_LINE:
      near.append(f"{label} {fraction:.4f} (line {row['roofline_target']})")
    if len(rows) > 1:
      repeats.append(f"{label}: " + ", ".join(
          f"{r['roofline_fraction']:.3f}" for r in rows) + " (the first counts)")
  met = sum(m for m, _ in directions.values())
  lines = [f"**{met} of {len(cases)}** meet their target (" + ", ".join(
      f"{d} {m} of {t}" for d, (m, t) in directions.items()) + ")", ""]
  if misses:
    lines += ["| direction, routing | misses (fraction of the roofline) |",
              "|---|---|"]
    lines += [f"| {d}, {r} ({len(v)}) | {', '.join(v)} |"
              for (d, r), v in misses.items()]
    lines.append("")
  for title, items in (("Within 1 % of their line", near),
                       ("Measured more than once", repeats),
                       ("WRONG RESULT", wrong)):
    if items:
      lines += [f"{title}:", *[f"- {item}" for item in items], ""]
  return lines


def compare(cases, earlier, moved):
  """Markdown lines: the cases that crossed their line against `earlier`,
  the spread of the time ratios, and the cases that moved more than
  `moved`."""
  common = [label for label in cases if label in earlier]
  if not common:
    return ["No case in common with the earlier runs.", ""]
  lines, ratios, moved_lines = [], [], []
  for label in common:
    new, old = cases[label][0], earlier[label][0]
    if passes(new) != passes(old):
      lines.append(f"- {label}: {old['roofline_fraction']:.3f} -> "
                   f"{new['roofline_fraction']:.3f}, now "
                   + ("passes" if passes(new) else "misses"))
    ratio = new["time_ms"] / old["time_ms"]
    ratios.append(ratio)
    if abs(ratio - 1) > moved:
      moved_lines.append(f"- {label}: {ratio:.3f}")
  out = [f"Against the earlier runs ({len(common)} cases in common): time "
         f"ratio median {statistics.median(ratios):.3f}, "
         f"{min(ratios):.3f}-{max(ratios):.3f}.", ""]
  if lines:
    out += ["Crossed their line:", *lines, ""]
  if moved_lines:
    out += [f"Moved by more than {moved:.0%}:", *moved_lines, ""]
  return out


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("results", nargs="+",
                      help="bench_moe.py results.json files, first counts")
  parser.add_argument("--against", nargs="+", default=[],
                      help="earlier results.json files to compare with")
  parser.add_argument("--moved", type=float, default=0.04,
                      help="list cases whose time moved by more than this")
  args = parser.parse_args(argv)
  if not 0 <= args.moved < 1:
    parser.error(f"--moved must lie in [0, 1), got {args.moved}")
  for name, paths in (("results", args.results), ("--against", args.against)):
    absent = [p for p in paths if not pathlib.Path(p).is_file()]
    if absent:
      parser.error(f"{name}: no such file {absent[0]}")
  cases = load_cases(args.results)
  if not cases:
    print("no `auto` rows in the files given", file=sys.stderr)
    return 1
  lines = tally(cases)
  if args.against:
    lines += compare(cases, load_cases(args.against), args.moved)
  print("\n".join(lines).rstrip())
  return 0


if __name__ == "__main__":
  sys.exit(main())
