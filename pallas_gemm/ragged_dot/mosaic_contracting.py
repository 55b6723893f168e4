"""Mode "contracting" of the Mosaic grouped GEMM: the expert-weight gradient.

  out[g] = lhs[rows of g].T @ dout[rows of g]        (groups, k, n)

Output tiles are (group, K strip, N strip) triples, a static count, walked
group by group and in a banded snake inside each group (or, with
`RaggedConfig.interleave_groups`, the group index fastest). A tile's reduction
runs over its group's rows in `tile_k`-row chunks aligned to `tile_k`: the
first and last chunk of a group may hold rows of its neighbours, which the
consumers zero in shared memory before the wgmma reads the chunk (each
consumer masks only the K columns it multiplies, so the two never write the
same bytes). The number of chunks is runtime data, read from a table
computed on the device (`mosaic_schedule.contracting_groups`); a group with
no rows runs no chunk and stores zeros. The pipeline is the one of
`mosaic.py`: producer warpgroup + two consumers over a ring whose step
counter runs on across tiles.

With `RaggedConfig.piece_rows`, each group's rows are first cut into
pieces (`mosaic_schedule.contracting_pieces`), which the kernel runs as
groups of their own: a group holding most tokens then has as many tiles
as it has pieces times its output tiles, enough to keep every SM busy.
`add_pieces` adds each cut group's pieces afterwards, in float32.

With `RaggedConfig.ping_pong`, the consumers take turns at whole tiles
(the CTA's first, third, ... tile to the first consumer) instead of each
computing half of every tile: the ring holds one set of `loaded` barriers
per consumer (`warp_specialised.Ring`), and each consumer walks every tile
of its CTA to keep the ring's step count, computing only its own. A
consumer's output store then overlaps the other's wgmmas.

With `RaggedConfig.largest_first`, the table's groups (or pieces) are
sorted by row count, largest first, with the output group as a fifth row,
and the tiles are dealt to the CTAs in a snake (`mosaic_schedule.
snake_deal`), so that the long tiles of large groups start first and spread
evenly over the CTAs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_gemm.mosaic_backend import tma
from pallas_gemm.mosaic_backend.configs import Dim
from pallas_gemm.mosaic_backend.warp_specialised import (
    Ring, call_kernel, consume_ring, for_each_tile, index, out_staging_smem,
    ring_smem, run_producer, run_warpgroups, tile_coordinates,
    warp_specialised_kernel)
from pallas_gemm.problem import cdiv
from pallas_gemm.ragged_dot import mosaic_schedule as schedule
from pallas_gemm.ragged_dot.configs import NUM_CONSUMERS, RaggedConfig
from pallas_gemm.ragged_dot.mosaic import (num_ctas_for, output_slot,
                                          ping_pong_turn, tile_steps)
from pallas_gemm.ragged_dot.problem import RaggedProblem


def _contracting_body(groups_gmem, lhs_gmem, dout_gmem, out_gmem,
                      pieces_gmem=None, *, config: RaggedConfig,
                      k_tiles: int, n_tiles: int, groups: int):
  """Walks `groups` output groups; with `pieces_gmem` (RaggedConfig.
  piece_rows) the first out_gmem.shape[0] of them are the groups' first
  pieces, stored to out_gmem, and the rest their further pieces, stored to
  pieces_gmem."""
  tile_m, tile_n, chunk = config.tile_m, config.tile_n, config.tile_k
  cta_m = config.cta_tile("contracting")[0]
  epi_n, stages, out_slots = config.epi_tile_n, config.stages, config.out_slots
  in_dtype, out_dtype = lhs_gmem.dtype, out_gmem.dtype
  num_tiles = index(groups * k_tiles * n_tiles)
  stores = tile_n // epi_n

  def tile_info(linear):
    if config.largest_first:
      linear = schedule.snake_deal(linear, index(lax.axis_size("sm")),
                                   num_tiles)
    if config.interleave_groups:
      g = lax.rem(linear, index(groups))
      _, k_idx, n_idx = tile_coordinates(
          lax.div(linear, index(groups)), m_tiles=k_tiles, n_tiles=n_tiles,
          band_dim=Dim.M, band=config.grid_band)
    else:
      g, k_idx, n_idx = tile_coordinates(linear, m_tiles=k_tiles,
                                         n_tiles=n_tiles, band_dim=Dim.M,
                                         band=config.grid_band)
    entry = schedule.read_entry(groups_gmem, g)
    row_lo, row_hi, first_chunk, steps = entry[:4]
    if config.largest_first:  # columns sorted; the output group comes last
      g = entry[4]
    return g, k_idx, n_idx, row_lo, row_hi, first_chunk, steps

  def store_piece(staged, g, rows, cols):
    first_pieces = out_gmem.shape[0]

    @pl.when(g < first_pieces)
    def _first_piece():
      plgpu.copy_smem_to_gmem(staged, out_gmem.at[g, rows, cols])

    @pl.when(g >= first_pieces)
    def _further_piece():
      plgpu.copy_smem_to_gmem(staged,
                              pieces_gmem.at[g - first_pieces, rows, cols])

  def scoped(lhs_smem, dout_smem, stage_loaded, stage_consumed, out_smem):
    ring = Ring(stages, stage_loaded, stage_consumed)

    def producer_tile(linear):
      _, k_idx, n_idx, _, _, first_chunk, steps = tile_info(linear)
      owner = ping_pong_turn(linear)[0] if config.ping_pong else 0
      return (pl.ds(k_idx * cta_m, cta_m), pl.ds(n_idx * tile_n, tile_n),
              first_chunk, owner, steps)

    def load_step(tile, c, slot):
      k_cols, n_cols, first_chunk, owner, _ = tile
      rows = pl.ds((first_chunk + c) * chunk, chunk)
      loaded = ring._replace(owner=owner).loaded_barrier(slot)
      plgpu.copy_gmem_to_smem(lhs_gmem.at[rows, k_cols],
                              lhs_smem.at[slot], loaded)
      plgpu.copy_gmem_to_smem(dout_gmem.at[rows, n_cols],
                              dout_smem.at[slot], loaded)

    def producer():
      run_producer(ring, num_tiles=num_tiles, steps=tile_steps,
                   coords=producer_tile, load_step=load_step)

    def consumer(wg):
      wg_rows = 0 if config.ping_pong else wg * tile_m
      my_ring = ring._replace(owner=wg) if config.ping_pong else ring

      def tile(linear, first_step):
        if not config.ping_pong:
          return compute_and_store(linear, first_step)
        steps = tile_info(linear)[-1]

        @pl.when(ping_pong_turn(linear)[0] == wg)
        def _my_turn():
          compute_and_store(linear, first_step)
        return first_step + steps

      def compute_and_store(linear, first_step):
        g, k_idx, n_idx, row_lo, row_hi, first_chunk, steps = tile_info(
            linear)

        def mma_step(at, acc_ref):
          slot, c = at.slot, at.kk
          lhs_part = lhs_smem.at[slot, :, pl.ds(wg_rows, tile_m)]
          chunk_row0 = (first_chunk + c) * chunk

          @pl.when((chunk_row0 < row_lo) | (chunk_row0 + chunk > row_hi))
          def _mask_other_groups():
            values = plgpu.load(lhs_part, layout=plgpu.Layout.WGMMA)
            rows = chunk_row0 + plgpu.broadcasted_iota(
                jnp.int32, (chunk, tile_m), 0, layout=plgpu.Layout.WGMMA)
            keep = (rows >= row_lo) & (rows < row_hi)
            lhs_part[...] = jnp.where(keep, values, jnp.zeros_like(values))
            plgpu.commit_smem()  # make the writes visible to the wgmma

          plgpu.wgmma(acc_ref, lhs_part.T, dout_smem.at[slot])

        (acc,) = consume_ring(
            my_ring, mma_step, first_step=first_step, steps=steps,
            accumulators=[plgpu.ACC((tile_m, tile_n), jnp.float32)])
        rows = pl.ds(k_idx * cta_m + wg_rows, tile_m)
        for ej in range(stores):
          slot = output_slot(linear, ej, stores, out_slots,
                             ping_pong=config.ping_pong)
          plgpu.wait_smem_to_gmem(out_slots - 1, wait_read_only=True)
          out_smem[wg, slot] = acc[:, ej * epi_n:(ej + 1) * epi_n].astype(
              out_dtype)
          plgpu.commit_smem()
          cols = pl.ds(n_idx * tile_n + ej * epi_n, epi_n)
          if pieces_gmem is None:
            plgpu.copy_smem_to_gmem(out_smem.at[wg, slot],
                                    out_gmem.at[g, rows, cols])
          else:
            store_piece(out_smem.at[wg, slot], g, rows, cols)
        return first_step + steps

      for_each_tile(num_tiles, tile, index(0))
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    run_warpgroups(producer, consumer)

  pl.run_scoped(
      scoped,
      **ring_smem(stages, lhs_smem=((chunk, cta_m), in_dtype),
                  dout_smem=((chunk, tile_n), in_dtype),
                  owners=NUM_CONSUMERS if config.ping_pong else 1),
      out_smem=out_staging_smem(out_slots, (tile_m, epi_n), out_dtype),
      collective_axes="wg",
  )


def contracting_matmul(lhs, dout, group_sizes, row_offset, *,
                       problem: RaggedProblem, config: RaggedConfig, params):
  if config.split_rows:
    raise ValueError("RaggedConfig.split_rows is a \"rows\"-mode option: the "
                     "contracting kernel always splits its K strip")
  m, k, n, groups = problem.m, problem.k, problem.n, problem.groups
  tile_n, chunk = config.tile_n, config.tile_k
  cta_m = config.cta_tile("contracting")[0]
  in_dtype = problem.in_dtype
  if config.piece_rows:
    table, extras = schedule.contracting_pieces(
        group_sizes, row_offset, m=m, chunk=chunk,
        piece_rows=config.piece_rows)
  else:
    table = schedule.contracting_groups(group_sizes, row_offset, m=m,
                                        chunk=chunk)
  if config.largest_first:
    table = schedule.largest_first(table)
  # The kernel sees every piece as a group of its own; the pieces beyond
  # the groups' first go to an output of their own, so that adding them
  # updates the groups' output in place.
  pieces = table.shape[1]
  lhs = tma.pad_to_tiling(lhs, tma.tma_tiling(cta_m, in_dtype), (chunk, cta_m))
  dout = tma.pad_to_tiling(dout, tma.tma_tiling(tile_n, in_dtype),
                           (chunk, tile_n))
  k_out = max(cdiv(k, 8) * 8, config.tile_m)
  n_out = cdiv(n, config.epi_tile_n) * config.epi_tile_n
  k_tiles, n_tiles = cdiv(k, cta_m), cdiv(n, tile_n)
  out_type = jax.ShapeDtypeStruct((groups, k_out, n_out),
                                  jnp.dtype(problem.out_dtype))
  if pieces > groups:
    out_type = (out_type, jax.ShapeDtypeStruct((pieces - groups, k_out, n_out),
                                               out_type.dtype))
  kernel = warp_specialised_kernel(
      functools.partial(_contracting_body, config=config, k_tiles=k_tiles,
                        n_tiles=n_tiles, groups=pieces),
      out_type=out_type,
      grid=(min(num_ctas_for(params), pieces * k_tiles * n_tiles),),
      interpret=params)
  out = call_kernel(kernel, [table, lhs, dout], out_type, params)
  if pieces > groups:
    out = add_pieces(*out, extras)
  return out[:, :k, :n] if out.shape[1:] != (k, n) else out


def add_pieces(first, rest, extras):
  """Adds the sums of the pieces beyond each group's first (`rest`,
  described by `extras`, see `mosaic_schedule.contracting_pieces`) to that
  group's first piece (`first[group]`), in float32. Only the groups that
  were cut are read and written again."""
  groups, count = first.shape[0], rest.shape[0]
  owner, first_extra = extras[0], extras[1]
  used = owner >= 0
  # One float32 sum per cut group, at the index of its first extra piece;
  # unused pieces go to an out-of-range segment, which is dropped.
  sums = jax.ops.segment_sum(rest.astype(jnp.float32),
                             jnp.where(used, first_extra, count),
                             num_segments=count)
  leads = used & (first_extra == jnp.arange(count, dtype=jnp.int32))
  target = jnp.where(leads, owner, groups)  # out of range: dropped
  total = first[jnp.minimum(target, groups - 1)].astype(jnp.float32) + sums
  return first.at[target].set(total.astype(first.dtype), mode="drop")
