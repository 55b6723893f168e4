"""Rung 4: grouped (swizzled) program order for L2 reuse.

The one change over rung 3: the tiles and the K loop are the same (rung
3's code, copied), only the order in which programs are launched changes.
The grid is one-dimensional over tiles (plus batch) and program `t`
computes tile (i, j) = grouped(t):

    for batch in range(B):                                       # parallel
      for t in range(cdiv(M, BM) * cdiv(N, BN)):                 # parallel
        group = t // (GROUP_M * grid_n)
        i = group * GROUP_M + (t % (GROUP_M * grid_n)) % rows_in_group
        j = (t % (GROUP_M * grid_n)) // rows_in_group
        acc = pipelined K loop as in rung 3
        C[batch, i, j] = epilogue(acc)

Why it is faster: at any moment the GPU runs about one wave (#SMs) of
programs. In row-major order a wave of 132 programs on a 64×64-tile grid
covers two rows of tiles: it reads 2 A row blocks but 64 B column blocks,
which together overflow L2, so B comes from HBM again for the next rows. In
groups of GROUP_M = 8 rows the same wave covers an 8×16 patch: 8 A blocks
and 16 B blocks, which stay in L2 and are each reused 8-16 times:

    row-major wave                 grouped wave (GROUP_M = 8)
    [##########################]   [#####.....................]
    [##########################]   [#####.....................]
    [..........................]   [#####.....................]
    [..........................]   [#####.....................]
    (2 rows × all columns)         (8 rows × a few columns)

Whether it pays depends on the L2: on the H200 at 4096³ and 8192³ it did
not, since one wave's working set fits its L2 in either order (the results
note experiments/results/nvidia_h200/triton/README.md, "The ladder").

The id mapping, with a diagram, is `common.grouped_tile_index`: rungs 4-6
and the experiments share it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_gemm.problem import apply_epilogue, cdiv
from pallas_gemm.triton_backend import common

NAME = "triton/04_grouped"
DEFAULT_CONFIG = common.TritonConfig(block_m=128, block_n=128, block_k=32,
                                     num_warps=4, num_stages=3, group_m=8)


def grouped_matmul(a, b, c, bias, *, problem, config, interpret):
  bm, bn, bk = config.block_m, config.block_n, config.block_k
  grid_m, grid_n = cdiv(problem.m, bm), cdiv(problem.n, bn)

  def block_index(tile, batch):
    i, j = common.grouped_tile_index(tile, grid_m=grid_m, grid_n=grid_n,
                                     group_m=config.group_m)
    return batch, i, j

  precision = common.dot_precision(problem)

  def kernel(*refs):
    a_ref, b_ref, c_ref, bias_ref, o_ref = common.unpack_refs(refs, problem)
    _, i, j = block_index(pl.program_id(0), pl.program_id(1))
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

  # Tiles on grid axis 0: CUDA launches blockIdx.x fastest, so consecutive
  # ids are the ones resident together.
  grid = (grid_m * grid_n, problem.batch)
  return common.run_tiled(kernel, a, b, c, bias, problem=problem,
                          config=config, interpret=interpret, name="grouped",
                          grid=grid, block_index=block_index)


heuristic_config = common.register_fixed_config_rung(
    NAME, grouped_matmul, DEFAULT_CONFIG,
    "pipelined K loop, grouped program order for L2 reuse")
