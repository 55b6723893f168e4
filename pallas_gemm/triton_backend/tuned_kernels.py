"""The production rung's kernels (`k06_tuned` chooses the config and calls
these). Not a teaching rung: it combines rungs 3-5 behind parameters, where
the rungs write each step out once.

What it has that the rungs do not:

  * only the edge masks the shape needs (`EdgeMasks`): when M, N or K
    divides its block the compare-and-select on that edge is compiled out,
    and the K offset carries a `pl.multiple_of` hint, so Triton can issue
    full-width aligned loads in the common case of tile-multiple shapes;
  * one set of loads, K loop and store (`accumulate_k_range`,
    `store_output`) for three launches: the grouped one-program-per-tile
    grid (`grouped_matmul`), split-K (`split_k_partials`) and the
    persistent grid (`persistent_matmul`);
  * `to_k_major`, the XLA transpose behind `TritonConfig.k_major`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_gemm.devices import device_info
from pallas_gemm.problem import Epilogue, GemmProblem, apply_epilogue, cdiv
from pallas_gemm.triton_backend import common
from pallas_gemm.triton_backend.common import TritonConfig


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


def _k_offset(k_index, bk: int):
  # Triton cannot always see through a loop-carried index that the offset is
  # block aligned; the hint lets it issue wide, aligned loads.
  return pl.multiple_of(k_index * bk, bk)


def _rows_cols(i, j, config: TritonConfig):
  rows = i * config.block_m + common.arange32(config.block_m)
  cols = j * config.block_n + common.arange32(config.block_n)
  return rows, cols


def _load_tile(ref, k_index, *, stored_k_axis: int, k_axis: int, bk: int,
               k_size: int, index, size: int, mask_index: bool, mask_k: bool,
               index_start):
  """One operand tile for K step `k_index`, with K along `k_axis` (A's tile
  is (block_m, block_k), B's (block_k, block_n)): loaded as the operand is
  stored, K along `stored_k_axis` and the M or N positions `index`
  (< `size`) along the other axis, elements outside the operand read as 0,
  then transposed if the two axes differ.

  `index_start`: where the tile's rows (A) or columns (B) begin when the
  ref spans the whole operand (the persistent grid); None when the BlockSpec
  already placed the ref on them. The K and M/N offsets go into one indexer:
  the Triton lowering takes a single `.at[...]` per load.
  """
  start = _k_offset(k_index, bk)
  k_ok = (k_index * bk + common.arange32(bk)) < k_size if mask_k else None
  index_ok = index < size if mask_index else None
  span = (slice(None) if index_start is None
          else pl.ds(index_start, index.shape[0]))
  first, second = ((k_ok, index_ok) if stored_k_axis == 0
                   else (index_ok, k_ok))
  mask = _and_masks(None if first is None else first[:, None],
                    None if second is None else second[None, :])
  at = ((pl.ds(start, bk), span) if stored_k_axis == 0
        else (span, pl.ds(start, bk)))
  tile = pltriton.load(ref.at[at], mask=mask,
                       other=None if mask is None else 0)
  return tile if stored_k_axis == k_axis else tile.T


def accumulate_k_range(a_ref, b_ref, *, problem, config, rows, cols,
                       k_start, k_stop, masks: EdgeMasks, tile_start=None):
  """acc = Σ_{k in [k_start, k_stop)} A[rows, k-tile] · B[k-tile, cols].

  `tile_start`: (row, column) where the tile begins when the refs span the
  whole matrix (the persistent grid), else None."""
  bk = config.block_k
  precision = common.dot_precision(problem)
  row_start, col_start = tile_start if tile_start is not None else (None,
                                                                    None)
  shared = dict(bk=bk, k_size=problem.k, mask_k=masks.k)

  def body(k_index, acc):
    k_index = common.index32(k_index)
    a_tile = _load_tile(
        a_ref, k_index, stored_k_axis=0 if problem.transpose_a else 1,
        k_axis=1, index=rows, size=problem.m, mask_index=masks.rows,
        index_start=row_start, **shared)
    b_tile = _load_tile(
        b_ref, k_index, stored_k_axis=1 if problem.transpose_b else 0,
        k_axis=0, index=cols, size=problem.n, mask_index=masks.cols,
        index_start=col_start, **shared)
    return acc + jnp.dot(a_tile, b_tile, precision=precision,
                         preferred_element_type=jnp.float32)

  acc = jnp.zeros((config.block_m, config.block_n), jnp.float32)
  return jax.lax.fori_loop(k_start, k_stop, body, acc)


def store_output(o_ref, acc, *, problem, rows, cols, c_ref, bias_ref,
                 masks: EdgeMasks):
  """Applies the fused epilogue to the f32 tile and stores the in-range part
  (a dropped mask lets Triton store unpredicated)."""
  row_ok = rows < problem.m if masks.rows else None
  col_ok = cols < problem.n if masks.cols else None
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


def _grouped_block_index(problem, config):
  """(tile, *other axes, batch) -> (batch, i, j) in grouped order."""
  grid_m = cdiv(problem.m, config.block_m)
  grid_n = cdiv(problem.n, config.block_n)

  def block_index(tile, *ids):
    i, j = common.grouped_tile_index(tile, grid_m=grid_m, grid_n=grid_n,
                                     group_m=config.group_m)
    return ids[-1], i, j

  return block_index


def grouped_matmul(a, b, c, bias, *, problem, config, masks, interpret):
  """One program per output tile, on a 1-D grid in grouped order."""
  block_index = _grouped_block_index(problem, config)

  def kernel(*refs):
    _, i, j = block_index(pl.program_id(0), pl.program_id(1))
    rows, cols = _rows_cols(i, j, config)
    a_ref, b_ref, c_ref, bias_ref, o_ref = common.unpack_refs(refs, problem)
    acc = accumulate_k_range(
        a_ref, b_ref, problem=problem, config=config, rows=rows, cols=cols,
        k_start=0, k_stop=cdiv(problem.k, config.block_k), masks=masks)
    store_output(o_ref, acc, problem=problem, rows=rows, cols=cols,
                 c_ref=c_ref, bias_ref=bias_ref, masks=masks)

  # Tiles on grid axis 0: CUDA launches blockIdx.x fastest, so consecutive
  # ids are the ones resident together.
  grid = (cdiv(problem.m, config.block_m) * cdiv(problem.n, config.block_n),
          problem.batch)
  return common.run_tiled(kernel, a, b, c, bias, problem=problem,
                          config=config, interpret=interpret, name="tuned",
                          grid=grid, block_index=block_index)


def split_k_partials(a, b, *, problem, config, masks, interpret):
  """f32 partial products, shape (split_k, batch, m, n), for the fixed-order
  `split_k_common.reduce_partials`: split s sums the K blocks
  [s·per_split, (s+1)·per_split) into its own slice of the buffer."""
  bm, bn = config.block_m, config.block_n
  k_blocks = cdiv(problem.k, config.block_k)
  per_split = cdiv(k_blocks, config.split_k)
  block_index = _grouped_block_index(problem, config)

  def kernel(a_ref, b_ref, o_ref):
    tile, split, batch = (pl.program_id(axis) for axis in range(3))
    _, i, j = block_index(tile, split, batch)
    rows, cols = _rows_cols(i, j, config)
    k_start = split * per_split
    acc = accumulate_k_range(
        a_ref, b_ref, problem=problem, config=config, rows=rows, cols=cols,
        k_start=k_start, k_stop=jnp.minimum(k_start + per_split, k_blocks),
        masks=masks)
    pltriton.store(o_ref, acc, mask=(rows < problem.m)[:, None]
                   & (cols < problem.n)[None, :])

  bare = dataclasses.replace(problem, epilogue=Epilogue(), c_dtype=None)
  in_specs, _ = common.operand_specs(bare, config, k_blocks=k_blocks,
                                     block_index=block_index)
  grid_tiles = cdiv(problem.m, bm) * cdiv(problem.n, bn)
  out_spec = pl.BlockSpec(
      (None, None, bm, bn),
      lambda tile, split, batch: (split, *block_index(tile, split, batch)))
  return common.launch(
      kernel, [a, b], config=config, interpret=interpret,
      name="tuned_split_k", grid=(grid_tiles, config.split_k, problem.batch),
      in_specs=in_specs, out_specs=out_spec,
      out_shape=jax.ShapeDtypeStruct(
          (config.split_k, problem.batch, problem.m, problem.n), jnp.float32))


#: Programs of the persistent grid per "SM" in interpret mode: a few, so that
#: every program loops over several tiles.
_INTERPRET_SMS = 2


def persistent_matmul(a, b, c, bias, *, problem, config, masks, interpret):
  """A persistent grid: `programs_per_sm` programs per SM, each looping over
  output tiles in grouped order with a stride of the program count.

  Every operand is one block spanning the whole (padded) matrix of its batch
  entry, and each tile's rows and columns are picked with `pl.ds` inside
  the kernel; rounding the blocks up to whole tiles keeps every `pl.ds` in
  bounds, which interpret mode needs (see `common`).
  """
  bm, bn, bk = config.block_m, config.block_n, config.block_k
  grid_m, grid_n = cdiv(problem.m, bm), cdiv(problem.n, bn)
  num_tiles = grid_m * grid_n
  device = device_info()
  sms = device.num_sms if device.is_gpu else _INTERPRET_SMS
  programs = max(1, min(num_tiles, config.programs_per_sm * max(sms, 1)))
  m_span, n_span = grid_m * bm, grid_n * bn
  k_span = cdiv(problem.k, bk) * bk

  def whole(*block):
    return pl.BlockSpec((None, *block), lambda prog, batch: (batch, 0, 0))

  in_specs = [whole(k_span, m_span) if problem.transpose_a
              else whole(m_span, k_span),
              whole(n_span, k_span) if problem.transpose_b
              else whole(k_span, n_span)]
  if problem.epilogue.has_c:
    in_specs.append(whole(m_span, n_span))
  if problem.epilogue.has_bias:
    in_specs.append(pl.BlockSpec((n_span,), lambda prog, batch: (0,)))

  def kernel(*refs):
    a_ref, b_ref, c_ref, bias_ref, o_ref = common.unpack_refs(refs, problem)
    prog = pl.program_id(0)

    def tile_body(t, carry):
      i, j = common.grouped_tile_index(prog + t * programs, grid_m=grid_m,
                                       grid_n=grid_n, group_m=config.group_m)
      row0 = pl.multiple_of(i * bm, bm)
      col0 = pl.multiple_of(j * bn, bn)
      rows, cols = _rows_cols(i, j, config)
      row_slice, col_slice = pl.ds(row0, bm), pl.ds(col0, bn)
      acc = accumulate_k_range(
          a_ref, b_ref, problem=problem, config=config, rows=rows,
          cols=cols, k_start=0, k_stop=cdiv(problem.k, bk), masks=masks,
          tile_start=(row0, col0))
      store_output(
          o_ref.at[row_slice, col_slice], acc, problem=problem, rows=rows,
          cols=cols,
          c_ref=None if c_ref is None else c_ref.at[row_slice, col_slice],
          bias_ref=None if bias_ref is None else bias_ref.at[col_slice],
          masks=masks)
      return carry

    # Program p owns tiles p, p + programs, p + 2 * programs, ... (an int32
    # divisor: the program id is int32 whatever x64 says).
    my_tiles = jax.lax.div(num_tiles - prog + programs - 1,
                           np.int32(programs))
    jax.lax.fori_loop(0, my_tiles, tile_body, 0)

  return common.launch(
      kernel, common.operands_list(a, b, c, bias), config=config,
      interpret=interpret, name="tuned_persistent",
      grid=(programs, problem.batch), in_specs=in_specs,
      out_specs=whole(m_span, n_span), out_shape=common.output_shape(problem))


def to_k_major(a, b, problem: GemmProblem):
  """Operands and problem with K contiguous in both: a (batch, m, k) and b
  (batch, n, k). An XLA transpose, done only where the layout needs it."""
  if problem.transpose_a:
    a = jnp.swapaxes(a, 1, 2)
  if not problem.transpose_b:
    b = jnp.swapaxes(b, 1, 2)
  return a, b, dataclasses.replace(problem, transpose_a=False,
                                   transpose_b=True)
