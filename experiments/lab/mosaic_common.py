"""Helpers of `mosaic_sweep.py`: problems, the CUPTI timing call, the jnp.dot
baseline and error text for its JSON lines."""

from __future__ import annotations

import statistics
import traceback

import jax
import jax.numpy as jnp

from pallas_gemm import timing
from pallas_gemm.problem import Epilogue, GemmProblem


def short_error(e: BaseException) -> str:
  text = "".join(traceback.format_exception_only(type(e), e)).strip()
  return text[-1500:]


def problem_for(m, n, k, dtype="bfloat16", layout="NN", batch=1,
                epilogue=Epilogue(), out_dtype=None, c_dtype=None):
  return GemmProblem(
      batch=batch, m=m, n=n, k=k, in_dtype=dtype, out_dtype=out_dtype or dtype,
      transpose_a=layout[0] == "T", transpose_b=layout[1] == "T",
      precision="tf32" if dtype == "float32" else "default",
      epilogue=epilogue, c_dtype=c_dtype)


def time_fn(fn, *args, iters):
  out, runtimes = timing.cupti_samples_ms(fn, args, iterations=iters)
  jax.block_until_ready(out)
  return out, statistics.median(runtimes)


def jnp_dot_fn(problem: GemmProblem):
  def f(a, b, c, bias):
    del c, bias
    a2 = jnp.swapaxes(a, 1, 2) if problem.transpose_a else a
    b2 = jnp.swapaxes(b, 1, 2) if problem.transpose_b else b
    # Like benchmark.py's baseline: 16-bit inputs give a 16-bit output
    # straight from cuBLAS. Asking for an f32 result and casting it would
    # time a slower f32-output GEMM plus a convert kernel.
    return jnp.matmul(a2, b2).astype(problem.out_dtype)
  return jax.jit(f)
