"""The "rows"-mode work list (`mosaic_schedule.row_items`) in one launch.

Built from XLA ops, the table takes a chain of small kernels: the groups'
prefix sum, the pieces' item counts and their prefix sum, then the table,
each waiting for the one before. On layers of small experts, whose grouped
GEMM is short, those launches are a share of the call worth removing
(experiments/results/nvidia_h100/ragged_work_list). This Pallas-Triton
kernel builds the same table in one launch: every program recomputes the
pieces from `group_sizes` (a prefix sum over at most `MAX_GROUPS` values,
in registers) and writes one block of the table's columns.

`mosaic_schedule.row_items` stays the definition; the tests hold this
kernel to it entry by entry.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_gemm.autotune import shape_bucket
from pallas_gemm.problem import cdiv
from pallas_gemm.ragged_dot import mosaic_schedule as schedule

#: Items x padded groups that one program compares at once, which sets how
#: many of the table's columns a program writes: the kernel's time is the
#: latency of one program's dependent instructions, so a program keeps only
#: a few compares per thread and the columns spread over many programs
#: (experiments/results/nvidia_h100/ragged_work_list).
COMPARES_PER_PROGRAM = 256
MAX_COLUMNS_PER_PROGRAM = 128
#: Group values per thread in a program's group vectors: one warp up to
#: COMPARES_PER_PROGRAM groups (as measured), a warp more per as many
#: again ...
GROUPS_PER_WARP = COMPARES_PER_PROGRAM
MAX_WARPS = 4
#: ... so that up to MAX_GROUPS the vectors stay a few registers a thread;
#: with more groups the table is built from XLA ops.
MAX_GROUPS = GROUPS_PER_WARP * MAX_WARPS
#: A fixed warp count instead (experiments/lab/work_list_kernel_sweep.py).
NUM_WARPS: int | None = None


def supports(groups: int) -> bool:
  return 0 < groups <= MAX_GROUPS


def row_items(group_sizes, row_offset, *, m: int, tile_m: int,
              row_align: int, balanced: bool = False,
              interpret: bool = False):
  """`mosaic_schedule.row_items`, the same (5, max_row_items + 1) int32
  table, from one Pallas-Triton launch. `interpret` runs the kernel in
  Pallas's interpreter (CPU)."""
  groups = group_sizes.shape[0]
  if not supports(groups):
    raise ValueError(f"RaggedConfig.work_list_kernel takes 1 to "
                     f"{MAX_GROUPS} groups; group_sizes has {groups}")
  max_items = schedule.max_row_items(m, groups, tile_m, row_align)
  columns = max_items + 1
  padded_groups = shape_bucket(groups)
  block = max(1, min(MAX_COLUMNS_PER_PROGRAM,
                     COMPARES_PER_PROGRAM // padded_groups))
  num_warps = NUM_WARPS or min(MAX_WARPS,
                               max(1, padded_groups // GROUPS_PER_WARP))

  def piece(lo, hi):
    return schedule.piece_items(lo, hi, tile_m=tile_m, row_align=row_align,
                                balanced=balanced)

  def kernel(sizes_ref, offset_ref, out_ref):
    group = jnp.arange(padded_groups, dtype=jnp.int32)
    sizes = jnp.maximum(pltriton.load(sizes_ref.at[pl.ds(0, padded_groups)],
                                      mask=group < groups, other=0), 0)
    offset = pltriton.load(offset_ref.at[pl.ds(0, 1)])  # (1,): broadcasts
    ends_unclipped = offset + jnp.cumsum(sizes)
    starts = jnp.clip(ends_unclipped - sizes, 0, m)
    ends = jnp.clip(ends_unclipped, 0, m)
    # The pieces in row order: the rows before the first group (lead), the
    # groups (padding groups have no rows and no items), the rows after the
    # last group (tail).
    lead_lo = jnp.zeros_like(offset)
    lead_hi = jnp.clip(offset, 0, m)
    tail_lo = jnp.clip(offset + jnp.sum(sizes), 0, m)
    tail_hi = jnp.full_like(offset, m)
    lead_row, lead_count, lead_stride = piece(lead_lo, lead_hi)
    group_row, group_count, group_stride = piece(starts, ends)
    group_end_item = lead_count + jnp.cumsum(group_count)
    group_first_item = group_end_item - group_count
    tail_first_item = lead_count + jnp.sum(group_count)
    tail_row, tail_count, tail_stride = piece(tail_lo, tail_hi)

    item = (pl.program_id(0) * block
            + jnp.arange(block, dtype=jnp.int32))[:, None]
    listed = item < max_items

    def entries(first_item, count, lo, hi, first_row, stride, owner):
      """Each item's entries from the piece among these that holds it
      (zeros where none does): one masked sum over the pieces."""
      holds = (first_item <= item) & (item < first_item + count) & listed
      tile_row = first_row + (item - first_item) * stride

      def pick(values):
        return jnp.sum(jnp.where(holds, values, 0), axis=1)

      return (pick(jnp.broadcast_to(owner, holds.shape)),
              pick(jnp.maximum(lo, tile_row)),
              pick(jnp.minimum(hi, tile_row + stride)),
              pick(jnp.broadcast_to(first_item, holds.shape)),
              pick(jnp.broadcast_to(count, holds.shape)))

    no_group = jnp.full((1, 1), -1, jnp.int32)
    zero = jnp.zeros((1, 1), jnp.int32)
    rows = [
        entries(zero, lead_count[None, :], lead_lo[None, :],
                lead_hi[None, :], lead_row[None, :], lead_stride[None, :],
                no_group),
        entries(group_first_item[None, :], group_count[None, :],
                starts[None, :], ends[None, :], group_row[None, :],
                group_stride[None, :], group[None, :]),
        entries(tail_first_item[None, :], tail_count[None, :],
                tail_lo[None, :], tail_hi[None, :], tail_row[None, :],
                tail_stride[None, :], no_group),
    ]
    table = [sum(values) for values in zip(*rows)]
    total = tail_first_item + tail_count  # (1,)
    item = item[:, 0]
    table[schedule.ITEM_GROUP] = jnp.where(item == max_items, total,
                                           table[schedule.ITEM_GROUP])
    in_table = item < columns
    for row, values in enumerate(table):
      pltriton.store(
          out_ref.at[pl.ds(row, 1), pl.ds(pl.program_id(0) * block, block)],
          values.astype(jnp.int32)[None, :], mask=in_table[None, :])

  return pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((5, columns), jnp.int32),
      grid=(cdiv(columns, block),),
      compiler_params=pltriton.CompilerParams(num_warps=num_warps,
                                             num_stages=1),
      interpret=interpret,
      name="ragged_row_items",
  )(group_sizes.astype(jnp.int32), row_offset.astype(jnp.int32))
