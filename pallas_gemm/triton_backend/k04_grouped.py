"""Rung 4: grouped (swizzled) program order for L2 reuse.

What it adds over rung 3: the tiles are the same, only the order in which
programs are launched changes. The grid is one-dimensional over tiles (plus
batch) and program `t` computes tile (i, j) = grouped(t):

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

The diagram of the id mapping is in `common.grouped_tile_index`.
"""

from __future__ import annotations

from jax.experimental import pallas as pl

from pallas_gemm.problem import cdiv
from pallas_gemm.triton_backend import common

NAME = "triton/04_grouped"
DEFAULT_CONFIG = common.TritonConfig(block_m=128, block_n=128, block_k=32,
                                     num_warps=4, num_stages=3, group_m=8)


def grouped_launch(kernel_body, a, b, c, bias, *, problem, config, interpret,
                   name):
  """Runs `kernel_body(refs, rows, cols)` over a 1-D grouped tile grid."""
  grid_m = cdiv(problem.m, config.block_m)
  grid_n = cdiv(problem.n, config.block_n)

  def block_index(tile, batch):
    i, j = common.grouped_tile_index(tile, grid_m=grid_m, grid_n=grid_n,
                                     group_m=config.group_m)
    return batch, i, j

  def kernel(*refs):
    _, i, j = block_index(pl.program_id(0), pl.program_id(1))
    rows, cols = common.program_rows_cols(i, j, config)
    kernel_body(refs, rows, cols)

  # Tiles on grid axis 0: CUDA launches blockIdx.x fastest, so consecutive
  # ids are the ones resident together.
  grid = (grid_m * grid_n, problem.batch)
  return common.run_tiled(kernel, a, b, c, bias, problem=problem,
                          config=config, interpret=interpret, name=name,
                          grid=grid, block_index=block_index)


def grouped_matmul(a, b, c, bias, *, problem, config, interpret):
  
  def body(refs, rows, cols):
    a_ref, b_ref, c_ref, bias_ref, o_ref = common.unpack_refs(refs, problem)
    acc = common.accumulate_k_range(
        a_ref, b_ref, problem=problem, config=config, rows=rows, cols=cols,
        k_start=0, k_stop=cdiv(problem.k, config.block_k))
    common.store_output(o_ref, acc, problem=problem, rows=rows, cols=cols,
                        c_ref=c_ref, bias_ref=bias_ref)

  return grouped_launch(body, a, b, c, bias, problem=problem, config=config,
                        interpret=interpret, name="grouped")


heuristic_config = common.register_fixed_config_rung(
    NAME, grouped_matmul, DEFAULT_CONFIG,
    "pipelined K loop, grouped program order for L2 reuse")
