"""Rung 6: the production Pallas-Triton kernel.

What it adds over rungs 3-5, all of which it combines:

  * grouped program order (rung 4) with a software-pipelined K loop
    (rung 3), on tiles and stage counts chosen per device, dtype, layout,
    precision and shape bucket by `pallas_gemm.autotune` (measured cache,
    shipped defaults for the GPUs we have measured, else the heuristic in
    `heuristic_config`);
  * split-K (rung 5) when the output is too small to fill the GPU;
  * for TF32, K-major operands (`TritonConfig.k_major`): wgmma takes
    32-bit operands only K-major, so an XLA transpose of a non-K-major
    operand buys full-width copies. TF32 stays near 0.56x of cuBLAS on the
    H200 all the same: XLA rounds every TF32 dot operand to TF32 in
    registers before the MMA (a pass of its own that Pallas cannot opt out
    of), so `kernel=None` sends Hopper TF32 to Mosaic (see the H200
    results);
  * only the edge masks the shape needs: when M, N or K divides its block
    the compare-and-select on that edge is compiled out, and the K offset
    carries a `pl.multiple_of` hint, so Triton can issue full-width
    aligned loads in the common case of tile-multiple shapes;
  * a persistent grid (`TritonConfig.programs_per_sm`): a fixed number of
    programs per SM, each looping over output tiles taken in grouped order
    with a stride of the program count. Triton's pipeliner only overlaps
    loads within one K loop, but a resident program skips the launch and
    scheduling of a new block per tile and starts its next tile's loads
    right after its stores: on the H200 this measured 3.8-4.7 % faster for
    bf16 at 4096^3-16384x4096x4096 (experiments/triton_knobs.py).

Loop nest (split_k = 1, programs_per_sm = 0):

    for t, batch in grid (cdiv(M, BM) * cdiv(N, BN), B):         # parallel
      i, j = grouped(t, GROUP_M)
      acc = zeros(BM, BN)                                         # f32
      for kk in range(cdiv(K, BK)):            # pipelined, num_stages deep
        k0 = multiple_of(kk * BK, BK)
        acc += A[batch, i, k0:k0+BK] @ B[batch, k0:k0+BK, j]      # masks only
      C[batch, i, j] = epilogue(acc)                              # if ragged

With programs_per_sm = p > 0 the outer loop becomes

    for prog, batch in grid (min(tiles, p * SMs), B):               # parallel
      for t in range(prog, tiles, p * SMs):                      # sequential
        i, j = grouped(t, GROUP_M); acc = ...; C[batch, i, j] = ...

It accepts every problem the primitive can ask of a Triton kernel: both
transposes, f32 (exact "ieee" or TF32), bf16 and f16 with f32 accumulation,
any batch, any M/N/K, the fused epilogue. This is the first kernel of the
CPU auto order (interpret mode) and of the non-Hopper GPU order.

Mosaic GPU kernels are faster on Hopper (wgmma + TMA + warp specialisation
written out by hand); this kernel is for Ampere and Ada, where Triton's
mma.sync path is what the hardware has.
"""

from __future__ import annotations

import dataclasses

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_gemm import autotune, registry
from pallas_gemm.devices import device_info
from pallas_gemm.problem import cdiv
from pallas_gemm.triton_backend import common, k04_grouped, k05_split_k

NAME = "triton/06_tuned"
TritonConfig = common.TritonConfig

# Preferred untuned configs, best first; the first whose shared memory fits
# the device wins. Chosen from the H200 sweep (experiments/triton_sweep.py);
# the smaller fall-backs are for Ampere/Ada's 99-163 KiB of shared memory.
_PREFERRED = {
    "16bit": (
        TritonConfig(128, 256, 64, num_warps=8, num_stages=3, group_m=8),
        TritonConfig(128, 128, 64, num_warps=4, num_stages=4, group_m=8),
        TritonConfig(128, 128, 32, num_warps=4, num_stages=4, group_m=8),
        TritonConfig(64, 64, 32, num_warps=4, num_stages=3, group_m=8),
    ),
    "tf32": (
        TritonConfig(128, 128, 32, num_warps=4, num_stages=4, group_m=8),
        TritonConfig(128, 64, 32, num_warps=4, num_stages=3, group_m=8),
        TritonConfig(64, 64, 32, num_warps=4, num_stages=3, group_m=8),
    ),
    "ieee": (
        TritonConfig(64, 128, 32, num_warps=4, num_stages=3, group_m=8),
        TritonConfig(64, 64, 32, num_warps=4, num_stages=3, group_m=8),
    ),
}
# Candidates searched before the generic grid (see `search_space`): for
# 16-bit the persistent grid, which won every shape measured on the H200.
# Exact f32 has none: persistent grids (26-27 TFLOP/s against 44-46) and
# 16-warp FFMA blocks (<= 128 registers, 16 warps per SM; 3-14 % slower)
# both lost to the 4-warp 64x128x32 block on the H200.
_PERSISTENT_16BIT = TritonConfig(128, 256, 64, num_warps=8, num_stages=3,
                                 group_m=8, programs_per_sm=1)
_SEARCH_FIRST = {
    "16bit": (_PERSISTENT_16BIT,) + tuple(
        dataclasses.replace(_PERSISTENT_16BIT, **change) for change in (
            dict(block_m=256, block_n=128), dict(num_stages=4),
            dict(group_m=16), dict(group_m=4),
            dict(block_k=32, num_stages=4))),
    "tf32": (
        TritonConfig(128, 128, 32, num_warps=4, num_stages=4, group_m=8,
                     k_major=True, programs_per_sm=1),
    ),
    "ieee": (),
}

# Interpret mode cost grows with the number of grid steps times K steps;
# moderate tiles keep the CPU path quick without huge padded tiles.
_INTERPRET_CONFIG = TritonConfig(64, 64, 32, num_warps=4, num_stages=1,
                                 group_m=8)


def _family(problem) -> str:
  if problem.in_dtype != "float32":
    return "16bit"
  return "ieee" if problem.precision == "ieee" else "tf32"


def heuristic_config(problem, device) -> TritonConfig:
  """The untuned choice: split-K for skinny outputs, else the first
  preferred tile that fits the device, shrunk for tiny dimensions."""
  if not device.is_gpu:
    return common.small_problem_config(problem, _INTERPRET_CONFIG)
  if problem.m <= k05_split_k.MAX_SKINNY_M:
    # Few rows: rung 5's skinny tiles, split only where that pays.
    skinny = k05_split_k.heuristic_config(problem, device)
    if autotune.fits_device(skinny, problem, device):
      return skinny
  # wgmma takes 32-bit operands from shared memory only K-major.
  k_major = _family(problem) == "tf32" and device.is_hopper
  # The persistent grid measured 3.8-4.7 % faster for 16-bit on the H200;
  # other GPUs keep the measured-elsewhere one-program-per-tile launch.
  programs_per_sm = 1 if (_family(problem) == "16bit"
                          and device.is_hopper) else 0
  for config in _PREFERRED[_family(problem)]:
    if autotune.fits_device(config, problem, device):
      return common.small_problem_config(
          problem, dataclasses.replace(config, k_major=k_major,
                                       programs_per_sm=programs_per_sm))
  return common.small_problem_config(problem, _PREFERRED[_family(problem)][-1])


def search_space(problem, device) -> list[TritonConfig]:
  """Configs `autotune.tune` times for this kernel (before smem filtering)."""
  family = _family(problem)
  if family == "16bit":
    tiles = [(128, 256, 64), (256, 128, 64), (128, 128, 64), (128, 128, 32),
             (64, 256, 64), (256, 64, 64)]
  elif family == "tf32":
    tiles = [(128, 128, 32), (128, 256, 32), (256, 128, 32), (128, 64, 32),
             (64, 128, 32), (128, 128, 64)]
  else:
    tiles = [(128, 128, 16), (64, 128, 32), (128, 64, 32), (64, 64, 32),
             (128, 128, 32), (64, 64, 16)]
  k_majors = (False, True) if family == "tf32" else (False,)
  space = list(_SEARCH_FIRST[family]) + [
      TritonConfig(bm, bn, bk, num_warps=warps, num_stages=stages,
                   group_m=8, k_major=k_major)
      for bm, bn, bk in tiles for warps in (4, 8) for stages in (3, 4)
      for k_major in k_majors]
  skinny = k05_split_k.heuristic_config(problem, device)
  if skinny.split_k > 1:
    space += [dataclasses.replace(skinny, split_k=s)
              for s in sorted({max(2, skinny.split_k // 2), skinny.split_k,
                               min(2 * skinny.split_k, 32)})]
  seen, unique = set(), []
  for config in (common.small_problem_config(problem, c) for c in space):
    if config not in seen:
      seen.add(config)
      unique.append(config)
  return unique


def tuned_matmul(a, b, c, bias, *, problem, config, interpret):
  if config.k_major:
    a, b, problem = common.to_k_major(a, b, problem)
  masks = common.edge_masks_for(problem, config)
  if config.split_k > 1:
    partials = common.split_k_partials(
        a, b, problem=problem, config=config, interpret=interpret,
        name="tuned_split_k", grouped=True, masks=masks, hint=True)
    return common.reduce_partials(partials, c, bias, problem=problem)

  if config.programs_per_sm:
    return _persistent_matmul(a, b, c, bias, problem=problem, config=config,
                              masks=masks, interpret=interpret)

  def body(refs, rows, cols):
    a_ref, b_ref, c_ref, bias_ref, o_ref = common.unpack_refs(refs, problem)
    acc = common.accumulate_k_range(
        a_ref, b_ref, problem=problem, config=config, rows=rows, cols=cols,
        k_start=0, k_stop=cdiv(problem.k, config.block_k), masks=masks,
        hint=True)
    common.store_output(o_ref, acc, problem=problem, rows=rows, cols=cols,
                        c_ref=c_ref, bias_ref=bias_ref, masks=masks)

  return k04_grouped.grouped_launch(body, a, b, c, bias, problem=problem,
                                    config=config, interpret=interpret,
                                    name="tuned")


#: Programs of the persistent grid per "SM" in interpret mode: a few, so that
#: every program loops over several tiles.
_INTERPRET_SMS = 2


def _persistent_matmul(a, b, c, bias, *, problem, config, masks, interpret):
  """Rung 6 on a persistent grid: each program loops over output tiles.

  Every operand is one block spanning the whole (padded) matrix of its batch
  entry, and each tile's rows and columns are picked with `pl.ds` inside
  the kernel; rounding the blocks up to whole tiles keeps every `pl.ds` in
  bounds, which interpret mode needs (see the module notes in common.py).
  """
  bm, bn, bk = config.block_m, config.block_n, config.block_k
  grid_m, grid_n = cdiv(problem.m, bm), cdiv(problem.n, bn)
  num_tiles = grid_m * grid_n
  device = device_info()
  sms = device.num_sms if device.is_gpu else _INTERPRET_SMS
  programs = max(1, min(num_tiles, config.programs_per_sm * max(sms, 1)))
  m_span, n_span = grid_m * bm, grid_n * bn
  k_span = cdiv(problem.k, bk) * bk

  def whole(*block):
    return pl.BlockSpec((None, *block), lambda prog, batch: (batch, 0, 0))

  in_specs = [whole(k_span, m_span) if problem.transpose_a
              else whole(m_span, k_span),
              whole(n_span, k_span) if problem.transpose_b
              else whole(k_span, n_span)]
  if problem.epilogue.has_c:
    in_specs.append(whole(m_span, n_span))
  if problem.epilogue.has_bias:
    in_specs.append(pl.BlockSpec((n_span,), lambda prog, batch: (0,)))

  def kernel(*refs):
    a_ref, b_ref, c_ref, bias_ref, o_ref = common.unpack_refs(refs, problem)
    prog = pl.program_id(0)

    def tile_body(t, carry):
      i, j = common.grouped_tile_index(prog + t * programs, grid_m=grid_m,
                                       grid_n=grid_n, group_m=config.group_m)
      row0 = pl.multiple_of(i * bm, bm)
      col0 = pl.multiple_of(j * bn, bn)
      rows, cols = common.program_rows_cols(i, j, config)
      row_slice, col_slice = pl.ds(row0, bm), pl.ds(col0, bn)
      acc = common.accumulate_k_range(
          a_ref, b_ref, problem=problem, config=config, rows=rows,
          cols=cols, k_start=0, k_stop=cdiv(problem.k, bk), masks=masks,
          hint=True, tile_start=(row0, col0))
      common.store_output(
          o_ref.at[row_slice, col_slice], acc, problem=problem, rows=rows,
          cols=cols,
          c_ref=None if c_ref is None else c_ref.at[row_slice, col_slice],
          bias_ref=None if bias_ref is None else bias_ref.at[col_slice],
          masks=masks)
      return carry

    # Program p owns tiles p, p + programs, p + 2 * programs, ...
    my_tiles = jax.lax.div(num_tiles - prog + programs - 1, programs)
    jax.lax.fori_loop(0, my_tiles, tile_body, 0)

  return pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((problem.batch, problem.m, problem.n),
                                     problem.out_dtype),
      grid=(programs, problem.batch),
      in_specs=in_specs,
      out_specs=whole(m_span, n_span),
      compiler_params=pltriton.CompilerParams(
          num_warps=config.num_warps, num_stages=config.num_stages),
      interpret=interpret,
      name="tuned_persistent",
  )(*common.operands_list(a, b, c, bias))


def supports(problem, device):
  return common.triton_supports(problem, device,
                                heuristic_config(problem, device))


autotune.register_search_space(NAME, search_space)
registry.register(registry.KernelEntry(
    name=NAME,
    fn=tuned_matmul,
    supports=supports,
    heuristic=heuristic_config,
    config_cls=TritonConfig,
    runs_on_cpu=True,
    description="grouped, pipelined, autotuned; split-K for skinny outputs",
))
