"""What the persistent, warp-specialised Mosaic GPU kernels share: the
dense GEMM (`ws_persistent.py`), `mosaic/fp8`, the fused GLU and the
grouped GEMM (`ragged_dot/mosaic*.py`).

One CTA per SM; its last warpgroup (the producer) only issues TMA loads
into a ring of shared-memory stages (`run_producer`), and the
NUM_CONSUMERS consumer warpgroups run wgmma on each stage as soon as it
lands (`consume_ring`), then store their part of the output tile. The
ring's step counter runs on across a CTA's tiles, so the producer loads
the next tile while the consumers run this one's epilogue.
"""

from __future__ import annotations

import threading
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_gemm.mosaic_backend import tma
from pallas_gemm.mosaic_backend.configs import NUM_CONSUMERS, Dim
from pallas_gemm.mosaic_backend.tma import swizzled_transforms, tiled_transforms
from pallas_gemm.problem import GemmProblem, apply_epilogue

PRODUCER_REGISTERS = 40
CONSUMER_REGISTERS = 232
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
      return jax.tree.map(np.asarray, interpreted(*arrays))

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


class Ring(NamedTuple):
  """The TMA ring of a warp-specialised kernel: `stages` shared-memory
  stages; `loaded[slot]` fires when a stage's TMA loads have landed and
  `consumed[slot]` once every consumer has released it.

  A ring whose tiles alternate between the consumers (each consumer runs
  whole tiles of its own: `ring_smem(owners=NUM_CONSUMERS)`) has one set of
  `loaded` barriers per consumer, so that each consumer waits only on the
  loads of its own tiles and its barrier phases stay in step; `owner`
  picks the set (barrier owner * stages + slot)."""
  stages: int
  loaded: Any
  consumed: Any
  owner: Any = 0

  def slot(self, step):
    """The stage of ring step `step` (the step counter runs on across
    tiles)."""
    return lax.rem(step, index(self.stages))

  def loaded_barrier(self, slot):
    """The barrier that fires when stage `slot`'s loads for this ring's
    owner have landed."""
    if isinstance(self.owner, int) and self.owner == 0:
      return self.loaded.at[slot]
    return self.loaded.at[index(self.owner) * index(self.stages) + slot]


class RingStep(NamedTuple):
  """Where a consumer's k-step stands: `kk` counts the tile's steps from 0,
  `step` is its position on the ring, `slot` the stage it reads."""
  kk: Any
  step: Any
  slot: Any


def tiles_of_this_cta(num_tiles):
  """How many of `num_tiles` (static or traced) this CTA runs when they are
  handed out round-robin over the grid's CTAs (as `plgpu.nd_loop` and
  `for_each_tile` do)."""
  cta = index(lax.axis_index("sm"))
  num_ctas = index(lax.axis_size("sm"))
  return lax.div(jnp.maximum(num_tiles - cta + num_ctas - 1, 0), num_ctas)


def for_each_tile(num_tiles, body, carry):
  """Runs `body(linear_tile, carry)` over this CTA's share of `num_tiles`
  (a traced count) handed out round-robin; returns the final carry."""
  cta = index(lax.axis_index("sm"))
  num_ctas = index(lax.axis_size("sm"))
  return lax.fori_loop(index(0), tiles_of_this_cta(num_tiles),
                       lambda i, c: body(cta + i * num_ctas, c), carry)


def drain_ring(ring: Ring, total_steps, awaited=None):
  """The producer's last act: await the releases of the ring that no later
  load waited for, so that no barrier is left with an unobserved phase.
  `total_steps` counts the ring steps this CTA ran; `awaited`, the steps
  whose release the producer has awaited (by default all but the final
  `stages`)."""
  if awaited is None:
    awaited = jnp.maximum(total_steps - ring.stages, 0)

  def drain(step, carry):
    plgpu.barrier_wait(ring.consumed.at[ring.slot(step)])
    return carry

  lax.fori_loop(awaited, total_steps, drain, None)


class SideWork(NamedTuple):
  """Work the producer interleaves with its loads (`run_producer`): a
  carry that starts as `init`, `after_load(carry) -> carry` after each load
  step, and `finish(carry)` once the tiles are walked, before the drain."""
  init: Any
  after_load: Any
  finish: Any


def run_producer(ring: Ring, *, num_tiles, steps, coords, load_step,
                 side_work: SideWork | None = None, lookahead=None,
                 walk=None):
  """The producer warpgroup of a persistent, warp-specialised kernel.

  It gives registers away, walks this CTA's tiles (`coords(linear)` names
  one: whatever `load_step` needs of it, computed once per tile) and, for
  each of a tile's ring steps, waits until the stage the step uses is free
  (the first pass finds every stage free), then calls
  `load_step(tile, kk, slot)` to issue the TMA copies of the tile's step kk
  into stage `slot`. The ring's step counter runs on across tiles. Finally
  it drains the ring (`drain_ring`).

  `steps` is the static step count of every tile, whose tiles are then
  handed out by `plgpu.nd_loop` as the consumers' are; or a function of the
  tile giving its traced count (a device-side work list), whose tiles are
  walked by `for_each_tile`, the ring position carried from tile to tile.

  `side_work` (only with a traced step count) runs between the loads.

  `walk(body, carry)` (only with a traced step count) replaces the
  round-robin walk over the CTA's tiles: it calls `body(linear, turn,
  carry)` for each tile it picks, `turn` its number among the tiles the
  consumers run, and the producer then names the tile as
  `coords(linear, turn)` (`tile_claims.producer_walk`).

  `lookahead(tile)` (only with a traced step count), a traced count of at
  least 2, caps the ring steps this tile's loads keep in flight (loaded and
  not yet released) below the ring's depth: before loading step s the
  producer awaits the release of every step up to s - lookahead. It keeps
  a count of the steps whose release it has awaited, so that each release
  is awaited once, in order, whatever the caps of consecutive tiles (a
  cap of 1 would wait for a release that needs the step being loaded).
  """
  plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")

  if ((side_work is not None or lookahead is not None or walk is not None)
      and not callable(steps)):
    raise ValueError("run_producer's side_work, lookahead and walk need a "
                     "traced step count (steps a function of the tile)")
  after_load = side_work.after_load if side_work else lambda carry: carry

  def await_release(step):
    plgpu.barrier_wait(ring.consumed.at[ring.slot(step)])
    return step + 1

  def load_tile(tile, first_step, tile_steps, side=None, awaited=None):
    limit = None if lookahead is None else lookahead(tile)

    def load_stage(kk, carry):
      side, awaited = carry
      kk = index(kk)
      step = first_step + kk
      slot = ring.slot(step)
      if limit is None:
        @pl.when(step >= ring.stages)
        def _wait_free():
          plgpu.barrier_wait(ring.consumed.at[slot])
      else:
        # Every step up to step - limit released (step - stages among them:
        # this step's stage is free).
        awaited = lax.while_loop(lambda w: w <= step - limit, await_release,
                                 awaited)

      load_step(tile, kk, slot)
      return after_load(side), awaited

    return lax.fori_loop(index(0), index(tile_steps), load_stage,
                         (side, awaited))

  if callable(steps):
    def next_tile(linear, turn, carry):
      first_step, side, awaited = carry
      tile = coords(linear) if turn is None else coords(linear, turn)
      tile_steps = steps(tile)
      side, awaited = load_tile(tile, first_step, tile_steps, side, awaited)
      return first_step + tile_steps, side, awaited

    if walk is None:  # round-robin: no turn numbers
      walk = lambda body, carry: for_each_tile(
          num_tiles, lambda linear, c: body(linear, None, c), carry)
    total_steps, side, awaited = walk(
        next_tile, (index(0), side_work.init if side_work else None,
                    None if lookahead is None else index(0)))
    if side_work is not None:
      side_work.finish(side)
  else:
    @plgpu.nd_loop((num_tiles,), collective_axes="sm")
    def _tile(info):
      load_tile(coords(info.index[0]), info.local_index * steps, steps)

    total_steps = tiles_of_this_cta(index(num_tiles)) * steps
    awaited = None
  drain_ring(ring, total_steps, awaited)


def consume_ring(ring: Ring, mma_step, *, first_step, steps, accumulators=(),
                 in_flight: int = 1):
  """A consumer warpgroup's main loop over `steps` ring steps (an int, or
  a traced count that may be 0) from ring position `first_step`.

  Each step waits for its stage's TMA loads and calls
  `mma_step(RingStep, *acc_refs)` to issue the step's wgmma(s) into the
  accumulators, then waits until only `in_flight` wgmma groups (this
  step's) are pending: the previous step's are done reading their stage,
  which goes back to the producer. After the loop every wgmma is awaited
  and the last stage released. The accumulators are `plgpu.ACC` shapes,
  scoped here; returns their final values (a tuple, () for none).
  """
  def run(*acc_refs):
    def mma_stage(kk, carry):
      kk = index(kk)
      step = first_step + kk
      slot = ring.slot(step)
      plgpu.barrier_wait(ring.loaded_barrier(slot))
      mma_step(RingStep(kk, step, slot), *acc_refs)
      plgpu.wgmma_wait(in_flight)

      @pl.when(kk > 0)
      def _release_previous():
        plgpu.barrier_arrive(ring.consumed.at[ring.slot(step - 1)])
      return carry

    lax.fori_loop(index(0), index(steps), mma_stage, None)
    plgpu.wgmma_wait(0)

    @pl.when(steps > 0)  # for a static count, a plain Python `if`
    def _release_last():
      plgpu.barrier_arrive(ring.consumed.at[ring.slot(first_step + steps - 1)])
    return tuple(acc_ref[...] for acc_ref in acc_refs)

  return pl.run_scoped(run, *accumulators) if accumulators else run()


def run_warpgroups(producer, consumer):
  """Runs `producer()` on the producer warpgroup (the last one) and
  `consumer(wg)` on consumer warpgroup wg, which first takes the registers
  the producer gives away."""
  wg = lax.axis_index("wg")

  @pl.when(wg == NUM_CONSUMERS)
  def _producer():
    producer()

  @pl.when(wg < NUM_CONSUMERS)
  def _consumer():
    plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")
    consumer(wg)


def ring_smem(stages: int, *, loads: int | None = None, owners: int = 1,
              cluster_axes: tuple[str, ...] | None = None,
              row_addressed: tuple[str, ...] = (), swizzle: int | None = None,
              **operands):
  """The shared memory of a TMA ring, as `pl.run_scoped` keyword arguments:
  a buffer of `stages` blocks for each named operand (block shape, dtype),
  swizzled along the block's minor dimension, and the barriers
  `stage_loaded` (one arrival per TMA copy of a stage: `loads`, by default
  one per operand) and `stage_consumed` (one per consumer).

  With `owners=NUM_CONSUMERS` the consumers take turns at whole tiles
  (see `Ring`): `stage_loaded` holds a set of `stages` barriers per
  consumer, and a stage is released by the one consumer that read it.

  With `cluster_axes`, a TMA multicast writes each stage of every CTA of the
  cluster, so `stage_consumed` is a cluster barrier: a stage is free only
  once its readers in every CTA of the cluster have released it.

  Each operand named in `row_addressed` is a pair of views of one buffer
  (`row_addressed_smem`): the tiled one for wgmma, and an untiled one for
  the TMA loads, whose source rows then need not be whole 8-row tiles.

  `swizzle` (bytes) narrows every operand's swizzle from the widest its
  block's minor dimension allows, e.g. where wgmma reads the blocks'
  rows as K in steps narrower than the widest span (excludes
  `row_addressed`, whose views are one 128-byte span a row)."""
  if owners not in (1, NUM_CONSUMERS):
    raise ValueError(f"owners={owners} must be 1 or {NUM_CONSUMERS}")
  unknown = set(row_addressed) - set(operands)
  if unknown:
    raise ValueError(f"row_addressed names {sorted(unknown)}, which are not "
                     f"operands ({sorted(operands)})")
  if swizzle is not None and row_addressed:
    raise ValueError(f"swizzle={swizzle} excludes row_addressed operands "
                     f"{sorted(row_addressed)} (one 128-byte span a row)")
  scratch = {
      name: (row_addressed_smem((stages, *block), dtype)
             if name in row_addressed else
             plgpu.SMEM((stages, *block), dtype,
                        transforms=(tiled_transforms(block[-1], dtype)
                                    if swizzle is None else
                                    swizzled_transforms(swizzle, dtype))))
      for name, (block, dtype) in operands.items()}
  scratch["stage_loaded"] = plgpu.Barrier(
      num_arrivals=len(operands) if loads is None else loads,
      num_barriers=stages * owners)
  releases = NUM_CONSUMERS if owners == 1 else 1
  if cluster_axes:
    scratch["stage_consumed"] = plgpu.ClusterBarrier(
        collective_axes=cluster_axes, num_arrivals=releases,
        num_barriers=stages)
  else:
    scratch["stage_consumed"] = plgpu.Barrier(num_arrivals=releases,
                                              num_barriers=stages)
  return scratch


def rows_addressable(minor_elems: int, dtype) -> bool:
  """Whether a shared-memory block whose rows hold `minor_elems` elements
  can be `row_addressed_smem`: its row is exactly one swizzle span, so the
  tiled layout is plain rows, swizzled."""
  return tma.tma_tiling(minor_elems, dtype)[1] == minor_elems


def row_addressed_smem(shape, dtype):
  """(wgmma view, load view) of one swizzled buffer whose row is one
  swizzle span (`rows_addressable`). The wgmma view is tiled (8-row tiles);
  the load view only swizzled. Both put row r at the same bytes and the TMA
  unit swizzles by shared-memory address, so a TMA load through the load
  view fills what wgmma reads through the other. A load through the tiled
  view needs the whole source array in 8-row tiles (Mosaic refuses other
  row counts); the untiled one does not, so an operand of any row count is
  read in place instead of padded (a copy)."""
  if not rows_addressable(shape[-1], dtype):
    raise ValueError(f"a row of {shape[-1]} {jnp.dtype(dtype).name} elements "
                     "is not one swizzle span")
  transforms = tiled_transforms(shape[-1], dtype)
  return plgpu.RefUnion(plgpu.SMEM(shape, dtype, transforms=transforms),
                        plgpu.SMEM(shape, dtype, transforms=transforms[1:]))


def out_staging_smem(out_slots: int, epi_tile, dtype):
  """Each consumer's `out_slots` swizzled staging buffers of the output
  sub-tiles its epilogue TMA-stores."""
  return plgpu.SMEM((NUM_CONSUMERS, out_slots, *epi_tile), dtype,
                    transforms=tiled_transforms(epi_tile[-1], dtype))


def warp_specialised_kernel(body, *, out_type, grid, interpret,
                            warpgroup_semantics: bool = False,
                            approx_math: bool = False, **cluster):
  """`plgpu.kernel` of a persistent grid of CTAs (axis "sm"), each of a
  producer and NUM_CONSUMERS consumer warpgroups (axis "wg")."""
  semantics = (plgpu.LoweringSemantics.Warpgroup if warpgroup_semantics
               else plgpu.LoweringSemantics.Lane)
  return plgpu.kernel(
      body,
      out_type=out_type,
      grid=grid,
      grid_names=("sm",),
      num_threads=NUM_CONSUMERS + 1,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(lowering_semantics=semantics,
                                           approx_math=approx_math),
      interpret=interpret,
      **cluster,
  )


def step_slices(config, tile, kk):
  """What step kk of a dense GEMM's CTA tile (batch, m, n) loads: (batch,
  A's rows, B's columns, the K range)."""
  batch_idx, m_idx, n_idx = tile
  return (batch_idx, pl.ds(m_idx * config.cta_tile_m, config.cta_tile_m),
          pl.ds(n_idx * config.cta_tile_n, config.cta_tile_n),
          pl.ds(kk * config.tile_k, config.tile_k))


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


def padded_out_dims(problem, config) -> tuple[int, int]:
  """The (m, n) of the output array the kernel writes: whole TMA tiles of
  its epi_tile_n-wide stores (see `tma.padded_dims`)."""
  return tma.padded_dims(
      problem.m, problem.n,
      tma.tma_tiling(config.epi_tile_n, problem.out_dtype),
      (config.cta_tile_m, config.cta_tile_n))


def pad_epilogue_operands(c, bias, problem: GemmProblem, config):
  """C and the bias (either may be None) padded as `store_epilogue` reads
  them, and the padded output dims."""
  cta_m, cta_n = config.cta_tile_m, config.cta_tile_n
  out_dims = padded_out_dims(problem, config)
  if c is not None:
    c = tma.pad_to_tiling(c, tma.tma_tiling(config.epi_tile_n, c.dtype),
                          (cta_m, cta_n))
  if bias is not None:
    bias = tma.pad_vector(bias.astype(jnp.float32), cta_n)
  return c, bias, out_dims


def epilogue_smem(config, out_dtype, *, c_dtype=None, has_bias=False):
  """The shared memory `store_epilogue` uses, as `pl.run_scoped` keyword
  arguments: the output staging buffers, and (None without them) each
  consumer's staging of a C sub-tile and of its tile_n bias entries."""
  epi_m, epi_n = config.epi_tile_m, config.epi_tile_n
  has_c = c_dtype is not None
  return dict(
      out_smem=out_staging_smem(config.out_slots, (epi_m, epi_n), out_dtype),
      c_smem=(plgpu.SMEM((NUM_CONSUMERS, epi_m, epi_n), c_dtype,
                         transforms=tiled_transforms(epi_n, c_dtype))
              if has_c else None),
      c_loaded=plgpu.Barrier(num_barriers=NUM_CONSUMERS) if has_c else None,
      bias_smem=(plgpu.SMEM((NUM_CONSUMERS, config.tile_n), jnp.float32)
                 if has_bias else None),
      bias_loaded=(plgpu.Barrier(num_barriers=NUM_CONSUMERS)
                   if has_bias else None),
  )
