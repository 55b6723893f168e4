"""PNG plots for the benchmark: TFLOP/s against size, and a decode roofline.

Both functions take the benchmark's result rows as plain dicts (the same
records that go into results.json) so that a plot can be redrawn later from a
saved JSON file without running anything.
"""

from __future__ import annotations

import collections
import math
from typing import Iterable, Sequence

import matplotlib

matplotlib.use("Agg")  # no display on CI machines or the GPU box
import matplotlib.pyplot as plt  # noqa: E402

BASELINE_LABELS = {"xla": "jnp.dot (xla)", "jax_hopper": "JAX hopper_matmul_mgpu"}


def _label(kernel: str) -> str:
  return BASELINE_LABELS.get(kernel, kernel)


def _group_key(row) -> str:
  return f"{row['dtype_label']} {row['layout']}"


def _ok_rows(rows: Iterable[dict]) -> list[dict]:
  return [r for r in rows if r.get("status") == "OK" and r.get("tflops")]


def _subplot_grid(count: int):
  cols = min(count, 2)
  rows = math.ceil(count / cols)
  fig, axes = plt.subplots(rows, cols, figsize=(7.5 * cols, 4.8 * rows),
                           squeeze=False)
  flat = [ax for line in axes for ax in line]
  for ax in flat[count:]:
    ax.set_visible(False)
  return fig, flat


def _panels(rows: Sequence[dict]):
  """(figure, axes, sorted (group, rows)) with one panel per dtype/layout
  group of the succeeded rows; None when no row succeeded."""
  ok = _ok_rows(rows)
  if not ok:
    return None
  groups = collections.defaultdict(list)
  for row in ok:
    groups[_group_key(row)].append(row)
  fig, axes = _subplot_grid(len(groups))
  return fig, axes, sorted(groups.items())


def _finish_panel(ax, group: str, *, which: str) -> None:
  ax.set_title(group)
  ax.grid(True, which=which, alpha=0.3)
  ax.legend(fontsize=7, loc="best")


def _save(fig, path: str, title: str) -> bool:
  fig.suptitle(title, fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return True


def plot_tflops_vs_size(rows: Sequence[dict], path: str, *, title: str) -> bool:
  """One line per kernel over the shapes (sorted by flops); one panel per
  dtype/layout. Returns False (and writes nothing) when no row succeeded."""
  panels = _panels(rows)
  if panels is None:
    return False
  fig, axes, groups = panels
  for ax, (group, group_rows) in zip(axes, groups):
    shapes = sorted({(r["flops"], r["shape"]) for r in group_rows})
    position = {shape: i for i, (_, shape) in enumerate(shapes)}
    by_kernel = collections.defaultdict(list)
    for row in group_rows:
      by_kernel[row["kernel"]].append((position[row["shape"]], row["tflops"]))
    values = [r["tflops"] for r in group_rows]
    for kernel in sorted(by_kernel, key=lambda k: (k not in BASELINE_LABELS, k)):
      points = sorted(by_kernel[kernel])
      style = "--" if kernel in BASELINE_LABELS else "-"
      ax.plot([p[0] for p in points], [p[1] for p in points], style,
              marker="o", markersize=4, label=_label(kernel))
    ax.set_xticks(range(len(shapes)))
    ax.set_xticklabels([s for _, s in shapes], rotation=35, ha="right",
                       fontsize=7)
    # Ladder rungs span orders of magnitude; a log axis keeps the slow ones
    # visible next to the fast ones.
    if min(values) > 0 and max(values) / min(values) > 50:
      ax.set_yscale("log")
    ax.set_ylabel("TFLOP/s")
    ax.set_xlabel("M x N x K (sorted by flops)")
    _finish_panel(ax, group, which="major")
  return _save(fig, path, title)


def plot_roofline(rows: Sequence[dict], path: str, *, title: str,
                  bandwidth_tbs: float | None, bandwidth_source: str,
                  peaks: dict[str, float | None]) -> bool:
  """Achieved TFLOP/s against arithmetic intensity (flops per byte of the
  minimal memory traffic), under the memory and compute roofs.

  `peaks` maps a row's dtype_label to its compute ceiling in TFLOP/s (None
  when unknown, e.g. on a CPU: the roof is then left out).
  """
  panels = _panels(rows)
  if panels is None:
    return False
  fig, axes, groups = panels
  for ax, (group, group_rows) in zip(axes, groups):
    intensities = [r["flops"] / r["min_bytes"] for r in group_rows]
    lo, hi = min(intensities) / 2, max(intensities) * 4
    peak = peaks.get(group_rows[0]["dtype_label"])
    xs = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    if bandwidth_tbs:
      roof = [bandwidth_tbs * x if peak is None else min(peak, bandwidth_tbs * x)
              for x in xs]
      ax.plot(xs, roof, "k-", linewidth=1.5,
              label=f"roof: {bandwidth_tbs:.2f} TB/s ({bandwidth_source})"
              + ("" if peak is None else f", {peak:g} TFLOP/s"))
    elif peak is not None:
      ax.axhline(peak, color="k", linewidth=1.5, label=f"peak {peak:g} TFLOP/s")
    by_kernel = collections.defaultdict(list)
    for row, intensity in zip(group_rows, intensities):
      by_kernel[row["kernel"]].append((intensity, row["tflops"]))
    markers = "os^vD<>phx*+"
    for i, kernel in enumerate(sorted(by_kernel)):
      points = by_kernel[kernel]
      ax.scatter([p[0] for p in points], [p[1] for p in points],
                 marker=markers[i % len(markers)], s=28, label=_label(kernel))
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (flop / byte of minimal traffic)")
    ax.set_ylabel("TFLOP/s")
    _finish_panel(ax, group, which="both")
  return _save(fig, path, title)
