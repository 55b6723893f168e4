"""Rung 2: a K loop over BlockSpec tiles.

The one change over rung 1: rung 1 loads the whole K extent of an A row-block
and a B column-block at once, so its register/shared footprint grows with K
and large K does not compile. Here each program walks K in `block_k` steps and
keeps only an f32 accumulator tile live, so the footprint is fixed and any K
runs.

Loop nest (one program per output tile):

    for batch, i, j in grid (batch, cdiv(M, BM), cdiv(N, BN)):   # parallel
      acc = zeros(BM, BN)
      for kk in range(cdiv(K, BK)):                              # sequential
        acc += A[batch, i*BM:(i+1)*BM, kk*BK:(kk+1)*BK]
             @ B[batch, kk*BK:(kk+1)*BK, j*BN:(j+1)*BN]
      C[batch, i, j] = epilogue(acc)

Compiled with one stage (no software pipelining): each tile's loads complete
before its dot starts. Rung 3 overlaps them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_gemm.problem import apply_epilogue, cdiv
from pallas_gemm.triton_backend import common

NAME = "triton/02_k_loop"
DEFAULT_CONFIG = common.TritonConfig(block_m=64, block_n=64, block_k=32,
                                     num_warps=4, num_stages=1)


def k_loop_matmul(a, b, c, bias, *, problem, config, interpret):
  bm, bn, bk = config.block_m, config.block_n, config.block_k
  precision = common.dot_precision(problem)

  def kernel(*refs):
    a_ref, b_ref, c_ref, bias_ref, o_ref = common.unpack_refs(refs, problem)
    i, j = pl.program_id(1), pl.program_id(2)
    rows = i * bm + common.arange32(bm)
    cols = j * bn + common.arange32(bn)

    def k_step(k_index, acc):
      start = common.index32(k_index) * bk
      # Elements past M, N or K read as 0: the zero K tail adds nothing to
      # the dot, and rows and columns past the edge are never stored. (The
      # row and column masks do not change with K; Triton hoists them.)
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

    acc = jax.lax.fori_loop(0, cdiv(problem.k, bk), k_step,
                            jnp.zeros((bm, bn), jnp.float32))

    row_ok, col_ok = rows < problem.m, cols < problem.n
    out_ok = row_ok[:, None] & col_ok[None, :]
    c_tile = bias_row = None
    if problem.epilogue.has_c:
      c_tile = pltriton.load(c_ref, mask=out_ok, other=0)
    if problem.epilogue.has_bias:
      bias_row = pltriton.load(bias_ref, mask=col_ok, other=0)[None, :]
    out = apply_epilogue(acc, problem.epilogue, c_tile, bias_row)
    pltriton.store(o_ref, out.astype(o_ref.dtype), mask=out_ok)

  grid = (problem.batch, cdiv(problem.m, bm), cdiv(problem.n, bn))
  return common.run_tiled(kernel, a, b, c, bias, problem=problem,
                          config=config, interpret=interpret, name="k_loop",
                          grid=grid, block_index=lambda b, i, j: (b, i, j))


heuristic_config = common.register_fixed_config_rung(
    NAME, k_loop_matmul, DEFAULT_CONFIG,
    "K loop over BlockSpec tiles, one stage")
