"""`xla`: XLA's own dot, the last entry of every fallback order.

It is also the baseline every benchmark compares against: the same
computation `jnp.dot` would run (cuBLAS/cuBLASLt on a GPU), with the epilogue
left to XLA's fusion.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_gemm import registry
from pallas_gemm.problem import apply_epilogue

_XLA_PRECISION = {
    "ieee": jax.lax.Precision.HIGHEST,
    "tf32": jax.lax.Precision.DEFAULT,
    "default": jax.lax.Precision.DEFAULT,
}


def xla_matmul(a, b, c, bias, *, problem, config=None, interpret=False):
  del config, interpret
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


registry.register(registry.KernelEntry(
    name="xla",
    fn=xla_matmul,
    supports=lambda problem, device: None,
    heuristic=lambda problem, device: None,
    runs_on_cpu=True,
    description="XLA's dot_general (cuBLAS on CUDA); the universal fallback",
))
