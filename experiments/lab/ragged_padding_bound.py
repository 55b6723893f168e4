"""How much tensor work does the grouped GEMM's row granularity add to each
`moe` case, and what fraction of issue 18's roofline does that leave at
best?

    python3 experiments/lab/ragged_padding_bound.py \
        experiments/results/nvidia_h200/moe_63cd7b1/results.json

The kernels multiply whole tiles, so the token rows a case runs are its
group sizes rounded up to a granularity (each group's rows counted from its
first row rounded down to the 8 rows where a TMA load may start, as
`mosaic_schedule` cuts them):

- forward and dlhs ("rows" mode): row items of 128 rows (the heuristic's
  tile for experts of more than 96 rows), of 64 rows (wgmma's row group,
  the finest the token rows allow while they are wgmma's M), and of 8 rows
  (the token rows on wgmma's N side instead, whose step is 8);
- drhs ("contracting" mode): reduction chunks of 64 rows, the least
  Mosaic's wgmma takes where both operands are transposed (token rows are
  its K) at the 128-byte swizzle, and of 32 rows, which it takes at the
  64-byte one (`chunk32_probe.py`).

For each granularity the bound is roofline / max(memory time, compute time x
padding): the padded work at the dense rate, with every byte moved once.
The memory time is the roofline's bytes over the run's copy bandwidth;
the compute time is the roofline where that bound is compute, and otherwise
flops over the median dense rate of the run's compute-bound cases (an
estimate). No GPU: it reads the results file and the suite's group sizes.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys

import jax.numpy as jnp
import numpy as np

_ROOT = pathlib.Path(__file__).resolve().parents[2]
if str(_ROOT) not in sys.path:
  sys.path.insert(0, str(_ROOT))

from experiments.bench_moe import roofline_target  # noqa: E402
from experiments.lab.ragged_profile_case import find_case  # noqa: E402
from pallas_gemm.mosaic_backend import tma  # noqa: E402
from pallas_gemm.ragged_dot import mosaic_schedule as schedule  # noqa: E402
from pallas_gemm.ragged_dot.configs import SWIZZLE_ELEMS_16BIT  # noqa: E402

#: Rows where a TMA load of the token rows may start: one row tile of the
#: suite's bfloat16 operands in shared memory (`mosaic.lhs_row_align`).
ROW_ALIGN = tma.tma_tiling(SWIZZLE_ELEMS_16BIT, jnp.bfloat16)[0]
#: Granularities per direction: name, rows.
GRANULARITIES = {
    "forward": (("items of 128", 128), ("items of 64", 64), ("steps of 8", 8)),
    "dlhs": (("items of 128", 128), ("items of 64", 64), ("steps of 8", 8)),
    "drhs": (("chunks of 64", 64), ("chunks of 32", 32)),
}


def padding(sizes: np.ndarray, rows: int) -> float:
  """Token rows run / token rows: each non-empty group from its first row
  rounded down to ROW_ALIGN, in whole units of `rows`, counted by the
  kernels' own schedule (`mosaic_schedule.contracting_groups`, whose
  chunks the "rows" items match: cdiv(size + up to ROW_ALIGN - 1, rows))."""
  total = int(np.sum(sizes))
  table = schedule.contracting_groups(
      jnp.asarray(sizes, jnp.int32), jnp.zeros((1,), jnp.int32), m=total,
      chunk=rows, row_align=ROW_ALIGN)
  units = int(jnp.sum(table[schedule.GROUP_CHUNKS]))
  return units * rows / max(total, 1)


def bounds(results: dict):
  """Yields (case, [(granularity, padding, bound)]) for every measured
  case."""
  bandwidth = results["metadata"]["copy_bandwidth_tbs"] * 1e12
  ok = [r for r in results["results"] if r.get("status") == "ok"]
  dense_rate = statistics.median(
      r["flops"] / (r["roofline_ms"] * 1e-3) for r in ok
      if r["bound"] == "compute")
  for r in ok:
    memory_s = r["bytes"] / bandwidth
    compute_s = (r["roofline_ms"] * 1e-3 if r["bound"] == "compute"
                 else r["flops"] / dense_rate)
    sizes = find_case(r["case"]).group_sizes().astype(np.int64)
    rows = []
    for name, unit in GRANULARITIES[r["direction"]]:
      pad = padding(sizes, unit)
      best = r["roofline_ms"] * 1e-3 / max(memory_s, compute_s * pad)
      rows.append((name, pad, best))
    yield r, rows


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("results", type=pathlib.Path,
                      help="a moe results.json (experiments/bench_moe.py)")
  parser.add_argument("--misses", action="store_true",
                      help="only the cases below their target")
  args = parser.parse_args(argv)
  results = json.loads(args.results.read_text())
  print(f"{results['metadata']['device']}, git "
        f"{results['metadata']['git'][:7]}: padding (rows run / token "
        f"rows) and the best fraction of the roofline it leaves, against "
        f"the measured fraction and the target\n")
  columns = len(GRANULARITIES["forward"])
  print("| case | measured | target | " + " | ".join(
      f"{name}: padding, bound" for name, _ in GRANULARITIES["forward"])
        + " |")
  print("|---" * (3 + columns) + "|")
  reachable = {}
  for r, rows in bounds(results):
    bar = roofline_target(r["distribution"], r["direction"])
    for name, _, best in rows:
      reachable.setdefault(name, [0, 0])
      reachable[name][0] += best >= bar
      reachable[name][1] += 1
    if args.misses and r["roofline_fraction"] >= bar:
      continue
    cells = [f"{pad:.2f}, {best:.2f}" for _, pad, best in rows]
    if r["direction"] == "drhs":
      cells = [f"({name}) {cell}" for (name, _, _), cell in zip(rows, cells)]
      cells += [""] * (columns - len(cells))
    print(f"| {r['case']} | {r['roofline_fraction']:.2f} | {bar:.2f} | "
          + " | ".join(cells) + " |")
  print()
  for name, (passing, total) in reachable.items():
    print(f"{name}: the bound reaches the target on {passing} of {total} "
          f"cases")
  return 0


if __name__ == "__main__":
  sys.exit(main())
