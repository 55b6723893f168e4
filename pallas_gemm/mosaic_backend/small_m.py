"""`mosaic/small_m`: decode-shaped GEMMs (M <= 128), which are bandwidth-bound.

With a handful of rows there are too few output tiles to occupy the SMs, yet
the whole weight B has to stream through once. The grid therefore splits the
work two ways: each CTA owns one `tile_n`-wide column strip of the output and
one contiguous share of K, so `n_tiles * k_splits` CTAs stream disjoint parts
of B at once, each through a `max_concurrent_steps`-deep TMA ring into wgmma.

wgmma always multiplies 64 (or 128) rows of A. Only the real rows (rounded
up to 8) are loaded; the rest of the A stage is never written, so those
accumulator rows hold garbage, and the TMA store drops rows past M. A TMA
box that runs dozens of rows past the end of A slowed the whole kernel on
the H200 (M=1 then ran slower than M=64; see "Numbers cited by the code" in
experiments/results/nvidia_h200/mosaic/README.md), hence this.

When K is split, each CTA writes its f32 partial tile and XLA adds the
partials in a fixed order, then applies the epilogue: deterministic, and the
heuristic only splits when the partials are small next to B.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_gemm import autotune, registry
from pallas_gemm.devices import DeviceInfo
from pallas_gemm.mosaic_backend import heuristics, tma
from pallas_gemm.mosaic_backend.configs import (HOPPER_SMEM_BYTES,
                                                hopper_unsupported,
                                                SmallMConfig, SplitKConfig,
                                                small_m_tile_m)
from pallas_gemm.mosaic_backend.tma import tiled_transforms
from pallas_gemm.mosaic_backend.warp_specialised import (call_kernel, index,
                                                         interpret_params)
from pallas_gemm.problem import GemmProblem, apply_epilogue, cdiv

NAME = "mosaic/small_m"
MAX_M = 128


def _kernel_body(*refs, problem: GemmProblem,
                 config: SmallMConfig | SplitKConfig, tile_m: int, rows: int,
                 m_tiles: int, n_tiles: int, steps_per_split: int,
                 fused_epilogue: bool, in_swizzle: int, out_swizzle: int):
  has_c = problem.epilogue.has_c and fused_epilogue
  has_bias = problem.epilogue.has_bias and fused_epilogue
  refs = list(refs)
  a_gmem, b_gmem = refs.pop(0), refs.pop(0)
  c_gmem = refs.pop(0) if has_c else None
  bias_gmem = refs.pop(0) if has_bias else None
  (out_gmem,) = refs
  transpose_b = problem.transpose_b
  in_dtype = a_gmem.dtype
  out_dtype = out_gmem.dtype
  tile_n, tile_k = config.tile_n, config.tile_k
  stages = min(config.max_concurrent_steps, steps_per_split)
  k_blocks = cdiv(problem.k, tile_k)

  strip = lax.axis_index("strip")
  split = lax.axis_index("split")
  if m_tiles == 1:
    batch_idx = lax.div(strip, index(n_tiles))
    first_row = 0
  else:  # `split_k`: a strip is one output tile of a column strip
    row_strip = lax.div(strip, index(n_tiles))
    batch_idx = lax.div(row_strip, index(m_tiles))
    first_row = lax.rem(row_strip, index(m_tiles)) * tile_m
  n_idx = lax.rem(strip, index(n_tiles))
  n_slice = pl.ds(n_idx * tile_n, tile_n)
  out_rows = pl.ds(first_row, tile_m)
  first_block = split * steps_per_split
  # The last split may own fewer K blocks than the others.
  num_steps = jnp.minimum(steps_per_split, k_blocks - first_block)

  b_block = (tile_n, tile_k) if transpose_b else (tile_k, tile_n)

  def scoped(a_smem, b_smem, loaded, out_smem, c_smem, bias_smem, epi_loaded):
    def issue(step):
      slot = lax.rem(step, index(stages))
      k_slice = pl.ds((first_block + step) * tile_k, tile_k)
      plgpu.copy_gmem_to_smem(a_gmem.at[batch_idx, pl.ds(first_row, rows),
                                        k_slice],
                              a_smem.at[slot, pl.ds(0, rows)],
                              loaded.at[slot])
      b_src = (b_gmem.at[batch_idx, n_slice, k_slice] if transpose_b
               else b_gmem.at[batch_idx, k_slice, n_slice])
      plgpu.copy_gmem_to_smem(b_src, b_smem.at[slot], loaded.at[slot])

    def prologue(step, carry):
      step = index(step)
      @pl.when(step < num_steps)
      def _():
        issue(step)
      return carry

    lax.fori_loop(index(0), index(stages), prologue, None)

    def mma_scope(acc_ref):
      def mma_step(step, carry):
        step = index(step)
        slot = lax.rem(step, index(stages))
        plgpu.barrier_wait(loaded.at[slot])
        b_view = b_smem.at[slot].T if transpose_b else b_smem.at[slot]
        plgpu.wgmma(acc_ref, a_smem.at[slot], b_view)
        # With one wgmma group left in flight, the previous step's stage is
        # free: refill it with the step `stages` ahead of that one.
        plgpu.wgmma_wait(1)
        refill = step - 1 + stages

        @pl.when((step > 0) & (refill < num_steps))
        def _():
          issue(refill)
        return carry

      lax.fori_loop(index(0), num_steps, mma_step, None)
      plgpu.wgmma_wait(0)
      return acc_ref[...]

    acc = pl.run_scoped(mma_scope, plgpu.ACC((tile_m, tile_n), jnp.float32))

    c_tile = bias_tile = None
    if has_c:
      plgpu.copy_gmem_to_smem(c_gmem.at[batch_idx, out_rows, n_slice],
                              c_smem, epi_loaded.at[0])
      plgpu.barrier_wait(epi_loaded.at[0])
      c_tile = c_smem[...]
    if has_bias:
      plgpu.copy_gmem_to_smem(bias_gmem.at[n_slice], bias_smem,
                              epi_loaded.at[1])
      plgpu.barrier_wait(epi_loaded.at[1])
      bias_vec = plgpu.load(bias_smem, layout=plgpu.Layout.WGMMA.reduce(0))
      bias_tile = lax.broadcast_in_dim(bias_vec, (tile_m, tile_n), (1,))
    value = acc
    if fused_epilogue:
      value = apply_epilogue(acc, problem.epilogue, c_tile, bias_tile)
    out_smem[...] = value.astype(out_dtype)
    plgpu.commit_smem()
    if fused_epilogue:
      dst = out_gmem.at[batch_idx, out_rows, n_slice]
    else:
      dst = out_gmem.at[split, batch_idx, out_rows, n_slice]
    plgpu.copy_smem_to_gmem(out_smem, dst)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  c_dtype = c_gmem.dtype if has_c else None
  pl.run_scoped(
      scoped,
      a_smem=plgpu.SMEM((stages, tile_m, tile_k), in_dtype,
                        transforms=tma.swizzled_transforms(in_swizzle,
                                                           in_dtype)),
      b_smem=plgpu.SMEM((stages, *b_block), in_dtype,
                        transforms=tma.swizzled_transforms(in_swizzle,
                                                           in_dtype)),
      loaded=plgpu.Barrier(num_arrivals=2, num_barriers=stages),
      out_smem=plgpu.SMEM((tile_m, tile_n), out_dtype,
                          transforms=tma.swizzled_transforms(out_swizzle,
                                                             out_dtype)),
      c_smem=(plgpu.SMEM((tile_m, tile_n), c_dtype,
                         transforms=tiled_transforms(tile_n, c_dtype))
              if has_c else None),
      bias_smem=plgpu.SMEM((tile_n,), jnp.float32) if has_bias else None,
      epi_loaded=(plgpu.Barrier(num_barriers=2) if (has_c or has_bias)
                  else None),
  )


def small_m_matmul(a, b, c, bias, *, problem: GemmProblem,
                   config: SmallMConfig, interpret=False):
  if not isinstance(config, SmallMConfig):
    raise TypeError(
        f"config must be a SmallMConfig, got {type(config).__name__}")
  return one_consumer_matmul(a, b, c, bias, problem=problem, config=config,
                             tile_m=small_m_tile_m(problem), row_tiled=False,
                             interpret=interpret)


def input_swizzle(problem: GemmProblem) -> int:
  """The swizzle (bytes) the one-consumer kernels read A and B with: the
  widest one their rows (K, and B's minor dim) are whole spans of, 128 for
  every power-of-two size, so that rows of a 16-element multiple (32 bytes
  of bf16) pay no padding copy."""
  b_minor = problem.k if problem.transpose_b else problem.n
  return tma.widest_swizzle(problem.in_dtype, problem.k, b_minor)


def output_swizzle(problem: GemmProblem, out_dtype) -> int:
  """The swizzle (bytes) the output tile is stored with, likewise (f32 when
  K is split)."""
  return tma.widest_swizzle(out_dtype, problem.n)


def one_consumer_matmul(a, b, c, bias, *, problem: GemmProblem,
                        config: SmallMConfig | SplitKConfig, tile_m: int,
                        row_tiled: bool, interpret=False):
  """The launch both one-consumer kernels share. `row_tiled=False`
  (`small_m`): every CTA multiplies all of A's rows, loading only the real
  ones. `row_tiled=True` (`split_k`): CTAs also split M into tile_m-row
  tiles, the last one's rows past M zero-filled by the TMA on load and
  clipped on store."""
  params = interpret_params(interpret)
  tma.check_full_swizzle(problem.in_dtype, tile_k=config.tile_k,
                         tile_n=config.tile_n)
  if not config.fits(problem):
    raise ValueError(
        f"config={config} needs {config.smem_bytes(problem)} bytes of "
        f"shared memory, more than {HOPPER_SMEM_BYTES}")
  in_dtype = problem.in_dtype
  if problem.transpose_a:
    # The kernel reads A K-major. For `small_m` A is at most 128 rows, so
    # this costs next to nothing; for `split_k` it is one copy of A, which
    # the dispatch table's timings include.
    a = jnp.swapaxes(a, 1, 2)
  tile_n, tile_k = config.tile_n, config.tile_k
  # A box must not be larger than the whole array (see `tma.pad_to_tiling`):
  # with rows tiled, A, C and the output span at least one tile of rows.
  min_rows = tile_m if row_tiled else 0
  in_swizzle = input_swizzle(problem)
  in_tiling = tma.swizzled_tiling(in_swizzle, in_dtype)
  a = tma.pad_to_tiling(a, in_tiling, (min_rows, tile_k))
  b_box = (tile_n, tile_k) if problem.transpose_b else (tile_k, tile_n)
  b = tma.pad_to_tiling(b, in_tiling, b_box)
  # `small_m` loads M rounded up to the 8-row TMA tile; `split_k` whole tiles.
  rows = tile_m if row_tiled else a.shape[1]
  m_tiles = cdiv(problem.m, tile_m) if row_tiled else 1
  k_iters = cdiv(problem.k, tile_k)
  k_splits = min(config.k_splits, k_iters)
  steps_per_split = cdiv(k_iters, k_splits)
  # Splits whose share would start past K have nothing to do.
  k_splits = cdiv(k_iters, steps_per_split)
  n_tiles = cdiv(problem.n, tile_n)
  fused_epilogue = k_splits == 1
  out_dtype = jnp.dtype(problem.out_dtype) if fused_epilogue else jnp.float32
  # Rows stay at M rounded to 8: the TMA store clips the accumulator rows
  # past them (verified on the H200 down to M = 1), which keeps the write
  # traffic at M rows. Columns get at least one whole box, and rows too
  # when they are tiled.
  out_swizzle = output_swizzle(problem, out_dtype)
  m_out, n_out = tma.padded_dims(problem.m, problem.n,
                                 tma.swizzled_tiling(out_swizzle, out_dtype),
                                 (min_rows, tile_n))
  if fused_epilogue:
    out_type = jax.ShapeDtypeStruct((problem.batch, m_out, n_out), out_dtype)
  else:
    out_type = jax.ShapeDtypeStruct((k_splits, problem.batch, m_out, n_out),
                                    out_dtype)
  operands = [a, b]
  if fused_epilogue and problem.epilogue.has_c:
    operands.append(tma.pad_to_tiling(
        c, tma.tma_tiling(tile_n, c.dtype), (min_rows, tile_n)))
  if fused_epilogue and problem.epilogue.has_bias:
    operands.append(tma.pad_vector(bias.astype(jnp.float32), config.tile_n))
  kernel = plgpu.kernel(
      functools.partial(_kernel_body, problem=problem, config=config,
                        tile_m=tile_m, rows=rows, m_tiles=m_tiles,
                        n_tiles=n_tiles, steps_per_split=steps_per_split,
                        fused_epilogue=fused_epilogue, in_swizzle=in_swizzle,
                        out_swizzle=out_swizzle),
      out_type=out_type,
      grid=(problem.batch * m_tiles * n_tiles, k_splits),
      grid_names=("strip", "split"),
      interpret=params,
  )
  out = call_kernel(kernel, operands, out_type, params)
  if fused_epilogue:
    if (m_out, n_out) != (problem.m, problem.n):
      out = out[:, :problem.m, :problem.n]
    return out
  acc = out[0]
  for partial in out[1:]:
    acc = acc + partial
  acc = acc[:, :problem.m, :problem.n]
  result = apply_epilogue(acc, problem.epilogue, c,
                          None if bias is None else bias.astype(jnp.float32))
  return result.astype(problem.out_dtype)


def supports(problem: GemmProblem, device: DeviceInfo) -> str | None:
  if problem.m > MAX_M:
    return f"m={problem.m} > {MAX_M}: not a decode shape (ws_persistent's job)"
  reason = hopper_unsupported(problem, device)
  if reason is None and problem.in_dtype == "float32" and not problem.transpose_b:
    return ("TF32 wgmma needs B as (n, k); transposing the weight would "
            "double the traffic of a bandwidth-bound kernel")
  return reason


def heuristic(problem: GemmProblem, device: DeviceInfo) -> SmallMConfig:
  """The bandwidth model of `heuristics.small_m_heuristic`."""
  return heuristics.small_m_heuristic(problem, device.planning_sms)


def check_config(config: SmallMConfig | SplitKConfig, problem: GemmProblem,
                 device: DeviceInfo) -> str | None:
  """Why a stored config of a one-consumer kernel (`small_m`, `split_k`)
  must not serve this problem: only shared memory."""
  del device
  if not config.fits(problem):
    return f"needs {config.smem_bytes(problem)} bytes of shared memory"
  return None


def search_space(problem: GemmProblem, device: DeviceInfo):
  return heuristics.small_m_candidates(problem, device.planning_sms)


autotune.register_tunable(registry.KernelEntry(
    name=NAME, fn=small_m_matmul, config_cls=SmallMConfig, supports=supports,
    heuristic=heuristic, check_config=check_config, runs_on_cpu=True,
    description=("decode GEMM (M <= 128): N strips x K splits over all SMs, "
                 "deep TMA->wgmma pipeline, deterministic split-K reduction"),
), search_space)
