"""fp8 GEMMs with dequantization scales: quantize_fp8, the XLA fallback for
every scale mode, `mosaic/fp8` in GPU interpret mode, errors, and the
kernel's Mosaic lowering for the GPU configs (cross-lowered on a CPU)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_gemm
from pallas_gemm import dispatch
from pallas_gemm.fp8 import (dequantize_fp8, fp8_max, quantize_fp8,
                             reference_operand)
from pallas_gemm.mosaic_backend import Dim, MosaicConfig
from pallas_gemm.mosaic_backend import fp8 as mosaic_fp8
from pallas_gemm.mosaic_backend.fp8_config import Fp8Config, heuristic_choices
from pallas_gemm.numerics import (fresh_key, random_normal, reference_matmul,
                                  relative_error, tolerance)
from pallas_gemm.problem import Epilogue, GemmProblem, cdiv
from kernel_test_base import lower_for_cuda

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
HOPPER = pallas_gemm.DeviceInfo("gpu", "NVIDIA H100", (9, 0), 132, 227 * 1024)
#: A small CTA tile keeps interpret mode quick (the GPU configs are checked by
#: the cross-lowering tests below).
SMALL = Fp8Config(tile_m=64, tile_n=64, tile_k=128, max_concurrent_steps=2,
                  epi_tile_n=64, wg_dimension=Dim.M)
#: Block-wise K blocks in overlapped pairs (3 blocks: a pair, then one),
#: consumers taking turns, on 2-CTA clusters along M (a single M tile leaves
#: the second CTA's tile wholly past the edge).
SMALL_GROUPED = Fp8Config(tile_m=64, tile_n=64, tile_k=128,
                          max_concurrent_steps=3, epi_tile_n=64,
                          wg_dimension=Dim.M, promote_group=2,
                          cluster_dim=Dim.M, alternate_consumers=True)
#: Block-wise pairs with consumer 1's groups one block behind consumer 0's.
SMALL_STAGGERED = Fp8Config(tile_m=64, tile_n=64, tile_k=128,
                            max_concurrent_steps=3, epi_tile_n=64,
                            wg_dimension=Dim.M, promote_group=2,
                            stagger_groups=True)

#: Every mode of each operand, and each kind of pair (both in the epilogue,
#: both per K block, one of each), without the whole cross product.
MODE_PAIRS = [("none", "tensor"), ("tensor", "col"), ("row", "block"),
              ("block", "none"), ("block", "block"), ("row", "col")]

#: Relative error budget of an fp8 product with a float32 output against
#: float64 of the same (dequantized) values. On a host the products are
#: summed in float32. Hopper's fp8 tensor cores (XLA's cuBLASLt call and our
#: wgmma alike) add them in a narrower accumulator, which over a K of a few
#: hundred lands near 1e-4 (measured on an H200): the reason block-wise
#: scaling promotes partial sums into float32 registers every 128 of K.
F32_OUT_BUDGET = 1e-3 if jax.default_backend() == "gpu" else 1e-5


def _operands(m, n, k, *, a_mode, b_mode, transpose_b, a_dtype=E4M3,
              b_dtype=E4M3):
  """Quantized a (m, k), b ((n, k) if transpose_b else (k, n)), their scales
  and the float64 reference of op(a) @ op(b) of the dequantized values."""
  x = random_normal(fresh_key(), (m, k), jnp.float32) * 3
  w_shape = (n, k) if transpose_b else (k, n)
  w = random_normal(fresh_key(), w_shape, jnp.float32) * 0.5

  def quantize(v, mode, dtype, block):
    if mode == "none":
      return v.astype(dtype), None
    if mode == "tensor":
      return quantize_fp8(v, dtype=dtype)
    if mode == "block":
      return quantize_fp8(v, dtype=dtype, block=block)
    # A vector: one positive scale per row of A / per column of op(B).
    size = m if mode == "row" else n
    scale = jnp.exp(random_normal(fresh_key(), (size,), jnp.float32) * 0.5)
    if mode == "row":
      return (v / scale[:, None]).astype(dtype), scale
    column_axis = 0 if transpose_b else 1
    expand = scale[:, None] if column_axis == 0 else scale[None, :]
    return (v / expand).astype(dtype), scale

  qa, sa = quantize(x, a_mode, a_dtype, (1, 128))
  qb, sb = quantize(w, b_mode, b_dtype, (128, 128))
  ra = reference_operand(qa, sa, a_mode, operand="a", transposed=False)
  rb = reference_operand(qb, sb, b_mode, operand="b", transposed=transpose_b)
  ref = ra @ (rb.T if transpose_b else rb)
  return qa, qb, sa, sb, ref


# ------------------------------------------------------------ quantize_fp8 ---


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("block", [None, (1, 128), (128, 128), (3, 5)])
def test_quantize_round_trip(dtype, block):
  x = random_normal(fresh_key(), (130, 257), jnp.float32) * 7
  q, s = quantize_fp8(x, dtype=dtype, block=block)
  assert q.dtype == dtype and s.dtype == jnp.float32
  if block is None:
    assert s.shape == ()
  else:
    assert s.shape == (cdiv(130, block[0]), cdiv(257, block[1]))
  # Every block's largest magnitude lands on the dtype's max.
  assert float(jnp.max(jnp.abs(q.astype(jnp.float32)))) == fp8_max(dtype)
  back = dequantize_fp8(q, s, block=block)
  # e4m3 keeps 3 mantissa bits (relative step 2^-4), e5m2 2 bits.
  budget = 0.04 if dtype == E4M3 else 0.08
  assert relative_error(back, np.asarray(x, np.float64)) < budget


def test_quantize_saturates_and_rounds_to_nearest():
  # An explicit tensor scale of 1 is what amax 448 gives for e4m3.
  x = jnp.array([[448.0, -448.0, 1.0, 0.0], [1.0625, 1.1875, -0.3, 2.0]])
  q, s = quantize_fp8(x)
  assert float(s) == 1.0
  got = np.asarray(q.astype(jnp.float32))
  # 1.0625 is halfway between 1 and 1.125: ties to even (1.0); 1.1875 -> 1.25.
  np.testing.assert_array_equal(got[1, :2], [1.0, 1.25])
  # Huge and tiny magnitudes in one tensor: the largest lands exactly on the
  # max, nothing overflows to NaN (e4m3fn has no inf), small ones go to 0.
  wide = jnp.array([[3.4e38, -1e30, 1.0, -2.0]], jnp.float32)
  q_wide, s_wide = quantize_fp8(wide)
  values = np.asarray(q_wide.astype(jnp.float32))
  assert np.all(np.isfinite(values)) and np.isfinite(float(s_wide))
  assert values[0, 0] == fp8_max(E4M3) and values[0, 2] == 0.0


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("block", [None, (1, 4)])
def test_quantize_keeps_non_finite_values_apart(dtype, block):
  """A nan or inf neither clips nor sets its block's scale: the finite
  values beside it round-trip, and it stays non-finite (inf only where the
  dtype has one)."""
  x = jnp.array([[1000.0, jnp.nan, -3.0, jnp.inf],
                 [5.0, -700.0, 0.5, -jnp.inf]])
  q, s = quantize_fp8(x, dtype=dtype, block=block)
  assert bool(jnp.all(jnp.isfinite(s)))
  back = np.asarray(dequantize_fp8(q, s, block=block))
  finite = np.isfinite(np.asarray(x))
  budget = 0.07 if dtype == E4M3 else 0.13  # a half step of the mantissa
  np.testing.assert_allclose(back[finite], np.asarray(x)[finite],
                             rtol=budget)
  assert np.isnan(back[0, 1])
  if dtype == E5M2:
    assert back[0, 3] == np.inf and back[1, 3] == -np.inf
  else:
    assert np.isnan(back[0, 3]) and np.isnan(back[1, 3])


def test_quantize_e5m2_range():
  # e5m2 reaches 57344 and keeps tiny values that e4m3 flushes.
  x = jnp.array([[57344.0, 1e-4, -3e4, 2.0 ** -14]])
  q = x.astype(E5M2)
  assert float(q[0, 0].astype(jnp.float32)) == 57344.0
  assert float(q[0, 3].astype(jnp.float32)) == 2.0 ** -14
  q_scaled, s = quantize_fp8(x, dtype=E5M2)
  assert float(s) == 1.0  # amax is already the dtype's max
  assert fp8_max(E5M2) == 57344.0 and fp8_max(E4M3) == 448.0


def test_quantize_errors():
  with pytest.raises(TypeError, match="dtype"):
    quantize_fp8(jnp.ones((4, 4)), dtype=jnp.bfloat16)
  with pytest.raises(ValueError, match="block"):
    quantize_fp8(jnp.ones((4, 4)), block=(0, 128))
  with pytest.raises(ValueError, match="block"):
    quantize_fp8(jnp.ones((4,)), block=(1, 128))
  # Scales read with another block than they were made with would broadcast
  # into a wrong answer (or fail inside jnp): the shape is checked.
  q, s = quantize_fp8(jnp.ones((4, 256)), block=(1, 128))
  for block in ((128, 128), None):
    with pytest.raises(ValueError,
                       match=r"scale.shape=\(4, 2\) does not match"):
      dequantize_fp8(q, s, block=block)


# ------------------------------------------------------- the XLA fallback ---


@pytest.mark.parametrize("transpose_b", [False, True], ids=["NN", "NT"])
def test_xla_every_scale_mode(transpose_b):
  m, n, k = 37, 150, 260
  for a_mode, b_mode in MODE_PAIRS:
    qa, qb, sa, sb, ref = _operands(m, n, k, a_mode=a_mode, b_mode=b_mode,
                                    transpose_b=transpose_b)
    out = pallas_gemm.matmul(qa, qb, a_scale=sa, b_scale=sb, kernel="xla",
                             transpose_b=transpose_b,
                             preferred_element_type=jnp.float32)
    assert out.shape == (m, n) and out.dtype == jnp.float32
    assert relative_error(out, ref) < F32_OUT_BUDGET, (a_mode, b_mode)


@pytest.mark.parametrize("transpose_b", [False, True], ids=["NN", "NT"])
@pytest.mark.parametrize("modes", [("tensor", "tensor"), ("none", "tensor"),
                                   ("tensor", "none")], ids="-".join)
@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_xla_per_tensor_bf16_output_dequantizes_then_dots(transpose_b, modes,
                                                          dtype):
  """The bf16-out per-tensor form (operands widened and scaled, then one
  dot) against float64, with scales that are not powers of two, one
  matrix and (through vmap) a batch of them, whose scales differ."""
  m, n, k = 37, 150, 260
  qa, qb, sa, sb, ref = _operands(m, n, k, a_mode=modes[0], b_mode=modes[1],
                                  transpose_b=transpose_b, a_dtype=dtype,
                                  b_dtype=dtype)
  budget = tolerance(jnp.dtype(dtype).name, "default", "bfloat16")
  call = functools.partial(pallas_gemm.matmul, kernel="xla",
                           transpose_b=transpose_b,
                           preferred_element_type=jnp.bfloat16)
  out = call(qa, qb, a_scale=sa, b_scale=sb)
  assert out.dtype == jnp.bfloat16 and out.shape == (m, n)
  assert relative_error(out, ref) < budget
  if modes == ("tensor", "tensor"):
    assert not jnp.any(jnp.isnan(out.astype(jnp.float32)))
    factors = jnp.asarray([1.0, 0.3], jnp.float32)
    batched = jax.vmap(lambda f: call(qa, qb, a_scale=sa * f, b_scale=sb))(
        factors)
    assert batched.shape == (2, m, n)
    for i, f in enumerate((1.0, 0.3)):
      assert relative_error(batched[i], ref * f) < budget, i


@pytest.mark.parametrize("dtypes", [(E4M3, E5M2), (E5M2, E5M2), (E5M2, E4M3)],
                         ids=["e4m3xe5m2", "e5m2", "e5m2xe4m3"])
def test_xla_dtypes_and_bf16_output(dtypes):
  qa, qb, sa, sb, ref = _operands(19, 33, 131, a_mode="row", b_mode="block",
                                  transpose_b=True, a_dtype=dtypes[0],
                                  b_dtype=dtypes[1])
  out = pallas_gemm.matmul(qa, qb, a_scale=sa, b_scale=sb, transpose_b=True,
                           preferred_element_type=jnp.bfloat16)
  assert out.dtype == jnp.bfloat16
  assert relative_error(out, ref) < tolerance("float8_e4m3fn", "default",
                                              "bfloat16")


def _check_epilogue_after_dequantization(m, n, k, *, a_mode, b_mode,
                                         transpose_b, c_dtype, epilogue,
                                         **kernel_args):
  """The float32 product of fp8 operands with `epilogue` (its c and bias
  drawn here) equals the epilogue applied to the dequantized product."""
  qa, qb, sa, sb, ref = _operands(m, n, k, a_mode=a_mode, b_mode=b_mode,
                                  transpose_b=transpose_b)
  c = random_normal(fresh_key(), (m, n), c_dtype)
  bias = random_normal(fresh_key(), (n,), jnp.float32)
  out = pallas_gemm.matmul(qa, qb, a_scale=sa, b_scale=sb,
                           transpose_b=transpose_b, alpha=epilogue.alpha,
                           beta=epilogue.beta, c=c, bias=bias,
                           activation=epilogue.activation,
                           preferred_element_type=jnp.float32, **kernel_args)
  expected = reference_matmul(np.asarray(ref), np.eye(n), epilogue=epilogue,
                              c=c, bias=bias)
  assert relative_error(out, expected) < F32_OUT_BUDGET


def test_epilogue_runs_after_dequantization():
  _check_epilogue_after_dequantization(
      20, 24, 140, a_mode="tensor", b_mode="col", transpose_b=False,
      c_dtype=jnp.float32,
      epilogue=Epilogue(alpha=0.5, beta=2.0, has_c=True, has_bias=True,
                        activation="gelu"))


def test_batched_and_vmapped_scales():
  m, n, k = 16, 40, 130
  qa, qb, sa, sb, _ = _operands(m, n, k, a_mode="block", b_mode="block",
                                transpose_b=True)
  stacked = jnp.stack([qa, qa])
  out = pallas_gemm.matmul(stacked, qb, a_scale=sa, b_scale=sb,
                           transpose_b=True, preferred_element_type=jnp.float32)
  single = pallas_gemm.matmul(qa, qb, a_scale=sa, b_scale=sb, transpose_b=True,
                              preferred_element_type=jnp.float32)
  np.testing.assert_allclose(out[1], single, rtol=1e-6)
  # vmap with per-example scales: they follow the batch axis.
  per_example = jax.vmap(lambda a, s: pallas_gemm.matmul(
      a, qb, a_scale=s, b_scale=sb, transpose_b=True,
      preferred_element_type=jnp.float32))(stacked, jnp.stack([sa, 2 * sa]))
  np.testing.assert_allclose(per_example[1], 2 * single, rtol=1e-5)
  both = jax.vmap(lambda a, b, t: pallas_gemm.matmul(
      a, b, a_scale=t, b_scale=t, preferred_element_type=jnp.float32))(
          stacked, jnp.stack([qb.T, qb.T]), jnp.array([1.0, 3.0]))
  np.testing.assert_allclose(both[1], 9 * both[0], rtol=1e-5)


def test_scaled_grad_raises():
  qa, qb, sa, sb, _ = _operands(8, 8, 128, a_mode="tensor", b_mode="tensor",
                                transpose_b=True)
  with pytest.raises(NotImplementedError, match="no gradient"):
    jax.grad(lambda s: pallas_gemm.matmul(
        qa, qb, a_scale=s, b_scale=sb, transpose_b=True,
        preferred_element_type=jnp.float32).sum())(sa)


def test_scale_errors_name_the_argument():
  qa = jnp.ones((8, 256), E4M3)
  qb = jnp.ones((256, 64), E4M3)
  with pytest.raises(ValueError, match=r"a_scale.shape=\(3,\)"):
    pallas_gemm.matmul(qa, qb, a_scale=jnp.ones(3))
  with pytest.raises(ValueError, match=r"b_scale.shape=\(1, 2\)"):
    pallas_gemm.matmul(qa, qb, b_scale=jnp.ones((1, 2)))
  # Transposed B takes block scales in its stored (n, k) layout.
  with pytest.raises(ValueError, match="b_scale"):
    pallas_gemm.matmul(qa, qb.T, b_scale=jnp.ones((2, 1)), transpose_b=True)
  with pytest.raises(TypeError, match="a_scale is for fp8"):
    pallas_gemm.matmul(jnp.ones((8, 8)), jnp.ones((8, 8)), a_scale=1.0)
  with pytest.raises(TypeError, match="b_scale has dtype"):
    pallas_gemm.matmul(qa, qb, b_scale=jnp.ones((64,), jnp.int32))
  with pytest.raises(TypeError, match="no common dtype"):
    pallas_gemm.matmul(qa, jnp.ones((256, 64), jnp.bfloat16))
  with pytest.raises(ValueError, match="mosaic/fp8"):
    pallas_gemm.matmul(qa, qb, kernel="mosaic/ws_persistent", a_scale=2.0)
  with pytest.raises(ValueError, match="a_scale_mode"):
    GemmProblem(1, 8, 8, 8, "float8_e4m3fn", "float32", a_scale_mode="col")


# ------------------------------------------------------ dispatch & explain ---


def test_hopper_auto_choice_is_mosaic_fp8(isolated_cache):
  """The fixed order, where the GPU has no measured fp8 buckets (an
  isolated, empty table here)."""
  for modes in (("none", "none"), ("tensor", "tensor"), ("block", "block")):
    problem = GemmProblem(1, 4096, 4096, 4096, "float8_e4m3fn", "bfloat16",
                          transpose_b=True, a_scale_mode=modes[0],
                          b_scale_mode=modes[1])
    resolution = dispatch.resolve(problem, HOPPER)
    assert resolution.kernel == "mosaic/fp8", resolution
    assert resolution.config.tile_k == 128
    assert mosaic_fp8.check_fp8_config(resolution.config, problem) is None
  bf16 = GemmProblem(1, 4096, 4096, 4096, "bfloat16", "bfloat16")
  assert dispatch.resolve(bf16, HOPPER).kernel != "mosaic/fp8"


def test_layout_note():
  nt = GemmProblem(1, 64, 64, 128, "float8_e4m3fn", "bfloat16",
                   transpose_b=True)
  nn = GemmProblem(1, 64, 64, 128, "float8_e4m3fn", "bfloat16")
  assert "native" in mosaic_fp8.layout_note(nt)
  assert "transposes B" in mosaic_fp8.layout_note(nn)


# ------------------------------------------------- mosaic/fp8, interpreted ---


@pytest.mark.parametrize("case", [
    # (m, n, k, a_mode, b_mode, transpose_b, a_dtype, b_dtype, out_dtype)
    (130, 72, 300, "tensor", "tensor", True, E4M3, E4M3, jnp.bfloat16),
    (70, 136, 260, "block", "block", True, E4M3, E5M2, jnp.float32),
    (65, 64, 129, "row", "col", False, E5M2, E5M2, jnp.float16),
    (33, 64, 200, "none", "none", True, E4M3, E4M3, jnp.float32),
], ids=["NT-tensor", "NT-block-mixed", "NN-rowcol-e5m2",
        "NT-unscaled"])
def test_mosaic_fp8_interpret(case):
  m, n, k, a_mode, b_mode, transpose_b, a_dtype, b_dtype, out_dtype = case
  qa, qb, sa, sb, ref = _operands(m, n, k, a_mode=a_mode, b_mode=b_mode,
                                  transpose_b=transpose_b, a_dtype=a_dtype,
                                  b_dtype=b_dtype)
  out = pallas_gemm.matmul(qa, qb, a_scale=sa, b_scale=sb,
                           transpose_b=transpose_b, kernel="mosaic/fp8",
                           config=SMALL_GROUPED if "block" in (a_mode, b_mode)
                           else SMALL, preferred_element_type=out_dtype)
  assert out.dtype == out_dtype and out.shape == (m, n)
  budget = F32_OUT_BUDGET if out_dtype == jnp.float32 else tolerance(
      "float8_e4m3fn", "default", jnp.dtype(out_dtype).name)
  assert relative_error(out, ref) < budget


@pytest.mark.parametrize("a_mode", ["none", "tensor", "row", "block"])
@pytest.mark.parametrize("b_mode", ["none", "tensor", "col", "block"])
def test_mosaic_fp8_every_scale_pair_on_partial_tiles_interpret(a_mode,
                                                                b_mode):
  """Every pair of scale modes, with a last row tile of 2 rows and a last
  column tile of 8 columns, where a scale read past the edge would show."""
  transpose_b = (a_mode, b_mode) != ("row", "col")  # one NN case too
  qa, qb, sa, sb, ref = _operands(130, 136, 300, a_mode=a_mode, b_mode=b_mode,
                                  transpose_b=transpose_b)
  out = pallas_gemm.matmul(
      qa, qb, a_scale=sa, b_scale=sb, transpose_b=transpose_b,
      kernel="mosaic/fp8",
      config=SMALL_GROUPED if "block" in (a_mode, b_mode) else SMALL,
      preferred_element_type=jnp.float32)
  assert relative_error(out, ref) < F32_OUT_BUDGET


@pytest.mark.parametrize("k", [128, 5 * 128 - 3])
def test_mosaic_fp8_staggered_groups_interpret(k):
  """Consumer 0 promotes K blocks as 2, 2, 1 and consumer 1 as 1, 2, 2 (one
  block: both a single group); every block is still scaled by its own
  factors."""
  qa, qb, sa, sb, ref = _operands(130, 136, k, a_mode="block",
                                  b_mode="tensor", transpose_b=True)
  out = pallas_gemm.matmul(qa, qb, a_scale=sa, b_scale=sb, transpose_b=True,
                           kernel="mosaic/fp8", config=SMALL_STAGGERED,
                           preferred_element_type=jnp.float32)
  assert relative_error(out, ref) < F32_OUT_BUDGET


@pytest.mark.skipif(jax.default_backend() != "cpu",
                    reason="race detection runs in interpret mode")
@pytest.mark.parametrize("config", [
    Fp8Config(tile_m=64, tile_n=64, tile_k=128, max_concurrent_steps=3,
              epi_tile_n=64, wg_dimension=Dim.M, promote_group=2),
    SMALL_STAGGERED,
    Fp8Config(tile_m=64, tile_n=64, tile_k=128, max_concurrent_steps=3,
              epi_tile_n=64, wg_dimension=Dim.M, promote_group=2,
              alternate_consumers=True),
    Fp8Config(tile_m=64, tile_n=64, tile_k=128, max_concurrent_steps=3,
              epi_tile_n=64, promote_group=2, pingpong=True),
], ids=["grouped", "staggered", "alternating", "pingpong"])
def test_mosaic_fp8_block_wise_schedules_have_no_races_interpret(config):
  """The block-wise consumers read each stage's scales and release it
  (behind a proxy fence) before the producer's TMA refills it: the race
  detector sees no shared-memory race, over tiles that wrap the ring."""
  from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
  from jax.experimental.pallas import mosaic_gpu as plgpu
  m, n, k = 130, 72, 3 * 128 - 5
  qa, qb, sa, sb, ref = _operands(m, n, k, a_mode="block", b_mode="block",
                                  transpose_b=True)
  problem = GemmProblem(1, m, n, k, "float8_e4m3fn", "float32",
                        transpose_b=True, a_scale_mode="block",
                        b_scale_mode="block")
  # The primitive's scale layout: B's blocks as (k blocks, n blocks).
  out = mosaic_fp8.fp8_matmul(
      qa[None], qb[None], None, None, problem=problem, config=config,
      interpret=plgpu.InterpretGPUParams(detect_races=True),
      a_scale=sa[None], b_scale=sb.T[None])
  assert not interpret_pallas_call.get_races().races_found
  assert relative_error(out[0], ref) < F32_OUT_BUDGET


def test_mosaic_fp8_epilogue_interpret():
  _check_epilogue_after_dequantization(
      64, 64, 128, a_mode="row", b_mode="block", transpose_b=True,
      c_dtype=jnp.bfloat16,
      epilogue=Epilogue(alpha=1.5, beta=-1.0, has_c=True, has_bias=True,
                        activation="silu"),
      kernel="mosaic/fp8", config=SMALL)


def test_mosaic_fp8_config_errors():
  problem = GemmProblem(1, 256, 256, 256, "float8_e4m3fn", "bfloat16",
                        transpose_b=True, a_scale_mode="block",
                        b_scale_mode="block")
  wide = MosaicConfig(tile_m=64, tile_n=256, tile_k=128,
                      max_concurrent_steps=2, wg_dimension=Dim.M)
  assert "accumulator registers" in mosaic_fp8.check_fp8_config(wide, problem)
  shallow = MosaicConfig(tile_m=64, tile_n=128, tile_k=64, wg_dimension=Dim.M)
  assert "tile_k=64" in mosaic_fp8.check_fp8_config(shallow, problem)


# -------------------------------------------- Mosaic lowering (GPU configs) ---


def _lower(m, n, k, a_mode, b_mode, transpose_b, dtypes=(E4M3, E4M3)):
  problem = GemmProblem(1, m, n, k, jnp.dtype(dtypes[0]).name, "bfloat16",
                        transpose_b=transpose_b, a_scale_mode=a_mode,
                        b_scale_mode=b_mode,
                        b_dtype=jnp.dtype(dtypes[1]).name)
  config = mosaic_fp8.fp8_heuristic(problem, HOPPER)
  kb = cdiv(k, 128)
  a_shape = {"none": (1,), "tensor": (1,), "row": (1, m),
             "block": (1, m, kb)}[a_mode]
  b_shape = {"none": (1,), "tensor": (1,), "col": (1, n),
             "block": (1, kb, cdiv(n, 128))}[b_mode]

  def run(a, b, a_scale, b_scale):
    return mosaic_fp8.fp8_matmul(
        a, b, None, None, problem=problem, config=config, interpret=False,
        a_scale=None if a_mode == "none" else a_scale,
        b_scale=None if b_mode == "none" else b_scale)

  spec = jax.ShapeDtypeStruct
  lower_for_cuda(
      run, spec((1, m, k), dtypes[0]),
      spec((1, n, k) if transpose_b else (1, k, n), dtypes[1]),
      spec(a_shape, jnp.float32), spec(b_shape, jnp.float32))


LOWERING_MODES = [("none", "none"), ("tensor", "tensor"), ("row", "col"),
                  ("block", "block"), ("row", "block"), ("block", "tensor")]


@pytest.mark.parametrize("modes", LOWERING_MODES, ids="-".join)
@pytest.mark.parametrize("transpose_b", [True, False], ids=["NT", "NN"])
def test_cross_lowering_4096(modes, transpose_b):
  _lower(4096, 4096, 4096, *modes, transpose_b)


@pytest.mark.parametrize("modes", [("tensor", "tensor"), ("block", "block")],
                         ids="-".join)
@pytest.mark.parametrize("transpose_b", [True, False], ids=["NT", "NN"])
def test_cross_lowering_8192(modes, transpose_b):
  _lower(8192, 8192, 8192, *modes, transpose_b)


def test_cross_lowering_mixed_llm_projection():
  _lower(8192, 14336, 4096, "block", "block", True, dtypes=(E4M3, E5M2))
  _lower(8192, 14336, 4096, "tensor", "tensor", True, dtypes=(E5M2, E4M3))


@pytest.mark.parametrize("modes", [("tensor", "tensor"), ("block", "block"),
                                   ("row", "col"), ("none", "none")],
                         ids="-".join)
def test_every_heuristic_choice_cross_lowers(modes):
  """Whatever tile the heuristic weighs a shape towards, it lowers."""
  m, n, k = 4096, 4096, 4096
  problem = GemmProblem(1, m, n, k, "float8_e4m3fn", "bfloat16",
                        transpose_b=True, a_scale_mode=modes[0],
                        b_scale_mode=modes[1])
  kb = cdiv(k, 128)
  shapes = {"none": (1,), "tensor": (1,), "row": (1, m), "col": (1, n),
            "block": None}
  a_shape = shapes[modes[0]] or (1, m, kb)
  b_shape = shapes[modes[1]] or (1, kb, cdiv(n, 128))
  spec = jax.ShapeDtypeStruct
  for config, _ in heuristic_choices(problem):
    assert mosaic_fp8.check_fp8_config(config, problem) is None

    def run(a, b, a_scale, b_scale, config=config):
      return mosaic_fp8.fp8_matmul(
          a, b, None, None, problem=problem, config=config, interpret=False,
          a_scale=None if modes[0] == "none" else a_scale,
          b_scale=None if modes[1] == "none" else b_scale)

    lower_for_cuda(
        run, spec((1, m, k), E4M3), spec((1, n, k), E4M3),
        spec(a_shape, jnp.float32), spec(b_shape, jnp.float32))


def test_cross_lowering_cluster_and_groups():
  """The sweep's 2-CTA clusters and promotion groups lower too."""
  for modes, config in (
      (("tensor", "tensor"), Fp8Config(tile_m=64, tile_n=256, tile_k=128,
                                       wg_dimension=Dim.M,
                                       cluster_dim=Dim.N)),
      (("block", "block"), Fp8Config(tile_m=64, tile_n=128, tile_k=128,
                                     max_concurrent_steps=5, epi_tile_n=32,
                                     wg_dimension=Dim.M, promote_group=2,
                                     cluster_dim=Dim.M,
                                     alternate_consumers=True)),
      (("block", "block"), Fp8Config(tile_m=64, tile_n=128, tile_k=128,
                                     max_concurrent_steps=6, epi_tile_n=32,
                                     wg_dimension=Dim.M, promote_group=2,
                                     stagger_groups=True))):
    problem = GemmProblem(1, 4096, 4096, 4096 + 3 * 128, "float8_e4m3fn",
                          "bfloat16", transpose_b=True, a_scale_mode=modes[0],
                          b_scale_mode=modes[1])
    assert mosaic_fp8.check_fp8_config(config, problem) is None
    k = problem.k
    kb = cdiv(k, 128)
    scale_shapes = (((1,), (1,)) if modes[0] == "tensor" else
                    ((1, 4096, kb), (1, kb, 32)))
    spec = jax.ShapeDtypeStruct
    lower_for_cuda(
        lambda a, b, x, y, config=config, problem=problem:
        mosaic_fp8.fp8_matmul(a, b, None, None, problem=problem,
                              config=config, a_scale=x, b_scale=y),
        spec((1, 4096, k), E4M3), spec((1, 4096, k), E4M3),
        spec(scale_shapes[0], jnp.float32), spec(scale_shapes[1], jnp.float32))


def test_fp8_config_validation():
  with pytest.raises(ValueError, match="promote_group"):
    Fp8Config(tile_k=128, promote_group=0)
  with pytest.raises(TypeError, match="cluster_dim"):
    Fp8Config(tile_k=128, cluster_dim=2)
  assert Fp8Config(tile_k=128, cluster_dim=1).cluster_dim == Dim.N
  with pytest.raises(ValueError, match="cooperative"):
    Fp8Config(tile_k=128, pingpong=True, alternate_consumers=True)
  for bad in (dict(promote_group=1), dict(promote_group=2, pingpong=True),
              dict(promote_group=2, alternate_consumers=True)):
    with pytest.raises(ValueError, match="stagger_groups"):
      Fp8Config(tile_k=128, stagger_groups=True, **bad)
  tensor = GemmProblem(1, 256, 256, 256, "float8_e4m3fn", "bfloat16",
                       transpose_b=True, a_scale_mode="tensor",
                       b_scale_mode="tensor")
  grouped = Fp8Config(tile_m=64, tile_n=128, tile_k=128, promote_group=2)
  assert "block-wise" in mosaic_fp8.check_fp8_config(grouped, tensor)


def test_search_space_configs_fit():
  for modes in (("tensor", "tensor"), ("block", "block")):
    problem = GemmProblem(1, 8192, 8192, 8192, "float8_e4m3fn", "bfloat16",
                          transpose_b=True, a_scale_mode=modes[0],
                          b_scale_mode=modes[1])
    candidates = mosaic_fp8.fp8_candidates(problem, HOPPER)
    assert candidates[0] == mosaic_fp8.fp8_heuristic(problem, HOPPER)
    assert len(candidates) > 3
    assert all(mosaic_fp8.check_fp8_config(c, problem) is None
               for c in candidates)


def test_explain_names_the_layout_copy():
  qa = jnp.ones((64, 128), E4M3)
  qb = jnp.ones((128, 64), E4M3)
  text = str(pallas_gemm.explain(qa, qb, kernel="mosaic/fp8", a_scale=2.0))
  assert "XLA first transposes B" in text
  text = str(pallas_gemm.explain(qa, qb.T, kernel="mosaic/fp8",
                                 transpose_b=True))
  assert "NT: native" in text


# ------------------------------------- ffi/fp8_nn (B stored (k, n), CUDA) ---

from pallas_gemm.ffi import fp8 as ffi_fp8  # noqa: E402

ON_HOPPER = (jax.default_backend() == "gpu"
             and pallas_gemm.device_info().is_hopper)


def _nn_problem(**changes):
  fields = dict(batch=1, m=512, n=1024, k=2048, in_dtype="float8_e4m3fn",
                out_dtype="bfloat16", a_scale_mode="tensor",
                b_scale_mode="tensor")
  fields.update(changes)
  return GemmProblem(**fields)


def _toolkit(monkeypatch, problem):
  """supports() with nvcc found (problem None) or not; resolutions are
  memoized, so they are forgotten before and after."""
  monkeypatch.setattr(ffi_fp8, "_toolkit_problem", lambda: problem)
  dispatch.clear_cache()


@pytest.fixture
def toolkit_found(monkeypatch):
  _toolkit(monkeypatch, None)
  yield
  dispatch.clear_cache()


@pytest.mark.parametrize("changes,words", [
    (dict(transpose_b=True), "transpose_b=True"),
    (dict(transpose_a=True), "transpose_a"),
    (dict(b_scale_mode="block"), "per-tensor scales only; b_scale is 'block'"),
    (dict(a_scale_mode="row"), "a_scale is 'row'"),
    (dict(out_dtype="float32"), "writes bfloat16, not float32"),
    (dict(epilogue=Epilogue(alpha=2.0)), "no epilogue"),
    (dict(batch=2), "a batch of 2"),
    (dict(n=1000), "n=1000"),
    (dict(k=1000), "k=1000"),
], ids=lambda x: x if isinstance(x, str) else None)
def test_ffi_fp8_nn_supports_says_why(toolkit_found, changes, words):
  reason = ffi_fp8.supports(_nn_problem(**changes), HOPPER)
  assert reason is not None and words in reason, reason


def test_ffi_fp8_nn_takes_either_format(toolkit_found):
  for a, b in (("float8_e5m2", None), ("float8_e4m3fn", "float8_e5m2"),
               ("float8_e5m2", "float8_e4m3fn")):
    assert ffi_fp8.supports(_nn_problem(in_dtype=a, b_dtype=b), HOPPER) is None


def test_ffi_fp8_nn_needs_hopper_and_nvcc(monkeypatch):
  ampere = pallas_gemm.DeviceInfo("gpu", "NVIDIA A100", (8, 0), 108,
                                  163 * 1024)
  assert "Hopper" in ffi_fp8.supports(_nn_problem(), ampere)
  _toolkit(monkeypatch, "ffi/fp8_nn builds ... no nvcc")
  assert "nvcc" in ffi_fp8.supports(_nn_problem(), HOPPER)
  dispatch.clear_cache()


def test_hopper_auto_choice_for_nn_per_tensor_is_ffi_fp8_nn(toolkit_found,
                                                           isolated_cache):
  for modes in (("none", "none"), ("tensor", "tensor"), ("tensor", "none")):
    problem = _nn_problem(a_scale_mode=modes[0], b_scale_mode=modes[1])
    assert dispatch.resolve(problem, HOPPER).kernel == "ffi/fp8_nn"
  # What it does not take falls through to mosaic/fp8.
  for changes in (dict(transpose_b=True), dict(b_scale_mode="block"),
                  dict(out_dtype="float32")):
    assert dispatch.resolve(_nn_problem(**changes),
                            HOPPER).kernel == "mosaic/fp8"


def test_hopper_auto_choice_without_nvcc_is_mosaic_fp8(monkeypatch,
                                                       isolated_cache):
  _toolkit(monkeypatch, "no nvcc")
  assert dispatch.resolve(_nn_problem(), HOPPER).kernel == "mosaic/fp8"
  dispatch.clear_cache()


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="ffi/fp8_nn needs a Hopper GPU")
@pytest.mark.parametrize("shape", [(1, 16, 16), (200, 400, 1008),
                                   (257, 144, 272), (1000, 2064, 4096),
                                   (3, 4096, 128)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("modes", [("tensor", "tensor"), ("none", "none"),
                                   ("none", "tensor")], ids="-".join)
def test_ffi_fp8_nn_matches_float64(shape, modes):
  _check_ffi_fp8_nn(shape, modes, (E4M3, E4M3))


def _check_ffi_fp8_nn(shape, modes, dtypes, config=None):
  """Checks ffi/fp8_nn (with `config`, else the resolver's) against
  float64; returns the jitted call, its operands and its output."""
  m, n, k = shape
  qa, qb, sa, sb, ref = _operands(m, n, k, a_mode=modes[0], b_mode=modes[1],
                                  transpose_b=False, a_dtype=dtypes[0],
                                  b_dtype=dtypes[1])
  call = jax.jit(lambda a, b, sa, sb: pallas_gemm.matmul(
      a, b, a_scale=sa, b_scale=sb, kernel="ffi/fp8_nn", config=config,
      preferred_element_type=jnp.bfloat16))
  out = call(qa, qb, sa, sb)
  assert out.dtype == jnp.bfloat16 and out.shape == (m, n)
  budget = max(tolerance(jnp.dtype(d).name, "default", "bfloat16")
               for d in dtypes)
  assert relative_error(out, ref) <= budget
  return call, (qa, qb, sa, sb), out


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="ffi/fp8_nn needs a Hopper GPU")
@pytest.mark.parametrize("dtypes", [(E5M2, E5M2), (E4M3, E5M2), (E5M2, E4M3)],
                         ids=lambda d: "x".join(jnp.dtype(t).name[8:] for t in d))
def test_ffi_fp8_nn_e5m2_and_mixed(dtypes):
  _check_ffi_fp8_nn((257, 144, 272), ("tensor", "tensor"), dtypes)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="ffi/fp8_nn needs a Hopper GPU")
@pytest.mark.parametrize("shape", [(0, 16, 32), (16, 32, 0)],
                         ids=["m0", "k0"])
def test_ffi_fp8_nn_zero_sizes(shape):
  m, n, k = shape
  a = jnp.ones((m, k), E4M3)
  b = jnp.ones((k, n), E4M3)
  out = pallas_gemm.matmul(a, b, kernel="ffi/fp8_nn",
                           preferred_element_type=jnp.bfloat16)
  assert out.shape == (m, n)
  np.testing.assert_array_equal(np.asarray(out, np.float32), 0)


# ffi/fp8_nn's K split: short M leaves fewer output tiles than SMs.

def test_ffi_fp8_nn_splits_k_only_where_tiles_are_few():
  decode = ffi_fp8.heuristic(_nn_problem(m=16, n=4096, k=4096), HOPPER)
  assert decode.k_splits > 1 and decode.tile_m == 64
  assert ffi_fp8.heuristic(_nn_problem(m=65), HOPPER).tile_m == 256
  assert ffi_fp8.check_config(decode, _nn_problem(m=16, n=4096, k=4096),
                              HOPPER) is None
  # Enough tiles for the SMs, or too little K to share: no split.
  for m, n, k in ((4096, 4096, 4096), (16, 4096, 256), (1, 16, 16)):
    assert ffi_fp8.heuristic(_nn_problem(m=m, n=n, k=k),
                             HOPPER).k_splits == 1
  # Partials cost 8 bytes per output element per share: with M = 256 and
  # K = 2048 they would outweigh a quarter of B's bytes.
  assert ffi_fp8.heuristic(_nn_problem(m=256, n=2048, k=2048),
                           HOPPER).k_splits == 1
  for m in (1, 7, 64, 130, 255):
    for k in (1040, 4096, 12288):
      problem = _nn_problem(m=m, n=1024, k=k)
      config = ffi_fp8.heuristic(problem, HOPPER)
      assert ffi_fp8.check_config(config, problem, HOPPER) is None


def test_ffi_fp8_nn_config_errors_name_the_field():
  with pytest.raises(ValueError, match="k_splits"):
    ffi_fp8.Fp8NnConfig(k_splits=0)
  with pytest.raises(ValueError, match="k_splits"):
    ffi_fp8.Fp8NnConfig(k_splits=ffi_fp8.MAX_K_SPLITS + 1)
  with pytest.raises(ValueError, match="tile_m"):
    ffi_fp8.Fp8NnConfig(tile_m=128)
  # k = 1152 is 9 blocks of 128: 4 shares of 3 would leave the last empty.
  reason = ffi_fp8.check_config(ffi_fp8.Fp8NnConfig(4),
                                _nn_problem(m=16, k=1152), HOPPER)
  assert "k_splits=4" in reason and "use 3" in reason


def test_ffi_fp8_nn_gets_its_config_from_the_resolver(toolkit_found):
  problem = _nn_problem(m=16, n=4096, k=4096)
  chosen = dispatch.resolve(problem, HOPPER, "ffi/fp8_nn")
  assert chosen.config == ffi_fp8.heuristic(problem, HOPPER)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="ffi/fp8_nn needs a Hopper GPU")
@pytest.mark.parametrize("tile_m", [64, 256])
@pytest.mark.parametrize("shape,splits", [
    ((16, 4096, 4096), 2), ((16, 4096, 4096), 8), ((3, 256, 1040), 3),
    ((200, 400, 1008), 4), ((1, 16, 4096), 16), ((130, 272, 528), 1),
    ((64, 144, 272), 1)],
    ids=lambda x: "x".join(map(str, x)) if isinstance(x, tuple) else str(x))
def test_ffi_fp8_nn_k_splits_match_float64_and_repeat(shape, splits, tile_m):
  call, operands, out = _check_ffi_fp8_nn(
      shape, ("tensor", "tensor"), (E4M3, E4M3),
      config=ffi_fp8.Fp8NnConfig(splits, tile_m))
  np.testing.assert_array_equal(np.asarray(call(*operands)), np.asarray(out))


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="ffi/fp8_nn needs a Hopper GPU")
def test_ffi_fp8_nn_rejects_a_split_that_leaves_a_share_empty():
  a = jnp.ones((16, 1152), E4M3)
  b = jnp.ones((1152, 64), E4M3)
  with pytest.raises(ValueError, match="k_splits=4"):
    pallas_gemm.matmul(a, b, kernel="ffi/fp8_nn",
                       config=ffi_fp8.Fp8NnConfig(4),
                       preferred_element_type=jnp.bfloat16)
