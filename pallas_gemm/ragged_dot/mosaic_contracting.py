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
from pallas_gemm.mosaic_backend.tma import tiled_transforms
from pallas_gemm.mosaic_backend.ws_persistent import (call_kernel, index,
                                                      tile_coordinates)
from pallas_gemm.problem import cdiv
from pallas_gemm.ragged_dot import mosaic_schedule as schedule
from pallas_gemm.ragged_dot.configs import NUM_CONSUMERS, RaggedConfig
from pallas_gemm.ragged_dot.mosaic import (CONSUMER_REGISTERS,
                                           PRODUCER_REGISTERS, drain_ring,
                                           for_each_tile, num_ctas_for,
                                           output_slot, run_stages)
from pallas_gemm.ragged_dot.problem import RaggedProblem


def _contracting_body(groups_gmem, lhs_gmem, dout_gmem, out_gmem, *,
                      config: RaggedConfig, k_tiles: int, n_tiles: int,
                      groups: int):
  tile_m, tile_n, chunk = config.tile_m, config.tile_n, config.tile_k
  cta_m = NUM_CONSUMERS * tile_m
  epi_n, stages, out_slots = config.epi_tile_n, config.stages, config.out_slots
  in_dtype, out_dtype = lhs_gmem.dtype, out_gmem.dtype
  num_tiles = index(groups * k_tiles * n_tiles)

  def tile_info(linear):
    if config.interleave_groups:
      g = lax.rem(linear, index(groups))
      _, k_idx, n_idx = tile_coordinates(
          lax.div(linear, index(groups)), m_tiles=k_tiles, n_tiles=n_tiles,
          band_dim=Dim.M, band=config.grid_band)
    else:
      g, k_idx, n_idx = tile_coordinates(linear, m_tiles=k_tiles,
                                         n_tiles=n_tiles, band_dim=Dim.M,
                                         band=config.grid_band)
    row_lo = groups_gmem[schedule.GROUP_ROW_LO, g]
    row_hi = groups_gmem[schedule.GROUP_ROW_HI, g]
    first_chunk = groups_gmem[schedule.GROUP_FIRST_CHUNK, g]
    steps = groups_gmem[schedule.GROUP_CHUNKS, g]
    return g, k_idx, n_idx, row_lo, row_hi, first_chunk, steps

  def scoped(lhs_smem, dout_smem, stage_loaded, stage_consumed, out_smem):
    wg = lax.axis_index("wg")

    @pl.when(wg == NUM_CONSUMERS)
    def _producer():
      plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")

      def tile(linear, first_step):
        _, k_idx, n_idx, _, _, first_chunk, steps = tile_info(linear)
        k_cols = pl.ds(k_idx * cta_m, cta_m)
        n_cols = pl.ds(n_idx * tile_n, tile_n)

        def load_stage(c, carry):
          step = first_step + c
          slot = lax.rem(step, index(stages))

          @pl.when(step >= stages)  # the first pass finds every stage free
          def _wait_free():
            plgpu.barrier_wait(stage_consumed.at[slot])

          rows = pl.ds((first_chunk + c) * chunk, chunk)
          plgpu.copy_gmem_to_smem(lhs_gmem.at[rows, k_cols],
                                  lhs_smem.at[slot], stage_loaded.at[slot])
          plgpu.copy_gmem_to_smem(dout_gmem.at[rows, n_cols],
                                  dout_smem.at[slot], stage_loaded.at[slot])
          return carry

        lax.fori_loop(index(0), steps, load_stage, None)
        return first_step + steps

      total_steps = for_each_tile(num_tiles, tile, index(0))
      drain_ring(stage_consumed, total_steps, stages)

    @pl.when(wg < NUM_CONSUMERS)
    def _consumer():
      plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")
      wg_rows = wg * tile_m

      def tile(linear, first_step):
        g, k_idx, n_idx, row_lo, row_hi, first_chunk, steps = tile_info(
            linear)

        def mma(acc_ref, slot, c):
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

        def mma_scope(acc_ref):
          run_stages(acc_ref, first_step, steps, stages, stage_loaded,
                     stage_consumed, mma)
          return acc_ref[...]

        acc = pl.run_scoped(mma_scope, plgpu.ACC((tile_m, tile_n), jnp.float32))
        rows = pl.ds(k_idx * cta_m + wg_rows, tile_m)
        for ej in range(tile_n // epi_n):
          slot = output_slot(linear, ej, tile_n // epi_n, out_slots)
          plgpu.wait_smem_to_gmem(out_slots - 1, wait_read_only=True)
          out_smem[wg, slot] = acc[:, ej * epi_n:(ej + 1) * epi_n].astype(
              out_dtype)
          plgpu.commit_smem()
          plgpu.copy_smem_to_gmem(
              out_smem.at[wg, slot],
              out_gmem.at[g, rows, pl.ds(n_idx * tile_n + ej * epi_n, epi_n)])
        return first_step + steps

      for_each_tile(num_tiles, tile, index(0))
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  pl.run_scoped(
      scoped,
      lhs_smem=plgpu.SMEM((stages, chunk, cta_m), in_dtype,
                          transforms=tiled_transforms(cta_m, in_dtype)),
      dout_smem=plgpu.SMEM((stages, chunk, tile_n), in_dtype,
                           transforms=tiled_transforms(tile_n, in_dtype)),
      stage_loaded=plgpu.Barrier(num_arrivals=2, num_barriers=stages),
      stage_consumed=plgpu.Barrier(num_arrivals=NUM_CONSUMERS,
                                   num_barriers=stages),
      out_smem=plgpu.SMEM((NUM_CONSUMERS, out_slots, tile_m, epi_n), out_dtype,
                          transforms=tiled_transforms(epi_n, out_dtype)),
      collective_axes="wg",
  )


def contracting_matmul(lhs, dout, group_sizes, row_offset, *,
                       problem: RaggedProblem, config: RaggedConfig, params):
  if config.split_rows:
    raise ValueError("RaggedConfig.split_rows is a \"rows\"-mode option: the "
                     "contracting kernel always splits its K strip")
  m, k, n, groups = problem.m, problem.k, problem.n, problem.groups
  tile_m, tile_n, chunk = config.tile_m, config.tile_n, config.tile_k
  cta_m = NUM_CONSUMERS * tile_m
  in_dtype = problem.in_dtype
  table = schedule.contracting_groups(group_sizes, row_offset, m=m,
                                      chunk=chunk)
  lhs = tma.pad_to_tiling(lhs, tma.tma_tiling(cta_m, in_dtype), (chunk, cta_m))
  dout = tma.pad_to_tiling(dout, tma.tma_tiling(tile_n, in_dtype),
                           (chunk, tile_n))
  k_out = max(cdiv(k, 8) * 8, tile_m)
  n_out = cdiv(n, config.epi_tile_n) * config.epi_tile_n
  k_tiles, n_tiles = cdiv(k, cta_m), cdiv(n, tile_n)
  out_type = jax.ShapeDtypeStruct((groups, k_out, n_out),
                                  jnp.dtype(problem.out_dtype))
  kernel = plgpu.kernel(
      functools.partial(_contracting_body, config=config, k_tiles=k_tiles,
                        n_tiles=n_tiles, groups=groups),
      out_type=out_type,
      grid=(min(num_ctas_for(params), groups * k_tiles * n_tiles),),
      grid_names=("sm",),
      num_threads=NUM_CONSUMERS + 1,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(
          lowering_semantics=plgpu.LoweringSemantics.Lane),
      interpret=params,
  )
  out = call_kernel(kernel, [table, lhs, dout], out_type, params)
  return out[:, :k, :n] if out.shape[1:] != (k, n) else out
