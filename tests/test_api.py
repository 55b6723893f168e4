"""The public API and the primitive's rules: jit, vmap, grad, jaxpr, errors.

These run the Pallas kernel `triton/02_k_loop` explicitly (interpret mode on a
CPU), so every transformation is checked on a real kernel, not on XLA.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_gemm
from kernel_test_base import make_operands
from pallas_gemm import numerics
from pallas_gemm.problem import Epilogue

KERNEL = "triton/02_k_loop"
HI = jax.lax.Precision.HIGHEST


def mm(a, b, **kw):
  kw.setdefault("kernel", KERNEL)
  kw.setdefault("precision", HI)
  return pallas_gemm.matmul(a, b, **kw)


def rand(shape, dtype=jnp.float32):
  return numerics.random_normal(numerics.fresh_key(), shape, dtype)


def ref_f64(a, b):
  return np.matmul(np.asarray(a, np.float64), np.asarray(b, np.float64))


def assert_close(out, ref, tol=1e-5):
  err = numerics.relative_error(out, ref)
  assert err <= tol, f"relative error {err:.3g} > {tol:.3g}"


# ------------------------------------------------------------------ jaxpr ---


def test_make_jaxpr_shows_one_primitive_equation():
  a, b = rand((16, 24)), rand((24, 8))
  jaxpr = jax.make_jaxpr(lambda a, b: mm(a, b))(a, b).jaxpr
  assert len(jaxpr.eqns) == 1
  (eqn,) = jaxpr.eqns
  assert eqn.primitive is pallas_gemm.pallas_gemm_p
  assert eqn.params["kernel"] == KERNEL
  assert isinstance(eqn.params["config"], pallas_gemm.TritonConfig)


def test_automatic_choice_is_recorded_in_params():
  a, b = rand((16, 24)), rand((24, 8))
  (eqn,) = jax.make_jaxpr(pallas_gemm.matmul)(a, b).jaxpr.eqns
  assert eqn.params["kernel"] in pallas_gemm.list_kernels()


def test_list_kernels_prefixes_backends():
  names = pallas_gemm.list_kernels()
  assert "xla" in names and KERNEL in names
  for name in names:
    assert name == "xla" or name.split("/")[0] in ("triton", "mosaic", "ffi")
  assert pallas_gemm.list_kernels("triton/*") == [
      n for n in names if n.startswith("triton/")]


def test_backends_import_cleanly():
  assert pallas_gemm.backend_errors() == {}


# ------------------------------------------------------------ shapes, jit ---


@pytest.mark.parametrize("shape", [(1, 1, 1), (1, 96, 80), (31, 29, 37),
                                   (97, 61, 131)])
def test_shapes_match_reference_and_jnp_dot(shape):
  m, n, k = shape
  a, b = rand((m, k)), rand((k, n))
  out = jax.jit(mm)(a, b)
  assert_close(out, ref_f64(a, b))
  np.testing.assert_allclose(out, jnp.dot(a, b, precision=HI), rtol=1e-4,
                             atol=1e-4)


def test_broadcast_batch_dims_like_jnp_matmul():
  a, b = rand((2, 1, 9, 13)), rand((3, 13, 7))
  out = mm(a, b)
  expected = jnp.matmul(a, b, precision=HI)
  assert out.shape == expected.shape == (2, 3, 9, 7)
  assert_close(out, ref_f64(a, b))


def test_shared_b_folds_batch_into_m():
  a, b = rand((4, 5, 13)), rand((13, 7))
  jaxpr = jax.make_jaxpr(lambda a, b: mm(a, b))(a, b).jaxpr
  (eqn,) = [e for e in jaxpr.eqns if e.primitive is pallas_gemm.pallas_gemm_p]
  assert eqn.invars[0].aval.shape == (20, 13)  # rows of A stacked, B shared
  assert_close(mm(a, b), ref_f64(a, b))


def test_vector_operands_like_jnp_matmul():
  a, b, v = rand((6, 5)), rand((5, 4)), rand((5,))
  assert mm(a, v).shape == (6,)
  assert mm(v, b).shape == (4,)
  assert mm(v, v).shape == ()
  assert_close(mm(a, v), ref_f64(a, v))
  assert_close(mm(v, b), ref_f64(v, b))


@pytest.mark.parametrize("layout", ["NT", "TN", "TT"])
def test_transposed_operands_are_not_materialised(layout):
  m, n, k = 19, 23, 29
  a, b = make_operands((m, n, k), "float32", layout=layout)
  ta, tb = layout[0] == "T", layout[1] == "T"
  f = lambda a, b: mm(a, b, transpose_a=ta, transpose_b=tb)
  jaxpr = jax.make_jaxpr(f)(a, b).jaxpr
  assert [e.primitive.name for e in jaxpr.eqns] == ["pallas_gemm"]
  a_op = a.T if ta else a
  b_op = b.T if tb else b
  assert_close(f(a, b), ref_f64(a_op, b_op))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_dtypes(dtype):
  a, b = rand((33, 40), dtype), rand((40, 27), dtype)
  out = mm(a, b, precision=None)
  assert out.dtype == jnp.dtype(dtype)
  assert_close(out, ref_f64(a.astype(jnp.float32), b.astype(jnp.float32)),
               tol=numerics.tolerance(dtype, "tf32" if dtype == "float32"
                                      else "default", dtype))


def test_mixed_dtypes_promote_like_jnp():
  a, b = rand((8, 16), jnp.bfloat16), rand((16, 8), jnp.float32)
  out = mm(a, b)
  assert out.dtype == jnp.matmul(a, b).dtype == jnp.float32


def test_preferred_element_type_sets_output_dtype():
  a, b = rand((8, 16), jnp.bfloat16), rand((16, 8), jnp.bfloat16)
  out = mm(a, b, preferred_element_type=jnp.float32)
  assert out.dtype == jnp.float32
  assert_close(out, ref_f64(a.astype(jnp.float32), b.astype(jnp.float32)),
               tol=1e-5)


# --------------------------------------------------------------- epilogue ---


@pytest.mark.parametrize("activation", [None, "relu", "gelu", "silu",
                                        "sigmoid", "tanh"])
def test_epilogue(activation):
  m, n, k = 21, 18, 35
  a, b, c, bias = rand((m, k)), rand((k, n)), rand((m, n)), rand((n,))
  out = mm(a, b, alpha=0.75, beta=-2.0, c=c, bias=bias, activation=activation)
  ref = numerics.reference_matmul(
      a, b, epilogue=Epilogue(0.75, -2.0, True, True, activation), c=c,
      bias=bias)
  assert_close(out, ref)


def test_identity_epilogue_adds_nothing():
  a, b = rand((8, 8)), rand((8, 8))
  (eqn,) = jax.make_jaxpr(lambda a, b: mm(a, b))(a, b).jaxpr.eqns
  assert eqn.params["epilogue"].is_identity
  assert len(eqn.invars) == 2


def test_c_broadcasts_and_beta_zero_drops_c():
  a, b, c_row = rand((6, 7)), rand((7, 5)), rand((1, 5))
  out = mm(a, b, c=c_row, beta=1.0)
  assert_close(out, ref_f64(a, b) + np.asarray(c_row, np.float64))
  jaxpr = jax.make_jaxpr(lambda a, b, c: mm(a, b, c=c, beta=0.0))(a, b, c_row)
  (eqn,) = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "pallas_gemm"]
  assert not eqn.params["epilogue"].has_c


# ------------------------------------------------------------------- vmap ---


def test_vmap_over_a_folds_into_m():
  a, b = rand((5, 9, 13)), rand((13, 7))
  f = jax.vmap(lambda a: mm(a, b))
  jaxpr = jax.make_jaxpr(f)(a).jaxpr
  eqns = [e for e in jaxpr.eqns if e.primitive.name == "pallas_gemm"]
  assert len(eqns) == 1 and eqns[0].invars[0].aval.shape == (45, 13)
  assert_close(f(a), ref_f64(a, b))


def test_vmap_over_both_uses_batch_axis():
  a, b = rand((4, 9, 13)), rand((4, 13, 7))
  f = jax.vmap(mm)
  eqns = [e for e in jax.make_jaxpr(f)(a, b).jaxpr.eqns
          if e.primitive.name == "pallas_gemm"]
  assert len(eqns) == 1 and eqns[0].invars[0].aval.shape == (4, 9, 13)
  assert_close(f(a, b), ref_f64(a, b))


def test_vmap_non_leading_axes_and_nested():
  a, b = rand((9, 3, 13)), rand((13, 2, 7))
  f = jax.vmap(jax.vmap(mm, in_axes=(None, 1)), in_axes=(1, None))
  out = f(a, b)
  expected = np.einsum("mvk,kwn->vwmn", np.asarray(a, np.float64),
                       np.asarray(b, np.float64))
  assert_close(out, expected)


def test_vmap_with_batched_bias_and_c():
  a, b = rand((3, 6, 10)), rand((10, 4))
  c, bias = rand((3, 6, 4)), rand((3, 4))
  f = jax.vmap(lambda a, c, bias: mm(a, b, c=c, beta=0.5, bias=bias,
                                     activation="relu"))
  out = f(a, c, bias)
  ref = np.maximum(ref_f64(a, b) + 0.5 * np.asarray(c, np.float64)
                   + np.asarray(bias, np.float64)[:, None, :], 0)
  assert_close(out, ref)


# ------------------------------------------------------------------- grad ---


def _loss(matmul_fn, **kw):
  def loss(a, b):
    return jnp.sum(jnp.sin(matmul_fn(a, b, **kw)))
  return loss


@pytest.mark.parametrize("layout", ["NN", "NT", "TN", "TT"])
def test_grad_matches_jnp_dot(layout):
  ta, tb = layout[0] == "T", layout[1] == "T"
  a, b = make_operands((11, 9, 14), "float32", layout=layout)

  def ref_mm(a, b):
    return jnp.matmul(a.T if ta else a, b.T if tb else b, precision=HI)

  got = jax.grad(_loss(mm, transpose_a=ta, transpose_b=tb), (0, 1))(a, b)
  want = jax.grad(_loss(ref_mm), (0, 1))(a, b)
  for g, w in zip(got, want):
    assert g.shape == w.shape
    assert_close(g, np.asarray(w, np.float64), tol=1e-5)


def test_backward_products_run_on_pallas_gemm():
  a, b = rand((8, 12)), rand((12, 6))
  jaxpr = jax.make_jaxpr(jax.grad(_loss(mm), (0, 1)))(a, b).jaxpr
  names = [e.primitive.name for e in jaxpr.eqns]
  assert names.count("pallas_gemm") == 3  # forward, dA, dB
  assert "dot_general" not in names


def test_grad_through_epilogue():
  a, b, c, bias = rand((7, 10)), rand((10, 5)), rand((7, 5)), rand((5,))

  def ours(a, b, c, bias):
    return jnp.sum(mm(a, b, alpha=1.5, beta=0.5, c=c, bias=bias,
                      activation="gelu") ** 2)

  def reference(a, b, c, bias):
    z = 1.5 * jnp.matmul(a, b, precision=HI) + 0.5 * c + bias
    return jnp.sum(jax.nn.gelu(z, approximate=True) ** 2)

  got = jax.grad(ours, (0, 1, 2, 3))(a, b, c, bias)
  want = jax.grad(reference, (0, 1, 2, 3))(a, b, c, bias)
  for g, w in zip(got, want):
    assert_close(g, np.asarray(w, np.float64), tol=1e-4)


def test_vmap_of_grad():
  a, b = rand((4, 6, 9)), rand((4, 9, 5))
  got = jax.vmap(jax.grad(_loss(mm), (0, 1)))(a, b)
  want = jax.vmap(jax.grad(_loss(lambda a, b: jnp.matmul(a, b, precision=HI)),
                           (0, 1)))(a, b)
  for g, w in zip(got, want):
    assert_close(g, np.asarray(w, np.float64), tol=1e-5)


def test_jvp_and_linearize():
  a, b, da, db = rand((5, 7)), rand((7, 3)), rand((5, 7)), rand((7, 3))
  out, tangent = jax.jvp(mm, (a, b), (da, db))
  expected = ref_f64(da, b) + ref_f64(a, db)
  assert_close(tangent, expected)
  assert_close(out, ref_f64(a, b))


def test_bf16_grad_dtypes():
  a, b = rand((8, 16), jnp.bfloat16), rand((16, 8), jnp.bfloat16)
  ga, gb = jax.grad(lambda a, b: jnp.sum(mm(a, b).astype(jnp.float32)),
                    (0, 1))(a, b)
  assert ga.dtype == gb.dtype == jnp.bfloat16


# --------------------------------------------------------- special values ---


@pytest.mark.parametrize("shape", [(0, 4, 3), (4, 0, 3), (4, 5, 0), (0, 0, 0)])
def test_zero_size_dims_match_jnp_matmul(shape):
  m, n, k = shape
  a, b = jnp.ones((m, k)), jnp.ones((k, n))
  out = mm(a, b)
  expected = jnp.matmul(a, b)
  assert out.shape == expected.shape and out.dtype == expected.dtype
  np.testing.assert_array_equal(out, expected)


def test_zero_k_with_epilogue_keeps_c_and_bias():
  c, bias = rand((3, 4)), rand((4,))
  out = mm(jnp.ones((3, 0)), jnp.ones((0, 4)), c=c, beta=2.0, bias=bias)
  np.testing.assert_allclose(out, 2.0 * c + bias, rtol=1e-6)


def test_nan_and_inf_propagate_like_jnp_dot():
  a, b = rand((8, 8)), rand((8, 8))
  a = a.at[2, 3].set(jnp.nan).at[5, 1].set(jnp.inf)
  out = np.asarray(mm(a, b))
  expected = np.asarray(jnp.dot(a, b, precision=HI))
  np.testing.assert_array_equal(np.isnan(out), np.isnan(expected))
  np.testing.assert_array_equal(np.isinf(out), np.isinf(expected))


# ----------------------------------------------------------------- errors ---


def test_contraction_mismatch_names_shapes():
  with pytest.raises(ValueError, match=r"a.shape=\(4, 5\).*b.shape=\(6, 3\)"):
    mm(jnp.ones((4, 5)), jnp.ones((6, 3)))


def test_batch_mismatch():
  with pytest.raises(ValueError, match="do not broadcast"):
    mm(jnp.ones((2, 4, 5)), jnp.ones((3, 5, 3)))


def test_scalar_operand():
  with pytest.raises(ValueError, match="rank >= 1"):
    mm(jnp.float32(1.0), jnp.ones((3,)))


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.bool_, jnp.complex64])
def test_unsupported_dtype_names_argument(dtype):
  with pytest.raises(TypeError, match="^b has dtype"):
    mm(jnp.ones((4, 4)), jnp.ones((4, 4), dtype))


def test_unknown_kernel():
  with pytest.raises(ValueError, match="kernel='nope/x' is not registered"):
    mm(jnp.ones((4, 4)), jnp.ones((4, 4)), kernel="nope/x")


def test_kernel_that_cannot_run_says_why():
  if "ffi/mma_sync" not in pallas_gemm.list_kernels():
    pytest.skip("ffi backend not registered")
  if jax.default_backend() == "gpu":
    pytest.skip("runs on a GPU")
  with pytest.raises(ValueError, match="needs a CUDA GPU"):
    mm(jnp.ones((4, 4)), jnp.ones((4, 4)), kernel="ffi/mma_sync")


def test_bad_config_type():
  with pytest.raises(TypeError, match="config for kernel='triton/02_k_loop'"):
    mm(jnp.ones((4, 4)), jnp.ones((4, 4)), config={"block_m": 64})


def test_bad_config_values():
  with pytest.raises(ValueError, match="block_m=48"):
    pallas_gemm.TritonConfig(block_m=48)


def test_bad_epilogue_arguments():
  a, b = jnp.ones((4, 5)), jnp.ones((5, 3))
  with pytest.raises(ValueError, match="activation='swish'"):
    mm(a, b, activation="swish")
  with pytest.raises(ValueError, match=r"bias.shape=\(4,\) must be \(3,\)"):
    mm(a, b, bias=jnp.ones((4,)))
  with pytest.raises(ValueError, match="c.shape=.*does not broadcast"):
    mm(a, b, c=jnp.ones((2, 3)), beta=1.0)
  with pytest.raises(ValueError, match="beta=1.0 scales c, but c is None"):
    mm(a, b, beta=1.0)


def test_c_without_beta_is_added_and_beta_zero_leaves_it_unread():
  """A `c` passed without beta is added (beta defaults to 1 with c, so it
  is never silently dropped); an explicit beta=0 leaves it unread, nan
  included, as BLAS does."""
  a, b, c = rand((5, 7)), rand((7, 3)), rand((5, 3))
  want = np.asarray(a, np.float64) @ np.asarray(b, np.float64)
  np.testing.assert_allclose(mm(a, b, c=c), want + np.asarray(c, np.float64),
                             rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(mm(a, b, c=jnp.full((5, 3), jnp.nan), beta=0.0),
                             want, rtol=1e-5, atol=1e-5)
  with pytest.raises(TypeError, match="alpha must be a Python float"):
    jax.jit(lambda alpha: mm(a, b, alpha=alpha))(2.0)
  with pytest.raises(TypeError, match="beta must be a Python float"):
    mm(a, b, beta="1")
  with pytest.raises(TypeError, match="transpose_a must be a bool"):
    mm(a, b, transpose_a="yes")
  with pytest.raises(TypeError, match="preferred_element_type="):
    mm(a, b, preferred_element_type=jnp.int8)
  with pytest.raises(TypeError, match="a must be an array, got None"):
    mm(None, b)


# ------------------------------------------------------------ dot_general ---


def test_dot_general_dense_layer_form():
  x, w = rand((2, 3, 16)), rand((16, 8))
  dims = (((2,), (0,)), ((), ()))
  out = pallas_gemm.dot_general(x, w, dims, precision=HI)
  expected = jax.lax.dot_general(x, w, dims, precision=HI)
  assert out.shape == expected.shape
  np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
  names = [e.primitive.name for e in jax.make_jaxpr(
      lambda x, w: pallas_gemm.dot_general(x, w, dims))(x, w).jaxpr.eqns]
  assert "pallas_gemm" in names


@pytest.mark.parametrize("dims", [
    (((1,), (0,)), ((), ())),
    (((0,), (0,)), ((), ())),
    (((1,), (1,)), ((), ())),
])
def test_dot_general_2d_contractions(dims):
  lhs = rand((6, 6))
  rhs = rand((6, 6))
  out = pallas_gemm.dot_general(lhs, rhs, dims, precision=HI)
  np.testing.assert_allclose(
      out, jax.lax.dot_general(lhs, rhs, dims, precision=HI), rtol=1e-5,
      atol=1e-5)


def test_dot_general_batched_and_fallback():
  lhs, rhs = rand((3, 5, 7)), rand((3, 7, 4))
  dims = (((2,), (1,)), ((0,), (0,)))
  np.testing.assert_allclose(
      pallas_gemm.dot_general(lhs, rhs, dims, precision=HI),
      jax.lax.dot_general(lhs, rhs, dims, precision=HI), rtol=1e-5, atol=1e-5)
  # Two contracting dims is no single GEMM: falls back to lax.dot_general.
  lhs, rhs = rand((3, 4, 5)), rand((4, 5, 2))
  dims = (((1, 2), (0, 1)), ((), ()))
  np.testing.assert_allclose(
      pallas_gemm.dot_general(lhs, rhs, dims, precision=HI),
      jax.lax.dot_general(lhs, rhs, dims, precision=HI), rtol=1e-5, atol=1e-5)
  ints = jnp.ones((3, 3), jnp.int32)
  assert pallas_gemm.dot_general(ints, ints, (((1,), (0,)), ((), ()))).dtype \
      == jnp.int32


# ---------------------------------------------------------- reproducible ---


def test_results_are_bitwise_reproducible():
  a, b = rand((40, 50)), rand((50, 30))
  f = jax.jit(mm)
  np.testing.assert_array_equal(f(a, b), f(a, b))


# -------------------------------------------------------------- auto order ---


def _problem(dtype="bfloat16", precision="default", m=4096):
  return pallas_gemm.GemmProblem(batch=1, m=m, n=4096, k=4096, in_dtype=dtype,
                                 out_dtype=dtype, precision=precision)


def test_auto_order_is_explicit_and_ends_in_xla():
  from pallas_gemm import registry
  hopper = pallas_gemm.DeviceInfo("gpu", "NVIDIA H200", (9, 0), 132, 227 * 1024)
  ampere = pallas_gemm.DeviceInfo("gpu", "NVIDIA A100", (8, 0), 108, 163 * 1024)
  cpu = pallas_gemm.DeviceInfo("cpu", "cpu")
  for device in (hopper, ampere, cpu):
    assert registry.auto_order(device, _problem())[-1] == "xla"
  assert registry.auto_order(hopper, _problem())[:2] == (
      "mosaic/small_m", "mosaic/ws_persistent")
  # Exact fp32 on Hopper: cuBLAS is the fastest measured; no wgmma fp32 mode.
  assert registry.auto_order(hopper, _problem("float32", "ieee")) == ("xla",)
  assert registry.auto_order(cpu, _problem())[0] == "triton/06_tuned"


def test_cpu_auto_choice_leaves_big_problems_to_xla():
  cpu = pallas_gemm.DeviceInfo("cpu", "cpu")
  small = pallas_gemm.select_kernel(
      pallas_gemm.GemmProblem(1, 64, 64, 64, "float32", "float32"), cpu)
  assert small.name == "triton/06_tuned"
  assert pallas_gemm.select_kernel(_problem("float32", "tf32"), cpu).name == "xla"
