"""`jax.lax.dot_general` dimension numbers as one (batched) GEMM.

Every valid set of dimension numbers is a batched GEMM once each operand's
axes are grouped as (batch, rows, columns):

  lhs  (B, M, K) or, read transposed, (B, K, M)
  rhs  (B, K, N) or, read transposed, (B, N, K)

where B flattens the batch dims (in the order the dimension numbers pair
them), M the lhs free dims, N the rhs free dims and K the contracting dims
(in one order shared by both operands). The GEMM's (B, M, N) output then
reshapes, for free, into lax's output order: batch, lhs free, rhs free.

Grouping is a free reshape when an operand's axes are already stored in the
grouped order; axes of size 1 do not count, since they can sit anywhere in
memory. Otherwise the operand is transposed first, which costs a copy; the
`transpose_a`/`transpose_b` flags absorb the two orders the kernels read
without one. `plan` picks the grouping that copies the fewest elements.
"""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class GemmPlan:
  """How to run one `dot_general` as a GEMM.

  `lhs_order`/`rhs_order` list the operand's axes in grouped order; an
  operand whose `*_copy` is set must be transposed into that order first,
  otherwise a reshape to `*_shape` is enough.
  """

  lhs_order: tuple[int, ...]
  rhs_order: tuple[int, ...]
  lhs_copy: bool
  rhs_copy: bool
  lhs_shape: tuple[int, ...]   # (B, M, K) / (B, K, M), or without B
  rhs_shape: tuple[int, ...]   # (B, K, N) / (B, N, K), or without B
  transpose_a: bool
  transpose_b: bool
  out_shape: tuple[int, ...]   # lax's: batch, lhs free, rhs free

  @property
  def copies(self) -> tuple[str, ...]:
    return tuple(name for name, copy in (("lhs", self.lhs_copy),
                                         ("rhs", self.rhs_copy)) if copy)


def _is_free(shape, order) -> bool:
  """Whether reading `shape`'s axes in `order` needs no data movement."""
  stored = [axis for axis in order if shape[axis] != 1]
  return stored == sorted(stored)


def _valid_dims(ndim, dims) -> bool:
  return all(isinstance(d, int) and 0 <= d < ndim for d in dims)


def check(lhs_shape, rhs_shape, dimension_numbers) -> str | None:
  """None for valid dimension numbers, else why not (lax raises the error
  itself; this only decides not to plan)."""
  try:
    (lc, rc), (lb, rb) = dimension_numbers
    lc, rc, lb, rb = (tuple(int(d) for d in x) for x in (lc, rc, lb, rb))
  except (TypeError, ValueError):
    return "the dimension numbers are not ((lc, rc), (lb, rb))"
  if len(lc) != len(rc) or len(lb) != len(rb):
    return "contracting or batch dims are not paired"
  lhs_dims, rhs_dims = lc + lb, rc + rb
  if not (_valid_dims(len(lhs_shape), lhs_dims)
          and _valid_dims(len(rhs_shape), rhs_dims)):
    return "a dimension is out of range"
  if len(set(lhs_dims)) != len(lhs_dims) or len(set(rhs_dims)) != len(rhs_dims):
    return "a dimension is listed twice"
  if any(lhs_shape[l] != rhs_shape[r] for l, r in zip(lhs_dims, rhs_dims)):
    return "paired dimensions differ in size"
  return None


def plan(lhs_shape, rhs_shape, dimension_numbers) -> GemmPlan:
  """The cheapest GEMM plan for valid dimension numbers (see `check`)."""
  lhs_shape, rhs_shape = tuple(lhs_shape), tuple(rhs_shape)
  (lc, rc), (lb, rb) = dimension_numbers
  lc, rc, lb, rb = (tuple(int(d) for d in x) for x in (lc, rc, lb, rb))
  lhs_free = tuple(d for d in range(len(lhs_shape)) if d not in lc + lb)
  rhs_free = tuple(d for d in range(len(rhs_shape)) if d not in rc + rb)
  batch = tuple(lhs_shape[d] for d in lb)
  b, m, n, k = (math.prod(batch), math.prod(lhs_shape[d] for d in lhs_free),
                math.prod(rhs_shape[d] for d in rhs_free),
                math.prod(lhs_shape[d] for d in lc))
  out_shape = (batch + tuple(lhs_shape[d] for d in lhs_free)
               + tuple(rhs_shape[d] for d in rhs_free))
  lead = (b,) if lb else ()

  # K may flatten its pairs in any order both operands share: try the
  # order each operand stores them in.
  pairs = list(zip(lc, rc))
  pair_orders = {tuple(sorted(pairs)), tuple(sorted(pairs, key=lambda p: p[1]))}
  best, best_cost = None, None
  for pair_order in sorted(pair_orders):
    lhs_k = tuple(l for l, _ in pair_order)
    rhs_k = tuple(r for _, r in pair_order)
    lhs_options = [  # (order, transposed): (B, M, K) first, then (B, K, M)
        (lb + lhs_free + lhs_k, False), (lb + lhs_k + lhs_free, True)]
    rhs_options = [  # (B, K, N) first, then (B, N, K)
        (rb + rhs_k + rhs_free, False), (rb + rhs_free + rhs_k, True)]
    lhs_order, ta, lhs_copy = _pick(lhs_shape, lhs_options)
    rhs_order, tb, rhs_copy = _pick(rhs_shape, rhs_options)
    cost = (lhs_copy * math.prod(lhs_shape) + rhs_copy * math.prod(rhs_shape))
    if best_cost is None or cost < best_cost:
      best_cost = cost
      best = GemmPlan(
          lhs_order=lhs_order, rhs_order=rhs_order, lhs_copy=lhs_copy,
          rhs_copy=rhs_copy,
          lhs_shape=lead + ((k, m) if ta else (m, k)),
          rhs_shape=lead + ((n, k) if tb else (k, n)),
          transpose_a=ta, transpose_b=tb, out_shape=out_shape)
  return best


def _pick(shape, options):
  """The first free option, else the first one, copied."""
  for order, transposed in options:
    if _is_free(shape, order):
      return order, transposed, False
  order, transposed = options[0]
  return order, transposed, True


def arrange(x, order, copy, shape):
  """`x` with its axes grouped as planned: a transpose only when needed."""
  if copy:
    x = x.transpose(order)
  return x.reshape(shape)


def describe(dimension_numbers) -> str:
  (lc, rc), (lb, rb) = dimension_numbers
  return (f"contracting {tuple(lc)}x{tuple(rc)}, "
          f"batch {tuple(lb)}x{tuple(rb)}")
