"""The fused GLU forward on Pallas Mosaic GPU (Hopper): one persistent,
warp-specialised kernel in the shape of `mosaic/ws_persistent`.

  producer warpgroup   (setmaxnreg 40) streams, per pipeline stage, ONE x
                       tile and TWO weight tiles (gate and up, the same
                       columns) into a ring of shared-memory stages.
  2 consumer wgs       (setmaxnreg 232) each keep two float32 wgmma
                       accumulators, gate and up, fed from the same x tile;
                       the epilogue computes activation(gate) * up in f32
                       and TMA-stores one output tile.

Config options beyond the tiling (see `GluConfig`): `fast_math` computes the
epilogue's activation on the SFU's approximate instructions, `consumer_lag`
starts the second consumer a few k-steps behind the first,
`x_in_registers` feeds both wgmma from one register copy of the x tile, and
`k_splits` cuts the contraction into runs that are tiles of their own
(for outputs of too few tiles to fill the SMs): the kernel then stores
float32 partial gate and up products, and XLA sums them and gates.

Against XLA's two GEMMs and an elementwise fusion, x is read once per tile
for both products and the two m x n intermediates are never written nor
read back. With `residuals` the kernel also stores gate and up (rounded to
the output dtype): the forward pass of the gradient, which needs them.

Fused (k, 2, n) weights are read in place as the free (k, 2n) reshape: the
up tile of columns [j, j + w) lies at [n + j, n + j + w). A gate tile that
runs past column n reads up columns into output columns >= n, which are
cut off (the TMA drops stores past the array's end, and a padded output is
sliced). When n is not a multiple of the 128-byte swizzle span the up tile
would start mid-tile of the TMA's tiled view, so such weights are split
into two arrays first (one copy).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_gemm.devices import DeviceInfo, device_info
from pallas_gemm.gated_linear_unit import xla
from pallas_gemm.gated_linear_unit.configs import GluConfig, k_steps
from pallas_gemm.gated_linear_unit.problem import GLU_ACTIVATIONS, GluProblem
from pallas_gemm.mosaic_backend import tma
from pallas_gemm.mosaic_backend.configs import hopper_device_unsupported
from pallas_gemm.mosaic_backend.warp_specialised import (
    INTERPRET_CTAS, Ring, call_kernel, consume_ring, consumer_offsets,
    interpret_params, out_staging_smem,
    padded_out_dims, ring_smem, run_producer, run_warpgroups,
    tile_coordinates, warp_specialised_kernel)
from pallas_gemm.problem import cdiv
from pallas_gemm.registry import INT32_LIMIT

NAME = "mosaic"
#: wgmma reads (k, n)-major weights only for 16-bit inputs: TF32 wgmma
#: takes K-major operands alone.
MOSAIC_GLU_DTYPES = ("bfloat16", "float16")
MOSAIC_GLU_OUT_DTYPES = ("bfloat16", "float16", "float32")


def _sigmoid_by_tanh(x):
  # One SFU op (tanh.approx under approx_math) in place of exp and an IEEE
  # division: sigmoid(x) = (1 + tanh(x / 2)) / 2.
  return 0.5 * jnp.tanh(0.5 * x) + 0.5


#: The epilogue activations of a `fast_math` config: the forms with fewer
#: SFU ops; the rest are as GLU_ACTIVATIONS (whose exp and tanh the
#: approx_math lowering makes approximate).
FAST_ACTIVATIONS = {
    "silu": lambda x: x * _sigmoid_by_tanh(x),
    "sigmoid": _sigmoid_by_tanh,
}


def epilogue_activation(name: str, config: GluConfig):
  if config.fast_math and name in FAST_ACTIVATIONS:
    return FAST_ACTIVATIONS[name]
  return GLU_ACTIVATIONS[name]


def supports(problem: GluProblem, device: DeviceInfo) -> str | None:
  """None when the kernel can run `problem` on `device`, else why not."""
  reason = hopper_device_unsupported(device)
  if reason:
    return reason
  if problem.in_dtype not in MOSAIC_GLU_DTYPES:
    return (f"input dtype {problem.in_dtype} is not one of "
            f"{MOSAIC_GLU_DTYPES} (TF32 wgmma cannot read (k, n) weights)")
  if problem.out_dtype not in MOSAIC_GLU_OUT_DTYPES:
    return f"output dtype {problem.out_dtype} is not supported"
  if 0 in (problem.m, problem.n, problem.k):
    return "an empty dimension (nothing for a kernel to do)"
  largest = max(problem.m * problem.k, 2 * problem.k * problem.n,
                problem.m * problem.n)
  if largest > INT32_LIMIT:
    return (f"an operand of {largest} elements is past the int32 indexing "
            "the kernel uses")
  return None


def _kernel_body(x_gmem, *refs, problem: GluProblem, config: GluConfig,
                 k_iters: int, m_tiles: int, n_tiles: int, up_offset: int,
                 separate_up: bool, residuals: bool, part_rows: int):
  """One CTA of the persistent grid. Its tiles are (split, m, n): with
  config.k_splits > 1 each covers k_iters k-steps of its split's run and
  stores float32 partial gate and up products at rows split * part_rows
  of the two outputs; else it gates."""
  refs = list(refs)
  gate_gmem = refs.pop(0)
  up_gmem = refs.pop(0) if separate_up else gate_gmem
  # out, then gate and up with `residuals`; the partial gate and up when split
  out_gmems = refs
  split = config.k_splits > 1
  activation = epilogue_activation(problem.activation, config)

  in_dtype, out_dtype = x_gmem.dtype, out_gmems[0].dtype
  tile_m, tile_n, tile_k = config.tile_m, config.tile_n, config.tile_k
  cta_m, cta_n = config.cta_tile_m, config.cta_tile_n
  epi_m, epi_n = config.epi_tile_m, config.epi_tile_n
  stages, out_slots = config.max_concurrent_steps, config.out_slots
  num_tiles = config.k_splits * m_tiles * n_tiles
  # The step of its first tile after which the first consumer lets the
  # second one start (every CTA has at least one tile); the ring's free
  # stages bound how far ahead it can be.
  lag = config.consumer_lag
  lag_step = min(lag, k_iters - 1)

  def coords(linear):
    # The splits are batches of the output's tiles.
    split_idx, m_idx, n_idx = tile_coordinates(
        linear, m_tiles=m_tiles, n_tiles=n_tiles, band_dim=config.band_dim,
        band=config.grid_band)
    return split_idx, m_idx, n_idx

  def scoped(x_smem, gate_smem, up_smem, stage_loaded, stage_consumed,
             out_smem, lag_barrier=None):
    ring = Ring(stages, stage_loaded, stage_consumed)

    def load_step(tile, kk, slot):
      split_idx, m_idx, n_idx = tile
      m_slice = pl.ds(m_idx * cta_m, cta_m)
      k_slice = pl.ds((split_idx * k_iters + kk) * tile_k, tile_k)
      loaded = stage_loaded.at[slot]
      plgpu.copy_gmem_to_smem(x_gmem.at[m_slice, k_slice], x_smem.at[slot],
                              loaded)
      plgpu.copy_gmem_to_smem(
          gate_gmem.at[k_slice, pl.ds(n_idx * cta_n, cta_n)],
          gate_smem.at[slot], loaded)
      plgpu.copy_gmem_to_smem(
          up_gmem.at[k_slice, pl.ds(up_offset + n_idx * cta_n, cta_n)],
          up_smem.at[slot], loaded)

    def producer():
      run_producer(ring, num_tiles=num_tiles, steps=k_iters, coords=coords,
                   load_step=load_step)

    def consumer(wg):
      wg_m_offset, wg_n_offset = consumer_offsets(config, wg, tile_m, tile_n)

      def mma_step(at, gate_acc, up_acc):
        x_view = x_smem.at[at.slot, pl.ds(wg_m_offset, tile_m), :]
        if config.x_in_registers:
          # Read the x tile from shared memory once instead of once per
          # wgmma: both products take it from registers.
          x_view = x_view[...]
        cols = pl.ds(wg_n_offset, tile_n)
        plgpu.wgmma(gate_acc, x_view, gate_smem.at[at.slot, :, cols])
        plgpu.wgmma(up_acc, x_view, up_smem.at[at.slot, :, cols])
        if lag:
          @pl.when((wg == 0) & (at.step == lag_step))
          def _let_the_second_consumer_start():
            plgpu.barrier_arrive(lag_barrier)

      def compute_tile(split_idx, m_idx, n_idx, first_step):
        acc_type = plgpu.ACC((tile_m, tile_n), jnp.float32)
        # A step's two wgmma groups (gate and up) stay in flight.
        gate, up = consume_ring(ring, mma_step, first_step=first_step,
                                steps=k_iters, in_flight=2,
                                accumulators=[acc_type, acc_type])

        row0 = split_idx * part_rows + m_idx * cta_m + wg_m_offset
        col0 = n_idx * cta_n + wg_n_offset
        store_index = 0
        for ei in range(tile_m // epi_m):
          for ej in range(tile_n // epi_n):
            part = (slice(ei * epi_m, (ei + 1) * epi_m),
                    slice(ej * epi_n, (ej + 1) * epi_n))
            gate_part, up_part = gate[part], up[part]
            if split:
              values = [gate_part, up_part]
            else:
              values = [activation(gate_part) * up_part]
              if residuals:
                values += [gate_part, up_part]
            rows = pl.ds(row0 + ei * epi_m, epi_m)
            cols = pl.ds(col0 + ej * epi_n, epi_n)
            for value, dst in zip(values, out_gmems):
              slot = store_index % out_slots
              store_index += 1
              # The TMA store that last read this slot must be done with it.
              plgpu.wait_smem_to_gmem(out_slots - 1, wait_read_only=True)
              out_smem[wg, slot] = value.astype(out_dtype)
              plgpu.commit_smem()
              plgpu.copy_smem_to_gmem(out_smem.at[wg, slot],
                                      dst.at[rows, cols])

      if lag:
        @pl.when(wg == 1)
        def _trail_the_first_consumer():
          plgpu.barrier_wait(lag_barrier)

      @plgpu.nd_loop((num_tiles,), collective_axes="sm")
      def _tile(info):
        split_idx, m_idx, n_idx = coords(info.index[0])
        compute_tile(split_idx, m_idx, n_idx, info.local_index * k_iters)

      plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    run_warpgroups(producer, consumer)

  w_block = ((tile_k, cta_n), in_dtype)
  pl.run_scoped(
      scoped,
      **ring_smem(stages, x_smem=((cta_m, tile_k), in_dtype),
                  gate_smem=w_block, up_smem=w_block),
      out_smem=out_staging_smem(out_slots, (epi_m, epi_n), out_dtype),
      collective_axes="wg",
      **({"lag_barrier": plgpu.Barrier(num_arrivals=1)} if lag else {}),
  )


def prepare_weights(weights, problem: GluProblem, config: GluConfig):
  """The weight operands as the kernel reads them: a list of one (k, 2n)
  view of fused weights (with the up columns' offset) or of two (k, n)
  arrays, padded to the TMA tiling. Returns (arrays, up_offset)."""
  in_dtype = problem.in_dtype
  tiling = tma.tma_tiling(config.cta_tile_n, in_dtype)
  box = (config.tile_k, config.cta_tile_n)
  if problem.fused_weights:
    k, _, n = weights.shape
    if n % tma.swizzle_elems(in_dtype) == 0:
      flat = weights.reshape(k, 2 * n)  # free: (k, 2, n) is row-major
      return [tma.pad_to_tiling(flat, tiling, box)], n
    weights = (weights[:, 0, :], weights[:, 1, :])
  gate, up = weights
  return [tma.pad_to_tiling(gate, tiling, box),
          tma.pad_to_tiling(up, tiling, box)], 0


def glu_forward(x, weights, *, problem: GluProblem, config: GluConfig,
                residuals: bool = False, interpret=False):
  """activation(x @ w_gate) * (x @ w_up) for a 2-D x on the Mosaic kernel;
  with `residuals` returns (out, gate, up)."""
  params = interpret_params(interpret)
  if not isinstance(config, GluConfig):
    raise TypeError(f"config must be a GluConfig, got {type(config).__name__}")
  reason = supports(problem, device_info() if params is None
                    else DeviceInfo("cpu", "cpu"))
  if reason:
    raise ValueError(f"the Mosaic GLU kernel cannot run {problem.describe()}: "
                     f"{reason}")
  if config.x_in_registers and params is not None:
    raise ValueError("config.x_in_registers=True runs on a GPU only: the "
                     "Mosaic GPU interpreter has no wgmma with a register "
                     "operand")
  misfit = config.misfit(problem)
  if misfit:
    raise ValueError(misfit)
  num_sms = (INTERPRET_CTAS if params is not None
             else max(device_info().num_sms, 1))
  cta_m, cta_n, tile_k = config.cta_tile_m, config.cta_tile_n, config.tile_k
  x = tma.pad_to_tiling(x, tma.tma_tiling(tile_k, problem.in_dtype),
                        (cta_m, tile_k))
  w_operands, up_offset = prepare_weights(weights, problem, config)
  splits = config.k_splits
  stored = dataclasses.replace(problem,
                               out_dtype=config.stored_dtype(problem))
  m_out, n_out = padded_out_dims(stored, config)
  m_tiles, n_tiles = cdiv(problem.m, cta_m), cdiv(problem.n, cta_n)
  k_iters = k_steps(problem, config) // splits
  if splits > 1:
    # Each split's partial products below the one before, in whole CTA
    # tiles of rows: a last tile past m must not reach the next split's.
    m_out = m_tiles * cta_m
    one_out = jax.ShapeDtypeStruct((splits * m_out, n_out), jnp.float32)
    out_type = (one_out,) * 2
  else:
    one_out = jax.ShapeDtypeStruct((m_out, n_out),
                                   jnp.dtype(problem.out_dtype))
    out_type = (one_out,) * 3 if residuals else one_out
  kernel = warp_specialised_kernel(
      functools.partial(
          _kernel_body, problem=problem, config=config, k_iters=k_iters,
          m_tiles=m_tiles, n_tiles=n_tiles, up_offset=up_offset,
          separate_up=len(w_operands) == 2, residuals=residuals,
          part_rows=m_out),
      out_type=out_type,
      grid=(min(num_sms, splits * m_tiles * n_tiles),),
      # Lane semantics, as ws_persistent: explicit WGMMA-layout epilogue.
      approx_math=config.fast_math,
      interpret=params,
  )
  operands = [x] + w_operands
  if isinstance(out_type, tuple) and params is not None:
    # The interpreter's host callback hands back one array: stack there.
    stacked = jax.ShapeDtypeStruct((len(out_type),) + one_out.shape,
                                   one_out.dtype)
    outs = tuple(call_kernel(lambda *ops: jnp.stack(kernel(*ops)), operands,
                             stacked, params))
  else:
    outs = call_kernel(kernel, operands, out_type, params)
  if splits > 1:
    return _gate_partials(outs, problem, splits, residuals)
  on_gpu = params is None

  def unpad(out):
    return tma.unpad_matrix(out, problem.m, problem.n, on_gpu=on_gpu)

  if residuals:
    return tuple(unpad(out) for out in outs)
  return unpad(outs)


def _gate_partials(partials, problem: GluProblem, splits: int,
                   residuals: bool):
  """The output (and with `residuals` gate and up, rounded to the output
  dtype) from a split kernel's stacked float32 partial products: one XLA
  fusion sums the splits, cuts the padding and gates, exactly."""
  def total(part):
    rows = part.shape[0] // splits
    return part.reshape(splits, rows, -1).sum(0)[:problem.m, :problem.n]

  gate, up = (total(part) for part in partials)
  out_dtype = jnp.dtype(problem.out_dtype)
  out = xla.gate(gate, up, problem.activation, out_dtype)
  if residuals:
    return out, gate.astype(out_dtype), up.astype(out_dtype)
  return out
