"""How the Mosaic kernels' configs are chosen without measuring.

`ws_heuristic`, `small_m_heuristic` and `split_k_heuristic` are pure
functions of the problem and the SM count (the registry's `heuristic`);
`ws_candidates`, `small_m_candidates` and `split_k_candidates` are the
autotuner's search spaces. Stored configs and
the order in which they win are `pallas_gemm.dispatch`'s business.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from pallas_gemm.mosaic_backend.configs import (Dim, MosaicConfig,
                                                SmallMConfig, SplitKConfig)
from pallas_gemm.mosaic_backend.tma import SWIZZLE_BYTES, swizzle_elems
from pallas_gemm.problem import GemmProblem, cdiv

# ------------------------------------------------------- mosaic/ws_persistent


def ws_candidates(problem: GemmProblem) -> list[MosaicConfig]:
  """A small per-shape-class search space for the persistent kernel, with
  the configs that do not fit in shared memory already dropped."""
  tile_k = swizzle_elems(problem.in_dtype)
  out = []
  for tile_m, tile_n, wg_dim in ((64, 256, Dim.M), (128, 128, Dim.N),
                                 (128, 128, Dim.M), (64, 128, Dim.M),
                                 (128, 256, Dim.M), (64, 192, Dim.M)):
    for stages in (4, 3, 5):
      for band in (8, 4, 16):
        config = MosaicConfig(
            tile_m=tile_m, tile_n=tile_n, tile_k=tile_k,
            max_concurrent_steps=stages, epi_tile_m=64,
            epi_tile_n=64 if tile_n % 64 == 0 else tile_n,
            band_dim=Dim.M, grid_band=band, wg_dimension=wg_dim)
        if config.fits(problem):
          out.append(config)
  return out


#: The CTA tiles the heuristic weighs, as (tile_m, tile_n) per consumer
#: (split over M) and how much slower each runs than the 128x256 CTA tile
#: per unit of work: a narrower CTA tile reads more shared memory per flop.
#: The factors summarise the H200 tuning log (the table "CTA tile slowdowns"
#: in experiments/results/nvidia_h200/mosaic/README.md).
CTA_TILE_CHOICES = ((64, 256, 1.0), (128, 128, 1.02), (64, 128, 1.08))


def cta_waves(problem: GemmProblem, cta_m: int, cta_n: int,
              num_sms: int) -> int:
  """How many rounds of (cta_m x cta_n) tiles a persistent grid of
  `num_sms` CTAs runs."""
  return cdiv(problem.output_tiles(cta_m, cta_n), max(num_sms, 1))


def waves(problem: GemmProblem, config: MosaicConfig, num_sms: int) -> int:
  """How many rounds of CTA tiles the persistent grid runs."""
  return cta_waves(problem, config.cta_tile_m, config.cta_tile_n, num_sms)


def wave_cost(problem: GemmProblem, cta_m: int, cta_n: int, slowdown: float,
              num_sms: int) -> float:
  """What the persistent kernels' heuristics minimise: waves of
  (cta_m x cta_n) tiles times the tile's area times its slowdown."""
  return cta_waves(problem, cta_m, cta_n, num_sms) * cta_m * cta_n * slowdown


def critical_path(problem: GemmProblem, config: MosaicConfig,
                  num_sms: int) -> float:
  """The heuristic's cost of `config` on `problem`: waves of CTA tiles
  times the CTA tile's area times its slowdown (`CTA_TILE_CHOICES`; a
  consumer tile not listed there counts as the fastest). With fewer tiles
  than SMs it is one CTA's work, so a tile half the size costs half."""
  slowdown = next((s for m, n, s in CTA_TILE_CHOICES
                   if (m, n) == (config.tile_m, config.tile_n)), 1.0)
  return wave_cost(problem, config.cta_tile_m, config.cta_tile_n, slowdown,
                   num_sms)


def ws_heuristic(problem: GemmProblem, num_sms: int) -> MosaicConfig:
  """The default persistent-kernel config.

  The deepest pipeline that fits, on the CTA tile whose waves of tiles
  cost least: the number of waves times the CTA tile's area times its
  slowdown (`CTA_TILE_CHOICES`). Usually the 128x256 tile (each warpgroup
  holds a 64x256 f32 accumulator, 128 registers a thread), the best timed
  on the H200; a 256x128 or 128x128 one when it wastes less of the last
  wave (4095x4097 on an H200's 132 SMs: 17 columns of 256 make 5 waves
  where 256x128 tiles make exactly 4) or when there are fewer big tiles
  than SMs.
  """
  tile_k = swizzle_elems(problem.in_dtype)

  def cost(tile_m, tile_n, slowdown):
    # The consumers split the CTA tile over M.
    return wave_cost(problem, 2 * tile_m, tile_n, slowdown, num_sms)

  tile_m, tile_n, _ = min(CTA_TILE_CHOICES, key=lambda c: cost(*c))
  # One 128-byte swizzle span per staged output row: 64 bf16 or 32 f32
  # columns, which keeps a float32 output from costing a pipeline stage.
  epi_tile_n = SWIZZLE_BYTES // jnp.dtype(problem.out_dtype).itemsize
  base = MosaicConfig(tile_m=tile_m, tile_n=tile_n, tile_k=tile_k,
                      epi_tile_n=epi_tile_n, wg_dimension=Dim.M)
  for stages in (4, 3, 2):
    config = dataclasses.replace(base, max_concurrent_steps=stages)
    if config.fits(problem):
      return config
  return dataclasses.replace(base, max_concurrent_steps=2)


# ------------------------------------------------------------ mosaic/small_m

#: A bandwidth-bound wave with at least this share of the SMs busy streams
#: at (nearly) full device bandwidth: each CTA keeps 150+ KB in flight.
SATURATING_SM_SHARE = 0.75


def small_m_cost(problem: GemmProblem, config: SmallMConfig, num_sms: int,
                 *, saturating_share: float = SATURATING_SM_SHARE,
                 ring_fill: float = 0.0) -> float:
  """Modelled time of a bandwidth-bound launch, in bytes at full bandwidth.

  Each wave takes as long as its busiest CTAs' bytes at the bandwidth its
  CTA count can draw (full from `saturating_share` of the SMs up); each CTA
  also pays `ring_fill` rings of bytes to fill and drain its pipeline
  (none in the shipped model); split-K partials are written, read back and
  reduced (three passes). The keyword constants let
  experiments/lab/small_m_model_fit.py replay the choice with others.
  """
  in_size = jnp.dtype(problem.in_dtype).itemsize
  n_tiles = cdiv(problem.n, config.tile_n) * problem.batch
  k_blocks = cdiv(problem.k, config.tile_k)
  splits = cdiv(k_blocks, cdiv(k_blocks, config.k_splits))
  k_share = cdiv(k_blocks, splits) * config.tile_k
  stage_bytes = config.tile_k * config.tile_n * in_size
  # A is a few rows that every CTA shares through L2: only B counts.
  bytes_per_cta = (k_share * config.tile_n * in_size
                   + ring_fill * config.max_concurrent_steps * stage_bytes)
  ctas = n_tiles * splits
  floor = saturating_share * num_sms
  cost = 0.0
  while ctas > 0:
    in_wave = min(ctas, num_sms)
    cost += bytes_per_cta * max(in_wave, floor)
    ctas -= in_wave
  if splits > 1:
    cost += 3 * splits * cdiv(problem.m, 8) * 8 * problem.n * problem.batch * 4
  return cost


def _deepest_ring(config: SmallMConfig,
                  problem: GemmProblem) -> SmallMConfig | None:
  """`config` with the deepest ring that fits in shared memory, or None."""
  for stages in (6, 5, 4, 3, 2):
    deeper = dataclasses.replace(config, max_concurrent_steps=stages)
    if deeper.fits(problem):
      return deeper
  return None


def small_m_heuristic(problem: GemmProblem, num_sms: int, *,
                      saturating_share: float = SATURATING_SM_SHARE,
                      ring_fill: float = 0.0) -> SmallMConfig:
  """The (tile_n, k_splits) pair, each with the deepest pipeline that fits
  in shared memory, with the lowest modelled time (`small_m_cost`, whose
  constants the keywords pass on)."""
  best = None
  for k_splits in (1, 2, 3, 4, 6, 8):
    for tile_n in (64, 128):
      config = _deepest_ring(
          SmallMConfig(tile_n=tile_n, tile_k=128, k_splits=k_splits), problem)
      if config is None:  # e.g. 128 columns at M = 128 with a float32 C
        continue
      cost = small_m_cost(problem, config, num_sms,
                          saturating_share=saturating_share,
                          ring_fill=ring_fill)
      # Ties go to fewer splits, then narrower strips (more stages fit).
      if best is None or cost < best[0] * 0.99:
        best = (cost, config)
  if best is None:  # nothing fits: the smallest footprint, for its error
    return SmallMConfig(tile_n=64, tile_k=128, max_concurrent_steps=2)
  return best[1]


def small_m_candidates(problem: GemmProblem,
                       num_sms: int) -> list[SmallMConfig]:
  """The autotuner's search space for `mosaic/small_m`: the heuristic's
  config first, then strips, splits and depths that fit."""
  out = []
  for tile_n in (64, 128):
    for k_splits in (1, 2, 4):
      for stages in (6, 4, 3):
        config = SmallMConfig(tile_n=tile_n, k_splits=k_splits,
                              max_concurrent_steps=stages)
        if config.fits(problem):
          out.append(config)
  heuristic = small_m_heuristic(problem, num_sms)
  return [heuristic] + [c for c in out if c != heuristic]


# ------------------------------------------------------------ mosaic/split_k

#: A Hopper SXM SM's dense 16-bit tensor throughput, flop per microsecond
#: (989 TFLOP/s over 132 SMs); TF32 runs at half of it.
SM_FLOPS_PER_US = 989e12 / 132 / 1e6
#: What one consumer warpgroup keeps of it: it waits on its own wgmmas
#: where the two-consumer kernels overlap one's wait with the other's work.
ONE_WARPGROUP_SHARE = 0.6
#: What one SM's TMA loads draw, bytes per microsecond, when every SM loads
#: at once (mostly L2 hits: the tiles of one column strip share B).
SM_LOAD_BYTES_PER_US = 60e3
#: A CTA's fixed cost, microseconds: filling its ring before the first
#: wgmma, and storing its tile after the last.
CTA_FIXED_US = 1.5
#: The XLA reduction of split-K partials: its launch, microseconds, and the
#: bandwidth it streams them at, bytes per microsecond.
REDUCTION_LAUNCH_US = 2.0
REDUCTION_BYTES_PER_US = 3.0e6


def split_k_cost(problem: GemmProblem, config: SplitKConfig,
                 num_sms: int) -> float:
  """Modelled time of a `split_k` launch, microseconds: waves of CTAs,
  each CTA its K share's steps (compute or load, whichever is slower) plus
  a fixed cost, and with K split, the partials' reduction (written, read
  back and reduced by XLA). The constants above are rough Hopper figures;
  only the order of the candidates matters, and measurement (the dispatch
  table) decides whether the kernel runs at all."""
  in_size = jnp.dtype(problem.in_dtype).itemsize
  out_size = jnp.dtype(problem.out_dtype).itemsize
  k_blocks = cdiv(problem.k, config.tile_k)
  steps = cdiv(k_blocks, config.k_splits)
  splits = cdiv(k_blocks, steps)
  ctas = problem.output_tiles(config.tile_m, config.tile_n) * splits
  flops_per_step = 2 * config.tile_m * config.tile_n * config.tile_k
  rate = SM_FLOPS_PER_US * ONE_WARPGROUP_SHARE / (2 if in_size == 4 else 1)
  load_bytes = (config.tile_m + config.tile_n) * config.tile_k * in_size
  step_us = max(flops_per_step / rate, load_bytes / SM_LOAD_BYTES_PER_US)
  cost = cdiv(ctas, max(num_sms, 1)) * (steps * step_us + CTA_FIXED_US)
  if splits > 1:
    outputs = problem.batch * problem.m * problem.n
    cost += REDUCTION_LAUNCH_US + (
        outputs * (2 * splits * 4 + out_size)) / REDUCTION_BYTES_PER_US
  return cost


#: The k_splits `split_k_heuristic` weighs.
SPLIT_K_SPLITS = (1, 2, 3, 4, 6, 8, 12, 16)


def split_k_candidates(problem: GemmProblem) -> list[SplitKConfig]:
  """Every (k_splits, tile_m, tile_n) of the heuristic's grid with the
  deepest ring that fits, fewer splits and bigger tiles first: the
  autotuner's search space."""
  tile_k = swizzle_elems(problem.in_dtype)
  out = []
  for k_splits in SPLIT_K_SPLITS:
    for tile_m, tile_n in ((128, 128), (128, 64), (64, 128), (64, 64)):
      for stages in (6, 5, 4, 3, 2):
        config = SplitKConfig(tile_m=tile_m, tile_n=tile_n, tile_k=tile_k,
                              max_concurrent_steps=stages, k_splits=k_splits)
        if config.fits(problem):
          out.append(config)
          break
  return out


def split_k_heuristic(problem: GemmProblem, num_sms: int) -> SplitKConfig:
  """The candidate with the lowest modelled time (`split_k_cost`); ties go
  to fewer splits, then to bigger tiles (the order of the candidates)."""
  best = None
  for config in split_k_candidates(problem):
    cost = split_k_cost(problem, config, num_sms)
    if best is None or cost < best[0] * 0.99:
      best = (cost, config)
  if best is None:  # nothing fits: the smallest footprint, for its error
    return SplitKConfig(tile_m=64, tile_n=64,
                        tile_k=swizzle_elems(problem.in_dtype),
                        max_concurrent_steps=2)
  return best[1]
