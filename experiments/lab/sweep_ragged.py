"""Times chosen Mosaic grouped-GEMM configs against the roofline, for the
heuristic's decisions (one GPU call, a few minutes at most).

Run from the repo root on an H100/H200:

    PYTHONPATH=. python3 experiments/lab/sweep_ragged.py [--budget-s 190]
        [--only g64_even/rows,g128_even/contracting]

Each line `SWEEP case mode label total_ms kernel_ms TFLOP/s fraction config`
gives the CUPTI median of one call (total: every kernel the call launches,
the device-side work-list ops included; kernel: the grouped-GEMM kernel
alone), the rate on the total and the fraction of the roofline,

    roofline time = max(flops / dense jnp.dot rate, bytes / copy bandwidth).

Every config's output is first checked on a float64 subsample (`err`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from experiments.lab.gpu_smoke_ragged import (CASES, check_contracting,
                                              check_rows, group_sizes_for)
from pallas_gemm import timing
from pallas_gemm.devices import device_info
from pallas_gemm.ragged_dot import configs, mosaic
from pallas_gemm.ragged_dot.configs import RaggedConfig
from pallas_gemm.ragged_dot.problem import RaggedProblem

START = time.perf_counter()

# Row tiles: 128 x 256 split into 64-row halves (the first heuristic),
# 256 x 128 split into 128-row halves (one CTA per group of <= 256 rows: an
# expert's weight tile is read by one CTA), 128 x 128, and 128 x 256 split by
# columns (a last strip inside the first half idles the second consumer).
ROWS_128x256_SPLIT = dict(tile_m=128, tile_n=128, split_rows=True)
ROWS_256x128 = dict(tile_m=256, tile_n=64, split_rows=True)
ROWS_128x128 = dict(tile_m=128, tile_n=64, split_rows=True)
ROWS_128x256_COLS = dict(tile_m=128, tile_n=128)
# Contracting: output buffering against ring depth, one wide store per
# consumer, tall-narrow vs short-wide CTA tiles.
CON_BASE = dict(tile_m=128, tile_n=128, tile_k=64)

CON_WIDE = dict(tile_m=64, tile_n=256, tile_k=64)
CON_EPI128 = {**CON_BASE, "epi_tile_n": 128, "stages": 3}
INTERLEAVED = {**CON_EPI128, "interleave_groups": True}

# (case, mode, label, config fields or None for the heuristic's).
# An earlier round (128 x 256 split, 256 x 128 and 128 x 256 by columns;
# one or two staging slots; bands 4 to 32) chose the heuristic's shapes;
# this one checks them and tries the contracting kernel's tile order and
# output bursts.
CANDIDATES = [
    ("g128_zipf", "contracting", "heuristic", None),
    ("g128_zipf", "contracting", "interleaved", INTERLEAVED),
    ("g128_zipf", "contracting", "interleaved_band1",
     {**INTERLEAVED, "grid_band": 1}),
    ("g128_zipf", "contracting", "interleaved_epi64_st4",
     {**CON_BASE, "stages": 4, "interleave_groups": True}),
    ("g128_zipf", "contracting", "64x256_epi256",
     {**CON_WIDE, "epi_tile_n": 256, "stages": 3}),
    ("g128_zipf", "contracting", "64x256_epi256_interl",
     {**CON_WIDE, "epi_tile_n": 256, "stages": 3, "interleave_groups": True}),
    ("g128_even", "contracting", "heuristic", None),
    ("g128_even", "contracting", "interleaved", INTERLEAVED),
    ("g128_even", "contracting", "64x256_epi256",
     {**CON_WIDE, "epi_tile_n": 256, "stages": 3}),
    ("g64_even", "contracting", "heuristic", None),
    ("g64_even", "contracting", "epi128_stages3", CON_EPI128),
    ("g64_even", "contracting", "interleaved_epi64_st4",
     {**CON_BASE, "stages": 4, "interleave_groups": True}),
    ("g64_even", "rows", "heuristic", None),
    ("g64_even", "rows", "128x128_band4", {**ROWS_128x128, "grid_band": 4}),
    ("g64_even", "rows", "128x128_band16", {**ROWS_128x128, "grid_band": 16}),
    ("g64_even", "rows", "128x128_st4_slots2",
     {**ROWS_128x128, "stages": 4, "out_slots": 2}),
    ("g64_even", "dlhs", "heuristic", None),
    ("g64_even", "dlhs", "128x128", ROWS_128x128),
    ("g8_even", "rows", "heuristic", None),
    ("g8_zipf", "rows", "heuristic", None),
    ("g8_zipf", "contracting", "heuristic", None),
    ("g128_zipf", "rows", "heuristic", None),
    ("g128_even", "rows", "heuristic", None),
    ("g128_even", "dlhs", "heuristic", None),
]


def log(*parts):
  print(f"[{time.perf_counter() - START:6.1f}s]", *parts, flush=True)


def problem_for(name: str, mode: str) -> RaggedProblem:
  groups, tokens, k, n, _ = CASES[name]
  if mode == "dlhs":  # dout (tokens, n) times each rhs[g] (k, n) transposed
    return RaggedProblem("rows", tokens, n, k, groups, "bfloat16", "bfloat16",
                         transpose_rhs=True)
  return RaggedProblem(mode, tokens, k, n, groups, "bfloat16", "bfloat16")


def config_for(problem: RaggedProblem, fields) -> RaggedConfig:
  if fields is None:
    return mosaic.heuristic(problem, device_info())
  config = RaggedConfig(**{"grid_band": 8, **fields})
  if "stages" in fields:
    return config
  return configs._most_stages(config, problem)  # noqa: SLF001


def timed_ms(fn, args, iterations):
  """(total, grouped-GEMM kernel) median ms of one call."""
  _, samples = timing.cupti_samples_ms(fn, args, iterations=iterations,
                                       per_kernel=True)
  totals = [sum(ms for _, ms in call) for call in samples]
  kernels = [max(ms for _, ms in call) for call in samples]
  return (statistics.median(totals), statistics.median(kernels),
          len(samples[0]))


class Case:
  """Operands, dense time and roofline of one (case, mode), made once."""

  def __init__(self, name, mode, bandwidth, dense_cache):
    self.name, self.mode = name, mode
    self.problem = problem = problem_for(name, mode)
    groups, tokens, _, _, distribution = CASES[name]
    keys = jax.random.split(jax.random.key(0), 2)
    self.lhs = jax.random.normal(keys[0], problem.lhs_shape,
                                 jnp.float32).astype(jnp.bfloat16)
    self.rhs = jax.random.normal(keys[1], problem.rhs_shape,
                                 jnp.float32).astype(jnp.bfloat16)
    self.sizes_np = group_sizes_for(groups, tokens, distribution)
    self.sizes = jnp.asarray(self.sizes_np)
    self.offset = jnp.zeros((1,), jnp.int32)
    key = (tokens, problem.k, problem.n)
    if key not in dense_cache:
      a = jax.random.normal(keys[0], (tokens, problem.k),
                            jnp.float32).astype(jnp.bfloat16)
      b = jax.random.normal(keys[1], (problem.k, problem.n),
                            jnp.float32).astype(jnp.bfloat16)
      dense_cache[key] = timing.median_time_ms(jax.jit(jnp.dot), (a, b),
                                               iterations=5, on_gpu=True)
    self.dense_ms = dense_cache[key]
    self.roofline_ms = max(self.dense_ms,
                           problem.min_bytes / bandwidth * 1e3)
    log(name, mode, f"dense {self.dense_ms:.3f} ms roofline "
        f"{self.roofline_ms:.3f} ms")

  def run(self, label, config, iterations):
    problem = self.problem
    kernel = jax.jit(lambda a, b, s, o: mosaic.ragged_matmul(
        a, b, s, o, problem=problem, config=config))
    args = (self.lhs, self.rhs, self.sizes, self.offset)
    out = jax.block_until_ready(kernel(*args))
    rng = np.random.default_rng(0)
    if problem.mode == "contracting":
      err = check_contracting(out, self.lhs, self.rhs, self.sizes_np, rng)
    else:
      err = check_rows(out, self.lhs,
                       jnp.swapaxes(self.rhs, 1, 2) if problem.transpose_rhs
                       else self.rhs, self.sizes_np, rng)
    del out
    total, alone, launches = timed_ms(kernel, args, iterations)
    print(f"SWEEP {self.name:9s} {self.mode:11s} {label:22s} "
          f"{total:.3f} ms kernel {alone:.3f} ms ({launches} launches) "
          f"{problem.flops / total / 1e9:6.1f} TFLOP/s "
          f"fraction {self.roofline_ms / total:.2f} err {err:.1e}"
          f"{'' if err < 2e-2 else ' WRONG'}  {config}", flush=True)


def lower_only(keep):
  """On a host: every candidate config lowered to Mosaic GPU for CUDA."""
  spec = jax.ShapeDtypeStruct
  for name, mode, label, fields in CANDIDATES:
    if keep is not None and f"{name}/{mode}" not in keep:
      continue
    problem = problem_for(name, mode)
    config = config_for(problem, fields)
    fn = jax.jit(lambda a, b, s, o, c=config: mosaic.ragged_matmul(
        a, b, s, o, problem=problem, config=c))
    fn.trace(spec(problem.lhs_shape, jnp.bfloat16),
             spec(problem.rhs_shape, jnp.bfloat16),
             spec((problem.groups,), jnp.int32),
             spec((1,), jnp.int32)).lower(lowering_platforms=("cuda",))
    log(name, mode, label, "lowers:", config)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--lower-only", action="store_true",
                      help="on a host: only lower every candidate for CUDA")
  parser.add_argument("--budget-s", type=float, default=190.0)
  parser.add_argument("--iters", type=int, default=5)
  parser.add_argument("--only", default="",
                      help="comma-separated case/mode pairs to keep")
  args = parser.parse_args(argv)
  keep = set(args.only.split(",")) if args.only else None
  if args.lower_only:
    return lower_only(keep)
  if jax.default_backend() != "gpu":
    sys.exit("needs a GPU (the kernels are compiled, not interpreted)")
  from experiments.bench import output
  bandwidth = output.measure_copy_bandwidth_tbs() * 1e12
  log("device", device_info(), f"copy bandwidth {bandwidth / 1e12:.2f} TB/s")
  dense_cache, current = {}, None
  for name, mode, label, fields in CANDIDATES:
    if keep is not None and f"{name}/{mode}" not in keep:
      continue
    if time.perf_counter() - START > args.budget_s:
      log(name, mode, label, "skipped: over --budget-s")
      continue
    try:
      if current is None or (current.name, current.mode) != (name, mode):
        current = None  # free the previous operands first
        current = Case(name, mode, bandwidth, dense_cache)
      config = config_for(current.problem, fields)
      current.run(label, config, args.iters)
    except Exception:  # one failing config must not stop the others
      log(name, mode, label, "FAILED")
      traceback.print_exc()
      sys.stdout.flush()


if __name__ == "__main__":
  main()
