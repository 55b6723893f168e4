"""Which way of writing a per-tensor scaled fp8 product does XLA run fastest?

`xla`'s fallback for per-tensor scales (`pallas_gemm/xla_backend.py`) is
written "fp8 dot into f32, then times the scales". XLA's GEMM rewriter also
knows a second form, "widen each fp8 operand and multiply it by its scalar
scale, then dot", and turns that into a single cuBLASLt fp8 call with the
scales applied inside the GEMM. This probe times both, per layout and shape,
next to the unscaled fp8 dot. It checks each against float64 and reports
whether XLA's compiled program calls cuBLASLt's fp8 GEMM
(`__cublas$lt$matmul$f8`). Usage (repository root on PYTHONPATH):

  python experiments/lab/fp8_xla_scaled_forms.py [--shapes 16x4096x4096,...]
      [--layouts NT,NN] [--iters 20]

Off a GPU it runs the same checks at one small shape (no cuBLASLt there).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from pallas_gemm import timing
from pallas_gemm.numerics import relative_error, tolerance
from pallas_gemm.problem import GemmProblem

E4M3 = jnp.float8_e4m3fn
ON_GPU = jax.default_backend() == "gpu"
DEFAULT_SHAPES = ("1x8192x8192", "16x4096x4096", "128x14336x4096",
                  "512x8192x8192", "2048x2048x2048", "4096x4096x4096",
                  "8192x8192x8192")


def _dims(transpose_b: bool):
  return (((1,), (1 if transpose_b else 0,)), ((), ()))


def product_then_scale(a, b, sa, sb, transpose_b):
  """`xla_backend`'s form: the fp8 dot into f32, then the scales."""
  acc = jax.lax.dot_general(a, b, _dims(transpose_b),
                            preferred_element_type=jnp.float32)
  return (acc * (sa * sb)).astype(jnp.bfloat16)


def scale_then_product(wide):
  """XLA's fp8 pattern: each operand widened and scaled, then the dot."""
  def form(a, b, sa, sb, transpose_b):
    a_wide = a.astype(wide) * sa.astype(wide)
    b_wide = b.astype(wide) * sb.astype(wide)
    return jax.lax.dot_general(a_wide, b_wide, _dims(transpose_b),
                               preferred_element_type=jnp.bfloat16)
  return form


def unscaled(a, b, sa, sb, transpose_b):
  del sa, sb
  return jax.lax.dot_general(a, b, _dims(transpose_b),
                             preferred_element_type=jnp.bfloat16)


FORMS = {
    "unscaled dot (jnp.dot)": unscaled,
    "dot, then scales": product_then_scale,
    "scale f32, then dot": scale_then_product(jnp.float32),
    "scale bf16, then dot": scale_then_product(jnp.bfloat16),
}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--shapes", default=",".join(DEFAULT_SHAPES))
  parser.add_argument("--layouts", default="NT,NN")
  parser.add_argument("--iters", type=int, default=20)
  args = parser.parse_args()
  shapes = [tuple(int(v) for v in s.split("x"))
            for s in args.shapes.split(",")] if ON_GPU else [(24, 48, 64)]
  sa, sb = jnp.float32(2.0), jnp.float32(0.5)
  budget = tolerance("float8_e4m3fn", "default", "bfloat16")
  print(f"{jax.devices()[0].device_kind}; relative error budget {budget}")
  for m, n, k in shapes:
    for layout in args.layouts.split(","):
      transpose_b = layout == "NT"
      problem = GemmProblem(1, m, n, k, "float8_e4m3fn", "bfloat16",
                            transpose_b=transpose_b)
      sets = []
      for seed in range(timing.operand_set_count(problem, ON_GPU)):
        a, b, _, _ = timing.random_operands(problem, seed=seed)
        sets.append((a[0], b[0]))
      a, b = sets[0]
      ref = np.asarray(a, np.float64) @ (
          np.asarray(b, np.float64).T if transpose_b
          else np.asarray(b, np.float64))
      for name, form in FORMS.items():
        call = jax.jit(lambda x, y, f=form: f(x, y, sa, sb, transpose_b))
        hlo = call.lower(a, b).compile().as_text()
        fp8_gemm = "cublas$lt$matmul$f8" in hlo
        # The scales multiply to 1: every form has the same reference.
        error = relative_error(np.asarray(call(a, b), np.float64), ref)
        us = 1e3 * timing.time_over_sets(call, sets, iterations=args.iters,
                                         on_gpu=ON_GPU)
        print(f"{m}x{n}x{k} {layout} {name:24s} {us:9.1f} us "
              f"{2 * m * n * k / us / 1e6:7.1f} TFLOP/s  cuBLASLt fp8 "
              f"{'yes' if fp8_gemm else 'no '}  err {error:.1e}"
              f"{'' if error <= budget else '  WRONG'}", flush=True)


if __name__ == "__main__":
  main()
