"""How unevenly do the "contracting"-mode (drhs) tiles load the SMs, and
what would other tile orders give? A model, no GPU (issue #18).

    PYTHONPATH=. python experiments/lab/ragged_balance_model.py [--sms 132]

Each output tile of group g costs ceil(rows_g / chunk) steps plus
`--store_cost` steps for writing it (a tile's reduction runs over all its
group's rows); tiles are dealt to the persistent CTAs round-robin in the
kernel's order (`warp_specialised.for_each_tile`), in the CTA tiles and
chunks of the heuristic's config. With turn-taking consumers (`ping_pong`) a
CTA's slots alternate between its two consumers, each running its own tiles
one after another, so the load is that of each consumer. Printed: the
busiest CTA's (or consumer's) load over the mean (1.00 = balanced) for the
kernel's group-major order and for three alternatives: groups sorted by size
(largest first), the kernel's snake deal (`mosaic_schedule.snake_deal`:
every other whole round of CTAs, or with ping_pong of the CTAs' consumers,
dealt backwards), and both. No order helps a group that holds every token:
only splitting its reduction over CTAs does. The last two columns are
schedules the kernel does not have: each CTA takes a contiguous range of the
sorted tiles holding an equal share of the total cost (a cost-balanced deal,
stream-K's split at tile granularity), and the same after cutting every tile
into pieces of at most `--piece_steps` steps (each piece paying its own
store, the merge not counted).
"""

from __future__ import annotations

import argparse
import pathlib
import sys

_ROOT = pathlib.Path(__file__).resolve().parents[2]
if str(_ROOT) not in sys.path:
  sys.path.insert(0, str(_ROOT))

import numpy as np  # noqa: E402

from pallas_gemm.devices import DeviceInfo  # noqa: E402
from pallas_gemm.ragged_dot import arg_specs, configs, mosaic_schedule  # noqa: E402


def busiest_over_mean(costs: np.ndarray, sms: int, snake: bool,
                      consumers: int = 1) -> float:
  """The busiest worker's load over the mean when slot s of the
  round-robin deal (CTA s % sms; with `consumers` taking turns, consumer
  (s // sms) % consumers of it) runs tile s, or with `snake` the kernel's
  `mosaic_schedule.snake_deal(s)` over rounds of sms x consumers slots."""
  slots = np.arange(len(costs))
  tiles = (mosaic_schedule.snake_deal(slots, sms * consumers, len(costs))
           if snake else slots)
  load = np.zeros(sms * consumers)
  np.add.at(load, (slots % sms) * consumers + (slots // sms) % consumers,
            costs[np.asarray(tiles)])
  return float(load.max() / load.mean())


def contiguous_busiest_over_mean(costs: np.ndarray, sms: int) -> float:
  """The busiest CTA's load over the mean when CTA c takes the tiles whose
  cost prefix starts in [c, c + 1) x total / sms (contiguous ranges, in
  the given order)."""
  starts = np.concatenate([[0.0], np.cumsum(costs)[:-1]])
  owner = np.minimum((starts * sms / costs.sum()).astype(int), sms - 1)
  load = np.zeros(sms)
  np.add.at(load, owner, costs)
  return float(load.max() / load.mean())


def cut(steps: np.ndarray, piece_steps: int, store_cost: float) -> np.ndarray:
  """Tile costs after cutting each tile's `steps` reduction steps into
  pieces of at most `piece_steps`, each paying `store_cost`."""
  pieces = [np.full(int(np.ceil(s / piece_steps)) or 1, 0.0) for s in steps]
  out = []
  for s, p in zip(steps, pieces):
    sizes = np.minimum(piece_steps, s - piece_steps * np.arange(len(p)))
    out.append(np.maximum(sizes, 0) + store_cost)
  return np.concatenate(out)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--sms", type=int, default=132)
  parser.add_argument("--store_cost", type=float, default=2.0)
  parser.add_argument("--piece_steps", type=int, default=16)
  args = parser.parse_args(argv)
  print("layer distribution | group-major | sorted | snake | sorted+snake "
        "| balanced ranges | balanced ranges, pieces")
  device = DeviceInfo("gpu", "model", (9, 0), args.sms)
  for layer in arg_specs.MOE_LAYERS:
    for distribution in ("zipf", "one_hot"):
      case = arg_specs.MoeCase(layer, distribution, "drhs")
      config = configs.heuristic(case.problem, device)
      cta_k, cta_n = config.cta_tile("contracting")
      tiles_per_group = -(-layer.k // cta_k) * -(-layer.n // cta_n)
      cost = np.ceil(case.group_sizes() / config.tile_k) + args.store_cost
      orders = {"group-major": np.repeat(cost, tiles_per_group),
                "sorted": np.repeat(np.sort(cost)[::-1], tiles_per_group)}
      consumers = configs.NUM_CONSUMERS if config.ping_pong else 1
      cells = [busiest_over_mean(orders[order], args.sms, snake, consumers)
               for order, snake in (("group-major", False), ("sorted", False),
                                    ("group-major", True), ("sorted", True))]
      cells.append(contiguous_busiest_over_mean(orders["sorted"], args.sms))
      steps = np.repeat(np.sort(cost - args.store_cost)[::-1],
                        tiles_per_group)
      cells.append(contiguous_busiest_over_mean(
          cut(steps, args.piece_steps, args.store_cost), args.sms))
      print(f"{layer.name} {distribution} | "
            + " | ".join(f"{c:.2f}" for c in cells))


if __name__ == "__main__":
  main()
