"""Does the order of the forward's (or dlhs's) tiles separate compute-bound
and memory-bound phases on the small experts' Zipf routing, and would an
order that mixes them be faster? A model, no GPU (issue #18).

    PYTHONPATH=. python experiments/lab/ragged_phase_model.py \
        --layers qwen3_30b_a3b_down,g64_t16384_k2048_n1408

Why: Nsight Compute found Qwen3-30B down's Zipf forward with as much tensor
time and as many DRAM bytes as its even one, yet 19 % slower, with the SMs
balanced over the whole kernel (`experiments/results/nvidia_h200/
ragged_options/`, 3f9c449's profiles). One explanation is phases: a large
expert's tiles fill whole waves of the persistent CTAs with compute-bound
work (its weight strips come from L2), while runs of small experts' tiles
read weights nobody else uses (bound by DRAM); over the whole kernel both
units are partly idle although neither is saturated on average.

The model walks the tiles in the kernel's order (the heuristic's config,
`mosaic_schedule.row_items`, bands per the kernel's `mosaic.tile_item`,
dealt round-robin to `--sms` CTAs) and runs them as a fluid: each SM works
through its tiles one after another; a tile needs its flops at the SM's
share of `--tflops` (the token width it runs at, `swap_ab`'s static widths
or the whole tile) and its DRAM bytes (its output; its weight strip and its
token rows the first time the walk touches them, later reads hit L2), and
at each moment the DRAM bandwidth (`--tbs`) is shared max-min fairly
between the SMs' demands. It prints the modelled time of each routing over
the even routing's, against the measured ratio where a results file is
given, and the time of two other orders over the walk's: one that deals
the tiles by cost, alternating between the walk's compute-heavy and
memory-heavy tiles (`mixed`), and one with the largest experts' tiles
first. A model:
with `--l2_tbs` the L2's bytes (every tile's weight strip, token rows
and output) are a second shared unit; it has no eviction and no per-tile
fixed cost.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

_ROOT = pathlib.Path(__file__).resolve().parents[2]
if str(_ROOT) not in sys.path:
  sys.path.insert(0, str(_ROOT))

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from experiments.lab.dispatch_holdout import hopper_device  # noqa: E402
from experiments.lab.moe_tally import load_cases  # noqa: E402
from experiments.lab.ragged_profile_case import find_case  # noqa: E402
from pallas_gemm.ragged_dot import arg_specs, configs  # noqa: E402
from pallas_gemm.ragged_dot import mosaic_schedule as schedule  # noqa: E402
from pallas_gemm.ragged_dot.mosaic import lhs_row_align, tile_item  # noqa: E402


def walk(case: arg_specs.MoeCase, device):
  """The kernel's tiles in walk order: dict of arrays (group, rows, width,
  n_idx, item) and the config."""
  problem = case.problem
  if problem.mode != "rows":
    raise SystemExit(f"{case.label}: the model covers the forward and dlhs "
                     "(rows mode) only")
  config = configs.heuristic(problem, device)
  table = np.asarray(schedule.row_items(
      jnp.asarray(case.group_sizes()), jnp.zeros((1,), jnp.int32), m=problem.m,
      tile_m=config.tile_m, row_align=lhs_row_align(config, problem),
      balanced=config.swap_ab))
  items = int(table[0, -1])
  cta_n = config.cta_tile("rows")[1]
  n_units = -(-problem.n // cta_n)
  # The kernel's own walk, over every tile at once.
  item, n_idx = (np.asarray(a) for a in tile_item(
      jnp.asarray(table), jnp.arange(items * n_units, dtype=jnp.int32),
      num_items=jnp.int32(items), n_units=n_units, config=config))
  group = table[schedule.ITEM_GROUP, item]
  rows = table[schedule.ITEM_ROW_HI, item] - table[schedule.ITEM_ROW_LO, item]
  if config.swap_ab:
    widths = np.array(sorted(config.token_widths()))
    width = widths[np.minimum(np.searchsorted(widths, rows), len(widths) - 1)]
  else:
    width = np.full_like(rows, config.tile_m)
  return dict(group=group, rows=rows, width=width, n_idx=n_idx,
              item=item), config


def tile_costs(tiles, problem, cta_n: int, sm_flops: float):
  """(seconds of compute at one SM's rate, DRAM bytes, L2 bytes) per tile,
  in walk order: an operand's first touch reads it from DRAM; every tile
  reads its whole weight strip and its token rows (at the width it runs)
  from L2 and writes its output through it."""
  in_size = jnp.dtype(problem.in_dtype).itemsize
  out_size = jnp.dtype(problem.out_dtype).itemsize
  k = problem.k
  compute = 2.0 * tiles["width"] * cta_n * k / sm_flops
  dram = tiles["rows"] * cta_n * out_size * 1.0
  seen_strips, seen_items = set(), set()
  for t, (g, n_idx, item, rows) in enumerate(zip(
      tiles["group"], tiles["n_idx"], tiles["item"], tiles["rows"])):
    if (g, n_idx) not in seen_strips:
      seen_strips.add((g, n_idx))
      dram[t] += k * cta_n * in_size
    if item not in seen_items:
      seen_items.add(item)
      dram[t] += rows * k * in_size
  l2 = (k * cta_n * in_size + tiles["width"] * k * in_size
        + tiles["rows"] * cta_n * out_size) * 1.0
  return compute, dram, l2


def strip_shared_by_pairs(tiles, strip_bytes: int):
  """L2 bytes saved per tile if each two neighbouring tiles of the walk with
  the same expert and column strip loaded the weight strip once between
  them (`--share_pairs`; the kernel has no such pairing)."""
  group, n_idx = tiles["group"], tiles["n_idx"]
  saved = np.zeros(len(group))
  t = 0
  while t < len(group) - 1:
    if group[t] == group[t + 1] and n_idx[t] == n_idx[t + 1]:
      saved[t] = saved[t + 1] = strip_bytes / 2
      t += 2
    else:
      t += 1
  return saved


def _water_fill(demands, total):
  """Max-min fair shares of `total` for `demands` (all positive)."""
  order = np.argsort(demands)
  shares = np.empty_like(demands)
  left, count = total, len(demands)
  for i in order:
    shares[i] = min(demands[i], left / count)
    left -= shares[i]
    count -= 1
  return shares


def fluid_time(compute, shared, order, sms: int) -> float:
  """Seconds for `sms` SMs to run the tiles `order` dealt round-robin,
  each SM one tile at a time. `shared`: (bytes per tile, bandwidth) of each
  shared unit (DRAM, L2), each shared max-min fairly between the SMs'
  demands; a tile runs at the slowest of its compute and its shares."""
  queues = [list(order[s::sms]) for s in range(sms)]
  heads = [0] * sms
  left = np.zeros(sms)  # fraction of the current tile still to run
  current = np.full(sms, -1)
  for s in range(sms):
    if queues[s]:
      current[s], left[s] = queues[s][0], 1.0
  now = 0.0
  while True:
    active = np.flatnonzero(current >= 0)
    if not len(active):
      return now
    tiles = current[active]
    full_rate = 1.0 / np.maximum(compute[tiles], 1e-30)  # tiles per second
    rate = full_rate.copy()
    for size, bandwidth in shared:
      demand = size[tiles] * full_rate
      needs = demand > 0
      if needs.any():
        shares = _water_fill(demand[needs], bandwidth)
        rate[needs] = np.minimum(rate[needs], shares / size[tiles][needs])
    finish = left[active] / rate
    step = finish.min()
    now += step
    left[active] -= rate * step
    for s in active[left[active] <= 1e-12]:
      heads[s] += 1
      if heads[s] < len(queues[s]):
        current[s], left[s] = queues[s][heads[s]], 1.0
      else:
        current[s] = -1


def mixed_order(compute, dram, bandwidth: float, sms: int):
  """The walk's tiles split into compute-heavy (their DRAM bytes take less
  than their compute at an SM's share of the bandwidth) and memory-heavy
  ones, each list in walk order, merged so that the two run side by side
  in proportion to their totals."""
  heavy = dram * sms / bandwidth > compute
  streams = [np.flatnonzero(~heavy), np.flatnonzero(heavy)]
  weights = [max(compute[s].sum(), 1e-30) for s in streams]
  out, taken, heads = [], [0.0, 0.0], [0, 0]
  while heads[0] < len(streams[0]) or heads[1] < len(streams[1]):
    pick = min((i for i in (0, 1) if heads[i] < len(streams[i])),
               key=lambda i: taken[i] / weights[i])
    t = streams[pick][heads[pick]]
    heads[pick] += 1
    taken[pick] += compute[t]
    out.append(t)
  return np.array(out)


def measured_times(paths):
  """case label -> measured µs, each case from the first file that has it
  (`moe_tally.load_cases`)."""
  return {label: rows[0]["time_ms"] * 1e3
          for label, rows in load_cases(paths).items()}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--layers", default="qwen3_30b_a3b_down",
                      help="comma-separated moe or moe_holdout layer names, "
                      "or g<groups>_t<rows>_k<k>_n<n>")
  parser.add_argument("--directions", default="forward",
                      help="comma-separated: forward, dlhs")
  parser.add_argument("--device", default="NVIDIA H200")
  parser.add_argument("--sms", type=int, default=132)
  parser.add_argument("--tflops", type=float, default=800.0,
                      help="the whole GPU's dense rate")
  parser.add_argument("--tbs", type=float, default=4.28,
                      help="DRAM bandwidth, TB/s")
  parser.add_argument("--l2_tbs", type=float, default=0.0,
                      help="L2-to-SM bandwidth, TB/s (0: no L2 limit)")
  parser.add_argument("--share_pairs", action="store_true",
                      help="add a column: the time if neighbouring items of "
                      "one expert and column strip shared its weight strip")
  parser.add_argument("--results", nargs="*", default=[],
                      help="moe results.json files with measured times")
  args = parser.parse_args(argv)
  for name in ("sms", "tflops", "tbs"):
    if getattr(args, name) <= 0:
      parser.error(f"--{name} must be positive, got {getattr(args, name)}")
  if args.l2_tbs < 0:
    parser.error(f"--l2_tbs must be 0 or positive, got {args.l2_tbs}")
  wanted = [name for name in args.layers.split(",") if name]
  directions = [d for d in args.directions.split(",") if d]
  bad = [d for d in directions if d not in ("forward", "dlhs")]
  if bad or not directions:
    parser.error(f"--directions: {args.directions!r} is not a list of "
                 "forward and dlhs")
  for name in wanted:
    try:  # the layers `ragged_profile_case.find_case` knows
      find_case(f"{name} even {directions[0]}")
    except SystemExit:
      parser.error(f"--layers: no moe layer {name!r}")
  device = hopper_device(args.device)
  measured = measured_times(args.results)
  sm_flops = args.tflops * 1e12 / args.sms
  bandwidth = args.tbs * 1e12
  print(f"Model: {args.tflops:g} TFLOP/s over {args.sms} SMs, DRAM "
        f"{args.tbs:g} TB/s, L2 " + (f"{args.l2_tbs:g} TB/s" if args.l2_tbs
                                     else "unlimited") + f"; {args.device}'s "
        "heuristic configs.\n")
  print("| case | tiles | memory-heavy share of compute | L2 GB "
        "| model µs | model / even | measured µs | measured / even "
        "| L2 TB/s at the measured time | mixed / walk "
        "| largest first / walk |"
        + (" pairs share strips / walk |" if args.share_pairs else ""))
  print("|---|---|---|---|---|---|---|---|---|---|---|"
        + ("---|" if args.share_pairs else ""))
  for name in wanted:
    for direction in directions:
      even_model = even_measured = None
      for distribution in arg_specs.DISTRIBUTIONS:
        case = find_case(f"{name} {distribution} {direction}")
        tiles, config = walk(case, device)
        cta_n = config.cta_tile("rows")[1]
        compute, dram, l2 = tile_costs(tiles, case.problem, cta_n, sm_flops)

        def units(dram, l2):
          """The shared units: DRAM, and the L2 if it is limited."""
          return [(dram, bandwidth)] + (
              [(l2, args.l2_tbs * 1e12)] if args.l2_tbs else [])

        shared = units(dram, l2)
        order = np.arange(len(compute))
        model = fluid_time(compute, shared, order, args.sms) * 1e6
        mixed = fluid_time(compute, shared,
                           mixed_order(compute, dram, bandwidth, args.sms),
                           args.sms) * 1e6
        heavy = dram * args.sms / bandwidth > compute
        # The walk with the largest experts' tiles first (each expert's in
        # walk order): the first touches move with the tiles.
        first = np.argsort(-case.group_sizes()[tiles["group"]], kind="stable")
        moved = {key: value[first] for key, value in tiles.items()}
        moved_compute, moved_dram, moved_l2 = tile_costs(
            moved, case.problem, cta_n, sm_flops)
        largest = fluid_time(moved_compute, units(moved_dram, moved_l2),
                             order, args.sms) * 1e6
        paired = ""
        if args.share_pairs:
          l2_paired = l2 - strip_shared_by_pairs(
              tiles, case.problem.k * cta_n
              * jnp.dtype(case.problem.in_dtype).itemsize)
          paired_time = fluid_time(compute, units(dram, l2_paired), order,
                                   args.sms) * 1e6
          paired = f" {paired_time / model:.3f} |"
        if distribution == "even":
          even_model, even_measured = model, measured.get(case.label)
        took = measured.get(case.label)
        measured_ratio = (f"{took / even_measured:.3f}"
                          if took and even_measured else "")
        l2_rate = f"{l2.sum() / took / 1e6:.1f}" if took else ""
        print(f"| {case.label} | {len(compute)} | "
              f"{compute[heavy].sum() / compute.sum():.2f} | "
              f"{l2.sum() / 1e9:.2f} | {model:.1f} | "
              f"{model / even_model:.3f} | {f'{took:.1f}' if took else ''} | "
              f"{measured_ratio} | {l2_rate} | {mixed / model:.3f} | "
              f"{largest / model:.3f} |"
              + paired)
  return 0


if __name__ == "__main__":
  sys.exit(main())
