"""Tables: the console table, summary.md and the ladder."""

from __future__ import annotations

import math
import statistics

import pathlib
import re
from typing import Sequence


from experiments.bench.cases import AUTO_NAME, BASELINE_NAME, HOPPER_NAME
from experiments.bench.runner import Measurement, _short_config, tflops_text

_REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------- reports ---

TABLE_COLUMNS = ("kernel", "shape", "dtype", "layout", "us", "TFLOP/s",
                 "% peak", "x jnp.dot", "config")


def _fmt(value, spec: str) -> str:
  return "-" if value is None else format(value, spec)



def table_cells(row: Measurement) -> list[str]:
  if row.status != "OK":
    return [row.kernel, row.shape, row.dtype_label, row.layout, row.status,
            "-", "-", "-", row.reason]
  return [row.kernel, row.shape, row.dtype_label, row.layout,
          _fmt(row.us, ".1f"), tflops_text(row.tflops),
          _fmt(row.pct_peak, ".1f"), _fmt(row.vs_jnp_dot, ".2f"),
          _short_config(row.config)]


def format_text_table(header: Sequence[str], body: Sequence[Sequence[str]]) -> str:
  widths = [max(len(str(x)) for x in column) for column in zip(header, *body)]
  def line(cells):
    return "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()
  return "\n".join([line(header), line(["-" * w for w in widths])]
                   + [line(r) for r in body])


def format_markdown_table(header: Sequence[str],
                          body: Sequence[Sequence[str]]) -> str:
  def escape(cell):
    return str(cell).replace("|", "\\|")
  lines = ["| " + " | ".join(escape(h) for h in header) + " |",
           "|" + "|".join("---" for _ in header) + "|"]
  lines += ["| " + " | ".join(escape(c) for c in r) + " |" for r in body]
  return "\n".join(lines)


def final_table(rows: Sequence[Measurement]) -> str:
  """The measured and failed rows; skipped ones are summarised once each."""
  shown = [table_cells(r) for r in rows if r.status != "SKIPPED"]
  text = format_text_table(TABLE_COLUMNS, shown) if shown else "(nothing ran)"
  skipped: dict[tuple[str, str], int] = {}
  for row in rows:
    if row.status == "SKIPPED":
      skipped[(row.kernel, row.reason)] = skipped.get((row.kernel, row.reason), 0) + 1
  if skipped:
    text += "\n\nSKIPPED:\n" + "\n".join(
        f"  {kernel} ({count}x): {reason}"
        for (kernel, reason), count in sorted(skipped.items()))
  return text


def summary_markdown(rows: Sequence[Measurement], device_kind: str) -> str:
  """TFLOP/s per shape (rows) and kernel (columns), per dtype and layout."""
  sections = []
  groups: dict[tuple[str, str], list[Measurement]] = {}
  for row in rows:
    groups.setdefault((row.dtype_label, row.layout), []).append(row)
  for (label, layout), group in groups.items():
    kernels = []
    for row in group:
      if row.status == "OK" and row.kernel not in kernels:
        kernels.append(row.kernel)
    if not kernels:
      continue
    shapes = []
    for row in group:
      if row.shape not in shapes:
        shapes.append(row.shape)
    cells = {(r.shape, r.kernel): r for r in group}
    body = []
    for shape in shapes:
      line = [shape]
      best = max((cells[(shape, k)].tflops or 0) for k in kernels
                 if (shape, k) in cells)
      for kernel in kernels:
        row = cells.get((shape, kernel))
        if row is None or row.status != "OK":
          line.append("—" if row is None or row.status == "SKIPPED" else "FAIL")
          continue
        text = tflops_text(row.tflops)
        line.append(f"**{text}**" if row.tflops == best else text)
      body.append(line)
    header = ["M×N×K"] + ["jnp.dot" if k == BASELINE_NAME else k for k in kernels]
    sections.append(f"TFLOP/s, {label}, layout {layout}, {device_kind} "
                    "(best per shape in bold; — unsupported, FAIL wrong result):\n\n"
                    + format_markdown_table(header, body))
  return "\n\n".join(sections) + "\n"


# ----------------------------------------------------------------- ladder ---

_RUNG_NUMBER = re.compile(r"(\d+)")


def ladder_group(kernel: str) -> str:
  """The ladder a kernel belongs to: its backend ("triton", "ffi", "mosaic").

  A backend's float32 and 16-bit rungs (ffi's sgemm_NN and mma_sync) land in
  different tables anyway, because each table is for one dtype.
  """
  return kernel.partition("/")[0]


def _rung_key(kernel: str):
  rest = kernel.partition("/")[2]
  number = _RUNG_NUMBER.search(rest)
  return (int(number.group(1)) if number else 10**6, kernel)


_GROUP_ORDER = ("triton", "ffi", "mosaic")


def ladder_markdown(rows: Sequence[Measurement], device_kind: str) -> str:
  """For each backend's ladder, shape and dtype: each rung's TFLOP/s, % of
  peak and gain over the previous rung that ran."""
  measured = [r for r in rows if r.kernel not in (BASELINE_NAME, HOPPER_NAME)]
  groups = sorted({ladder_group(r.kernel) for r in measured},
                  key=lambda g: (_GROUP_ORDER.index(g) if g in _GROUP_ORDER
                                 else len(_GROUP_ORDER), g))
  baselines = {(r.shape, r.dtype_label, r.layout): r for r in rows
               if r.kernel == BASELINE_NAME and r.status == "OK"}
  hopper = {(r.shape, r.dtype_label, r.layout): r for r in rows
            if r.kernel == HOPPER_NAME and r.status == "OK"}
  sections = []
  for group in groups:
    members = [r for r in measured if ladder_group(r.kernel) == group]
    keys = []
    for row in members:
      key = (row.shape, row.dtype_label, row.layout)
      if key not in keys:
        keys.append(key)
    for key in keys:
      rungs = sorted((r for r in members
                      if (r.shape, r.dtype_label, r.layout) == key),
                     key=lambda r: _rung_key(r.kernel))
      if not any(r.status == "OK" for r in rungs):
        continue  # e.g. an fp32-only ladder at bfloat16
      body, previous = [], None
      for row in rungs:
        if row.status == "SKIPPED":
          continue
        if row.status != "OK":
          body.append([row.kernel, "FAILED", "-", "-", row.reason[:80]])
          continue
        gain = "-" if previous is None else f"{row.tflops / previous:.2f}x"
        body.append([row.kernel, tflops_text(row.tflops), _fmt(row.pct_peak, ".1f"),
                     gain, _short_config(row.config)])
        previous = row.tflops
      for label, reference in (("jnp.dot (reference)", baselines.get(key)),
                               ("JAX hopper_matmul_mgpu (reference)",
                                hopper.get(key))):
        if reference is not None:
          body.append([label, tflops_text(reference.tflops),
                       _fmt(reference.pct_peak, ".1f"), "-",
                       _short_config(reference.config)])
      title = (f"**{group}** — {key[0]}, {key[1]}, {key[2]}, {device_kind}")
      sections.append(title + "\n\n" + format_markdown_table(
          ["rung", "TFLOP/s", "% peak", "gain vs previous rung", "config"], body))
  if not sections:
    return "(no ladder rung ran)\n"
  return "\n\n".join(sections) + "\n"


# ------------------------------------------------------------ auto regimes ---

#: A shape where the automatic choice runs below this fraction of jnp.dot
#: counts as a loss in the regime table.
LOSS_THRESHOLD = 0.97


def regime_stats(rows) -> dict[str, dict]:
  """Per regime (and "all"): count, geomean, median and min of
  auto/jnp.dot, and how many shapes fall below `LOSS_THRESHOLD`."""
  ratios: dict[str, list[float]] = {}
  same: dict[str, int] = {}
  for row in rows:
    if row.kernel == AUTO_NAME and row.status == "OK" and row.vs_jnp_dot:
      regime = row.regime or "-"
      ratios.setdefault(regime, []).append(row.vs_jnp_dot)
      same[regime] = same.get(regime, 0) + bool(
          getattr(row, "same_program_as_baseline", False))
  if ratios:
    ratios["all"] = [r for values in list(ratios.values()) for r in values]
    same["all"] = sum(same.values())
  stats = {}
  for regime, values in ratios.items():
    stats[regime] = {
        "count": len(values),
        "geomean": math.exp(sum(map(math.log, values)) / len(values)),
        "median": statistics.median(values),
        "min": min(values),
        "below": sum(1 for v in values if v < LOSS_THRESHOLD),
        "same_program": same.get(regime, 0),
    }
  return stats


def regime_markdown(rows, device_kind: str) -> str:
  """The `auto` row against jnp.dot, per regime of the wide suite."""
  stats = regime_stats(rows)
  if not stats:
    return ""
  header = ("regime", "shapes", "geomean", "median", "min",
            f"below {LOSS_THRESHOLD}x", "jnp.dot's own program")
  body = [[regime, str(s["count"]), f"{s['geomean']:.3f}x",
           f"{s['median']:.3f}x", f"{s['min']:.3f}x", str(s["below"]),
           str(s["same_program"])]
          for regime, s in stats.items()]
  paired = any(getattr(row, "paired_baseline_us", None) for row in rows)
  return (f"`auto` (kernel=None) / jnp.dot, {device_kind}. A shape where "
          "`auto` compiled to jnp.dot's very XLA program (the dispatch chose "
          "xla) counts as 1.0"
          + ("; the other ratios come from timings interleaved with "
             "jnp.dot's (--paired_timing)" if paired else "")
          + ":\n\n"
          + format_markdown_table(header, body) + "\n")
