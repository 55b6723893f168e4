"""Fits `pallas_gemm.ragged_dot.cost_model`'s terms to measured draws of
`random_ragged_sweep.py`, and replays the shipped terms' choice (no GPU).

    PYTHONPATH=. python3 experiments/lab/ragged_cost_fit.py \
        [--train_seeds 0,1,2,3,4] [FILES...]

FILES are the sweeps' tables (default: every `seed*.txt` and
`kernels_seed*.txt` of experiments/results/nvidia_h200/random_ragged, the
latter `--kernels_too` sweeps whose `mosaic` column is the kernels' time,
and the small sweeps of `small_ragged_sweep.py` at the current rules, as
seed 0). Draws of the train seeds fit the terms (least squares on
relative error, no term negative: the features are
`cost_model.mosaic_features` and `xla_features`, at the heuristic's config
for an H200); the other seeds' draws are held out. For
the fitted and for the shipped terms it prints each way's median error and,
at `cost_model.XLA_MARGIN` on the estimates as the choice weighs them
(`cost_model.choice_estimates`), what the choice would have cost: how
many draws stay slower than lax, the worst and geometric-mean time over
the faster way's (regret), and how many draws switch to XLA where the
kernels were faster (wrong switches).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import pathlib
import re
import sys

import numpy as np

_ROOT = pathlib.Path(__file__).resolve().parents[2]
if str(_ROOT) not in sys.path:
  sys.path.insert(0, str(_ROOT))

from experiments.lab import ragged_lab_common as common  # noqa: E402
from experiments.lab.dispatch_holdout import hopper_device  # noqa: E402
from pallas_gemm.ragged_dot import arg_specs, cost_model  # noqa: E402
from pallas_gemm.ragged_dot import mosaic as mosaic_kernels  # noqa: E402

#: The random draws (seeds 1-6), then `small_ragged_sweep.py`'s grids of
#: square experts at the heuristic's current rules (seed 0: no seed).
DEFAULT_FILES = (
    "experiments/results/nvidia_h200/random_ragged/seed*.txt",
    "experiments/results/nvidia_h200/moe_edges/small_sweep_drhs_90cb913.txt",
    "experiments/results/nvidia_h200/moe_edges/"
    "small_sweep_long_drhs_90cb913.txt",
    "experiments/results/nvidia_h200/moe_edges/"
    "small_sweep_one_group_c3413a6.txt",
    "experiments/results/nvidia_h200/moe_edges/small_sweep_rows_eb88ab3.txt",
    # `random_ragged_sweep.py --kernels_too`: the kernels timed at the
    # configs of their commit, also where `auto` ran XLA.
    "experiments/results/nvidia_h200/random_ragged/kernels_seed*.txt")
ROW = re.compile(r"\| (?:\d+ )?g(\d+) m(\d+) (?:k(\d+) n(\d+)|k=n(\d+)) "
                 r"(\w+) (\w+) \| ([\d.]+) \| ([\d.]+) \|")
#: A `--kernels_too` table's row: lax, auto, then the kernels' time.
KERNELS_ROW = re.compile(ROW.pattern + r" ([\d.]+) \|")
KERNELS_HEADER = "| case | lax (us) | auto (us) | mosaic (us) |"
SEED = re.compile(r"seed (\d+)")


@dataclasses.dataclass(frozen=True)
class Draw:
  """One timed problem. `auto_us` is the kernels' time: `auto`'s in the
  sweeps where it always ran them, else the `mosaic` column's, measured
  at the configs of that run's commit (`at_run_config`)."""
  seed: int
  problem: object
  lax_us: float
  auto_us: float
  at_run_config: bool = False


def read_draws(paths) -> list[Draw]:
  draws = []
  for path in paths:
    text = pathlib.Path(path).read_text()
    if not text.splitlines()[0].rstrip().endswith(", bfloat16"):
      # The terms are bfloat16 terms: float16 inputs or a float32 output
      # move other bytes.
      print(f"# {path}: not bfloat16 in and out, left out")
      continue
    seed = SEED.search(text)
    kernels_column = KERNELS_HEADER in text
    for match in (KERNELS_ROW if kernels_column else ROW).finditer(text):
      g, m = int(match.group(1)), int(match.group(2))
      k = int(match.group(3) or match.group(5))
      n = int(match.group(4) or match.group(5))
      case = arg_specs.MoeCase(arg_specs.MoeLayer("draw", g, m, k, n),
                               "even", match.group(7))
      draws.append(Draw(int(seed.group(1)) if seed else 0, case.problem,
                        float(match.group(8)),
                        float(match.group(10 if kernels_column else 9)),
                        at_run_config=kernels_column))
  return draws


def nonnegative_least_squares(a: np.ndarray, b: np.ndarray) -> np.ndarray:
  """min |a x - b| with x >= 0: least squares, dropping the most negative
  term until none is negative (enough for a handful of terms)."""
  active = list(range(a.shape[1]))
  while True:
    x = np.zeros(a.shape[1])
    x[active] = np.linalg.lstsq(a[:, active], b, rcond=None)[0]
    if x.min() >= 0:
      return x
    active.remove(int(np.argmin(x)))


def _draw_config(draw, device):
  """The config `draw`'s kernels ran at: for a `--kernels_too` draw,
  today's heuristic's (right while the heuristic has not changed since the
  commit it ran at), else `_config`."""
  if draw.at_run_config:
    return mosaic_kernels.heuristic(draw.problem, device)
  return _config(draw.problem, device)


@functools.lru_cache(maxsize=None)
def _config(problem, device):
  """The config a draw ran at, once per problem: the fit and every replay
  weigh the same draws. That is the heuristic's, except where it now
  splits the reduction (`RaggedConfig.split_k`, after every draw here
  ran): there the config the heuristic gave before, which the draw
  measured."""
  return common.unsplit_config(problem, device)


def fit(draws, device):
  """(mosaic terms, {form: xla terms}) fitted to `draws`."""
  def solve(rows, features, key):
    a = np.array([features(d) for d in rows])
    y = np.array([getattr(d, key) for d in rows])
    return nonnegative_least_squares(a / y[:, None], np.ones_like(y))
  mosaic = solve(draws, lambda d: cost_model.mosaic_features(
      d.problem, mosaic_kernels, _draw_config(d, device), device),
      "auto_us")
  xla = {form: solve([d for d in draws if cost_model.form(d.problem) == form],
                     lambda d: cost_model.xla_features(d.problem, device),
                     "lax_us")
         for form in cost_model.XLA_TERMS}
  return tuple(mosaic), {form: tuple(t) for form, t in xla.items()}


def replay(draws, device, mosaic_terms, xla_terms, margin):
  """Statistics of the choice these terms make on `draws` (see the module
  docstring)."""
  stats = dict(draws=len(draws), mosaic_errors=[], xla_errors=[],
               slower_before=0, slower_after=0, regret_before=[],
               regret_after=[], wrong_switches=0, switches=0)
  for d in draws:
    config = _draw_config(d, device)
    terms = dict(mosaic_terms=mosaic_terms, xla_terms=xla_terms)
    mosaic, xla = cost_model.estimated_us(d.problem, mosaic_kernels, config,
                                          device, **terms)
    stats["mosaic_errors"].append(abs(mosaic / d.auto_us - 1))
    stats["xla_errors"].append(abs(xla / d.lax_us - 1))
    switch = cost_model.xla_chosen(*cost_model.choice_estimates(
        d.problem, mosaic_kernels, config, device, **terms), margin)
    chosen = d.lax_us if switch else d.auto_us
    best = min(d.lax_us, d.auto_us)
    stats["switches"] += switch
    stats["wrong_switches"] += switch and d.auto_us < d.lax_us
    stats["slower_before"] += d.auto_us > 1.05 * d.lax_us
    stats["slower_after"] += chosen > 1.05 * d.lax_us
    stats["regret_before"].append(d.auto_us / best)
    stats["regret_after"].append(chosen / best)
  return stats


def summary(stats) -> str:
  geo = lambda values: float(np.exp(np.mean(np.log(values))))
  return (f"{stats['draws']} draws: median error mosaic "
          f"{np.median(stats['mosaic_errors']):.2f}, xla "
          f"{np.median(stats['xla_errors']):.2f}; slower than lax by >5 %: "
          f"{stats['slower_before']} -> {stats['slower_after']}; worst regret "
          f"{max(stats['regret_before']):.2f} -> "
          f"{max(stats['regret_after']):.2f}; geometric mean "
          f"{geo(stats['regret_before']):.3f} -> "
          f"{geo(stats['regret_after']):.3f}; {stats['switches']} switched "
          f"to xla, {stats['wrong_switches']} of them wrongly")


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("files", nargs="*")
  parser.add_argument("--train_seeds", default="0,1,2,3,4")
  args = parser.parse_args(argv)
  files = args.files or [str(p) for pattern in DEFAULT_FILES
                         for p in sorted(_ROOT.glob(pattern))]
  if not files:
    raise SystemExit(f"no sweep tables given and none at {DEFAULT_FILES}")
  try:
    train_seeds = {int(v) for v in args.train_seeds.split(",")}
  except ValueError:
    raise SystemExit(f"--train_seeds={args.train_seeds!r} must be "
                     "comma-separated integers")
  device = hopper_device(cost_model.FITTED_ON)
  draws = read_draws(files)
  train = [d for d in draws if d.seed in train_seeds]
  held_out = [d for d in draws if d.seed not in train_seeds]
  if not train:
    raise SystemExit(f"no draw of the train seeds {sorted(train_seeds)}")
  mosaic_terms, xla_terms = fit(train, device)
  print("fitted MOSAIC_TERMS = (" + ", ".join(f"{t:.3g}" for t in mosaic_terms)
        + ")")
  for form, terms in xla_terms.items():
    print(f"fitted XLA_TERMS[{form!r}] = ("
          + ", ".join(f"{t:.3g}" for t in terms) + ")")
  margin = cost_model.XLA_MARGIN
  for name, terms in (("fitted", (mosaic_terms, xla_terms)),
                      ("shipped", (cost_model.MOSAIC_TERMS,
                                   cost_model.XLA_TERMS))):
    for part, rows in (("train", train), ("held out", held_out)):
      if rows:
        print(f"{name} terms, margin {margin}, {part}: "
              + summary(replay(rows, device, *terms, margin)))
  return 0


if __name__ == "__main__":
  sys.exit(main())
