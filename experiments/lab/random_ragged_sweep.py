"""Does `pallas_gemm.ragged_dot`'s automatic choice hold on grouped GEMMs
nobody chose? `auto` against `jax.lax.ragged_dot` on seeded random problems,
on a GPU.

The `moe*` suites are model layers and `small_ragged_sweep.py` a grid of
square experts: both are lists the heuristic was, or could have been, drawn
from. This script draws each case at random instead, from wide ranges:

  groups          log-uniform over 1-256;
  rows per group  log-uniform over 1-4096 on average (at most 65536 rows);
  k, n            log-uniform over `--dims` (16-8192), mostly multiples of 8, one in
                  five any integer;
  routing         even, Zipf, one-hot, or random (a Dirichlet(1) share per
                  group: uneven sizes, some empty);
  direction       forward, dlhs (rhs read transposed) or drhs;

in `--dtype` (bfloat16, float16, float32: the kernels' three bfloat16
products or XLA, whichever the automatic choice takes, or float8_e4m3fn
or float8_e5m2),
out `--out_dtype` (the same, or float32; fp8 operands: bfloat16 unless
given).

A draw whose estimated XLA time (groups x the dense flops at LAX_RATE of
its dtype, its usual cost) exceeds `--max_lax_ms`, or whose operands and
output exceed 2 GiB, is drawn again, so the run stays in budget; the estimate only filters, it is not reported. Each row gives both
ways' CUPTI time of every kernel of one call (median of `--iterations`, both
in one process, the group sizes an argument of the jitted call), auto / lax,
and each way's relative error against float64 on a sample that touches
groups of every kind (`sampled_error`); an error over the dtypes'
tolerance of `numerics` is also printed as a WRONG line. The last column
names what `auto` ran on this device: xla, or mosaic (with its split_k
where it splits). The same `--seed`
draws the same cases on every machine, in every dtype.

    PYTHONPATH=. python3 experiments/lab/random_ragged_sweep.py \
        [--seed 0] [--cases 60] [--iterations 20] [--budget_s 300] \
        [--max_lax_ms 25] [--dims 16,8192] [--only 3,15] [--breakdown] \
        [--dtype bfloat16] [--out_dtype float32] [--kernels_too] \
        [--problems "g1 m2048 k256 n1024 even drhs;g2 m8192 k64 n384 zipf drhs"]

`--only` runs the draws of those indices alone (the same draws: every case
is drawn first); `--breakdown` adds a line per case and way with each
kernel that its call launches and its CUPTI median; `--kernels_too` times
`kernel="mosaic"` as a third way, so that the kernels' time is known where
`auto` runs XLA (the draws `ragged_cost_fit.py` refits the kernels' terms
on, saved as `random_ragged/kernels_seed*.txt`); `--problems` times the
problems it names, in the draws' label form, instead of drawing any (a rule's
changed cases, both ways; a `random` routing's sizes come from `--seed`).
"""

from __future__ import annotations

import argparse
import math
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np

from pallas_gemm import numerics, timing
from pallas_gemm.devices import device_info
from pallas_gemm.problem import itemsize
from pallas_gemm.ragged_dot import arg_specs, implementations

from experiments.lab import ragged_lab_common as common

WAYS = ("lax", "auto")
#: With `--kernels_too`: the Mosaic kernels whatever `auto` chose, the
#: kernels' time at today's configs that `ragged_cost_fit.py` fits.
KERNELS_WAY = "mosaic"
ROUTINGS = arg_specs.DISTRIBUTIONS + ("random",)
MAX_ROWS = 65536
#: XLA's usual rate on the groups x dense flops it does, by input dtype
#: (float32: TF32 products), for the draws' filter only.
LAX_RATE = {"bfloat16": 700e12, "float16": 700e12, "float32": 300e12,
            "float8_e4m3fn": 200e12, "float8_e5m2": 200e12}
MAX_BYTES = 2 * 2**30


def _log_uniform_int(rng, low: int, high: int) -> int:
  return int(round(math.exp(rng.uniform(math.log(low), math.log(high)))))


def _dim(rng, low: int, high: int) -> int:
  value = _log_uniform_int(rng, low, high)
  if rng.uniform() < 0.8:
    value = max(8, 8 * round(value / 8))
  return value


def random_sizes(rng, routing: str, rows: int, groups: int) -> np.ndarray:
  """int32 (groups,) sizes summing to `rows`."""
  if routing in arg_specs.DISTRIBUTIONS:
    return arg_specs.group_sizes(routing, rows, groups,
                                 seed=int(rng.integers(2**31)))
  shares = rng.dirichlet(np.ones(groups))
  return rng.multinomial(rows, shares).astype(np.int32)


def draw_cases(seed: int, count: int, max_lax_ms: float,
               dims: tuple[int, int] = (16, 8192), dtype: str = "bfloat16",
               out_dtype: str = "bfloat16"):
  """`count` (label, MoeCase, sizes) draws, the same for the same seed."""
  rng = np.random.default_rng(seed)
  cases = []
  while len(cases) < count:
    groups = _log_uniform_int(rng, 1, 256)
    rows = min(MAX_ROWS, max(1, round(groups * math.exp(
        rng.uniform(0.0, math.log(4096))))))
    k, n = _dim(rng, *dims), _dim(rng, *dims)
    routing = ROUTINGS[rng.integers(len(ROUTINGS))]
    direction = arg_specs.DIRECTIONS[rng.integers(len(arg_specs.DIRECTIONS))]
    if (1e3 * groups * 2 * rows * k * n / LAX_RATE[dtype] > max_lax_ms
        or itemsize(dtype) * (groups * k * n + rows * (k + n)) > MAX_BYTES):
      continue
    label = f"g{groups} m{rows} k{k} n{n} {routing} {direction}"
    layer = arg_specs.MoeLayer(label, groups, rows, k, n)
    case = arg_specs.MoeCase(layer, "even", direction, dtype=dtype,
                             out_dtype=out_dtype)
    cases.append((label, case, random_sizes(rng, routing, rows, groups)))
  return cases


def default_out_dtype(dtype: str) -> str:
  """The output dtype a run of `dtype` operands takes unless told: the
  same, or bfloat16 for fp8 operands."""
  return "bfloat16" if dtype.startswith("float8") else dtype


def dtypes_note(dtype: str, out_dtype: str) -> str:
  """The run line's note of its dtypes: one, or "in -> out"."""
  return dtype if out_dtype == dtype else f"{dtype} -> {out_dtype}"


PROBLEM_LABEL = re.compile(
    r"g(\d+) m(\d+) k(\d+) n(\d+) (" + "|".join(ROUTINGS) + r") ("
    + "|".join(arg_specs.DIRECTIONS) + r")")


def parse_case(text: str, seed: int, dtype: str = "bfloat16",
               out_dtype: str = "bfloat16", flag: str = "--problems"):
  """(label, MoeCase, sizes) of one problem named in `draw_cases`' label
  form, its routing's sizes drawn from `seed`; `flag` names the option a
  malformed one came from."""
  label = text.strip()
  match = PROBLEM_LABEL.fullmatch(label)
  if match is None:
    raise SystemExit(
        f"{flag}: {label!r} is not 'g<groups> m<rows> k<k> n<n> "
        f"<{'|'.join(ROUTINGS)}> <{'|'.join(arg_specs.DIRECTIONS)}>'")
  groups, rows, k, n = (int(v) for v in match.groups()[:4])
  if min(groups, k, n) < 1:
    raise SystemExit(f"{flag}: {label!r} needs groups, k and n >= 1")
  layer = arg_specs.MoeLayer(label, groups, rows, k, n)
  case = arg_specs.MoeCase(layer, "even", match.group(6), dtype=dtype,
                           out_dtype=out_dtype)
  return label, case, random_sizes(np.random.default_rng(seed),
                                   match.group(5), rows, groups)


#: Groups, rows a group and output columns (and, for the weight gradient,
#: K rows) the float64 check samples.
CHECKED_GROUPS = 64
CHECKED_ROWS = 4
CHECKED_COLS = 32


def _spread(count: int, most: int) -> np.ndarray:
  return np.unique(np.linspace(0, count - 1, min(count, most)).astype(np.int64))


def sampled_error(problem, lhs, rhs, sizes, out) -> float:
  """Relative error of `out` against float64 on a sample that touches every
  kind of group: up to CHECKED_GROUPS groups spread over all of them (empty
  ones included, whose rows or weight gradient must be zero) and the
  largest, a few rows
  of each (rows mode) or a grid of its K x N block (contracting mode), at
  CHECKED_COLS output columns, plus up to CHECKED_GROUPS rows in no group
  (zero)."""
  f64 = lambda x: np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)
  ends = np.cumsum(sizes.astype(np.int64))
  starts = ends - sizes
  # The largest group too: with a one-hot routing the spread can miss the
  # one group with rows, and then checks only zeros.
  groups = np.union1d(_spread(problem.groups, CHECKED_GROUPS),
                      [int(np.argmax(sizes))] if sizes.size else [])
  cols = _spread(problem.n, CHECKED_COLS)
  got, ref = [], []
  if problem.mode == "rows":
    for g in groups:
      rows = starts[g] + _spread(int(sizes[g]), CHECKED_ROWS)
      if not rows.size:
        continue
      w = rhs[g][cols, :].T if problem.transpose_rhs else rhs[g][:, cols]
      got.append(f64(out[rows][:, cols]))
      ref.append(f64(lhs[rows]) @ f64(w))
    outside = np.arange(int(ends[-1]) if ends.size else 0, problem.m)
    outside = outside[_spread(outside.size, CHECKED_GROUPS)] if outside.size \
        else outside
    got.append(f64(out[outside][:, cols]))
    ref.append(np.zeros((outside.size, cols.size)))
    return numerics.relative_error(np.concatenate(got), np.concatenate(ref))
  ks = _spread(problem.k, CHECKED_COLS)
  for g in groups:
    rows = slice(int(starts[g]), int(ends[g]))
    got.append(f64(out[g][ks][:, cols]))
    ref.append(f64(lhs[rows][:, ks]).T @ f64(rhs[rows][:, cols]))
  return numerics.relative_error(np.stack(got), np.stack(ref))


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--cases", type=int, default=60)
  parser.add_argument("--iterations", type=int, default=20)
  parser.add_argument("--budget_s", type=float, default=0.0,
                      help="start no new case after this long (0: no limit)")
  parser.add_argument("--max_lax_ms", type=float, default=25.0)
  parser.add_argument("--dims", default="16,8192",
                      help="low,high: the range k and n are drawn from")
  parser.add_argument("--only", default="",
                      help="comma-separated draw indices to run (default all)")
  parser.add_argument("--breakdown", action="store_true",
                      help="also print each way's kernels and their times")
  parser.add_argument("--kernels_too", action="store_true",
                      help="also time kernel='mosaic' (a 'mosaic' column), "
                      "the kernels' time also where auto runs XLA")
  parser.add_argument("--problems", default="",
                      help="';'-separated labels ('g2 m8192 k64 n384 even "
                      "drhs') to time instead of random draws")
  parser.add_argument("--dtype", default="bfloat16",
                      choices=tuple(LAX_RATE))
  parser.add_argument("--out_dtype", default="",
                      choices=("", "bfloat16", "float16", "float32"),
                      help="the output's dtype (default: --dtype, or "
                      "bfloat16 for fp8 operands)")
  args = parser.parse_args(argv)
  out_dtype = args.out_dtype or default_out_dtype(args.dtype)
  try:
    only = {int(v) for v in args.only.split(",")} if args.only else None
  except ValueError:
    raise SystemExit(f"--only={args.only!r} must be comma-separated integers")
  if only and (min(only) < 0 or max(only) >= args.cases):
    raise SystemExit(f"--only={args.only!r}: indices must lie in "
                     f"0..{args.cases - 1} (--cases={args.cases})")
  try:
    dims = tuple(int(v) for v in args.dims.split(","))
  except ValueError:
    dims = ()
  if len(dims) != 2 or not 1 <= dims[0] <= dims[1]:
    raise SystemExit(f"--dims={args.dims!r} must be low,high with "
                     "1 <= low <= high")
  if args.cases < 1:
    raise SystemExit(f"--cases={args.cases} must be >= 1")
  if args.max_lax_ms <= 0:
    raise SystemExit(f"--max_lax_ms={args.max_lax_ms} must be > 0")
  if args.problems:
    if only:
      raise SystemExit("--only picks draws; --problems names its own cases")
    cases = [parse_case(text, args.seed, args.dtype, out_dtype)
             for text in args.problems.split(";") if text.strip()]
  else:
    cases = draw_cases(args.seed, args.cases, args.max_lax_ms, dims,
                       args.dtype, out_dtype)
  ways = WAYS + ((KERNELS_WAY,) if args.kernels_too else ())
  on_gpu = common.print_header(ways, ("auto / lax",)
                               + tuple(f"{way} error" for way in ways)
                               + ("auto runs",),
                               args.iterations, f"seed {args.seed}",
                               f"dims {args.dims}",
                               dtypes_note(args.dtype, out_dtype))
  budget = common.Budget(args.budget_s)
  device = device_info()
  keys = jax.random.split(jax.random.key(args.seed), 2)
  for index, (label, case, sizes) in enumerate(cases):
    if only is not None and index not in only:
      continue
    if budget.spent():
      return 0
    problem = case.problem
    lhs = numerics.random_normal(keys[0], problem.lhs_shape, args.dtype)
    rhs = numerics.random_normal(keys[1], problem.rhs_shape, args.dtype)
    calls = {way: common.way_call(way, problem) for way in ways}
    times, results = common.time_ways(
        calls, (lhs, rhs, jnp.asarray(sizes)), iterations=args.iterations,
        on_gpu=on_gpu, label=label)
    errors = {way: sampled_error(problem, lhs, rhs, sizes, result)
              for way, result in results.items()}
    # What the automatic choice ran: the kernels' config names its split.
    chosen = implementations.resolve(problem, device)
    runs = chosen.implementation + (
        f" split_k={chosen.config.split_k}"
        if getattr(chosen.config, "split_k", 1) > 1 else "")
    common.print_row(f"{index} {label}", ways, times, (("auto", "lax"),),
                     errors, ways, more=(runs,))
    # float32 at the default precision allows TF32 products.
    tolerance = numerics.tolerance(
        args.dtype, "tf32" if args.dtype == "float32" else "default",
        out_dtype)
    for way, error in errors.items():
      if not error <= tolerance:
        print(f"# {index} {way}: WRONG, relative error {error:.1e} over "
              f"{tolerance:.0e} against float64", flush=True)
    for way in (ways if args.breakdown and on_gpu else ()):
      if way in times:
        kernels = timing.kernel_medians_us(
            calls[way], (lhs, rhs, jnp.asarray(sizes)),
            iterations=args.iterations)
        print(f"#   {index} {way}: " + ", ".join(
            f"{name[:40]} {us:.1f}" for name, us in kernels), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
