"""Rung 3: software pipelining and a warp count to match the tile.

What it adds over rung 2: the same K loop, compiled with `num_stages` > 1.
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

from pallas_gemm.triton_backend import common, k02_k_loop

NAME = "triton/03_pipelined"
DEFAULT_CONFIG = common.TritonConfig(block_m=128, block_n=128, block_k=32,
                                     num_warps=4, num_stages=3)


def pipelined_matmul(a, b, c, bias, *, problem, config, interpret):
  """Rung 2's kernel, unchanged: pipelining is a compile option, not code."""
  return k02_k_loop.k_loop_matmul(
      a, b, c, bias, problem=problem,
      config=config, interpret=interpret)


heuristic_config = common.register_fixed_config_rung(
    NAME, pipelined_matmul, DEFAULT_CONFIG,
    "K loop with software pipelining (num_stages > 1)")
