"""The frozen launch configs of the Mosaic kernels and their shared memory.

Nothing here needs a GPU: a config is a plain frozen dataclass, validated
when it is built, and its shared-memory footprint is computed before
anything is compiled, so a candidate that cannot fit is dropped without
paying for a compile. Constraints that depend on the problem's dtypes (a
tile spanning whole swizzle atoms) are checked by the kernels, through
`tma.check_full_swizzle`, when the dtype is known.
"""

from __future__ import annotations

import dataclasses
import enum

import jax.numpy as jnp

from pallas_gemm.config_fields import (at_least, checked, field_error,
                                       multiple_dividing, multiple_in_range,
                                       one_of, validate)
from pallas_gemm.problem import GemmProblem

#: Opt-in shared memory per block on sm_90 (227 KiB).
HOPPER_SMEM_BYTES = 227 * 1024
#: Barriers, alignment slack and the pipeline's bookkeeping.
SMEM_SLACK_BYTES = 2 * 1024

MOSAIC_INPUT_DTYPES = ("bfloat16", "float16", "float32")

#: wgmma multiplies groups of 64 rows; a warpgroup's accumulator holds at
#: most 256 of them at the register budget the consumers get.
WGMMA_ROWS = 64
#: wgmma's N is a multiple of 8 up to 256.
WGMMA_N_STEP, WGMMA_MAX_N = 8, 256


class Dim(enum.IntEnum):
  M = 0
  N = 1


def hopper_device_unsupported(device) -> str | None:
  """Why no Mosaic kernel (of any op) can run on `device`: each needs a
  Hopper GPU, or a CPU to interpret on."""
  if device.is_gpu and not device.is_hopper:
    return "needs an sm_90 (Hopper) GPU: wgmma and the TMA"
  if not device.is_gpu and device.platform != "cpu":
    return f"platform {device.platform} is not a CUDA GPU"
  return None


def hopper_unsupported(problem, device) -> str | None:
  """Why neither Mosaic GEMM kernel can run `problem` on `device`: the
  checks they share (`hopper_device_unsupported`; 16-bit or TF32 inputs;
  16/32-bit outputs and C)."""
  reason = hopper_device_unsupported(device)
  if reason:
    return reason
  if problem.in_dtype not in MOSAIC_INPUT_DTYPES:
    return f"input dtype {problem.in_dtype} is not one of {MOSAIC_INPUT_DTYPES}"
  if problem.in_dtype == "float32" and problem.precision == "ieee":
    return "wgmma has no exact-fp32 mode (float32 runs only as TF32)"
  for name, dtype in (("output", problem.out_dtype), ("c", problem.c_dtype)):
    if dtype is not None and dtype not in ("float32", "bfloat16", "float16"):
      return f"{name} dtype {dtype} is not supported"
  return None


def _as_dim(config, name: str, value, allowed: str = "Dim.M or Dim.N") -> Dim:
  """The field as a `Dim`; configs read back from JSON carry 0 or 1."""
  if isinstance(value, bool) or not isinstance(value, int) or value not in (
      0, 1):
    raise TypeError(field_error(config, name, value, allowed))
  return Dim(value)


def _as_dim_or_none(config, name: str, value) -> Dim | None:
  if value is None:
    return None
  return _as_dim(config, name, value, "None, Dim.M or Dim.N")


#: How `config_fields.check_types` checks the Mosaic configs' `Dim` fields.
DIM_CONVERTERS = {"Dim": _as_dim, "Dim | None": _as_dim_or_none}

#: A tile_n that wgmma takes as its N.
WGMMA_TILE_N = multiple_in_range(WGMMA_N_STEP, WGMMA_N_STEP,
                                 WGMMA_MAX_N).because("wgmma's N range")


#: Consumer warpgroups of every warp-specialised Mosaic kernel (beside
#: its one producer warpgroup).
NUM_CONSUMERS = 2

#: CTAs of each cluster a clustered Mosaic kernel launches: a pair that
#: shares one operand through TMA multicast (and, with claims, one tile).
CLUSTER_CTAS = 2


class TwoConsumerTile:
  """The CTA tile of a config whose NUM_CONSUMERS consumer warpgroups each
  compute a tile_m x tile_n part, side by side along `wg_dimension`."""

  @property
  def cta_tile_m(self) -> int:
    return self.tile_m * (NUM_CONSUMERS if self.wg_dimension == Dim.M else 1)

  @property
  def cta_tile_n(self) -> int:
    return self.tile_n * (NUM_CONSUMERS if self.wg_dimension == Dim.N else 1)


@dataclasses.dataclass(frozen=True)
class MosaicConfig(TwoConsumerTile):
  """One launch of `mosaic/ws_persistent`.

  tile_m, tile_n: the output tile each of the two consumer warpgroups owns;
    the CTA tile is twice that along `wg_dimension`. tile_m is 64, 128, 192
    or 256 (wgmma's 64-row groups); tile_n a multiple of 8 up to 256
    (wgmma's N range).
  tile_k: the K extent of one pipeline stage: 16, 32, 64 or 128 elements.
    The kernel also needs tile_k and tile_n to span whole 128-byte swizzle
    atoms of the input dtype (64 16-bit or 32 float32 elements), checked
    when the dtype is known.
  max_concurrent_steps: pipeline stages resident in shared memory (>= 2:
    one being loaded while one is read).
  epi_tile_m, epi_tile_n: the sub-tile the epilogue stages through shared
    memory for each TMA store (smaller tiles = less shared memory); they
    divide tile_m and tile_n, epi_tile_m in 64-row groups, epi_tile_n in
    multiples of 8.
  band_dim, grid_band: the tile order. Output tiles are grouped in bands
    `grid_band` (>= 1) tiles wide along `band_dim`; consecutive tiles walk
    across the band first, then step along the other dimension, and every
    other band runs backwards (a snake). The CTAs in flight then share
    operand tiles in L2 instead of each streaming its own.
  wg_dimension: the dimension split between the two consumer warpgroups.
  warpgroup_semantics: lower with Mosaic's warpgroup-level semantics (layouts
    inferred) instead of lane-level semantics (layouts explicit).

  Every field is validated here: an int field given a bool, float or
  string raises TypeError, a value out of range ValueError, each naming
  the field and the value.
  """

  tile_m: int = checked(128, one_of(64, 128, 192, 256).because(
      "wgmma works on 64-row groups"))
  tile_n: int = checked(128, WGMMA_TILE_N)
  tile_k: int = checked(64, one_of(16, 32, 64, 128))
  max_concurrent_steps: int = checked(4, at_least(2))
  epi_tile_m: int = checked(64, multiple_dividing(WGMMA_ROWS, "tile_m"))
  epi_tile_n: int = checked(64, multiple_dividing(WGMMA_N_STEP, "tile_n"))
  band_dim: Dim = Dim.M
  grid_band: int = checked(8, at_least(1))
  wg_dimension: Dim = Dim.N
  warpgroup_semantics: bool = False

  def __post_init__(self):
    validate(self, DIM_CONVERTERS)

  @property
  def epilogue_tiles_per_wg(self) -> int:
    return (self.tile_m // self.epi_tile_m) * (self.tile_n // self.epi_tile_n)

  @property
  def out_slots(self) -> int:
    """Double-buffer the staged output only when the slot parity stays
    consistent from one output tile to the next (an even count per tile)."""
    return 2 if self.epilogue_tiles_per_wg % 2 == 0 else 1

  def smem_bytes(self, problem: GemmProblem | str) -> int:
    """Shared memory of one CTA. Takes the problem, or (as the autotune
    cache asks) only the input dtype, then assuming a plain epilogue."""
    problem = _as_problem(problem)
    in_size = jnp.dtype(problem.in_dtype).itemsize
    out_size = jnp.dtype(problem.out_dtype).itemsize
    stage = (self.cta_tile_m + self.cta_tile_n) * self.tile_k * in_size
    total = self.max_concurrent_steps * stage
    total += 2 * self.out_slots * self.epi_tile_m * self.epi_tile_n * out_size
    if problem.epilogue.has_c:
      c_size = jnp.dtype(problem.c_dtype or "float32").itemsize
      total += 2 * self.epi_tile_m * self.epi_tile_n * c_size
    if problem.epilogue.has_bias:
      total += 2 * self.tile_n * 4
    return total + SMEM_SLACK_BYTES

  def fits(self, problem: GemmProblem | str) -> bool:
    return self.smem_bytes(problem) <= HOPPER_SMEM_BYTES


@dataclasses.dataclass(frozen=True)
class SmallMConfig:
  """One launch of `mosaic/small_m` (M <= 128, bandwidth-bound).

  Each CTA owns a tile_n-wide column strip (a multiple of 8 up to 256,
  wgmma's N range) and a 1/k_splits share of K (k_splits >= 1), so
  n_tiles * k_splits CTAs stream B concurrently, each through a
  max_concurrent_steps-deep ring (>= 2) of tile_k-deep stages (32, 64, 128
  or 256 elements; the kernel also needs tile_k and tile_n to span whole
  128-byte swizzle atoms of the input dtype). With k_splits > 1 the f32
  partial products are summed by XLA in a fixed order (deterministic).
  Fields are validated as `MosaicConfig`'s are.
  """

  tile_n: int = checked(128, WGMMA_TILE_N)
  tile_k: int = checked(128, one_of(32, 64, 128, 256))
  max_concurrent_steps: int = checked(6, at_least(2))
  k_splits: int = checked(1, at_least(1))

  def __post_init__(self):
    validate(self)

  def smem_bytes(self, problem: GemmProblem | str,
                 tile_m: int | None = None) -> int:
    """Shared memory of one CTA (tile_m: 64 for M <= 64, else 128). Takes
    the problem, or only the input dtype as the autotune cache asks."""
    problem = _as_problem(problem)
    if tile_m is None:
      tile_m = small_m_tile_m(problem)
    return one_consumer_smem_bytes(problem, tile_m, self)

  def fits(self, problem: GemmProblem | str) -> bool:
    return self.smem_bytes(problem) <= HOPPER_SMEM_BYTES


@dataclasses.dataclass(frozen=True)
class SplitKConfig:
  """One launch of `mosaic/split_k` (few output tiles, K long enough to
  share out).

  Each CTA owns one tile_m x tile_n output tile (tile_m 64 or 128, one
  consumer warpgroup's wgmma rows; tile_n a multiple of 8 up to 256) and a
  1/k_splits share of K (k_splits >= 1), through a max_concurrent_steps-deep
  ring (>= 2) of tile_k-deep stages (32, 64, 128 or 256 elements; tile_k
  and tile_n span whole 128-byte swizzle atoms of the input dtype). With
  k_splits > 1 the f32 partial tiles are summed by XLA in a fixed order
  (deterministic). Fields are validated as `MosaicConfig`'s are.
  """

  tile_m: int = checked(128, one_of(64, 128))
  tile_n: int = checked(128, WGMMA_TILE_N)
  tile_k: int = checked(64, one_of(32, 64, 128, 256))
  max_concurrent_steps: int = checked(4, at_least(2))
  k_splits: int = checked(1, at_least(1))

  def __post_init__(self):
    validate(self)

  def smem_bytes(self, problem: GemmProblem | str) -> int:
    """Shared memory of one CTA. Takes the problem, or only the input
    dtype as the autotune cache asks."""
    return one_consumer_smem_bytes(_as_problem(problem), self.tile_m, self)

  def fits(self, problem: GemmProblem | str) -> bool:
    return self.smem_bytes(problem) <= HOPPER_SMEM_BYTES


def one_consumer_smem_bytes(problem: GemmProblem, tile_m: int,
                            config: SmallMConfig | SplitKConfig) -> int:
  """Shared memory of a CTA of the one-consumer kernels (`small_m`,
  `split_k`): the ring of A and B stages, the staged output tile (f32
  partials when K is split), and C and bias when the epilogue is fused."""
  in_size = jnp.dtype(problem.in_dtype).itemsize
  stage = (tile_m + config.tile_n) * config.tile_k * in_size
  split = config.k_splits > 1
  out_size = 4 if split else jnp.dtype(problem.out_dtype).itemsize
  total = (config.max_concurrent_steps * stage
           + tile_m * config.tile_n * out_size)
  if problem.epilogue.has_c and not split:
    total += tile_m * config.tile_n * jnp.dtype(
        problem.c_dtype or "float32").itemsize
  if problem.epilogue.has_bias and not split:
    total += config.tile_n * 4
  return total + SMEM_SLACK_BYTES


def small_m_tile_m(problem: GemmProblem) -> int:
  """The rows wgmma multiplies in `mosaic/small_m`: one 64-row group when
  M fits in it, else two."""
  return 64 if problem.m <= 64 else 128


def _as_problem(problem: GemmProblem | str) -> GemmProblem:
  if isinstance(problem, GemmProblem):
    return problem
  dtype = jnp.dtype(problem).name
  return GemmProblem(1, 128, 128, 128, dtype, dtype)
