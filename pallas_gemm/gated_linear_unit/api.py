"""`pallas_gemm.gated_linear_unit`: activation(x @ w_gate) * (x @ w_up).

The call path: check the arguments (`_normalize`), describe the call as a
`GluProblem`, decide kernel and config once (`resolve`), then run a
`jax.custom_vjp` function whose forward is the fused Mosaic kernel or the
XLA form, and whose backward runs its GEMMs on `pallas_gemm.matmul`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_gemm import dispatch
from pallas_gemm.devices import DeviceInfo, device_info
from pallas_gemm.gated_linear_unit import mosaic, xla
from pallas_gemm.gated_linear_unit.configs import (GluConfig, busy_share,
                                                   glu_heuristic, output_tiles)
from pallas_gemm.gated_linear_unit.problem import GLU_ACTIVATIONS, GluProblem
from pallas_gemm.problem import (GemmProblem, as_array, dtype_name,
                                 normalize_precision)

KERNELS = ("mosaic", "xla")
GLU_INPUT_DTYPES = ("float32", "bfloat16", "float16", "float64")
GLU_OUTPUT_DTYPES = ("float32", "bfloat16", "float16", "float64")


@dataclasses.dataclass(frozen=True)
class GluResolution:
  """The kernel and config one call runs with, and why."""

  kernel: str
  config: GluConfig | None
  source: str  # "explicit", "heuristic" or "fallback"
  reason: str


def resolve(problem: GluProblem, device: DeviceInfo, kernel: str | None = None,
            config: GluConfig | None = None) -> GluResolution:
  """The one place where a call's kernel and config are decided.

  kernel="mosaic" or a config: the Mosaic kernel, or a ValueError saying
  why it cannot run. kernel="xla": the XLA form. kernel=None: the Mosaic
  kernel on a Hopper GPU when it supports the problem, else the XLA form
  (on a CPU too: the Mosaic kernel runs there only in interpret mode, which
  is for tests and must be asked for by name). Also the XLA form for a
  decode batch (at most `dispatch.STREAMING_ROWS` rows) whose output has
  so few tiles that the heuristic splits the contraction, or that the
  tiles keep under STREAMING_MIN_FILL of the SMs busy: there the kernel
  ran slower than XLA on most shapes timed
  (experiments/results/nvidia_h200/glu_split/); and for a pair of weights
  whose rows are 8-byte but not 16-byte units (`_weights_near_aligned`).
  The config: the caller's, else the heuristic's.
  """
  if kernel is not None and kernel not in KERNELS:
    raise ValueError(f"kernel={kernel!r} is not one of {KERNELS} or None")
  if config is not None and not isinstance(config, GluConfig):
    raise TypeError(f"config must be a GluConfig or None, got "
                    f"{type(config).__name__}")
  if kernel == "xla":
    if config is not None:
      raise ValueError("config is given but kernel='xla' takes no config")
    return GluResolution("xla", None, "explicit", "kernel='xla' was asked for")
  reason = mosaic.supports(problem, device)
  if kernel == "mosaic" or config is not None:
    asked = "kernel='mosaic'" if kernel == "mosaic" else "a GluConfig"
    if reason is not None:
      raise ValueError(f"{asked} was given, but the Mosaic GLU kernel cannot "
                       f"run {problem.describe()}: {reason}")
    misfit = config.misfit(problem) if config is not None else None
    if misfit:
      raise ValueError(misfit)
    chosen = config or glu_heuristic(problem, device.planning_sms)
    return GluResolution("mosaic", chosen,
                         "explicit" if config is not None else "heuristic",
                         f"{asked} was asked for")
  if not device.is_gpu:
    return GluResolution("xla", None, "fallback",
                         f"no CUDA GPU ({device.device_kind}): the Mosaic "
                         "kernel runs on a host only in interpret mode "
                         "(kernel='mosaic')")
  if reason is not None:
    return GluResolution("xla", None, "fallback",
                         f"the Mosaic GLU kernel cannot run it: {reason}")
  chosen = glu_heuristic(problem, device.planning_sms)
  if problem.m <= dispatch.STREAMING_ROWS:
    why = _streams_on_few_sms(problem, chosen, device.planning_sms)
    if why:
      return GluResolution(
          "xla", None, "fallback",
          f"{problem.m} rows (at most {dispatch.STREAMING_ROWS}): {why}, "
          "which ran slower than XLA's two products at such row counts "
          "(kernel='mosaic' runs it anyway)")
  if _weights_near_aligned(problem):
    return GluResolution(
        "xla", None, "fallback",
        f"the weights' rows of {problem.n} {problem.in_dtype} are 8-byte but "
        "not 16-byte units: the kernel pads both weights, while XLA's "
        "products run near their aligned speed (kernel='mosaic' runs it "
        "anyway)")
  return GluResolution("mosaic", chosen, "heuristic",
                       "a Hopper GPU: the fused Mosaic kernel")


def _weights_near_aligned(problem: GluProblem) -> bool:
  """Whether a pair of weights (rows of n) puts each product in the dense
  dispatch's "ub8" class: x's rows whole 16-byte units, the weights' rows
  8-byte but not 16-byte units. The kernel pads both weights there and
  lost to XLA at every size timed; at rows of 2- or 4-byte units XLA is
  slow and the kernel wins (experiments/results/nvidia_h200/glu_split/,
  "Weights of 8-byte rows")."""
  if problem.fused_weights:
    return False
  return dispatch.alignment(GemmProblem(
      1, problem.m, problem.n, problem.k, problem.in_dtype,
      problem.out_dtype)) == "ub8"


#: A decode batch streams the weights: a kernel whose tiles keep less than
#: this share of the SMs busy reads them slower than XLA's products do.
STREAMING_MIN_FILL = 0.75


def _streams_on_few_sms(problem: GluProblem, config: GluConfig,
                        num_sms: int) -> str | None:
  """Why the kernel would stream a decode batch's weights on too few SMs
  (it splits the contraction to fill them, or its tiles fill less than
  STREAMING_MIN_FILL of its waves), or None."""
  tiles = output_tiles(problem, config)
  if config.k_splits > 1:
    return (f"its output has {tiles} tiles for {num_sms} SMs, so the kernel "
            f"would split its contraction in {config.k_splits}")
  fill = busy_share(tiles, num_sms)
  if fill < STREAMING_MIN_FILL:
    return (f"its {tiles} tiles keep {fill:.0%} of the {num_sms} SMs busy "
            f"(under {STREAMING_MIN_FILL:.0%})")
  return None


# ------------------------------------------------------------ the call path


def gated_linear_unit(x, weights, *, activation: str = "silu", precision=None,
                      preferred_element_type=None, kernel: str | None = None,
                      config: GluConfig | None = None):
  """activation(x @ w_gate) * (x @ w_up), fused on Hopper.

  Args:
    x: (..., k): leading dimensions are batch (flattened into the rows).
    weights: a pair (w_gate, w_up) of (k, n) arrays, or one fused (k, 2, n)
      array with the gate at [:, 0] and the up projection at [:, 1] (read in
      place, no copy).
    activation: the gate's activation: "silu" (SwiGLU), "gelu" (tanh form,
      GEGLU), "gelu_exact" (erf form), "relu" (ReGLU), "sigmoid" (GLU) or
      "identity" (bilinear).
    precision: as for `jnp.dot`; it matters for float32 inputs only.
    preferred_element_type: the output dtype (default: the inputs' dtype).
      The products accumulate and the gating runs in float32 either way.
    kernel: "mosaic", "xla" or None (automatic, see `resolve`).
    config: a `GluConfig` for the Mosaic kernel; None uses its heuristic.

  Returns:
    (..., n) in `preferred_element_type`. Differentiable (jax.grad, under
    jit and vmap): the backward runs on `pallas_gemm.matmul`.
  """
  x, weights, problem, out_dtype = _normalize(x, weights, activation,
                                              precision,
                                              preferred_element_type)
  lead_shape = x.shape[:-1]
  if 0 in (problem.m, problem.n, problem.k):
    return jnp.zeros(lead_shape + (problem.n,), out_dtype)
  device = device_info()
  resolution = resolve(problem, device, kernel, config)
  spec = _Spec(activation=activation, out_dtype=dtype_name(out_dtype),
               precision=_hashable(precision), resolution=resolution,
               interpret=not device.is_gpu)
  out = _glu(spec, x.reshape(problem.m, problem.k), weights)
  return out.reshape(lead_shape + (problem.n,))


def explain(x, weights, **kwargs) -> GluResolution:
  """The resolution `gated_linear_unit` would use for these arguments."""
  kernel, config = kwargs.pop("kernel", None), kwargs.pop("config", None)
  args = (kwargs.pop("activation", "silu"), kwargs.pop("precision", None),
          kwargs.pop("preferred_element_type", None))
  if kwargs:
    raise TypeError(f"unexpected arguments {sorted(kwargs)}")
  problems = []

  def describe(x, weights):  # abstract: takes jax.ShapeDtypeStruct too
    problems.append(_normalize(x, weights, *args)[2])
    return jnp.zeros(())

  jax.eval_shape(describe, x, weights)
  return resolve(problems[0], device_info(), kernel, config)


def _normalize(x, weights, activation, precision, preferred_element_type):
  """Checks every argument (errors name it) and returns (x, weights,
  problem, out_dtype) with x and the weights in one promoted dtype."""
  x = as_array(x, "x")
  if x.ndim < 1:
    raise ValueError(f"x must have rank >= 1 (..., k), got shape {x.shape}")
  if isinstance(weights, (tuple, list)):
    if len(weights) != 2:
      raise ValueError(f"weights must be a pair (w_gate, w_up) or one "
                       f"(k, 2, n) array, got a sequence of {len(weights)}")
    w_gate = as_array(weights[0], "weights[0] (w_gate)")
    w_up = as_array(weights[1], "weights[1] (w_up)")
    if w_gate.ndim != 2 or w_gate.shape != w_up.shape:
      raise ValueError(f"weights (w_gate, w_up) must both be (k, n), got "
                       f"{w_gate.shape} and {w_up.shape}")
    k, n = w_gate.shape
    fused = False
    arrays = (w_gate, w_up)
  else:
    w = as_array(weights, "weights")
    if w.ndim != 3 or w.shape[1] != 2:
      raise ValueError(f"fused weights must be (k, 2, n), got shape {w.shape}")
    k, _, n = w.shape
    fused = True
    arrays = (w,)
  if x.shape[-1] != k:
    raise ValueError(f"x.shape={x.shape} has k={x.shape[-1]} but the weights "
                     f"have k={k}")
  for name, array in (("x", x),) + tuple(
      (f"weights[{i}]" if not fused else "weights", a)
      for i, a in enumerate(arrays)):
    if dtype_name(array.dtype) not in GLU_INPUT_DTYPES:
      raise TypeError(f"{name} has dtype {array.dtype}; gated_linear_unit "
                      f"takes {GLU_INPUT_DTYPES}")
  if not isinstance(activation, str):
    raise TypeError(f"activation must be a name (str), one of "
                    f"{sorted(GLU_ACTIVATIONS)}; got {type(activation).__name__}")
  if activation not in GLU_ACTIVATIONS:
    raise ValueError(f"activation={activation!r} is not one of "
                     f"{sorted(GLU_ACTIVATIONS)}")
  in_dtype = jnp.result_type(x, *arrays)
  x = x.astype(in_dtype)
  arrays = tuple(a.astype(in_dtype) for a in arrays)
  if preferred_element_type is None:
    out_dtype = jnp.dtype(in_dtype)
  else:
    try:
      out_dtype = jnp.dtype(preferred_element_type)
    except TypeError:
      raise TypeError(f"preferred_element_type={preferred_element_type!r} is "
                      "not a dtype") from None
    if dtype_name(out_dtype) not in GLU_OUTPUT_DTYPES:
      raise TypeError(f"preferred_element_type={out_dtype} is not one of "
                      f"{GLU_OUTPUT_DTYPES}")
  precision_name = ("default" if dtype_name(in_dtype) == "float64" else
                    normalize_precision(precision, dtype_name(in_dtype)))
  m = int(np.prod(x.shape[:-1], dtype=np.int64))
  problem = GluProblem(m=m, n=int(n), k=int(k), in_dtype=dtype_name(in_dtype),
                       out_dtype=dtype_name(out_dtype), activation=activation,
                       fused_weights=fused, precision=precision_name)
  return x, (arrays[0] if fused else arrays), problem, out_dtype


def _hashable(precision):
  return tuple(precision) if isinstance(precision, list) else precision


@dataclasses.dataclass(frozen=True)
class _Spec:
  """Everything static about one call (a custom_vjp non-diff argument)."""

  activation: str
  out_dtype: str
  precision: Any
  resolution: GluResolution
  interpret: bool


def _problem(spec: _Spec, x, weights) -> GluProblem:
  fused = not isinstance(weights, tuple)
  k, n = (weights.shape[0], weights.shape[2]) if fused else weights[0].shape
  return GluProblem(m=x.shape[0], n=n, k=k, in_dtype=dtype_name(x.dtype),
                    out_dtype=spec.out_dtype, activation=spec.activation,
                    fused_weights=fused)


def _split(weights):
  if isinstance(weights, tuple):
    return weights
  return weights[:, 0, :], weights[:, 1, :]


def _forward_2d(spec: _Spec, residuals: bool, x, weights):
  """The forward on a 2-D x: out, or (out, gate, up) with `residuals`."""
  resolution = spec.resolution
  if resolution.kernel == "mosaic":
    return mosaic.glu_forward(x, weights, problem=_problem(spec, x, weights),
                              config=resolution.config, residuals=residuals,
                              interpret=spec.interpret)
  out_dtype = jnp.dtype(spec.out_dtype)
  gate, up = xla.glu_products(x, *_split(weights), precision=spec.precision,
                              out_dtype=out_dtype)
  out = xla.gate(gate, up, spec.activation, out_dtype)
  return (out, gate, up) if residuals else out


@functools.lru_cache(maxsize=None)
def _forward(spec: _Spec, residuals: bool):
  """The forward as a function of (x, weights) that vmaps: a batch of x
  alone becomes rows (one kernel call); batched weights run one call per
  batch entry."""
  fn = jax.custom_batching.custom_vmap(
      functools.partial(_forward_2d, spec, residuals))

  @fn.def_vmap
  def _rule(axis_size, in_batched, x, weights):
    x_batched, weights_batched = in_batched
    if not any(jax.tree.leaves(weights_batched)):
      if not x_batched:
        x = jnp.broadcast_to(x, (axis_size,) + x.shape)
      rows = fn(x.reshape(-1, x.shape[-1]), weights)
      unflatten = lambda o: o.reshape((axis_size, x.shape[1]) + o.shape[1:])
      out = jax.tree.map(unflatten, rows)
    else:
      x = x if x_batched else jnp.broadcast_to(x, (axis_size,) + x.shape)
      weights = jax.tree.map(
          lambda w, b: w if b else jnp.broadcast_to(w, (axis_size,) + w.shape),
          weights, weights_batched)
      out = jax.lax.map(lambda xw: fn(*xw), (x, weights))
    return out, jax.tree.map(lambda _: True, out)

  return fn


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _glu(spec: _Spec, x, weights):
  return _forward(spec, False)(x, weights)


def _glu_fwd(spec: _Spec, x, weights):
  # gate and up are saved rather than recomputed: recomputing them would
  # add a third to the GEMM work of forward + backward (XLA's own autodiff
  # of the two-dot form saves them too).
  out, gate, up = _forward(spec, True)(x, weights)
  return out, (x, weights, gate, up)


def _glu_bwd(spec: _Spec, saved, d_out):
  from pallas_gemm.api import matmul  # the package imports this module
  x, weights, gate, up = saved
  d_gate, d_up = _gating_cotangents(spec.activation, d_out, gate, up, x.dtype)
  gemm = functools.partial(matmul, precision=spec.precision)
  if isinstance(weights, tuple):
    w_gate, w_up = weights
    # Two GEMMs in x's dtype and one add, as XLA's autodiff of the two-dot
    # form. XLA runs the add as an elementwise kernel of its own (it does
    # not fold it into the second GEMM); a float32 partial product passed as
    # `c` would add an m x k float32 write and read on top
    # (experiments/results/nvidia_h100/glu_breakdown).
    dx = (gemm(d_gate, w_gate, transpose_b=True, preferred_element_type=x.dtype)
          + gemm(d_up, w_up, transpose_b=True, preferred_element_type=x.dtype))
    d_weights = (gemm(x, d_gate, transpose_a=True,
                      preferred_element_type=w_gate.dtype),
                 gemm(x, d_up, transpose_a=True,
                      preferred_element_type=w_up.dtype))
  else:
    k, _, n = weights.shape
    # [d_gate d_up] is written by the elementwise fusion straight into one
    # (m, 2n) array, so that each of dx and dW is ONE GEMM against the
    # fused weights' free (k, 2n) view.
    d_both = jnp.stack([d_gate, d_up], axis=1).reshape(x.shape[0], 2 * n)
    dx = gemm(d_both, weights.reshape(k, 2 * n), transpose_b=True,
              preferred_element_type=x.dtype)
    d_weights = gemm(x, d_both, transpose_a=True,
                     preferred_element_type=weights.dtype).reshape(k, 2, n)
  return dx, d_weights


def _gating_cotangents(activation: str, d_out, gate, up, dtype):
  """(d_gate, d_up) of out = act(gate) * up, in float32, rounded to the
  GEMM input dtype."""
  d_out = d_out.astype(jnp.float32)
  up32 = up.astype(jnp.float32)
  activated, act_vjp = jax.vjp(GLU_ACTIVATIONS[activation],
                               gate.astype(jnp.float32))
  (d_gate,) = act_vjp(d_out * up32)
  return d_gate.astype(dtype), (d_out * activated).astype(dtype)


_glu.defvjp(_glu_fwd, _glu_bwd)
