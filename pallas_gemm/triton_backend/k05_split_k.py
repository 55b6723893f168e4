"""Rung 5: split-K for skinny and long-K problems.

The one change over rung 4 (whose grouped order and K loop are copied
here): when the output has too few tiles to fill the GPU
(M ≤ 256 against N = K = 8192 gives 1-2 rows of tiles, 64-128 programs for
132 SMs), the K loop is cut into `split_k` ranges that run as separate
programs, each writing an f32 partial. A second pass sums the partials in a
fixed order and applies the epilogue once:

    # pass 1: split_k times more programs than tiles
    for t, s, batch in grid (tiles, split_k, B):                 # parallel
      i, j = grouped(t)
      acc = zeros(BM, BN)
      for kk in range(s*per_split, min((s+1)*per_split, cdiv(K, BK))):
        acc += A[batch, i, kk] @ B[batch, kk, j]
      P[s, batch, i, j] = acc                                    # f32
    # pass 2: elementwise, fused by XLA
    C = epilogue(((P[0] + P[1]) + P[2]) + ...)

Why it is faster: a skinny GEMM is bound by reading B once from HBM, which
needs every SM issuing loads; split-K multiplies the programs until a wave
is full. The price is writing and re-reading split_k·M·N f32 values, small
when M is small. The reduction never uses atomics, so the output is the same
bits on every run (atomics would add the partials in arrival order).

How many splits and which tiles, and the fixed-order reduction of pass 2,
are `split_k_common` (shared with rung 6).
`supports()` declines problems where the tiles already fill the GPU or K is
too short to split; the GPU auto order tries this kernel first, so it must
only accept shapes it wins.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_gemm import registry
from pallas_gemm.problem import Epilogue, cdiv
from pallas_gemm.triton_backend import common, split_k_common

NAME = "triton/05_split_k"


def split_k_partials(a, b, *, problem, config, interpret):
  """Pass 1: f32 partial products, shape (split_k, batch, m, n).

  Split s sums the K blocks [s·per_split, (s+1)·per_split): each program
  writes its own slice of the buffer, so no two programs touch the same
  output and no atomics are needed.
  """
  bm, bn, bk = config.block_m, config.block_n, config.block_k
  grid_m, grid_n = cdiv(problem.m, bm), cdiv(problem.n, bn)
  k_blocks = cdiv(problem.k, bk)
  per_split = cdiv(k_blocks, config.split_k)

  def block_index(tile, split, batch):
    del split
    i, j = common.grouped_tile_index(tile, grid_m=grid_m, grid_n=grid_n,
                                     group_m=config.group_m)
    return batch, i, j

  precision = common.dot_precision(problem)

  def kernel(a_ref, b_ref, o_ref):
    tile, split, batch = (pl.program_id(axis) for axis in range(3))
    _, i, j = block_index(tile, split, batch)
    rows = i * bm + common.arange32(bm)
    cols = j * bn + common.arange32(bn)

    def k_step(k_index, acc):
      start = common.index32(k_index) * bk
      # Elements past M, N or K read as 0 (see rung 2).
      k_ok = (start + common.arange32(bk)) < problem.k
      row_ok = rows < problem.m
      if problem.transpose_a:  # A is stored (K, M)
        a_tile = pltriton.load(a_ref.at[pl.ds(start, bk), :],
                               mask=k_ok[:, None] & row_ok[None, :],
                               other=0).T
      else:
        a_tile = pltriton.load(a_ref.at[:, pl.ds(start, bk)],
                               mask=row_ok[:, None] & k_ok[None, :], other=0)
      col_ok = cols < problem.n
      if problem.transpose_b:  # B is stored (N, K)
        b_tile = pltriton.load(b_ref.at[:, pl.ds(start, bk)],
                               mask=col_ok[:, None] & k_ok[None, :],
                               other=0).T
      else:
        b_tile = pltriton.load(b_ref.at[pl.ds(start, bk), :],
                               mask=k_ok[:, None] & col_ok[None, :], other=0)
      return acc + jnp.dot(a_tile, b_tile, precision=precision,
                           preferred_element_type=jnp.float32)

    # This program's share of the K blocks; the last split may be short.
    k_start = split * per_split
    k_stop = jnp.minimum(k_start + per_split, k_blocks)
    acc = jax.lax.fori_loop(k_start, k_stop, k_step,
                            jnp.zeros((bm, bn), jnp.float32))
    out_ok = (rows < problem.m)[:, None] & (cols < problem.n)[None, :]
    pltriton.store(o_ref, acc, mask=out_ok)

  # The partials carry no epilogue: pass 2 applies it once, to the sum.
  bare = dataclasses.replace(problem, epilogue=Epilogue(), c_dtype=None)
  in_specs, _ = common.operand_specs(bare, config, k_blocks=k_blocks,
                                     block_index=block_index)

  def partial_map(tile, split, batch):
    _, i, j = block_index(tile, split, batch)
    return split, batch, i, j

  return common.launch(
      kernel, [a, b], config=config, interpret=interpret, name="split_k",
      grid=(grid_m * grid_n, config.split_k, problem.batch),
      in_specs=in_specs,
      out_specs=pl.BlockSpec((None, None, bm, bn), partial_map),
      out_shape=jax.ShapeDtypeStruct(
          (config.split_k, problem.batch, problem.m, problem.n), jnp.float32))


def split_k_matmul(a, b, c, bias, *, problem, config, interpret):
  partials = split_k_partials(a, b, problem=problem, config=config,
                              interpret=interpret)
  # Pass 2, in XLA.
  return split_k_common.reduce_partials(partials, c, bias, problem=problem)


heuristic_config = split_k_common.skinny_config


def supports(problem, device):
  config = heuristic_config(problem, device)
  reason = common.triton_supports(problem, device, config)
  if reason is not None:
    return reason
  if problem.m > split_k_common.MAX_SKINNY_M and config.split_k == 1:
    return (f"m={problem.m} > {split_k_common.MAX_SKINNY_M} and the output "
            f"tiles fill the GPU; split-K would only add partial traffic")
  if config.split_k == 1:
    return (f"k={problem.k} is too short to split (needs >= "
            f"{2 * split_k_common.MIN_K_BLOCKS_PER_SPLIT} K blocks of "
            f"{config.block_k}) or the {problem.m}x{problem.n} output "
            f"already fills the GPU")
  return None


registry.register(registry.KernelEntry(
    name=NAME,
    fn=split_k_matmul,
    supports=supports,
    heuristic=heuristic_config,
    config_cls=common.TritonConfig,
    runs_on_cpu=True,
    description="split-K with a deterministic fixed-order reduction",
))
