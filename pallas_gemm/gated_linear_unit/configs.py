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
  k_splits: the contraction cut into this many equal runs of k-steps, each
    a tile of its own, so that an output of few tiles (a decode batch, a
    narrow width) still keeps most SMs busy. The activation is not linear,
    so a split kernel stores float32 partial gate and up products instead
    of the output, and XLA sums them and gates in one fusion. It must
    divide the problem's k-steps (`k_steps`); 1 gates in the kernel.
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
  k_splits: int = checked(1, at_least(1))

  def __post_init__(self):
    validate(self, DIM_CONVERTERS)
    if self.tile_m * self.tile_n > MAX_ACC_ELEMS:
      raise ValueError(
          f"GluConfig.tile_m * tile_n = {self.tile_m * self.tile_n} must be "
          f"<= {MAX_ACC_ELEMS}: two float32 accumulators of that size take "
          "all the registers a consumer warpgroup has")
    if self.fast_math and self.k_splits > 1:
      raise ValueError(
          "GluConfig.fast_math=True with k_splits > 1: a split kernel does "
          "not gate (XLA sums its partials and gates exactly), so the "
          "approximate activation would not run")
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

  def stored_dtype(self, problem: GluProblem) -> str:
    """What the kernel stores: the output, or float32 partial products
    when the contraction is split."""
    return "float32" if self.k_splits > 1 else problem.out_dtype

  def smem_bytes(self, problem: GluProblem) -> int:
    """Shared memory of one CTA. The gate and up residuals (the forward
    pass of the gradient) are staged through the same output slots, so
    they cost no shared memory."""
    in_size = jnp.dtype(problem.in_dtype).itemsize
    out_size = jnp.dtype(self.stored_dtype(problem)).itemsize
    stage = (self.cta_tile_m + 2 * self.cta_tile_n) * self.tile_k * in_size
    staged = 2 * self.out_slots * self.epi_tile_m * self.epi_tile_n * out_size
    return self.max_concurrent_steps * stage + staged + SMEM_SLACK_BYTES

  def fits(self, problem: GluProblem) -> bool:
    return self.smem_bytes(problem) <= HOPPER_SMEM_BYTES

  def misfit(self, problem: GluProblem) -> str | None:
    """Why this config cannot run `problem`, or None."""
    if not self.fits(problem):
      return (f"config={self} needs {self.smem_bytes(problem)} bytes of "
              f"shared memory, more than the {HOPPER_SMEM_BYTES} an sm_90 "
              "block has")
    steps = k_steps(problem, self)
    if steps % self.k_splits:
      return (f"config.k_splits={self.k_splits} does not divide the "
              f"{steps} k-steps of k={problem.k} (tile_k={self.tile_k})")
    return None


def k_steps(problem: GluProblem, config: GluConfig) -> int:
  return cdiv(problem.k, config.tile_k)


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


def output_tiles(problem: GluProblem, config: GluConfig) -> int:
  return (cdiv(problem.m, config.cta_tile_m)
          * cdiv(problem.n, config.cta_tile_n))


def glu_waves(problem: GluProblem, config: GluConfig, num_sms: int) -> int:
  return cdiv(output_tiles(problem, config), max(num_sms, 1))


def busy_share(tiles: int, num_sms: int) -> float:
  """The share of the SMs that `tiles` tiles keep busy over their waves."""
  sms = max(num_sms, 1)
  return tiles / (cdiv(tiles, sms) * sms)


#: Each run of a split contraction keeps at least this many k-steps: with
#: fewer, filling the ring and storing the partials take much of the run.
MIN_SPLIT_STEPS = 8
#: Flops a Hopper GPU runs in the time it copies one byte (its dense 16-bit
#: rate over its copy bandwidth, to the order of the datasheets): weighs the
#: partial products' traffic against the compute a split spreads out.
RIDGE_FLOPS_PER_BYTE = 250
#: A split is taken only where its estimate is below this share of the
#: unsplit kernel's (the partials' sum is a second pass the estimate does
#: not see).
SPLIT_GAIN = 0.8


def split_cost(problem: GluProblem, config: GluConfig, splits: int,
               num_sms: int) -> float:
  """The call's estimated time, in bytes copied, with the contraction cut
  in `splits` runs: its work (the flops over the ridge or the operand
  bytes, whichever is more) spread over the share of the SMs its tiles
  keep busy, plus the float32 partial gate and up products written and
  read back when split."""
  in_size = jnp.dtype(problem.in_dtype).itemsize
  out_size = jnp.dtype(problem.out_dtype).itemsize
  m, n, k = problem.m, problem.n, problem.k
  busy = busy_share(output_tiles(problem, config) * splits, num_sms)
  operand_bytes = (m * k + 2 * k * n) * in_size + m * n * out_size
  work = max(4 * m * n * k / RIDGE_FLOPS_PER_BYTE, operand_bytes) / busy
  if splits > 1:
    rows = cdiv(m, config.cta_tile_m) * config.cta_tile_m
    cols = cdiv(n, config.cta_tile_n) * config.cta_tile_n
    work += 2 * 2 * splits * rows * cols * 4
  return work


def glu_k_splits(problem: GluProblem, config: GluConfig, num_sms: int) -> int:
  """The split of the contraction (a divisor of its k-steps, each run at
  least MIN_SPLIT_STEPS long) that `split_cost` puts lowest, where that is
  under SPLIT_GAIN of the unsplit kernel's; else 1."""
  steps = k_steps(problem, config)
  unsplit = split_cost(problem, config, 1, num_sms)
  best, best_cost = 1, unsplit * SPLIT_GAIN
  for splits in range(2, steps // MIN_SPLIT_STEPS + 1):
    if steps % splits:
      continue
    cost = split_cost(problem, config, splits, num_sms)
    if cost < best_cost:
      best, best_cost = splits, cost
  return best


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
  Where the output has too few tiles to keep the SMs busy, the contraction
  is split (`glu_k_splits`).
  """
  def cost(choice):
    tile_m, tile_n, wg_dim, slowdown = choice
    config = GluConfig(tile_m=tile_m, tile_n=tile_n, wg_dimension=wg_dim)
    return (glu_waves(problem, config, num_sms) * config.cta_tile_m
            * config.cta_tile_n * slowdown)

  tile_m, tile_n, wg_dim, _ = min(CTA_TILE_CHOICES, key=cost)
  base = GluConfig(tile_m=tile_m, tile_n=tile_n, wg_dimension=wg_dim)
  base = dataclasses.replace(
      base, k_splits=glu_k_splits(problem, base, num_sms))
  base = dataclasses.replace(
      base, epi_tile_n=epilogue_width(base, problem),
      fast_math=(base.k_splits == 1
                 and problem.out_dtype in FAST_MATH_OUT_DTYPES))
  base = dataclasses.replace(base, grid_band=balanced_band(
      base.cta_tile_m, base.cta_tile_n, num_sms))
  return deepest_ring(base, problem)


def epilogue_width(config: GluConfig, problem: GluProblem) -> int:
  """Columns of an output sub-tile: one 128-byte row of what the kernel
  stores (`GluConfig.stored_dtype`), at most tile_n."""
  stored_size = jnp.dtype(config.stored_dtype(problem)).itemsize
  return min(config.tile_n, 128 // stored_size)


def deepest_ring(config: GluConfig, problem: GluProblem) -> GluConfig:
  """`config` with the deepest ring of 5, 4 or 3 stages that fits in shared
  memory, else of 2."""
  for stages in (5, 4, 3):
    deeper = dataclasses.replace(config, max_concurrent_steps=stages)
    if deeper.fits(problem):
      return deeper
  return dataclasses.replace(config, max_concurrent_steps=2)
