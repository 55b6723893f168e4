"""The grouped GEMM's work lists, each in one launch.

Built from XLA ops, a table takes a chain of small kernels: the groups'
prefix sum, the pieces' item counts and their prefix sum, then the table,
each waiting for the one before. On layers of small experts, whose grouped
GEMM is short, those launches are a share of the call worth removing
(experiments/results/nvidia_h100/ragged_work_list). These Pallas-Triton
kernels build the same tables in one launch each:

  row_items          "rows" mode: every program recomputes the pieces from
                     `group_sizes` (a prefix sum over at most `MAX_GROUPS`
                     values, in registers) and writes one block of the
                     table's columns;
  contracting_table  "contracting" mode: one program builds the groups'
                     table, the pieces beyond each group's first
                     (`RaggedConfig.piece_rows`), their order and the zero
                     drip's counts, where XLA took up to seven launches
                     (experiments/results/nvidia_h200/ragged_options).

`mosaic_schedule` stays the definition; the tests hold these kernels to it
entry by entry.
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


#: Entries (groups and pieces beyond their first) up to which
#: `contracting_table` runs: one program holds every entry and, for an
#: order, compares each with every other (about twenty entries x entries
#: steps), so the entries stay few: at 256 the kernel took far longer than
#: XLA's chain (experiments/results/nvidia_h200/ragged_options, "Pieces
#: where one group leaves the SMs idle").
MAX_CONTRACTING_ENTRIES = 64
#: Its warps: the entries x entries steps spread over all of them.
CONTRACTING_WARPS = 4


def supports_contracting(entries: int) -> bool:
  return 0 < entries <= MAX_CONTRACTING_ENTRIES


def contracting_table(group_sizes, row_offset, *, m: int, chunk: int,
                      row_align: int, piece_rows: int = 0,
                      order: str | None = None, interpret: bool = False):
  """The "contracting"-mode work list in one Pallas-Triton launch: what
  `mosaic_schedule.contracting_groups` (piece_rows 0) or
  `mosaic_schedule.contracting_pieces` build, then with `order`
  ("largest_first" or "empty_last") reordered as `mosaic_schedule`'s
  functions of that name do, and the two counts the zero drip reads (the
  empty groups, and the entries with rows, of the table before its order),
  each the same int32 values as those XLA ops give.

  Returns (table, extras, counts): table (4, entries), or (5, entries)
  with an order; extras (3, E) (None without pieces); counts (2,)."""
  if order not in (None, "largest_first", "empty_last"):
    raise ValueError(f"order={order!r} is not None, 'largest_first' or "
                     f"'empty_last'")
  groups = group_sizes.shape[0]
  extra_count = (schedule.max_extra_pieces(m, groups, row_align, piece_rows)
                 if piece_rows else 0)
  entries = groups + extra_count
  if not supports_contracting(entries):
    raise ValueError(
        f"RaggedConfig.work_list_kernel takes 1 to {MAX_CONTRACTING_ENTRIES} "
        f"weight-gradient entries (groups + pieces beyond their first); "
        f"group_sizes has {groups} groups and piece_rows={piece_rows} adds "
        f"up to {extra_count}")
  padded = shape_bucket(entries)
  table_rows = 4 if order is None else 5

  def kernel(sizes_ref, offset_ref, table_ref, *rest):
    extras_ref, counts_ref = rest if piece_rows else (None, rest[0])
    index = jnp.arange(padded, dtype=jnp.int32)
    is_group = index < groups
    sizes = jnp.maximum(pltriton.load(sizes_ref.at[pl.ds(0, padded)],
                                      mask=is_group, other=0), 0)
    offset = pltriton.load(offset_ref.at[pl.ds(0, 1)])  # (1,): broadcasts
    ends_unclipped = offset + jnp.cumsum(sizes)
    starts = jnp.clip(ends_unclipped - sizes, 0, m)
    ends = jnp.clip(ends_unclipped, 0, m)
    if piece_rows:
      # As mosaic_schedule.contracting_pieces: entry g < groups is group
      # g's first piece, entry groups + x the x-th piece beyond a first.
      first_cut = starts // row_align * row_align + piece_rows
      first_hi = jnp.minimum(ends, first_cut)
      extra = jnp.where(is_group & (ends > first_cut),
                        (ends - first_cut + piece_rows - 1) // piece_rows, 0)
      extra_ends = jnp.cumsum(extra)
      first_extra = extra_ends - extra
      extras_listed = jnp.sum(extra)

      def beyond_first(x):
        """The x-th pieces beyond a first: their group (clamped; -1 where
        unused), rows [lo, hi) (0 where unused), and their group's first
        such piece and count."""
        owner = jnp.minimum(
            jnp.sum((extra_ends[None, :] <= x[:, None]) & is_group[None, :],
                    axis=1), groups - 1)
        used = (x >= 0) & (x < extras_listed)
        owned = (owner[:, None] == index[None, :]) & is_group[None, :]

        def of_owner(values):
          return jnp.sum(jnp.where(owned, values[None, :], 0), axis=1)

        lo = of_owner(first_cut) + (x - of_owner(first_extra)) * piece_rows
        hi = jnp.minimum(of_owner(ends), lo + piece_rows)
        return (jnp.where(used, owner, -1), jnp.where(used, lo, 0),
                jnp.where(used, hi, 0),
                jnp.where(used, of_owner(first_extra), 0),
                jnp.where(used, of_owner(extra), 0))

      # The table of pieces beyond a first, column x = index.
      owner, _, _, first, count = beyond_first(index)
      for row, values in enumerate((owner, first, count)):
        pltriton.store(extras_ref.at[pl.ds(row, 1), pl.ds(0, padded)],
                       values.astype(jnp.int32)[None, :],
                       mask=(index < extra_count)[None, :])
      # The entries: group g's first piece at g, then those pieces.
      _, lo_extra, hi_extra, _, _ = beyond_first(index - groups)
      lo = jnp.where(is_group, starts, lo_extra)
      hi = jnp.where(is_group, first_hi, hi_extra)
    else:
      lo, hi = starts, ends
    first_row = lo // row_align * row_align
    chunks = jnp.where(hi > lo, (hi - first_row + chunk - 1) // chunk, 0)
    listed = index < entries
    counts = jnp.where(jnp.arange(2, dtype=jnp.int32) == 0,
                       jnp.sum(is_group & (chunks == 0)),
                       jnp.sum(listed & (chunks > 0)))
    pltriton.store(counts_ref.at[pl.ds(0, 2)], counts.astype(jnp.int32))
    table = [lo, hi, first_row, chunks]
    if order is not None:
      # As mosaic_schedule._sorted_entries: each entry's rank (the entries
      # with a larger key, and the earlier ones with as large), then each
      # rank's entry, its original index in a fifth row.
      key = hi - lo if order == "largest_first" else (hi > lo).astype(
          jnp.int32)
      other, this = key[None, :], key[:, None]
      ahead = ((other > this) | ((other == this)
                                 & (index[None, :] < index[:, None])))
      rank = jnp.sum(ahead & listed[None, :], axis=1)
      lands = (rank[None, :] == index[:, None]) & listed[None, :]
      table = [jnp.sum(jnp.where(lands, values[None, :], 0), axis=1)
               for values in table + [index]]
    for row, values in enumerate(table):
      pltriton.store(table_ref.at[pl.ds(row, 1), pl.ds(0, padded)],
                     values.astype(jnp.int32)[None, :], mask=listed[None, :])

  out_shape = [jax.ShapeDtypeStruct((table_rows, entries), jnp.int32)]
  if piece_rows:
    out_shape.append(jax.ShapeDtypeStruct((3, max(extra_count, 1)),
                                          jnp.int32))
  out_shape.append(jax.ShapeDtypeStruct((2,), jnp.int32))
  outs = pl.pallas_call(
      kernel,
      out_shape=tuple(out_shape),
      grid=(1,),
      compiler_params=pltriton.CompilerParams(num_warps=CONTRACTING_WARPS,
                                             num_stages=1),
      interpret=interpret,
      name="ragged_contracting_table",
  )(group_sizes.astype(jnp.int32), row_offset.astype(jnp.int32))
  if piece_rows:
    table, extras, counts = outs
    return table, extras[:, :extra_count], counts
  table, counts = outs
  return table, None, counts
