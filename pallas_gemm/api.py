"""The public entry points: `matmul` and `dot_general`."""

from __future__ import annotations

import collections
import logging
import math

import jax
import jax.numpy as jnp
import numpy as np

from pallas_gemm import dimension_numbers as dimension_numbers_lib
from pallas_gemm import dispatch, primitive
from pallas_gemm.devices import device_info
from pallas_gemm.problem import (ACTIVATIONS, FP8_DTYPES, SCALE_BLOCK,
                                 SUPPORTED_INPUT_DTYPES,
                                 SUPPORTED_OUTPUT_DTYPES, XLA_ONLY_DTYPES,
                                 Epilogue, as_array,
                                 apply_epilogue, dtype_name,
                                 normalize_precision, preset_input_dtype)


#: Why recent `dot_general` calls stayed on `jax.lax.dot_general` (read and
#: cleared by `pallas_gemm.explain`; bounded, since every trace adds one).
LAX_REASONS: collections.deque[str] = collections.deque(maxlen=256)
_LOGGED_REASONS: set[str] = set()
_LOGGER = logging.getLogger(__name__)


def _check_input_dtype(x, name):
  name_of = dtype_name(x.dtype)
  if name_of not in SUPPORTED_INPUT_DTYPES + FP8_DTYPES + XLA_ONLY_DTYPES:
    raise TypeError(
        f"{name} has dtype {name_of}; pallas_gemm.matmul supports "
        f"{', '.join(SUPPORTED_INPUT_DTYPES + FP8_DTYPES + XLA_ONLY_DTYPES)}")


def matmul(a, b, *, kernel: str | None = None, config=None, precision=None,
           preferred_element_type=None, transpose_a: bool = False,
           transpose_b: bool = False, alpha: float = 1.0,
           beta: float | None = None, c=None, bias=None,
           activation: str | None = None, a_scale=None, b_scale=None):
  """`jnp.matmul` on pallas_gemm kernels, with a fused BLAS-style epilogue.

  Computes `activation(alpha * (op(a) @ op(b)) + beta * c + bias)`, where
  op(x) is x, or x with its last two axes swapped when `transpose_a` /
  `transpose_b` is set (the kernel then reads the operand as stored; nothing
  is transposed in memory). Shapes follow `jnp.matmul`: 1-D operands are
  vectors, leading batch dimensions broadcast.

  Args:
    a, b: float32, bfloat16 or float16 arrays (fp8 where a kernel takes it).
      Mixed dtypes are promoted as `jnp.matmul` promotes them.
    kernel: a name from `list_kernels()`, or None for the automatic choice.
    config: the kernel's frozen config dataclass; None uses its heuristic or
      the autotuning cache.
    precision: for float32 inputs, `jax.lax.Precision.HIGHEST` asks for exact
      fp32 products; anything else allows TF32, as `jnp.dot` does on a GPU.
      Takes what `jnp.dot` takes: a `jax.lax.Precision`, its strings, or a
      `jax.lax.DotAlgorithmPreset` (or its name). F16_F16_F32 and
      BF16_BF16_F32 multiply in float16/bfloat16 (the operands are cast);
      the float32-accurate presets run exactly; presets that accumulate in
      16 bits, or need float8 or float64 operands they are not given, raise.
    preferred_element_type: the output dtype (default: the input dtype).
      Accumulation is always float32.
    alpha, beta: Python floats, compiled into the kernel. beta defaults to
      1 where `c` is given and 0 where it is not; beta=0 with a `c` leaves
      c unread (BLAS's convention).
    c: an array broadcastable to the output, scaled by `beta`; a beta other
      than 0 needs it.
    bias: a vector of length N added to every row.
    activation: None or one of "relu", "gelu" (tanh form), "silu",
      "sigmoid", "tanh".
    a_scale, b_scale: fp8 inputs only (float8_e4m3fn, float8_e5m2, or one of
      each): float32 dequantization factors (x ≈ q · s), applied before the
      epilogue. Each is a scalar (per tensor), a vector (A: one per row of
      op(a), (m,); B: one per column of op(b), (n,)) or block-wise (A:
      (m, ceil(k/128)), 1x128 blocks; B: (ceil(k/128), ceil(n/128)), 128x128
      blocks, or (ceil(n/128), ceil(k/128)) when `transpose_b`, i.e. in B's
      stored layout). They are shared by every batch entry; vmap for
      per-example scales. See `pallas_gemm.fp8`. No gradient.
  """
  a = as_array(a, "a")
  b = as_array(b, "b")
  if a.ndim == 0 or b.ndim == 0:
    raise ValueError(
        f"matmul needs operands of rank >= 1, got a.shape={a.shape}, "
        f"b.shape={b.shape}")
  _check_input_dtype(a, "a")
  _check_input_dtype(b, "b")
  for flag_name, flag in (("transpose_a", transpose_a),
                          ("transpose_b", transpose_b)):
    if not isinstance(flag, (bool, np.bool_)):
      raise TypeError(f"{flag_name} must be a bool, got {type(flag).__name__}")
  if activation is not None and not isinstance(activation, str):
    raise TypeError(f"activation must be None or a str, got "
                    f"{type(activation).__name__}")
  if activation is not None and activation not in ACTIVATIONS:
    raise ValueError(
        f"activation={activation!r} is not one of {sorted(ACTIVATIONS)} or None")

  # jnp's promotion, weak types included: a weakly typed float32 operand
  # (from a Python scalar) does not widen a bfloat16 one. The e4m3 x e5m2
  # pair has no promotion: wgmma multiplies it as it is.
  mixed_fp8 = (a.dtype != b.dtype and dtype_name(a.dtype) in FP8_DTYPES
               and dtype_name(b.dtype) in FP8_DTYPES)
  in_dtype = a.dtype if mixed_fp8 else _promote(a, b)
  if dtype_name(in_dtype) not in (SUPPORTED_INPUT_DTYPES + FP8_DTYPES
                                  + XLA_ONLY_DTYPES):
    raise TypeError(
        f"a ({a.dtype}) and b ({b.dtype}) promote to {in_dtype}, which "
        f"pallas_gemm.matmul does not support")
  if not mixed_fp8:
    a, b = a.astype(in_dtype), b.astype(in_dtype)
  if preferred_element_type is None:
    out_dtype = in_dtype if dtype_name(in_dtype) in (
        SUPPORTED_OUTPUT_DTYPES + XLA_ONLY_DTYPES) \
        else jnp.dtype(jnp.float32)
  else:
    try:
      out_dtype = jnp.dtype(preferred_element_type)
    except TypeError:
      raise TypeError(
          f"preferred_element_type={preferred_element_type!r} is not a "
          "dtype") from None
    if dtype_name(out_dtype) not in SUPPORTED_OUTPUT_DTYPES + XLA_ONLY_DTYPES:
      raise TypeError(
          f"preferred_element_type={out_dtype} is not one of "
          f"{SUPPORTED_OUTPUT_DTYPES}")
  # A DotAlgorithmPreset may read the operands in another dtype (after the
  # output dtype is fixed, as in lax): F16_F16_F32 on float32 inputs runs a
  # float16 GEMM with a float32 output.
  read_as = _preset_dtype(precision, in_dtype)
  if read_as != in_dtype:
    a, b, in_dtype = a.astype(read_as), b.astype(read_as), read_as
  precision_name = normalize_precision(precision, dtype_name(in_dtype))

  # 1-D operands are vectors, as in jnp.matmul: lift, multiply, drop.
  squeeze_m = a.ndim == 1
  squeeze_n = b.ndim == 1
  if squeeze_m:
    a, transpose_a = a[None, :], False
  if squeeze_n:
    b, transpose_b = b[:, None], False

  m, k = (a.shape[-1], a.shape[-2]) if transpose_a else a.shape[-2:]
  k_b, n = (b.shape[-1], b.shape[-2]) if transpose_b else b.shape[-2:]
  if k != k_b:
    raise ValueError(
        f"contraction sizes differ: a.shape={a.shape} "
        f"(transpose_a={transpose_a}) gives k={k}, b.shape={b.shape} "
        f"(transpose_b={transpose_b}) gives k={k_b}")
  try:
    batch_shape = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
  except ValueError:
    raise ValueError(
        f"batch dimensions of a.shape={a.shape} and b.shape={b.shape} do not "
        "broadcast") from None
  out_shape = tuple(batch_shape) + (m, n)

  if c is not None:
    c = as_array(c, "c")
    if not jnp.issubdtype(c.dtype, jnp.floating):
      raise TypeError(f"c has dtype {c.dtype}; it must be a float array")
    c_target = out_shape
    if squeeze_m or squeeze_n:  # c is given in the squeezed output's shape
      c_target = _squeezed(out_shape, squeeze_m, squeeze_n)
    try:
      c = jnp.broadcast_to(c, c_target)
    except ValueError:
      raise ValueError(
          f"c.shape={c.shape} does not broadcast to the output shape "
          f"{c_target}") from None
    c = c.reshape(out_shape)
  if bias is not None:
    bias = as_array(bias, "bias")
    if not jnp.issubdtype(bias.dtype, jnp.floating):
      raise TypeError(f"bias has dtype {bias.dtype}; it must be a float array")
    if bias.shape != (n,):
      raise ValueError(f"bias.shape={bias.shape} must be ({n},), the output's N")
  if beta is None:
    beta = 0.0 if c is None else 1.0
  for scalar_name, scalar in (("alpha", alpha), ("beta", beta)):
    if isinstance(scalar, (bool, np.bool_)):
      raise TypeError(f"{scalar_name} must be a float, got bool {scalar!r}")
    if np.iscomplexobj(scalar):
      raise TypeError(f"{scalar_name} must be a real float, got the complex "
                      f"{scalar!r}")
    if isinstance(scalar, jax.core.Tracer) or (
        not isinstance(scalar, (int, float, np.number))
        and not (hasattr(scalar, "shape") and scalar.shape == ())):
      raise TypeError(
          f"{scalar_name} must be a Python float: it is compiled into the "
          f"kernel, so it cannot be a traced or array value (got "
          f"{type(scalar).__name__})")
  if c is None and float(beta) != 0.0:
    # BLAS's beta scales C; with no C it would be silently dropped.
    raise ValueError(f"beta={beta!r} scales c, but c is None: pass c=, or "
                     f"leave beta at 0")
  a_scale, a_scale_mode = _scale_operand(
      a_scale, "a_scale", operand="a", size=m, k=k, in_dtype=in_dtype,
      transposed=False, vector=squeeze_m)
  b_scale, b_scale_mode = _scale_operand(
      b_scale, "b_scale", operand="b", size=n, k=k, in_dtype=in_dtype,
      transposed=transpose_b, vector=squeeze_n)
  scales = dict(a_scale=a_scale, b_scale=b_scale, a_scale_mode=a_scale_mode,
                b_scale_mode=b_scale_mode)
  epilogue = Epilogue(alpha=float(alpha), beta=float(beta),
                      has_c=c is not None and float(beta) != 0.0,
                      has_bias=bias is not None, activation=activation)
  if not epilogue.has_c:
    c = None

  if 0 in out_shape or k == 0:
    out = _degenerate(out_shape, epilogue, c, bias, out_dtype)
  else:
    out = _matmul_nd(a, b, c, bias, batch_shape=tuple(batch_shape), m=m, n=n,
                     kernel=kernel, config=config, transpose_a=transpose_a,
                     transpose_b=transpose_b, precision=precision_name,
                     epilogue=epilogue, out_dtype=out_dtype, **scales)
  if squeeze_m or squeeze_n:
    out = out.reshape(_squeezed(out_shape, squeeze_m, squeeze_n))
  return out


def _preset_dtype(precision, in_dtype):
  """The dtype `precision` (a DotAlgorithmPreset, its name, or None under a
  preset jax_default_matmul_precision) multiplies `in_dtype` operands in."""
  if precision is None:
    precision = jax.config.jax_default_matmul_precision
  read_as = preset_input_dtype(precision, dtype_name(in_dtype))
  return jnp.dtype(in_dtype) if read_as is None else jnp.dtype(read_as)


def _squeezed(out_shape, squeeze_m, squeeze_n):
  batch, (m, n) = out_shape[:-2], out_shape[-2:]
  return batch + ((m,) if not squeeze_m else ()) + ((n,) if not squeeze_n else ())


def _degenerate(out_shape, epilogue, c, bias, out_dtype):
  """Empty outputs, or k == 0 (the product is all zeros, as in jnp.matmul)."""
  acc = jnp.zeros(out_shape, jnp.float32)
  if 0 in out_shape:
    return acc.astype(out_dtype)
  return apply_epilogue(acc, epilogue, c, bias).astype(out_dtype)


def _matmul_nd(a, b, c, bias, *, batch_shape, m, n, **params):
  if not batch_shape:
    return primitive.bind(a, b, c, bias, **params)
  batch = math.prod(batch_shape)
  a_scale, b_scale = params.pop("a_scale"), params.pop("b_scale")
  if b.ndim == 2 and not params["transpose_a"]:
    # B is shared by every batch entry: stack the rows of A into one tall
    # problem (a free reshape) instead of broadcasting B.
    a2 = jnp.broadcast_to(a, batch_shape + a.shape[-2:]).reshape(batch * m, -1)
    c2 = None if c is None else c.reshape(batch * m, n)
    if params["a_scale_mode"] in ("row", "block"):  # one per row: repeat
      a_scale = jnp.tile(a_scale, (batch,) + (1,) * (a_scale.ndim - 1))
    out = primitive.bind(a2, b, c2, bias, a_scale=a_scale, b_scale=b_scale,
                         **params)
    return out.reshape(batch_shape + (m, n))
  params["a_scale"], params["b_scale"] = (
      None if x is None else jnp.broadcast_to(x, (batch,) + x.shape)
      for x in (a_scale, b_scale))
  a3 = jnp.broadcast_to(a, batch_shape + a.shape[-2:]).reshape(
      (batch,) + a.shape[-2:])
  b3 = jnp.broadcast_to(b, batch_shape + b.shape[-2:]).reshape(
      (batch,) + b.shape[-2:])
  c3 = None if c is None else c.reshape(batch, m, n)
  out = primitive.bind(a3, b3, c3, bias, **params)
  return out.reshape(batch_shape + (m, n))


def _promote(a, b):
  try:
    return jnp.result_type(a, b)
  except (TypeError, jax.dtypes.TypePromotionError) as e:
    # fp8 with another dtype: jnp has no implicit promotion for it.
    raise TypeError(
        f"a ({a.dtype}) and b ({b.dtype}) have no common dtype: {e}") from None


def _scale_operand(scale, name, *, operand, size, k, in_dtype, transposed,
                   vector):
  """(scale as the primitive takes it, its mode) for one fp8 operand."""
  if scale is None:
    return None, "none"
  if dtype_name(in_dtype) not in FP8_DTYPES:
    raise TypeError(f"{name} is for fp8 inputs only; the inputs are "
                    f"{dtype_name(in_dtype)}")
  scale = as_array(scale, name)
  if not jnp.issubdtype(scale.dtype, jnp.floating):
    raise TypeError(f"{name} has dtype {scale.dtype}; it must be a float array")
  scale = scale.astype(jnp.float32)
  blocks_k, blocks = -(-k // SCALE_BLOCK), -(-size // SCALE_BLOCK)
  vector_mode = "row" if operand == "a" else "col"
  if operand == "a":
    block_shape = (size, blocks_k)
  else:
    block_shape = (blocks, blocks_k) if transposed else (blocks_k, blocks)
  if scale.shape == ():
    return scale, "tensor"
  if vector:
    raise ValueError(f"{name}.shape={scale.shape}: a 1-D operand takes only "
                     "a scalar (per-tensor) scale")
  if scale.shape == (size,):
    return scale, vector_mode
  if scale.shape == block_shape:
    if operand == "b" and transposed:
      scale = scale.T  # the primitive takes B's block scales as (kb, nb)
    return scale, "block"
  what = "row of op(a)" if operand == "a" else "column of op(b)"
  raise ValueError(
      f"{name}.shape={scale.shape} is none of the scale layouts: () per "
      f"tensor, ({size},) per {what}, or {block_shape} block-wise "
      f"({'1x128' if operand == 'a' else '128x128'} blocks)")


def dot_general(lhs, rhs, dimension_numbers, precision=None,
                preferred_element_type=None, **kwargs):
  """A drop-in for `jax.lax.dot_general` (e.g. `flax.nnx.Linear(dot_general=...)`).

  Every dimension-number form runs as one (batched) pallas_gemm GEMM:
  several contracting dims, batch dims anywhere, free dims on both sides
  (see `pallas_gemm.dimension_numbers`). Where the operands' axes cannot be
  grouped by a free reshape or the kernels' transpose flags, an operand is
  transposed (a copy) first, unless `dispatch.resolve` leaves the GEMM to
  XLA anyway: then lax.dot_general runs it with no copy. Non-float operands
  and `out_sharding` stay on lax too. Each case on lax is logged once at
  debug level and reported by `pallas_gemm.explain`.
  """
  lhs = as_array(lhs, "lhs")
  rhs = as_array(rhs, "rhs")

  def on_lax(why):
    _note_lax(f"{dimension_numbers_lib.describe(dimension_numbers)} on "
              f"{lhs.shape}x{rhs.shape}: {why}")
    return jax.lax.dot_general(lhs, rhs, dimension_numbers,
                               precision=precision,
                               preferred_element_type=preferred_element_type,
                               **kwargs)

  invalid = dimension_numbers_lib.check(lhs.shape, rhs.shape,
                                        dimension_numbers)
  if invalid is not None:  # lax raises its own error for these
    return jax.lax.dot_general(lhs, rhs, dimension_numbers,
                               precision=precision,
                               preferred_element_type=preferred_element_type,
                               **kwargs)
  unsupported = [dtype_name(x.dtype) for x in (lhs, rhs)
                 if dtype_name(x.dtype) not in SUPPORTED_INPUT_DTYPES]
  if unsupported:
    return on_lax(f"{' and '.join(sorted(set(unsupported)))} operands (the "
                  f"kernels take {', '.join(SUPPORTED_INPUT_DTYPES)})")
  if kwargs.get("out_sharding") is not None:
    return on_lax("out_sharding is given")
  unknown = sorted(set(kwargs) - {"out_sharding"})
  if unknown:
    raise TypeError(f"dot_general got unexpected arguments {unknown}")

  plan = dimension_numbers_lib.plan(lhs.shape, rhs.shape, dimension_numbers)
  if plan.copies:
    resolution = _resolve_planned(plan, lhs, rhs, precision,
                                  preferred_element_type)
    if resolution.kernel == "xla":
      return on_lax(
          f"{' and '.join(plan.copies)} would need a transpose copy, and the "
          f"dispatch gives the GEMM to XLA ({resolution.reason})")
  a = dimension_numbers_lib.arrange(lhs, plan.lhs_order, plan.lhs_copy,
                                    plan.lhs_shape)
  b = dimension_numbers_lib.arrange(rhs, plan.rhs_order, plan.rhs_copy,
                                    plan.rhs_shape)
  out = matmul(a, b, precision=precision, transpose_a=plan.transpose_a,
               transpose_b=plan.transpose_b,
               preferred_element_type=preferred_element_type)
  return out.reshape(plan.out_shape)


def _resolve_planned(plan, lhs, rhs, precision, preferred_element_type):
  """What the dispatch would run the planned GEMM on."""
  in_dtype = dtype_name(jnp.result_type(lhs, rhs))
  try:
    out_dtype = (in_dtype if preferred_element_type is None
                 else dtype_name(preferred_element_type))
  except TypeError:
    raise TypeError(f"preferred_element_type={preferred_element_type!r} is "
                    "not a dtype") from None
  in_dtype = dtype_name(_preset_dtype(precision, in_dtype))
  problem = primitive.problem_from_shapes(
      plan.lhs_shape, plan.rhs_shape, in_dtype=in_dtype, out_dtype=out_dtype,
      transpose_a=plan.transpose_a, transpose_b=plan.transpose_b,
      precision=normalize_precision(precision, in_dtype), epilogue=Epilogue())
  return dispatch.resolve(problem, device_info())


def _note_lax(reason):
  LAX_REASONS.append(reason)
  if reason not in _LOGGED_REASONS:
    _LOGGED_REASONS.add(reason)
    _LOGGER.debug("pallas_gemm.dot_general runs lax.dot_general: %s", reason)
