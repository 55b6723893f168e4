"""Does `mosaic/split_k` beat cuBLAS on few-tile problems, and does its
cost model pick the right config? (issue 15's `small` and `batched`
regimes)

The problems are drawn like the dispatch builder's training set, from
seeds of their own (`--seed`, default 7; not the `wide` suite the dispatch
is judged on): M 136-2048, N 64-2048, K 64-4096 log-uniform, a third of
them batched (2-64), each kept if its 128x128 output tiles number fewer
than the SMs (`split_k.supports`). For each, `xla`, `mosaic/ws_persistent`
(its resolved config) and `mosaic/split_k` with the heuristic's config and
the `--alternatives` cheapest other candidates of its cost model are timed
the builder's way (`build_dispatch_table.time_kernel`: CUPTI kernel time,
median over operand sets rotated past L2), each checked against float64
first. One line per problem: xla's time, every kernel's speed-up over it,
the model's rank of the fastest split_k config.

    PYTHONPATH=. python3 experiments/lab/split_k_probe.py [--count 24] \\
        [--seed 7] [--alternatives 4] [--max_seconds 200]

`--sweep FILE` times every config of a fixed grid instead (`SWEEP_TILES` x
`SWEEP_SPLITS`, each with the deepest ring that fits), no ws_persistent,
and appends one JSON line per problem to FILE: the data
`split_k_model_fit.py` replays the cost model's choices against.

On a CPU it checks one tiny problem in interpret mode and times nothing.
"""

from __future__ import annotations

import argparse
import functools
import pathlib
import random
import sys
import time

_ROOT = pathlib.Path(__file__).resolve().parents[2]
if str(_ROOT) not in sys.path:
  sys.path.insert(0, str(_ROOT))


import pallas_gemm  # noqa: E402
from experiments import build_dispatch_table as builder  # noqa: E402
from pallas_gemm import numerics, timing  # noqa: E402
from pallas_gemm.mosaic_backend import heuristics, split_k  # noqa: E402
from pallas_gemm.problem import GemmProblem  # noqa: E402


def draw(seed: int, count: int, device) -> list[GemmProblem]:
  rng = random.Random(seed)
  size = functools.partial(builder._log_uniform, rng)
  out = []
  while len(out) < count:
    batch = rng.choice((1, 1, 2, 4, 8, 16, 32, 64))
    problem = GemmProblem(batch, size(136, 2048, 8), size(64, 2048, 8),
                          size(64, 4096, 8), "bfloat16", "bfloat16")
    if split_k.supports(problem, device) is None:
      out.append(problem)
  return out


def within_budget(problems, max_seconds: float):
  """(number, problem) for each problem until `max_seconds` have passed,
  then a line saying how many were left."""
  start = time.perf_counter()
  for number, problem in enumerate(problems, 1):
    if time.perf_counter() - start > max_seconds:
      print(f"--max_seconds={max_seconds:g} spent; "
            f"{len(problems) - number + 1} problems left", flush=True)
      return
    yield number, problem


#: The grid `--sweep` times on every problem.
SWEEP_TILES = ((128, 128), (128, 64), (64, 128), (64, 64))
SWEEP_SPLITS = (1, 2, 3, 4, 6, 8)


def sweep_grid(problem: GemmProblem) -> list:
  """The `--sweep` configs that fit: each tile and split count with the
  deepest ring that fits, as `heuristics.split_k_candidates` builds them."""
  return [c for c in heuristics.split_k_candidates(problem)
          if (c.tile_m, c.tile_n) in SWEEP_TILES
          and c.k_splits in SWEEP_SPLITS]


def sweep(problems, device, args, tolerance) -> None:
  import dataclasses
  import json
  for number, problem in within_budget(problems, args.max_seconds):
    chosen = split_k.heuristic(problem, device)
    error = check(problem, split_k.NAME, chosen)
    if not error <= tolerance:
      print(f"  {problem.describe()} [{chosen}]: WRONG, relative error "
            f"{error:.2e}", flush=True)
      continue
    xla_ms, _ = builder.time_kernel(problem, "xla", device, args.iters)
    timed = []
    for config in sweep_grid(problem):
      ms, _ = builder.time_kernel(problem, split_k.NAME, device, args.iters,
                                  config)
      timed.append({"config": dataclasses.asdict(config), "us": ms * 1e3})
    best = min(timed, key=lambda t: t["us"])
    heuristic = dataclasses.asdict(chosen)
    mine = next((t for t in timed if t["config"] == heuristic), None)
    row = {"problem": problem.describe(), "batch": problem.batch,
           "m": problem.m, "n": problem.n, "k": problem.k,
           "device": device.device_kind, "xla_us": xla_ms * 1e3,
           "heuristic": heuristic, "timed": timed}
    with open(args.sweep, "a") as f:
      f.write(json.dumps(row) + "\n")
    print(f"[{number}/{len(problems)}] {problem.describe()}: xla "
          f"{xla_ms * 1e3:.1f} us; best {xla_ms * 1e3 / best['us']:.3f}x "
          f"{best['config']['tile_m']}x{best['config']['tile_n']} "
          f"splits {best['config']['k_splits']}; heuristic "
          + (f"{xla_ms * 1e3 / mine['us']:.3f}x" if mine else "off the grid"),
          flush=True)


def check(problem: GemmProblem, kernel: str, config) -> float:
  a, b, _, _ = timing.random_operands(problem, seed=0)
  if problem.batch == 1:
    a, b = a[0], b[0]
  out = pallas_gemm.matmul(a, b, kernel=kernel, config=config)
  ref = numerics.reference_matmul(a, b)
  return numerics.relative_error(out, ref)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--seed", type=int, default=7)
  parser.add_argument("--count", type=int, default=24)
  parser.add_argument("--alternatives", type=int, default=4)
  parser.add_argument("--iters", type=int, default=20)
  parser.add_argument("--max_seconds", type=float, default=200.0)
  parser.add_argument("--sweep", default="",
                      help="time the whole config grid; JSON lines to this "
                      "file")
  args = parser.parse_args(argv)
  if args.count < 1 or args.alternatives < 0:
    raise SystemExit("--count must be >= 1 and --alternatives >= 0")
  device = pallas_gemm.device_info()
  tolerance = numerics.tolerance("bfloat16", "default", "bfloat16")
  if not device.is_gpu:
    problem = GemmProblem(1, 136, 72, 200, "bfloat16", "bfloat16")
    config = split_k.heuristic(problem, device)
    error = check(problem, split_k.NAME, config)
    print(f"{problem.describe()} [{config}]: relative error {error:.1e} "
          f"({'ok' if error <= tolerance else 'WRONG'}); timing needs a GPU")
    return
  problems = draw(args.seed, args.count, device)
  if args.sweep:
    sweep(problems, device, args, tolerance)
    return
  for number, problem in within_budget(problems, args.max_seconds):
    chosen = split_k.heuristic(problem, device)
    ranked = sorted(heuristics.split_k_candidates(problem),
                    key=lambda c: heuristics.split_k_cost(
                        problem, c, device.num_sms))
    configs = [chosen] + [c for c in ranked if c != chosen][
        :args.alternatives]
    xla_ms, _ = builder.time_kernel(problem, "xla", device, args.iters)
    ws_ms, _ = builder.time_kernel(problem, "mosaic/ws_persistent", device,
                                   args.iters)
    results = []
    for config in configs:
      error = check(problem, split_k.NAME, config)
      if not error <= tolerance:
        print(f"  {problem.describe()} [{config}]: WRONG, relative error "
              f"{error:.2e}", flush=True)
        continue
      ms, _ = builder.time_kernel(problem, split_k.NAME, device, args.iters,
                                  config)
      results.append((ms, config))
    if not results:
      continue
    best_ms, best = min(results, key=lambda r: r[0])
    rank = ranked.index(best) if best in ranked else -1
    print(f"[{number}/{len(problems)}] {problem.describe()}: xla "
          f"{xla_ms * 1e3:.1f} us; ws_persistent {xla_ms / ws_ms:.3f}x; "
          f"split_k heuristic {xla_ms / results[0][0]:.3f}x "
          f"(tile {chosen.tile_m}x{chosen.tile_n}, splits {chosen.k_splits}, "
          f"model {heuristics.split_k_cost(problem, chosen, device.num_sms):.1f}"
          f" us); best {xla_ms / best_ms:.3f}x (tile {best.tile_m}x"
          f"{best.tile_n}, splits {best.k_splits}, model rank {rank})",
          flush=True)


if __name__ == "__main__":
  main()
