"""Rung 3: software pipelining and a warp count to match the tile.

The one change over rung 2: the same K loop (the code below is rung 2's,
copied so that this file reads on its own), compiled with `num_stages` > 1.
Triton's pipeliner then keeps `num_stages - 1` K steps of A and B in flight
in shared memory (cp.async on Ampere, TMA-free async copies on Hopper), so the
tensor cores work on step kk while the loads for kk+1.. kk+S-1 are still in
the air. Rung 2 waited for every load before its dot; with memory latency of
~600 cycles and a 128×128×32 bf16 dot of ~130 cycles per SM sub-partition,
that wait dominated.

    for batch, i, j in grid (batch, cdiv(M, BM), cdiv(N, BN)):   # parallel
      acc = zeros(BM, BN)
      prefetch tiles 0 .. S-2 of A[i, :] and B[:, j]
      for kk in range(cdiv(K, BK)):                              # sequential
        wait for tile kk; issue the load of tile kk + S - 1
        acc += A_tile[kk] @ B_tile[kk]
      C[batch, i, j] = epilogue(acc)

Bigger tiles (128×128 instead of 64×64) halve the bytes loaded per flop;
they need more warps (`num_warps` = 4 or 8) to hold the accumulator without
spilling. Shared memory grows with the stages: (BM + BN)·BK·bytes·S, which
`TritonConfig.smem_bytes` checks against the device before compiling.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_gemm.problem import apply_epilogue, cdiv
from pallas_gemm.triton_backend import common

NAME = "triton/03_pipelined"
DEFAULT_CONFIG = common.TritonConfig(block_m=128, block_n=128, block_k=32,
                                     num_warps=4, num_stages=3)


def pipelined_matmul(a, b, c, bias, *, problem, config, interpret):
  """Rung 2's kernel: pipelining is the compile option `config.num_stages`
  (passed to Triton by `common.launch`), not code."""
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
                          config=config, interpret=interpret, name="pipelined",
                          grid=grid, block_index=lambda b, i, j: (b, i, j))


heuristic_config = common.register_fixed_config_rung(
    NAME, pipelined_matmul, DEFAULT_CONFIG,
    "K loop with software pipelining (num_stages > 1)")
