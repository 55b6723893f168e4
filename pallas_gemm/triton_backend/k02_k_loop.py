"""Rung 2: a K loop over BlockSpec tiles.

What it adds over rung 1: rung 1 loads the whole K extent of an A row-block
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

from jax.experimental import pallas as pl

from pallas_gemm.problem import cdiv
from pallas_gemm.triton_backend import common

NAME = "triton/02_k_loop"
DEFAULT_CONFIG = common.TritonConfig(block_m=64, block_n=64, block_k=32,
                                     num_warps=4, num_stages=1)


def k_loop_matmul(a, b, c, bias, *, problem, config, interpret):
  
  def kernel(*refs):
    a_ref, b_ref, c_ref, bias_ref, o_ref = common.unpack_refs(refs, problem)
    rows, cols = common.program_rows_cols(pl.program_id(1), pl.program_id(2),
                                          config)
    acc = common.accumulate_k_range(
        a_ref, b_ref, problem=problem, config=config, rows=rows, cols=cols,
        k_start=0, k_stop=cdiv(problem.k, config.block_k))
    common.store_output(o_ref, acc, problem=problem, rows=rows, cols=cols,
                        c_ref=c_ref, bias_ref=bias_ref)

  grid = (problem.batch, cdiv(problem.m, config.block_m),
          cdiv(problem.n, config.block_n))
  return common.run_tiled(kernel, a, b, c, bias, problem=problem,
                          config=config, interpret=interpret, name="k_loop",
                          grid=grid, block_index=lambda b, i, j: (b, i, j))


heuristic_config = common.register_fixed_config_rung(
    NAME, k_loop_matmul, DEFAULT_CONFIG,
    "K loop over BlockSpec tiles, one stage")
