"""Configs, shared-memory budgets and operand preparation for the Mosaic kernels.

Nothing here needs a GPU: configs are plain frozen dataclasses and the
footprint arithmetic is done before anything is compiled, so a candidate that
cannot fit in shared memory is dropped without paying for a compile.

Alignment policy. The Tensor Memory Accelerator (TMA) reads and writes whole
boxes and handles every ragged edge itself: a box that runs past the end of
an array is zero-filled on load and clipped on store. What it cannot handle is
a row pitch that is not a multiple of 16 bytes. When a row length is
misaligned (e.g. K = 4093 in bf16) we pad *that operand only* on the device,
with zeros, up to the next aligned length; the kernel still iterates over the
true K, so the padding never contributes. A padded output is sliced back.
This keeps every M, N, K correct at the price of one extra copy of the
misaligned operand, which the benchmark measures.
"""

from __future__ import annotations

import dataclasses
import enum

import jax.numpy as jnp

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


class Dim(enum.IntEnum):
  M = 0
  N = 1


@dataclasses.dataclass(frozen=True)
class MosaicConfig:
  """One launch of `mosaic/ws_persistent`.

  tile_m, tile_n: the output tile each of the two consumer warpgroups owns;
    the CTA tile is twice that along `wg_dimension`.
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

  def __post_init__(self):
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
    if not isinstance(self.band_dim, Dim) or not isinstance(
        self.wg_dimension, Dim):
      raise TypeError("band_dim and wg_dimension must be Dim.M or Dim.N")

  @property
  def cta_tile_m(self) -> int:
    return self.tile_m * (2 if self.wg_dimension == Dim.M else 1)

  @property
  def cta_tile_n(self) -> int:
    return self.tile_n * (2 if self.wg_dimension == Dim.N else 1)

  @property
  def epilogue_tiles_per_wg(self) -> int:
    return (self.tile_m // self.epi_tile_m) * (self.tile_n // self.epi_tile_n)

  @property
  def out_slots(self) -> int:
    """Double-buffer the staged output only when the slot parity stays
    consistent from one output tile to the next (an even count per tile)."""
    return 2 if self.epilogue_tiles_per_wg % 2 == 0 else 1

  def smem_bytes(self, problem: GemmProblem) -> int:
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

  def fits(self, problem: GemmProblem) -> bool:
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

  def smem_bytes(self, problem: GemmProblem, tile_m: int) -> int:
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


def swizzle_elems(dtype) -> int:
  return SWIZZLE_BYTES // jnp.dtype(dtype).itemsize


def aligned_length(length: int, dtype) -> int:
  """`length` rounded up so that a row of it is a whole number of 16 bytes."""
  per = TMA_STRIDE_ALIGN_BYTES // jnp.dtype(dtype).itemsize
  return cdiv(length, per) * per


def pad_minor_to_alignment(x):
  """Zero-pads the last axis of `x` so its rows are TMA-aligned (a no-op,
  without a copy, when they already are)."""
  target = aligned_length(x.shape[-1], x.dtype)
  if target == x.shape[-1]:
    return x
  pad = [(0, 0)] * (x.ndim - 1) + [(0, target - x.shape[-1])]
  return jnp.pad(x, pad)


def ws_candidates(problem: GemmProblem) -> list[MosaicConfig]:
  """A small per-shape-class search space for the persistent kernel, with
  the configs that do not fit in shared memory already dropped."""
  is_f32 = problem.in_dtype == "float32"
  tile_k = 32 if is_f32 else 64
  out = []
  for tile_m, tile_n, wg_dim in ((128, 128, Dim.N), (128, 256, Dim.M),
                                 (128, 128, Dim.M), (64, 128, Dim.M),
                                 (128, 192, Dim.M)):
    for stages in (4, 5, 3, 6):
      for band in (8, 16, 4):
        config = MosaicConfig(
            tile_m=tile_m, tile_n=tile_n, tile_k=tile_k,
            max_concurrent_steps=stages, epi_tile_m=64,
            epi_tile_n=64 if tile_n % 64 == 0 else tile_n,
            band_dim=Dim.M, grid_band=band, wg_dimension=wg_dim)
        if config.fits(problem):
          out.append(config)
  return out


def ws_heuristic(problem: GemmProblem) -> MosaicConfig:
  """The default persistent-kernel config: a 256x128 CTA tile split over M
  between the consumers (each warpgroup 128x128 in registers), the deepest
  pipeline that fits, bands of 8 tiles in the snake order.

  Small problems whose CTA-tile count would leave SMs idle use 128x128 CTA
  tiles instead.
  """
  is_f32 = problem.in_dtype == "float32"
  tile_k = 32 if is_f32 else 64
  tiles_big = cdiv(problem.m, 256) * cdiv(problem.n, 128) * problem.batch
  if tiles_big >= 132:
    base = MosaicConfig(tile_m=128, tile_n=128, tile_k=tile_k,
                        wg_dimension=Dim.M)
  else:
    base = MosaicConfig(tile_m=64, tile_n=128, tile_k=tile_k,
                        wg_dimension=Dim.M)
  for stages in (5, 4, 3, 2):
    config = dataclasses.replace(base, max_concurrent_steps=stages)
    if config.fits(problem):
      return config
  return dataclasses.replace(base, max_concurrent_steps=2, epi_tile_n=64)


def small_m_heuristic(problem: GemmProblem, num_sms: int) -> SmallMConfig:
  """Picks the N-strip width and K split that keep every SM streaming B:
  the (tile_n, k_splits) pair whose CTA count fills the last wave best,
  preferring fewer splits (less partial traffic) and wider strips."""
  best = None
  k_steps_min = 4
  for tile_n in (128, 64, 256):
    n_tiles = cdiv(problem.n, tile_n) * problem.batch
    for k_splits in (1, 2, 3, 4, 6, 8):
      if k_splits > 1 and cdiv(problem.k, 128 * k_splits) < k_steps_min:
        continue
      ctas = n_tiles * k_splits
      waves = cdiv(ctas, num_sms)
      fill = ctas / (waves * num_sms)
      # Under half a wave leaves bandwidth on the table; more CTAs than SMs
      # only pays when the waves are nearly full.
      score = (round(fill, 2), -k_splits, tile_n == 128)
      if best is None or score > best[0]:
        best = (score, SmallMConfig(tile_n=tile_n, k_splits=k_splits))
  config = best[1]
  stages = 6
  tile_m = 64 if problem.m <= 64 else 128
  while stages > 2 and config.smem_bytes(problem, tile_m) > HOPPER_SMEM_BYTES:
    stages -= 1
    config = dataclasses.replace(config, max_concurrent_steps=stages)
  return dataclasses.replace(config, max_concurrent_steps=stages)
