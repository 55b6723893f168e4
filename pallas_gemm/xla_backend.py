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
  contract_a = 1 if problem.transpose_a else 2
  contract_b = 2 if problem.transpose_b else 1
  acc = jax.lax.dot_general(
      a, b, (((contract_a,), (contract_b,)), ((0,), (0,))),
      precision=_XLA_PRECISION[problem.precision],
      preferred_element_type=jnp.float32)
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
