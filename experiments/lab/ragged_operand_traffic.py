"""How many bytes does each weight-gradient (drhs) case move between L2 and
the SMs under its config, and at what rate did a run move them?

    python3 experiments/lab/ragged_operand_traffic.py \
        experiments/results/nvidia_h200/moe_a21e353/suite/run_*/results.json

A "contracting"-mode tile loads, for every reduction chunk of its group, a
(chunk, CTA rows) block of lhs and a (chunk, CTA columns) block of dout into
shared memory, and stores its (CTA rows, CTA columns) output once. So a case
loads sum over groups of chunks x tiles per group x stage bytes, where the
chunks are counted by the kernel's own schedule
(`mosaic_schedule.contracting_groups`) and the tile is the config the
heuristic picks on the run's GPU (`configs.heuristic`). Those loads come from
L2 (an operand byte is fetched from DRAM about once), and with the output
stores they are the traffic between L2 and the SMs; this divides it by the
measured time.

The question it asks: does a case move as much as the busiest cases do?
Runs whose configs keep the tensor cores busy move 9-11 TB/s this way on an
H200; a case at that rate with few flops per byte loaded (a narrow tile, a
short reduction) may need fewer bytes per flop to get faster, and one well
below it is held by something else (experiments/results/nvidia_h200/
ragged_options, "What the weight gradient's operand traffic says").

No GPU: it reads results files and the suite's group sizes. 2-CTA
clusters (`cluster_columns`, `cluster_rows`) are counted as if each CTA
loaded its whole shared block (lhs's or dout's); the heuristic picks
neither today.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys

import jax.numpy as jnp

_ROOT = pathlib.Path(__file__).resolve().parents[2]
if str(_ROOT) not in sys.path:
  sys.path.insert(0, str(_ROOT))

from experiments.lab.dispatch_holdout import hopper_device  # noqa: E402
from experiments.lab.ragged_padding_bound import ROW_ALIGN  # noqa: E402
from experiments.lab.ragged_profile_case import find_case  # noqa: E402
from pallas_gemm.ragged_dot import configs  # noqa: E402
from pallas_gemm.ragged_dot import mosaic_schedule as schedule  # noqa: E402


def traffic(case, config) -> tuple[int, int]:
  """(operand bytes loaded into shared memory, output bytes stored) of a
  "contracting"-mode `case` (a `MoeCase`) under `config`."""
  problem = case.problem
  sizes = case.group_sizes()
  table = schedule.contracting_groups(
      jnp.asarray(sizes, jnp.int32), jnp.zeros((1,), jnp.int32),
      m=problem.m, chunk=config.tile_k, row_align=ROW_ALIGN)
  chunks = int(jnp.sum(table[schedule.GROUP_CHUNKS]))
  cta_m, cta_n = config.cta_tile("contracting")
  tiles = math.ceil(problem.k / cta_m) * math.ceil(problem.n / cta_n)
  in_size = jnp.dtype(problem.in_dtype).itemsize
  stage = (cta_m + cta_n) * config.tile_k * in_size
  out = (problem.groups * problem.k * problem.n
         * jnp.dtype(problem.out_dtype).itemsize)
  return chunks * tiles * stage, out


def rows(results_files):
  """Yields (result, config, operand bytes, output bytes) for every drhs
  case measured in `results_files`."""
  for path in results_files:
    results = json.loads(pathlib.Path(path).read_text())
    device = hopper_device(results["metadata"]["device"])
    for r in results["results"]:
      if r.get("status") != "ok" or r["direction"] != "drhs":
        continue
      case = find_case(r["case"])
      config = configs.heuristic(case.problem, device)
      yield (r, config, *traffic(case, config))


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("results", type=pathlib.Path, nargs="+",
                      help="moe results.json files (experiments/bench_moe.py)")
  args = parser.parse_args(argv)
  print("| case | CTA tile | turns | operand GB | output GB | operand "
        "TB/s | operand + output TB/s | KB loaded per MFLOP | fraction "
        "of the roofline |")
  print("|---" * 9 + "|")
  for r, config, operand, out in rows(args.results):
    seconds = r["time_ms"] * 1e-3
    cta_m, cta_n = config.cta_tile("contracting")
    print(f"| {r['case']} | {cta_m} x {cta_n} | "
          f"{'yes' if config.ping_pong else 'no'} | {operand / 1e9:.2f} | "
          f"{out / 1e9:.2f} | {operand / seconds / 1e12:.2f} | "
          f"{(operand + out) / seconds / 1e12:.2f} | "
          f"{operand / 1e3 / (r['flops'] / 1e6):.1f} | "
          f"{r['roofline_fraction']:.3f} |")
  return 0


if __name__ == "__main__":
  sys.exit(main())
