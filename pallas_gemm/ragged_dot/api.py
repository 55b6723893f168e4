"""`ragged_dot` and `ragged_dot_general`: grouped GEMMs with the semantics of
`jax.lax.ragged_dot` / `jax.lax.ragged_dot_general`, on pallas_gemm kernels.

    out = pallas_gemm.ragged_dot(tokens, expert_weights, group_sizes)

lhs (m, k) holds the tokens sorted by expert, rhs (groups, k, n) the expert
weights, group_sizes (groups,) int32 how many consecutive rows go to each
expert; out (m, n). Rows past the sum of the sizes come out zero; a
negative size counts as zero.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_gemm.devices import device_info
from pallas_gemm.problem import (ACTIVATIONS, FP8_DTYPES, SUPPORTED_INPUT_DTYPES,
                                 SUPPORTED_OUTPUT_DTYPES, XLA_ONLY_DTYPES,
                                 as_array, dtype_name, normalize_precision)
from pallas_gemm.ragged_dot import implementations, primitive

_INPUT_DTYPES = SUPPORTED_INPUT_DTYPES + FP8_DTYPES + XLA_ONLY_DTYPES
_OUTPUT_DTYPES = SUPPORTED_OUTPUT_DTYPES + XLA_ONLY_DTYPES


def ragged_dot(lhs, rhs, group_sizes, *, precision=None,
               preferred_element_type=None, group_offset=None,
               transpose_rhs: bool = False, activation: str | None = None,
               kernel: str | None = None, config=None):
  """Per group g: out[rows of g] = activation(lhs[rows of g] @ rhs[g]).

  Args:
    lhs: (m, k) rows sorted by group.
    rhs: (groups, k, n), or (groups, n, k) read in place when `transpose_rhs`.
    group_sizes: int32 (total_groups,): rows per group, in order.
    precision: as for `jax.lax.dot` (matters for float32 inputs only).
    preferred_element_type: the output dtype (default: lhs's dtype, and
      float32 for fp8 inputs, whose products an fp8 output would not hold).
    group_offset: expert parallelism: rhs holds groups [offset, offset +
      groups) of the total_groups in group_sizes (an int or an int32 array
      of shape () or (1,)); rows of the other groups come out zero.
      Without it, total_groups must equal rhs's groups.
    activation: a name from `pallas_gemm.ACTIVATIONS`, applied to the rows
      of every group (rows in no group stay zero).
    kernel: "mosaic", "xla" or None (automatic, see `explain_ragged`).
    config: the kernel's config (a `RaggedConfig` for "mosaic").
  """
  return _ragged_rows(lhs, rhs, group_sizes, precision, preferred_element_type,
                      group_offset, transpose_rhs, activation, kernel, config,
                      primitive.bind)


def _ragged_rows(lhs, rhs, group_sizes, precision, preferred_element_type,
                 group_offset, transpose_rhs, activation, kernel, config,
                 submit):
  lhs, rhs = as_array(lhs, "lhs"), as_array(rhs, "rhs")
  in_dtype = _check_operands(lhs, rhs)
  if rhs.ndim != 3:
    raise ValueError(f"rhs.shape={rhs.shape} must be (groups, k, n)")
  if not isinstance(transpose_rhs, bool):
    raise TypeError(f"transpose_rhs must be a bool, got {transpose_rhs!r}")
  k_rhs = rhs.shape[2] if transpose_rhs else rhs.shape[1]
  if lhs.shape[1] != k_rhs:
    raise ValueError(
        f"lhs.shape={lhs.shape} and rhs.shape={rhs.shape} (transpose_rhs="
        f"{transpose_rhs}) do not agree on k: {lhs.shape[1]} vs {k_rhs}")
  local_sizes, row_offset = _local_groups(group_sizes, rhs.shape[0],
                                          group_offset)
  return submit(
      lhs, rhs, local_sizes, row_offset, kernel=_check_kernel(kernel),
      config=config, mode="rows", transpose_rhs=transpose_rhs,
      activation=_check_activation(activation),
      precision=normalize_precision(precision, in_dtype),
      out_dtype=_out_dtype(preferred_element_type, in_dtype))


def ragged_dot_general(lhs, rhs, group_sizes, ragged_dot_dimension_numbers,
                       precision=None, preferred_element_type=None,
                       group_offset=None, *, activation: str | None = None,
                       kernel: str | None = None, config=None):
  """`jax.lax.ragged_dot_general` for the two forms a mixture-of-experts
  layer and its gradient need:

    ragged rows (lhs dim 0 ragged, rhs dim 0 the group):
      lhs (m, k), rhs (g, k, n) contracting ((1,), (1,)), or rhs (g, n, k)
      contracting ((1,), (2,)) -> (m, n)
    ragged contraction (lhs dim 0 ragged and contracted, no rhs group dim):
      lhs (m, k), rhs (m, n) contracting ((0,), (0,)) -> (g, k, n)

  No batch dimensions. Other forms raise NotImplementedError: use
  `jax.lax.ragged_dot_general` for them.
  """
  return _general(lhs, rhs, group_sizes, ragged_dot_dimension_numbers,
                  precision, preferred_element_type, group_offset, activation,
                  kernel, config, primitive.bind)


def explain(lhs, rhs, group_sizes, ragged_dot_dimension_numbers=None, *,
            precision=None, preferred_element_type=None, group_offset=None,
            transpose_rhs: bool = False, activation: str | None = None,
            kernel: str | None = None, config=None
            ) -> implementations.Resolution:
  """What `ragged_dot` (or, given dimension numbers, `ragged_dot_general`)
  would run for these arguments, and why: the same checks and the same
  `resolve` call, without running anything. Operands may be
  `jax.ShapeDtypeStruct`s."""
  found = []

  def resolution_of(lhs, rhs, group_sizes, row_offset, *, kernel, config,
                    **params):
    del row_offset
    problem = primitive.problem_for(lhs, rhs, group_sizes, **params)
    found.append(implementations.resolve(problem, device_info(), kernel,
                                         config))
    return jnp.zeros(())

  def trace(lhs, rhs, group_sizes):
    if ragged_dot_dimension_numbers is None:
      return _ragged_rows(lhs, rhs, group_sizes, precision,
                          preferred_element_type, group_offset, transpose_rhs,
                          activation, kernel, config, resolution_of)
    return _general(lhs, rhs, group_sizes, ragged_dot_dimension_numbers,
                    precision, preferred_element_type, group_offset,
                    activation, kernel, config, resolution_of)

  # Shapes only: the operands may be ShapeDtypeStructs.
  jax.eval_shape(trace, lhs, rhs, group_sizes)
  return found[0]


def _general(lhs, rhs, group_sizes, ragged_dot_dimension_numbers, precision,
             preferred_element_type, group_offset, activation, kernel, config,
             submit):
  numbers = ragged_dot_dimension_numbers
  if not isinstance(numbers, jax.lax.RaggedDotDimensionNumbers):
    raise TypeError("ragged_dot_dimension_numbers must be a jax.lax."
                    f"RaggedDotDimensionNumbers, got {type(numbers).__name__}")
  lhs, rhs = as_array(lhs, "lhs"), as_array(rhs, "rhs")
  (contract_lhs, contract_rhs), (batch_lhs, batch_rhs) = (
      numbers.dot_dimension_numbers)
  ragged, group = (tuple(numbers.lhs_ragged_dimensions),
                   tuple(numbers.rhs_group_dimensions))
  no_batch = tuple(batch_lhs) == tuple(batch_rhs) == ()
  if (no_batch and lhs.ndim == 2 and rhs.ndim == 3 and ragged == (0,)
      and group == (0,) and tuple(contract_lhs) == (1,)
      and tuple(contract_rhs) in ((1,), (2,))):
    return _ragged_rows(lhs, rhs, group_sizes, precision,
                        preferred_element_type, group_offset,
                        tuple(contract_rhs) == (2,), activation, kernel,
                        config, submit)
  if (no_batch and lhs.ndim == 2 and rhs.ndim == 2 and ragged == (0,)
      and group == () and tuple(contract_lhs) == (0,)
      and tuple(contract_rhs) == (0,)):
    return _ragged_contracting(lhs, rhs, group_sizes, precision,
                               preferred_element_type, group_offset,
                               activation, kernel, config, submit)
  raise NotImplementedError(
      f"ragged_dot_dimension_numbers={numbers} with lhs.shape={lhs.shape}, "
      f"rhs.shape={rhs.shape} is not a form pallas_gemm runs (ragged rows "
      "of a 2-D lhs against (g, k, n) or (g, n, k), or a ragged contraction "
      "of two 2-D operands over dim 0); use jax.lax.ragged_dot_general")


def _ragged_contracting(lhs, rhs, group_sizes, precision,
                        preferred_element_type, group_offset, activation,
                        kernel, config, submit):
  in_dtype = _check_operands(lhs, rhs)
  if lhs.shape[0] != rhs.shape[0]:
    raise ValueError(f"lhs.shape={lhs.shape} and rhs.shape={rhs.shape} must "
                     "have the same number of (ragged) rows")
  if activation is not None:
    raise ValueError(f"activation={activation!r}: the ragged contraction "
                     "takes no activation")
  if group_offset is not None:
    raise NotImplementedError(
        "group_offset is not supported for the ragged contraction: it has no "
        "rhs group dimension to say how many groups are local")
  sizes = _check_group_sizes(group_sizes)
  return submit(
      lhs, rhs, sizes, jnp.zeros((1,), jnp.int32),
      kernel=_check_kernel(kernel), config=config, mode="contracting",
      transpose_rhs=False, activation=None,
      precision=normalize_precision(precision, in_dtype),
      out_dtype=_out_dtype(preferred_element_type, in_dtype))


# ------------------------------------------------------------------ checks ---


def _check_operands(lhs, rhs) -> str:
  if lhs.ndim != 2:
    raise ValueError(f"lhs.shape={lhs.shape} must be (m, k)")
  lhs_dtype, rhs_dtype = dtype_name(lhs.dtype), dtype_name(rhs.dtype)
  if lhs_dtype not in _INPUT_DTYPES:
    raise TypeError(f"lhs.dtype={lhs_dtype} is not one of {_INPUT_DTYPES}")
  if rhs_dtype != lhs_dtype:
    raise TypeError(f"rhs.dtype={rhs_dtype} must equal lhs.dtype={lhs_dtype}")
  return lhs_dtype


def _check_group_sizes(group_sizes):
  group_sizes = as_array(group_sizes, "group_sizes")
  if dtype_name(group_sizes.dtype) != "int32":
    raise TypeError(f"group_sizes.dtype={group_sizes.dtype} must be int32")
  if group_sizes.ndim != 1:
    raise ValueError(f"group_sizes.shape={group_sizes.shape} must be (groups,)")
  return group_sizes


def _local_groups(group_sizes, local_groups: int, group_offset):
  """(sizes of rhs's groups, row offset of the first) as int32 arrays."""
  sizes = _check_group_sizes(group_sizes)
  total = sizes.shape[0]
  if group_offset is None:
    if total != local_groups:
      raise ValueError(
          f"group_sizes.shape={sizes.shape} must be ({local_groups},), the "
          "rhs's groups (pass group_offset when rhs holds only some groups)")
    return sizes, jnp.zeros((1,), jnp.int32)
  if total < local_groups:
    raise ValueError(f"group_sizes.shape={sizes.shape} has fewer groups than "
                     f"rhs ({local_groups})")
  offset = as_array(group_offset, "group_offset")
  if not jnp.issubdtype(offset.dtype, jnp.integer) or offset.size != 1 or (
      offset.ndim > 1):
    raise TypeError(f"group_offset must be one integer (an int or an int array "
                    f"of shape () or (1,)), got {group_offset!r}")
  if not isinstance(offset, jax.core.Tracer):
    value = int(np.asarray(offset).reshape(()))
    if not 0 <= value <= total - local_groups:
      raise ValueError(f"group_offset={value} must be in [0, "
                       f"{total - local_groups}]: rhs holds {local_groups} of "
                       f"{total} groups")
  offset = offset.reshape(()).astype(jnp.int32)
  local = jax.lax.dynamic_slice(sizes, (offset,), (local_groups,))
  before = jnp.sum(jnp.where(jnp.arange(total) < offset, sizes, 0))
  return local, before.astype(jnp.int32).reshape(1)


def _check_kernel(kernel):
  if kernel is None:
    return None
  if not isinstance(kernel, str):
    raise TypeError(f"kernel must be a str or None, got {type(kernel).__name__}")
  implementations.get(kernel)  # raises, naming the kernel, when unknown
  return kernel


def _check_activation(activation):
  if activation is not None and activation not in ACTIVATIONS:
    raise ValueError(f"activation={activation!r} is not one of "
                     f"{sorted(ACTIVATIONS)} or None")
  return activation


def _out_dtype(preferred_element_type, in_dtype: str) -> str:
  if preferred_element_type is None:
    return "float32" if in_dtype in FP8_DTYPES else in_dtype
  try:
    name = dtype_name(preferred_element_type)
  except TypeError as e:
    raise TypeError(f"preferred_element_type={preferred_element_type!r} is "
                    "not a dtype") from e
  if name not in _OUTPUT_DTYPES:
    raise TypeError(f"preferred_element_type={name} is not one of "
                    f"{_OUTPUT_DTYPES}")
  return name
