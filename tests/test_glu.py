"""pallas_gemm.gated_linear_unit: the Mosaic kernel (interpret mode on a
CPU, compiled on a Hopper GPU) and the XLA form against float64, the
backward against jax.grad of the XLA form, vmap, errors, the resolution,
and the kernel's Mosaic lowering at the configs a GPU run will use."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_gemm import numerics
from pallas_gemm.devices import DeviceInfo
from pallas_gemm.gated_linear_unit import (GLU_ACTIVATIONS, GluConfig,
                                           GluProblem, explain,
                                           gated_linear_unit, glu_heuristic,
                                           reference_glu, resolve)
from pallas_gemm.gated_linear_unit import mosaic
from pallas_gemm.gated_linear_unit.configs import (MIN_SPLIT_STEPS,
                                                   k_steps, output_tiles)
from pallas_gemm.gated_linear_unit.arg_specs import glu_suite
from pallas_gemm.mosaic_backend.config import Dim
from kernel_test_base import lower_for_cuda

ON_GPU = jax.default_backend() == "gpu"
BF16 = jnp.bfloat16
H200 = DeviceInfo("gpu", "NVIDIA H200", (9, 0), 132, 227 * 1024)
A100 = DeviceInfo("gpu", "NVIDIA A100", (8, 0), 108, 163 * 1024)
CPU = DeviceInfo("cpu", "cpu")


def _inputs(x_shape, k, n, dtype=BF16, fused=False):
  keys = jax.random.split(numerics.fresh_key(), 2)
  x = numerics.random_normal(keys[0], x_shape, dtype)
  # Scaled so that the gate's pre-activations are O(1), where every
  # activation is far from linear.
  w = (jax.random.normal(keys[1], (k, 2, n), jnp.float32)
       / np.sqrt(k)).astype(dtype)
  weights = w if fused else (w[:, 0], w[:, 1])
  return x, w, weights


def _check(out, x, w, activation, tol=None):
  ref = reference_glu(x, w[:, 0], w[:, 1], activation)
  assert out.shape == ref.shape
  in_dtype = jnp.dtype(x.dtype).name
  precision = "ieee" if in_dtype == "float32" else "default"
  tol = tol or numerics.tolerance(in_dtype, precision,
                                  jnp.dtype(out.dtype).name)
  error = numerics.relative_error(out, ref)
  assert error <= tol, f"relative error {error} > {tol}"


# ------------------------------------------------------ forward vs float64

# Every activation once, on small ragged shapes, alternating the weights'
# layout and covering the config variants (interpret mode is slow: few,
# small cases). None: the heuristic's config.
MOSAIC_CASES = [
    # The production tile (CTA 128 x 128, two staging slots), with the
    # fast_math epilogue (silu through tanh) and the second consumer one
    # step behind; three tiles of two k-steps over the two CTAs.
    ("silu", (72, 128), 384, False,
     GluConfig(max_concurrent_steps=2, fast_math=True, consumer_lag=1)),
    # Consumers split N; the CTA's 128 columns span the whole fused array.
    ("gelu", (64, 128), 64, True,
     GluConfig(tile_n=64, wg_dimension=Dim.N, max_concurrent_steps=2)),
    ("gelu_exact", (130, 64), 64, False,
     GluConfig(tile_m=128, tile_n=64, epi_tile_n=32, max_concurrent_steps=3)),
    ("relu", (1, 64), 128, True, None),                  # M = 1
    # Leading batch dims; a CTA tile (256 columns) wider than the fused
    # (k, 2n) view, which is then padded.
    ("sigmoid", (2, 3, 64), 64, True,
     GluConfig(tile_n=128, wg_dimension=Dim.N, max_concurrent_steps=2,
               fast_math=True)),
    # Primes; fused weights with n off the swizzle span are split (a copy).
    ("identity", (67, 97), 131, True, None),
    # The contraction split in two runs of two k-steps: float32 partials,
    # summed and gated by XLA; a prime width, fused weights split.
    ("silu", (72, 256), 131, True,
     GluConfig(max_concurrent_steps=2, k_splits=2)),
    # Split, with rows past a whole CTA tile (200 = 128 + 72): each split's
    # partials start on a whole tile of rows (the last tile's rows past m
    # once overwrote the next split's first rows).
    ("gelu", (200, 256), 64, False,
     GluConfig(max_concurrent_steps=2, tile_n=64, k_splits=2)),
]


@pytest.mark.parametrize("activation,x_shape,n,fused,config", MOSAIC_CASES)
def test_mosaic_forward_vs_float64(activation, x_shape, n, fused, config):
  x, w, weights = _inputs(x_shape, x_shape[-1], n, fused=fused)
  out = gated_linear_unit(x, weights, activation=activation, kernel="mosaic",
                          config=config)
  assert out.dtype == BF16 and out.shape == x_shape[:-1] + (n,)
  _check(out, x, w, activation)


@pytest.mark.slow
def test_mosaic_fused_weights_with_ragged_n_and_f32_output():
  # n = 131 is no multiple of the swizzle span: the fused weights are split
  # (one copy) instead of read in place.
  x, w, weights = _inputs((40, 64), 64, 131, fused=True)
  out = gated_linear_unit(x, weights, kernel="mosaic",
                          preferred_element_type=jnp.float32)
  assert out.dtype == jnp.float32
  _check(out, x, w, "silu", tol=1e-2)


@pytest.mark.parametrize("k,config", [
    (64, GluConfig(max_concurrent_steps=2)),
    # Four runs of one k-step, two output tiles each: eight tiles.
    (256, GluConfig(max_concurrent_steps=2, tile_n=64, k_splits=4)),
])
def test_mosaic_residuals_are_the_products(k, config):
  x, w, weights = _inputs((64, k), k, 128, fused=True)
  problem = GluProblem(64, 128, k, "bfloat16", "bfloat16", "gelu",
                       fused_weights=True)
  out, gate, up = mosaic.glu_forward(
      x, weights, problem=problem, config=config, residuals=True,
      interpret=not ON_GPU)
  assert gate.dtype == up.dtype == out.dtype == BF16
  x64 = np.asarray(x.astype(jnp.float32), np.float64)
  w64 = np.asarray(w.astype(jnp.float32), np.float64)
  assert numerics.relative_error(gate, x64 @ w64[:, 0]) < 1e-2
  assert numerics.relative_error(up, x64 @ w64[:, 1]) < 1e-2
  _check(out, x, w, "gelu")


@pytest.mark.skipif(ON_GPU, reason="race detection runs in interpret mode")
def test_mosaic_has_no_races_interpret():
  """The production tile with the second consumer one step behind, over
  tiles that wrap the ring, separate and fused weights, and the contraction
  split: the race detector sees no shared-memory race."""
  from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
  from jax.experimental.pallas import mosaic_gpu as plgpu
  for fused, k_splits in ((False, 1), (True, 1), (False, 2)):
    x, w, weights = _inputs((72, 128), 128, 256, fused=fused)
    problem = GluProblem(72, 256, 128, "bfloat16", "bfloat16", "silu",
                         fused_weights=fused)
    out = mosaic.glu_forward(
        x, weights, problem=problem,
        config=GluConfig(max_concurrent_steps=2, consumer_lag=1,
                         k_splits=k_splits),
        interpret=plgpu.InterpretGPUParams(detect_races=True))
    assert not interpret_pallas_call.get_races().races_found
    _check(out, x, w, "silu")


@pytest.mark.parametrize("activation,dtype", [
    (name, "bfloat16") for name in sorted(GLU_ACTIVATIONS)] + [
        ("silu", "float32"), ("gelu_exact", "float32")])
def test_xla_forward_vs_float64(activation, dtype):
  x, w, weights = _inputs((3, 5, 48), 48, 40, dtype=dtype,
                          fused=activation < "r")
  out = gated_linear_unit(x, weights, activation=activation, kernel="xla",
                          precision=jax.lax.Precision.HIGHEST)
  _check(out, x, w, activation)


def test_zero_sized():
  x, _, weights = _inputs((0, 64), 64, 16)
  assert gated_linear_unit(x, weights).shape == (0, 16)
  x = jnp.ones((4, 0), BF16)
  weights = (jnp.ones((0, 16), BF16), jnp.ones((0, 16), BF16))
  out = gated_linear_unit(x, weights)
  assert out.shape == (4, 16) and not np.any(np.asarray(out, np.float32))


# ------------------------------------------------------------ the backward


def _xla_form_loss(x, weights, activation, cotangent):
  """The XLA form in float32 (jax.grad's reference)."""
  gate_w, up_w = (weights if isinstance(weights, tuple)
                  else (weights[:, 0], weights[:, 1]))
  f32 = lambda v: v.astype(jnp.float32)
  out = GLU_ACTIVATIONS[activation](f32(x) @ f32(gate_w)) * (f32(x) @ f32(up_w))
  return jnp.sum(out * cotangent)


@pytest.mark.parametrize("kernel,fused,activation", [
    # The backward is one function for both kernels: the Mosaic one once,
    # the other layout on the (fast) XLA forward.
    ("mosaic", False, "silu"),
    pytest.param("mosaic", True, "gelu_exact", marks=pytest.mark.slow),
    ("xla", True, "sigmoid"),
])
def test_grad_vs_jax_grad_of_xla_form(kernel, fused, activation):
  x, _, weights = _inputs((2, 20, 64), 64, 64, fused=fused)
  cotangent = numerics.random_normal(numerics.fresh_key(), (2, 20, 64),
                                     jnp.float32)

  def loss(x, weights):
    out = gated_linear_unit(x, weights, activation=activation, kernel=kernel)
    return jnp.sum(out.astype(jnp.float32) * cotangent)

  grads = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, weights)
  expected = jax.grad(_xla_form_loss, argnums=(0, 1))(x, weights, activation,
                                                      cotangent)
  for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(expected)):
    assert got.dtype == BF16 and got.shape == want.shape  # as lax's cotangents
    assert numerics.relative_error(got, np.asarray(want, np.float64)) < 2e-2


def test_grad_under_vmap_and_promoted_dtypes():
  # x in float32 and bf16 weights promote to float32 (the XLA form runs);
  # the cotangent of x comes back in x's dtype.
  x, _, weights = _inputs((2, 8, 32), 32, 16, dtype=jnp.float32)
  weights = tuple(w.astype(BF16) for w in weights)

  def loss(x_row, weights):
    return jnp.sum(gated_linear_unit(x_row, weights) ** 2)

  grads = jax.vmap(jax.grad(loss, argnums=(0, 1)), in_axes=(0, None))(
      x, weights)
  expected = jax.vmap(jax.grad(_sq_loss, argnums=(0, 1)),
                      in_axes=(0, None))(x, weights)
  assert grads[0].dtype == jnp.float32 and grads[1][0].dtype == BF16
  for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(expected)):
    assert numerics.relative_error(got, np.asarray(want.astype(jnp.float32),
                                                   np.float64)) < 2e-2


def _sq_loss(x, weights):
  w = tuple(v.astype(jnp.float32) for v in weights)
  return jnp.sum((GLU_ACTIVATIONS["silu"](x @ w[0]) * (x @ w[1])) ** 2)


# -------------------------------------------------------------------- vmap


@pytest.mark.slow
def test_vmap_over_x_runs_one_mosaic_call():
  x, w, weights = _inputs((2, 24, 64), 64, 64, fused=True)
  out = jax.jit(jax.vmap(lambda xi: gated_linear_unit(
      xi, weights, kernel="mosaic")))(x)
  _check(out, x, w, "silu")


def test_vmap_over_weights():
  x, w, _ = _inputs((3, 16, 32), 32, 40)
  stacked = jnp.stack([w, w * 0.5, -w])  # (3, k, 2, n)
  out = jax.vmap(lambda xi, wi: gated_linear_unit(xi, wi, kernel="xla"))(
      x, stacked)
  for i, scale in enumerate((1.0, 0.5, -1.0)):
    ws = (w * scale).astype(BF16)
    _check(out[i], x[i], ws, "silu")


# ------------------------------------------------------------------ errors


@pytest.mark.parametrize("kwargs,weights_kind,error,match", [
    ({"activation": "swish"}, "pair", ValueError, "activation"),
    ({"activation": jax.nn.silu}, "pair", TypeError, "activation"),
    ({"kernel": "triton"}, "pair", ValueError, "kernel"),
    ({"kernel": "xla", "config": GluConfig()}, "pair", ValueError, "config"),
    ({"config": "fast"}, "pair", TypeError, "config"),
    ({"preferred_element_type": jnp.int8}, "pair", TypeError,
     "preferred_element_type"),
    ({}, "triple", ValueError, "weights"),
    ({}, "k_mismatch", ValueError, "k="),
    ({}, "bad_fused", ValueError, r"\(k, 2, n\)"),
    ({}, "int_x", TypeError, "x has dtype"),
    ({}, "scalar_x", ValueError, "rank"),
    ({}, "none_weight", TypeError, r"weights\[1\]"),
])
def test_errors_name_the_argument(kwargs, weights_kind, error, match):
  x = jnp.ones((4, 32), BF16)
  w = jnp.ones((32, 16), BF16)
  weights = {"pair": (w, w), "triple": (w, w, w),
             "k_mismatch": (jnp.ones((8, 16), BF16),) * 2,
             "bad_fused": jnp.ones((32, 3, 16), BF16),
             "none_weight": (w, None)}.get(weights_kind, (w, w))
  if weights_kind == "int_x":
    x = jnp.ones((4, 32), jnp.int32)
  if weights_kind == "scalar_x":
    x = jnp.ones((), BF16)
  with pytest.raises(error, match=match):
    gated_linear_unit(x, weights, **kwargs)


def test_mosaic_rejects_float32_by_name():
  x, _, weights = _inputs((8, 32), 32, 16, dtype=jnp.float32)
  with pytest.raises(ValueError, match="TF32"):
    gated_linear_unit(x, weights, kernel="mosaic")


def test_config_register_budget():
  with pytest.raises(ValueError, match="registers"):
    GluConfig(tile_m=128, tile_n=128)


def test_k_splits_must_divide_the_k_steps_and_drop_fast_math():
  x, _, weights = _inputs((8, 512), 512, 64)  # 8 k-steps
  with pytest.raises(ValueError, match="k_splits=3 does not divide the 8"):
    gated_linear_unit(x, weights, config=GluConfig(k_splits=3,
                                                   max_concurrent_steps=2))
  with pytest.raises(ValueError, match="k_splits"):
    GluConfig(k_splits=0)
  with pytest.raises(ValueError, match="fast_math"):
    GluConfig(k_splits=2, fast_math=True)


# -------------------------------------------------------------- resolution


def _problem(m, n, k, dtype="bfloat16", fused=False):
  return GluProblem(m, n, k, dtype, dtype, "silu", fused)


def test_resolution():
  problem = _problem(4096, 11008, 4096)
  on_cpu = resolve(problem, CPU)
  assert on_cpu.kernel == "xla" and "interpret" in on_cpu.reason
  on_hopper = resolve(problem, H200)
  assert on_hopper.kernel == "mosaic" and on_hopper.source == "heuristic"
  assert on_hopper.config == glu_heuristic(problem, 132)
  on_ampere = resolve(problem, A100)
  assert on_ampere.kernel == "xla" and "Hopper" in on_ampere.reason
  huge = resolve(_problem(2**20, 4096, 4096), H200)
  assert huge.kernel == "xla" and "int32" in huge.reason
  f32 = resolve(_problem(64, 64, 64, "float32"), H200)
  assert f32.kernel == "xla" and "TF32" in f32.reason
  config = GluConfig(max_concurrent_steps=3)
  explicit = resolve(problem, CPU, config=config)
  assert explicit.kernel == "mosaic" and explicit.config is config
  with pytest.raises(ValueError, match="Hopper"):
    resolve(problem, A100, kernel="mosaic")
  # More rows than a decode batch (which runs XLA's form when its tiles
  # leave most SMs idle).
  x, _, weights = _inputs((256, 64), 64, 128)
  assert explain(x, weights).kernel == ("mosaic" if ON_GPU else "xla")
  x, _, weights = _inputs((8, 32), 32, 16)
  assert explain(x, weights).kernel == "xla"


@pytest.mark.parametrize("name,m,n,k", glu_suite())
def test_heuristic_configs_fit(name, m, n, k):
  del name
  for fused in (False, True):
    config = glu_heuristic(_problem(m, n, k, fused=fused), 132)
    assert config.fits(_problem(m, n, k)) and config.max_concurrent_steps >= 3


def test_heuristic_fast_math_only_for_16_bit_outputs():
  bf16 = glu_heuristic(_problem(4096, 11008, 4096), 132)
  f32_out = dataclasses.replace(_problem(4096, 11008, 4096),
                                out_dtype="float32")
  assert bf16.fast_math and bf16.consumer_lag == 0
  assert not glu_heuristic(f32_out, 132).fast_math


@pytest.mark.parametrize("m,n,k", [(1, 1500, 4096), (64, 1500, 4096),
                                   (16, 768, 2048), (1, 2048, 7168)])
def test_heuristic_splits_k_where_the_output_has_few_tiles(m, n, k):
  problem = _problem(m, n, k)
  config = glu_heuristic(problem, 132)
  tiles = output_tiles(problem, config)
  assert tiles * 2 <= 132 and config.k_splits > 1
  assert tiles * config.k_splits <= 132 and config.misfit(problem) is None
  assert k_steps(problem, config) // config.k_splits >= MIN_SPLIT_STEPS
  assert not config.fast_math and config.epi_tile_n == 32  # float32 rows


@pytest.mark.parametrize("m,n,k", [(8192, 14336, 4096), (1, 14336, 4096),
                                   (512, 1500, 4096), (64, 1536, 256)])
def test_heuristic_keeps_k_whole_where_tiles_fill_the_gpu_or_k_is_short(
    m, n, k):
  assert glu_heuristic(_problem(m, n, k), 132).k_splits == 1


def test_decode_batches_the_kernel_would_split_run_on_xla():
  few_tiles = resolve(_problem(16, 768, 2048), H200)
  assert few_tiles.kernel == "xla" and few_tiles.source == "fallback"
  assert "split" in few_tiles.reason and "kernel='mosaic'" in few_tiles.reason
  asked = resolve(_problem(16, 768, 2048), H200, kernel="mosaic")
  assert asked.kernel == "mosaic" and asked.config.k_splits > 1
  # More rows: the split kernel runs; a wide decode batch is not split.
  more_rows = resolve(_problem(128, 768, 2048), H200)
  assert more_rows.kernel == "mosaic" and more_rows.config.k_splits > 1
  wide = resolve(_problem(16, 14336, 4096), H200)  # 112 tiles
  assert wide.kernel == "mosaic" and wide.config.k_splits == 1
  # 80 tiles that no split spreads over more SMs in one wave.
  part_wave = resolve(_problem(24, 5120, 5120), H200)
  assert part_wave.kernel == "xla" and "61%" in part_wave.reason


@pytest.mark.parametrize("n,kernel", [(1500, "xla"), (2500, "xla"),
                                      (4100, "xla"), (1502, "mosaic"),
                                      (4093, "mosaic"), (4096, "mosaic")])
def test_weights_of_8_byte_rows_run_on_xla(n, kernel):
  """Pair weights whose rows are 8-byte but not 16-byte units: XLA's
  products run near their aligned speed while the kernel pads both weights;
  at 2- or 4-byte units XLA is slow and the kernel runs."""
  chosen = resolve(_problem(2048, n, 4096), H200)
  assert chosen.kernel == kernel, chosen
  if kernel == "xla":
    assert "8-byte" in chosen.reason
    assert resolve(_problem(2048, n, 4096), H200,
                   kernel="mosaic").kernel == "mosaic"
  # Fused weights (k, 2, n) are read in place: the rule does not apply.
  assert resolve(_problem(2048, n, 4096, fused=True), H200).kernel == "mosaic"


def test_heuristic_splits_n_for_decode():
  config = glu_heuristic(_problem(16, 14336, 4096), 132)
  assert config.wg_dimension == Dim.N and config.cta_tile_m == 64
  assert glu_heuristic(_problem(8192, 14336, 4096), 132).cta_tile_m == 128


# --------------------------------------------- Mosaic lowering for a GPU
# Interpret mode does not lower through Mosaic; these lower the real kernel
# for CUDA on this host, at the configs the heuristic picks for the shapes
# a GPU run measures, so that a compile error shows here first.

LOWERING_SHAPES = [(8192, 14336, 4096), (16, 14336, 4096),
                   (64, 1500, 4096),  # k split in four
                   pytest.param(4096, 11008, 4096, marks=pytest.mark.slow),
                   pytest.param(3000, 18944, 3584, marks=pytest.mark.slow)]


def _lower(problem, config, residuals):
  x = jax.ShapeDtypeStruct((problem.m, problem.k), problem.in_dtype)
  if problem.fused_weights:
    ws = (jax.ShapeDtypeStruct((problem.k, 2, problem.n), problem.in_dtype),)
  else:
    ws = (jax.ShapeDtypeStruct((problem.k, problem.n), problem.in_dtype),) * 2

  def call(x, *w):
    return mosaic.glu_forward(x, w[0] if problem.fused_weights else tuple(w),
                              problem=problem, config=config,
                              residuals=residuals, interpret=False)

  return lower_for_cuda(call, x, *ws)


@pytest.mark.parametrize("m,n,k", LOWERING_SHAPES)
@pytest.mark.parametrize("fused", [False, True])
def test_mosaic_lowers_for_cuda_at_heuristic_configs(m, n, k, fused):
  problem = _problem(m, n, k, fused=fused)
  config = glu_heuristic(problem, 132)
  for residuals in (False, True):
    assert "mosaic_gpu" in _lower(problem, config, residuals).as_text()


def test_x_in_registers_is_refused():
  with pytest.raises(NotImplementedError, match="x_in_registers"):
    GluConfig(x_in_registers=True)


@pytest.mark.parametrize("activation", sorted(GLU_ACTIVATIONS))
def test_mosaic_lowers_every_activation(activation):
  problem = dataclasses.replace(_problem(512, 1024, 512, fused=True),
                                activation=activation,
                                out_dtype="float32")
  _lower(problem, glu_heuristic(problem, 132), residuals=False)


# ---------------------------------------------------------- on a real GPU


@pytest.mark.hopper
@pytest.mark.parametrize("m,n,k,fused", [(2048, 4096, 1024, True),
                                         (1000, 2752, 1024, False),
                                         (16, 4096, 2048, True),
                                         (64, 1500, 4096, False),  # k split
                                         (192, 1536, 4096, False),
                                         (1, 768, 2048, True)])
def test_mosaic_on_gpu_vs_float64(m, n, k, fused):
  x, w, weights = _inputs((m, k), k, n, fused=fused)
  numerics.poison_allocator((m, n), BF16)
  out = gated_linear_unit(x, weights, kernel="mosaic")
  _check(out, x, w, "silu")
  # The second consumer started a step behind the first.
  problem = GluProblem(m, n, k, "bfloat16", "bfloat16", "silu", fused)
  config = dataclasses.replace(glu_heuristic(problem, 132), consumer_lag=1)
  out = gated_linear_unit(x, weights, kernel="mosaic", config=config)
  _check(out, x, w, "silu")


# -------------------------------------------------------------- benchmark


@pytest.mark.skipif(ON_GPU, reason="the CPU smoke run of the benchmark")
def test_bench_glu_smoke(tmp_path):
  import json
  from experiments import bench_glu
  bench_glu.main(["--targets=xla,two_dots,auto", "--modes=fwd",
                  "--weights=pair", "--max_cases=1",
                  f"--output_dir={tmp_path}"])
  results = json.loads((tmp_path / "results.json").read_text())
  assert results["metadata"]["git"] and results["metadata"]["jax_version"]
  rows = results["results"]
  assert {r["target"] for r in rows} == {"xla", "two_dots", "auto"}
  assert all(r["status"] == "ok" for r in rows), rows
  assert "× xla" in (tmp_path / "README.md").read_text()


@pytest.mark.skipif(ON_GPU, reason="the CPU smoke run of the benchmark")
def test_bench_glu_runs_explicit_shapes(tmp_path):
  """--shapes replaces the suite (decode batches, widths that are not
  64-column spans)."""
  import json
  from experiments import bench_glu
  bench_glu.main(["--targets=xla", "--modes=fwd", "--shapes=3x130x64",
                  f"--output_dir={tmp_path}"])
  rows = json.loads((tmp_path / "results.json").read_text())["results"]
  assert [(r["m"], r["n"], r["k"]) for r in rows] == [(3, 130, 64)]


def test_bench_glu_rejects_counts_it_cannot_honour():
  """--iters below 1, a negative --max_cases and a malformed --shapes stop
  the run (a negative count used to drop shapes from the end)."""
  from experiments import bench_glu
  for bad in ("--iters=0", "--max_cases=-1", "--shapes=8x200"):
    with pytest.raises(SystemExit):
      bench_glu.main(["--targets=xla", bad])


def _fake_paired_cupti(monkeypatch):
  """Fakes CUPTI under paired timing: in each ABBA round of two calls xla
  takes 3 us a call and the kernel 2 us. Returns the list of timed calls."""
  from experiments.bench import timers
  calls = []

  def fake_samples(call, iters):
    calls.append(call)
    return [3.0 if len(calls) % 4 in (1, 0) else 2.0] * iters
  monkeypatch.setattr(timers, "_cupti_samples_us", fake_samples)
  return calls


def test_bench_glu_pairs_the_kernel_with_xla(monkeypatch):
  """Paired timing: the kernel and XLA's faster form are timed in
  interleaved rounds, and the row's ratio comes from those samples (CUPTI
  faked: xla 3 us a call, the kernel 2 us)."""
  from experiments import bench_glu
  order = _fake_paired_cupti(monkeypatch)
  case = ("smoke", 16, 64, 32)
  xla_row = {"xla_form": "pair"}
  row = {"target": "auto", "mode": "fwd+bwd", "note": ""}
  bench_glu.pair_with_xla(row, xla_row, case, fused=False,
                          activation="silu", iters=8, seed=0)
  assert row["paired_vs_xla"] == pytest.approx(1.5)
  assert "paired with xla's pair form" in row["note"]
  assert len(order) == 8  # four ABBA rounds of two calls


def test_bench_glu_pairs_earlier_rows_as_main_calls_it(monkeypatch, capsys):
  """The pairing step main runs after each xla row pairs the mosaic row of
  the same case (CUPTI faked); a row it cannot pair warns and is counted."""
  from experiments import bench_glu
  from experiments.bench import timers
  _fake_paired_cupti(monkeypatch)
  case = ("smoke", 16, 64, 32)
  base = {"model": "smoke", "m": 16, "weights": "pair", "mode": "fwd",
          "time_us": 3.0, "note": ""}
  mosaic_row = dict(base, target="mosaic")
  xla_row = dict(base, target="xla", xla_form="pair")
  bench_glu._pair_earlier_rows([mosaic_row, xla_row], xla_row, case,
                               activation="silu", iters=8, seed=0)
  assert mosaic_row["paired_vs_xla"] == pytest.approx(1.5)
  assert "not_paired" not in mosaic_row

  def broken(call, iters):
    raise RuntimeError("CUPTI recorded no kernels")
  monkeypatch.setattr(timers, "_cupti_samples_us", broken)
  mosaic_row = dict(base, target="mosaic")
  bench_glu._pair_earlier_rows([mosaic_row, xla_row], xla_row, case,
                               activation="silu", iters=8, seed=0)
  assert "paired_vs_xla" not in mosaic_row
  assert "CUPTI recorded no kernels" in mosaic_row["not_paired"]
  assert "not paired with xla" in capsys.readouterr().err


@pytest.mark.parametrize("case", [c for c in MOSAIC_CASES if c[-1]],
                         ids=lambda c: c[0])
def test_mosaic_lowers_the_tested_configs(case):
  # The interpret-mode cases above run compiled on a GPU: lower them here.
  activation, x_shape, n, fused, config = case
  problem = GluProblem(int(np.prod(x_shape[:-1])), n, x_shape[-1],
                       "bfloat16", "bfloat16", activation, fused)
  for residuals in (False, True):
    _lower(problem, config, residuals)
