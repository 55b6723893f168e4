"""`precision=` as jnp.dot takes it, and gradients as accurate as lax's.

Every `jax.lax.DotAlgorithmPreset` (or its name) either maps onto what a
kernel computes or raises naming it; none is ignored.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_gemm
from pallas_gemm import numerics

PRESET = jax.lax.DotAlgorithmPreset
KERNEL = "triton/02_k_loop"


_RNG = np.random.default_rng(0)


def rand(shape, dtype=jnp.float32):
  # NumPy's generator: jax.random compiles anew for every shape, which
  # costs more than the tiny GEMMs tested here.
  return jnp.asarray(_RNG.standard_normal(shape, np.float32), dtype)


def f64(x):
  return np.asarray(x, np.float64)


def product_in(a, b, dtype):
  """The float64 product of the operands rounded to `dtype` first."""
  return f64(a.astype(dtype)) @ f64(b.astype(dtype))


@pytest.mark.parametrize("preset", [PRESET.F32_F32_F32, "F32_F32_F32",
                                    PRESET.TF32_TF32_F32_X3,
                                    PRESET.BF16_BF16_F32_X3,
                                    PRESET.BF16_BF16_F32_X6,
                                    PRESET.BF16_BF16_F32_X9])
def test_float32_accurate_presets_are_exact(preset):
  a, b = rand((16, 32)), rand((32, 8))
  out = pallas_gemm.matmul(a, b, precision=preset, kernel=KERNEL)
  assert numerics.relative_error(out, f64(a) @ f64(b)) <= 1e-6


@pytest.mark.parametrize("preset, dtype", [
    (PRESET.BF16_BF16_F32, jnp.bfloat16), ("BF16_BF16_F32", jnp.bfloat16),
    (PRESET.F16_F16_F32, jnp.float16)])
def test_16_bit_presets_multiply_in_16_bits(preset, dtype):
  """float32 operands: products of the 16-bit roundings, a float32 output."""
  a, b = rand((16, 32)), rand((32, 8))
  out = pallas_gemm.matmul(a, b, precision=preset, kernel=KERNEL)
  assert out.dtype == jnp.float32
  assert numerics.relative_error(out, product_in(a, b, dtype)) <= 1e-6
  # Not the float32 product: the preset is applied, not ignored.
  assert numerics.relative_error(out, f64(a) @ f64(b)) > 1e-4
  jaxpr = jax.make_jaxpr(lambda x, y: pallas_gemm.matmul(
      x, y, precision=preset))(a, b)
  gemm = [e for e in jaxpr.eqns if e.primitive.name == "pallas_gemm"][0]
  assert gemm.invars[0].aval.dtype == dtype


def test_f16_preset_on_bf16_operands_reads_them_as_f16():
  a, b = rand((8, 16), jnp.bfloat16), rand((16, 4), jnp.bfloat16)
  out = pallas_gemm.matmul(a, b, precision=PRESET.F16_F16_F32,
                           preferred_element_type=jnp.float32, kernel=KERNEL)
  assert numerics.relative_error(out, product_in(a, b, jnp.float16)) <= 1e-6


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("preset", [PRESET.F32_F32_F32, PRESET.TF32_TF32_F32,
                                    PRESET.DEFAULT, "highest", "bfloat16",
                                    "tensorfloat32", "high", "default"])
def test_presets_reading_float32_keep_16_bit_operands_exact(preset, dtype):
  a, b = rand((8, 16), dtype), rand((16, 4), dtype)
  out = pallas_gemm.matmul(a, b, precision=preset,
                           preferred_element_type=jnp.float32, kernel=KERNEL)
  assert numerics.relative_error(out, f64(a) @ f64(b)) <= 1e-6


@pytest.mark.parametrize("preset, dtype, match", [
    (PRESET.BF16_BF16_BF16, jnp.bfloat16, "accumulates in 16 bits"),
    (PRESET.F16_F16_F16, jnp.float32, "accumulates in 16 bits"),
    (PRESET.ANY_F8_ANY_F8_F32, jnp.bfloat16, "needs float8"),
    ("ANY_F8_ANY_F8_F32_FAST_ACCUM", jnp.float32, "needs float8"),
    (PRESET.F64_F64_F64, jnp.float32, "needs float64"),
])
def test_presets_no_kernel_honours_raise(preset, dtype, match):
  a, b = rand((8, 16), dtype), rand((16, 4), dtype)
  with pytest.raises(ValueError, match=match):
    pallas_gemm.matmul(a, b, precision=preset)
  with pytest.raises(ValueError, match=match):
    pallas_gemm.dot_general(a, b, (((1,), (0,)), ((), ())), precision=preset)


def test_dot_algorithm_objects_are_refused_by_name():
  algorithm = jax.lax.DotAlgorithm(jnp.float32, jnp.float32, jnp.float32)
  with pytest.raises(TypeError, match="DotAlgorithmPreset"):
    pallas_gemm.matmul(rand((8, 16)), rand((16, 4)), precision=algorithm)


def test_default_matmul_precision_preset_applies():
  a, b = rand((16, 32)), rand((32, 8))
  with jax.default_matmul_precision("BF16_BF16_F32"):
    out = pallas_gemm.matmul(a, b, kernel=KERNEL)
  assert numerics.relative_error(out, product_in(a, b, jnp.bfloat16)) <= 1e-6


def test_dot_general_takes_presets():
  lhs, rhs = rand((2, 8, 16)), rand((16, 4))
  dims = (((2,), (0,)), ((), ()))
  out = pallas_gemm.dot_general(lhs, rhs, dims, precision="BF16_BF16_F32")
  expected = np.einsum("btk,kn->btn", f64(lhs.astype(jnp.bfloat16)),
                       f64(rhs.astype(jnp.bfloat16)))
  assert out.dtype == jnp.float32
  assert numerics.relative_error(out, expected) <= 1e-6


@pytest.mark.parametrize("dims, lhs_shape, rhs_shape", [
    ((((1,), (0,)), ((), ())), (32, 48), (48, 24)),
    ((((0,), (2,)), ((1,), (1,))), (48, 2, 16), (24, 2, 48)),
])
def test_bf16_grads_with_f32_cotangents_no_worse_than_lax(dims, lhs_shape,
                                                          rhs_shape):
  """bf16 inputs, preferred_element_type=float32: the f32 cotangent stays
  f32 into the backward GEMMs, so the gradient error against float64 is no
  larger than lax's."""
  lhs, rhs = rand(lhs_shape, jnp.bfloat16), rand(rhs_shape, jnp.bfloat16)
  out_shape = jax.eval_shape(lambda a, b: jax.lax.dot_general(a, b, dims),
                             lhs, rhs).shape
  w = rand(out_shape)

  def grads(dot_general):
    loss = lambda a, b: jnp.sum(dot_general(
        a, b, dims, preferred_element_type=jnp.float32) * w)
    return jax.grad(loss, (0, 1))(lhs, rhs)

  ours = grads(pallas_gemm.dot_general)
  theirs = grads(jax.lax.dot_general)
  with jax.enable_x64():
    exact = jax.grad(lambda a, b: jnp.sum(jax.lax.dot_general(
        a, b, dims, precision="highest") * f64(w)), (0, 1))(
            f64(lhs), f64(rhs))
  for mine, lax_grad, ref in zip(ours, theirs, exact):
    assert mine.dtype == lax_grad.dtype == jnp.bfloat16
    assert numerics.relative_error(mine, ref) <= (
        numerics.relative_error(lax_grad, ref) * 1.01 + 1e-7)
