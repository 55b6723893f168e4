"""Which `mosaic/fp8` configs and kernel variants are fastest, NT layout.

One GPU call: for each shape it times XLA's fp8 NT (unscaled) and NT-then-
scale once, then every candidate config of `mosaic/fp8` with per-tensor and
with block-wise (1x128 / 128x128) scales, printing one line per candidate
as it finishes:

  shape scaling name config err TF/s %peak  vs xlaNT  vs NT*s

The candidates are the mechanisms the heuristic chooses between: the
consumer tile and how it is split, ring depth against epilogue sub-tile
width (both share shared memory), the L2 band, and for block-wise scales
the promotion group (wgmma of the next K block in flight while the previous
block is scaled) and whether the consumers' groups are staggered (`stg`).
`none` rows run the heuristic's config without scales, the cost of scaling
being their difference to the `tensor` rows. `pp`
is the pingpong schedule (consumers own alternate tiles), `cM`/`cN` 2-CTA
clusters multicasting the shared operand tile, `alt` block-wise consumers
taking turns to issue each K block's wgmma.

Each candidate is checked on a subsample against float64 and timed through
`pallas_gemm.timing` (CUPTI, operands rotated past L2). A candidate that
fails to compile or run prints its error and the sweep goes on; once
--budget_s is spent the remaining candidates are listed as skipped.

  python3 experiments/lab/gpu_sweep_fp8.py [--shapes 4096x4096x4096,...]
      [--scalings none,tensor,block] [--iters 10] [--budget_s 190]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)  # gpu_smoke_fp8
sys.path.insert(0, os.path.dirname(os.path.dirname(_HERE)))  # pallas_gemm

import gpu_smoke_fp8 as smoke  # noqa: E402  (operands, reference, baselines)

import pallas_gemm  # noqa: E402
from pallas_gemm import timing  # noqa: E402
from pallas_gemm.devices import device_info, peak_tflops  # noqa: E402
from pallas_gemm.mosaic_backend.configs import Dim  # noqa: E402
from pallas_gemm.mosaic_backend.fp8_config import (  # noqa: E402
    FP8_TILE_K, Fp8Config, check_fp8_config, fp8_heuristic)
from pallas_gemm.numerics import relative_error, tolerance  # noqa: E402
from pallas_gemm.problem import GemmProblem  # noqa: E402

DEFAULT_SHAPES = ("4096x4096x4096", "8192x8192x8192", "8192x14336x4096")


def _config(tile_m, tile_n, split, stages, epi_n, band=8, band_dim=Dim.M,
            group=1, cluster=None, pingpong=False, alternate=False,
            stagger=False):
  return Fp8Config(tile_m=tile_m, tile_n=tile_n, tile_k=FP8_TILE_K,
                   wg_dimension=split, max_concurrent_steps=stages,
                   epi_tile_n=epi_n, grid_band=band, band_dim=band_dim,
                   promote_group=group, cluster_dim=cluster,
                   pingpong=pingpong, alternate_consumers=alternate,
                   stagger_groups=stagger)


#: (name, config) per scaling; None is the heuristic's pick for the problem.
TENSOR_CANDIDATES = (
    ("heuristic", None),
    ("64x256 pp s4 e64", _config(64, 256, Dim.M, 4, 64, pingpong=True)),
    ("64x256 pp s5 e32", _config(64, 256, Dim.M, 5, 32, pingpong=True)),
    ("128x128 pp s6 e64", _config(128, 128, Dim.M, 6, 64, pingpong=True)),
    ("64x256 pp s4 cM", _config(64, 256, Dim.M, 4, 64, pingpong=True,
                                cluster=Dim.M)),
    ("64x256M s4 e64 cM", _config(64, 256, Dim.M, 4, 64, cluster=Dim.M)),
)
BLOCK_CANDIDATES = (
    ("heuristic", None),
    ("64x128M s6 g2 stg", _config(64, 128, Dim.M, 6, 32, group=2,
                                  stagger=True)),
    ("64x128M s6 g2 stg cM", _config(64, 128, Dim.M, 6, 32, group=2,
                                     stagger=True, cluster=Dim.M)),
    ("64x128M s6 g2 alt", _config(64, 128, Dim.M, 6, 32, group=2,
                                  alternate=True)),
    ("64x128M s6 g1 alt", _config(64, 128, Dim.M, 6, 32, alternate=True)),
    ("64x128M s6 g1", _config(64, 128, Dim.M, 6, 32, group=1)),
    ("64x128 pp s6 g2", _config(64, 128, Dim.M, 6, 64, group=2,
                                pingpong=True)),
    ("64x128 pp s6 g1", _config(64, 128, Dim.M, 6, 64, pingpong=True)),
    ("64x128M s6 g2 cM", _config(64, 128, Dim.M, 6, 32, group=2,
                                 cluster=Dim.M)),
    ("64x128N s5 g2", _config(64, 128, Dim.N, 5, 32, group=2)),
)
NONE_CANDIDATES = (("heuristic", None),)
#: Candidates per scaling on shapes outside --full_shapes (compiles dominate
#: the sweep's time).
QUICK_CANDIDATES = 3
CANDIDATES = {"none": NONE_CANDIDATES, "tensor": TENSOR_CANDIDATES,
              "block": BLOCK_CANDIDATES}


def _describe(config) -> str:
  split = "M" if config.wg_dimension == Dim.M else "N"
  band = "M" if config.band_dim == Dim.M else "N"
  cluster = ("" if config.cluster_dim is None else
             " c" + ("M" if config.cluster_dim == Dim.M else "N"))
  if config.pingpong:
    split = "pp"
  if config.alternate_consumers:
    cluster += " alt"
  if config.stagger_groups:
    cluster += " stg"
  return (f"{config.tile_m}x{config.tile_n}{split} s{config.max_concurrent_steps}"
          f" e{config.epi_tile_n} b{config.grid_band}{band}"
          f" g{config.promote_group}{cluster}")


def _problem(m, n, k, scaling):
  modes = {"none": ("none", "none"), "tensor": ("tensor", "tensor"),
           "block": ("block", "block")}[scaling]
  return GemmProblem(1, m, n, k, "float8_e4m3fn", "bfloat16",
                     transpose_b=True, a_scale_mode=modes[0],
                     b_scale_mode=modes[1])


def _mosaic_call(scaling, config):
  def call(qa, qb, sa, sb):
    if scaling == "none":
      sa = sb = None
    return pallas_gemm.matmul(qa, qb, a_scale=sa, b_scale=sb,
                              transpose_b=True, kernel="mosaic/fp8",
                              config=config,
                              preferred_element_type=jnp.bfloat16)
  return call


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--shapes", default=",".join(DEFAULT_SHAPES))
  parser.add_argument("--scalings", default="none,tensor,block")
  parser.add_argument("--full_shapes", default=",".join(DEFAULT_SHAPES[:2]),
                      help="shapes that run every candidate; the others run "
                      f"the first {QUICK_CANDIDATES} of each scaling")
  smoke.add_run_arguments(parser, iters=10, budget_s=190.0)
  args = parser.parse_args()

  device = device_info()
  peak = peak_tflops(device.device_kind, "float8_e4m3fn") or float("nan")
  tol = tolerance("float8_e4m3fn", "default", "bfloat16")
  print(f"device: {device.device_kind}  fp8 peak {peak} TFLOP/s  jax "
        f"{jax.__version__}  tolerance {tol:g}", flush=True)
  start = time.monotonic()
  header = (f"{'shape':<16} {'scale':<6} {'name':<19} {'config':<26} "
            f"{'err':>8} {'TF/s':>6} {'%pk':>4} {'vsNT':>6} {'vsNT*s':>6}")
  print(header)
  print("-" * len(header), flush=True)
  best = {}

  for shape_text in args.shapes.split(","):
    if time.monotonic() - start > args.budget_s:
      print(f"budget of {args.budget_s:g} s spent: skipping {shape_text}")
      continue
    m, n, k = smoke._parse_shape(shape_text)
    flops = 2 * m * n * k

    def tflops(us):
      return flops / (us * 1e-6) / 1e12

    try:
      case = smoke.Case(m, n, k, args.seed)
    except Exception as e:  # noqa: BLE001 - report and go on
      print(f"{shape_text}: operands failed: {smoke._short(e)}", flush=True)
      continue
    tensor_sets = case.operands("tensor", "NT")
    base = {}
    for name, scaled in (("xla NT", False), ("xla NT*s", True)):
      try:
        base[name] = smoke._time_us(smoke.xla_call("NT", scaled), tensor_sets,
                                    args.iters)
      except Exception as e:  # noqa: BLE001
        base[name] = None
        print(f"{shape_text} {name}: {smoke._short(e)}", flush=True)
    print(f"{shape_text:<16} xla NT {tflops(base['xla NT']) if base['xla NT'] else 0:.0f}"
          f" TF/s, NT*s {tflops(base['xla NT*s']) if base['xla NT*s'] else 0:.0f}"
          " TF/s", flush=True)
    rows_idx, cols_idx = smoke._sample(m), smoke._sample(n)
    for scaling in args.scalings.split(","):
      sets = case.operands("block" if scaling == "block" else "tensor", "NT")
      ref = case.reference("block" if scaling == "block" else "tensor",
                           rows_idx, cols_idx)
      if scaling == "none":
        qa, qb, sa, sb = case.sets["tensor"][0]
        ref = ref / (float(sa) * float(sb))
      problem = _problem(m, n, k, scaling)
      candidates = CANDIDATES[scaling]
      if shape_text not in args.full_shapes.split(","):
        candidates = candidates[:QUICK_CANDIDATES]
      for name, config in candidates:
        if config is None:
          config = fp8_heuristic(problem, device)
        described = _describe(config)
        prefix = f"{shape_text:<16} {scaling:<6} {name:<19} {described:<26}"
        if time.monotonic() - start > args.budget_s:
          print(f"{prefix} skipped (budget spent)", flush=True)
          continue
        reason = check_fp8_config(config, problem)
        if reason:
          print(f"{prefix} unfit: {reason}", flush=True)
          continue
        try:
          # One compiled function over all operand sets: its first output is
          # checked, then the same function is timed (as time_over_sets
          # does), so each candidate compiles once.
          over_sets = timing.over_sets(_mosaic_call(scaling, config))
          operand_sets = tuple(tuple(x) for x in sets)
          first = over_sets(operand_sets)[0]
          out = np.asarray(first.astype(jnp.float32))
          err = relative_error(out[np.ix_(rows_idx, cols_idx)], ref)
          us = 1e3 * timing.median_time_ms(
              over_sets, (operand_sets,), iterations=args.iters,
              on_gpu=smoke.ON_GPU) / len(operand_sets)
        except Exception as e:  # noqa: BLE001 - a failure must not stop it
          print(f"{prefix} FAILED {smoke._short(e)}", flush=True)
          continue
        mine = tflops(us)
        ratios = [f"{base[b] / us:>5.2f}x" if base.get(b) else f"{'-':>6}"
                  for b in ("xla NT", "xla NT*s")]
        flag = "" if err <= tol else "  WRONG"
        print(f"{prefix} {err:>8.1e} {mine:>6.0f} {100 * mine / peak:>4.0f} "
              f"{ratios[0]} {ratios[1]}{flag}", flush=True)
        key = (shape_text, scaling)
        if err <= tol and mine > best.get(key, (0, ""))[0]:
          best[key] = (mine, f"{name} [{described}]")
    del case, tensor_sets

  print("\nbest per shape and scaling:")
  for (shape_text, scaling), (value, name) in best.items():
    print(f"  {shape_text:<16} {scaling:<6} {value:>6.0f} TF/s  {name}")
  print(f"(TFLOP/s from CUPTI kernel time, median of {args.iters}; wall "
        f"{time.monotonic() - start:.0f} s)")


if __name__ == "__main__":
  main()
