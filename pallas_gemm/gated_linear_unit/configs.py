"""The frozen launch config of the Mosaic GLU kernel and its heuristic.

Each consumer warpgroup holds two float32 accumulators (gate and up) of
tile_m x tile_n, so its register budget caps tile_m * tile_n at half of
what one plain GEMM accumulator may take: 64 x 128 per accumulator is the
same 128 registers a thread as ws_persistent's 64 x 256 tile. One pipeline
stage holds one x tile and two weight tiles (same columns, gate and up).
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from pallas_gemm.config_fields import (Requirement, at_least, checked,
                                       multiple_dividing, one_of, validate)
from pallas_gemm.gated_linear_unit.problem import GluProblem
from pallas_gemm.mosaic_backend.config import (HOPPER_SMEM_BYTES,
                                               SMEM_SLACK_BYTES, Dim)
from pallas_gemm.mosaic_backend.configs import DIM_CONVERTERS, TwoConsumerTile
from pallas_gemm.problem import cdiv

#: tile_m * tile_n of one accumulator: two of them take 128 f32 registers
#: per consumer thread, leaving the rest of 232 for the epilogue.
MAX_ACC_ELEMS = 64 * 128


#: The ring holds the stages by which the second consumer lags.
_WITHIN_THE_RING = Requirement(
    lambda lag, config: 0 <= lag < config.max_concurrent_steps,
    lambda config: (">= 0 and < max_concurrent_steps="
                    f"{config.max_concurrent_steps}"))


@dataclasses.dataclass(frozen=True)
class GluConfig(TwoConsumerTile):
  """One launch of the Mosaic GLU kernel.

  tile_m, tile_n: the gate (and up) accumulator of one consumer warpgroup;
    the CTA tile is twice that along `wg_dimension`. tile_m is 64 or 128,
    tile_n a multiple of 64 up to 128; tile_m * tile_n <= 8192 (registers).
  tile_k: K per pipeline stage, 64 (one 128-byte swizzle span of bf16).
  max_concurrent_steps: stages in the shared-memory ring (>= 2).
  epi_tile_n: columns of the output sub-tile staged per TMA store (a
    multiple of 8 dividing tile_n); the sub-tile is 64 rows.
  band_dim, grid_band: the snake order of output tiles (see
    `ws_persistent.tile_coordinates`).
  wg_dimension: the dimension split between the two consumers: M for
    large token counts, N when M fits in one 64-row wgmma group.
  fast_math: the epilogue's activation on the SFU's approximate
    instructions (sigmoid and silu through one tanh.approx, exp and tanh
    approximate) instead of exact exp and IEEE division: the epilogue
    stalls the tensor cores, and the approximate forms' error (about 2^-11
    relative) is far below a 16-bit output's rounding.
  consumer_lag: k-steps by which the second consumer starts behind the
    first (< max_concurrent_steps: the ring holds the gap). The two then
    reach their epilogues at different times, and one's epilogue can run
    while the other issues wgmma; 0 runs them in lockstep.
  x_in_registers: each consumer loads its x tile (64 x 64) from shared
    memory into registers once per k-step, and both wgmma read it there
    (shared-memory reads per step as a plain GEMM's, instead of x read
    twice); needs tile_m = 64 (wgmma's register operand is one 64-row
    group).
  """

  tile_m: int = checked(64, one_of(64, 128))
  tile_n: int = checked(128, one_of(64, 128).because(
      "whole 128-byte swizzle spans, wgmma's N range"))
  tile_k: int = checked(64, one_of(64).because(
      "one 128-byte swizzle span of 16-bit inputs"))
  max_concurrent_steps: int = checked(4, at_least(2))
  epi_tile_n: int = checked(64, multiple_dividing(8, "tile_n"))
  band_dim: Dim = Dim.M
  grid_band: int = checked(8, at_least(1))
  wg_dimension: Dim = Dim.M
  fast_math: bool = False
  consumer_lag: int = checked(0, _WITHIN_THE_RING)
  x_in_registers: bool = False

  def __post_init__(self):
    validate(self, DIM_CONVERTERS)
    if self.tile_m * self.tile_n > MAX_ACC_ELEMS:
      raise ValueError(
          f"GluConfig.tile_m * tile_n = {self.tile_m * self.tile_n} must be "
          f"<= {MAX_ACC_ELEMS}: two float32 accumulators of that size take "
          "all the registers a consumer warpgroup has")
    if self.x_in_registers:
      # Compiled on an H200 it gave wrong results (relative error 0.1-1.2
      # against float64, tests/test_glu.py::test_mosaic_on_gpu_vs_float64);
      # refused until that is found, rather than offered.
      raise NotImplementedError(
          "GluConfig.x_in_registers=True is disabled: it computed wrong "
          "results on a GPU; use the default (x read from shared memory)")

  @property
  def epi_tile_m(self) -> int:
    return 64

  @property
  def epilogue_tiles_per_wg(self) -> int:
    return (self.tile_m // self.epi_tile_m) * (self.tile_n // self.epi_tile_n)

  @property
  def out_slots(self) -> int:
    """Double-buffered staging only with an even count of sub-tiles per
    output tile, so that slot parity carries from one tile to the next
    (with residuals each sub-tile makes three stores, which keeps an even
    count even)."""
    return 2 if self.epilogue_tiles_per_wg % 2 == 0 else 1

  def smem_bytes(self, problem: GluProblem) -> int:
    """Shared memory of one CTA. The gate and up residuals (the forward
    pass of the gradient) are staged through the same output slots, so
    they cost no shared memory."""
    in_size = jnp.dtype(problem.in_dtype).itemsize
    out_size = jnp.dtype(problem.out_dtype).itemsize
    stage = (self.cta_tile_m + 2 * self.cta_tile_n) * self.tile_k * in_size
    staged = 2 * self.out_slots * self.epi_tile_m * self.epi_tile_n * out_size
    return self.max_concurrent_steps * stage + staged + SMEM_SLACK_BYTES

  def fits(self, problem: GluProblem) -> bool:
    return self.smem_bytes(problem) <= HOPPER_SMEM_BYTES


#: (tile_m, tile_n, wg_dimension, slowdown): the CTA tiles the heuristic
#: weighs. The slowdown is the shared-memory traffic per flop relative to
#: the 128 x 128 CTA tile (x rows read once per two weight tiles).
CTA_TILE_CHOICES = (
    (64, 128, Dim.M, 1.0),
    (128, 64, Dim.M, 1.1),
    (64, 64, Dim.M, 1.25),
    (64, 128, Dim.N, 1.25),
    (64, 64, Dim.N, 1.5),
)


def glu_waves(problem: GluProblem, config: GluConfig, num_sms: int) -> int:
  tiles = cdiv(problem.m, config.cta_tile_m) * cdiv(problem.n,
                                                    config.cta_tile_n)
  return cdiv(tiles, max(num_sms, 1))


#: Output dtypes whose rounding (2^-9 relative for bf16, 2^-12 for f16 at
#: most) hides the approximate activation of `GluConfig.fast_math`; a float32
#: output keeps the exact one.
FAST_MATH_OUT_DTYPES = ("bfloat16", "float16")


def balanced_band(cta_tile_m: int, cta_tile_n: int, num_sms: int) -> int:
  """The grid band (M-tiles per band) whose concurrent tiles, one per SM,
  read the fewest distinct operand bytes: `band` row blocks of x
  (band * cta_tile_m rows) and num_sms / band column blocks of both weights
  (2 * cta_tile_n columns each), least at band^2 = num_sms * 2 * cta_tile_n
  / cta_tile_m; rounded to a power of two."""
  ideal = math.sqrt(max(num_sms, 1) * 2 * cta_tile_n / cta_tile_m)
  return 2 ** max(0, round(math.log2(ideal)))


def glu_heuristic(problem: GluProblem, num_sms: int) -> GluConfig:
  """The CTA tile whose waves cost least (waves x CTA area x slowdown),
  then the deepest pipeline that fits in shared memory, with the
  approximate-math epilogue for 16-bit outputs (the epilogue stalls both
  consumers' wgmma, and its exact exp and division cost more than the
  main loop's slack), and the grid band that keeps the operands of the
  tiles in flight smallest (`balanced_band`). The consumers run in
  lockstep (consumer_lag=0): a lag moved nothing on the H200.

  Padding rows of a CTA tile cost their full wgmma time, so when m is
  small (decode) a tile split over N wastes less than one split over M.
  """
  def cost(choice):
    tile_m, tile_n, wg_dim, slowdown = choice
    config = GluConfig(tile_m=tile_m, tile_n=tile_n, wg_dimension=wg_dim)
    return (glu_waves(problem, config, num_sms) * config.cta_tile_m
            * config.cta_tile_n * slowdown)

  tile_m, tile_n, wg_dim, _ = min(CTA_TILE_CHOICES, key=cost)
  epi_tile_n = min(tile_n, 128 // jnp.dtype(problem.out_dtype).itemsize)
  base = GluConfig(tile_m=tile_m, tile_n=tile_n, wg_dimension=wg_dim,
                   epi_tile_n=epi_tile_n,
                   fast_math=problem.out_dtype in FAST_MATH_OUT_DTYPES)
  base = dataclasses.replace(base, grid_band=balanced_band(
      base.cta_tile_m, base.cta_tile_n, num_sms))
  for stages in (5, 4, 3):
    config = dataclasses.replace(base, max_concurrent_steps=stages)
    if config.fits(problem):
      return config
  return dataclasses.replace(base, max_concurrent_steps=2)
