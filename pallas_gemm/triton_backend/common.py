"""Pieces every rung of the Pallas-Triton ladder shares.

Masking, not padding: the kernels read operands where they lie and mask the
ragged edges, so any M, N and K works without copying an operand on the host.
An A tile whose rows run past M, or whose columns run past K, is loaded with
`other=0`; zeros in the K tail add nothing to the dot, and rows past M are
never stored.

Blocks: along K a BlockSpec covers the whole contraction, rounded up to a
multiple of `block_k`, and the kernel walks it with `pl.ds`. Rounding up
keeps every `pl.ds` inside the block, which interpret mode needs (it pads the
operand to the block with garbage and the mask hides that garbage).
"""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_gemm.devices import DeviceInfo
from pallas_gemm.problem import (SUPPORTED_INPUT_DTYPES, GemmProblem,
                                 apply_epilogue, cdiv)

# The Pallas-Triton lowering is deprecated since JAX 0.11 (Mosaic GPU is its
# successor); it still works in 0.11.x/0.12 and this backend keeps it running.
warnings.filterwarnings(
    "ignore", category=DeprecationWarning, message=".*[Tt]riton.*")


@dataclasses.dataclass(frozen=True)
class TritonConfig:
  """Tile shape and Triton compile options for one kernel launch.

  Every rung takes the same config; a rung ignores the knobs it predates
  (rung 2 has no `group_m`, only rung 5 reads `split_k`).
  """

  block_m: int = 64
  block_n: int = 64
  block_k: int = 32
  num_warps: int = 4
  num_stages: int = 1
  group_m: int = 1
  split_k: int = 1

  def __post_init__(self):
    for name in ("block_m", "block_n", "block_k"):
      value = getattr(self, name)
      if value < 16 or value & (value - 1):
        raise ValueError(
            f"{name}={value} must be a power of two >= 16 (Triton's dot)")
    if self.num_warps not in (1, 2, 4, 8, 16):
      raise ValueError(f"num_warps={self.num_warps} must be 1, 2, 4, 8 or 16")
    if self.num_stages < 1:
      raise ValueError(f"num_stages={self.num_stages} must be >= 1")
    if self.group_m < 1:
      raise ValueError(f"group_m={self.group_m} must be >= 1")
    if self.split_k < 1:
      raise ValueError(f"split_k={self.split_k} must be >= 1")

  def smem_bytes(self, in_dtype: str) -> int:
    """Shared memory the software pipeline holds: one A and one B tile per
    stage (Triton keeps at least two stages for a pipelined loop)."""
    itemsize = jnp.dtype(in_dtype).itemsize
    stages = max(self.num_stages, 1)
    return (self.block_m + self.block_n) * self.block_k * itemsize * stages


def triton_supports(problem: GemmProblem, device: DeviceInfo,
                    config: TritonConfig | None = None) -> str | None:
  """The checks every rung shares; None means supported."""
  if problem.in_dtype not in SUPPORTED_INPUT_DTYPES:
    return f"input dtype {problem.in_dtype} is not one of {SUPPORTED_INPUT_DTYPES}"
  if device.is_gpu:
    if device.compute_capability is None or device.compute_capability < (8, 0):
      return "Pallas-Triton tensor-core kernels need compute capability >= 8.0"
    if config is not None and device.smem_per_block and (
        config.smem_bytes(problem.in_dtype) > device.smem_per_block):
      return (f"config needs {config.smem_bytes(problem.in_dtype)} bytes of "
              f"shared memory, the device has {device.smem_per_block}")
  return None


def dot_precision(problem: GemmProblem):
  if problem.precision == "ieee":
    return jax.lax.Precision.HIGHEST
  return jax.lax.Precision.DEFAULT


def operand_specs(problem: GemmProblem, config: TritonConfig, *,
                  k_blocks: int, block_index):
  """BlockSpecs for a, b, c and bias over a (batch, m-block, n-block) index.

  `block_index(*grid_ids)` must return `(batch, i, j)`: the batch entry and
  the output tile this program computes. Rungs with a remapped program order
  pass their own mapping; all operand specs derive from it, so they agree.
  """
  bm, bn, bk = config.block_m, config.block_n, config.block_k
  k_span = k_blocks * bk

  def a_map(*ids):
    b, i, _ = block_index(*ids)
    return (b, 0, i) if problem.transpose_a else (b, i, 0)

  def b_map(*ids):
    b, _, j = block_index(*ids)
    return (b, j, 0) if problem.transpose_b else (b, 0, j)

  def c_map(*ids):
    return block_index(*ids)

  def bias_map(*ids):
    return (block_index(*ids)[2],)

  a_block = (None, k_span, bm) if problem.transpose_a else (None, bm, k_span)
  b_block = (None, bn, k_span) if problem.transpose_b else (None, k_span, bn)
  specs = [pl.BlockSpec(a_block, a_map), pl.BlockSpec(b_block, b_map)]
  if problem.epilogue.has_c:
    specs.append(pl.BlockSpec((None, bm, bn), c_map))
  if problem.epilogue.has_bias:
    specs.append(pl.BlockSpec((bn,), bias_map))
  out_spec = pl.BlockSpec((None, bm, bn), c_map)
  return specs, out_spec


def load_a_tile(a_ref, k_index, *, problem: GemmProblem, rows, bk: int):
  """The (block_m, block_k) tile of op(a) for K step `k_index`, zero-masked."""
  ks = k_index * bk + jnp.arange(bk)
  k_ok = ks < problem.k
  row_ok = rows < problem.m
  if problem.transpose_a:
    tile = pltriton.load(a_ref.at[pl.ds(k_index * bk, bk), :],
                         mask=k_ok[:, None] & row_ok[None, :], other=0)
    return tile.T
  return pltriton.load(a_ref.at[:, pl.ds(k_index * bk, bk)],
                       mask=row_ok[:, None] & k_ok[None, :], other=0)


def load_b_tile(b_ref, k_index, *, problem: GemmProblem, cols, bk: int):
  """The (block_k, block_n) tile of op(b) for K step `k_index`, zero-masked."""
  ks = k_index * bk + jnp.arange(bk)
  k_ok = ks < problem.k
  col_ok = cols < problem.n
  if problem.transpose_b:
    tile = pltriton.load(b_ref.at[:, pl.ds(k_index * bk, bk)],
                         mask=col_ok[:, None] & k_ok[None, :], other=0)
    return tile.T
  return pltriton.load(b_ref.at[pl.ds(k_index * bk, bk), :],
                       mask=k_ok[:, None] & col_ok[None, :], other=0)


def accumulate_k_range(a_ref, b_ref, *, problem, config, rows, cols,
                       k_start, k_stop):
  """acc = Σ_{k in [k_start, k_stop)} A[rows, k-tile] · B[k-tile, cols]."""
  bk = config.block_k
  precision = dot_precision(problem)

  def body(k_index, acc):
    a_tile = load_a_tile(a_ref, k_index, problem=problem, rows=rows, bk=bk)
    b_tile = load_b_tile(b_ref, k_index, problem=problem, cols=cols, bk=bk)
    return acc + jnp.dot(a_tile, b_tile, precision=precision,
                         preferred_element_type=jnp.float32)

  acc = jnp.zeros((config.block_m, config.block_n), jnp.float32)
  return jax.lax.fori_loop(k_start, k_stop, body, acc)


def store_output(o_ref, acc, *, problem, rows, cols, c_ref=None,
                 bias_ref=None):
  """Applies the fused epilogue to the f32 tile and stores the in-range part."""
  row_ok = rows < problem.m
  col_ok = cols < problem.n
  mask = row_ok[:, None] & col_ok[None, :]
  c_tile = bias_tile = None
  if problem.epilogue.has_c:
    c_tile = pltriton.load(c_ref, mask=mask, other=0)
  if problem.epilogue.has_bias:
    bias_tile = pltriton.load(bias_ref, mask=col_ok, other=0)[None, :]
  out = apply_epilogue(acc, problem.epilogue, c_tile, bias_tile)
  pltriton.store(o_ref, out.astype(o_ref.dtype), mask=mask)


def unpack_refs(refs, problem: GemmProblem):
  """(a_ref, b_ref, c_ref|None, bias_ref|None, o_ref) from the kernel's refs."""
  a_ref, b_ref, *rest = refs
  c_ref = rest.pop(0) if problem.epilogue.has_c else None
  bias_ref = rest.pop(0) if problem.epilogue.has_bias else None
  (o_ref,) = rest
  return a_ref, b_ref, c_ref, bias_ref, o_ref


def operands_list(a, b, c, bias):
  return [x for x in (a, b, c, bias) if x is not None]


def run_tiled(kernel_body, a, b, c, bias, *, problem: GemmProblem,
              config: TritonConfig, interpret: bool, name: str,
              grid, block_index):
  """Launches `kernel_body(refs...)` over `grid` with the shared BlockSpecs."""
  k_blocks = cdiv(problem.k, config.block_k)
  in_specs, out_spec = operand_specs(problem, config, k_blocks=k_blocks,
                                     block_index=block_index)
  return pl.pallas_call(
      kernel_body,
      out_shape=jax.ShapeDtypeStruct((problem.batch, problem.m, problem.n),
                                     problem.out_dtype),
      grid=grid,
      in_specs=in_specs,
      out_specs=out_spec,
      compiler_params=pltriton.CompilerParams(
          num_warps=config.num_warps, num_stages=config.num_stages),
      interpret=interpret,
      name=name,
  )(*operands_list(a, b, c, bias))


def program_rows_cols(i, j, config: TritonConfig):
  rows = i * config.block_m + jnp.arange(config.block_m)
  cols = j * config.block_n + jnp.arange(config.block_n)
  return rows, cols


def small_problem_config(problem: GemmProblem, base: TritonConfig) -> TritonConfig:
  """Shrinks tiles that are far larger than the problem (M=1, tiny N or K)
  so a decode-sized call does not compute mostly masked-out work."""
  def fit(block, size):
    while block > 16 and block // 2 >= size:
      block //= 2
    return block
  return dataclasses.replace(
      base, block_m=fit(base.block_m, problem.m),
      block_n=fit(base.block_n, problem.n),
      block_k=fit(base.block_k, problem.k))
