"""`ragged_dot_p`: the JAX primitive behind `pallas_gemm.ragged_dot`.

One equation is one grouped GEMM of a `RaggedProblem`. Operands:
`lhs`, `rhs`, `group_sizes` (int32, (groups,)) and `row_offset` (int32,
(1,)): the rows of the groups start at `row_offset` (see problem.py).

Params (static, hashable): `mode` ("rows" or "contracting"),
`transpose_rhs`, `activation`, `precision`, `out_dtype`, and the resolved
`kernel` (an implementation name) and `config`.

Rules:
  * abstract eval: shape and dtype (and the varying mesh axes in a shard_map);
  * lowering: CUDA runs the resolved implementation; CPU runs the same Pallas
    kernel in interpret mode; other platforms use the xla implementation;
  * batching: no loop; the batch is folded into the groups by permuting the
    rows of every batch entry into one ragged problem;
  * JVP and transpose: the products are bilinear in (lhs, rhs); their
    cotangents are ragged products again:
      rows:        dlhs = rows(ct, rhs, transpose_rhs flipped)
                   drhs = contracting(lhs, ct), or contracting(ct, lhs) when
                          rhs is stored transposed
      contracting: dlhs = rows(rhs, ct, transpose_rhs=True)
                   drhs = rows(lhs, ct)
    A fused activation is not linear: its JVP recomputes the pre-activation
    product and applies the activation's own JVP. A float32 cotangent of
    bfloat16 operands (preferred_element_type=float32) is split into two
    bfloat16 parts (`splits_wide_cotangent`): a contracting product takes
    both as rows of one product, a rows product takes each in its own.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax._src import config as jax_config  # the shard_map varying-axes check
from jax._src import core as jax_core
from jax._src import dispatch as jax_dispatch
from jax._src import mesh as mesh_lib
from jax.extend import core as jex_core
from jax.interpreters import ad, batching, mlir
from jax.sharding import NamedSharding, PartitionSpec

from pallas_gemm import sharding
from pallas_gemm.devices import device_info
from pallas_gemm.problem import ACTIVATIONS, dtype_name
from pallas_gemm.ragged_dot import implementations
from pallas_gemm.ragged_dot.bfloat16_split import (bfloat16_parts,
                                                   repeated_rows,
                                                   repeated_rows_fit)
from pallas_gemm.ragged_dot.problem import RaggedProblem
from pallas_gemm.ragged_dot.xla import clipped_groups, group_row_mask

ragged_dot_p = jex_core.Primitive("pallas_ragged_dot")

_PROBLEM_PARAMS = ("mode", "transpose_rhs", "activation", "precision",
                   "out_dtype")


def problem_for(lhs, rhs, group_sizes, *, mode, transpose_rhs, activation,
                precision, out_dtype, **unused) -> RaggedProblem:
  """The problem of one equation, from its operands or their avals."""
  del unused
  m, k = lhs.shape
  if mode == "contracting":
    n, groups = rhs.shape[1], group_sizes.shape[0]
  else:
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    groups = rhs.shape[0]
  return RaggedProblem(mode=mode, m=m, k=k, n=n, groups=groups,
                       in_dtype=dtype_name(lhs.dtype), out_dtype=out_dtype,
                       transpose_rhs=transpose_rhs, activation=activation,
                       precision=precision)


def bind(lhs, rhs, group_sizes, row_offset, *, kernel=None, config=None,
         **problem_params):
  """Resolves the implementation for these operands, once, and binds."""
  problem = problem_for(lhs, rhs, group_sizes, **problem_params)
  resolution = implementations.resolve(problem, device_info(), kernel, config)
  return _bind(resolution, (lhs, rhs, group_sizes, row_offset), problem_params)


def rebind(lhs, rhs, group_sizes, row_offset, *, kernel, **problem_params):
  """Binds a derived product (a tangent, a cotangent, a batched copy): the
  same implementation when it supports the new problem (with its heuristic's
  config: the caller's was chosen for another shape), else (or with kernel
  None) the automatic choice."""
  problem = problem_for(lhs, rhs, group_sizes, **problem_params)
  device = device_info()
  if kernel is not None and implementations.get(kernel).supports(
      problem, device) is not None:
    kernel = None
  resolution = implementations.resolve(problem, device, kernel, None)
  return _bind(resolution, (lhs, rhs, group_sizes, row_offset), problem_params)


def _bind(resolution, operands, problem_params):
  params = {name: problem_params[name] for name in _PROBLEM_PARAMS}
  return ragged_dot_p.bind(*sharding.match_varying_axes(list(operands)),
                           kernel=resolution.implementation,
                           config=resolution.config, **params)


# ---------------------------------------------------------- abstract eval ---


@ragged_dot_p.def_abstract_eval
def _abstract_eval(lhs, rhs, group_sizes, row_offset, **params):
  if lhs.ndim != 2 or rhs.ndim != (2 if params["mode"] == "contracting" else 3):
    raise ValueError(f"ragged_dot_p got lhs.shape={lhs.shape}, rhs.shape="
                     f"{rhs.shape} for mode {params['mode']!r}")
  if group_sizes.ndim != 1 or tuple(row_offset.shape) != (1,):
    raise ValueError(f"ragged_dot_p got group_sizes.shape={group_sizes.shape},"
                     f" row_offset.shape={row_offset.shape}")
  problem = problem_for(lhs, rhs, group_sizes, **params)
  return _output_type((lhs, rhs, group_sizes, row_offset), problem.out_shape,
                      problem.out_dtype)


def _output_type(operands, shape, dtype):
  """Inside a shard_map the output varies over every manual axis an operand
  varies over, as for lax's dot."""
  varying = frozenset()
  if jax_config._check_vma.value:  # noqa: SLF001
    varying = frozenset().union(*(x.mat.varying for x in operands))
  if not varying:
    return jax_core.ShapedArray(shape, jnp.dtype(dtype))
  mesh = operands[0].sharding.mesh
  if mesh.empty:
    mesh = mesh_lib.get_abstract_mesh()
  return jax_core.ShapedArray(
      shape, jnp.dtype(dtype), sharding=NamedSharding(mesh, PartitionSpec()),
      manual_axis_type=jax_core.ManualAxisType(varying=varying))


# ---------------------------------------------------------------- lowering ---


def _run(lhs, rhs, group_sizes, row_offset, *, platform, kernel, config,
         **params):
  problem = problem_for(lhs, rhs, group_sizes, **params)
  if platform not in ("cuda", "cpu"):
    kernel, config = "xla", None
  implementation = implementations.get(kernel)
  return implementation.ragged_matmul(
      lhs, rhs, group_sizes, row_offset, problem=problem, config=config,
      interpret=platform == "cpu")


def _lowering_for(platform):
  def rule(ctx, *args, **params):
    return mlir.lower_fun(functools.partial(_run, platform=platform, **params),
                          multiple_results=False)(ctx, *args)
  return rule


mlir.register_lowering(ragged_dot_p, _lowering_for("cuda"), platform="cuda")
mlir.register_lowering(ragged_dot_p, _lowering_for("cpu"), platform="cpu")
mlir.register_lowering(ragged_dot_p, _lowering_for("other"))
ragged_dot_p.def_impl(functools.partial(jax_dispatch.apply_primitive,
                                        ragged_dot_p))


# ---------------------------------------------------------------- batching ---


def _packing(sizes, offsets, m: int, group_major: bool):
  """How to lay the rows of a batch of ragged problems out as one.

  sizes (batch, groups), offsets (batch,). Returns (dest, in_group,
  packed_sizes): row r of entry b moves to row dest[b*m + r]; the rows of
  every (entry, group) block come first, ordered entry-major (one group per
  block) or group-major (the entries' rows of a group merged into one group,
  for a shared rhs); rows in no group follow them."""
  batch, groups = sizes.shape
  first, clipped = jax.vmap(lambda s, o: clipped_groups(s, o, m))(sizes, offsets)
  starts = first[:, None] + jnp.cumsum(clipped, axis=1) - clipped
  ends = starts + clipped
  rows = jnp.arange(m, dtype=jnp.int32)
  group = jax.vmap(lambda e: jnp.searchsorted(e, rows, side="right"))(ends)
  group = jnp.minimum(group, groups - 1).astype(jnp.int32)
  in_group = (rows[None] >= first[:, None]) & (rows[None] < ends[:, -1:])
  entry = jnp.arange(batch, dtype=jnp.int32)[:, None]
  if group_major:
    block_sizes, block = clipped.T.reshape(-1), group * batch + entry
    packed_sizes = jnp.sum(clipped, axis=0)
  else:
    block_sizes, block = clipped.reshape(-1), entry * groups + group
    packed_sizes = clipped.reshape(-1)
  block_starts = jnp.cumsum(block_sizes) - block_sizes
  start_of_row = jnp.take_along_axis(starts, group, axis=1)
  dest = block_starts[block] + rows[None] - start_of_row
  in_group = in_group.reshape(-1)
  outside_rank = jnp.cumsum(~in_group) - 1
  dest = jnp.where(in_group, dest.reshape(-1),
                   jnp.sum(clipped) + outside_rank).astype(jnp.int32)
  return dest, in_group, packed_sizes.astype(jnp.int32)


def _batching_rule(operands, batch_dims, **params):
  size = next(x.shape[d] for x, d in zip(operands, batch_dims) if d is not None)
  lhs, rhs, sizes, offsets = [
      jnp.broadcast_to(x, (size,) + x.shape) if d is None
      else jnp.moveaxis(x, d, 0)
      for x, d in zip(operands, batch_dims)]
  rhs_shared = batch_dims[1] is None and params["mode"] == "rows"
  if rhs_shared:
    rhs = operands[1]
  offsets = offsets.reshape(size)
  m = lhs.shape[1]
  derived = _derived(params)
  if size == 0 or m == 0:
    unbatched = [jax_core.ShapedArray(x.shape[1:], x.dtype)
                 for x in (lhs, rhs, sizes, offsets[:, None])]
    if rhs_shared:
      unbatched[1] = jax_core.ShapedArray(rhs.shape, rhs.dtype)
    aval = _abstract_eval(*unbatched, **params)
    return jnp.zeros((size,) + aval.shape, aval.dtype), 0
  dest, in_group, packed_sizes = _packing(sizes, offsets, m, rhs_shared)
  no_offset = jnp.zeros((1,), jnp.int32)

  def pack(x):
    flat = x.reshape((size * m,) + x.shape[2:])
    return jnp.zeros_like(flat).at[dest].set(flat, unique_indices=True)

  if params["mode"] == "contracting":
    out = rebind(pack(lhs), pack(rhs), packed_sizes, no_offset, **derived)
    return out.reshape((size, sizes.shape[1]) + out.shape[1:]), 0
  if not rhs_shared:
    rhs = rhs.reshape((size * rhs.shape[1],) + rhs.shape[2:])
  out = rebind(pack(lhs), rhs, packed_sizes, no_offset, **derived)
  out = jnp.where(in_group[:, None], out[dest], 0).astype(out.dtype)
  return out.reshape(size, m, out.shape[-1]), 0


batching.primitive_batchers[ragged_dot_p] = _batching_rule


# --------------------------------------------------------------- autodiff ---


def _is_zero(t):
  return t is None or type(t) is ad.Zero


def _derived(params, **changes):
  out = {k: v for k, v in params.items() if k != "config"}
  out.update(changes)
  return out


def _jvp_rule(primals, tangents, **params):
  lhs, rhs, group_sizes, row_offset = primals
  d_lhs, d_rhs = tangents[:2]
  activation = params["activation"]
  out_dtype = params["out_dtype"]
  wide = "float64" if "float64" in (out_dtype, dtype_name(lhs.dtype)) else "float32"
  linear = _derived(params, activation=None,
                    out_dtype=wide if activation else out_dtype)
  if activation is None:
    out = ragged_dot_p.bind(*primals, **params)
  else:
    z = rebind(*primals, **linear)
    mask = group_row_mask(group_sizes, row_offset, lhs.shape[0])[:, None]
    out = jnp.where(mask, ACTIVATIONS[activation](z), 0).astype(out_dtype)
  terms = []
  if not _is_zero(d_lhs):
    terms.append(rebind(d_lhs, rhs, group_sizes, row_offset, **linear))
  if not _is_zero(d_rhs):
    terms.append(rebind(lhs, d_rhs, group_sizes, row_offset, **linear))
  if not terms:
    return out, ad.Zero.from_primal_value(out)
  t = functools.reduce(jnp.add, terms)
  if activation is not None:
    t = jax.jvp(ACTIVATIONS[activation], (z,), (t,))[1]
    t = jnp.where(mask, t, 0)
  return out, t.astype(out_dtype)


ad.primitive_jvps[ragged_dot_p] = _jvp_rule


def _transpose_rule(ct, lhs, rhs, group_sizes, row_offset, **params):
  if params["activation"] is not None:
    raise NotImplementedError("ragged_dot_p with an activation is not "
                              "linear; its JVP never transposes it")
  if ad.is_undefined_primal(lhs) and ad.is_undefined_primal(rhs):
    raise ValueError("ragged_dot_p is bilinear, not linear, in (lhs, rhs)")
  if type(ct) is ad.Zero:
    return [None] * 4
  wanted_lhs = ad.is_undefined_primal(lhs)
  other = rhs if wanted_lhs else lhs
  target_dtype = dtype_name((lhs if wanted_lhs else rhs).aval.dtype)
  tr = params["transpose_rhs"]
  # The rows form's weight gradient is a "contracting" product of ct and
  # the other operand, each with a row per token; every other cotangent
  # is a "rows" product.
  contracting = params["mode"] == "rows" and not wanted_lhs

  def product(ct, other, sizes, precision, out_dtype, kernel=params["kernel"]):
    """The cotangent's product with the other operand."""
    common = dict(kernel=kernel, activation=None,
                  precision=precision, out_dtype=out_dtype)
    if contracting:
      first, second = (ct, other) if tr else (other, ct)
      return rebind(first, second, *sizes, mode="contracting",
                    transpose_rhs=False, **common)
    if params["mode"] == "rows":
      return rebind(ct, other, *sizes, mode="rows", transpose_rhs=not tr,
                    **common)
    return rebind(other, ct, *sizes, mode="rows", transpose_rhs=wanted_lhs,
                  **common)

  sizes = (group_sizes, row_offset)
  precision = params["precision"]
  if splits_wide_cotangent(ct.dtype, other.dtype, precision):
    # A float32 cotangent of bfloat16 operands (a forward with
    # preferred_element_type=float32) as the sum of two bfloat16 parts,
    # each multiplied on the operands' own dtype: together they hold 16 of
    # the cotangent's 24 significand bits, more than the TF32 products that
    # precision="default" allows, and the grouped GEMM kernels run them,
    # where an upcast operand would leave only XLA's float32 product.
    high, low = bfloat16_parts(ct)
    m = ct.shape[0]
    if contracting and repeated_rows_fit(m, 2):
      # One product over twice the rows: each token row twice, with the
      # high then the low part, so that the kernel adds both parts in its
      # float32 accumulator and rounds once.
      parts, others, *doubled = repeated_rows((high, low), (other, other),
                                              group_sizes, row_offset)
      grad = product(parts, others, doubled, precision, target_dtype)
    else:
      # The low part's product is about 2^-8 of the high part's, so
      # rounding it to the operands' dtype costs nothing measurable; the
      # high part's stays float32 until the sum is rounded once.
      grad = (product(high, other, sizes, precision, "float32")
              + product(low, other, sizes, precision,
                        dtype_name(other.dtype)).astype(jnp.float32)
              ).astype(target_dtype)
  elif jnp.dtype(ct.dtype).itemsize > jnp.dtype(other.dtype).itemsize:
    # A cotangent wider than the operands keeps its precision, as lax's
    # does: the other operand is upcast instead. Where the forward ran on
    # the Mosaic kernels, the automatic choice decides where these float32
    # products run: split on the kernels, or on XLA where the cost model
    # has XLA faster (a few rows).
    grad = product(ct, other.astype(ct.dtype), sizes,
                   "ieee" if precision == "ieee" else "tf32", target_dtype,
                   kernel=None if params["kernel"] == "mosaic"
                   else params["kernel"])
  else:
    grad = product(ct.astype(other.dtype), other, sizes, precision,
                   target_dtype)
  return [grad, None, None, None] if wanted_lhs else [None, grad, None, None]


def splits_wide_cotangent(ct_dtype, operand_dtype, precision: str) -> bool:
  """Whether a cotangent of `ct_dtype` against an operand of
  `operand_dtype` runs as products of its two parts in the operand's
  dtype (`_transpose_rule`): a float32 cotangent of bfloat16 operands at
  the operands' own precision. float16 is left out: its range is narrower
  than float32's, so the high part could overflow."""
  return (dtype_name(ct_dtype) == "float32"
          and dtype_name(operand_dtype) == "bfloat16"
          and precision == "default")


ad.primitive_transposes[ragged_dot_p] = _transpose_rule
