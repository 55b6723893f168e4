"""`mosaic`: the grouped GEMM on Pallas Mosaic GPU (Hopper: TMA + wgmma).

Both modes run one persistent, warp-specialised kernel shape, as
`mosaic_backend/ws_persistent.py` does for the dense GEMM: one CTA per SM,
a producer warpgroup that only issues TMA loads into a ring of `stages`
shared-memory stages, and two consumer warpgroups that run wgmma on them.
The ring's step counter runs on across tiles (carried through the tile
loop, since tiles take different numbers of steps), so the next tile's
loads overlap this tile's epilogue.

Mode "rows" (this file). The work is a list of row items computed on the
device from `group_sizes` (see `mosaic_schedule.py`): each group's rows cut
into tiles of tile_m rows from the group's first row (rounded down to the 8
rows of a swizzled row tile). An item's tile starts there (or earlier, at
the last tile_m rows of lhs, so that no load reaches past it) and may reach
into the neighbouring groups' rows; each item stores only its own rows: the
TMA store of a partial tile goes out as a ladder of power-of-two row counts
(the binary digits of the row count), since a TMA descriptor's box is
static. With `split_rows`, a consumer whose half of the tile holds none of
the item's rows (the short last item of a group) issues no wgmma, so the
tensor cores run only the half with rows. Items of rows that belong to no
group skip the product and store zeros. Tiles are (item, column strip)
pairs walked in a banded snake along the items, so all row items of one
(group, column strip) run together and the expert's weight tile comes from
HBM once.
The two consumers split the CTA tile's columns, or with
`RaggedConfig.split_rows` its two row halves (64 or 128 rows each; each then
stores only its half's share of the item's rows). A 256-row tile holds a
whole group of up to 256 rows, so that one CTA reads each of that expert's
weight tiles. The partial stores start at any row, which a tiled
shared-memory layout cannot address: the staged output tile is plain rows,
or (`RaggedConfig.swizzled_staging`) swizzled and stored through a second,
untiled view (`row_staging_smem`). No store reaches past the output's last
column.
With `RaggedConfig.swap_ab`, each tile is computed transposed, acc
(columns, tokens) = rhs[g]^T lhs^T, so that the token rows are wgmma's N:
each group is cut into equally long items (`row_items(balanced=True)`),
and an item runs, loads and stores at the narrowest of a few static token
widths (`configs.swap_ab_widths`) that holds its rows; the accumulator
reaches the staging tile through a transposed view of it.
With `RaggedConfig.cluster_columns`, the grid is of 2-CTA clusters: both
CTAs walk the same (item, strip pair) tiles, each computing one of the two
neighbouring column strips, and each multicasts half of the item's lhs
tile into both CTAs' stage; a stage is released once the consumers of both
CTAs are done with it. With an odd strip count the second CTA's last strip
lies past the output: its weight loads read zeros and it stores nothing.

Mode "contracting" lives in `mosaic_contracting.py`. float32 and fp8
operands run as a bfloat16 problem of their parts (`bfloat16_split`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_gemm.devices import DeviceInfo, device_info
from pallas_gemm.mosaic_backend import tma
from pallas_gemm.mosaic_backend.configs import (CLUSTER_CTAS, Dim,
                                              hopper_device_unsupported)
from pallas_gemm.mosaic_backend.warp_specialised import (
    INTERPRET_CTAS, Ring, call_kernel, consume_ring, for_each_tile,
    index, interpret_params, ring_smem, rows_addressable,
    run_producer, run_warpgroups, tile_coordinates, tiles_of_this_cta,
    warp_specialised_kernel)
from pallas_gemm.problem import ACTIVATIONS, cdiv, power_of_two_at_most
from pallas_gemm.ragged_dot import bfloat16_split, configs
from pallas_gemm.ragged_dot import mosaic_schedule as schedule
from pallas_gemm.ragged_dot import work_list_kernel
from pallas_gemm.ragged_dot.configs import (NUM_CONSUMERS, SHORT_ITEM_ROWS,
                                          RaggedConfig)
from pallas_gemm.ragged_dot.problem import RaggedProblem
from pallas_gemm.ragged_dot.xla import group_row_mask

NAME = "mosaic"

INPUT_DTYPES = ("bfloat16", "float16")
OUTPUT_DTYPES = ("bfloat16", "float16", "float32")


def heuristic(problem: RaggedProblem, device: DeviceInfo) -> RaggedConfig:
  return configs.heuristic(_kernel_problem(problem), device)


def _kernel_problem(problem: RaggedProblem) -> RaggedProblem:
  """The problem the kernels run: float32 and fp8 operands as the bfloat16
  problem of their parts' products (`bfloat16_split`)."""
  if bfloat16_split.splits(problem):
    return bfloat16_split.bfloat16_problem(problem)
  return problem


def supports(problem: RaggedProblem, device: DeviceInfo) -> str | None:
  reason = hopper_device_unsupported(device)
  if reason:
    return reason
  if bfloat16_split.splits(problem):
    reason = bfloat16_split.why_not(problem)
    if reason:
      return reason
  problem = _kernel_problem(problem)
  if problem.in_dtype not in INPUT_DTYPES:
    return f"input dtype {problem.in_dtype} is not one of {INPUT_DTYPES}"
  if problem.out_dtype not in OUTPUT_DTYPES:
    return f"output dtype {problem.out_dtype} is not one of {OUTPUT_DTYPES}"
  if problem.precision not in ("default", "bf16", "fp16"):
    return f"precision {problem.precision!r} is not the inputs' own"
  return None


# -- shared by both modes ----------------------------------------------------


def num_ctas_for(params) -> int:
  if params is not None:
    return INTERPRET_CTAS
  return device_info().planning_sms


def tile_steps(tile):
  """The ring steps of a producer tile: the last entry of the tuple the
  kernels' `producer_tile` returns (a count from the device's work list)."""
  return tile[-1]


def _tile_number(linear):
  """How many tiles this CTA ran before `linear`, one of its tiles dealt
  round-robin (`warp_specialised.for_each_tile`)."""
  cta, num_ctas = index(lax.axis_index("sm")), index(lax.axis_size("sm"))
  return lax.div(index(linear) - cta, num_ctas)


def _turn_number(linear, turn=None):
  """How many tiles this CTA ran before `linear`: `turn` where the tiles
  were claimed (`tile_claims`, which numbers them), else from the
  round-robin deal."""
  return _tile_number(linear) if turn is None else index(turn)


def ping_pong_turn(linear, turn=None):
  """With `RaggedConfig.ping_pong`: the consumer whose turn `linear` (one of
  this CTA's tiles, dealt round-robin) is, and how many tiles that consumer
  ran before it. The CTA's tiles alternate between the consumers. `turn`:
  the tile's number among the CTA's tiles where they were claimed
  (`tile_claims`), not dealt."""
  local = _turn_number(linear, turn)
  consumers = index(NUM_CONSUMERS)
  return lax.rem(local, consumers), lax.div(local, consumers)


def output_slot(linear, store, stores_per_tile: int, out_slots: int, *,
                ping_pong: bool = False, turn=None):
  """The staging slot of a tile's `store`-th output store. The slots
  alternate over the consumer's consecutive stores, across tiles too, so
  that a store never overwrites the slot of the one just before it (which
  may still be reading it); static unless a tile has an odd number of
  stores. With `ping_pong` a consumer runs every other tile of its CTA.
  `turn` as for `ping_pong_turn`."""
  if stores_per_tile % out_slots == 0:
    return store % out_slots
  tile_number = (ping_pong_turn(linear, turn)[1] if ping_pong
                 else _turn_number(linear, turn))
  return lax.rem(tile_number * stores_per_tile + store, index(out_slots))


def store_rows(out_smem, out_gmem, *, row0, first_row, num_rows, max_rows,
               cols):
  """TMA-stores rows [first_row, first_row + num_rows) of `out_smem` (an
  un-swizzled (max_rows, width) tile) to rows row0 + those of `out_gmem`,
  leaving the others untouched: one store per binary digit of num_rows
  (largest first), as a TMA box has a static size. Commits one bulk group.
  The first store is the largest power of two at most max_rows (a 192-row
  tile's binary digits run from 128)."""
  offset = first_row
  rows = power_of_two_at_most(max_rows)
  while rows >= 1:
    size = rows
    digit = jnp.bitwise_and(num_rows, index(size))

    @pl.when(digit != 0)
    def _store(offset=offset, size=size):
      plgpu.copy_smem_to_gmem(out_smem.at[pl.ds(offset, size)],
                              out_gmem.at[pl.ds(row0 + offset, size), cols],
                              commit_group=False)
    offset = offset + digit
    rows //= 2
  plgpu.commit_smem_to_gmem_group()


# -- mode "rows" ---------------------------------------------------------------


def lhs_row_align(config: RaggedConfig, problem: RaggedProblem) -> int:
  """Rows of one tile of lhs's swizzled shared-memory layout: the items'
  tiles start on a multiple of it (through the tiled view, a TMA load's
  first row must be one: Mosaic divides the start by it)."""
  return tma.tma_tiling(config.tile_k, problem.in_dtype)[0]


def lhs_in_place(config: RaggedConfig, problem: RaggedProblem,
                 params) -> bool:
  """Whether the compiled kernel reads an lhs whose rows are not whole
  8-row tiles as it is, through an untiled view of its ring
  (`row_addressed_smem`), and writes an output of exactly m rows: no
  padded copy of lhs and no slice of the output, each a full pass over an
  operand (m = tokens x top-k is often not a multiple of 8). Rows in whole
  tiles keep the tiled view, the path all earlier measurements ran. The
  interpreter keeps the views of a `plgpu.RefUnion` apart, so there lhs is
  padded."""
  return (params is None
          and problem.m % lhs_row_align(config, problem) != 0
          and rows_addressable(config.tile_k, problem.in_dtype))


def tile_item(items, linear, *, num_items, n_units: int,
              config: RaggedConfig):
  """(item, column unit) of "rows"-mode tile `linear` in the walk order:
  bands of grid_band items, every other one backwards, restarted at each
  piece's first item with group_bands. `items`: the item table
  (`mosaic_schedule.row_items`), a kernel ref or an array (the lab's model
  of the walk, `experiments/lab/ragged_phase_model.py`, calls this too)."""
  if config.group_bands:
    # The tiles of a piece (a group, or rows of no group) are the
    # consecutive run of its items times n_units, so the item whose
    # number is linear // n_units lies in the tile's piece; the bands
    # are counted from the piece's first item.
    some_item = lax.div(index(linear), index(n_units))
    first = items[schedule.ITEM_PIECE_FIRST, some_item]
    count = items[schedule.ITEM_PIECE_ITEMS, some_item]
    _, item, n_idx = tile_coordinates(
        index(linear) - first * n_units, m_tiles=count, n_tiles=n_units,
        band_dim=Dim.M, band=config.grid_band)
    return first + item, n_idx
  _, item, n_idx = tile_coordinates(linear, m_tiles=num_items,
                                    n_tiles=n_units, band_dim=Dim.M,
                                    band=config.grid_band)
  return item, n_idx


def _rows_body(items_gmem, lhs_gmem, rhs_gmem, out_gmem, *,
               problem: RaggedProblem, config: RaggedConfig, k_iters: int,
               n_units: int, swizzled_staging: bool, in_place: bool,
               splits: int = 1, split_steps: int = 0):
  """`n_units`: column strips, or with cluster_columns pairs of them (one
  per CTA of a cluster). `in_place`: lhs has any row count (at least
  tile_m) and is loaded through the untiled view of its ring
  (`lhs_in_place`). `splits` > 1 (`RaggedConfig.split_k`): the walk runs
  every tile `splits` times, the s-th over K steps [s * split_steps,
  (s + 1) * split_steps), and stores it to out_gmem[s] (float32 partial
  sums, which `_rows_matmul` adds)."""
  tile_m, tile_n, tile_k = config.tile_m, config.tile_n, config.tile_k
  cta_n = config.cta_tile("rows")[1]
  epi_n = config.epi_tile_n
  stages = config.stages
  transpose_rhs = problem.transpose_rhs
  in_dtype, out_dtype = lhs_gmem.dtype, out_gmem.dtype
  cons_m, cons_n = config.consumer_tile("rows")
  epi_m = config.staged_rows("rows")
  out_slots = config.out_slots
  activation = (ACTIVATIONS[problem.activation] if problem.activation
                else None)

  lhs_block = (tile_m, tile_k)
  rhs_block = (cta_n, tile_k) if transpose_rhs else (tile_k, cta_n)
  num_items = index(schedule.item_count(items_gmem))
  split_tiles = num_items * n_units  # the tiles of one share of K
  num_tiles = split_tiles * splits
  n_out = out_gmem.shape[-1]
  # RaggedConfig.halve_last_round: where the walk's last round of the
  # round-robin deal fills at most half the CTAs, each of its tiles runs as
  # two tiles of half the CTA tile's columns, dealt to two CTAs.
  halves_from = walked = num_tiles
  if config.halve_last_round:
    num_ctas = index(lax.axis_size("sm"))
    last_round = lax.rem(num_tiles, num_ctas)
    halved_tiles = jnp.where(2 * last_round <= num_ctas, last_round,
                             index(0))
    halves_from = num_tiles - halved_tiles
    walked = num_tiles + halved_tiles

  # Each tile starts on a whole row tile of lhs's swizzled layout, or is
  # held back to lhs's last tile_m rows (`schedule.tile_first_row`): then
  # in place it may start anywhere.
  row_align = lhs_row_align(config, problem)
  lhs_rows = lhs_gmem.shape[0]
  assert lhs_rows >= tile_m, lhs_gmem.shape
  assert in_place or lhs_rows % row_align == 0, lhs_gmem.shape

  def tile_info(linear):
    """(group, tile_row, row_lo, row_hi, n_idx, steps, half) of tile
    `linear` of the walk: its item's, and its column strip's. `half` is
    None without halve_last_round; with it, (whether the tile is half of
    a last-round tile, its first column within the strip: 0, or cta_n / 2
    for a second half)."""
    half = None
    split, k_first = split_of(linear)
    if splits > 1:
      linear = lax.rem(linear, jnp.maximum(split_tiles, 1))
    if config.halve_last_round:
      halved = linear >= halves_from
      past = linear - halves_from
      linear = jnp.where(halved, halves_from + lax.div(past, index(2)),
                         linear)
      half = (halved, jnp.where(halved, lax.rem(past, index(2))
                                * (cta_n // 2), index(0)))
    item, n_idx = tile_item(items_gmem, linear, num_items=num_items,
                            n_units=n_units, config=config)
    if config.cluster_columns:
      n_idx = n_idx * CLUSTER_CTAS + lax.axis_index("cluster")
    group = items_gmem[schedule.ITEM_GROUP, item]
    row_lo = items_gmem[schedule.ITEM_ROW_LO, item]
    row_hi = items_gmem[schedule.ITEM_ROW_HI, item]
    tile_row = schedule.tile_first_row(row_lo, row_align=row_align,
                                       lhs_rows=lhs_rows, tile_m=tile_m)
    steps = jnp.where(group >= 0, index(k_iters), index(0))
    if split is not None:
      # The last share may hold fewer steps (never none: `k_splits`).
      steps = jnp.where(group >= 0, jnp.minimum(index(split_steps),
                                                index(k_iters) - k_first),
                        index(0))
    return group, tile_row, row_lo, row_hi, n_idx, steps, half

  def split_of(linear):
    """(share, first K step) of tile `linear` of the walk: (None, 0)
    without split_k; else its share of the reduction, whose tiles are the
    walk's share-th run of split_tiles."""
    if splits == 1:
      return None, 0
    share = lax.div(linear, jnp.maximum(split_tiles, 1))
    return share, share * index(split_steps)

  def output_of(linear):
    """The output tile `linear` stores to: its share's partial sums with
    split_k."""
    share, _ = split_of(linear)
    return out_gmem if share is None else out_gmem.at[share]

  def strip_col(n_idx, half):
    """The first output column of a tile of column strip n_idx (`half` as
    `tile_info` gives it)."""
    col = n_idx * cta_n
    return col if half is None else col + half[1]

  # With swap_ab: the first token row of each consumer's share of a tile
  # (with split_rows each consumer owns cons_m of the tile's rows).
  swap_token_offsets = ((0, cons_m) if config.split_rows else (0,))

  def swap_widths(needed):
    """With swap_ab: (width, whether it is the narrowest static token width
    that holds `needed` rows of a consumer's share, at most cons_m) for each
    width; exactly one holds (the narrowest also for needed <= 0)."""
    needed = jnp.minimum(needed, cons_m)
    widths = config.token_widths()
    return [(width, (needed > narrower) & (needed <= width))
            for width, narrower in zip(widths, (*widths[1:], -tile_m))]

  def scoped(lhs_smem, rhs_smem, stage_loaded, stage_consumed, out_smem,
             staging_free=None):
    ring = Ring(stages, stage_loaded, stage_consumed)
    # wgmma reads lhs through the tiled view, the TMA writes it through
    # the other (the same bytes).
    lhs_smem, lhs_loaded = lhs_smem if in_place else (lhs_smem, lhs_smem)
    # The epilogue writes its registers through one view of the staging
    # buffer and TMA-stores rows through the other (the same bytes).
    out_written, out_stored = (out_smem if swizzled_staging
                               else (out_smem, out_smem))

    def producer_tile(linear):
      group, tile_row, _, row_hi, n_idx, steps, half = tile_info(linear)
      weights = rhs_gmem.at[jnp.maximum(group, 0)]
      owner = ping_pong_turn(linear)[0] if config.ping_pong else 0
      return (weights, tile_row, row_hi - tile_row,
              pl.ds(strip_col(n_idx, half), cta_n), owner,
              None if half is None else half[0], split_of(linear)[1], steps)

    def load_half_weights(weights, depth, cols, slot, loaded):
      """A half tile's weights (`cols`: from its first column): read
      transposed, its columns are the stage's first cta_n / 2 rows.
      Otherwise a column range of the stage is not contiguous in its tiled
      layout, which the TMA needs, so the whole stage is loaded from its
      first column (the second half reads into the next strip, or past the
      padded columns, where the TMA fills zeros)."""
      if transpose_rhs:
        plgpu.copy_gmem_to_smem(
            weights.at[pl.ds(cols.start, cta_n // 2), depth],
            rhs_smem.at[slot, pl.ds(0, cta_n // 2)], loaded)
      else:
        plgpu.copy_gmem_to_smem(weights.at[depth, cols], rhs_smem.at[slot],
                                loaded)

    def load_step(tile, kk, slot):
      weights, tile_row, needed, cols, owner, halved, k_first, _ = tile
      depth = pl.ds((kk + k_first) * tile_k, tile_k)
      loaded = ring._replace(owner=owner).loaded_barrier(slot)
      if config.swap_ab:
        # Only the rows each consumer's width multiplies. With split_rows,
        # each consumer's share is its own copy, also when it holds no row
        # (then the narrowest: the stage's arrival count is static).
        for wg_rows in swap_token_offsets:
          for width, fits in swap_widths(needed - wg_rows):
            pl.when(fits)(functools.partial(
                plgpu.copy_gmem_to_smem,
                lhs_gmem.at[pl.ds(tile_row + wg_rows, width), depth],
                lhs_loaded.at[slot, pl.ds(wg_rows, width)], loaded))
      else:
        plgpu.copy_gmem_to_smem(
            lhs_gmem.at[pl.ds(tile_row, tile_m), depth], lhs_loaded.at[slot],
            loaded,
            collective_axes="cluster" if config.cluster_columns else None)
      load_whole = functools.partial(
          plgpu.copy_gmem_to_smem,
          weights.at[cols, depth] if transpose_rhs
          else weights.at[depth, cols],
          rhs_smem.at[slot], loaded)
      if halved is None:
        load_whole()
        return
      pl.when(~halved)(load_whole)
      pl.when(halved)(functools.partial(load_half_weights, weights, depth,
                                        cols, slot, loaded))

    def producer():
      run_producer(ring, num_tiles=walked, steps=tile_steps,
                   coords=producer_tile, load_step=load_step)

    def consumer(wg):
      wg_rows = wg * cons_m if config.split_rows else 0
      splits_columns = not (config.split_rows or config.ping_pong)
      wg_cols = wg * tile_n if splits_columns else 0
      my_ring = ring._replace(owner=wg) if config.ping_pong else ring
      stores = cons_n // epi_n  # per staged row block
      # With shared_staging both consumers write one staging buffer, in
      # the order of their turns: each waits for the other's hand-over.
      staging = 0 if config.shared_staging else wg

      def take_staging():
        if config.shared_staging:
          plgpu.barrier_wait(staging_free.at[wg])

      def hand_over_staging():
        if config.shared_staging:
          # The other consumer may write once this one's stores have read
          # the buffer.
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)
          plgpu.barrier_arrive(staging_free.at[1 - wg])

      def mma_step(at, acc_ref, *, rows, cols=cons_n):
        if config.swap_ab:
          # acc (columns, tokens) += rhs^T (columns, depth) x lhs^T (depth,
          # tokens): the item's first `rows` token rows are wgmma's N.
          if transpose_rhs:
            a = rhs_smem.at[at.slot, pl.ds(wg_cols, cons_n), :]
          else:
            a = rhs_smem.at[at.slot, :, pl.ds(wg_cols, cons_n)].T
          plgpu.wgmma(acc_ref, a,
                      lhs_smem.at[at.slot, pl.ds(wg_rows, rows), :].T)
          return
        if transpose_rhs:
          b = rhs_smem.at[at.slot, pl.ds(wg_cols, cols), :].T
        else:
          b = rhs_smem.at[at.slot, :, pl.ds(wg_cols, cols)]
        plgpu.wgmma(acc_ref, lhs_smem.at[at.slot, pl.ds(wg_rows, rows), :],
                    b)

      def idle(first_step, steps):
        """A tile this consumer does not compute: it only keeps the ring's
        barriers and its count of output bulk groups in step."""
        consume_ring(my_ring, lambda at: None, first_step=first_step,
                     steps=steps)
        for _ in range(cons_m // epi_m * stores):
          plgpu.commit_smem_to_gmem_group()  # keep the slot count

      def tile(linear, first_step):
        group, tile_row, row_lo, row_hi, n_idx, steps, half = tile_info(
            linear)
        # With clusters and an odd strip count, the second CTA's last strip
        # lies past the output: its loads still run (the lhs multicast
        # needs both CTAs), its consumers compute nothing.
        in_output = (n_idx * cta_n < problem.n if config.cluster_columns
                     else None)
        if config.ping_pong:
          # Every other tile of the CTA is this consumer's, whole; the
          # others only advance its count of ring steps.
          mine = ping_pong_turn(linear)[0] == wg
          if in_output is not None:
            pl.when(mine & ~in_output)(lambda: idle(first_step, steps))
            mine = mine & in_output
          args = (linear, group, tile_row, row_lo, row_hi, n_idx, steps,
                  first_step)
          if config.swap_ab:
            swapped_compute_and_store(mine, *args)
            return first_step + steps
          if not config.short_items:
            pl.when(mine)(lambda: compute_and_store(*args))
            return first_step + steps
          # An item whose rows all lie in the tile's first SHORT_ITEM_ROWS
          # (the short last item of a group) multiplies only those rows.
          short = row_hi - tile_row <= SHORT_ITEM_ROWS
          pl.when(mine & short)(
              lambda: compute_and_store(*args, rows=SHORT_ITEM_ROWS))
          pl.when(mine & ~short)(lambda: compute_and_store(*args))
          return first_step + steps
        if config.split_rows:
          # A short item (the last rows of a group) may leave the second
          # half of the tile without a row of its own.
          has_work = row_hi > jnp.maximum(row_lo, tile_row + wg_rows)
          if in_output is not None:
            has_work = has_work & in_output
        else:
          # A last column strip that ends inside the first consumer's half
          # leaves the second one no column to compute.
          has_work = n_idx * cta_n + wg_cols < problem.n

        if config.swap_ab:
          swapped_compute_and_store(has_work, linear, group, tile_row, row_lo,
                                    row_hi, n_idx, steps, first_step)
        elif half is not None:
          # halve_last_round: a half tile runs both consumers' rows at half
          # their columns.
          args = (linear, group, tile_row, row_lo, row_hi, n_idx, steps,
                  first_step)
          halved, _ = half
          pl.when(has_work & ~halved)(
              lambda: compute_and_store(*args, half=half))
          pl.when(has_work & halved)(
              lambda: compute_and_store(*args, cols=cons_n // 2, half=half))
        else:
          @pl.when(has_work)
          def _compute():
            compute_and_store(linear, group, tile_row, row_lo, row_hi, n_idx,
                              steps, first_step)

        # The idle consumer only keeps the ring's barriers in step, and the
        # other one runs alone on the tensor cores.
        pl.when(jnp.logical_not(has_work))(lambda: idle(first_step, steps))
        return first_step + steps

      def swapped_compute_and_store(runs, linear, group, tile_row, row_lo,
                                    row_hi, n_idx, steps, first_step):
        """With swap_ab, where `runs`: the tile at the narrowest of the
        static token widths that holds the item's rows (they end `needed`
        rows into the tile), each width its own copy of the loop."""
        for width, fits in swap_widths(row_hi - tile_row - wg_rows):
          pl.when(runs & fits)(functools.partial(
              swapped_tile, linear, group, tile_row, row_lo, row_hi, n_idx,
              steps, first_step, width))

      def multiply(group, steps, first_step, *, rows, acc_shape):
        """The tile's product over its first `rows` token rows, in an f32
        accumulator of `acc_shape` (with swap_ab, columns by tokens; else
        the first acc_shape[1] of the consumer's columns), then the
        activation."""
        (acc,) = consume_ring(
            my_ring, functools.partial(
                mma_step, rows=rows,
                **({} if config.swap_ab else dict(cols=acc_shape[1]))),
            first_step=first_step, steps=steps,
            accumulators=[plgpu.ACC(acc_shape, jnp.float32)])
        if activation is not None:
          # Rows of no group are zero, also where activation(0) is not.
          acc = activation(acc) * (group >= 0).astype(jnp.float32)
        return acc

      def swapped_tile(linear, group, tile_row, row_lo, row_hi, n_idx, steps,
                       first_step, width):
        """swap_ab: multiplies the tile's first `width` token rows into an
        accumulator (columns, tokens), then stores the item's rows of it
        through transposed views of the staging tile."""
        acc = multiply(group, steps, first_step, rows=width,
                       acc_shape=(cons_n, width))
        row0 = tile_row + wg_rows
        first_row = jnp.clip(row_lo - row0, 0, width)
        num_rows = jnp.clip(row_hi - row0, 0, width) - first_row
        col0 = n_idx * cta_n + wg_cols
        take_staging()
        for ej in range(stores):
          slot = output_slot(linear, ej, stores, out_slots,
                             ping_pong=config.ping_pong)
          part = acc[ej * epi_n:(ej + 1) * epi_n]  # (columns, tokens)
          plgpu.wait_smem_to_gmem(out_slots - 1, wait_read_only=True)
          out_written.at[staging, slot, pl.ds(0, width)].T[...] = part.astype(
              out_dtype)
          plgpu.commit_smem()
          col = col0 + ej * epi_n
          # As in compute_and_store: no store right of the last column.
          # The ladder of power-of-two stores spans the whole staging tile
          # (tile_m rows), of which the item's lie in the first `width`.
          store_rows(out_stored.at[staging, slot], out_gmem,
                     row0=row0, first_row=first_row,
                     num_rows=jnp.where(col < n_out, num_rows, 0),
                     max_rows=cons_m, cols=pl.ds(col, epi_n))
        hand_over_staging()

      def compute_and_store(linear, group, tile_row, row_lo, row_hi, n_idx,
                            steps, first_step, rows=cons_m, cols=cons_n,
                            half=None):
        """Multiplies and stores the first `rows` rows of this consumer's
        tile (all cons_m, or the SHORT_ITEM_ROWS holding a short item), and
        its first `cols` columns (all cons_n, or with halve_last_round
        half, from `half`'s column); the stores past them are empty bulk
        groups, so that the staging slots keep their order."""
        acc = multiply(group, steps, first_step, rows=rows,
                       acc_shape=(rows, cols))
        block_rows = min(epi_m, rows)
        blocks = rows // block_rows
        take_staging()
        for ei in range(blocks):
          # This consumer's share of the item's rows [row_lo, row_hi) in its
          # ei-th block of staged rows.
          row0 = tile_row + wg_rows
          if ei:
            row0 = row0 + ei * block_rows
          first_row = jnp.clip(row_lo - row0, 0, block_rows)
          num_rows = jnp.clip(row_hi - row0, 0, block_rows) - first_row
          col0 = n_idx * cta_n + wg_cols
          if half is not None:
            col0 = col0 + half[1]
          block = (acc if blocks == 1
                   else acc[ei * block_rows:(ei + 1) * block_rows])
          for ej in range(stores):
            if ej * epi_n >= cols:
              plgpu.commit_smem_to_gmem_group()  # keep the slots' order
              continue
            slot = output_slot(linear, ei * stores + ej, blocks * stores,
                               out_slots, ping_pong=config.ping_pong)
            part = block[:, ej * epi_n:(ej + 1) * epi_n]
            # The TMA stores that last read this slot must be done with it.
            plgpu.wait_smem_to_gmem(out_slots - 1, wait_read_only=True)
            out_written.at[staging, slot, pl.ds(0, block_rows)][...] = (
                part.astype(out_dtype))
            plgpu.commit_smem()
            staged = out_stored.at[staging, slot, pl.ds(0, block_rows)]
            col = col0 + ej * epi_n
            # Columns past the output's (a multiple of epi_n) are not stored
            # at all: a store from the un-swizzled staging tile whose window is
            # contiguous in memory (one row, or full-width rows) is issued as
            # a linear bulk copy, clipped only at the array's end, so a window
            # right of the last column would land on the next rows. (Zero rows
            # still commit a bulk group: the slot waits above count them.)
            store_rows(staged, output_of(linear), row0=row0,
                       first_row=first_row,
                       num_rows=jnp.where(col < n_out, num_rows, 0),
                       max_rows=block_rows, cols=pl.ds(col, epi_n))
        hand_over_staging()

      if config.shared_staging:
        # The CTA's first tile is consumer 0's.
        pl.when(wg == 1)(lambda: plgpu.barrier_arrive(staging_free.at[0]))
      for_each_tile(walked, tile, index(0))
      if config.shared_staging:
        # The last hand-over went to the consumer whose turn the next tile
        # would be: it observes it, so that no barrier phase is left
        # unobserved.
        next_turn = lax.rem(tiles_of_this_cta(walked),
                            index(NUM_CONSUMERS))
        pl.when(next_turn == wg)(
            lambda: plgpu.barrier_wait(staging_free.at[wg]))
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    run_warpgroups(producer, consumer)

  pl.run_scoped(
      scoped,
      **ring_smem(stages, lhs_smem=(lhs_block, in_dtype),
                  rhs_smem=(rhs_block, in_dtype),
                  # swap_ab with split_rows: an lhs copy per consumer.
                  loads=3 if config.swap_ab and config.split_rows else None,
                  owners=NUM_CONSUMERS if config.ping_pong else 1,
                  cluster_axes=("cluster",) if config.cluster_columns
                  else None,
                  row_addressed=("lhs_smem",) if in_place else ()),
      out_smem=row_staging_smem(
          swizzled_staging,
          (config.staging_buffers, out_slots, epi_m, epi_n), out_dtype),
      **({"staging_free": plgpu.Barrier(num_arrivals=1,
                                        num_barriers=NUM_CONSUMERS)}
         if config.shared_staging else {}),
      collective_axes="wg",
  )


def row_staging_smem(swizzled: bool, shape, out_dtype):
  """The epilogue's staging tiles. The partial stores of a tile's rows
  start at any row, which a tiled shared-memory layout (8-row tiles) cannot
  address, so by default the buffer is plain rows, which the registers'
  wgmma layout writes with bank conflicts (each warp's store spans 8 rows
  of the same banks). With `swizzled`, two views of one buffer: the
  registers are written through the tiled and swizzled one (conflict-free),
  and the TMA stores read rows through a swizzled view without tiling, whose
  row slices may start anywhere: a tile's row is one swizzle span, so both
  views put row r at the same bytes, and the TMA unit swizzles by the
  shared-memory address, as the tiled writes did."""
  if not swizzled:
    return plgpu.SMEM(shape, out_dtype)
  swizzle = configs.staging_swizzle(shape[-1], out_dtype)
  assert swizzle is not None, (shape, out_dtype)
  tiling = (8, swizzle // jnp.dtype(out_dtype).itemsize)
  return plgpu.RefUnion(
      plgpu.SMEM(shape, out_dtype,
                 transforms=(plgpu.TilingTransform(tiling),
                             plgpu.SwizzleTransform(swizzle))),
      plgpu.SMEM(shape, out_dtype,
                 transforms=(plgpu.SwizzleTransform(swizzle),)))


def _check_operands(lhs, rhs, group_sizes, row_offset, problem):
  for name, value, shape in (("lhs", lhs, problem.lhs_shape),
                             ("rhs", rhs, problem.rhs_shape),
                             ("group_sizes", group_sizes, (problem.groups,)),
                             ("row_offset", row_offset, (1,))):
    if tuple(value.shape) != tuple(shape):
      raise ValueError(f"{name} has shape {tuple(value.shape)}; the problem "
                       f"needs {tuple(shape)}")
  for name, value in (("lhs", lhs), ("rhs", rhs)):
    if jnp.dtype(value.dtype).name != problem.in_dtype:
      raise ValueError(f"{name} has dtype {value.dtype}; the problem needs "
                       f"{problem.in_dtype}")


def _rows_matmul(lhs, rhs, group_sizes, row_offset, *, problem, config,
                 params):
  m, n = problem.m, problem.n
  tile_m, tile_k = config.tile_m, config.tile_k
  cta_n = config.cta_tile("rows")[1]
  in_dtype = problem.in_dtype
  row_align = lhs_row_align(config, problem)
  if config.work_list_kernel:
    items = work_list_kernel.row_items(
        group_sizes, row_offset, m=m, tile_m=tile_m, row_align=row_align,
        balanced=config.swap_ab, interpret=params is not None)
  else:
    items = schedule.row_items(group_sizes, row_offset, m=m, tile_m=tile_m,
                               row_align=row_align, balanced=config.swap_ab)
  in_place = lhs_in_place(config, problem, params)
  lhs_tiling = tma.tma_tiling(tile_k, in_dtype)
  if in_place:  # rows as they are (at least one tile of them)
    lhs_tiling = (1, lhs_tiling[1])
  lhs = tma.pad_to_tiling(lhs, lhs_tiling, (tile_m, tile_k))
  rhs_box = (cta_n, tile_k) if problem.transpose_rhs else (tile_k, cta_n)
  rhs = tma.pad_to_tiling(rhs, tma.tma_tiling(rhs_box[1], in_dtype), rhs_box)
  # Item stores write exact rows: read in place, the output needs no row
  # past m; padded, it has lhs's padded rows. At least a tile's either way.
  m_out = max(m if in_place else cdiv(m, 8) * 8, tile_m)
  n_out = configs.staged_columns(n, config)
  cluster_size = CLUSTER_CTAS if config.cluster_columns else 1
  n_units = cdiv(cdiv(n, cta_n), cluster_size)
  k_iters = cdiv(problem.k, tile_k)
  splits, split_steps = configs.k_splits(config, k_iters)
  max_tiles = (schedule.max_row_items(m, problem.groups, tile_m, row_align)
               * n_units * splits)
  kernel_problem = configs.kernel_problem(problem, config)
  out_type = jax.ShapeDtypeStruct(
      (splits, m_out, n_out) if splits > 1 else (m_out, n_out),
      jnp.dtype(kernel_problem.out_dtype))
  # The interpreter keeps each view of a `plgpu.RefUnion` apart (and its
  # race detector refuses a read through another view than the write), so
  # there the staging is plain rows; the GPU tests check the swizzled views.
  swizzled_staging = config.swizzled_staging and params is None
  kernel = warp_specialised_kernel(
      functools.partial(_rows_body, problem=kernel_problem, config=config,
                        k_iters=k_iters, n_units=n_units,
                        swizzled_staging=swizzled_staging,
                        in_place=in_place, splits=splits,
                        split_steps=split_steps),
      out_type=out_type,
      # With halve_last_round a walk of fewer tiles than CTAs may halve
      # them all, onto twice as many CTAs.
      grid=(max(1, min(num_ctas_for(params) // cluster_size,
                       max_tiles * (2 if config.halve_last_round else 1))),),
      interpret=params,
      **(dict(cluster=(cluster_size,), cluster_names=("cluster",))
         if config.cluster_columns else {}))
  out = call_kernel(kernel, [items, lhs, rhs], out_type, params)
  if splits > 1:
    return _sum_of_shares(out[:, :m, :n], group_sizes, row_offset, problem)
  # Rows of n columns that are not whole 16-byte units start at misaligned
  # addresses, where XLA's slice copies far below the bandwidth: compiled,
  # the dense kernels' copy cuts them.
  return tma.unpad_matrix(out, m, n, on_gpu=params is None)


def _sum_of_shares(partials, group_sizes, row_offset, problem: RaggedProblem):
  """split_k's epilogue: the shares' float32 partial sums added, then the
  activation on the rows of a group (rows of no group stay 0, also where
  activation(0) is not), in the output dtype."""
  out = partials.sum(axis=0)
  if problem.activation:
    in_group = group_row_mask(group_sizes, row_offset, problem.m)[:, None]
    out = jnp.where(in_group, ACTIVATIONS[problem.activation](out), 0)
  return out.astype(problem.out_dtype)


def _rows_without_k(group_sizes, row_offset, problem: RaggedProblem):
  """Every product is an empty sum; rows of a group still get
  activation(0), which is not 0 for every activation."""
  zeros = jnp.zeros(problem.out_shape, jnp.float32)
  value = (ACTIVATIONS[problem.activation](zeros) if problem.activation
           else zeros)
  in_group = group_row_mask(group_sizes, row_offset, problem.m)[:, None]
  return jnp.where(in_group, value, 0).astype(problem.out_dtype)


def ragged_matmul(lhs, rhs, group_sizes, row_offset, *,
                  problem: RaggedProblem, config: RaggedConfig,
                  interpret=False):
  """`problem` on the Mosaic kernels; see `problem.py` for the semantics."""
  if not isinstance(config, RaggedConfig):
    raise TypeError(f"config must be a RaggedConfig, got "
                    f"{type(config).__name__}")
  if bfloat16_split.splits(problem):
    reason = bfloat16_split.why_not(problem)
    if reason:
      raise ValueError(f"{problem} cannot run on the mosaic kernels: {reason}")
    _check_operands(lhs, rhs, group_sizes, row_offset, problem)
    *operands, parts_problem = bfloat16_split.bfloat16_products(
        lhs, rhs, group_sizes, row_offset, problem)
    return ragged_matmul(*operands, problem=parts_problem, config=config,
                         interpret=interpret)
  if not config.fits(problem):  # at the dtype the kernel writes
    raise ValueError(f"config={config} needs {config.smem_bytes(problem)} "
                     "bytes of shared memory, more than an sm_90 block has")
  _check_operands(lhs, rhs, group_sizes, row_offset, problem)
  out_dtype = jnp.dtype(problem.out_dtype)
  if 0 in problem.out_shape or problem.m == 0 or problem.groups == 0:
    # Nothing to sum, or no row in any group: all zeros.
    return jnp.zeros(problem.out_shape, out_dtype)
  if problem.k == 0:  # "rows": empty products, then the activation
    return _rows_without_k(group_sizes, row_offset, problem)
  params = interpret_params(interpret)
  group_sizes = group_sizes.astype(jnp.int32)
  row_offset = row_offset.astype(jnp.int32)
  config.check_mode(problem.mode)
  if problem.mode == "rows" and config.swizzled_staging and (
      configs.staging_swizzle(config.epi_tile_n, out_dtype) is None):
    raise ValueError(
        f"RaggedConfig.swizzled_staging needs a staged row of "
        f"epi_tile_n={config.epi_tile_n} {out_dtype.name} elements to be "
        f"128 bytes (one swizzle span)")
  if problem.mode == "contracting":
    from pallas_gemm.ragged_dot import mosaic_contracting
    return mosaic_contracting.contracting_matmul(
        lhs, rhs, group_sizes, row_offset, problem=problem, config=config,
        params=params)
  return _rows_matmul(lhs, rhs, group_sizes, row_offset, problem=problem,
                      config=config, params=params)
