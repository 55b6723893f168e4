"""What one grouped (ragged) GEMM call asks for, as hashable data.

A mixture-of-experts layer sorts its tokens by expert, so the rows of `lhs`
come in consecutive groups, one per expert. Two products are needed:

  mode "rows"         lhs (m, k), rhs (groups, k, n), or (groups, n, k) when
                      `transpose_rhs`; out (m, n):
                        out[r] = activation(lhs[r] @ rhs[g])
                      for every row r of group g. This is the forward pass
                      and, with rhs read transposed, the lhs gradient.
  mode "contracting"  lhs (m, k), rhs (m, n) (the output cotangent);
                      out (groups, k, n):
                        out[g] = lhs[rows of g].T @ rhs[rows of g]
                      This is the rhs (expert weight) gradient.

Group g holds the rows [row_offset + sizes[0] + ... + sizes[g-1], ... +
sizes[g]), clipped to [0, m). Rows that belong to no group are zero in a
"rows" output and are left out of every "contracting" sum: this is what
`jax.lax.ragged_dot` does when the sizes sum to less than m, and what expert
parallelism needs, where a device holds only experts [offset, offset +
groups) and `row_offset` is the number of rows of the experts before them.

Group sizes are runtime data (an int32 array), never part of the problem:
a kernel compiled for one problem serves every distribution of the tokens.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from pallas_gemm.config_fields import check_sizes
from pallas_gemm.problem import ACTIVATIONS, itemsize

MODES = ("rows", "contracting")

#: `jax.lax.ragged_dot_general`'s dimension numbers of the products above:
#: rows against rhs (groups, k, n), against rhs (groups, n, k), and the
#: ragged contraction.
ROWS_NUMBERS = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((1,), (1,)), ((), ())),
    lhs_ragged_dimensions=(0,), rhs_group_dimensions=(0,))
ROWS_TRANSPOSED_NUMBERS = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((1,), (2,)), ((), ())),
    lhs_ragged_dimensions=(0,), rhs_group_dimensions=(0,))
CONTRACTING_NUMBERS = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((0,), (0,)), ((), ())),
    lhs_ragged_dimensions=(0,), rhs_group_dimensions=())


@dataclasses.dataclass(frozen=True)
class RaggedProblem:
  mode: str
  m: int
  k: int
  n: int
  groups: int
  in_dtype: str
  out_dtype: str
  transpose_rhs: bool = False
  activation: str | None = None
  precision: str = "default"

  def __post_init__(self):
    if self.mode not in MODES:
      raise ValueError(f"mode={self.mode!r} is not one of {MODES}")
    check_sizes(self, ("m", "k", "n", "groups"), minimum=0)
    if self.activation is not None and self.activation not in ACTIVATIONS:
      raise ValueError(f"activation={self.activation!r} is not one of "
                       f"{sorted(ACTIVATIONS)} or None")
    if self.mode == "contracting" and (self.transpose_rhs or self.activation):
      raise ValueError("the contracting form takes no transpose_rhs and no "
                       "activation")

  @property
  def lhs_shape(self) -> tuple[int, ...]:
    return (self.m, self.k)

  @property
  def rhs_shape(self) -> tuple[int, ...]:
    if self.mode == "contracting":
      return (self.m, self.n)
    if self.transpose_rhs:
      return (self.groups, self.n, self.k)
    return (self.groups, self.k, self.n)

  @property
  def out_shape(self) -> tuple[int, ...]:
    if self.mode == "contracting":
      return (self.groups, self.k, self.n)
    return (self.m, self.n)

  @property
  def flops(self) -> int:
    """Flops when every row belongs to a group."""
    return 2 * self.m * self.k * self.n

  @property
  def dimension_numbers(self) -> jax.lax.RaggedDotDimensionNumbers:
    """This product's `jax.lax.ragged_dot_general` dimension numbers."""
    if self.mode == "contracting":
      return CONTRACTING_NUMBERS
    return ROWS_TRANSPOSED_NUMBERS if self.transpose_rhs else ROWS_NUMBERS

  @property
  def out_bytes(self) -> int:
    """Bytes of the output."""
    return itemsize(self.out_dtype) * int(np.prod(self.out_shape))

  @property
  def min_bytes(self) -> int:
    """Bytes every implementation must move at least: each operand read once,
    the output written once."""
    size_in = itemsize(self.in_dtype)
    return (size_in * (int(np.prod(self.lhs_shape)) + int(np.prod(self.rhs_shape)))
            + self.out_bytes)


def group_bounds(group_sizes, m: int, row_offset: int = 0):
  """(start, end) row of each group, clipped to [0, m), as NumPy int64; a
  negative size counts as zero."""
  sizes = np.maximum(np.asarray(group_sizes, np.int64), 0)
  ends = row_offset + np.cumsum(sizes)
  starts = ends - sizes
  return np.clip(starts, 0, m), np.clip(ends, 0, m)


def reference(lhs, rhs, group_sizes, problem: RaggedProblem, row_offset: int = 0):
  """The float64 NumPy result of `problem` (for tests and the benchmark)."""
  lhs = np.asarray(lhs, np.float64)
  rhs = np.asarray(rhs, np.float64)
  starts, ends = group_bounds(group_sizes, problem.m, row_offset)
  out = np.zeros(problem.out_shape, np.float64)
  for g, (start, end) in enumerate(zip(starts, ends)):
    if problem.mode == "contracting":
      out[g] = lhs[start:end].T @ rhs[start:end]
    else:
      weights = rhs[g].T if problem.transpose_rhs else rhs[g]
      out[start:end] = lhs[start:end] @ weights
  if problem.activation is not None and problem.mode == "rows":
    import jax.numpy as jnp  # the activations are written with jnp
    rows = np.zeros(problem.m, bool)
    for start, end in zip(starts, ends):
      rows[start:end] = True
    act = np.asarray(ACTIVATIONS[problem.activation](jnp.asarray(out)),
                     np.float64)
    out = np.where(rows[:, None], act, 0.0)
  return out
