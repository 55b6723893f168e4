"""Redraws a results folder's plots from its results.json (no GPU needed).

    python experiments/lab/replot.py experiments/results/nvidia_h200/decode

The data are the run's own; only the drawing is redone, e.g. after a fix to
the plotting code. The plots' titles say they were redrawn.
"""

from __future__ import annotations

import json
import pathlib
import sys

_REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(_REPO_ROOT))

from experiments.bench import plotting  # noqa: E402
from experiments.bench import output  # noqa: E402
from pallas_gemm.devices import peak_tflops  # noqa: E402


def replot(folder: pathlib.Path) -> list[pathlib.Path]:
  data = json.loads((folder / "results.json").read_text())
  meta, rows = data["metadata"], data["results"]
  on_gpu = meta.get("platform") == "gpu"
  timing = "CUPTI" if on_gpu else "interpret mode, not meaningful"
  title = (f"{meta['device']} — suite {meta['suite']} ({timing}) — git "
           f"{meta['git']} (redrawn from results.json)")
  written = []
  if plotting.plot_tflops_vs_size(rows, str(folder / "tflops.png"),
                                  title=title):
    written.append(folder / "tflops.png")
  if meta["suite"] == "decode":
    bandwidth, source = output.roofline_bandwidth(meta["device"],
                                                     measure=False)
    peaks = {row["dtype_label"]: peak_tflops(meta["device"], row["dtype"],
                                             row["precision"])
             for row in rows}
    if plotting.plot_roofline(rows, str(folder / "roofline.png"),
                              title="Roofline: " + title,
                              bandwidth_tbs=bandwidth,
                              bandwidth_source=source, peaks=peaks):
      written.append(folder / "roofline.png")
  return written


def main(argv) -> int:
  if len(argv) < 2:
    print("usage: python experiments/lab/replot.py RESULTS_FOLDER...", file=sys.stderr)
    return 2
  for name in argv[1:]:
    folder = pathlib.Path(name)
    if not (folder / "results.json").is_file():
      print(f"error: {folder} has no results.json", file=sys.stderr)
      return 2
    for path in replot(folder):
      print(f"wrote {path}")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
