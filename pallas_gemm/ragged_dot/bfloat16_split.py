"""float32 and fp8 operands as bfloat16 parts, so that the grouped GEMM
kernels (which multiply 16-bit operands only) can run their work.

`bfloat16_parts(x)` cuts x into high + low: high is x's sign, exponent and
top 7 stored significand bits, low the rest rounded to bfloat16, so that
together they hold 16 of x's 24 significand bits.

`bfloat16_products(...)` turns a float32 `RaggedProblem` into one bfloat16
problem whose products are

    a @ b  ~  high(a) @ high(b) + high(a) @ low(b) + low(a) @ high(b)

(XLA's BF16_BF16_F32_X3 algorithm). What it leaves out, low(a) @ low(b) and
the rounding of each low part, is about 2^-16 of each product, finer than
the 2^-11 of the TF32 products that precision="default" allows for float32
operands on a GPU, but not the exact float32 products of
precision="highest". The three products run as one kernel call, so that the
kernel adds them in its float32 accumulator and rounds once:
  * "rows": the parts are laid side by side along the contraction, lhs
    (m, 3k) = [high, high, low] against rhs [high; low; high];
  * "contracting": each token row is repeated three times, once per pair
    of parts, so that every group's rows stay contiguous (the group sizes
    and the row offset are tripled).

An fp8 value is its own high part: bfloat16 holds every float8_e4m3fn and
float8_e5m2 value exactly, so fp8 operands become one bfloat16 product of
the same shape, exact, with a pass that widens them.

The pass over the weights is what a decode batch pays for: with fewer rows
than groups, most experts have no rows, and the kernels never read their
weights. So a "rows" problem with enough fewer rows than groups (`gathers`)
first gathers the weights of the groups that have rows (at most m of them,
found on the device: `xla.groups_with_rows`), and makes the parts of those
only.

For float32 operands, which is faster, this or XLA's ragged product of the
operands as they are, depends on the rows (`estimated_seconds`); the
automatic choice (`implementations.resolve`) asks the cost model. fp8
operands take the kernels (`XLA_COMPETES`), but on calls of a few
microseconds.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from pallas_gemm.devices import DeviceInfo, copy_tb_per_s, peak_tflops
from pallas_gemm.problem import itemsize
from pallas_gemm.ragged_dot.problem import RaggedProblem
from pallas_gemm.ragged_dot.xla import GATHER_PASSES as xla_gather_passes
from pallas_gemm.ragged_dot.xla import clipped_groups, groups_with_rows
from pallas_gemm.ragged_dot.xla import gathers as xla_gathers

#: How many bfloat16 products stand for one product of each dtype.
PRODUCTS = {"float32": 3, "float8_e4m3fn": 1, "float8_e5m2": 1}
INT32_MAX = 2**31 - 1


def bfloat16_parts(x):
  """(high, low) bfloat16 parts of float32 `x`: high is `x` cut to
  bfloat16's 8 significand bits, low what is left, rounded. The cut is a
  bit mask, not a round trip through bfloat16, because XLA may drop such a
  round trip (excess precision, on the GPU), which would leave low zero;
  and a cut never overflows. Where `x` is not finite, high is `x` (a NaN
  whose payload lies in the cut bits stays a NaN) and low is zero."""
  high, low, _ = _parts(x)
  return high, low


def products(problem: RaggedProblem) -> int:
  return PRODUCTS[problem.in_dtype]


def _parts(x):
  """(high, low, high of the cross terms): the last is high with the
  values that are not finite zeroed. A cross term multiplies one operand's
  high part by the other's low part; an infinity there would meet a low
  part of zero (any value that bfloat16 holds exactly) and make a NaN that
  the float32 product has not. The high x high term still carries it."""
  bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
  cut = jax.lax.bitcast_convert_type(bits & jnp.uint32(0xFFFF0000),
                                     jnp.float32)
  finite = jnp.isfinite(x)
  high = jnp.where(finite, cut, x).astype(jnp.bfloat16)
  low = jnp.where(finite, x - cut, 0).astype(jnp.bfloat16)
  cross_high = jnp.where(finite, cut, 0).astype(jnp.bfloat16)
  return high, low, cross_high


def splits(problem: RaggedProblem) -> bool:
  """Whether `problem` runs on the kernels as `bfloat16_products`."""
  return problem.in_dtype in PRODUCTS


def why_not(problem: RaggedProblem) -> str | None:
  """Why `problem` cannot run as bfloat16 products, or None."""
  count = products(problem)
  if problem.in_dtype == "float32" and problem.precision == "ieee":
    return (f"precision {problem.precision!r} asks for exact float32 "
            "products; the kernels' three bfloat16 products keep about 16 "
            "significand bits (enough for precision='default', which allows "
            "TF32)")
  if problem.mode == "contracting" and not repeated_rows_fit(problem.m,
                                                             count):
    return (f"the contracting form repeats each of the m={problem.m} rows "
            f"{count} times, past int32 row numbers")
  return None


#: Bytes the split moves per operand element beyond its first read: the
#: parts' pass writes 2 per part, and the kernel reads them again.
PART_BYTES_MOVED = 4
#: ... and per gathered float32 weight element (`xla.groups_with_rows`): XLA
#: computes the finiteness mask of gathered weights in a pass of its own,
#: which reads them (4) and writes the mask (1), read again by the parts.
GATHERED_MASK_BYTES = 6
#: The fractions of the datasheet peaks reached: the kernels' bfloat16
#: products on long calls, and XLA's float32 ragged product (TF32) near
#: where the two cross. Fitted to the H200 runs of
#: experiments/results/nvidia_h200/float32_ragged/; XLA's varies with the
#: shape, so near the crossing the choice can cost a little either way.
KERNEL_PEAK_FRACTION = 0.8
XLA_PEAK_FRACTION = 0.6
#: The operand dtypes whose XLA ragged product can beat the split: float32's
#: (on a few rows). XLA's fp8 ragged product ran far below the memory bound
#: on the H200, slower than the widened product on every layer measured but
#: the smallest (same folder), so fp8 operands take the kernels but on calls
#: of a few microseconds (`implementations.resolve`).
XLA_COMPETES = ("float32",)


def active_groups(problem: RaggedProblem) -> int:
  """How many groups' weights the split makes parts of: all, or m where it
  gathers the weights of the groups with rows first (`gathers`)."""
  return problem.m if gathers(problem) else problem.groups


def gathers(problem: RaggedProblem) -> bool:
  """Whether the split first gathers the weights of the groups with rows
  (`xla.groups_with_rows`). In the "rows" form at most m groups have rows; the
  gather pays where its passes over m groups' weights (with the mask pass
  that float32 weights get) move fewer bytes than one over all groups'."""
  if problem.mode != "rows" or problem.m >= problem.groups:
    return False
  return (problem.m * _gathered_bytes_per_element(problem)
          < problem.groups * _bytes_per_element(problem))


def _bytes_per_element(problem: RaggedProblem) -> int:
  """Bytes the split moves per operand element: its read, and its parts."""
  return itemsize(problem.in_dtype) + products(problem) * PART_BYTES_MOVED


def _gathered_bytes_per_element(problem: RaggedProblem) -> int:
  """... per gathered weight element: float32 weights add the mask pass."""
  return _bytes_per_element(problem) + (
      GATHERED_MASK_BYTES if products(problem) > 1 else 0)


def estimated_seconds(problem: RaggedProblem, device: DeviceInfo,
                      copies_us: float = 0.0) -> tuple[float, float]:
  """(the split on the kernels, XLA's ragged product of the operands as
  they are): a cost model for the automatic choice between them.
  `copies_us`: the kernels' path's pads and cuts of the parts, where k or
  n is not whole 64-column spans (`cost_model.copies_us`), added to the
  split's time.

  The split pays its memory passes over every operand element (over only
  m groups' weights where it `gathers`), then its bfloat16 products.
  XLA's ragged product expands the groups into one dense batched product,
  every group against every row: it reads each operand once but does
  `groups` times the flops (on a decode batch, over the gathered weights
  of at most m groups: `xla.gathers`). So XLA is faster on a few rows (a
  pass over the weights is all either does), and the split by up to the
  group count on many. For the dtypes of `XLA_COMPETES` only."""
  if problem.in_dtype not in XLA_COMPETES:
    raise ValueError(f"no cost model for XLA's {problem.in_dtype} ragged "
                     f"product (only {XLA_COMPETES})")
  bandwidth = copy_tb_per_s(device.device_kind) * 1e12
  bf16_rate = KERNEL_PEAK_FRACTION * 1e12 * (
      peak_tflops(device.device_kind, "bfloat16") or 989.0)
  xla_rate = XLA_PEAK_FRACTION * 1e12 * (
      peak_tflops(device.device_kind, "float32", "tf32") or 495.0)
  lhs_elements = math.prod(problem.lhs_shape)
  rhs_elements = math.prod(problem.rhs_shape)
  # The weights of the m groups a gather keeps, as whole groups' elements.
  kept_elements = rhs_elements * problem.m // max(problem.groups, 1)
  per_element = _bytes_per_element(problem)
  if gathers(problem):
    split_bytes = (per_element * lhs_elements
                   + _gathered_bytes_per_element(problem) * kept_elements)
  else:
    split_bytes = per_element * (lhs_elements + rhs_elements)
  split = ((split_bytes + problem.out_bytes) / bandwidth
           + products(problem) * problem.flops / bf16_rate + 1e-6 * copies_us)
  if xla_gathers(problem):
    xla_weights, xla_groups = xla_gather_passes * kept_elements, problem.m
  else:
    xla_weights, xla_groups = rhs_elements, problem.groups
  xla_bytes = problem.out_bytes + itemsize(problem.in_dtype) * (
      lhs_elements + xla_weights)
  xla = max(xla_bytes / bandwidth, xla_groups * problem.flops / xla_rate)
  return split, xla


def against_xla(problem: RaggedProblem, device: DeviceInfo,
                copies_us: float = 0.0) -> tuple[bool, str]:
  """(whether XLA's ragged product is expected to beat the split, why: the
  cost model's estimates, for `explain`); `copies_us` as
  `estimated_seconds` takes it."""
  count = products(problem)
  if problem.in_dtype not in XLA_COMPETES:
    return False, (f"widened exactly to {count} bfloat16 product; XLA's "
                   f"{problem.in_dtype} ragged product runs far below the "
                   "memory bound")
  split, xla = estimated_seconds(problem, device, copies_us)
  return split > xla, (
      f"{count} bfloat16 products about {split * 1e6:.0f} us, XLA's "
      f"{problem.in_dtype} product about {xla * 1e6:.0f} us (estimates)")


def bfloat16_problem(problem: RaggedProblem) -> RaggedProblem:
  """The one bfloat16 problem that `bfloat16_products` runs for `problem`."""
  count = products(problem)
  longer = ({"m": count * problem.m} if problem.mode == "contracting"
            else {"k": count * problem.k})
  return dataclasses.replace(problem, in_dtype="bfloat16", precision="default",
                             groups=active_groups(problem), **longer)


def bfloat16_products(lhs, rhs, group_sizes, row_offset,
                      problem: RaggedProblem):
  """(lhs, rhs, group_sizes, row_offset, problem) of the bfloat16 problem
  whose result is `problem`'s: exactly for fp8 operands, to about 2^-16
  of each product for float32 ones."""
  if gathers(problem):
    rhs, group_sizes, row_offset = groups_with_rows(
        rhs, group_sizes, row_offset, problem.m, problem.m)
  if products(problem) == 1:  # bfloat16 holds the values exactly
    return (lhs.astype(jnp.bfloat16), rhs.astype(jnp.bfloat16), group_sizes,
            row_offset, bfloat16_problem(problem))
  lhs_high, lhs_low, lhs_cross = _parts(lhs)
  rhs_high, rhs_low, rhs_cross = _parts(rhs)
  # Pairs, in order: high x high, high x low, low x high.
  lhs_parts = (lhs_high, lhs_cross, lhs_low)
  rhs_parts = (rhs_high, rhs_low, rhs_cross)
  if problem.mode == "contracting":
    return (*repeated_rows(lhs_parts, rhs_parts, group_sizes, row_offset),
            bfloat16_problem(problem))
  k_axis = 2 if problem.transpose_rhs else 1
  return (jnp.concatenate(lhs_parts, axis=1),
          jnp.concatenate(rhs_parts, axis=k_axis), group_sizes, row_offset,
          bfloat16_problem(problem))


def repeated_rows_fit(m: int, count: int) -> bool:
  """Whether `count` rows per token row still have int32 row numbers."""
  return count * m <= INT32_MAX


def repeated_rows(lhs_parts, rhs_parts, group_sizes, row_offset):
  """(lhs, rhs, group_sizes, row_offset) of a contracting product over
  each token row once per part pair: row r becomes rows count * r ...
  count * r + count - 1, holding lhs_parts[i][r] and rhs_parts[i][r], so
  that the kernel sums every pair of one token into its float32
  accumulator. The groups, clipped to [0, m) and scaled by the count, stay
  contiguous."""
  count, m = len(lhs_parts), lhs_parts[0].shape[0]
  first, sizes = clipped_groups(group_sizes, row_offset, m)
  interleave = lambda parts: jnp.stack(parts, axis=1).reshape(
      count * m, parts[0].shape[1])
  return (interleave(lhs_parts), interleave(rhs_parts), count * sizes,
          jnp.reshape(count * first, (1,)))
