"""Mode "contracting" of the Mosaic grouped GEMM: the expert-weight gradient.

  out[g] = lhs[rows of g].T @ dout[rows of g]        (groups, k, n)

Output tiles are (group, K strip, N strip) triples, a static count, walked
group by group and in a banded snake inside each group (or, with
`RaggedConfig.interleave_groups`, the group index fastest). A tile's reduction
runs over its group's rows in `tile_k`-row chunks from the group's first
row, rounded down to the 8 rows where a TMA load may start: the first and
last chunk of a group may hold rows of its neighbours, which the consumers
zero in shared memory before the wgmma reads the chunk (each consumer masks
only the K columns it multiplies, so the two never write the same bytes).
The number of chunks is runtime data, read from a table computed on the
device (`mosaic_schedule.contracting_groups`); a group with
no rows runs no chunk and stores zeros. The pipeline is the one of
`mosaic.py`: producer warpgroup + two consumers over a ring whose step
counter runs on across tiles.

With `RaggedConfig.tile_k` = 32, the chunks are 32 rows and the operands'
stages are swizzled by 64 bytes, the widest span at which wgmma takes a
K of 32 with both operands transposed (`configs.
contracting_operand_swizzle`); a chunk holding other groups' rows is
masked through its transpose, since the wgmma register layout tiles 64
rows.

With `RaggedConfig.operand_planes`, each stage of lhs and dout is held as
64-column planes (rows of one swizzle span), each loaded by one TMA copy
and multiplied as its own wgmma operand: 64 x 64 wgmmas, one per (lhs
plane, dout plane) of the consumer's tile. Compiled, a plane is a pair of
views of one buffer (`row_addressed_smem`), so lhs and dout whose row
count is not a whole number of 8-row tiles are read as they are
(`operands_in_place`) rather than padded.

With `RaggedConfig.narrow_last_strip`, the tiles of a last column strip
that holds fewer of the output's columns than tile_n multiply and store
only those (the consumer's main loop has a copy at that width; with
operand_planes only those planes are loaded).

Compiled, the output is allocated at its own column count wherever the
TMA can clip the last strip's stores (`output_columns`); the interpreter
pads it to whole stores and the result is cut out of it.

With `RaggedConfig.piece_rows`, each group's rows are first cut into
pieces (`mosaic_schedule.contracting_pieces`), which the kernel runs as
groups of their own: a group holding most tokens then has as many tiles
as it has pieces times its output tiles, enough to keep every SM busy.
The bound on pieces is static; a piece the routing left empty is neither
computed nor stored. `merge_pieces` adds each cut group's pieces afterwards,
in float32, in place in the output, reading only the pieces in use.

With `RaggedConfig.zeros_by_producer`, the producer warpgroup TMA-stores the
zero tiles of empty groups from one zeroed buffer, and the consumers skip
those tiles.

With `RaggedConfig.zero_drip` as well, the producer stores those zeros
through a cursor of its own over the CTA's tiles, a few boxes after each
load and the rest after its last, rather than when its walk meets them:
a walk that met them before its long tiles would queue every zero store
ahead of the loads, one that met them after would leave them to the end,
and either way the writes and the wgmmas would take turns.

With `RaggedConfig.spread_zero_tiles` (and empty_last, so that the tiles
with rows are the table's first), each CTA visits its round-robin share
with its zero tiles spread evenly between its tiles with rows
(`mosaic_schedule.spread_zero_visits`), two visits at a time with
ping_pong, rather than in table order: where one group holds most tokens,
a consumer stores zero tiles while the other computes a long tile,
instead of the zeros being written before or after the long tiles. With
`RaggedConfig.zero_tiles_evict_first` as well (compiled), a zero tile is
stored as its share of the runs of contiguous output covering the empty
group, from a zeroed staging slot under an L2 evict-first policy
(`bulk_stores.store_zeros`), so that the zeros' lines do not evict the
operands the long tiles read again from L2.

With `RaggedConfig.cluster_columns`, the grid is of 2-CTA clusters: both
CTAs walk the same tiles, each computing one of two neighbouring column
strips, and each multicasts half of the lhs chunk they share into both
CTAs' stage; a stage is released once the consumers of both CTAs are done
with it (a cluster barrier). `RaggedConfig.cluster_rows` pairs the CTAs
along K instead: each computes one of two neighbouring K strips of one
column strip, and they share the dout chunk.

With `RaggedConfig.ping_pong`, the consumers take turns at whole tiles
(the CTA's first, third, ... tile to the first consumer) instead of each
computing half of every tile: the ring holds one set of `loaded` barriers
per consumer (`warp_specialised.Ring`), and each consumer walks every tile
of its CTA to keep the ring's step count, computing only its own. A
consumer's output store then overlaps the other's wgmmas.

With `RaggedConfig.short_tile_lookahead` = L, the producer keeps at most L
ring steps loaded and not yet released while it loads a tile of at most L
steps (a whole short reduction), rather than running a whole ring ahead
into the next tiles; longer tiles use the whole ring.

With `RaggedConfig.claim_tiles`, each CTA's producer claims its tiles
one at a time from a counter in global memory (`mosaic_backend.
tile_claims`) instead of walking a round-robin share, and hands those its
consumers run to them through a queue in shared memory; the consumers'
turns (ping_pong) and staging slots follow the queue's turn numbers. With
`zero_drip` as well (and largest_first or empty_last, so that the empty
groups' tiles are the walk's last), the walk stops at the first entry
without rows, and the producers claim those zero tiles' boxes from a second
counter, a few after each load (`tile_claims.claim_work`). With
clusters as well, each cluster claims its tiles once, its first CTA
passing each to the second through a mailbox in global memory, and the
zero boxes are claimed per CTA of the cluster (each stores its own
strips).

With `RaggedConfig.largest_first`, the table's groups (or pieces) are
sorted by row count, largest first, with the output group as a fifth row,
and the tiles are dealt to the CTAs (with ping_pong: to the CTAs'
consumers) in a snake (`mosaic_schedule.snake_deal`), so that the long
tiles of large groups start first and spread evenly over them; with
claim_tiles, claimed in that order instead. `RaggedConfig.empty_last`
moves only the entries without rows, after the others (no snake deal).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_gemm.mosaic_backend import bulk_stores, tile_claims, tma
from pallas_gemm.mosaic_backend.configs import CLUSTER_CTAS, WGMMA_ROWS, Dim
from pallas_gemm.mosaic_backend.warp_specialised import (
    Ring, SideWork, call_kernel, consume_ring, for_each_tile, index,
    out_staging_smem, ring_smem, run_producer, run_warpgroups,
    tile_coordinates, tiled_transforms, tiles_of_this_cta,
    warp_specialised_kernel)
from pallas_gemm.problem import cdiv
from pallas_gemm.ragged_dot import mosaic_schedule as schedule
from pallas_gemm.ragged_dot.configs import (NUM_CONSUMERS,
                                          SWIZZLE_ELEMS_16BIT,
                                          RaggedConfig,
                                          contracting_operand_swizzle,
                                          planes_read_in_place,
                                          staged_columns)
from pallas_gemm.ragged_dot.mosaic import (num_ctas_for, output_slot,
                                          ping_pong_turn, tile_steps)
from pallas_gemm.ragged_dot.problem import RaggedProblem


def _contracting_body(groups_gmem, lhs_gmem, dout_gmem, *refs,
                      config: RaggedConfig, k_units: int, n_units: int,
                      groups: int, in_place: bool, claims_on_device: bool):
  """Walks `groups` output groups. `in_place` (with operand_planes): lhs
  and dout have any row count (at least a chunk) and are loaded through
  the untiled views of their planes (`operands_in_place`). `refs`: with
  RaggedConfig.zero_drip or spread_zero_tiles,
  first `counts_gmem`, (2,) int32, how many groups are empty and how many
  table entries (groups or pieces) have rows; with
  RaggedConfig.claim_tiles, `counter_gmem`, (tile_claims.counter_words,)
  int32, zero at launch: the tiles' claims and the zero boxes' (claimed
  with atomics where `claims_on_device`), and with clusters the clusters'
  mailboxes; then out_gmem;
  then, with `pieces_gmem` (RaggedConfig.piece_rows), the first
  out_gmem.shape[0] groups are the groups' first pieces, stored to
  out_gmem, and the rest their further pieces, stored to pieces_gmem."""
  counts_gmem = counter_gmem = None
  if counts_entries(config):
    counts_gmem, *refs = refs
  if config.claim_tiles:
    counter_gmem, *refs = refs
  out_gmem, pieces_gmem = (*refs, None)[:2]
  tile_m, tile_n, chunk = config.tile_m, config.tile_n, config.tile_k
  cta_m = config.cta_tile("contracting")[0]
  epi_n, stages, out_slots = config.epi_tile_n, config.stages, config.out_slots
  in_dtype, out_dtype = lhs_gmem.dtype, out_gmem.dtype
  # With cluster_columns a unit is a pair of neighbouring column strips,
  # with cluster_rows a pair of neighbouring K strips, one per CTA of the
  # cluster (both walk the same units in lockstep).
  num_tiles = index(groups * k_units * n_units)
  stores = tile_n // epi_n

  def tile_info(linear):
    if config.spread_zero_tiles:
      linear = spread_zero_tiles(linear)
    if config.snake_deal:
      # With ping_pong a CTA's consecutive slots alternate between its two
      # consumers, which each run their own tiles one after another: the
      # snake then turns after every round of the CTAs' consumers (two
      # rounds of slots), so that the consumer dealt a long tile is dealt a
      # short one next, rather than the same consumer being dealt the long
      # tile of every other round.
      workers = NUM_CONSUMERS if config.ping_pong else 1
      linear = schedule.snake_deal(
          linear, index(lax.axis_size("sm")) * workers, num_tiles)
    if config.interleave_groups:
      g = lax.rem(linear, index(groups))
      _, k_idx, n_idx = tile_coordinates(
          lax.div(linear, index(groups)), m_tiles=k_units, n_tiles=n_units,
          band_dim=Dim.M, band=config.grid_band)
    else:
      g, k_idx, n_idx = tile_coordinates(linear, m_tiles=k_units,
                                         n_tiles=n_units, band_dim=Dim.M,
                                         band=config.grid_band)
    # With an odd strip count the second CTA's last strip lies past the
    # edge: its loads read zeros and its stores are dropped by the TMA.
    if config.cluster_columns:
      n_idx = n_idx * CLUSTER_CTAS + lax.axis_index("cluster")
    if config.cluster_rows:
      k_idx = k_idx * CLUSTER_CTAS + lax.axis_index("cluster")
    entry = schedule.read_entry(groups_gmem, g)
    row_lo, row_hi, first_row, steps = entry[:4]
    if config.reorders_entries:  # the output group comes last
      g = entry[schedule.GROUP_OUTPUT]
    return g, k_idx, n_idx, row_lo, row_hi, first_row, steps

  first_pieces = out_gmem.shape[0]
  # The consumers may skip a tile only where the staging slots alternate
  # within each tile: otherwise the slot depends on the tile's number, and a
  # skipped tile would have two stores in a row use the same slot (then the
  # unused pieces are stored as zeros; zeros_by_producer requires it).
  can_skip = config.slots_divide_stores()
  # With `zeros_by_producer` the producer stores the zero output tiles of
  # empty groups from a zeroed buffer, and the consumers skip those tiles.
  zeros_by_producer = config.zeros_by_producer
  assert can_skip or not zeros_by_producer  # RaggedConfig checks it
  # RaggedConfig.streamed_zeros compiled (the interpreter has no bulk
  # copies with a cache policy, so it stores the boxes, the same zeros).
  streams_zeros = config.streamed_zeros and claims_on_device

  # RaggedConfig.zero_tiles_evict_first compiled (the interpreter has no
  # bulk copies with a cache policy, so it stores the tiles, the same
  # zeros).
  evicts_zero_tiles = config.zero_tiles_evict_first and claims_on_device

  # Whether the consumers skip some tiles: those of pieces beyond a group's
  # first that got no rows (`merge_pieces` never reads them), and with
  # zeros_by_producer the empty groups' zero tiles.
  skips_tiles = can_skip and (zeros_by_producer or pieces_gmem is not None)

  def consumers_run(g, steps):
    """Whether the consumers compute and store this tile (see
    skips_tiles)."""
    empty = steps == 0
    if zeros_by_producer:
      return ~empty
    return ~(empty & (g >= first_pieces))

  def store_piece(staged, g, rows, cols):
    @pl.when(g < first_pieces)
    def _first_piece():
      plgpu.copy_smem_to_gmem(staged, out_gmem.at[g, rows, cols])

    @pl.when(g >= first_pieces)
    def _further_piece():
      plgpu.copy_smem_to_gmem(staged,
                              pieces_gmem.at[g - first_pieces, rows, cols])

  def store_zero_box(zeros_smem, g, k_idx, n_idx, box_row, box_col):
    """The producer's store of box (box_row, box_col) of an empty group's
    output tile, one commit group; never awaited until the end (the buffer
    stays zero)."""
    box_m, box_n = zeros_smem.shape
    plgpu.copy_smem_to_gmem(
        zeros_smem, out_gmem.at[g, pl.ds(k_idx * cta_m + box_row * box_m,
                                          box_m),
                                pl.ds(n_idx * tile_n + box_col * box_n,
                                      box_n)])

  def zero_box_grid(zeros_smem):
    """(boxes, boxes per row) of the zero box in an output tile."""
    box_m, box_n = zeros_smem.shape
    box_cols = tile_n // box_n
    return (cta_m // box_m) * box_cols, box_cols

  def store_zero_box_number(zeros_smem, g, k_idx, n_idx, box):
    """`store_zero_box` of the tile's box number `box` (traced), counted
    row by row."""
    box_cols = index(zero_box_grid(zeros_smem)[1])
    store_zero_box(zeros_smem, g, k_idx, n_idx, lax.div(box, box_cols),
                   lax.rem(box, box_cols))

  def store_zero_tile(zeros_smem, g, k_idx, n_idx):
    """Every box of an empty group's output tile."""
    box_m, box_n = zeros_smem.shape

    @pl.when(g < first_pieces)
    def _empty_group():
      for i in range(cta_m // box_m):
        for j in range(tile_n // box_n):
          store_zero_box(zeros_smem, g, k_idx, n_idx, i, j)

  def claimed_zero_work(zeros_smem, queue):
    """With claim_tiles: the empty groups' zero tiles, the walk's last
    (largest_first or empty_last), claimed box by box on their own counter
    (`tile_claims.claim_work`): RaggedConfig.zero_drip boxes after each
    load, then CLAIMED_ZERO_BOXES_AT_END at a time. With streams_zeros a
    unit is a run of an empty group's contiguous output of the box's bytes
    instead (`bulk_stores.zero_runs`)."""
    tiles_per_entry = index(k_units * n_units)
    first_zero = tiles_with_rows()
    if streams_zeros:
      _, rows, cols = out_gmem.shape
      runs = bulk_stores.zero_runs(rows, cols, out_gmem.dtype.itemsize,
                                   bulk_stores.buffer_bytes(zeros_smem))
      per_entry = index(runs.runs)

      def store_unit(unit):
        g = tile_info(first_zero + lax.div(unit, per_entry)
                      * tiles_per_entry)[0]
        row, col = runs.start(lax.rem(unit, per_entry), rows=rows,
                              cols=cols, minimum=jnp.minimum)
        bulk_stores.store_zeros(
            zeros_smem, out_gmem.at[g, pl.ds(row, runs.run_rows),
                                    pl.ds(col, runs.run_cols)])
    else:
      boxes = index(zero_box_grid(zeros_smem)[0])
      per_entry = tiles_per_entry * boxes

      def store_unit(unit):
        g, k_idx, n_idx = tile_info(first_zero + lax.div(unit, boxes))[:3]
        store_zero_box_number(zeros_smem, g, k_idx, n_idx,
                              lax.rem(unit, boxes))

    return tile_claims.claim_work(
        queue, index(counts_gmem[0]) * per_entry, store_unit,
        per_load=config.zero_drip, at_end=CLAIMED_ZERO_BOXES_AT_END)

  def zero_drip_work(zeros_smem):
    """The producer's cursor over this CTA's zero tiles (RaggedConfig.
    zero_drip): the CTA's tile number i, the next box of it, and the tile's
    (group, K strip, N strip, whether it is a zero tile), read from the
    table once per tile. Each advance visits at most `budget` boxes or
    non-empty tiles; without an empty group the cursor starts past the
    CTA's last tile."""
    boxes = zero_box_grid(zeros_smem)[0]
    cta = index(lax.axis_index("sm"))
    num_ctas = index(lax.axis_size("sm"))
    my_tiles = tiles_of_this_cta(num_tiles)

    def read_tile(i):
      # Past the CTA's last tile the cursor stops; read a valid entry.
      linear = jnp.minimum(cta + i * num_ctas, num_tiles - 1)
      g, k_idx, n_idx, _, _, _, steps = tile_info(linear)
      return g, k_idx, n_idx, (steps == 0) & (g < first_pieces)

    def advance(cursor, budget):
      def more(state):
        i, left = state[0], state[-1]
        return (left > 0) & (i < my_tiles)

      def visit(state):
        i, box, g, k_idx, n_idx, zero, left = state

        @pl.when(zero)
        def _store():
          store_zero_box_number(zeros_smem, g, k_idx, n_idx, box)

        box = jnp.where(zero, box + 1, index(boxes))
        i, box, tile = lax.cond(
            box == boxes,
            lambda: (i + 1, index(0), read_tile(i + 1)),
            lambda: (i, box, (g, k_idx, n_idx, zero)))
        return (i, box, *tile, left - 1)

      state = lax.while_loop(more, visit, (*cursor, budget))
      return state[:-1]

    start = jnp.where(counts_gmem[0] > 0, index(0), my_tiles)
    return SideWork(
        init=(start, index(0), *read_tile(start)),
        after_load=lambda cursor: advance(cursor, index(config.zero_drip)),
        # Every box left, and one visit per non-empty tile.
        finish=lambda cursor: advance(cursor, my_tiles * (boxes + 1)))

  planes = config.operand_planes
  # With operand_planes: 64-column planes of each stage, a consumer's lhs
  # planes starting at plane `wg_rows // PLANE`.
  lhs_planes, dout_planes = cta_m // PLANE, tile_n // PLANE
  # With narrow_last_strip, the columns the last strip's tiles load and
  # compute (tile_n where the output's end fills the strip).
  last_cols = config.last_strip_columns(
      staged_columns(out_gmem.shape[2], config))

  def in_narrow_strip(n_idx):
    """Whether column strip `n_idx` is a narrow last strip (None where the
    last strip is whole)."""
    return n_idx == index(n_units - 1) if last_cols < tile_n else None

  def tiles_with_rows():
    """With zero_drip or spread_zero_tiles: the tiles of the table's
    entries that have rows, the first ones of a walk in largest_first's or
    empty_last's order."""
    return index(counts_gmem[1]) * index(k_units * n_units)

  if config.spread_zero_tiles:
    # This CTA's deal, computed once: the round-robin share and how many of
    # its tiles have rows (the walk's first, in empty_last's order).
    cta = index(lax.axis_index("sm"))
    num_ctas = index(lax.axis_size("sm"))
    spreads, spread_tile = schedule.spread_zero_visits(
        tiles=tiles_of_this_cta(num_tiles),
        with_rows=tiles_of_this_cta(tiles_with_rows()),
        unit=NUM_CONSUMERS if config.ping_pong else 1)

  def spread_zero_tiles(linear):
    """RaggedConfig.spread_zero_tiles: the tile that this CTA's visit
    `linear` (a slot of the round-robin deal) runs, its zero tiles spread
    between its tiles with rows (`schedule.spread_zero_visits`), in units of
    a turn per consumer with ping_pong; a CTA without both kinds of tile
    walks in order. The turns and staging slots still follow the
    visits."""
    return lax.cond(
        spreads,
        lambda: cta + spread_tile(lax.div(index(linear) - cta, num_ctas))
        * num_ctas,
        lambda: index(linear))

  def handed(linear):
    """With claim_tiles: whether the consumers run tile `linear` (all but
    the tiles they would skip)."""
    if not skips_tiles:
      return jnp.bool_(True)
    info = tile_info(linear)
    return consumers_run(info[0], info[-1])

  def scoped(lhs_smem, dout_smem, stage_loaded, stage_consumed, out_smem,
             zeros_smem=None, claimed_smem=None, queue_smem=None,
             tile_ready=None, tile_taken=None):
    ring = Ring(stages, stage_loaded, stage_consumed)
    queue = (tile_claims.TileQueue(counter_gmem, claimed_smem, queue_smem,
                                   tile_ready, tile_taken, claims_on_device,
                                   cluster=config.clustered)
             if config.claim_tiles else None)
    # wgmma reads the planes through their tiled views; in place, the TMA
    # writes them through the untiled ones (the same bytes).
    lhs_smem, lhs_loaded = lhs_smem if in_place else (lhs_smem, lhs_smem)
    dout_smem, dout_loaded = dout_smem if in_place else (dout_smem, dout_smem)

    def producer_tile(linear, turn=None):
      g, k_idx, n_idx, _, _, first_row, steps = tile_info(linear)
      owner = ping_pong_turn(linear, turn)[0] if config.ping_pong else 0
      if zeros_by_producer and not config.zero_drip:
        @pl.when(steps == 0)
        def _zeros():
          store_zero_tile(zeros_smem, g, k_idx, n_idx)
      last_strip = in_narrow_strip(n_idx)
      return (pl.ds(k_idx * cta_m, cta_m), pl.ds(n_idx * tile_n, tile_n),
              last_strip, first_row, owner, steps)

    def load_step(tile, c, slot):
      k_cols, n_cols, last_strip, first_row, owner, _ = tile
      rows = pl.ds(first_row + c * chunk, chunk)
      loaded = ring._replace(owner=owner).loaded_barrier(slot)
      if planes:
        for p in range(lhs_planes):
          plgpu.copy_gmem_to_smem(
              lhs_gmem.at[rows, pl.ds(k_cols.start + p * PLANE, PLANE)],
              lhs_loaded.at[slot, p], loaded)
        for p in range(dout_planes):
          copy = functools.partial(
              plgpu.copy_gmem_to_smem,
              dout_gmem.at[rows, pl.ds(n_cols.start + p * PLANE, PLANE)],
              dout_loaded.at[slot, p], loaded)
          if last_strip is None or p * PLANE < last_cols:
            copy()
            continue
          # A plane the narrow last strip does not multiply: not loaded,
          # its arrival still counted.
          pl.when(last_strip)(lambda: plgpu.barrier_arrive(loaded))
          pl.when(~last_strip)(copy)
        return
      # A clustered pair's shared operand: each CTA loads half of it into
      # both CTAs' stages.
      plgpu.copy_gmem_to_smem(
          lhs_gmem.at[rows, k_cols], lhs_smem.at[slot], loaded,
          collective_axes="cluster" if config.cluster_columns else None)
      # The whole box also for a narrow last strip: a narrower one would
      # land on columns of the stage's tiles that are not contiguous in
      # shared memory, which a TMA copy cannot write (the planes are); the
      # columns past the output read as zeros.
      plgpu.copy_gmem_to_smem(
          dout_gmem.at[rows, n_cols], dout_smem.at[slot], loaded,
          collective_axes="cluster" if config.cluster_rows else None)

    def producer():
      side_work = None
      if zeros_by_producer:
        zeros_smem[...] = jnp.zeros(zeros_smem.shape, zeros_smem.dtype)
        plgpu.commit_smem()  # visible to the TMA stores that read it
        if config.zero_drip:
          side_work = (claimed_zero_work(zeros_smem, queue)
                       if queue is not None
                       else zero_drip_work(zeros_smem))
      lookahead = None
      if config.short_tile_lookahead:
        short = config.short_tile_lookahead
        # A tile of at most `short` steps keeps at most that many in flight;
        # a longer one, the whole ring.
        lookahead = lambda tile: jnp.where(
            tile_steps(tile) <= short, index(short), index(stages))
      walk = None
      if queue is not None:
        # With the zeros claimed apart, the walk ends at the first entry
        # without rows (largest_first and empty_last put all such entries
        # last).
        walked = tiles_with_rows() if config.zero_drip else num_tiles
        walk = lambda body, carry: tile_claims.producer_walk(
            queue, walked, body, carry, handed=handed)
      run_producer(ring, num_tiles=num_tiles, steps=tile_steps,
                   coords=producer_tile, load_step=load_step,
                   side_work=side_work, lookahead=lookahead, walk=walk)
      if zeros_by_producer:
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        if streams_zeros:
          bulk_stores.await_zero_stores(zeros_smem)

    def consumer(wg):
      wg_rows = 0 if config.ping_pong else wg * tile_m
      my_ring = ring._replace(owner=wg) if config.ping_pong else ring

      def run_tile(info, linear, turn, first_step, runs):
        """compute_and_store where `runs` (None: always), at the last
        column strip's own width where that is narrower: each width its
        own copy of the main loop."""
        def at_width(width, when):
          body = functools.partial(compute_and_store, info, linear, turn,
                                   first_step, width=width)
          if when is None:
            body()
          else:
            pl.when(when)(body)

        last = in_narrow_strip(info[2])
        if last is None:
          at_width(tile_n, runs)
          return
        for width, strip in ((last_cols, last), (tile_n, ~last)):
          at_width(width, strip if runs is None else runs & strip)

      def tile(linear, turn, first_step):
        # The tile's table entry, read once for both the decision and the
        # work.
        info = tile_info(linear)
        steps = info[-1]
        runs = None
        if config.ping_pong:
          runs = ping_pong_turn(linear, turn)[0] == wg
        if skips_tiles and queue is None:  # a claimed tile is one to run
          kept = consumers_run(info[0], steps)
          runs = kept if runs is None else runs & kept
        if evicts_zero_tiles:
          zero = (steps == 0) & (info[0] < first_pieces)
          pl.when(zero if runs is None else runs & zero)(
              lambda: store_zero_runs(info, linear, turn))
          runs = ~zero if runs is None else runs & ~zero

        run_tile(info, linear, turn, first_step, runs)
        return first_step + steps

      def store_zero_runs(info, linear, turn):
        """RaggedConfig.zero_tiles_evict_first: an empty group's zero tile
        stored as its share of the runs of contiguous output that cover the
        group's slab (`bulk_stores.zero_runs`, each at most a staging
        slot's bytes), from a zeroed staging slot under an L2 evict-first
        policy, so that the zeros do not evict the long tiles' operands.
        The tile's runs are split between the consumers that share it; its
        stores past the first are empty bulk groups, so that the staging
        slots keep their order."""
        g, k_idx, n_idx = info[:3]
        _, rows, cols = out_gmem.shape
        slot = output_slot(linear, 0, stores, out_slots,
                           ping_pong=config.ping_pong, turn=turn)
        staged = out_smem.at[wg, slot]
        plgpu.wait_smem_to_gmem(out_slots - 1, wait_read_only=True)
        # In the accumulators' register layout, the one the slot's tiled
        # (and swizzled) layout is stored from.
        staged[...] = plgpu.layout_cast(
            jnp.zeros(staged.shape, staged.dtype), plgpu.Layout.WGMMA)
        plgpu.commit_smem()  # visible to the bulk copies that read it
        runs = bulk_stores.zero_runs(rows, cols, out_gmem.dtype.itemsize,
                                     bulk_stores.buffer_bytes(staged))
        per_tile = cdiv(runs.runs, k_units * n_units)
        first = (k_idx * index(n_units) + n_idx) * index(per_tile)
        count = jnp.clip(index(runs.runs) - first, 0, per_tile)
        sharers, part = ((1, 0) if config.ping_pong
                         else (NUM_CONSUMERS, wg))

        def store_run(i, carry):
          row, col = runs.start(first + i * sharers + part, rows=rows,
                                cols=cols, minimum=jnp.minimum)
          bulk_stores.store_zeros(
              staged, out_gmem.at[g, pl.ds(row, runs.run_rows),
                                  pl.ds(col, runs.run_cols)],
              smem_transforms=tiled_transforms(epi_n, out_dtype))
          return carry

        lax.fori_loop(index(0),
                      lax.div(count - part + sharers - 1, index(sharers)),
                      store_run, None)
        for _ in range(1, stores):
          plgpu.commit_smem_to_gmem_group()  # keep the slots' order

      def compute_and_store(info, linear, turn, first_step, *, width):
        """The tile's first `width` columns (tile_n, or the last strip's
        own), multiplied and stored; the stores past them are empty bulk
        groups, so that the staging slots keep their order."""
        g, k_idx, n_idx, row_lo, row_hi, first_row, steps = info
        col_planes = width // PLANE

        def lhs_parts(slot):
          """The consumer's lhs in the stage: one (chunk, tile_m) part, or
          with operand_planes its (chunk, 64) planes."""
          if planes:
            return [lhs_smem.at[slot, wg_rows // PLANE + i]
                    for i in range(tile_m // PLANE)]
          return [lhs_smem.at[slot, :, pl.ds(wg_rows, tile_m)]]

        def mma_step(at, *acc_refs):
          slot, c = at.slot, at.kk
          parts = lhs_parts(slot)
          chunk_row0 = first_row + c * chunk

          @pl.when((chunk_row0 < row_lo) | (chunk_row0 + chunk > row_hi))
          def _mask_other_groups():
            for part in parts:
              # The wgmma register layout tiles 64 rows: a 32-row chunk is
              # masked through its transpose, whose rows are the columns.
              view, token_axis = ((part.T, 1) if chunk < WGMMA_ROWS
                                  else (part, 0))
              values = plgpu.load(view, layout=plgpu.Layout.WGMMA)
              rows = chunk_row0 + plgpu.broadcasted_iota(
                  jnp.int32, view.shape, token_axis,
                  layout=plgpu.Layout.WGMMA)
              keep = (rows >= row_lo) & (rows < row_hi)
              view[...] = jnp.where(keep, values, jnp.zeros_like(values))
            plgpu.commit_smem()  # make the writes visible to the wgmma

          if not planes:
            dout = dout_smem.at[slot]
            if width < tile_n:
              dout = dout.at[:, pl.ds(0, width)]
            plgpu.wgmma(acc_refs[0], parts[0].T, dout)
            return
          for i, part in enumerate(parts):
            for j in range(col_planes):
              plgpu.wgmma(acc_refs[i * col_planes + j], part.T,
                          dout_smem.at[slot, j])

        if planes:
          blocks = (tile_m // PLANE) * col_planes
          accs = consume_ring(
              my_ring, mma_step, first_step=first_step, steps=steps,
              accumulators=[plgpu.ACC((PLANE, PLANE), jnp.float32)] * blocks,
              in_flight=blocks)
        else:
          accs = consume_ring(
              my_ring, mma_step, first_step=first_step, steps=steps,
              accumulators=[plgpu.ACC((tile_m, width), jnp.float32)])

        def stage_output(slot, ej):
          """Columns [ej * epi_n, (ej + 1) * epi_n) of the consumer's tile
          into its staging slot."""
          if not planes:
            out_smem[wg, slot] = accs[0][:, ej * epi_n:(ej + 1) * epi_n
                                         ].astype(out_dtype)
            return
          for i in range(tile_m // PLANE):
            for jj in range(epi_n // PLANE):
              j = ej * (epi_n // PLANE) + jj
              out_smem[wg, slot, pl.ds(i * PLANE, PLANE),
                       pl.ds(jj * PLANE, PLANE)] = (
                           accs[i * col_planes + j].astype(out_dtype))

        rows = pl.ds(k_idx * cta_m + wg_rows, tile_m)
        for ej in range(stores):
          if ej * epi_n >= width:
            plgpu.commit_smem_to_gmem_group()  # keep the slots' order
            continue
          slot = output_slot(linear, ej, stores, out_slots,
                             ping_pong=config.ping_pong, turn=turn)
          plgpu.wait_smem_to_gmem(out_slots - 1, wait_read_only=True)
          stage_output(slot, ej)
          plgpu.commit_smem()
          cols = pl.ds(n_idx * tile_n + ej * epi_n, epi_n)
          if pieces_gmem is None:
            plgpu.copy_smem_to_gmem(out_smem.at[wg, slot],
                                    out_gmem.at[g, rows, cols])
          else:
            store_piece(out_smem.at[wg, slot], g, rows, cols)

      if queue is None:
        for_each_tile(num_tiles, lambda linear, first_step: tile(
            linear, None, first_step), index(0))
      else:
        tile_claims.consumer_walk(queue, tile, index(0))
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    run_warpgroups(producer, consumer)

  if planes:
    blocks = dict(lhs_smem=((lhs_planes, chunk, PLANE), in_dtype),
                  dout_smem=((dout_planes, chunk, PLANE), in_dtype))
  else:
    blocks = dict(lhs_smem=((chunk, cta_m), in_dtype),
                  dout_smem=((chunk, tile_n), in_dtype))
  pl.run_scoped(
      scoped,
      **ring_smem(stages, **blocks,
                  loads=lhs_planes + dout_planes if planes else None,
                  row_addressed=tuple(blocks) if in_place else (),
                  swizzle=contracting_operand_swizzle(config, in_dtype),
                  owners=NUM_CONSUMERS if config.ping_pong else 1,
                  cluster_axes=("cluster",) if config.clustered else None),
      out_smem=out_staging_smem(out_slots, (tile_m, epi_n), out_dtype),
      **({"zeros_smem": plgpu.SMEM(config.zero_box(out_dtype), out_dtype)}
         if zeros_by_producer else {}),
      **(tile_claims.queue_smem(stages) if config.claim_tiles else {}),
      collective_axes="wg",
  )


#: Columns of one `RaggedConfig.operand_planes` plane: a 128-byte swizzle
#: span of 16-bit elements, so that a plane's tiled layout is plain rows.
PLANE = SWIZZLE_ELEMS_16BIT


def operands_in_place(config: RaggedConfig, problem: RaggedProblem,
                      params) -> bool:
  """Whether the compiled kernel reads lhs and dout as they are, through
  the untiled views of `operand_planes`' planes, where they would
  otherwise be padded to whole 8-row tiles (each pad a full copy of an
  operand; `configs.planes_read_in_place`). The interpreter keeps a
  `plgpu.RefUnion`'s views apart, so there the operands are padded and
  the planes loaded through their tiled views."""
  return (params is None and config.operand_planes
          and planes_read_in_place(config, problem))


def contracting_matmul(lhs, dout, group_sizes, row_offset, *,
                       problem: RaggedProblem, config: RaggedConfig, params):
  m, k, n, groups = problem.m, problem.k, problem.n, problem.groups
  tile_n, chunk = config.tile_n, config.tile_k
  cta_m = config.cta_tile("contracting")[0]
  in_dtype = problem.in_dtype
  # A chunk's load starts on a whole row tile of both operands' swizzled
  # layouts.
  row_align = max(tma.tma_tiling(cta_m, in_dtype)[0],
                  tma.tma_tiling(tile_n, in_dtype)[0])
  if config.piece_rows:
    table, extras = schedule.contracting_pieces(
        group_sizes, row_offset, m=m, chunk=chunk, row_align=row_align,
        piece_rows=config.piece_rows,
        cut_groups_first=config.cut_groups_first)
  else:
    table = schedule.contracting_groups(group_sizes, row_offset, m=m,
                                        chunk=chunk, row_align=row_align)
  # With zero_drip or spread_zero_tiles the kernel also reads how many
  # groups are empty and how many entries have rows.
  entry_counts = ([schedule.entry_counts(table, groups)]
                  if counts_entries(config) else [])
  if config.largest_first:
    table = schedule.largest_first(table)
  elif config.empty_last:
    table = schedule.empty_last(table)
  # The kernel sees every piece as a group of its own; the pieces beyond
  # the groups' first go to an output of their own, so that adding them
  # updates the groups' output in place.
  pieces = table.shape[1]
  if config.operand_planes and jnp.dtype(in_dtype).itemsize != 2:
    raise ValueError(f"RaggedConfig.operand_planes needs 16-bit inputs "
                     f"(a {PLANE}-column plane is one 128-byte swizzle "
                     f"span), got {in_dtype}")
  in_place = operands_in_place(config, problem, params)
  if not in_place:
    lhs = tma.pad_to_tiling(lhs, tma.tma_tiling(cta_m, in_dtype),
                            (chunk, cta_m))
    dout = tma.pad_to_tiling(dout, tma.tma_tiling(tile_n, in_dtype),
                             (chunk, tile_n))
  k_out = max(cdiv(k, 8) * 8, config.tile_m)
  n_out = output_columns(n, config, problem.out_dtype, compiled=params is None)
  # Units of the walk: K and N strips, or with clusters pairs of them
  # along the shared operand's other dimension.
  cluster_size = CLUSTER_CTAS if config.clustered else 1
  k_units = cdiv(cdiv(k, cta_m), cluster_size if config.cluster_rows else 1)
  n_units = cdiv(cdiv(n, tile_n),
                 cluster_size if config.cluster_columns else 1)
  out_type = jax.ShapeDtypeStruct((groups, k_out, n_out),
                                  jnp.dtype(problem.out_dtype))
  if pieces > groups:
    out_type = (out_type, jax.ShapeDtypeStruct((pieces - groups, k_out, n_out),
                                               out_type.dtype))
  grid = max(1, min(num_ctas_for(params) // cluster_size,
                    pieces * k_units * n_units))
  kernel = warp_specialised_kernel(
      functools.partial(_contracting_body, config=config, k_units=k_units,
                        n_units=n_units, groups=pieces, in_place=in_place,
                        claims_on_device=params is None),
      out_type=out_type,
      grid=(grid,),
      interpret=params,
      **(dict(cluster=(cluster_size,), cluster_names=("cluster",))
         if config.clustered else {}))
  if config.claim_tiles:
    launch = kernel

    def kernel(*operands):
      # The claims' counters (and the clusters' mailboxes): a fresh zero
      # for every call.
      words = tile_claims.counter_words(grid if config.clustered else 0)
      return launch(*operands, jax.new_ref(jnp.zeros((words,), jnp.int32)))
  out = call_kernel(kernel, [table, lhs, dout, *entry_counts], out_type,
                    params)
  if pieces > groups:
    out = merge_pieces(*out, extras, params)
  # Compiled, rows of n that are not whole 16-byte units are cut by the
  # dense kernels' copy: XLA's slice of misaligned rows runs far below the
  # bandwidth.
  return tma.unpad_output(out, k, n, on_gpu=params is None)


def counts_entries(config: RaggedConfig) -> bool:
  """Whether the weight-gradient kernel reads its table's entry counts
  (`_contracting_body`'s `counts_gmem`)."""
  return bool(config.zero_drip) or config.spread_zero_tiles


def output_columns(n: int, config: RaggedConfig, out_dtype, *,
                   compiled: bool) -> int:
  """Columns of the weight gradient's output as the kernel allocates it.
  Compiled, `n` itself where the TMA can store the last strip's boxes
  clipped at the edge: whole 128-byte swizzle spans of the output (the
  staging tiles' columns) and no box wider than the array (one such came
  back wrong on the H200, `tma.pad_to_tiling`). Otherwise `n` rounded up to
  whole staged stores, which the result is then cut out of (a copy of the
  whole output: with the short-reduction tile's 256-column stores, 1408
  columns would be stored as 1536). The interpreter clamps a slice that
  reaches past the array instead of clipping it, so it always pads."""
  if (compiled and n >= config.tile_n
      and n % tma.swizzle_elems(out_dtype) == 0):
    return n
  if not config.narrow_last_strip:
    # Every strip's tiles store all tile_n columns: allocated narrower than
    # a whole last strip, the weight gradient came back wrong on the H200
    # (every group, at 24 columns of a 128-column tile), so the last strip
    # is allocated whole and cut off with the rest.
    return cdiv(n, config.tile_n) * config.tile_n
  return staged_columns(n, config)


#: Zero boxes (`RaggedConfig.zero_box`) a claim takes once a producer's
#: tiles are walked (`RaggedConfig.claim_tiles` with `zero_drip`): only
#: zeros are left then, so fewer, larger claims.
CLAIMED_ZERO_BOXES_AT_END = 64

#: The output tile (rows, columns) of one `merge_pieces` CTA, and how many
#: of its loads (the group's first piece, then the others) are in flight at
#: once: a group's pieces are added one after another, so each CTA keeps
#: several loads going rather than waiting out one at a time, and smaller
#: tiles put more CTAs on a small output.
MERGE_TILE = (64, 128)
MERGE_LOADS_IN_FLIGHT = 4


def _merge_body(extras_gmem, rest_gmem, out_gmem, *, tile):
  tile_rows, tile_cols = tile
  depth = MERGE_LOADS_IN_FLIGHT

  def scoped(tiles_smem, landed):
    x, k_idx, n_idx = (lax.axis_index(axis) for axis in ("x", "k", "n"))
    owner = extras_gmem[schedule.EXTRA_GROUP, x]
    leads = extras_gmem[schedule.EXTRA_FIRST, x] == x
    count = extras_gmem[schedule.EXTRA_COUNT, x]

    @pl.when((owner >= 0) & leads)
    def _merge():
      rows = pl.ds(k_idx * tile_rows, tile_rows)
      cols = pl.ds(n_idx * tile_cols, tile_cols)

      def start(j):
        """Starts load j into slot j % depth: the group's output (its first
        piece's sum) for j = 0, its j-th further piece after."""
        slot = lax.rem(j, depth)

        @pl.when(j == 0)
        def _first():
          plgpu.copy_gmem_to_smem(out_gmem.at[owner, rows, cols],
                                  tiles_smem.at[slot], landed.at[slot])

        @pl.when(j > 0)
        def _further():
          plgpu.copy_gmem_to_smem(rest_gmem.at[x + j - 1, rows, cols],
                                  tiles_smem.at[slot], landed.at[slot])

      for j in range(depth):
        pl.when(j <= count)(functools.partial(start, jnp.int32(j)))

      def add(j, acc):
        slot = lax.rem(j, depth)
        plgpu.barrier_wait(landed.at[slot])
        values = tiles_smem[slot].astype(jnp.float32)
        # Every thread's read ends before a TMA load overwrites the slot.
        plgpu.commit_smem()
        pl.when(j + depth <= count)(functools.partial(start, j + depth))
        return acc + values

      total = lax.fori_loop(0, count + 1, add,
                            jnp.zeros(tile, jnp.float32))
      tiles_smem[0] = total.astype(tiles_smem.dtype)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(tiles_smem.at[0],
                              out_gmem.at[owner, rows, cols])
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  pl.run_scoped(scoped, plgpu.SMEM((depth, *tile), out_gmem.dtype),
                plgpu.Barrier(num_arrivals=1, num_barriers=depth))


def merge_tile(k_out: int, n_out: int) -> tuple[int, int]:
  """`merge_pieces`' output tile on a (groups, k_out, n_out) output: at most
  MERGE_TILE, with rows dividing k_out (a multiple of 8), so that no tile
  reaches past a group's K rows. On the H200 a 64-row tile over a group's
  last rows (K of 312, 64 columns: the whole output's width) added rows of
  the next group's output. Columns stay up to MERGE_TILE's: a tile past
  the last column is clipped (columns of 136 were merged right), and
  narrower tiles fail Mosaic's layout inference (8 x 8)."""
  return (math.gcd(k_out, MERGE_TILE[0]), min(MERGE_TILE[1], n_out))


def merge_pieces(first, rest, extras, params):
  """Adds the sums of the pieces beyond each cut group's first (`rest`,
  described by `extras`, see `mosaic_schedule.contracting_pieces`) to that
  group's output in `first`, in float32, in place (`first`'s buffer is the
  result's). One CTA per (piece beyond a first, output tile); only those of
  a group's first such piece work, so the cost follows the pieces the
  routing cut, not the static bound on them, and no unused piece is read."""
  _, k_out, n_out = first.shape
  tile = merge_tile(k_out, n_out)
  kernel = plgpu.kernel(
      functools.partial(_merge_body, tile=tile), out_type=(),
      grid=(rest.shape[0], cdiv(k_out, tile[0]), cdiv(n_out, tile[1])),
      grid_names=("x", "k", "n"), interpret=params)

  def in_place(extras, rest, first):
    out = jax.new_ref(first)
    kernel(extras, rest, out)
    return jax.freeze(out)

  return call_kernel(in_place, [extras, rest, first],
                     jax.ShapeDtypeStruct(first.shape, first.dtype), params)
