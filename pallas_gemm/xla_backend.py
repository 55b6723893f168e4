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
  """Scaled or mixed fp8, explicitly: per-tensor/row/column scales multiply
  XLA's f32-accumulated fp8 product; block-wise scales dequantize the
  operands to float32 first (an exact f32 GEMM of the dequantized values:
  correct everywhere, not fast). Mixed e4m3 x e5m2 operands are widened to
  bfloat16, which holds every value of both exactly."""
  a_mode, b_mode = problem.a_scale_mode, problem.b_scale_mode
  dims = (((1 if problem.transpose_a else 2,),
           (2 if problem.transpose_b else 1,)), ((0,), (0,)))
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


registry.register(registry.KernelEntry(
    name="xla",
    fn=xla_matmul,
    supports=lambda problem, device: None,
    heuristic=lambda problem, device: None,
    runs_on_cpu=True,
    takes_scales=True,
    description="XLA's dot_general (cuBLAS on CUDA); the universal fallback",
))
