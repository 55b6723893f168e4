"""Rung 5: split-K for skinny and long-K problems.

What it adds over rung 4: when the output has too few tiles to fill the GPU
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

`supports()` declines problems where the tiles already fill the GPU or K is
too short to split; the GPU auto order tries this kernel first, so it must
only accept shapes it wins.
"""

from __future__ import annotations

import dataclasses

from pallas_gemm import registry
from pallas_gemm.problem import cdiv
from pallas_gemm.triton_backend import common

NAME = "triton/05_split_k"
# Each split should walk at least this many K blocks, or the pipeline never
# reaches steady state and the partial traffic outweighs the gain.
MIN_K_BLOCKS_PER_SPLIT = 4
MAX_SPLIT_K = 32
# Past this many rows the tiles fill the GPU on their own for any real N.
MAX_SKINNY_M = 256


def base_config(problem) -> common.TritonConfig:
  """Tiles for a short, wide output: few rows, deep K steps.

  From the H200 sweep at N = K = 8192 (results/nvidia_h200/triton): for
  M <= 16 a 16-row tile with K steps of 256 was best; for M = 128, 64×128
  tiles beat 64×64 by 1.5×.
  """
  if problem.in_dtype == "float32":
    tile = common.TritonConfig(block_m=64, block_n=64, block_k=64,
                               num_warps=4, num_stages=3, group_m=8)
  elif problem.m <= 16:
    tile = common.TritonConfig(block_m=16, block_n=64, block_k=256,
                               num_warps=4, num_stages=3, group_m=8)
  else:
    tile = common.TritonConfig(block_m=64, block_n=128, block_k=128,
                               num_warps=4, num_stages=4, group_m=8)
  return common.small_problem_config(problem, tile)


def choose_split_k(problem, config: common.TritonConfig, device) -> int:
  """Splits that bring the program count to about two waves, or 1.

  Only when the tiles fill less than half the SMs: on the H200 an output of
  128 tiles (one wave on 132 SMs) lost 2-15% with any split.
  """
  tiles = problem.batch * cdiv(problem.m, config.block_m) * cdiv(
      problem.n, config.block_n)
  sms = device.planning_sms
  if 2 * tiles > sms:
    return 1
  k_blocks = cdiv(problem.k, config.block_k)
  wanted = cdiv(2 * sms, tiles)
  most = k_blocks // MIN_K_BLOCKS_PER_SPLIT
  return max(1, min(wanted, most, MAX_SPLIT_K))


def heuristic_config(problem, device):
  config = base_config(problem)
  return dataclasses.replace(
      config, split_k=choose_split_k(problem, config, device))


def split_k_matmul(a, b, c, bias, *, problem, config, interpret):
  partials = common.split_k_partials(
      a, b, problem=problem, config=config, interpret=interpret,
      name="split_k", grouped=True)
  return common.reduce_partials(partials, c, bias, problem=problem)


def supports(problem, device):
  config = heuristic_config(problem, device)
  reason = common.triton_supports(problem, device, config)
  if reason is not None:
    return reason
  if problem.m > MAX_SKINNY_M and config.split_k == 1:
    return (f"m={problem.m} > {MAX_SKINNY_M} and the output tiles fill the "
            f"GPU; split-K would only add partial traffic")
  if config.split_k == 1:
    return (f"k={problem.k} is too short to split (needs >= "
            f"{2 * MIN_K_BLOCKS_PER_SPLIT} K blocks of {config.block_k}) or "
            f"the {problem.m}x{problem.n} output already fills the GPU")
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
