"""How unevenly do the "contracting"-mode (drhs) tiles load the SMs, and
what would other tile orders give? A model, no GPU (issue #18).

    PYTHONPATH=. python experiments/lab/ragged_balance_model.py [--sms 132]

Each output tile of group g costs ceil(rows_g / chunk) steps plus
`--store_cost` steps for writing it (a tile's reduction runs over all its
group's rows); tiles are dealt to the persistent CTAs round-robin in the
kernel's order (`warp_specialised.for_each_tile`), in the CTA tiles and chunks of the
heuristic's config. Printed: the busiest
CTA's load over the mean (1.00 = balanced) for the kernel's group-major
order and for three alternatives: groups sorted by size (largest first),
the kernel's snake deal (`mosaic_schedule.snake_deal`: every other whole
round of CTAs dealt backwards), and both. No
order helps a group that holds every token: only splitting its reduction
over CTAs does.
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


def busiest_over_mean(costs: np.ndarray, sms: int, snake: bool) -> float:
  """The busiest CTA's load over the mean when slot s of the round-robin
  deal (CTA s % sms) runs tile s, or with `snake` the kernel's
  `mosaic_schedule.snake_deal(s)`."""
  slots = np.arange(len(costs))
  tiles = mosaic_schedule.snake_deal(slots, sms, len(costs)) if snake else slots
  load = np.zeros(sms)
  np.add.at(load, slots % sms, costs[np.asarray(tiles)])
  return float(load.max() / load.mean())


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--sms", type=int, default=132)
  parser.add_argument("--store_cost", type=float, default=2.0)
  args = parser.parse_args(argv)
  print("layer distribution | group-major | sorted | snake | sorted+snake")
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
      cells = [busiest_over_mean(orders[order], args.sms, snake)
               for order, snake in (("group-major", False), ("sorted", False),
                                    ("group-major", True), ("sorted", True))]
      print(f"{layer.name} {distribution} | "
            + " | ".join(f"{c:.2f}" for c in cells))


if __name__ == "__main__":
  main()
