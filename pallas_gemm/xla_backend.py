"""`xla`: XLA's own dot, the last entry of every fallback order.

It is also the baseline every benchmark compares against: the same
computation `jnp.dot` would run (cuBLAS/cuBLASLt on a GPU), with the epilogue
left to XLA's fusion.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_gemm import fp8, registry
from pallas_gemm.problem import apply_epilogue

_XLA_PRECISION = {
    "ieee": jax.lax.Precision.HIGHEST,
    "tf32": jax.lax.Precision.DEFAULT,
    "default": jax.lax.Precision.DEFAULT,
}


def xla_matmul(a, b, c, bias, *, problem, config=None, interpret=False,
               a_scale=None, b_scale=None):
  del config, interpret
  if problem.is_scaled or problem.b_dtype is not None:
    return _xla_fp8(a, b, c, bias, problem, a_scale, b_scale)
  # Without an epilogue, ask for the output dtype directly, as `jnp.dot`
  # does: cuBLAS still accumulates in f32, and a separate f32 -> bf16 pass
  # over the output would make `xla` slower than the baseline it stands for.
  direct = problem.epilogue.is_identity
  wide = "float64" in (problem.in_dtype, problem.out_dtype)
  acc_dtype = problem.out_dtype if direct else (
      jnp.float64 if wide else jnp.float32)
  precision = _XLA_PRECISION[problem.precision]
  if problem.batch == 1:
    # The 2-D dot `jnp.dot` emits for matrices.
    acc = jax.lax.dot_general(
        a[0], b[0], (((0 if problem.transpose_a else 1,),
                      (1 if problem.transpose_b else 0,)), ((), ())),
        precision=precision, preferred_element_type=acc_dtype)[None]
  else:
    acc = jax.lax.dot_general(
        a, b, (((1 if problem.transpose_a else 2,),
                (2 if problem.transpose_b else 1,)), ((0,), (0,))),
        precision=precision, preferred_element_type=acc_dtype)
  if direct:
    return acc.astype(problem.out_dtype)
  out = apply_epilogue(acc, problem.epilogue, c, bias)
  return out.astype(problem.out_dtype)


def _xla_fp8(a, b, c, bias, problem, a_scale, b_scale):
  """Scaled or mixed fp8, explicitly: per-tensor scales with a bfloat16
  output and no epilogue take `_dequantized_dot`; other per-tensor and
  row/column scales multiply XLA's f32-accumulated fp8 product; block-wise
  scales dequantize the operands to float32 first (an exact f32 GEMM of
  the dequantized values: correct everywhere, not fast). Mixed e4m3 x e5m2
  operands are widened to bfloat16, which holds every value of both
  exactly."""
  a_mode, b_mode = problem.a_scale_mode, problem.b_scale_mode
  dims = (((1 if problem.transpose_a else 2,),
           (2 if problem.transpose_b else 1,)), ((0,), (0,)))
  if (a_mode in ("none", "tensor") and b_mode in ("none", "tensor")
      and a.dtype == b.dtype and problem.epilogue.is_identity
      and problem.out_dtype == "bfloat16"):
    return _dequantized_dot(a, a_scale if a_mode == "tensor" else None,
                            b, b_scale if b_mode == "tensor" else None,
                            problem.batch, dims)
  if "block" in (a_mode, b_mode):
    a32 = fp8.dequantize_operand(a, a_scale, a_mode, operand="a",
                                 transposed=problem.transpose_a)
    b32 = fp8.dequantize_operand(b, b_scale, b_mode, operand="b",
                                 transposed=problem.transpose_b)
    acc = jax.lax.dot_general(a32, b32, dims,
                              precision=jax.lax.Precision.HIGHEST,
                              preferred_element_type=jnp.float32)
  else:
    if a.dtype != b.dtype:
      a, b = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)
    acc = jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)
    factor = fp8.output_scale(a_scale, a_mode, b_scale, b_mode)
    if factor is not None:
      acc = acc * factor
  out = apply_epilogue(acc, problem.epilogue, c, bias)
  return out.astype(problem.out_dtype)


def _dequantized_dot(a, a_scale, b, b_scale, batch, dims):
  """Per-tensor scales, bfloat16 out: each operand widened to bfloat16
  (exact for e4m3 and e5m2) and multiplied by its scale, then one dot.

  XLA's GEMM rewriter turns this form into a single cuBLASLt fp8 GEMM that
  applies the scales inside it; "the fp8 dot into f32, then the scales"
  costs a second pass over the output, and for B stored (k, n) a slower
  GEMM as well (experiments/lab/fp8_xla_scaled_forms.py; notes in
  experiments/results/nvidia_h100/fp8_nn/NOTES.md). The scales are rounded
  to bfloat16 on the way: a relative change of at most 2^-9 each, about one
  rounding of the bfloat16 output and far under fp8's own quantization
  step.
  """
  def widen(x, scale):
    x = x.astype(jnp.bfloat16)
    if scale is None:
      return x
    return x * scale.astype(jnp.bfloat16)[:, None, None]

  a_wide, b_wide = widen(a, a_scale), widen(b, b_scale)
  if batch == 1:  # the 2-D dot the rewriter was measured on: no batch axis
    contract = tuple(tuple(d - 1 for d in side) for side in dims[0])
    return jax.lax.dot_general(a_wide[0], b_wide[0], (contract, ((), ())),
                               preferred_element_type=jnp.bfloat16)[None]
  return jax.lax.dot_general(a_wide, b_wide, dims,
                             preferred_element_type=jnp.bfloat16)


registry.register(registry.KernelEntry(
    name="xla",
    fn=xla_matmul,
    supports=lambda problem, device: None,
    heuristic=lambda problem, device: None,
    runs_on_cpu=True,
    takes_scales=True,
    description="XLA's dot_general (cuBLAS on CUDA); the universal fallback",
))
