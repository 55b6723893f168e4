"""Splices benchmark tables from a results directory into README.md.

    python experiments/update_readme.py experiments/results/nvidia_h200
    python experiments/update_readme.py      # the only GPU folder there is

The README holds two generated blocks, each between a pair of markers:

    <!-- BEGIN:results --> ... <!-- END:results -->   summary.md of every suite
    <!-- BEGIN:ladder -->  ... <!-- END:ladder -->    ladder/ladder.md

Everything between a pair is replaced; the rest of the README is untouched.
When the README lacks a pair of markers the script changes nothing, prints
what it would have inserted and exits with status 2. A block whose source
file is missing is left as it is.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import sys

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
# Suites in the order the README shows them; others follow alphabetically.
SUITE_ORDER = ("large", "llm", "square", "decode", "skinny", "odd_large")
PLOTS = (("tflops.png", "TFLOP/s against size"),
         ("roofline.png", "roofline"))


def marker_pattern(name: str) -> re.Pattern:
  return re.compile(
      rf"(<!-- BEGIN:{name} -->)(.*?)(<!-- END:{name} -->)", re.DOTALL)


def _suite_dirs(results_dir: pathlib.Path) -> list[pathlib.Path]:
  # Only benchmark.py's outputs: other folders (a backend's own sweep notes)
  # may carry a summary.md too, but not the benchmark's results.json.
  dirs = [d for d in results_dir.iterdir()
          if d.is_dir() and not (d / "ladder.md").is_file()
          and (d / "summary.md").is_file() and (d / "results.json").is_file()]
  return sorted(dirs, key=lambda d: (
      SUITE_ORDER.index(d.name) if d.name in SUITE_ORDER else len(SUITE_ORDER),
      d.name))


def _plot_links(directory: pathlib.Path, readme_dir: pathlib.Path) -> str:
  links = []
  for filename, title in PLOTS:
    path = directory / filename
    if path.is_file():
      relative = pathlib.Path(os.path.relpath(path, readme_dir)).as_posix()
      links.append(f"[{title}]({relative})")
  return ("\n\nPlots: " + ", ".join(links) + ".") if links else ""


def results_block(results_dir: pathlib.Path, readme_dir: pathlib.Path) -> str | None:
  """Every suite's summary.md under a heading, or None when there is none."""
  sections = []
  if (results_dir / "summary.md").is_file():  # a single suite's directory
    sections.append((results_dir / "summary.md").read_text().strip()
                    + _plot_links(results_dir, readme_dir))
  for suite_dir in _suite_dirs(results_dir):
    sections.append(f"#### Suite `{suite_dir.name}`\n\n"
                    + (suite_dir / "summary.md").read_text().strip()
                    + _plot_links(suite_dir, readme_dir))
  return "\n\n".join(sections) if sections else None


def ladder_block(results_dir: pathlib.Path, readme_dir: pathlib.Path) -> str | None:
  """Every ladder run's table (`ladder/`, `ladder_8192/`, ...), in name order."""
  if (results_dir / "ladder.md").is_file():  # a single ladder's directory
    paths = [results_dir / "ladder.md"]
  else:
    paths = sorted(results_dir.glob("ladder*/ladder.md"))
  blocks = [path.read_text().strip() + _plot_links(path.parent, readme_dir)
            for path in paths]
  return "\n\n".join(blocks) if blocks else None


def splice(text: str, name: str, block: str) -> str | None:
  """`text` with the block between `name`'s markers replaced, or None when
  the markers are missing."""
  pattern = marker_pattern(name)
  if not pattern.search(text):
    return None
  return pattern.sub(lambda m: f"{m.group(1)}\n{block}\n{m.group(3)}", text,
                     count=1)


def update(readme: pathlib.Path, results_dir: pathlib.Path, *,
           dry_run: bool = False, out=sys.stdout) -> int:
  """Returns the process exit status: 0 done, 1 nothing to insert, 2 the
  README lacks markers."""
  if not results_dir.is_dir():
    print(f"error: results directory {results_dir} does not exist", file=out)
    return 1
  if not readme.is_file():
    print(f"error: README {readme} does not exist", file=out)
    return 1
  blocks = {"results": results_block(results_dir, readme.parent),
            "ladder": ladder_block(results_dir, readme.parent)}
  blocks = {name: block for name, block in blocks.items() if block is not None}
  if not blocks:
    print(f"error: {results_dir} holds no summary.md or ladder.md; run "
          "experiments/benchmark.py with --output_dir there first", file=out)
    return 1
  text = readme.read_text()
  missing = []
  for name, block in blocks.items():
    spliced = splice(text, name, block)
    if spliced is None:
      missing.append(name)
    else:
      text = spliced
  if missing:
    for name in missing:
      print(f"--- would insert between <!-- BEGIN:{name} --> and "
            f"<!-- END:{name} -->:\n{blocks[name]}\n", file=out)
    print(f"error: {readme} has no marker pair for "
          f"{', '.join(missing)}: add '<!-- BEGIN:NAME -->' and "
          f"'<!-- END:NAME -->' lines where the table belongs, then run this "
          "again. Nothing was written.", file=out)
    return 2
  if dry_run:
    print(text, file=out)
    return 0
  readme.write_text(text)
  print(f"updated {', '.join(blocks)} in {readme} from {results_dir}", file=out)
  return 0


def default_results_dir(out=sys.stdout) -> pathlib.Path | None:
  """The one GPU folder under experiments/results/ holding suite results."""
  root = REPO_ROOT / "experiments" / "results"
  found = sorted(d for d in root.iterdir() if d.is_dir() and (
      any(d.glob("*/summary.md")) or (d / "ladder" / "ladder.md").is_file())
  ) if root.is_dir() else []
  if len(found) == 1:
    return found[0]
  print("error: name the results directory; "
        + (f"candidates: {', '.join(str(d) for d in found)}" if found
           else f"none with results under {root}"), file=out)
  return None


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("results_dir", type=pathlib.Path, nargs="?",
                      help="e.g. experiments/results/nvidia_h200: one "
                      "subdirectory per suite, as run_gpu.sh writes them "
                      "(default: the only such folder there is)")
  parser.add_argument("--readme", type=pathlib.Path,
                      default=REPO_ROOT / "README.md",
                      help="the README to update (default: the repo's)")
  parser.add_argument("--dry_run", action="store_true",
                      help="print the updated README instead of writing it")
  args = parser.parse_args(argv)
  results_dir = args.results_dir or default_results_dir()
  if results_dir is None:
    return 1
  return update(args.readme, results_dir, dry_run=args.dry_run)


if __name__ == "__main__":
  sys.exit(main())
