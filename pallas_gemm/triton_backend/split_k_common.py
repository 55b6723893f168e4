"""What rung 5 (`k05_split_k`) and the production rung 6 (`k06_tuned`)
share about split-K: the plan for a short, wide output (its tiles and how
many ways to split the K loop) and the fixed-order reduction of the
partials. It lives here, not in rung 5, so that no rung imports another;
each rung writes its own partials kernel.

Split-K pays when the output has too few tiles to fill the GPU: it
multiplies the programs until a wave is full, at the price of writing and
re-reading split_k·M·N f32 partials (small when M is small). Why each
number below was chosen is in experiments/results/nvidia_h200/triton/README.md
(the skinny rows of "`triton/06_tuned`, tuned, against the acceptance
targets", and "Numbers cited by the code").
"""

from __future__ import annotations

import dataclasses

from pallas_gemm.devices import DeviceInfo
from pallas_gemm.problem import GemmProblem, apply_epilogue, cdiv
from pallas_gemm.triton_backend.common import TritonConfig, small_problem_config

# Each split should walk at least this many K blocks, or the pipeline never
# reaches steady state and the partial traffic outweighs the gain.
MIN_K_BLOCKS_PER_SPLIT = 4
MAX_SPLIT_K = 32
# Past this many rows the tiles fill the GPU on their own for any real N.
MAX_SKINNY_M = 256


def skinny_tiles(problem: GemmProblem) -> TritonConfig:
  """Tiles for a short, wide output: few rows, deep K steps.

  From the H200 sweep at N = K = 8192: for M <= 16 a 16-row tile with K
  steps of 256 was the fastest; for M = 128, 64×128 tiles beat 64×64 (the
  results note has the times).
  """
  if problem.in_dtype == "float32":
    tile = TritonConfig(block_m=64, block_n=64, block_k=64,
                        num_warps=4, num_stages=3, group_m=8)
  elif problem.m <= 16:
    tile = TritonConfig(block_m=16, block_n=64, block_k=256,
                        num_warps=4, num_stages=3, group_m=8)
  else:
    tile = TritonConfig(block_m=64, block_n=128, block_k=128,
                        num_warps=4, num_stages=4, group_m=8)
  return small_problem_config(problem, tile)


def choose_split_k(problem: GemmProblem, config: TritonConfig,
                   device: DeviceInfo) -> int:
  """Splits that bring the program count to about two waves, or 1.

  Only when the tiles fill less than half the SMs: an output of about one
  wave of tiles (N = 8192 in 64-wide tiles: 128 tiles for 132 SMs on the
  H200) was slower with every split, since the partial traffic is paid and
  the wave was already (nearly) full.
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


def skinny_config(problem: GemmProblem, device: DeviceInfo) -> TritonConfig:
  """The skinny tiles with the split count for this device."""
  config = skinny_tiles(problem)
  return dataclasses.replace(
      config, split_k=choose_split_k(problem, config, device))


def reduce_partials(partials, c, bias, *, problem: GemmProblem):
  """Sums the (split_k, batch, m, n) f32 partials in a fixed order, then
  applies the epilogue.

  A chain of adds over a static split count (not a tree reduce whose order
  the compiler picks) gives the same bits on every run; XLA fuses the chain
  and the epilogue into one elementwise pass over (batch, m, n).
  """
  total = partials[0]
  for split in range(1, partials.shape[0]):
    total = total + partials[split]
  bias_row = None if bias is None else bias[None, None, :]
  out = apply_epilogue(total, problem.epilogue, c, bias_row)
  return out.astype(problem.out_dtype)
