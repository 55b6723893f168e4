"""Regression tests for the defects a hostile-user pass found (issue #17):
each failed before its fix. Where jnp.matmul has a behaviour, it is the
reference."""

from __future__ import annotations

import threading
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import pallas_gemm
from pallas_gemm import numerics, registry
from pallas_gemm.problem import GemmProblem

warnings.filterwarnings("ignore", category=DeprecationWarning,
                        message=".*[Tt]riton.*")


def _operands(shape_a, shape_b, dtype=jnp.float32):
  ka, kb = jax.random.split(numerics.fresh_key())
  return (numerics.random_normal(ka, shape_a, dtype),
          numerics.random_normal(kb, shape_b, dtype))


def test_disable_jit_runs_instead_of_recursing():
  a, b = _operands((8, 16), (16, 4))
  with jax.disable_jit():
    out = pallas_gemm.matmul(a, b)
  np.testing.assert_allclose(out, numerics.reference_matmul(a, b), rtol=5e-3,
                             atol=5e-3)


@pytest.mark.parametrize("axes", [(0, None), (0, 0)])
def test_vmap_over_an_empty_axis(axes):
  a = jnp.ones((0, 24, 32))
  b = jnp.ones((32, 16)) if axes[1] is None else jnp.ones((0, 32, 16))
  out = jax.vmap(pallas_gemm.matmul, axes)(a, b)
  assert out.shape == jax.vmap(jnp.matmul, axes)(a, b).shape == (0, 24, 16)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("precision, error", [
    ("bogus", ValueError), (5, TypeError), (object(), TypeError)])
def test_bad_precision_names_the_argument(dtype, precision, error):
  a, b = _operands((8, 16), (16, 4), dtype)
  with pytest.raises(error, match="precision"):
    pallas_gemm.matmul(a, b, precision=precision)


@pytest.mark.parametrize("name, value", [
    ("alpha", 1 + 2j), ("alpha", True), ("beta", np.bool_(False)),
    ("alpha", jnp.ones(()) * 2 + 0j)])
def test_alpha_and_beta_must_be_real_floats(name, value):
  a, b = _operands((8, 16), (16, 4))
  with pytest.raises(TypeError, match=name):
    pallas_gemm.matmul(a, b, c=jnp.ones((8, 4)), **{name: value})


def test_weak_typed_f32_does_not_widen_bf16():
  vector = jnp.broadcast_to(1.0, (16,))  # weakly typed, as from a scalar
  weight = _operands((16, 4), (4, 4), jnp.bfloat16)[0]
  expected = jnp.matmul(vector, weight)
  out = pallas_gemm.matmul(vector, weight)
  assert out.dtype == expected.dtype == jnp.bfloat16


def test_checkify_sees_nan_made_by_the_kernel():
  a = jnp.full((8, 16), jnp.inf)
  b = jnp.zeros((16, 4))
  err, _ = checkify.checkify(jax.jit(pallas_gemm.matmul),
                             errors=checkify.nan_checks)(a, b)
  assert "pallas_gemm" in str(err.get())


def test_activation_of_the_wrong_type_names_the_argument():
  a, b = _operands((8, 16), (16, 4))
  with pytest.raises(TypeError, match="activation"):
    pallas_gemm.matmul(a, b, activation=["relu"])


def test_past_int32_indexing_runs_on_xla_or_says_why():
  big = jax.ShapeDtypeStruct((2**31 // 16 + 1, 16), jnp.bfloat16)
  small = jax.ShapeDtypeStruct((16, 16), jnp.bfloat16)
  jaxpr = jax.make_jaxpr(pallas_gemm.matmul)(big, small)
  kernels = [e.params["kernel"] for e in jaxpr.eqns if "kernel" in e.params]
  assert kernels == ["xla"]
  with pytest.raises(ValueError, match="int32"):
    jax.make_jaxpr(lambda x, y: pallas_gemm.matmul(
        x, y, kernel="triton/06_tuned"))(big, small)
  problem = GemmProblem(1, 2**20, 2**12, 2**12, "bfloat16", "bfloat16")
  assert "int32" in registry.int32_overflow(problem)


def test_dot_algorithm_presets_map_or_refuse():
  a, b = _operands((8, 16), (16, 4))
  preset = jax.lax.DotAlgorithmPreset
  exact = pallas_gemm.matmul(a, b, precision=preset.F32_F32_F32)
  np.testing.assert_allclose(exact, numerics.reference_matmul(a, b),
                             rtol=1e-5, atol=1e-5)
  assert pallas_gemm.matmul(a, b, precision=preset.TF32_TF32_F32).shape == (
      8, 4)
  with pytest.raises(ValueError, match="BF16_BF16_BF16"):
    pallas_gemm.matmul(a, b, precision=preset.BF16_BF16_BF16)
  a16, b16 = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)
  assert pallas_gemm.matmul(a16, b16, precision=preset.BF16_BF16_F32).dtype \
      == jnp.bfloat16


def test_f32_cotangent_keeps_its_precision():
  """bf16 inputs, f32 output: the gradients are as accurate as lax's."""
  a, b = _operands((64, 96), (96, 48), jnp.bfloat16)
  w = numerics.random_normal(numerics.fresh_key(), (64, 48), jnp.float32)

  def grads(dot):
    return jax.grad(lambda a, b: jnp.sum(dot(a, b) * w), argnums=(0, 1))(a, b)

  ours = grads(lambda a, b: pallas_gemm.matmul(
      a, b, preferred_element_type=jnp.float32))
  theirs = grads(lambda a, b: jnp.dot(a, b,
                                      preferred_element_type=jnp.float32))
  a64, b64, w64 = (np.asarray(x, np.float64) for x in (a, b, w))
  for mine, lax_grad, ref in zip(ours, theirs, (w64 @ b64.T, a64.T @ w64)):
    assert numerics.relative_error(mine, ref) <= (
        numerics.relative_error(lax_grad, ref) * 1.01 + 1e-7)


def _in_threads(work, count=8):
  """Runs work(i) on `count` threads at once; re-raises what they raised."""
  errors = []

  def guarded(i):
    try:
      work(i)
    except Exception as e:  # noqa: BLE001 - collected for the assert
      errors.append(e)

  threads = [threading.Thread(target=guarded, args=(i,)) for i in range(count)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert not errors, errors


def test_concurrent_calls_from_threads_are_correct():
  """8 threads, each its own problem, on the default CPU path."""
  def work(seed):
    a, b = _operands((16 + seed, 24), (24, 8 + seed))
    out = jax.jit(pallas_gemm.matmul)(a, b)
    assert numerics.relative_error(out, numerics.reference_matmul(a, b)) < 5e-3

  _in_threads(work)


_X64_SCRIPT = """
import jax, jax.numpy as jnp
import pallas_gemm
from pallas_gemm import numerics
assert jax.config.jax_enable_x64
for kernel, dtype, tol in (("mosaic/ws_persistent", jnp.bfloat16, 2e-2),
                           ("mosaic/ws_persistent", jnp.float32, 5e-3),
                           ("mosaic/small_m", jnp.bfloat16, 2e-2),
                           ("triton/06_tuned", jnp.float32, 5e-3),
                           (None, jnp.float32, 5e-3)):
  ka, kb = jax.random.split(jax.random.key(0))
  a = numerics.random_normal(ka, (37, 45), dtype)
  b = numerics.random_normal(kb, (45, 71), dtype)
  out = pallas_gemm.matmul(a, b, kernel=kernel)
  err = numerics.relative_error(out, numerics.reference_matmul(a, b))
  assert err < tol, (kernel, dtype, err)
print("x64 ok")
"""


def test_x64_mode_every_backend():
  """JAX_ENABLE_X64=1 set before jax starts, as users set it."""
  import os
  import subprocess
  import sys
  env = dict(os.environ, JAX_ENABLE_X64="1", JAX_PLATFORMS="cpu")
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
  result = subprocess.run([sys.executable, "-c", _X64_SCRIPT], env=env,
                          capture_output=True, text=True, timeout=600)
  assert result.returncode == 0 and "x64 ok" in result.stdout, (
      result.stdout[-2000:] + result.stderr[-4000:])


@pytest.mark.parametrize("field, value", [
    ("tile_m", 128.0), ("tile_n", "64"), ("grid_band", True),
    ("max_concurrent_steps", 2.5)])
def test_mosaic_config_fields_are_ints(field, value):
  from pallas_gemm.mosaic_backend.config import MosaicConfig, SmallMConfig
  with pytest.raises(TypeError, match=field):
    MosaicConfig(**{field: value})
  if field in ("tile_n", "max_concurrent_steps"):
    with pytest.raises(TypeError, match=field):
      SmallMConfig(**{field: value})
