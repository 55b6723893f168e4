"""Property-based tests: random problems of every kind against float64.

Hypothesis draws the shapes (0, 1, primes, 2^n +- 1), dtypes, layouts,
epilogues, batch broadcasting and the transformation (none, jit, vmap,
grad), and compares `pallas_gemm.matmul` with a float64 NumPy reference
within the tolerances of `pallas_gemm.numerics`.

Profiles (select with HYPOTHESIS_PROFILE): "ci" (the default: a fixed,
derandomized set that runs in a few minutes on two cores), "x64" (fewer,
for CI's second pass under jax_enable_x64) and "gpu" (more examples, for
the GPU script).
"""

from __future__ import annotations

import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings, strategies as st  # noqa: E402

import pallas_gemm  # noqa: E402
from pallas_gemm import numerics  # noqa: E402
from pallas_gemm.problem import Epilogue  # noqa: E402

warnings.filterwarnings("ignore", category=DeprecationWarning,
                        message=".*[Tt]riton.*")

settings.register_profile("ci", max_examples=20, deadline=None,
                          derandomize=True, print_blob=True)
#: CI's second pass (jax_enable_x64): a check that x64 mode changes no
#: result, over fewer examples than the main pass searches.
settings.register_profile("x64", max_examples=10, deadline=None,
                          derandomize=True, print_blob=True)
settings.register_profile("gpu", max_examples=60, deadline=None,
                          derandomize=True, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
#: vmap and grad run three products (or a product and its two cotangents)
#: per example: two thirds of the profile's examples keep their share of
#: the suite's time near the plain test's.
FEWER = settings(max_examples=max(1, settings.default.max_examples * 2 // 3))

SIZES = st.sampled_from([0, 1, 2, 3, 5, 7, 8, 13, 15, 17, 31, 33, 63, 65])
DTYPES = st.sampled_from(["float32", "bfloat16", "float16"])
BATCHES = st.sampled_from([(), (2,), (1, 3)])


def _tolerance(dtype, out_dtype):
  precision = "tf32" if dtype == "float32" else "default"
  return numerics.tolerance(dtype, precision, out_dtype)


def _close(out, ref, tol):
  out = np.asarray(jnp.asarray(out).astype(jnp.float32), np.float64)
  assert out.shape == ref.shape
  assert np.all(np.isfinite(out))
  if ref.size == 0 or not np.any(ref):
    np.testing.assert_allclose(out, ref, atol=tol)
    return
  assert numerics.relative_error(out, ref) <= tol


@st.composite
def problems(draw):
  m, n, k = draw(SIZES), draw(SIZES), draw(SIZES)
  batch = draw(BATCHES)
  shared_b = draw(st.booleans())
  ta, tb = draw(st.booleans()), draw(st.booleans())
  dtype = draw(DTYPES)
  a_shape = batch + ((k, m) if ta else (m, k))
  b_shape = (() if shared_b else batch) + ((n, k) if tb else (k, n))
  epilogue = draw(st.sampled_from(["none", "alpha", "bias_relu", "c_gelu"]))
  return dict(a_shape=a_shape, b_shape=b_shape, ta=ta, tb=tb, dtype=dtype,
              epilogue=epilogue, seed=draw(st.integers(0, 2**16)))


def _inputs(p):
  keys = jax.random.split(jax.random.key(p["seed"]), 4)
  a = numerics.random_normal(keys[0], p["a_shape"], p["dtype"])
  b = numerics.random_normal(keys[1], p["b_shape"], p["dtype"])
  return a, b, keys


def _kwargs(p, out_shape, keys):
  kwargs = dict(transpose_a=p["ta"], transpose_b=p["tb"])
  epilogue = Epilogue()
  if p["epilogue"] == "alpha":
    kwargs["alpha"] = -0.75
    epilogue = Epilogue(alpha=-0.75)
  elif p["epilogue"] == "bias_relu":
    kwargs["bias"] = numerics.random_normal(keys[2], out_shape[-1:],
                                            jnp.float32)
    kwargs["activation"] = "relu"
    epilogue = Epilogue(has_bias=True, activation="relu")
  elif p["epilogue"] == "c_gelu":
    kwargs["c"] = numerics.random_normal(keys[3], out_shape, jnp.float32)
    kwargs.update(beta=0.5, activation="gelu")
    epilogue = Epilogue(beta=0.5, has_c=True, activation="gelu")
  return kwargs, epilogue


def _reference(a, b, p, kwargs, epilogue):
  return numerics.reference_matmul(
      a, b, transpose_a=p["ta"], transpose_b=p["tb"], epilogue=epilogue,
      c=kwargs.get("c"), bias=kwargs.get("bias"))


@given(problems(), st.sampled_from(["eager", "jit"]))
def test_matmul_matches_float64(p, mode):
  a, b, keys = _inputs(p)
  m = p["a_shape"][-1] if p["ta"] else p["a_shape"][-2]
  n = p["b_shape"][-2] if p["tb"] else p["b_shape"][-1]
  batch = np.broadcast_shapes(p["a_shape"][:-2], p["b_shape"][:-2])
  out_shape = tuple(batch) + (m, n)
  kwargs, epilogue = _kwargs(p, out_shape, keys)
  fn = lambda a, b: pallas_gemm.matmul(a, b, **kwargs)  # noqa: E731
  out = (jax.jit(fn) if mode == "jit" else fn)(a, b)
  assert out.dtype == jnp.dtype(p["dtype"])
  _close(out, _reference(a, b, p, kwargs, epilogue),
         _tolerance(p["dtype"], p["dtype"]))


@FEWER
@given(problems())
def test_vmap_matches_a_loop(p):
  a, b, keys = _inputs(p)
  stacked_a = jnp.stack([a, -a, 2 * a])
  fn = lambda a: pallas_gemm.matmul(a, b, transpose_a=p["ta"],  # noqa: E731
                                    transpose_b=p["tb"])
  out = jax.vmap(fn)(stacked_a)
  assert out.shape[0] == 3
  for i in range(3):
    _close(out[i], numerics.reference_matmul(
        stacked_a[i], b, transpose_a=p["ta"], transpose_b=p["tb"]),
        _tolerance(p["dtype"], p["dtype"]))


@FEWER
@given(problems())
def test_grad_matches_float64(p):
  a, b, keys = _inputs(p)
  a, b = a.astype(jnp.float32), b.astype(jnp.float32)
  out = pallas_gemm.matmul(a, b, transpose_a=p["ta"], transpose_b=p["tb"])
  w = numerics.random_normal(keys[2], out.shape, jnp.float32)

  def loss(a, b):
    return jnp.sum(pallas_gemm.matmul(a, b, transpose_a=p["ta"],
                                      transpose_b=p["tb"],
                                      precision="highest") * w)
  da, db = jax.grad(loss, argnums=(0, 1))(a, b)
  a64, b64, w64 = (np.asarray(x, np.float64) for x in (a, b, w))
  op_a = np.swapaxes(a64, -1, -2) if p["ta"] else a64
  op_b = np.swapaxes(b64, -1, -2) if p["tb"] else b64
  d_op_a = w64 @ np.swapaxes(op_b, -1, -2)
  d_op_b = np.swapaxes(op_a, -1, -2) @ w64
  ref_da = np.swapaxes(d_op_a, -1, -2) if p["ta"] else d_op_a
  ref_db = np.swapaxes(d_op_b, -1, -2) if p["tb"] else d_op_b
  # b shared across the batch accumulates every batch entry's gradient.
  if len(p["b_shape"]) == 2 and ref_db.ndim > 2:
    ref_db = ref_db.sum(axis=tuple(range(ref_db.ndim - 2)))
  _close(da, ref_da, 1e-4)
  _close(db, ref_db, 1e-4)
