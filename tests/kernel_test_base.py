"""One correctness suite, subclassed per backend (tokamax-style).

A subclass sets `KERNELS` (registered names) and may narrow `SHAPES`,
`DTYPES`, `LAYOUTS`. On a CPU the Pallas kernels run in interpret mode; on a
GPU the same tests run the compiled kernels. Kernels that decline a case
(their `supports()` says why) are skipped with that reason, never silently
passed.

Every test: fresh random-normal inputs, float64 NumPy reference, per-dtype
tolerance, outputs poisoned first (interpret mode starts outputs as NaN; on a
GPU `poison_allocator` leaves NaN in the memory the output will reuse).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_gemm
from pallas_gemm import shapes
from pallas_gemm import numerics, registry
from pallas_gemm.primitive import problem_from_shapes
from pallas_gemm.problem import Epilogue, normalize_precision


def lower_for_cuda(fn, *args):
  """`jax.jit(fn)` traced at `args` (ShapeDtypeStructs) and lowered for
  CUDA on a machine without a GPU: under an abstract H100, from which
  Pallas-Triton kernels learn the compute capability they lower for
  (Mosaic kernels do not ask)."""
  device = jax.sharding.AbstractDevice(
      device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu")
  mesh = jax.sharding.AbstractMesh(
      (1,), ("lowering",), axis_types=(jax.sharding.AxisType.Auto,),
      abstract_device=device)
  with jax.sharding.use_abstract_mesh(mesh):
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))


def ragged_sin_loss_grads(lhs, rhs, group_sizes, weights, *,
                          transpose_rhs=False, row_offset=0):
  """float64 (dlhs, drhs) of sum(weights * sin(ragged_dot(lhs, rhs))), the
  rows form, from the float64 `ragged_dot.reference`: the output's
  cotangent is weights * cos(out), and each gradient is its ragged
  product. Rows outside the groups get no gradient."""
  from pallas_gemm.ragged_dot.problem import RaggedProblem, reference
  (m, k), groups = lhs.shape, rhs.shape[0]
  n = rhs.shape[1] if transpose_rhs else rhs.shape[2]

  def product(a, b, mode, k, n, transpose_rhs=False):
    return reference(a, b, group_sizes, RaggedProblem(
        mode, m, k, n, groups, "float32", "float32",
        transpose_rhs=transpose_rhs), row_offset)
  out = product(lhs, rhs, "rows", k, n, transpose_rhs)
  dout = np.asarray(weights, np.float64) * np.cos(out)
  dlhs = product(dout, rhs, "rows", n, k, not transpose_rhs)
  drhs = product(lhs, dout, "contracting", k, n)
  return dlhs, np.swapaxes(drhs, 1, 2) if transpose_rhs else drhs


def make_operands(shape, dtype, *, layout="NN", batch=None, key=None):
  m, n, k = shape
  key = key if key is not None else numerics.fresh_key()
  ka, kb = jax.random.split(key)
  a_shape = (k, m) if layout[0] == "T" else (m, k)
  b_shape = (n, k) if layout[1] == "T" else (k, n)
  if batch is not None:
    a_shape, b_shape = (batch,) + a_shape, (batch,) + b_shape
  return (numerics.random_normal(ka, a_shape, dtype),
          numerics.random_normal(kb, b_shape, dtype))


def skip_unless_supported(kernel, shape, dtype, *, layout="NN",
                          precision=None, out_dtype=None, epilogue=Epilogue(),
                          batch=1):
  """Skips with the kernel's own reason when it declines the problem."""
  entry = registry.get_kernel(kernel)
  device = pallas_gemm.device_info()
  m, n, k = shape
  problem = problem_from_shapes(
      (batch, k, m) if layout[0] == "T" else (batch, m, k),
      (batch, n, k) if layout[1] == "T" else (batch, k, n),
      in_dtype=dtype, out_dtype=out_dtype or dtype,
      transpose_a=layout[0] == "T", transpose_b=layout[1] == "T",
      precision=normalize_precision(precision, dtype), epilogue=epilogue,
      c_dtype="float32" if epilogue.has_c else None)
  reason = registry.why_unsupported(entry, problem, device)
  if reason is not None:
    pytest.skip(f"{kernel}: {reason}")
  return problem


def check_matmul(kernel, shape, dtype, *, layout="NN", precision=None,
                 out_dtype=None, batch=None, alpha=1.0, beta=0.0, with_c=False,
                 with_bias=False, activation=None):
  """Runs pallas_gemm.matmul under jit and checks it against float64."""
  m, n, k = shape
  epilogue = Epilogue(alpha=alpha, beta=beta, has_c=with_c and beta != 0.0,
                      has_bias=with_bias, activation=activation)
  problem = skip_unless_supported(
      kernel, shape, dtype, layout=layout, precision=precision,
      out_dtype=out_dtype, epilogue=epilogue, batch=batch or 1)
  a, b = make_operands(shape, dtype, layout=layout, batch=batch)
  key = numerics.fresh_key()
  out_shape = ((batch,) if batch else ()) + (m, n)
  c = numerics.random_normal(key, out_shape, jnp.float32) if with_c else None
  bias = (numerics.random_normal(jax.random.fold_in(key, 1), (n,), jnp.float32)
          if with_bias else None)
  numerics.poison_allocator(out_shape, out_dtype or dtype)

  @jax.jit
  def run(a, b, c, bias):
    return pallas_gemm.matmul(
        a, b, kernel=kernel, precision=precision,
        preferred_element_type=out_dtype, transpose_a=layout[0] == "T",
        transpose_b=layout[1] == "T", alpha=alpha, beta=beta, c=c, bias=bias,
        activation=activation)

  out = run(a, b, c, bias)
  assert out.shape == out_shape
  assert out.dtype == jnp.dtype(out_dtype or dtype)
  ref = numerics.reference_matmul(
      a, b, transpose_a=layout[0] == "T", transpose_b=layout[1] == "T",
      epilogue=epilogue, c=c, bias=bias)
  err = numerics.relative_error(out, ref)
  tol = numerics.tolerance(dtype, problem.precision, out_dtype or dtype)
  assert err <= tol, (
      f"{kernel} {problem.describe()}: relative error {err:.3g} > {tol:.3g}")
  return out


class KernelTestBase:
  """Subclass and set KERNELS; narrow the other lists where a backend must."""

  KERNELS: tuple[str, ...] = ()
  SHAPES = tuple(shapes.ODD)
  DTYPES = ("float32", "bfloat16", "float16")
  LAYOUTS = ("NN", "NT", "TN", "TT")
  ACTIVATIONS = ("relu", "gelu")
  # float32 tests ask for exact products; TF32 is tested separately.
  F32_PRECISION = "highest"
  # The shape the dtype/layout/epilogue tests use: ragged in every dimension.
  PROBE_SHAPE = (37, 45, 71)
  # The (m, n, k) of each of the batched test's three products.
  BATCHED_SHAPE = (33, 20, 40)

  def _precision(self, dtype):
    return self.F32_PRECISION if dtype == "float32" else None

  def test_odd_shapes(self, kernel, shape):
    dtype = self.DTYPES[0]
    check_matmul(kernel, shape, dtype, precision=self._precision(dtype))

  def test_dtypes(self, kernel, dtype):
    check_matmul(kernel, self.PROBE_SHAPE, dtype,
                 precision=self._precision(dtype))

  def test_tf32(self, kernel):
    if "float32" not in self.DTYPES:
      pytest.skip("backend has no float32 path")
    check_matmul(kernel, self.PROBE_SHAPE, "float32", precision="default")

  def test_layouts(self, kernel, layout):
    dtype = self.DTYPES[0]
    check_matmul(kernel, self.PROBE_SHAPE, dtype, layout=layout,
                 precision=self._precision(dtype))

  def test_epilogue(self, kernel, activation):
    dtype = self.DTYPES[-1]
    check_matmul(kernel, self.PROBE_SHAPE, dtype, out_dtype="float32",
                 alpha=0.5, beta=-1.5, with_c=True, with_bias=True,
                 activation=activation)

  def test_batched(self, kernel):
    dtype = self.DTYPES[0]
    check_matmul(kernel, self.BATCHED_SHAPE, dtype, batch=3,
                 precision=self._precision(dtype))

  def test_matches_jnp_dot(self, kernel):
    dtype = "bfloat16" if "bfloat16" in self.DTYPES else self.DTYPES[0]
    skip_unless_supported(kernel, self.PROBE_SHAPE, dtype)
    a, b = make_operands(self.PROBE_SHAPE, dtype)
    out = jax.jit(lambda a, b: pallas_gemm.matmul(a, b, kernel=kernel))(a, b)
    expected = jnp.dot(a, b, preferred_element_type=jnp.float32).astype(dtype)
    np.testing.assert_allclose(np.asarray(out, np.float32),
                               np.asarray(expected, np.float32),
                               rtol=2e-2, atol=2e-2 * float(jnp.abs(
                                   expected.astype(jnp.float32)).max()))
