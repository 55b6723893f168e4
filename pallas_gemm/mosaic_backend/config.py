"""Configs, shared-memory budgets and operand preparation for the Mosaic kernels.

Nothing here needs a GPU: configs are plain frozen dataclasses and the
footprint arithmetic is done before anything is compiled, so a candidate that
cannot fit in shared memory is dropped without paying for a compile.

Ragged shapes. The TMA handles a box that runs past the end of an array
(zero fill on load, clipping on store), but Mosaic copies a swizzled tile
with a *tiled* TMA descriptor: it views the whole global array as tiles of
(8 rows x one 128-byte swizzle span), so both of an operand's last two dims
must be multiples of that tile (measured on the H200: a 66-column B is
rejected at compile time, a 1x1 operand silently computes garbage). An
operand whose dims are not multiples is therefore zero-padded on the device
up to the next multiple (at most 7 rows and one swizzle span minus one
column), and a padded output is sliced back. Zero padding along K adds
nothing; padded rows/columns of the output are dropped. Tile-aligned shapes
(every power-of-two size) pay nothing; other shapes pay one copy of each
misaligned operand, which the benchmark measures.
"""

from __future__ import annotations

import dataclasses
import enum

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_gemm.problem import GemmProblem, cdiv

#: Opt-in shared memory per block on sm_90 (227 KiB).
HOPPER_SMEM_BYTES = 227 * 1024
#: Barriers, alignment slack and the pipeline's bookkeeping.
SMEM_SLACK_BYTES = 2 * 1024
#: The TMA needs every non-minor stride to be a multiple of this many bytes.
TMA_STRIDE_ALIGN_BYTES = 16
#: 128-byte swizzle is the only one that lets wgmma read tiles conflict-free
#: at full rate, so every operand tile's minor dimension spans 128 bytes.
SWIZZLE_BYTES = 128

MOSAIC_INPUT_DTYPES = ("bfloat16", "float16", "float32")


def require_ints(config, names) -> None:
  """Raises TypeError naming the field when one of `names` is not an int
  (a bool, float or str would pass the range checks and fail deep in
  lowering); numpy integers are stored as plain ints."""
  for name in names:
    value = getattr(config, name)
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
      raise TypeError(f"{type(config).__name__}.{name}={value!r} must be an "
                      f"int, got {type(value).__name__}")
    object.__setattr__(config, name, int(value))


class Dim(enum.IntEnum):
  M = 0
  N = 1


@dataclasses.dataclass(frozen=True)
class MosaicConfig:
  """One launch of `mosaic/ws_persistent`.

  tile_m, tile_n: the output tile each of the two consumer warpgroups owns;
    the CTA tile is twice that along `wg_dimension` (cooperative), or the
    same tile (`pingpong`).
  tile_k: the K extent of one pipeline stage.
  max_concurrent_steps: pipeline stages resident in shared memory.
  epi_tile_m, epi_tile_n: the sub-tile the epilogue stages through shared
    memory for each TMA store (smaller tiles = less shared memory).
  band_dim, grid_band: the tile order. Output tiles are grouped in bands
    `grid_band` tiles wide along `band_dim`; consecutive tiles walk across
    the band first, then step along the other dimension, and every other
    band runs backwards (a snake). The CTAs in flight then share operand
    tiles in L2 instead of each streaming its own.
  wg_dimension: the dimension split between the two consumer warpgroups.
  warpgroup_semantics: lower with Mosaic's warpgroup-level semantics (layouts
    inferred) instead of lane-level semantics (layouts explicit).
  pingpong: the two consumer warpgroups take alternate output tiles of the
    CTA instead of halves of one tile. Their main loops then follow each
    other through the shared ring, so one warpgroup's epilogue runs while
    the other keeps the tensor cores busy; in the cooperative schedule both
    stop for the epilogue. `wg_dimension` is ignored. On the H200 no
    pingpong config beat the cooperative default: a consumer's own tile is
    then smaller, and moves more operand bytes per flop
    (experiments/results/nvidia_h200/mosaic/README.md).
  cluster_dim: None, or the dimension along which two neighbouring CTA
    tiles form a 2-CTA cluster. The operand tile both need (B's for Dim.M,
    A's for Dim.N) is fetched once from L2, half by each CTA, and the TMA
    multicasts it into both CTAs' shared memory: that operand's L2 traffic
    halves. A stage is refilled only when the consumers of both CTAs have
    released it. On the H200 it moved the large suite by -0.5 to +0.6 %
    (along M) and cost 2-3 % (along N), so the search space leaves it out.
  """

  tile_m: int = 128
  tile_n: int = 128
  tile_k: int = 64
  max_concurrent_steps: int = 4
  epi_tile_m: int = 64
  epi_tile_n: int = 64
  band_dim: Dim = Dim.M
  grid_band: int = 8
  wg_dimension: Dim = Dim.N
  warpgroup_semantics: bool = False
  pingpong: bool = False
  cluster_dim: Dim | None = None

  def __post_init__(self):
    require_ints(self, ("tile_m", "tile_n", "tile_k", "max_concurrent_steps",
                        "epi_tile_m", "epi_tile_n", "grid_band"))
    if not isinstance(self.warpgroup_semantics, bool):
      raise TypeError(f"warpgroup_semantics={self.warpgroup_semantics!r} "
                      "must be a bool")
    if self.tile_m % 64 or not 64 <= self.tile_m <= 256:
      raise ValueError(f"tile_m={self.tile_m} must be 64, 128, 192 or 256 "
                       "(wgmma works on 64-row groups)")
    if self.tile_n % 8 or not 8 <= self.tile_n <= 256:
      raise ValueError(f"tile_n={self.tile_n} must be a multiple of 8 in "
                       "[8, 256] (wgmma's N range)")
    if self.tile_k not in (16, 32, 64, 128):
      raise ValueError(f"tile_k={self.tile_k} must be 16, 32, 64 or 128")
    if self.max_concurrent_steps < 2:
      raise ValueError(
          f"max_concurrent_steps={self.max_concurrent_steps} must be >= 2")
    if self.epi_tile_m % 64 or self.tile_m % self.epi_tile_m:
      raise ValueError(f"epi_tile_m={self.epi_tile_m} must be a multiple of 64 "
                       f"dividing tile_m={self.tile_m}")
    if self.epi_tile_n % 8 or self.tile_n % self.epi_tile_n:
      raise ValueError(f"epi_tile_n={self.epi_tile_n} must be a multiple of 8 "
                       f"dividing tile_n={self.tile_n}")
    if self.grid_band < 1:
      raise ValueError(f"grid_band={self.grid_band} must be >= 1")
    for name in ("band_dim", "wg_dimension"):
      value = getattr(self, name)
      # Configs read back from JSON (the autotune cache) carry plain ints.
      if isinstance(value, int) and not isinstance(value, bool) and value in (
          0, 1):
        object.__setattr__(self, name, Dim(value))
      elif not isinstance(value, Dim):
        raise TypeError(f"{name}={value!r} must be Dim.M or Dim.N")

    if not isinstance(self.pingpong, bool):
      raise TypeError(f"pingpong={self.pingpong!r} must be a bool")
    if self.cluster_dim is not None:
      if isinstance(self.cluster_dim, bool) or self.cluster_dim not in (0, 1):
        raise TypeError(
            f"cluster_dim={self.cluster_dim!r} must be None, Dim.M or Dim.N")
      object.__setattr__(self, "cluster_dim", Dim(self.cluster_dim))

  @property
  def cluster_size(self) -> int:
    return 1 if self.cluster_dim is None else 2

  @property
  def cta_tile_m(self) -> int:
    if self.pingpong:
      return self.tile_m
    return self.tile_m * (2 if self.wg_dimension == Dim.M else 1)

  @property
  def cta_tile_n(self) -> int:
    if self.pingpong:
      return self.tile_n
    return self.tile_n * (2 if self.wg_dimension == Dim.N else 1)

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

  Each CTA owns a tile_n-wide column strip and a 1/k_splits share of K, so
  n_tiles * k_splits CTAs stream B concurrently. With k_splits > 1 the f32
  partial products are summed by XLA in a fixed order (deterministic).
  """

  tile_n: int = 128
  tile_k: int = 128
  max_concurrent_steps: int = 6
  k_splits: int = 1

  def __post_init__(self):
    require_ints(self, ("tile_n", "tile_k", "max_concurrent_steps",
                        "k_splits"))
    if self.tile_n % 8 or not 8 <= self.tile_n <= 256:
      raise ValueError(f"tile_n={self.tile_n} must be a multiple of 8 in "
                       "[8, 256]")
    if self.tile_k not in (32, 64, 128, 256):
      raise ValueError(f"tile_k={self.tile_k} must be 32, 64, 128 or 256")
    if self.max_concurrent_steps < 2:
      raise ValueError(
          f"max_concurrent_steps={self.max_concurrent_steps} must be >= 2")
    if self.k_splits < 1:
      raise ValueError(f"k_splits={self.k_splits} must be >= 1")

  def smem_bytes(self, problem: GemmProblem | str,
                 tile_m: int | None = None) -> int:
    """Shared memory of one CTA (tile_m: 64 for M <= 64, else 128). Takes
    the problem, or only the input dtype as the autotune cache asks."""
    problem = _as_problem(problem)
    if tile_m is None:
      tile_m = 64 if problem.m <= 64 else 128
    in_size = jnp.dtype(problem.in_dtype).itemsize
    stage = (tile_m + self.tile_n) * self.tile_k * in_size
    out_size = 4 if self.k_splits > 1 else jnp.dtype(problem.out_dtype).itemsize
    total = self.max_concurrent_steps * stage + tile_m * self.tile_n * out_size
    if problem.epilogue.has_c and self.k_splits == 1:
      total += tile_m * self.tile_n * jnp.dtype(
          problem.c_dtype or "float32").itemsize
    if problem.epilogue.has_bias and self.k_splits == 1:
      total += self.tile_n * 4
    return total + SMEM_SLACK_BYTES


def _as_problem(problem: GemmProblem | str) -> GemmProblem:
  if isinstance(problem, GemmProblem):
    return problem
  dtype = jnp.dtype(problem).name
  return GemmProblem(1, 128, 128, 128, dtype, dtype)


def swizzle_elems(dtype) -> int:
  return SWIZZLE_BYTES // jnp.dtype(dtype).itemsize


def check_full_swizzle(in_dtype, **dims: int) -> None:
  """wgmma reads A and B with one swizzle; every operand tile dimension
  that can end up minor in shared memory must span whole 128-byte swizzle
  atoms, or A and B would get different swizzles (and a warpgroup's half of
  a tile would start mid-atom)."""
  elems = swizzle_elems(in_dtype)
  for name, value in dims.items():
    if value % elems:
      raise ValueError(
          f"{name}={value} must be a multiple of {elems} for "
          f"{jnp.dtype(in_dtype).name} inputs (one 128-byte swizzle span)")


def tma_tiling(minor_elems: int, dtype) -> tuple[int, int]:
  """The (rows, columns) tile of a swizzled shared-memory buffer whose minor
  dimension holds `minor_elems` elements: the widest swizzle that fits."""
  bits = jnp.dtype(dtype).itemsize * 8
  for swizzle in (128, 64, 32, 16):
    if (minor_elems * bits) % (swizzle * 8) == 0:
      return 8, swizzle * 8 // bits
  raise ValueError(
      f"a tile row of {minor_elems} {jnp.dtype(dtype).name} elements is not a "
      "multiple of 16 bytes")


def pad_to_tiling(x, tiling: tuple[int, int],
                  min_shape: tuple[int, int] = (0, 0)):
  """Zero-pads the last two axes of `x` up to multiples of `tiling`, and to
  at least `min_shape` (one TMA box: a box larger than the whole array came
  back wrong on the H200). No copy when nothing changes."""
  rows, cols = x.shape[-2:]
  padded_rows, padded_cols = padded_dims(rows, cols, tiling, min_shape)
  if (padded_rows, padded_cols) == (rows, cols):
    return x
  pad = [(0, 0)] * (x.ndim - 2) + [(0, padded_rows - rows),
                                    (0, padded_cols - cols)]
  return jnp.pad(x, pad)


def padded_dims(rows: int, cols: int, tiling: tuple[int, int],
                min_shape: tuple[int, int] = (0, 0)):
  return (cdiv(max(rows, min_shape[0]), tiling[0]) * tiling[0],
          cdiv(max(cols, min_shape[1]), tiling[1]) * tiling[1])


#: Rows and columns one program of `unpad_output` copies.
_UNPAD_BLOCK = (8, 1024)


def unpad_output(out, m: int, n: int, *, on_gpu: bool):
  """`out[:, :m, :n]` of a padded kernel output.

  When n is odd (or not a multiple of 8 elements) every row of the result
  starts at a misaligned address, and XLA's slice of such an array ran at
  about a quarter of the copy bandwidth on the H200 (80 us of a 310 us
  4095x4097x4093 matmul). A Pallas-Triton copy kernel with masked edges
  reads aligned rows with wide loads and runs much faster. Off a GPU, or
  where the Triton lowering is not available, the XLA slice stays.
  """
  if out.shape[1:] == (m, n):
    return out
  if not on_gpu or n % 8 == 0:
    return out[:, :m, :n]
  try:
    from jax.experimental.pallas import triton as pltriton
  except ImportError:
    return out[:, :m, :n]
  from jax.experimental import pallas as pl

  rows_per, cols_per = _UNPAD_BLOCK

  def kernel(src_ref, dst_ref):
    i, j = pl.program_id(1), pl.program_id(2)
    rows = i * rows_per + jnp.arange(rows_per)
    cols = j * cols_per + jnp.arange(cols_per)
    mask = (rows < m)[:, None] & (cols < n)[None, :]
    block = (pl.ds(i * rows_per, rows_per), pl.ds(j * cols_per, cols_per))
    tile = pltriton.load(src_ref.at[block], mask=mask, other=0)
    pltriton.store(dst_ref.at[block], tile, mask=mask)

  def whole(shape):
    return pl.BlockSpec((None, *shape), lambda b, i, j: (b, 0, 0))

  return pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((out.shape[0], m, n), out.dtype),
      grid=(out.shape[0], cdiv(m, rows_per), cdiv(n, cols_per)),
      in_specs=[whole(out.shape[1:])],
      out_specs=whole((m, n)),
      compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
      name="unpad_output",
  )(out)


def pad_vector(x, multiple: int):
  target = cdiv(x.shape[-1], multiple) * multiple
  if target == x.shape[-1]:
    return x
  return jnp.pad(x, [(0, target - x.shape[-1])])


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
#: (split over M) and how much slower each runs than the 128x256 CTA tile per
#: unit of work on the H200 (tune/mosaic_tune_log.json: the 256x128 CTA tile
#: 1.3-2 % over 4096^3-16384x4096x4096, the 128x128 one 7-9 %, from its
#: extra shared-memory traffic per flop).
CTA_TILE_CHOICES = ((64, 256, 1.0), (128, 128, 1.02), (64, 128, 1.08))


def _waves_of(problem: GemmProblem, cta_m: int, cta_n: int, num_sms: int):
  tiles = cdiv(problem.m, cta_m) * cdiv(problem.n, cta_n) * problem.batch
  return cdiv(tiles, max(num_sms, 1))


def waves(problem: GemmProblem, config: MosaicConfig, num_sms: int) -> int:
  """How many rounds of CTA tiles the persistent grid runs."""
  return _waves_of(problem, config.cta_tile_m, config.cta_tile_n, num_sms)


def ws_heuristic(problem: GemmProblem, num_sms: int) -> MosaicConfig:
  """The default persistent-kernel config.

  The deepest pipeline that fits, on the CTA tile whose waves of tiles
  cost least: the number of waves times the CTA tile's area times its
  slowdown (`CTA_TILE_CHOICES`). Usually the 128x256 tile (each warpgroup
  holds a 64x256 f32 accumulator, 128 registers a thread), the best timed
  on the H200; a 256x128 or 128x128 one when it wastes less of the last
  wave (N = 4097: 17 columns of 256 make 5 waves of 132 CTAs where 256x128
  tiles make exactly 4) or when there are fewer big tiles than SMs.
  """
  tile_k = swizzle_elems(problem.in_dtype)

  def cost(tile_m, tile_n, slowdown):
    cta_m = 2 * tile_m  # the consumers split the CTA tile over M
    return (_waves_of(problem, cta_m, tile_n, num_sms) * cta_m * tile_n
            * slowdown)

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


#: A bandwidth-bound wave with at least this share of the SMs busy streams
#: at (nearly) full device bandwidth: each CTA keeps 150+ KB in flight.
SATURATING_SM_SHARE = 0.75


def small_m_cost(problem: GemmProblem, config: SmallMConfig,
                 num_sms: int) -> float:
  """Modelled time of a bandwidth-bound launch, in bytes at full bandwidth.

  Each wave takes as long as its busiest CTAs' bytes at the bandwidth its
  CTA count can draw (full from SATURATING_SM_SHARE of the SMs up); split-K
  partials are written, read back and reduced (three passes).
  """
  in_size = jnp.dtype(problem.in_dtype).itemsize
  n_tiles = cdiv(problem.n, config.tile_n) * problem.batch
  k_blocks = cdiv(problem.k, config.tile_k)
  splits = cdiv(k_blocks, cdiv(k_blocks, config.k_splits))
  k_share = cdiv(k_blocks, splits) * config.tile_k
  # A is a few rows that every CTA shares through L2: only B counts.
  bytes_per_cta = k_share * config.tile_n * in_size
  ctas = n_tiles * splits
  floor = SATURATING_SM_SHARE * num_sms
  cost = 0.0
  while ctas > 0:
    in_wave = min(ctas, num_sms)
    cost += bytes_per_cta * max(in_wave, floor)
    ctas -= in_wave
  if splits > 1:
    cost += 3 * splits * cdiv(problem.m, 8) * 8 * problem.n * problem.batch * 4
  return cost


def small_m_heuristic(problem: GemmProblem, num_sms: int) -> SmallMConfig:
  """The (tile_n, k_splits) pair with the lowest modelled time, then the
  deepest pipeline that fits in shared memory."""
  tile_m = 64 if problem.m <= 64 else 128
  best = None
  for k_splits in (1, 2, 3, 4, 6, 8):
    for tile_n in (64, 128):
      config = SmallMConfig(tile_n=tile_n, tile_k=128, k_splits=k_splits)
      cost = small_m_cost(problem, config, num_sms)
      # Ties go to fewer splits, then narrower strips (more stages fit).
      if best is None or cost < best[0] * 0.99:
        best = (cost, config)
  config = best[1]
  for stages in (6, 5, 4, 3, 2):
    config = dataclasses.replace(config, max_concurrent_steps=stages)
    if config.smem_bytes(problem, tile_m) <= HOPPER_SMEM_BYTES:
      break
  return config


def div32(x, y):
  """`lax.div` on int32 operands: grid and loop indices are int32, and with
  jax_enable_x64 a Python int would otherwise become int64."""
  return lax.div(jnp.asarray(x, jnp.int32), jnp.asarray(y, jnp.int32))


def rem32(x, y):
  """`lax.rem` on int32 operands (see `div32`)."""
  return lax.rem(jnp.asarray(x, jnp.int32), jnp.asarray(y, jnp.int32))
