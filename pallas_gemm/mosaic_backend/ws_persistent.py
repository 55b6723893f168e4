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
"""

from __future__ import annotations

import functools
import threading

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_gemm import autotune, registry
from pallas_gemm.devices import DeviceInfo, device_info
from pallas_gemm.mosaic_backend import heuristics, tma
from pallas_gemm.mosaic_backend.configs import (HOPPER_SMEM_BYTES,
                                                Dim, MosaicConfig,
                                                hopper_unsupported)
from pallas_gemm.mosaic_backend.tma import tiled_transforms
from pallas_gemm.problem import GemmProblem, apply_epilogue, cdiv

NAME = "mosaic/ws_persistent"

PRODUCER_REGISTERS = 40
CONSUMER_REGISTERS = 232
NUM_CONSUMERS = 2
#: CTAs of the persistent grid in interpret mode: two, so that the
#: round-robin tile hand-out and the cross-tile ring are exercised.
INTERPRET_CTAS = 2

#: The Mosaic GPU interpreter is not thread-safe (its shared-memory and
#: barrier bookkeeping is process-global): interpret calls are serialised.
_INTERPRET_LOCK = threading.Lock()


def interpret_params(interpret):
  """Maps the registry's `interpret` flag onto what `plgpu.kernel` takes.

  Callers (tests) may also pass their own `plgpu.InterpretGPUParams`, e.g.
  with `detect_races=True`.
  """
  if isinstance(interpret, plgpu.InterpretGPUParams):
    return interpret
  return plgpu.InterpretGPUParams() if interpret else None


def call_kernel(kernel, operands, out_type, params):
  """Runs a `plgpu.kernel`, compiled or (params set) in GPU interpret mode.

  The interpreter drives the kernel through ordered io_callbacks, and that
  effect cannot pass through the `pallas_gemm_p` lowering (`mlir.lower_fun`
  raises a KeyError on it). Inside a pure_callback the interpretation runs
  as its own eager computation, with no effect leaking out.

  The Mosaic GPU interpreter is not thread-safe; interpret calls are
  serialised (one module-level lock around the host callback), so threads
  that call a Mosaic kernel on a CPU take turns.

  The interpretation also runs with x64 off. The interpreter lowers parts
  of the kernel on worker threads of its own, which do not see a caller's
  thread-local `jax.enable_x64(True)`; loop counters traced as int64 then
  fail MLIR verification there. No operand of these kernels is 64-bit, so
  with x64 off every thread sees the same 32-bit types and nothing else
  changes.
  """
  if params is None:
    return kernel(*operands)
  interpreted = jax.jit(kernel)

  def on_host(*arrays):
    with _INTERPRET_LOCK, jax.enable_x64(False):
      return np.asarray(interpreted(*arrays))

  return jax.pure_callback(on_host, out_type, *operands)


def index(value):
  """`value` as an int32 scalar, for kernel index arithmetic, which stays
  32-bit whether or not x64 is enabled: `lax.div`/`lax.rem` take no mixed
  dtypes, and under x64 a Python int (or a `fori_loop` counter started from
  one) is int64. A Python int becomes a NumPy constant, which keeps a
  `fori_loop` bound static (a static trip count lowers to a scan); an int32
  value is returned unchanged, so without x64 the kernel traces exactly as
  with plain ints."""
  if isinstance(value, (int, np.integer)):
    return np.int32(value)
  return value if value.dtype == jnp.int32 else value.astype(jnp.int32)


def tile_coordinates(linear, *, m_tiles, n_tiles, band_dim: Dim, band: int):
  """(batch, m, n) tile indices of the `linear`-th output tile (int32).

  Tiles are grouped into bands of `band` tiles along `band_dim`; inside a band
  consecutive tiles walk across it, then step along the other dimension; odd
  bands run backwards so that the turn between bands reuses operand tiles.
  """
  linear = index(linear)
  per_batch = m_tiles * n_tiles
  batch_idx = lax.div(linear, index(per_batch))
  within_batch = lax.rem(linear, index(per_batch))
  across, along = ((m_tiles, n_tiles) if band_dim == Dim.M
                   else (n_tiles, m_tiles))
  band_size = band * along
  band_idx = lax.div(within_batch, index(band_size))
  within_band = lax.rem(within_batch, index(band_size))
  band_start = band_idx * band
  height = jnp.minimum(band, across - band_start)
  across_idx = band_start + lax.rem(within_band, height)
  along_idx = lax.div(within_band, height)
  along_idx = jnp.where(lax.rem(band_idx, index(2)) == 1,
                        along - 1 - along_idx, along_idx)
  if band_dim == Dim.M:
    return batch_idx, across_idx, along_idx
  return batch_idx, along_idx, across_idx


def drain_ring(stage_consumed, *, num_tiles: int, k_iters: int, stages: int):
  """The producer's last act: await the final `stages` releases of the ring,
  which no later load waited for, so that no barrier is left with an
  unobserved phase. This CTA ran every `num_ctas`-th of `num_tiles` tiles
  (the round-robin of `plgpu.nd_loop`), `k_iters` ring steps each."""
  cta = lax.axis_index("sm")
  num_ctas = index(lax.axis_size("sm"))
  local_tiles = lax.div(index(num_tiles), num_ctas) + (
      cta < lax.rem(index(num_tiles), num_ctas)).astype(jnp.int32)
  total_steps = local_tiles * k_iters

  def drain(step, carry):
    plgpu.barrier_wait(stage_consumed.at[lax.rem(step, index(stages))])
    return carry

  lax.fori_loop(jnp.maximum(total_steps - stages, 0), total_steps, drain, None)


def run_producer(*, num_tiles: int, k_iters: int, stages: int, stage_consumed,
                 coords, load_step):
  """The producer warpgroup of a persistent, warp-specialised GEMM.

  It gives registers away, walks this CTA's tiles (`coords(linear)` names
  one) and, for each of their `k_iters` steps, waits until the ring stage
  the step uses is free (the first pass finds every stage free), then calls
  `load_step(tile, kk, slot)` to issue that step's TMA copies into stage
  `slot`. The ring's step counter runs on across tiles. Finally it drains the
  ring (`drain_ring`)."""
  plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")

  @plgpu.nd_loop((num_tiles,), collective_axes="sm")
  def _tile(info):
    tile = coords(info.index[0])
    first_step = info.local_index * k_iters

    def load_stage(kk, carry):
      kk = index(kk)
      step = first_step + kk
      slot = lax.rem(step, index(stages))

      @pl.when(step >= stages)
      def _wait_free():
        plgpu.barrier_wait(stage_consumed.at[slot])

      load_step(tile, kk, slot)
      return carry

    lax.fori_loop(index(0), index(k_iters), load_stage, None)

  drain_ring(stage_consumed, num_tiles=num_tiles, k_iters=k_iters,
             stages=stages)


def consumer_offsets(config, wg, tile_m: int, tile_n: int):
  """(row, column) offset of consumer warpgroup `wg`'s part of the CTA tile,
  which the two consumers split along `config.wg_dimension`."""
  if config.wg_dimension == Dim.M:
    return wg * tile_m, 0
  return 0, wg * tile_n


def store_epilogue(acc, *, problem: GemmProblem, config, wg, batch_idx, row0,
                   col0, out_gmem, out_smem, c_gmem=None, c_smem=None,
                   c_loaded=None, bias_gmem=None, bias_smem=None,
                   bias_loaded=None):
  """Applies the fused epilogue to one consumer's f32 accumulator `acc`
  (tile_m x tile_n, at (row0, col0) of batch `batch_idx`) and TMA-stores it
  in epi_tile_m x epi_tile_n pieces through `out_slots` staging buffers."""
  tile_m, tile_n = config.tile_m, config.tile_n
  epi_m, epi_n = config.epi_tile_m, config.epi_tile_n
  out_slots = config.out_slots
  if bias_gmem is not None:
    plgpu.copy_gmem_to_smem(bias_gmem.at[pl.ds(col0, tile_n)],
                            bias_smem.at[wg], bias_loaded.at[wg])
    plgpu.barrier_wait(bias_loaded.at[wg])
  epi_index = 0
  for ei in range(tile_m // epi_m):
    for ej in range(tile_n // epi_n):
      slot = epi_index % out_slots
      epi_index += 1
      rows = pl.ds(row0 + ei * epi_m, epi_m)
      cols = pl.ds(col0 + ej * epi_n, epi_n)
      part = acc[ei * epi_m:(ei + 1) * epi_m, ej * epi_n:(ej + 1) * epi_n]
      c_part = bias_part = None
      if c_gmem is not None:
        plgpu.copy_gmem_to_smem(c_gmem.at[batch_idx, rows, cols],
                                c_smem.at[wg], c_loaded.at[wg])
        plgpu.barrier_wait(c_loaded.at[wg])
        c_part = c_smem[wg]
      if bias_gmem is not None:
        bias_vec = plgpu.load(
            bias_smem.at[wg, pl.ds(ej * epi_n, epi_n)],
            layout=plgpu.Layout.WGMMA.reduce(0))
        bias_part = lax.broadcast_in_dim(bias_vec, (epi_m, epi_n), (1,))
      value = apply_epilogue(part, problem.epilogue, c_part, bias_part)
      # The TMA store that last read this slot must be done with it.
      plgpu.wait_smem_to_gmem(out_slots - 1, wait_read_only=True)
      out_smem[wg, slot] = value.astype(out_gmem.dtype)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(out_smem.at[wg, slot],
                              out_gmem.at[batch_idx, rows, cols])


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
  out_dtype = out_gmem.dtype
  tile_m, tile_n, tile_k = config.tile_m, config.tile_n, config.tile_k
  cta_m, cta_n = config.cta_tile_m, config.cta_tile_n
  epi_m, epi_n = config.epi_tile_m, config.epi_tile_n
  stages = config.max_concurrent_steps
  out_slots = config.out_slots
  num_tiles = problem.batch * m_tiles * n_tiles

  a_block = (tile_k, cta_m) if transpose_a else (cta_m, tile_k)
  b_block = (cta_n, tile_k) if transpose_b else (tile_k, cta_n)
  a_transforms = tiled_transforms(a_block[1], in_dtype)
  b_transforms = tiled_transforms(b_block[1], in_dtype)
  out_transforms = tiled_transforms(epi_n, out_dtype)

  def coords(linear):
    return tile_coordinates(linear, m_tiles=m_tiles, n_tiles=n_tiles,
                            band_dim=config.band_dim, band=config.grid_band)

  def slot_of(step):
    return lax.rem(step, index(stages))

  def scoped(a_smem, b_smem, stage_loaded, stage_consumed, out_smem, c_smem,
             c_loaded, bias_smem, bias_loaded):
    wg = lax.axis_index("wg")

    def load_step(tile, kk, slot):
      batch_idx, m_idx, n_idx = tile
      m_slice = pl.ds(m_idx * cta_m, cta_m)
      n_slice = pl.ds(n_idx * cta_n, cta_n)
      k_slice = pl.ds(kk * tile_k, tile_k)
      a_src = (a_gmem.at[batch_idx, k_slice, m_slice] if transpose_a
               else a_gmem.at[batch_idx, m_slice, k_slice])
      b_src = (b_gmem.at[batch_idx, n_slice, k_slice] if transpose_b
               else b_gmem.at[batch_idx, k_slice, n_slice])
      plgpu.copy_gmem_to_smem(a_src, a_smem.at[slot], stage_loaded.at[slot])
      plgpu.copy_gmem_to_smem(b_src, b_smem.at[slot], stage_loaded.at[slot])

    @pl.when(wg == NUM_CONSUMERS)
    def _producer():
      run_producer(num_tiles=num_tiles, k_iters=k_iters, stages=stages,
                   stage_consumed=stage_consumed, coords=coords,
                   load_step=load_step)

    @pl.when(wg < NUM_CONSUMERS)
    def _consumer():
      plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")
      wg_m_offset, wg_n_offset = consumer_offsets(config, wg, tile_m, tile_n)

      def a_view(slot):
        if transpose_a:
          return a_smem.at[slot, :, pl.ds(wg_m_offset, tile_m)].T
        return a_smem.at[slot, pl.ds(wg_m_offset, tile_m), :]

      def b_view(slot):
        if transpose_b:
          return b_smem.at[slot, pl.ds(wg_n_offset, tile_n), :].T
        return b_smem.at[slot, :, pl.ds(wg_n_offset, tile_n)]

      def compute_tile(batch_idx, m_idx, n_idx, first_step):
        def mma_scope(acc_ref):
          def mma_stage(kk, carry):
            kk = index(kk)
            step = first_step + kk
            slot = slot_of(step)
            plgpu.barrier_wait(stage_loaded.at[slot])
            plgpu.wgmma(acc_ref, a_view(slot), b_view(slot))
            # One wgmma group stays in flight; the one before it has now
            # finished reading its stage, which goes back to the producer.
            plgpu.wgmma_wait(1)

            @pl.when(kk > 0)
            def _release_previous():
              plgpu.barrier_arrive(stage_consumed.at[slot_of(step - 1)])
            return carry

          lax.fori_loop(index(0), index(k_iters), mma_stage, None)
          plgpu.wgmma_wait(0)
          plgpu.barrier_arrive(
              stage_consumed.at[slot_of(first_step + k_iters - 1)])
          return acc_ref[...]

        acc = pl.run_scoped(mma_scope, plgpu.ACC((tile_m, tile_n), jnp.float32))

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

  c_dtype = c_gmem.dtype if has_c else None
  pl.run_scoped(
      scoped,
      a_smem=plgpu.SMEM((stages, *a_block), in_dtype, transforms=a_transforms),
      b_smem=plgpu.SMEM((stages, *b_block), in_dtype, transforms=b_transforms),
      stage_loaded=plgpu.Barrier(num_arrivals=2, num_barriers=stages),
      stage_consumed=plgpu.Barrier(num_arrivals=NUM_CONSUMERS,
                                   num_barriers=stages),
      out_smem=plgpu.SMEM((NUM_CONSUMERS, out_slots, epi_m, epi_n), out_dtype,
                          transforms=out_transforms),
      c_smem=(plgpu.SMEM((NUM_CONSUMERS, epi_m, epi_n), c_dtype,
                         transforms=tiled_transforms(epi_n, c_dtype))
              if has_c else None),
      c_loaded=plgpu.Barrier(num_barriers=NUM_CONSUMERS) if has_c else None,
      bias_smem=(plgpu.SMEM((NUM_CONSUMERS, tile_n), jnp.float32)
                 if has_bias else None),
      bias_loaded=(plgpu.Barrier(num_barriers=NUM_CONSUMERS)
                   if has_bias else None),
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
  out_dims = tma.padded_dims(
      problem.m, problem.n, tma.tma_tiling(config.epi_tile_n, problem.out_dtype),
      (cta_m, cta_n))
  if c is not None:
    c = tma.pad_to_tiling(c, tma.tma_tiling(config.epi_tile_n, c.dtype),
                          (cta_m, cta_n))
  if bias is not None:
    bias = tma.pad_vector(bias.astype(jnp.float32), cta_n)
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
  num_ctas = min(num_sms, problem.batch * m_tiles * n_tiles)
  semantics = (plgpu.LoweringSemantics.Warpgroup if config.warpgroup_semantics
               else plgpu.LoweringSemantics.Lane)
  out_type = jax.ShapeDtypeStruct((problem.batch, m_out, n_out),
                                  jnp.dtype(problem.out_dtype))
  kernel = plgpu.kernel(
      functools.partial(_kernel_body, problem=problem, config=config,
                        k_iters=k_iters, m_tiles=m_tiles, n_tiles=n_tiles),
      out_type=out_type,
      grid=(num_ctas,),
      grid_names=("sm",),
      num_threads=NUM_CONSUMERS + 1,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(lowering_semantics=semantics),
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


def check_config(config: MosaicConfig, problem: GemmProblem,
                 device: DeviceInfo) -> str | None:
  """Why a stored config must not serve this problem.

  Besides shared memory, a config tuned for one shape may tile another one
  of its bucket badly: a tile that divides 4096 leaves a nearly empty extra
  wave at 4097. The heuristic weighs waves, so a stored config that needs
  more waves of CTA tiles than the heuristic's gives way to it.
  """
  if not config.fits(problem):
    return f"needs {config.smem_bytes(problem)} bytes of shared memory"
  sms = device.planning_sms
  stored = heuristics.waves(problem, config, sms)
  fallback = heuristics.waves(problem, heuristic(problem, device), sms)
  if stored > fallback:
    return (f"makes {stored} waves of CTA tiles where the heuristic makes "
            f"{fallback}")
  return None


def search_space(problem: GemmProblem, device: DeviceInfo):
  del device
  return heuristics.ws_candidates(problem)


autotune.register_search_space(NAME, search_space)


registry.register(registry.KernelEntry(
    name=NAME,
    fn=ws_persistent_matmul,
    supports=supports,
    heuristic=heuristic,
    check_config=check_config,
    config_cls=MosaicConfig,
    runs_on_cpu=True,
    description=("persistent warp-specialised wgmma GEMM: TMA ring across "
                 "tiles, 2 consumer warpgroups, fused TMA-store epilogue"),
))
