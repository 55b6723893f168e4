"""Infrastructure every rung of the Pallas-Triton ladder shares.

Nothing here computes a GEMM: the loads, masks, K loops and stores are
written out in each teaching rung (`k01_naive` ... `k05_split_k`), and the
production rung's own versions are in `tuned_kernels`. What is shared is
what every rung would otherwise copy verbatim and what the rest of the
package and the experiments import:

  * `TritonConfig`, validated at construction, and `small_problem_config`;
  * `triton_supports`, the checks every rung makes;
  * `dot_precision`, the problem's precision as a `jax.lax.Precision`;
  * the launch plumbing: `operand_specs` (BlockSpecs for a, b, c, bias and
    the output from a program -> tile mapping), `unpack_refs`,
    `operands_list`, `launch` and `run_tiled` (`pl.pallas_call` with the
    config's compile options) and `register_fixed_config_rung`;
  * `grouped_tile_index`, the program -> tile order that rungs 4-6 and the
    experiments use (rung 4's docstring says why it helps);
  * `arange32`/`index32`: int32 index vectors and scalars, so a kernel's
    index arithmetic stays int32 (the width of Triton's program ids) also
    when JAX runs with `jax_enable_x64`.

Masking, not padding: the kernels read operands where they lie and mask the
ragged edges, so any M, N and K works without copying an operand on the
host. Along K a BlockSpec covers the whole contraction, rounded up to a
multiple of `block_k`, and a kernel walks it with `pl.ds`; rounding up keeps
every `pl.ds` inside the block, which interpret mode needs (it pads the
operand to the block with garbage, and the masks hide that garbage).
"""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_gemm import registry
from pallas_gemm.config_fields import (at_least, checked, in_range, one_of,
                                       power_of_two_at_least, validate)
from pallas_gemm.devices import DeviceInfo
from pallas_gemm.problem import SUPPORTED_INPUT_DTYPES, GemmProblem, cdiv

# The Pallas-Triton lowering is deprecated since JAX 0.11 (Mosaic GPU is its
# successor); it still works in 0.11.x/0.12 and this backend keeps it running.
warnings.filterwarnings(
    "ignore", category=DeprecationWarning, message=".*[Tt]riton.*")

# Triton's dot needs power-of-two tiles of at least 16 along every dim.
_MIN_BLOCK = 16
_WARP_COUNTS = (1, 2, 4, 8, 16)
_MAX_PROGRAMS_PER_SM = 8


_TRITON_BLOCK = power_of_two_at_least(_MIN_BLOCK).because("Triton's dot")


@dataclasses.dataclass(frozen=True)
class TritonConfig:
  """Tile shape and Triton compile options for one kernel launch.

  Every rung takes the same config; a rung ignores the knobs it predates
  (rung 2 has no `group_m`, only rungs 5-6 read `split_k`, only rung 6
  reads `k_major` and `programs_per_sm`).

  `k_major`: copy an operand whose contraction dim is not the contiguous
  one (A given as (K, M), B as (K, N)) into K-contiguous form in XLA before
  the kernel. Hopper's wgmma reads 32-bit (TF32) operands only K-major, so
  without the copy Triton moves such an operand 4 bytes at a time; the copy
  is one pass over the operand, and what it gained on the H200 is in
  experiments/results/nvidia_h200/triton/README.md ("Why TF32 was slow").

  `programs_per_sm` (rung 6 only): 0 launches one program per output tile;
  n > 0 launches n programs per SM that each loop over output tiles (a
  persistent grid).

  Validated at construction: every field but `k_major` is an int (a bool,
  float or string raises TypeError); the block sizes are powers of two >= 16
  and `num_warps` one of 1, 2, 4, 8, 16 (Triton's layouts need both);
  `num_stages`, `group_m` and `split_k` are >= 1 and `programs_per_sm` in
  [0, 8] (ValueError). Every error names the field and the value.
  """

  block_m: int = checked(64, _TRITON_BLOCK)
  block_n: int = checked(64, _TRITON_BLOCK)
  block_k: int = checked(32, _TRITON_BLOCK)
  num_warps: int = checked(4, one_of(*_WARP_COUNTS))
  num_stages: int = checked(1, at_least(1))
  group_m: int = checked(1, at_least(1))
  split_k: int = checked(1, at_least(1))
  k_major: bool = False
  programs_per_sm: int = checked(0, in_range(0, _MAX_PROGRAMS_PER_SM).because(
      "0: one program per output tile"))

  def __post_init__(self):
    validate(self)

  def smem_bytes(self, problem: GemmProblem | str) -> int:
    """Shared memory the software pipeline holds: one A and one B tile per
    stage (Triton keeps at least two stages for a pipelined loop). Takes
    the problem or only its input dtype."""
    in_dtype = problem.in_dtype if isinstance(problem, GemmProblem) else problem
    itemsize = jnp.dtype(in_dtype).itemsize
    stages = max(self.num_stages, 1)
    return (self.block_m + self.block_n) * self.block_k * itemsize * stages


def triton_supports(problem: GemmProblem, device: DeviceInfo,
                    config: TritonConfig | None = None) -> str | None:
  """The checks every rung shares; None means supported."""
  if problem.in_dtype not in SUPPORTED_INPUT_DTYPES:
    return (f"input dtype {problem.in_dtype} is not one of "
            f"{SUPPORTED_INPUT_DTYPES}")
  if device.is_gpu:
    if device.compute_capability is None or device.compute_capability < (8, 0):
      return "Pallas-Triton tensor-core kernels need compute capability >= 8.0"
    if config is not None and device.smem_per_block and (
        config.smem_bytes(problem.in_dtype) > device.smem_per_block):
      return (f"config needs {config.smem_bytes(problem.in_dtype)} bytes of "
              f"shared memory, the device has {device.smem_per_block}")
  return None


def small_problem_config(problem: GemmProblem,
                         base: TritonConfig) -> TritonConfig:
  """Shrinks tiles that are far larger than the problem (M=1, tiny N or K)
  so a decode-sized call does not compute mostly masked-out work."""
  def fit(block, size):
    while block > _MIN_BLOCK and block // 2 >= size:
      block //= 2
    return block
  return dataclasses.replace(
      base, block_m=fit(base.block_m, problem.m),
      block_n=fit(base.block_n, problem.n),
      block_k=fit(base.block_k, problem.k))


def dot_precision(problem: GemmProblem):
  if problem.precision == "ieee":
    return jax.lax.Precision.HIGHEST
  return jax.lax.Precision.DEFAULT


# ------------------------------------------------------------ int32 index ---


def arange32(size: int):
  """`[0, size)` as int32: with x64 on, `jnp.arange` would give int64 and
  drag every offset and mask computed from it to 64 bits."""
  return jnp.arange(size, dtype=jnp.int32)


def index32(index):
  """A loop index as int32. `fori_loop` over static bounds counts in the
  default int type, int64 with x64 on; the offsets computed from it stay
  int32 like the program ids (with x64 off this is a no-op)."""
  return index.astype(jnp.int32)


def grouped_tile_index(tile_id, *, grid_m: int, grid_n: int, group_m: int):
  """Maps an int32 linear program id to an output tile (i, j) in grouped
  order (why: see `k04_grouped`).

  Row-major order walks a whole row of tiles before the next; grouped order
  walks `group_m` rows down one column before moving right (group_m = 3):

      row-major ids          grouped ids
      0  1  2  3  4         0  3  6  9 12
      5  6  7  8  9         1  4  7 10 13
     10 11 12 13 14         2  5  8 11 14
     15 16 17 18 19        15 17 19 21 23
                           16 18 20 22 24   <- last group may be short

  Written with lax.div/rem on non-negative ints, which lower to one integer
  op each in Triton (jnp's floor division would add sign fix-ups); their
  constant operands are int32 like the ids, whatever x64 says.
  """
  tiles_per_group = np.int32(group_m * grid_n)
  group = jax.lax.div(tile_id, tiles_per_group)
  first_row = group * group_m
  rows_in_group = jnp.minimum(grid_m - first_row, group_m)
  within = jax.lax.rem(tile_id, tiles_per_group)
  i = first_row + jax.lax.rem(within, rows_in_group)
  j = jax.lax.div(within, rows_in_group)
  return i, j


# ------------------------------------------------------ launch plumbing ---


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


def unpack_refs(refs, problem: GemmProblem):
  """(a_ref, b_ref, c_ref|None, bias_ref|None, o_ref) from the kernel's refs."""
  a_ref, b_ref, *rest = refs
  c_ref = rest.pop(0) if problem.epilogue.has_c else None
  bias_ref = rest.pop(0) if problem.epilogue.has_bias else None
  (o_ref,) = rest
  return a_ref, b_ref, c_ref, bias_ref, o_ref


def operands_list(a, b, c, bias):
  return [x for x in (a, b, c, bias) if x is not None]


def launch(kernel_body, operands, *, config: TritonConfig, interpret: bool,
           name: str, grid, in_specs, out_specs, out_shape):
  """`pl.pallas_call` with the config's Triton compile options."""
  return pl.pallas_call(
      kernel_body,
      out_shape=out_shape,
      grid=grid,
      in_specs=in_specs,
      out_specs=out_specs,
      compiler_params=pltriton.CompilerParams(
          num_warps=config.num_warps, num_stages=config.num_stages),
      interpret=interpret,
      name=name,
  )(*operands)


def output_shape(problem: GemmProblem):
  return jax.ShapeDtypeStruct((problem.batch, problem.m, problem.n),
                              problem.out_dtype)


def run_tiled(kernel_body, a, b, c, bias, *, problem: GemmProblem,
              config: TritonConfig, interpret: bool, name: str,
              grid, block_index):
  """Launches `kernel_body(refs...)` over `grid`, one output tile per
  program, with the BlockSpecs of `operand_specs`."""
  in_specs, out_spec = operand_specs(
      problem, config, k_blocks=cdiv(problem.k, config.block_k),
      block_index=block_index)
  return launch(kernel_body, operands_list(a, b, c, bias), config=config,
                interpret=interpret, name=name, grid=grid, in_specs=in_specs,
                out_specs=out_spec, out_shape=output_shape(problem))


def register_fixed_config_rung(name: str, fn, default: TritonConfig,
                               description: str):
  """Registers a rung whose only tuning is one default config, shrunk for
  small problems, and returns its `heuristic(problem, device)`."""
  def heuristic(problem, device):
    del device
    return small_problem_config(problem, default)

  def supports(problem, device):
    return triton_supports(problem, device, heuristic(problem, device))

  registry.register(registry.KernelEntry(
      name=name, fn=fn, supports=supports, heuristic=heuristic,
      config_cls=TritonConfig, runs_on_cpu=True, description=description))
  return heuristic
