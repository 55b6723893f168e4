"""`xla`: the grouped GEMM written with `jax.lax.ragged_dot_general`.

It runs every `RaggedProblem` on every platform and is the explicit fallback
when no Pallas kernel supports a problem. `jax.lax.ragged_dot_general` has
no `group_offset` yet, so a `row_offset` is honoured by rotating the rows:
the groups then start at row 0, and rows outside every group come out zero
(or are left out of the sums) exactly as the problem defines.

A decode batch (far fewer rows than groups) first gathers the weights of
the groups with rows (`gathers`), since XLA's product would read them all.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_gemm.problem import ACTIVATIONS
from pallas_gemm.ragged_dot import mosaic_schedule as schedule
from pallas_gemm.ragged_dot.problem import RaggedProblem

NAME = "xla"

_PRECISION = {
    "ieee": jax.lax.Precision.HIGHEST,
    "tf32": jax.lax.Precision.DEFAULT,
    "default": jax.lax.Precision.DEFAULT,
}


def supports(problem: RaggedProblem, device) -> str | None:
  del problem, device
  return None


def heuristic(problem: RaggedProblem, device):
  del problem, device
  return None


def clipped_groups(group_sizes, row_offset, m: int):
  """(first row, sizes) of the groups once clipped to [0, m), as int32; a
  negative size counts as zero: the rows of the Mosaic kernels' schedule
  (`mosaic_schedule.group_rows`, plain jnp ops).

  The clipped sizes sum to at most m - first row, so the rows they cover
  never wrap around when the operands are rotated by the first row."""
  offset = jnp.reshape(row_offset, (1,)).astype(jnp.int32)
  starts, ends = schedule.group_rows(group_sizes, offset, m)
  return jnp.clip(offset[0], 0, m), ends - starts


def product_sizes(group_sizes, row_offset, m: int):
  """(first row, sizes) to give XLA's ragged product, once the rows are
  rotated to start at the first row. XLA assigns the rows by comparing them
  with the sizes' cumulative sum, so sizes that sum past m need no clip:
  the rows past m do not exist. A negative size (which would move the later
  groups back) needs only a maximum. A row offset other than 0 needs
  `clipped_groups`, whose cumulative sum is a kernel of its own: below 0
  the first groups start before row 0, above it the rows rotated round to
  the end belong to no group. With no group offset the row offset is a
  constant 0, so XLA folds the select and that kernel is gone."""
  first, clipped = clipped_groups(group_sizes, row_offset, m)
  nonnegative = jnp.maximum(group_sizes.astype(jnp.int32), 0)
  at_row_0 = jnp.reshape(row_offset, ()) == 0
  return first, jnp.where(at_row_0, nonnegative, clipped)


def group_row_mask(group_sizes, row_offset, m: int):
  """(m,) bool: which rows belong to some group."""
  first, sizes = clipped_groups(group_sizes, row_offset, m)
  rows = jnp.arange(m, dtype=jnp.int32)
  return (rows >= first) & (rows < first + jnp.sum(sizes))


#: Passes over the gathered weights: the gather's read and write, then the
#: product's read.
GATHER_PASSES = 3


def gathers(problem: RaggedProblem) -> bool:
  """Whether the "rows" product first gathers the weights of the groups
  with rows (`groups_with_rows`). XLA's ragged product reads the weights
  of every group, also of those with no rows, and multiplies every row by
  each. At most m groups have rows, so with few rows copying theirs pays:
  `GATHER_PASSES` over m groups' weights against one over all groups'."""
  return (problem.mode == "rows"
          and 0 < GATHER_PASSES * problem.m < problem.groups)


def groups_with_rows(rhs, group_sizes, row_offset, m: int, count: int):
  """(rhs, group_sizes, row_offset) of the same "rows" product over only
  the groups that have rows, in order, padded with empty groups to `count`
  groups (`count` >= how many groups have rows, which m bounds). Groups of
  no rows leave no gap in the rows, so dropping them moves no group; the
  sizes come back clipped to [0, m), from the clipped first row. A gather
  on the device: no host sync, one compiled program for any routing."""
  first, sizes = clipped_groups(group_sizes, row_offset, m)
  has_rows = sizes > 0
  (kept,) = jnp.nonzero(has_rows, size=count, fill_value=0)
  # The barrier makes the few indices an array of their own: otherwise XLA
  # fuses their computation (a cumulative sum) into the gather's fusions,
  # which then redo it for every weight element they copy.
  kept = jax.lax.optimization_barrier(kept)
  padding = jnp.arange(count) >= jnp.sum(has_rows)
  return (jnp.take(rhs, kept, axis=0, mode="clip"),
          jnp.where(padding, 0, sizes[kept]), jnp.reshape(first, (1,)))


def ragged_matmul(lhs, rhs, group_sizes, row_offset, *, problem: RaggedProblem,
                  config=None, interpret=False):
  del interpret
  if config is not None:
    raise TypeError(f"the xla implementation takes no config, got {config!r}")
  m = problem.m
  first, sizes = product_sizes(group_sizes, row_offset, m)
  precision = _PRECISION[problem.precision]
  wide = jnp.float64 if "float64" in (problem.in_dtype,
                                      problem.out_dtype) else jnp.float32
  acc_dtype = problem.out_dtype if problem.activation is None else wide
  # Rotating by a traced amount is a dynamic slice of the doubled array;
  # with m == 0 there is nothing to rotate.
  rotate = (lambda x, shift: jnp.roll(x, shift, axis=0)) if m else (
      lambda x, shift: x)
  if problem.mode == "contracting":
    out = jax.lax.ragged_dot_general(
        rotate(lhs, -first), rotate(rhs, -first), sizes,
        problem.dimension_numbers, precision=precision,
        preferred_element_type=acc_dtype)
    return out.astype(problem.out_dtype)
  if gathers(problem):
    rhs, sizes, _ = groups_with_rows(rhs, group_sizes, row_offset, m, m)
  out = jax.lax.ragged_dot_general(
      rotate(lhs, -first), rhs, sizes, problem.dimension_numbers,
      precision=precision, preferred_element_type=acc_dtype)
  out = rotate(out, first)
  if problem.activation is not None:
    mask = group_row_mask(group_sizes, row_offset, m)
    out = jnp.where(mask[:, None], ACTIVATIONS[problem.activation](out), 0)
  return out.astype(problem.out_dtype)
