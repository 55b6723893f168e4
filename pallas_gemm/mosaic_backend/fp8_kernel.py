"""The kernel body of `mosaic/fp8` (the design is in `mosaic_backend/fp8.py`):
the producer warpgroup's TMA ring, the consumers' wgmma main loop (whole-K
or promoted per K block), the dequantizing epilogue and the TMA store.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_gemm.mosaic_backend.configs import Dim, MosaicConfig
from pallas_gemm.mosaic_backend.fp8_config import (alternate_of,
                                                   cluster_dim_of,
                                                   cluster_units,
                                                   column_factor_is_uniform,
                                                   pingpong_of,
                                                   promote_group_of,
                                                   stagger_of)
from pallas_gemm.mosaic_backend.fp8_operands import scaling_kind
from pallas_gemm.mosaic_backend.warp_specialised import (
    NUM_CONSUMERS, Ring, consume_ring, consumer_offsets, epilogue_smem, index,
    ring_smem, run_producer, run_warpgroups, step_slices, store_epilogue,
    tile_coordinates)
from pallas_gemm.problem import GemmProblem


def kernel_body(*refs, problem: GemmProblem, config: MosaicConfig,
                 k_iters: int, m_tiles: int, n_tiles: int):
  kind = scaling_kind(problem)
  has_c, has_bias = problem.epilogue.has_c, problem.epilogue.has_bias
  refs = list(refs)
  a_gmem, b_gmem = refs.pop(0), refs.pop(0)
  c_gmem = refs.pop(0) if has_c else None
  bias_gmem = refs.pop(0) if has_bias else None
  a_sc_gmem = b_sc_gmem = None
  a_vector = b_vector = False  # epilogue scales staged through smem
  if kind == "per_k":
    a_sc_gmem, b_sc_gmem = refs.pop(0), refs.pop(0)
  elif kind == "epilogue":
    if problem.a_scale_mode != "none":
      a_sc_gmem = refs.pop(0)
    if problem.b_scale_mode != "none":
      b_sc_gmem = refs.pop(0)
    a_vector = problem.a_scale_mode == "row"
    b_vector = problem.b_scale_mode == "col"
  (out_gmem,) = refs

  tile_m, tile_n, tile_k = config.tile_m, config.tile_n, config.tile_k
  cta_m, cta_n = config.cta_tile_m, config.cta_tile_n
  stages = config.max_concurrent_steps
  cluster_dim = cluster_dim_of(config)
  pingpong = pingpong_of(config)
  m_units, n_units = cluster_units(config, m_tiles, n_tiles)
  num_tiles = problem.batch * m_units * n_units
  # The operand both CTAs of a cluster read, multicast by the TMA.
  shared_operand = {None: None, Dim.M: "b", Dim.N: "a"}[cluster_dim]
  per_k = kind == "per_k"
  alternate = per_k and alternate_of(config)
  stagger = per_k and stagger_of(config)
  group = promote_group_of(config)
  uniform_columns = per_k and column_factor_is_uniform(problem, config)
  loads_per_stage = 4 if per_k else 2

  def coords(linear):
    batch_idx, m_idx, n_idx = tile_coordinates(
        linear, m_tiles=m_units, n_tiles=n_units, band_dim=config.band_dim,
        band=config.grid_band)
    # A 2-CTA cluster owns two neighbouring CTA tiles along cluster_dim; with
    # an odd count the second may lie past the edge: its loads read zeros
    # and its stores are dropped by the TMA.
    if cluster_dim == Dim.M:
      m_idx = m_idx * 2 + lax.axis_index("cluster")
    elif cluster_dim == Dim.N:
      n_idx = n_idx * 2 + lax.axis_index("cluster")
    return batch_idx, m_idx, n_idx

  def scoped(a_smem, b_smem, stage_loaded, stage_consumed, out_smem, c_smem,
             c_loaded, bias_smem, bias_loaded, a_sc_smem, b_sc_smem,
             sc_loaded, turn):
    ring = Ring(stages, stage_loaded, stage_consumed)

    def load_step(tile, kk, slot):
      batch_idx, m_slice, n_slice, k_slice = step_slices(config, tile, kk)
      barrier = stage_loaded.at[slot]
      plgpu.copy_gmem_to_smem(
          a_gmem.at[batch_idx, m_slice, k_slice], a_smem.at[slot], barrier,
          collective_axes="cluster" if shared_operand == "a" else None)
      plgpu.copy_gmem_to_smem(
          b_gmem.at[batch_idx, n_slice, k_slice], b_smem.at[slot], barrier,
          collective_axes="cluster" if shared_operand == "b" else None)
      if per_k:
        plgpu.copy_gmem_to_smem(a_sc_gmem.at[batch_idx, kk, m_slice],
                                a_sc_smem.at[slot], barrier)
        plgpu.copy_gmem_to_smem(b_sc_gmem.at[batch_idx, kk, n_slice],
                                b_sc_smem.at[slot], barrier)

    def producer():
      run_producer(ring, num_tiles=num_tiles, steps=k_iters, coords=coords,
                   load_step=load_step)

    def consumer(wg):
      if pingpong:
        wg_m_offset = wg_n_offset = 0
      else:
        wg_m_offset, wg_n_offset = consumer_offsets(config, wg, tile_m, tile_n)

      def a_view(slot):
        return a_smem.at[slot, pl.ds(wg_m_offset, tile_m), :]

      def b_view(slot):
        return b_smem.at[slot, pl.ds(wg_n_offset, tile_n), :].T

      row_layout = plgpu.Layout.WGMMA.reduce(1)
      col_layout = plgpu.Layout.WGMMA.reduce(0)

      def outer(rows, cols):
        """rows[:, None] * cols[None, :] in the accumulator's layout (rows
        alone, broadcast over the columns, when cols is None)."""
        factor = lax.broadcast_in_dim(rows, (tile_m, tile_n), (0,))
        if cols is not None:
          factor = factor * lax.broadcast_in_dim(cols, (tile_m, tile_n), (1,))
        return factor

      def load_factors(slot):
        """This consumer's scale vectors of the block in `slot`, read as
        soon as its stage has landed: a_scale over the tile's rows and
        b_scale over its columns (None when B's scale is one number over
        them). The proxy fence follows at once: the producer's next TMA
        write into this stage goes through the async proxy, and the PTX
        memory model orders a generic read before it only through a proxy
        fence (the interpreter's race detector flags the stage's reuse
        without it). Issued here, while the previous block's wgmma runs,
        the read's latency and the fence stay off the promotion's path."""
        rows = plgpu.load(a_sc_smem.at[slot, pl.ds(wg_m_offset, tile_m)],
                          layout=row_layout)
        if uniform_columns:
          # B's scale is one number over these columns: read tile_m of its
          # (equal) column entries in the row layout and multiply per row.
          rows = rows * plgpu.load(
              b_sc_smem.at[slot, pl.ds(wg_n_offset, tile_m)],
              layout=row_layout)
          cols = None
        else:
          cols = plgpu.load(b_sc_smem.at[slot, pl.ds(wg_n_offset, tile_n)],
                            layout=col_layout)
        plgpu.commit_smem()
        return rows, cols

      def pipelined_acc(first_step):
        """The whole-K f32 accumulator, wgmma groups overlapping."""
        def mma_step(at, acc_ref):
          plgpu.wgmma(acc_ref, a_view(at.slot), b_view(at.slot))

        (acc,) = consume_ring(
            ring, mma_step, first_step=first_step, steps=k_iters,
            accumulators=[plgpu.ACC((tile_m, tile_n), jnp.float32)])
        return acc

      def promote(total, acc_ref, factors, slot):
        """total + (finished block's product) * its scales; frees the
        block's stage. The caller has already waited for the block's wgmma:
        a plain `acc_ref[...]` would wait for every wgmma in flight, the
        next block's too, and so serialise the overlap `promote_group` is
        for."""
        product = plgpu.wgmma_accumulator_load(acc_ref, wait_n=None)
        scaled = product * outer(*factors)  # a_scale[row] * b_scale[col]
        plgpu.barrier_arrive(stage_consumed.at[slot])
        return scaled if total is None else total + scaled

      def promote_group(total, kk0, size, first_step):
        """Blocks kk0 .. kk0+size-1: each block's wgmma is issued before the
        previous block is promoted, so the tensor cores run while the
        previous partial product is scaled. All the group's accumulators
        are zeroed before its first wgmma: zeroing a register while a wgmma
        is in flight would make ptxas serialise every wgmma. Not
        `consume_ring`'s loop: each block has its own accumulator (unrolled),
        and its stage is released only once its product has been scaled."""
        def group(*acc_refs):
          new_total = total
          slots, factors = [], []
          for i, acc_ref in enumerate(acc_refs):
            slots.append(ring.slot(first_step + kk0 + i))
            plgpu.barrier_wait(stage_loaded.at[slots[i]])
            factors.append(load_factors(slots[i]))
            if alternate:
              plgpu.barrier_wait(turn.at[wg])
            plgpu.wgmma(acc_ref, a_view(slots[i]), b_view(slots[i]))
            if alternate:
              plgpu.barrier_arrive(turn.at[1 - wg])
            if i > 0:
              plgpu.wgmma_wait(1)
              new_total = promote(new_total, acc_refs[i - 1], factors[i - 1],
                                  slots[i - 1])
          plgpu.wgmma_wait(0)
          return promote(new_total, acc_refs[-1], factors[-1], slots[-1])

        return pl.run_scoped(
            group, *[plgpu.ACC((tile_m, tile_n), jnp.float32)] * size)

      def promoted_acc(first_step, first_group):
        """Sum over K blocks of (block product) * (its scales), in f32; the
        first promotion group has `first_group` blocks, the others
        `group`."""
        # The first group starts the sum: no zero-filled array to lay out.
        first = min(first_group, k_iters)
        total = promote_group(None, index(0), first, first_step)
        full_groups = (k_iters - first) // group
        tail = k_iters - first - full_groups * group

        def group_step(g, total):
          return promote_group(total, index(first) + index(g) * group, group,
                               first_step)

        if full_groups:
          total = lax.fori_loop(index(0), index(full_groups), group_step,
                                total)
        if tail:
          total = promote_group(total, index(k_iters - tail), tail,
                                first_step)
        return total

      def fetch_epilogue_scales(batch_idx, row0, col0):
        """Start the copies of this tile's row and column scales; they land
        while the main loop runs (the previous tile's epilogue has already
        read the buffers into registers)."""
        if a_vector:
          plgpu.copy_gmem_to_smem(
              a_sc_gmem.at[batch_idx, pl.ds(row0, tile_m)],
              a_sc_smem.at[wg], sc_loaded.at[wg])
        if b_vector:
          plgpu.copy_gmem_to_smem(
              b_sc_gmem.at[batch_idx, pl.ds(col0, tile_n)],
              b_sc_smem.at[wg], sc_loaded.at[wg])

      def tensor_scalar(batch_idx):
        """The product of the per-tensor scales, or None: one float read
        from global memory (cached) per tile, so it needs no shared memory
        and no copy; read before the main loop, its latency is hidden."""
        scalar = None
        for mode, gmem in ((problem.a_scale_mode, a_sc_gmem),
                           (problem.b_scale_mode, b_sc_gmem)):
          if mode == "tensor":
            value = gmem[batch_idx]
            scalar = value if scalar is None else scalar * value
        return scalar

      def dequantize(acc, scalar):
        """acc times the row scales, column scales and per-tensor scalar."""
        if a_vector or b_vector:
          plgpu.barrier_wait(sc_loaded.at[wg])
        if a_vector and b_vector:
          factor = outer(plgpu.load(a_sc_smem.at[wg], layout=row_layout),
                         plgpu.load(b_sc_smem.at[wg], layout=col_layout))
          return acc * (factor if scalar is None else factor * scalar)
        if a_vector or b_vector:
          vec = plgpu.load(a_sc_smem.at[wg] if a_vector else b_sc_smem.at[wg],
                           layout=row_layout if a_vector else col_layout)
          if scalar is not None:
            vec = vec * scalar
          return acc * lax.broadcast_in_dim(vec, (tile_m, tile_n),
                                            (0,) if a_vector else (1,))
        return acc * scalar

      def compute_tile(batch_idx, m_idx, n_idx, first_step,
                       first_group=group):
        row0 = m_idx * cta_m + wg_m_offset
        col0 = n_idx * cta_n + wg_n_offset
        if a_vector or b_vector:
          fetch_epilogue_scales(batch_idx, row0, col0)
        scalar = tensor_scalar(batch_idx) if kind == "epilogue" else None
        if per_k:
          acc = promoted_acc(first_step, first_group)
        else:
          acc = pipelined_acc(first_step)
        if kind == "epilogue":
          acc = dequantize(acc, scalar)
        store_epilogue(
            acc, problem=problem, config=config, wg=wg, batch_idx=batch_idx,
            row0=row0, col0=col0, out_gmem=out_gmem, out_smem=out_smem,
            c_gmem=c_gmem, c_smem=c_smem, c_loaded=c_loaded,
            bias_gmem=bias_gmem, bias_smem=bias_smem, bias_loaded=bias_loaded)

      def follow_tile(first_step):
        """The other consumer's tile (pingpong): observe each stage's load
        and release it at once, so that every consumer sees every phase of
        every stage barrier and the producer refills a stage only after
        both have passed it."""
        def pass_stage(kk, carry):
          slot = ring.slot(first_step + index(kk))
          plgpu.barrier_wait(stage_loaded.at[slot])
          plgpu.barrier_arrive(stage_consumed.at[slot])
          return carry

        lax.fori_loop(index(0), index(k_iters), pass_stage, None)

      if alternate:
        # Consumer 0 issues first: its first wait is on this arrival.
        @pl.when(wg == 1)
        def _start_turns():
          plgpu.barrier_arrive(turn.at[0])

      @plgpu.nd_loop((num_tiles,), collective_axes="sm")
      def _tile(info):
        batch_idx, m_idx, n_idx = coords(info.index[0])
        first_step = info.local_index * k_iters
        if stagger:
          # Consumer 1 starts with a one-block group (see stagger_groups);
          # the group sizes are static, so each consumer has its own copy.
          for consumer_wg, first_group in ((0, group), (1, 1)):
            @pl.when(wg == consumer_wg)
            def _staggered():
              compute_tile(batch_idx, m_idx, n_idx, first_step, first_group)
          return
        if not pingpong:
          compute_tile(batch_idx, m_idx, n_idx, first_step)
          return
        owner = lax.rem(info.local_index, NUM_CONSUMERS)

        @pl.when(owner == wg)
        def _own():
          compute_tile(batch_idx, m_idx, n_idx, first_step)

        @pl.when(owner != wg)
        def _follow():
          follow_tile(first_step)

      if alternate:
        # Consumer 1's last turn passes to consumer 0, which is done: observe
        # it so that no barrier phase is left unobserved.
        @pl.when(wg == 0)
        def _end_turns():
          plgpu.barrier_wait(turn.at[0])

      plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    run_warpgroups(producer, consumer)

  ring_buffers = ring_smem(
      stages, loads=loads_per_stage,
      cluster_axes=None if cluster_dim is None else ("cluster",),
      a_smem=((cta_m, tile_k), a_gmem.dtype),
      b_smem=((cta_n, tile_k), b_gmem.dtype))
  if per_k:
    scale_smem = dict(
        a_sc_smem=plgpu.SMEM((stages, cta_m), jnp.float32),
        b_sc_smem=plgpu.SMEM((stages, cta_n), jnp.float32), sc_loaded=None)
  elif a_vector or b_vector:
    scale_smem = dict(
        a_sc_smem=(plgpu.SMEM((NUM_CONSUMERS, tile_m), jnp.float32)
                   if a_vector else None),
        b_sc_smem=(plgpu.SMEM((NUM_CONSUMERS, tile_n), jnp.float32)
                   if b_vector else None),
        sc_loaded=plgpu.Barrier(num_arrivals=int(a_vector) + int(b_vector),
                                num_barriers=NUM_CONSUMERS))
  else:
    scale_smem = dict(a_sc_smem=None, b_sc_smem=None, sc_loaded=None)
  pl.run_scoped(
      scoped,
      **ring_buffers,
      **epilogue_smem(config, out_gmem.dtype,
                      c_dtype=c_gmem.dtype if has_c else None,
                      has_bias=has_bias),
      **scale_smem,
      turn=(plgpu.Barrier(num_arrivals=1, num_barriers=NUM_CONSUMERS)
            if alternate else None),
      collective_axes="wg",
  )
