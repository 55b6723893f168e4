"""`mosaic/ws_persistent`: the Hopper production GEMM on Pallas Mosaic GPU.

Structure of one CTA (three warpgroups, one CTA per SM):

  producer warpgroup   gives registers away (setmaxnreg 40) and only issues
                       TMA loads of A and B tiles into a ring of
                       `max_concurrent_steps` swizzled shared-memory stages.
  2 consumer wgs       take the registers (setmaxnreg 232), run wgmma on each
                       stage as soon as its TMA barrier fires and release the
                       stage one step later (one wgmma group stays in flight),
                       then run the fused epilogue and TMA-store the tile.

The ring is indexed by a step counter that runs on across output tiles, so
the producer starts loading tile t+1 while the consumers are still in tile
t's epilogue: there is no pipeline drain or refill between tiles. Tiles are
handed out round-robin over the persistent grid in a banded snake order.

The two consumers work cooperatively: each computes its half of the CTA
tile (split along `MosaicConfig.wg_dimension`), and both stop issuing wgmma
while they run the epilogue. Three variants were built, measured on the H200
and removed because none gained on this schedule beyond noise (the numbers
are in experiments/results/nvidia_h200/mosaic/README.md): a pingpong schedule
(each consumer owns alternate whole tiles, so one's epilogue overlaps the
other's main loop), 2-CTA clusters with TMA multicast of the shared operand
tile, and output tiles stored straight from registers. The pingpong and
cluster code is in git at be99091 (`MosaicConfig.pingpong`,
`MosaicConfig.cluster_dim`), the direct store at b2401fa.

Ragged edges are left to the TMA: loads past the end of an array read
zeros (zero rows/columns add nothing to the product) and stores past the end
are dropped. Operands whose dims are not multiples of the TMA tiling are
zero-padded first; see `tma.py`.

Float32 inputs run as TF32, which wgmma takes only K-major: XLA transposes
A or B first when the caller's layout is not (m, k) x (n, k).

The producer and consumer loops, the shared memory and the epilogue store
are shared with the other warp-specialised kernels (`mosaic/fp8`, the GLU,
ragged_dot): see `warp_specialised.py`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_gemm import autotune, registry
from pallas_gemm.devices import DeviceInfo, device_info
from pallas_gemm.mosaic_backend import heuristics, tma
from pallas_gemm.mosaic_backend.configs import (HOPPER_SMEM_BYTES,
                                                MosaicConfig,
                                                hopper_unsupported)
from pallas_gemm.mosaic_backend.warp_specialised import (
    INTERPRET_CTAS, Ring, call_kernel, consume_ring,
    consumer_offsets, epilogue_smem, interpret_params,
    pad_epilogue_operands, ring_smem, run_producer, run_warpgroups,
    step_slices, store_epilogue, tile_coordinates, warp_specialised_kernel)
from pallas_gemm.problem import GemmProblem, cdiv

NAME = "mosaic/ws_persistent"


def _kernel_body(*refs, problem: GemmProblem, config: MosaicConfig,
                 k_iters: int, m_tiles: int, n_tiles: int):
  """One CTA of the persistent grid."""
  has_c, has_bias = problem.epilogue.has_c, problem.epilogue.has_bias
  refs = list(refs)
  a_gmem, b_gmem = refs.pop(0), refs.pop(0)
  c_gmem = refs.pop(0) if has_c else None
  bias_gmem = refs.pop(0) if has_bias else None
  (out_gmem,) = refs
  transpose_a, transpose_b = _kernel_layout(problem)

  in_dtype = a_gmem.dtype
  tile_m, tile_n, tile_k = config.tile_m, config.tile_n, config.tile_k
  cta_m, cta_n = config.cta_tile_m, config.cta_tile_n
  stages = config.max_concurrent_steps
  num_tiles = problem.batch * m_tiles * n_tiles

  a_block = (tile_k, cta_m) if transpose_a else (cta_m, tile_k)
  b_block = (cta_n, tile_k) if transpose_b else (tile_k, cta_n)

  def coords(linear):
    return tile_coordinates(linear, m_tiles=m_tiles, n_tiles=n_tiles,
                            band_dim=config.band_dim, band=config.grid_band)

  def scoped(a_smem, b_smem, stage_loaded, stage_consumed, out_smem, c_smem,
             c_loaded, bias_smem, bias_loaded):
    ring = Ring(stages, stage_loaded, stage_consumed)

    def load_step(tile, kk, slot):
      batch_idx, m_slice, n_slice, k_slice = step_slices(config, tile, kk)
      a_src = (a_gmem.at[batch_idx, k_slice, m_slice] if transpose_a
               else a_gmem.at[batch_idx, m_slice, k_slice])
      b_src = (b_gmem.at[batch_idx, n_slice, k_slice] if transpose_b
               else b_gmem.at[batch_idx, k_slice, n_slice])
      plgpu.copy_gmem_to_smem(a_src, a_smem.at[slot], stage_loaded.at[slot])
      plgpu.copy_gmem_to_smem(b_src, b_smem.at[slot], stage_loaded.at[slot])

    def producer():
      run_producer(ring, num_tiles=num_tiles, steps=k_iters, coords=coords,
                   load_step=load_step)

    def consumer(wg):
      wg_m_offset, wg_n_offset = consumer_offsets(config, wg, tile_m, tile_n)

      def a_view(slot):
        if transpose_a:
          return a_smem.at[slot, :, pl.ds(wg_m_offset, tile_m)].T
        return a_smem.at[slot, pl.ds(wg_m_offset, tile_m), :]

      def b_view(slot):
        if transpose_b:
          return b_smem.at[slot, pl.ds(wg_n_offset, tile_n), :].T
        return b_smem.at[slot, :, pl.ds(wg_n_offset, tile_n)]

      def mma_step(at, acc_ref):
        plgpu.wgmma(acc_ref, a_view(at.slot), b_view(at.slot))

      def compute_tile(batch_idx, m_idx, n_idx, first_step):
        (acc,) = consume_ring(
            ring, mma_step, first_step=first_step, steps=k_iters,
            accumulators=[plgpu.ACC((tile_m, tile_n), jnp.float32)])
        row0 = m_idx * cta_m + wg_m_offset
        col0 = n_idx * cta_n + wg_n_offset
        store_epilogue(
            acc, problem=problem, config=config, wg=wg, batch_idx=batch_idx,
            row0=row0, col0=col0, out_gmem=out_gmem, out_smem=out_smem,
            c_gmem=c_gmem, c_smem=c_smem, c_loaded=c_loaded,
            bias_gmem=bias_gmem, bias_smem=bias_smem, bias_loaded=bias_loaded)

      @plgpu.nd_loop((num_tiles,), collective_axes="sm")
      def _tile(info):
        batch_idx, m_idx, n_idx = coords(info.index[0])
        compute_tile(batch_idx, m_idx, n_idx, info.local_index * k_iters)

      plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    run_warpgroups(producer, consumer)

  pl.run_scoped(
      scoped,
      **ring_smem(stages, a_smem=(a_block, in_dtype), b_smem=(b_block, in_dtype)),
      **epilogue_smem(config, out_gmem.dtype,
                      c_dtype=c_gmem.dtype if has_c else None,
                      has_bias=has_bias),
      collective_axes="wg",
  )


def _kernel_layout(problem: GemmProblem) -> tuple[bool, bool]:
  """(transpose_a, transpose_b) as the kernel sees its operands.

  wgmma reads 16-bit operands in either major order, so those keep the
  caller's layout. TF32 wgmma only takes K-major operands (A as (m, k),
  B as (n, k)); float32 operands are transposed by XLA to get there.
  """
  if problem.in_dtype == "float32":
    return False, True
  return problem.transpose_a, problem.transpose_b


def prepare_operands(a, b, c, bias, problem: GemmProblem,
                     config: MosaicConfig):
  """Brings operands into the layout the kernel reads and pads ragged dims
  to the TMA tiling (see `tma.py`). Returns the operands and the padded
  output dims."""
  transpose_a, transpose_b = _kernel_layout(problem)
  if transpose_a != problem.transpose_a:
    a = jnp.swapaxes(a, 1, 2)
  if transpose_b != problem.transpose_b:
    b = jnp.swapaxes(b, 1, 2)
  in_dtype = problem.in_dtype
  cta_m, cta_n, tile_k = config.cta_tile_m, config.cta_tile_n, config.tile_k
  a_box = (tile_k, cta_m) if transpose_a else (cta_m, tile_k)
  b_box = (cta_n, tile_k) if transpose_b else (tile_k, cta_n)
  a = tma.pad_to_tiling(a, tma.tma_tiling(a_box[1], in_dtype), a_box)
  b = tma.pad_to_tiling(b, tma.tma_tiling(b_box[1], in_dtype), b_box)
  c, bias, out_dims = pad_epilogue_operands(c, bias, problem, config)
  return a, b, c, bias, out_dims


def ws_persistent_matmul(a, b, c, bias, *, problem: GemmProblem,
                         config: MosaicConfig, interpret=False):
  params = interpret_params(interpret)
  if not isinstance(config, MosaicConfig):
    raise TypeError(f"config must be a MosaicConfig, got {type(config).__name__}")
  num_sms = (INTERPRET_CTAS if params is not None
             else max(device_info().num_sms, 1))
  tma.check_full_swizzle(problem.in_dtype, tile_k=config.tile_k,
                         tile_n=config.tile_n)
  if not config.fits(problem):
    raise ValueError(
        f"config={config} needs {config.smem_bytes(problem)} bytes of shared "
        f"memory, more than the {HOPPER_SMEM_BYTES} an sm_90 block has")
  a, b, c, bias, (m_out, n_out) = prepare_operands(a, b, c, bias, problem,
                                                   config)
  m_tiles = cdiv(problem.m, config.cta_tile_m)
  n_tiles = cdiv(problem.n, config.cta_tile_n)
  k_iters = cdiv(problem.k, config.tile_k)
  out_type = jax.ShapeDtypeStruct((problem.batch, m_out, n_out),
                                  jnp.dtype(problem.out_dtype))
  kernel = warp_specialised_kernel(
      functools.partial(_kernel_body, problem=problem, config=config,
                        k_iters=k_iters, m_tiles=m_tiles, n_tiles=n_tiles),
      out_type=out_type,
      grid=(min(num_sms, problem.batch * m_tiles * n_tiles),),
      warpgroup_semantics=config.warpgroup_semantics,
      interpret=params,
  )
  operands = [a, b] + ([c] if c is not None else []) + (
      [bias] if bias is not None else [])
  out = call_kernel(kernel, operands, out_type, params)
  return tma.unpad_output(out, problem.m, problem.n, on_gpu=params is None)


def supports(problem: GemmProblem, device: DeviceInfo) -> str | None:
  return hopper_unsupported(problem, device)


def heuristic(problem: GemmProblem, device: DeviceInfo) -> MosaicConfig:
  return heuristics.ws_heuristic(problem, device.planning_sms)


#: A stored config whose CTA tiles cost more than this times the
#: heuristic's (`heuristics.critical_path`) gives way to the heuristic. Its
#: own tuning won by a few percent; a tile tuned on a bigger shape can
#: leave half the SMs idle on a smaller one of the nearest bucket.
STORED_TILE_COST_LIMIT = 1.25


def check_config(config: MosaicConfig, problem: GemmProblem,
                 device: DeviceInfo) -> str | None:
  """Why a stored config must not serve this problem.

  Besides shared memory, a config tuned for one shape may tile another one
  of its bucket badly: a tile that divides 4096 leaves a nearly empty extra
  wave at 4097, and a 256-row tile tuned at 2048 rows makes 20 CTAs at
  1024x640, where the heuristic's 128-row tile makes 40 of half the work.
  The heuristic weighs waves and tile sizes, so a stored config that needs
  more waves of CTA tiles than the heuristic's, or whose critical path is
  over `STORED_TILE_COST_LIMIT` times the heuristic's, gives way to it.
  """
  if not config.fits(problem):
    return f"needs {config.smem_bytes(problem)} bytes of shared memory"
  sms = device.planning_sms
  fallback = heuristic(problem, device)
  stored = heuristics.waves(problem, config, sms)
  fallback_waves = heuristics.waves(problem, fallback, sms)
  if stored > fallback_waves:
    return (f"makes {stored} waves of CTA tiles where the heuristic makes "
            f"{fallback_waves}")
  cost = heuristics.critical_path(problem, config, sms)
  fallback_cost = heuristics.critical_path(problem, fallback, sms)
  if cost > STORED_TILE_COST_LIMIT * fallback_cost:
    return (f"its {config.cta_tile_m}x{config.cta_tile_n} CTA tiles make a "
            f"critical path {cost / fallback_cost:.2f}x the heuristic's "
            f"{fallback.cta_tile_m}x{fallback.cta_tile_n} tiles' (limit "
            f"{STORED_TILE_COST_LIMIT}x)")
  return None


def search_space(problem: GemmProblem, device: DeviceInfo):
  del device
  return heuristics.ws_candidates(problem)


autotune.register_tunable(registry.KernelEntry(
    name=NAME, fn=ws_persistent_matmul, config_cls=MosaicConfig,
    supports=supports, heuristic=heuristic, check_config=check_config,
    runs_on_cpu=True,
    description=("persistent warp-specialised wgmma GEMM: TMA ring across "
                 "tiles, 2 consumer warpgroups, fused TMA-store epilogue"),
), search_space)
