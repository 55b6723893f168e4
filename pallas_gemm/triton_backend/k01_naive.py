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
from jax.experimental.pallas import triton as pltriton

from pallas_gemm import registry
from pallas_gemm.problem import apply_epilogue, cdiv
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
  bm, bn = config.block_m, config.block_n
  whole_k = padded_k(problem.k)

  def kernel(*refs):
    a_ref, b_ref, c_ref, bias_ref, o_ref = common.unpack_refs(refs, problem)
    i, j = pl.program_id(1), pl.program_id(2)
    rows = i * bm + common.arange32(bm)
    cols = j * bn + common.arange32(bn)
    # Every element past M, N or K reads as 0: the zero K tail adds nothing
    # to the dot, and rows and columns past the edge are never stored.
    k_ok = common.arange32(whole_k) < problem.k
    row_ok = rows < problem.m
    if problem.transpose_a:  # A is stored (K, M)
      a_tile = pltriton.load(a_ref.at[pl.ds(0, whole_k), :],
                             mask=k_ok[:, None] & row_ok[None, :], other=0).T
    else:
      a_tile = pltriton.load(a_ref.at[:, pl.ds(0, whole_k)],
                             mask=row_ok[:, None] & k_ok[None, :], other=0)
    col_ok = cols < problem.n
    if problem.transpose_b:  # B is stored (N, K)
      b_tile = pltriton.load(b_ref.at[:, pl.ds(0, whole_k)],
                             mask=col_ok[:, None] & k_ok[None, :], other=0).T
    else:
      b_tile = pltriton.load(b_ref.at[pl.ds(0, whole_k), :],
                             mask=k_ok[:, None] & col_ok[None, :], other=0)
    acc = jnp.dot(a_tile, b_tile, precision=common.dot_precision(problem),
                  preferred_element_type=jnp.float32)

    out_ok = row_ok[:, None] & col_ok[None, :]
    c_tile = bias_row = None
    if problem.epilogue.has_c:
      c_tile = pltriton.load(c_ref, mask=out_ok, other=0)
    if problem.epilogue.has_bias:
      bias_row = pltriton.load(bias_ref, mask=col_ok, other=0)[None, :]
    out = apply_epilogue(acc, problem.epilogue, c_tile, bias_row)
    pltriton.store(o_ref, out.astype(o_ref.dtype), mask=out_ok)

  # The BlockSpecs hand each program its (BM, whole K) and (whole K, BN)
  # operand blocks: a config whose K step is the whole (padded) K.
  whole_k_config = common.TritonConfig(
      block_m=bm, block_n=bn, block_k=whole_k, num_warps=config.num_warps,
      num_stages=1)
  grid = (problem.batch, cdiv(problem.m, bm), cdiv(problem.n, bn))
  return common.run_tiled(kernel, a, b, c, bias, problem=problem,
                          config=whole_k_config, interpret=interpret,
                          name="naive", grid=grid,
                          block_index=lambda b, i, j: (b, i, j))


def heuristic_config(problem, device):
  del device
  return common.small_problem_config(problem, DEFAULT_CONFIG)


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
