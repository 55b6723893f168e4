"""Pieces every rung of the Pallas-Triton ladder shares.

Masking, not padding: the kernels read operands where they lie and mask the
ragged edges, so any M, N and K works without copying an operand on the host.
An A tile whose rows run past M, or whose columns run past K, is loaded with
`other=0`; zeros in the K tail add nothing to the dot, and rows past M are
never stored.

Blocks: along K a BlockSpec covers the whole contraction, rounded up to a
multiple of `block_k`, and the kernel walks it with `pl.ds`. Rounding up
keeps every `pl.ds` inside the block, which interpret mode needs (it pads the
operand to the block with garbage and the mask hides that garbage).
"""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_gemm import registry
from pallas_gemm.devices import DeviceInfo
from pallas_gemm.problem import (SUPPORTED_INPUT_DTYPES, Epilogue, GemmProblem,
                                 apply_epilogue, cdiv)

# The Pallas-Triton lowering is deprecated since JAX 0.11 (Mosaic GPU is its
# successor); it still works in 0.11.x/0.12 and this backend keeps it running.
warnings.filterwarnings(
    "ignore", category=DeprecationWarning, message=".*[Tt]riton.*")


@dataclasses.dataclass(frozen=True)
class TritonConfig:
  """Tile shape and Triton compile options for one kernel launch.

  Every rung takes the same config; a rung ignores the knobs it predates
  (rung 2 has no `group_m`, only rungs 5-6 read `split_k`, only rung 6
  reads `k_major`).

  `k_major`: copy an operand whose contraction dim is not the contiguous
  one (A given as (K, M), B as (K, N)) into K-contiguous form in XLA before
  the kernel. Hopper's wgmma reads 32-bit (TF32) operands only K-major, so
  without the copy Triton moves such an operand 4 bytes at a time; on the
  H200 the copy (one pass over the operand) made TF32 2.0-2.7x faster.

  `programs_per_sm` (rung 6 only): 0 launches one program per output tile;
  n > 0 launches n programs per SM that each loop over output tiles (a
  persistent grid). Only rung 6 reads it.
  """

  block_m: int = 64
  block_n: int = 64
  block_k: int = 32
  num_warps: int = 4
  num_stages: int = 1
  group_m: int = 1
  split_k: int = 1
  k_major: bool = False
  programs_per_sm: int = 0

  def __post_init__(self):
    for name in ("block_m", "block_n", "block_k"):
      value = getattr(self, name)
      if value < 16 or value & (value - 1):
        raise ValueError(
            f"{name}={value} must be a power of two >= 16 (Triton's dot)")
    if self.num_warps not in (1, 2, 4, 8, 16):
      raise ValueError(f"num_warps={self.num_warps} must be 1, 2, 4, 8 or 16")
    if self.num_stages < 1:
      raise ValueError(f"num_stages={self.num_stages} must be >= 1")
    if self.group_m < 1:
      raise ValueError(f"group_m={self.group_m} must be >= 1")
    if self.split_k < 1:
      raise ValueError(f"split_k={self.split_k} must be >= 1")
    if not isinstance(self.k_major, bool):
      raise TypeError(f"k_major={self.k_major!r} must be a bool")
    if (isinstance(self.programs_per_sm, bool)
        or not isinstance(self.programs_per_sm, int)
        or not 0 <= self.programs_per_sm <= 8):
      raise ValueError(f"programs_per_sm={self.programs_per_sm!r} must be an "
                       "int in [0, 8] (0: one program per output tile)")

  def smem_bytes(self, in_dtype: str) -> int:
    """Shared memory the software pipeline holds: one A and one B tile per
    stage (Triton keeps at least two stages for a pipelined loop)."""
    itemsize = jnp.dtype(in_dtype).itemsize
    stages = max(self.num_stages, 1)
    return (self.block_m + self.block_n) * self.block_k * itemsize * stages


def triton_supports(problem: GemmProblem, device: DeviceInfo,
                    config: TritonConfig | None = None) -> str | None:
  """The checks every rung shares; None means supported."""
  if problem.in_dtype not in SUPPORTED_INPUT_DTYPES:
    return f"input dtype {problem.in_dtype} is not one of {SUPPORTED_INPUT_DTYPES}"
  if device.is_gpu:
    if device.compute_capability is None or device.compute_capability < (8, 0):
      return "Pallas-Triton tensor-core kernels need compute capability >= 8.0"
    if config is not None and device.smem_per_block and (
        config.smem_bytes(problem.in_dtype) > device.smem_per_block):
      return (f"config needs {config.smem_bytes(problem.in_dtype)} bytes of "
              f"shared memory, the device has {device.smem_per_block}")
  return None


def dot_precision(problem: GemmProblem):
  if problem.precision == "ieee":
    return jax.lax.Precision.HIGHEST
  return jax.lax.Precision.DEFAULT


def operand_specs(problem: GemmProblem, config: TritonConfig, *,
                  k_blocks: int, block_index):
  """BlockSpecs for a, b, c and bias over a (batch, m-block, n-block) index.

  `block_index(*grid_ids)` must return `(batch, i, j)`: the batch entry and
  the output tile this program computes. Rungs with a remapped program order
  pass their own mapping; all operand specs derive from it, so they agree.
  """
  bm, bn, bk = config.block_m, config.block_n, config.block_k
  k_span = k_blocks * bk

  def a_map(*ids):
    b, i, _ = block_index(*ids)
    return (b, 0, i) if problem.transpose_a else (b, i, 0)

  def b_map(*ids):
    b, _, j = block_index(*ids)
    return (b, j, 0) if problem.transpose_b else (b, 0, j)

  def c_map(*ids):
    return block_index(*ids)

  def bias_map(*ids):
    return (block_index(*ids)[2],)

  a_block = (None, k_span, bm) if problem.transpose_a else (None, bm, k_span)
  b_block = (None, bn, k_span) if problem.transpose_b else (None, k_span, bn)
  specs = [pl.BlockSpec(a_block, a_map), pl.BlockSpec(b_block, b_map)]
  if problem.epilogue.has_c:
    specs.append(pl.BlockSpec((None, bm, bn), c_map))
  if problem.epilogue.has_bias:
    specs.append(pl.BlockSpec((bn,), bias_map))
  out_spec = pl.BlockSpec((None, bm, bn), c_map)
  return specs, out_spec


@dataclasses.dataclass(frozen=True)
class EdgeMasks:
  """Which edges of a tile may fall outside the operand.

  A mask costs a compare and a select per element and can stop Triton from
  vectorising a load, so a kernel that knows a dimension divides its block
  (say K % block_k == 0) turns that mask off. The default masks everything,
  which is always correct.
  """

  rows: bool = True
  cols: bool = True
  k: bool = True


def edge_masks_for(problem: GemmProblem, config: TritonConfig) -> EdgeMasks:
  """Only the masks this problem needs with this config's tiles."""
  return EdgeMasks(rows=problem.m % config.block_m != 0,
                   cols=problem.n % config.block_n != 0,
                   k=problem.k % config.block_k != 0)


def _and_masks(*masks):
  present = [mask for mask in masks if mask is not None]
  if not present:
    return None
  out = present[0]
  for mask in present[1:]:
    out = out & mask
  return out


def _k_offset(k_index, bk: int, hint: bool):
  offset = k_index * bk
  # Triton cannot always see through a loop-carried index that the offset is
  # block aligned; the hint lets it issue wide, aligned loads.
  return pl.multiple_of(offset, bk) if hint else offset


def load_a_tile(a_ref, k_index, *, problem: GemmProblem, rows, bk: int,
                masks: EdgeMasks = EdgeMasks(), hint: bool = False,
                row_start=None):
  """The (block_m, block_k) tile of op(a) for K step `k_index`, zero-masked.

  `row_start`: where the tile's rows begin when `a_ref` spans all of M (the
  persistent grid); None when the BlockSpec already placed the ref on them.
  The row and K offsets go into one indexer: the Triton lowering takes a
  single `.at[...]` per load.
  """
  start = _k_offset(k_index, bk, hint)
  k_ok = (k_index * bk + jnp.arange(bk)) < problem.k if masks.k else None
  row_ok = rows < problem.m if masks.rows else None
  row_span = (slice(None) if row_start is None
              else pl.ds(row_start, rows.shape[0]))
  if problem.transpose_a:
    mask = _and_masks(None if k_ok is None else k_ok[:, None],
                      None if row_ok is None else row_ok[None, :])
    tile = pltriton.load(a_ref.at[pl.ds(start, bk), row_span], mask=mask,
                         other=None if mask is None else 0)
    return tile.T
  mask = _and_masks(None if row_ok is None else row_ok[:, None],
                    None if k_ok is None else k_ok[None, :])
  return pltriton.load(a_ref.at[row_span, pl.ds(start, bk)], mask=mask,
                       other=None if mask is None else 0)


def load_b_tile(b_ref, k_index, *, problem: GemmProblem, cols, bk: int,
                masks: EdgeMasks = EdgeMasks(), hint: bool = False,
                col_start=None):
  """The (block_k, block_n) tile of op(b) for K step `k_index`, zero-masked
  (`col_start` as `row_start` in `load_a_tile`)."""
  start = _k_offset(k_index, bk, hint)
  k_ok = (k_index * bk + jnp.arange(bk)) < problem.k if masks.k else None
  col_ok = cols < problem.n if masks.cols else None
  col_span = (slice(None) if col_start is None
              else pl.ds(col_start, cols.shape[0]))
  if problem.transpose_b:
    mask = _and_masks(None if col_ok is None else col_ok[:, None],
                      None if k_ok is None else k_ok[None, :])
    tile = pltriton.load(b_ref.at[col_span, pl.ds(start, bk)], mask=mask,
                         other=None if mask is None else 0)
    return tile.T
  mask = _and_masks(None if k_ok is None else k_ok[:, None],
                    None if col_ok is None else col_ok[None, :])
  return pltriton.load(b_ref.at[pl.ds(start, bk), col_span], mask=mask,
                       other=None if mask is None else 0)


def accumulate_k_range(a_ref, b_ref, *, problem, config, rows, cols,
                       k_start, k_stop, masks: EdgeMasks = EdgeMasks(),
                       hint: bool = False, tile_start=None):
  """acc = Σ_{k in [k_start, k_stop)} A[rows, k-tile] · B[k-tile, cols].

  `tile_start`: (row, column) where the tile begins when the refs span the
  whole matrix (the persistent grid), else None."""
  bk = config.block_k
  precision = dot_precision(problem)
  row_start, col_start = tile_start if tile_start is not None else (None,
                                                                    None)

  def body(k_index, acc):
    a_tile = load_a_tile(a_ref, k_index, problem=problem, rows=rows, bk=bk,
                         masks=masks, hint=hint, row_start=row_start)
    b_tile = load_b_tile(b_ref, k_index, problem=problem, cols=cols, bk=bk,
                         masks=masks, hint=hint, col_start=col_start)
    return acc + jnp.dot(a_tile, b_tile, precision=precision,
                         preferred_element_type=jnp.float32)

  acc = jnp.zeros((config.block_m, config.block_n), jnp.float32)
  return jax.lax.fori_loop(k_start, k_stop, body, acc)


def store_output(o_ref, acc, *, problem, rows, cols, c_ref=None,
                 bias_ref=None, masks: EdgeMasks | None = None):
  """Applies the fused epilogue to the f32 tile and stores the in-range part.

  `masks`: the edges that may be ragged (`edge_masks_for`); None masks both,
  which is always correct. A dropped mask lets Triton store unpredicated.
  """
  row_ok = rows < problem.m if masks is None or masks.rows else None
  col_ok = cols < problem.n if masks is None or masks.cols else None
  mask = _and_masks(None if row_ok is None else row_ok[:, None],
                    None if col_ok is None else col_ok[None, :])
  c_tile = bias_tile = None
  if problem.epilogue.has_c:
    c_tile = pltriton.load(c_ref, mask=mask, other=None if mask is None else 0)
  if problem.epilogue.has_bias:
    bias_tile = pltriton.load(bias_ref, mask=col_ok,
                              other=None if col_ok is None else 0)[None, :]
  out = apply_epilogue(acc, problem.epilogue, c_tile, bias_tile)
  pltriton.store(o_ref, out.astype(o_ref.dtype), mask=mask)


def unpack_refs(refs, problem: GemmProblem):
  """(a_ref, b_ref, c_ref|None, bias_ref|None, o_ref) from the kernel's refs."""
  a_ref, b_ref, *rest = refs
  c_ref = rest.pop(0) if problem.epilogue.has_c else None
  bias_ref = rest.pop(0) if problem.epilogue.has_bias else None
  (o_ref,) = rest
  return a_ref, b_ref, c_ref, bias_ref, o_ref


def operands_list(a, b, c, bias):
  return [x for x in (a, b, c, bias) if x is not None]


def run_tiled(kernel_body, a, b, c, bias, *, problem: GemmProblem,
              config: TritonConfig, interpret: bool, name: str,
              grid, block_index):
  """Launches `kernel_body(refs...)` over `grid` with the shared BlockSpecs."""
  k_blocks = cdiv(problem.k, config.block_k)
  in_specs, out_spec = operand_specs(problem, config, k_blocks=k_blocks,
                                     block_index=block_index)
  return pl.pallas_call(
      kernel_body,
      out_shape=jax.ShapeDtypeStruct((problem.batch, problem.m, problem.n),
                                     problem.out_dtype),
      grid=grid,
      in_specs=in_specs,
      out_specs=out_spec,
      compiler_params=pltriton.CompilerParams(
          num_warps=config.num_warps, num_stages=config.num_stages),
      interpret=interpret,
      name=name,
  )(*operands_list(a, b, c, bias))


def program_rows_cols(i, j, config: TritonConfig):
  rows = i * config.block_m + jnp.arange(config.block_m)
  cols = j * config.block_n + jnp.arange(config.block_n)
  return rows, cols


def register_fixed_config_rung(name: str, fn, default: TritonConfig,
                               description: str):
  """Registers a rung whose only tuning is one default config, shrunk for
  small problems, and returns its `heuristic(problem, device)`."""
  def heuristic(problem, device):
    del device
    return small_problem_config(problem, default)

  def supports(problem, device):
    return triton_supports(problem, device, heuristic(problem, device))

  registry.register(registry.KernelEntry(
      name=name, fn=fn, supports=supports, heuristic=heuristic,
      config_cls=TritonConfig, runs_on_cpu=True, description=description))
  return heuristic


def small_problem_config(problem: GemmProblem, base: TritonConfig) -> TritonConfig:
  """Shrinks tiles that are far larger than the problem (M=1, tiny N or K)
  so a decode-sized call does not compute mostly masked-out work."""
  def fit(block, size):
    while block > 16 and block // 2 >= size:
      block //= 2
    return block
  return dataclasses.replace(
      base, block_m=fit(base.block_m, problem.m),
      block_n=fit(base.block_n, problem.n),
      block_k=fit(base.block_k, problem.k))


def grouped_tile_index(tile_id, *, grid_m: int, grid_n: int, group_m: int):
  """Maps a linear program id to an output tile (i, j) in grouped order.

  Programs are launched roughly in id order. Row-major order walks a whole
  row of tiles before the next, so every program of a row re-reads all of B
  while A's row block is the only thing reused. Grouped order walks `group_m`
  rows down one column before moving right, so the tiles resident at one time
  share both A row blocks and B column blocks in L2 (group_m = 3):

      row-major ids          grouped ids
      0  1  2  3  4         0  3  6  9 12
      5  6  7  8  9         1  4  7 10 13
     10 11 12 13 14         2  5  8 11 14
     15 16 17 18 19        15 17 19 21 23
                           16 18 20 22 24   <- last group may be short

  Written with lax.div/rem on non-negative ints, which lower to one integer
  op each in Triton (jnp's floor division would add sign fix-ups).
  """
  tiles_per_group = group_m * grid_n
  group = jax.lax.div(tile_id, tiles_per_group)
  first_row = group * group_m
  rows_in_group = jnp.minimum(grid_m - first_row, group_m)
  within = jax.lax.rem(tile_id, tiles_per_group)
  i = first_row + jax.lax.rem(within, rows_in_group)
  j = jax.lax.div(within, rows_in_group)
  return i, j


def without_epilogue(problem: GemmProblem) -> GemmProblem:
  return dataclasses.replace(problem, epilogue=Epilogue(), c_dtype=None)


def split_k_partials(a, b, *, problem: GemmProblem, config: TritonConfig,
                     interpret: bool, name: str, grouped: bool,
                     masks: EdgeMasks | None = None, hint: bool = False):
  """f32 partial products, shape (split_k, batch, m, n).

  Split s sums the K blocks [s·per_split, (s+1)·per_split): each program
  writes its own slice of the buffer, so no two programs touch the same
  output and no atomics are needed. The caller reduces over axis 0.
  """
  bare = without_epilogue(problem)
  bm, bn, bk = config.block_m, config.block_n, config.block_k
  grid_m, grid_n = cdiv(problem.m, bm), cdiv(problem.n, bn)
  k_blocks = cdiv(problem.k, bk)
  per_split = cdiv(k_blocks, config.split_k)
  masks = EdgeMasks() if masks is None else masks

  if grouped:
    def block_index(tile, split, batch):
      del split
      i, j = grouped_tile_index(tile, grid_m=grid_m, grid_n=grid_n,
                                group_m=config.group_m)
      return batch, i, j
    grid = (grid_m * grid_n, config.split_k, problem.batch)
  else:
    def block_index(i, j, split, batch):
      del split
      return batch, i, j
    grid = (grid_m, grid_n, config.split_k, problem.batch)

  def kernel(a_ref, b_ref, o_ref):
    ids = [pl.program_id(axis) for axis in range(len(grid))]
    _, i, j = block_index(*ids)
    split = ids[-2]
    rows, cols = program_rows_cols(i, j, config)
    k_start = split * per_split
    k_stop = jnp.minimum(k_start + per_split, k_blocks)
    acc = accumulate_k_range(a_ref, b_ref, problem=bare, config=config,
                             rows=rows, cols=cols, k_start=k_start,
                             k_stop=k_stop, masks=masks, hint=hint)
    mask = (rows < problem.m)[:, None] & (cols < problem.n)[None, :]
    pltriton.store(o_ref, acc, mask=mask)

  in_specs, _ = operand_specs(bare, config, k_blocks=k_blocks,
                              block_index=block_index)

  def partial_map(*ids):
    batch, i, j = block_index(*ids)
    return ids[-2], batch, i, j

  out_spec = pl.BlockSpec((None, None, bm, bn), partial_map)
  return pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct(
          (config.split_k, problem.batch, problem.m, problem.n), jnp.float32),
      grid=grid,
      in_specs=in_specs,
      out_specs=out_spec,
      compiler_params=pltriton.CompilerParams(
          num_warps=config.num_warps, num_stages=config.num_stages),
      interpret=interpret,
      name=name,
  )(a, b)


def reduce_partials(partials, c, bias, *, problem: GemmProblem):
  """Sums the split-K partials in a fixed order, then applies the epilogue.

  A chain of adds over a static split count (not a tree reduce whose order
  the compiler picks) gives the same bits on every run; XLA fuses the chain
  and the epilogue into one elementwise pass over (batch, m, n).
  """
  total = partials[0]
  for split in range(1, partials.shape[0]):
    total = total + partials[split]
  bias_row = None if bias is None else bias[None, None, :]
  out = apply_epilogue(total, problem.epilogue, c, bias_row)
  return out.astype(problem.out_dtype)


def to_k_major(a, b, problem: GemmProblem):
  """Operands and problem with K contiguous in both: a (batch, m, k) and b
  (batch, n, k). An XLA transpose, done only where the layout needs it."""
  if problem.transpose_a:
    a = jnp.swapaxes(a, 1, 2)
  if not problem.transpose_b:
    b = jnp.swapaxes(b, 1, 2)
  return a, b, dataclasses.replace(problem, transpose_a=False,
                                   transpose_b=True)
