"""Rung 1: one output tile per program, the whole K in one block.

The starting point of the ladder. Each program loads an entire row block of
A and an entire column block of B, K padded up to a power of two (Triton's
tensors have power-of-two shapes) and masked, and does one dot:

    for batch, i, j in grid (batch, cdiv(M, BM), cdiv(N, BN)):   # parallel
      KP = next_power_of_two(K)
      a = A[batch, i*BM:(i+1)*BM, 0:KP]      # masked: rows >= M, cols >= K -> 0
      b = B[batch, 0:KP, j*BN:(j+1)*BN]
      C[batch, i, j] = epilogue(a @ b)

Why it is slow: the operand footprint is (BM + BN)·KP elements, so large K
spills out of registers and shared memory, and the padded K wastes up to half
the work when K is just past a power of two. It is also why the tiles must
stay small (32×32 by default), which re-reads A and B from memory N/BN and
M/BM times. Rung 2 fixes the footprint with a K loop.

`supports()` declines problems whose whole-K tiles would exceed the footprint
budget below, on every platform, so the ladder behaves the same in interpret
mode and on a GPU.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_gemm import registry
from pallas_gemm.problem import cdiv
from pallas_gemm.triton_backend import common

NAME = "triton/01_naive"
DEFAULT_CONFIG = common.TritonConfig(block_m=32, block_n=32, block_k=16,
                                     num_warps=4, num_stages=1)
# Bytes the two whole-K operand tiles may take together. Past this Triton
# spills registers to local memory or fails to allocate shared memory.
FOOTPRINT_BUDGET_BYTES = 96 * 1024


def padded_k(k: int) -> int:
  """Next power of two >= k, at least 16 (the smallest tensor-core K)."""
  return max(16, 1 << (k - 1).bit_length())


def footprint_bytes(problem, config: common.TritonConfig) -> int:
  itemsize = jnp.dtype(problem.in_dtype).itemsize
  return (config.block_m + config.block_n) * padded_k(problem.k) * itemsize


def naive_matmul(a, b, c, bias, *, problem, config, interpret):
  whole_k = padded_k(problem.k)
  # The K loop of the shared helpers, run once over a single K block.
  whole_k_config = common.TritonConfig(
      block_m=config.block_m, block_n=config.block_n, block_k=whole_k,
      num_warps=config.num_warps, num_stages=1)

  def kernel(*refs):
    a_ref, b_ref, c_ref, bias_ref, o_ref = common.unpack_refs(refs, problem)
    rows, cols = common.program_rows_cols(pl.program_id(1), pl.program_id(2),
                                          whole_k_config)
    a_tile = common.load_a_tile(a_ref, 0, problem=problem, rows=rows,
                                bk=whole_k)
    b_tile = common.load_b_tile(b_ref, 0, problem=problem, cols=cols,
                                bk=whole_k)
    acc = jnp.dot(a_tile, b_tile, precision=common.dot_precision(problem),
                  preferred_element_type=jnp.float32)
    common.store_output(o_ref, acc, problem=problem, rows=rows, cols=cols,
                        c_ref=c_ref, bias_ref=bias_ref)

  grid = (problem.batch, cdiv(problem.m, config.block_m),
          cdiv(problem.n, config.block_n))
  return common.run_tiled(kernel, a, b, c, bias, problem=problem,
                          config=whole_k_config, interpret=interpret,
                          name="naive", grid=grid,
                          block_index=lambda b, i, j: (b, i, j))


def heuristic_config(problem, device):
  del device
  return common.small_problem_config(
      problem, DEFAULT_CONFIG)


def supports(problem, device):
  reason = common.triton_supports(problem, device)
  if reason is not None:
    return reason
  config = heuristic_config(problem, device)
  needed = footprint_bytes(problem, config)
  if needed > FOOTPRINT_BUDGET_BYTES:
    return (f"k={problem.k} pads to a whole-K tile of {padded_k(problem.k)}; "
            f"the operand tiles would need {needed} bytes, over the naive "
            f"kernel's {FOOTPRINT_BUDGET_BYTES}; use triton/02_k_loop")
  return None


registry.register(registry.KernelEntry(
    name=NAME,
    fn=naive_matmul,
    supports=supports,
    heuristic=heuristic_config,
    config_cls=common.TritonConfig,
    runs_on_cpu=True,
    description="one tile per program, whole K in one masked block",
))
