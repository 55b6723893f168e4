"""`pallas_gemm_p`: the JAX primitive behind `pallas_gemm.matmul`.

One equation in a jaxpr stands for one fused GEMM:

    out = activation(alpha * (op(a) @ op(b)) + beta * c + bias)

Operands: `a`, `b`, then `c` and `bias` when the epilogue asks for them,
then fp8 dequantization scales `a_scale` and `b_scale` when their modes are
not "none". `a` and `b` are both rank 2 (m×k, k×n) or both rank 3 with a
leading batch dimension; `c` has the output's shape and `bias` is (n,).
Scales are float32 and, for rank 3, carry the batch dimension first:
  a_scale: "tensor" (), "row" (m,), "block" (m, ceil(k/128));
  b_scale: "tensor" (), "col" (n,), "block" (ceil(k/128), ceil(n/128)),
           whatever B's stored layout (the API reorders an (n, k) one).

Params (all static and hashable): `kernel` (a registered name), `config` (that
kernel's frozen config dataclass, or None), `transpose_a`, `transpose_b`,
`precision` ("ieee", "tf32" or "default"), `epilogue`, `out_dtype`,
`a_scale_mode` and `b_scale_mode`.

Rules:
  * abstract eval: shape and dtype only;
  * lowering, per platform: CUDA runs the kernel; CPU runs the same Pallas
    kernel in interpret mode (kernels that cannot run on a CPU fall back to
    XLA's dot there);
  * batching: a vmapped axis becomes rows of M when only `a` carries it,
    otherwise the kernel's batch grid axis; no Python loop;
  * JVP and transpose: the tangent and cotangent products are this primitive
    again, so dA = dC·Bᵀ and dB = Aᵀ·dC run on pallas_gemm kernels too.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax._src import dispatch as jax_dispatch  # no public hook for "needs devices"
from jax.extend import core as jex_core
from jax._src import checkify as checkify_lib  # no public rule registry
from jax.interpreters import ad, batching, mlir

from pallas_gemm import dispatch, registry, sharding
from pallas_gemm.devices import device_info
from pallas_gemm.problem import (ACTIVATIONS, SCALE_BLOCK, Epilogue,
                                 GemmProblem, cdiv, dtype_name)

pallas_gemm_p = jex_core.Primitive("pallas_gemm")


# ---------------------------------------------------------------- helpers ---


def _matrix_dims(a_shape, b_shape, transpose_a, transpose_b):
  m, k = (a_shape[-1], a_shape[-2]) if transpose_a else (a_shape[-2], a_shape[-1])
  n = b_shape[-2] if transpose_b else b_shape[-1]
  return m, n, k


def problem_from_shapes(a_shape, b_shape, *, in_dtype, out_dtype, transpose_a,
                        transpose_b, precision, epilogue, c_dtype=None,
                        b_dtype=None, a_scale_mode="none",
                        b_scale_mode="none") -> GemmProblem:
  m, n, k = _matrix_dims(a_shape, b_shape, transpose_a, transpose_b)
  batch = a_shape[0] if len(a_shape) == 3 else 1
  return GemmProblem(
      batch=batch, m=m, n=n, k=k, in_dtype=in_dtype, out_dtype=out_dtype,
      transpose_a=transpose_a, transpose_b=transpose_b, precision=precision,
      epilogue=epilogue, c_dtype=c_dtype,
      b_dtype=None if b_dtype == in_dtype else b_dtype,
      a_scale_mode=a_scale_mode, b_scale_mode=b_scale_mode)


def _split_all(operands, epilogue: Epilogue, scale_modes=("none", "none")):
  """(a, b, c, bias, a_scale, b_scale), absent ones as None."""
  a, b, *rest = operands
  c = rest.pop(0) if epilogue.has_c else None
  bias = rest.pop(0) if epilogue.has_bias else None
  a_scale = rest.pop(0) if scale_modes[0] != "none" else None
  b_scale = rest.pop(0) if scale_modes[1] != "none" else None
  assert not rest, "unexpected extra operands"
  return a, b, c, bias, a_scale, b_scale


def _split_operands(operands, epilogue: Epilogue, scale_modes=("none", "none")):
  return _split_all(operands, epilogue, scale_modes)[:4]


def _modes(params):
  return (params.get("a_scale_mode", "none"),
          params.get("b_scale_mode", "none"))


def _join_operands(a, b, c, bias, a_scale=None, b_scale=None):
  return [x for x in (a, b, c, bias, a_scale, b_scale) if x is not None]


def scale_shape(mode: str, operand: str, m_or_n: int, k: int) -> tuple:
  """The unbatched canonical shape of a scale (see the module docstring)."""
  if mode == "tensor":
    return ()
  if mode in ("row", "col"):
    return (m_or_n,)
  blocks_k = cdiv(k, SCALE_BLOCK)
  if operand == "a":
    return (m_or_n, blocks_k)
  return (blocks_k, cdiv(m_or_n, SCALE_BLOCK))


def problem_from_params(operands, params) -> GemmProblem:
  """The problem of one `pallas_gemm_p` equation, from its operands (or
  their avals) and params."""
  return _problem_for(operands, params)


def _problem_for(operands, params) -> GemmProblem:
  modes = _modes(params)
  a, b, c, _ = _split_operands(operands, params["epilogue"], modes)
  return problem_from_shapes(
      a.shape, b.shape, in_dtype=dtype_name(a.dtype),
      out_dtype=params["out_dtype"], transpose_a=params["transpose_a"],
      transpose_b=params["transpose_b"], precision=params["precision"],
      epilogue=params["epilogue"],
      c_dtype=None if c is None else dtype_name(c.dtype),
      b_dtype=dtype_name(b.dtype), a_scale_mode=modes[0],
      b_scale_mode=modes[1])


def bind(a, b, c=None, bias=None, *, kernel=None, config=None,
         transpose_a=False, transpose_b=False, precision="default",
         epilogue=Epilogue(), out_dtype=None, a_scale=None, b_scale=None,
         a_scale_mode="none", b_scale_mode="none"):
  """Resolves the kernel and its config for these operands, then binds.

  `kernel` may be None (automatic choice). A named kernel that cannot run the
  problem fails with the kernel's own reason; a config of the wrong class is
  a TypeError. The decision is `dispatch.resolve`'s, made once per problem.
  """
  operands = _join_operands(a, b, c, bias, a_scale, b_scale)
  params = dict(transpose_a=transpose_a, transpose_b=transpose_b,
                precision=precision, epilogue=epilogue,
                out_dtype=dtype_name(out_dtype if out_dtype is not None
                                     else a.dtype),
                a_scale_mode=a_scale_mode, b_scale_mode=b_scale_mode)
  problem = _problem_for(operands, params)
  resolution = dispatch.resolve(problem, device_info(), kernel, config)
  return _bind_resolved(resolution, operands, params)


def rebind(a, b, c=None, bias=None, *, kernel, config, transpose_a,
           transpose_b, precision, epilogue, out_dtype, a_scale=None,
           b_scale=None, a_scale_mode="none", b_scale_mode="none"):
  """Binds a derived product (a tangent, a cotangent, a batched copy).

  It keeps the original kernel and config when that kernel supports the new
  problem, and otherwise lets the automatic choice decide.
  """
  operands = _join_operands(a, b, c, bias, a_scale, b_scale)
  params = dict(transpose_a=transpose_a, transpose_b=transpose_b,
                precision=precision, epilogue=epilogue,
                out_dtype=dtype_name(out_dtype), a_scale_mode=a_scale_mode,
                b_scale_mode=b_scale_mode)
  problem, device = _problem_for(operands, params), device_info()
  entry = registry.get_kernel(kernel)
  if registry.why_unsupported(entry, problem, device) is not None:
    kernel, config = None, None
  resolution = dispatch.resolve(problem, device, kernel, config)
  return _bind_resolved(resolution, operands, params)


def _bind_resolved(resolution, operands, params):
  return pallas_gemm_p.bind(*sharding.match_varying_axes(operands),
                            kernel=resolution.kernel,
                            config=resolution.config, **params)


# ---------------------------------------------------------- abstract eval ---


@pallas_gemm_p.def_abstract_eval
def _abstract_eval(*operands, kernel, config, transpose_a, transpose_b,
                   precision, epilogue, out_dtype, a_scale_mode="none",
                   b_scale_mode="none"):
  del kernel, config, precision
  a, b, c, bias, a_scale, b_scale = _split_all(
      operands, epilogue, (a_scale_mode, b_scale_mode))
  if a.ndim != b.ndim or a.ndim not in (2, 3):
    raise ValueError(
        f"pallas_gemm_p needs a and b of equal rank 2 or 3, got a.shape="
        f"{a.shape}, b.shape={b.shape}")
  m, n, k = _matrix_dims(a.shape, b.shape, transpose_a, transpose_b)
  k_b = b.shape[-1] if transpose_b else b.shape[-2]
  if k != k_b:
    raise ValueError(
        f"contraction sizes differ: a.shape={a.shape} gives k={k}, "
        f"b.shape={b.shape} gives k={k_b}")
  out_shape = (a.shape[0], m, n) if a.ndim == 3 else (m, n)
  if a.ndim == 3 and a.shape[0] != b.shape[0]:
    raise ValueError(f"batch sizes differ: a.shape={a.shape}, b.shape={b.shape}")
  if c is not None and tuple(c.shape) != out_shape:
    raise ValueError(f"c.shape={c.shape} must equal the output shape {out_shape}")
  if bias is not None and tuple(bias.shape) != (n,):
    raise ValueError(f"bias.shape={bias.shape} must be ({n},)")
  batch = (a.shape[0],) if a.ndim == 3 else ()
  for name, scale, mode, size in (("a_scale", a_scale, a_scale_mode, m),
                                  ("b_scale", b_scale, b_scale_mode, n)):
    if scale is None:
      continue
    want = batch + scale_shape(mode, name[0], size, k)
    if tuple(scale.shape) != want:
      raise ValueError(f"{name}.shape={scale.shape} must be {want} for "
                       f"{name}_mode={mode!r}")
    if scale.dtype != jnp.float32:
      raise TypeError(f"{name} has dtype {scale.dtype}; it must be float32")
  return sharding.output_type(operands, out_shape, out_dtype,
                              transpose_a=transpose_a, transpose_b=transpose_b)


# ---------------------------------------------------------------- lowering ---


def _run_kernel(*operands, platform, kernel, config, transpose_a, transpose_b,
                precision, epilogue, out_dtype, a_scale_mode="none",
                b_scale_mode="none"):
  params = dict(kernel=kernel, config=config, transpose_a=transpose_a,
                transpose_b=transpose_b, precision=precision,
                epilogue=epilogue, out_dtype=out_dtype,
                a_scale_mode=a_scale_mode, b_scale_mode=b_scale_mode)
  problem = _problem_for(operands, params)
  a, b, c, bias, a_scale, b_scale = _split_all(
      operands, epilogue, (a_scale_mode, b_scale_mode))
  entry = registry.get_kernel(kernel)
  interpret = platform == "cpu"
  if interpret and not entry.runs_on_cpu:
    entry, config = registry.get_kernel("xla"), None
  rank2 = a.ndim == 2
  if rank2:
    a, b = a[None], b[None]
    c = None if c is None else c[None]
    a_scale = None if a_scale is None else a_scale[None]
    b_scale = None if b_scale is None else b_scale[None]
  # Only kernels that take scales get the keywords (`KernelEntry.takes_scales`).
  scales = (dict(a_scale=a_scale, b_scale=b_scale) if problem.is_scaled
            else {})
  out = entry.fn(a, b, c, bias, problem=problem, config=config,
                 interpret=interpret, **scales)
  return out[0] if rank2 else out


def _lowering_for(platform):
  def rule(ctx, *args, **params):
    impl = functools.partial(_run_kernel, platform=platform, **params)
    if sharding.needs_partitioning(ctx):
      if _modes(params) != ("none", "none"):
        raise NotImplementedError(
            "pallas_gemm: scaled fp8 matmuls are not partitioned across "
            "devices; call them inside shard_map, or unsharded")
      params = {key: value for key, value in params.items()
                if key not in ("a_scale_mode", "b_scale_mode")}
      impl = sharding.partitioned_kernel(sharding.GemmCall(
          _run_kernel, platform, len(ctx.avals_in[0].shape), **params))
    return sharding.lower_per_device(ctx, impl, *args)
  return rule


mlir.register_lowering(pallas_gemm_p, _lowering_for("cuda"), platform="cuda")
mlir.register_lowering(pallas_gemm_p, _lowering_for("cpu"), platform="cpu")
# Any other platform (ROCm, TPU) gets XLA's dot through the CPU path's
# fallback: no Pallas-Triton or CUDA kernel here targets it.
mlir.register_lowering(pallas_gemm_p, _lowering_for("cpu"))
# The partitioned lowering needs the device assignment while lowering.
jax_dispatch.prim_requires_devices_during_lowering.add(pallas_gemm_p)


# Eager calls compile the one equation, as lax primitives do; unlike a
# `jax.jit` of the bind, this also holds under `jax.disable_jit()`, where a
# jit would run the bind eagerly and recurse.
pallas_gemm_p.def_impl(functools.partial(jax_dispatch.apply_primitive,
                                         pallas_gemm_p))

# checkify's nan_checks look at the output as they do for lax.dot_general.
checkify_lib.error_checks[pallas_gemm_p] = functools.partial(
    checkify_lib.nan_error_check, pallas_gemm_p)


# ---------------------------------------------------------------- batching ---


def _batching_rule(operands, batch_dims, **params):
  epilogue: Epilogue = params["epilogue"]
  size = next(x.shape[d] for x, d in zip(operands, batch_dims)
              if d is not None)
  if size == 0:
    # vmap over an empty axis: the output is empty too, as in jnp.matmul.
    avals = [jax.core.ShapedArray(
        x.shape[:d] + x.shape[d + 1:] if d is not None else x.shape, x.dtype)
        for x, d in zip(operands, batch_dims)]
    out_aval = _abstract_eval(*avals, **params)
    return jnp.zeros((0,) + tuple(out_aval.shape), out_aval.dtype), 0
  moved = [x if d is None else jnp.moveaxis(x, d, 0)
           for x, d in zip(operands, batch_dims)]
  mapped = [d is not None for d in batch_dims]
  modes = _modes(params)
  a, b, c, bias, a_scale, b_scale = _split_all(moved, epilogue, modes)
  a_m, b_m, c_m, bias_m, a_scale_m, b_scale_m = _split_all(
      mapped, epilogue, modes)
  rank = a.ndim - 1 if a_m else a.ndim

  if bias_m:
    # A per-example bias is no longer one row vector: fold it, with beta, into
    # a per-example C so the kernel's epilogue still adds it in one pass.
    a_shape = a.shape[1:] if a_m else a.shape
    b_shape = b.shape[1:] if b_m else b.shape
    m, n, _ = _matrix_dims(a_shape, b_shape, params["transpose_a"],
                           params["transpose_b"])
    out_shape_unbatched = a_shape[:rank - 2] + (m, n)
    bias_rows = bias.astype(jnp.float32)
    bias_rows = bias_rows.reshape(
        (size,) + (1,) * (len(out_shape_unbatched) - 1) + bias.shape[-1:])
    c_new = bias_rows
    if c is not None and epilogue.beta != 0.0:
      c_new = c_new + epilogue.beta * c.astype(jnp.float32)
    c = jnp.broadcast_to(c_new, (size,) + out_shape_unbatched)
    c_m, bias, bias_m = True, None, False
    epilogue = dataclasses.replace(epilogue, beta=1.0, has_c=True,
                                   has_bias=False)
    params = dict(params, epilogue=epilogue)

  # A's scales fold into rows only when they stay one per row (or one in
  # all); B's must be shared by every example, as B is.
  scales_fold = (not b_scale_m and (
      modes[0] in ("none", "row", "block")
      or (modes[0] == "tensor" and not a_scale_m)))
  fold_into_m = (rank == 2 and a_m and not b_m and not params["transpose_a"]
                 and scales_fold)
  if fold_into_m:
    # Rows of independent problems that share B are one taller problem.
    m = a.shape[1]
    a2 = a.reshape(size * m, a.shape[2])
    c2 = None
    if c is not None:
      c2 = (c if c_m else jnp.broadcast_to(c, (size,) + c.shape))
      c2 = c2.reshape(size * m, c2.shape[-1])
    a_scale2 = a_scale
    if modes[0] in ("row", "block"):
      a_scale2 = (a_scale if a_scale_m
                  else jnp.broadcast_to(a_scale, (size,) + a_scale.shape))
      a_scale2 = a_scale2.reshape((size * m,) + a_scale.shape[2 if a_scale_m
                                                              else 1:])
    out = rebind(a2, b, c2, bias, a_scale=a_scale2, b_scale=b_scale, **params)
    return out.reshape(size, m, out.shape[-1]), 0

  def with_batch(x, is_mapped):
    if x is None:
      return None
    if not is_mapped:
      x = jnp.broadcast_to(x, (size,) + x.shape)
    if rank == 3:  # merge the vmapped axis with the existing batch axis
      x = x.reshape((x.shape[0] * x.shape[1],) + x.shape[2:])
    return x

  a3, b3, c3 = with_batch(a, a_m), with_batch(b, b_m), with_batch(c, c_m)
  # Scales follow the batch axis when mapped and are broadcast otherwise.
  out = rebind(a3, b3, c3, bias, a_scale=with_batch(a_scale, a_scale_m),
               b_scale=with_batch(b_scale, b_scale_m), **params)
  if rank == 3:
    out = out.reshape((size, out.shape[0] // size) + out.shape[1:])
  return out, 0


batching.primitive_batchers[pallas_gemm_p] = _batching_rule


# --------------------------------------------------------------- autodiff ---


def _is_zero(t):
  return t is None or type(t) is ad.Zero


def _jvp_rule(primals, tangents, **params):
  epilogue: Epilogue = params["epilogue"]
  if _modes(params) != ("none", "none"):
    if all(_is_zero(t) for t in tangents):
      out = pallas_gemm_p.bind(*primals, **params)
      return out, ad.Zero.from_primal_value(out)
    raise NotImplementedError(
        "pallas_gemm.matmul: scaled fp8 matmuls have no gradient (fp8 "
        "training recipes quantize outside the GEMM); differentiate a "
        "bf16/f32 matmul of the dequantized operands instead, or wrap the "
        "inputs in jax.lax.stop_gradient")
  a, b, c, bias = _split_operands(primals, epilogue)
  da, db, dc, dbias = _split_operands(tangents, epilogue)
  out_dtype = params["out_dtype"]
  linear_dtype = "float32" if epilogue.activation else out_dtype
  linear_params = dict(params, epilogue=Epilogue(alpha=epilogue.alpha),
                       out_dtype=linear_dtype)

  if epilogue.activation is None:
    out = pallas_gemm_p.bind(*primals, **params)
  else:
    pre_activation = dict(
        params, epilogue=dataclasses.replace(epilogue, activation=None),
        out_dtype="float32")
    z = pallas_gemm_p.bind(*primals, **pre_activation)
    out = ACTIVATIONS[epilogue.activation](z).astype(out_dtype)

  terms = []
  if not _is_zero(da):
    terms.append(rebind(da, b, **linear_params))
  if not _is_zero(db):
    terms.append(rebind(a, db, **linear_params))
  if epilogue.has_c and not _is_zero(dc) and epilogue.beta != 0.0:
    terms.append((epilogue.beta * dc.astype(jnp.float32)).astype(linear_dtype))
  if epilogue.has_bias and not _is_zero(dbias):
    terms.append(jnp.broadcast_to(dbias.astype(linear_dtype), out.shape))
  if not terms:
    return out, ad.Zero.from_primal_value(out)
  t = functools.reduce(jnp.add, terms)
  if epilogue.activation is not None:
    act = ACTIVATIONS[epilogue.activation]
    t = jax.jvp(act, (z,), (t.astype(jnp.float32),))[1]
  return out, t.astype(out_dtype)


ad.primitive_jvps[pallas_gemm_p] = _jvp_rule


def _transpose_rule(ct, *operands, **params):
  epilogue: Epilogue = params["epilogue"]
  if epilogue.has_c or epilogue.has_bias or epilogue.activation is not None:
    raise NotImplementedError(
        "pallas_gemm_p is only linear without c, bias and activation; the "
        "JVP rule never transposes the epilogue")
  a, b = operands
  if ad.is_undefined_primal(a) and ad.is_undefined_primal(b):
    raise ValueError("pallas_gemm_p is bilinear, not linear, in (a, b)")
  if type(ct) is ad.Zero:
    return [None, None]
  ta, tb = params["transpose_a"], params["transpose_b"]
  common = dict(kernel=params["kernel"], config=params["config"],
                precision=params["precision"], epilogue=epilogue)
  if ad.is_undefined_primal(a):
    ct_in, b, common = _cotangent_operands(ct, b, common)
    a_dtype = a.aval.dtype
    if not ta:  # dA = alpha · ct · op(b)ᵀ
      da = rebind(ct_in, b, transpose_a=False, transpose_b=not tb,
                  out_dtype=a_dtype, **common)
    else:  # a holds op(a)ᵀ: dA = alpha · op(b) · ctᵀ
      da = rebind(b, ct_in, transpose_a=tb, transpose_b=True,
                  out_dtype=a_dtype, **common)
    return [da, None]
  ct_in, a, common = _cotangent_operands(ct, a, common)
  b_dtype = b.aval.dtype
  if not tb:  # dB = alpha · op(a)ᵀ · ct
    db = rebind(a, ct_in, transpose_a=not ta, transpose_b=False,
                out_dtype=b_dtype, **common)
  else:  # b holds op(b)ᵀ: dB = alpha · ctᵀ · op(a)
    db = rebind(ct_in, a, transpose_a=True, transpose_b=ta,
                out_dtype=b_dtype, **common)
  return [None, db]


def _cotangent_operands(ct, other, common):
  """(cotangent, other operand, params) for a backward product.

  A cotangent wider than the operands (f32 from a bf16 GEMM with an f32
  output) keeps its precision, as lax keeps it: the other operand is
  upcast instead, and the product runs as float32 at TF32, the precision
  lax's own backward dot gets by default.
  """
  if jnp.dtype(ct.dtype).itemsize > jnp.dtype(other.dtype).itemsize:
    precision = "ieee" if common["precision"] == "ieee" else "tf32"
    # A config chosen for the 16-bit forward does not fit float32 tiles.
    return ct, other.astype(ct.dtype), dict(common, precision=precision,
                                            config=None)
  return ct.astype(other.dtype), other, common


ad.primitive_transposes[pallas_gemm_p] = _transpose_rule
