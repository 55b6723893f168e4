"""The Mosaic GPU (Hopper) kernels: the shared suite plus backend specifics.

On a CPU both kernels run in Mosaic GPU interpret mode (slow: shapes stay
tiny); on an H100/H200 the same tests run the compiled kernels.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

import pallas_gemm
from kernel_test_base import KernelTestBase, lower_for_cuda
from pallas_gemm import numerics, registry
from pallas_gemm.devices import DeviceInfo
from pallas_gemm.mosaic_backend import config as cfg
from pallas_gemm.mosaic_backend import small_m, split_k, ws_persistent
from pallas_gemm.mosaic_backend.config import (Dim, MosaicConfig, SmallMConfig,
                                               SplitKConfig)
from pallas_gemm.problem import Epilogue, GemmProblem

warnings.filterwarnings("ignore", category=DeprecationWarning)

HOPPER = DeviceInfo("gpu", "NVIDIA H200", (9, 0), 132, 227 * 1024)
AMPERE = DeviceInfo("gpu", "NVIDIA A100", (8, 0), 108, 163 * 1024)


class TestMosaic(KernelTestBase):
  KERNELS = ("mosaic/ws_persistent", "mosaic/small_m")
  # Interpret mode costs seconds per case: one single row, one all-prime,
  # one just past a tile in every dimension.
  SHAPES = ((1, 96, 80), (31, 29, 37), (130, 66, 70))
  DTYPES = ("bfloat16", "float16", "float32")


class TestSplitK(KernelTestBase):
  """`mosaic/split_k` takes only M > 128 (below, `small_m` does): shapes
  just past a 128-row tile, ragged in every dimension."""
  KERNELS = ("mosaic/split_k",)
  SHAPES = ((129, 29, 37), (200, 130, 300))
  DTYPES = ("bfloat16", "float16", "float32")
  PROBE_SHAPE = (137, 45, 71)
  BATCHED_SHAPE = (131, 20, 40)


# A small config so that tiny problems still span several CTA tiles, K steps
# and epilogue sub-tiles, and the ring wraps around more than once.
SMALL_WS = MosaicConfig(tile_m=64, tile_n=64, tile_k=64, max_concurrent_steps=2,
                        epi_tile_m=64, epi_tile_n=32, grid_band=2,
                        wg_dimension=Dim.N)


def _operands(problem, seed):
  """Random-normal operands in the layout `problem` states (seed None:
  fresh ones on every call)."""
  key = numerics.fresh_key(seed)
  ka, kb, kc, kd = jax.random.split(key, 4)
  a_shape = ((problem.batch, problem.k, problem.m) if problem.transpose_a
             else (problem.batch, problem.m, problem.k))
  b_shape = ((problem.batch, problem.n, problem.k) if problem.transpose_b
             else (problem.batch, problem.k, problem.n))
  a = numerics.random_normal(ka, a_shape, problem.in_dtype)
  b = numerics.random_normal(kb, b_shape, problem.in_dtype)
  c = (numerics.random_normal(kc, (problem.batch, problem.m, problem.n),
                              problem.c_dtype) if problem.epilogue.has_c
       else None)
  bias = (numerics.random_normal(kd, (problem.n,), jnp.float32)
          if problem.epilogue.has_bias else None)
  return a, b, c, bias


def _run_checked(fn, problem, config, *, detect_races):
  a, b, c, bias = _operands(problem, seed=None)
  # On a GPU the kernel is compiled; the interpreter only runs on a CPU.
  params = (plgpu.InterpretGPUParams(detect_races=detect_races)
            if jax.default_backend() == "cpu" else False)
  out = fn(a, b, c, bias, problem=problem, config=config, interpret=params)
  ref = numerics.reference_matmul(
      a, b, transpose_a=problem.transpose_a, transpose_b=problem.transpose_b,
      epilogue=problem.epilogue, c=c, bias=bias)
  err = numerics.relative_error(out, ref)
  assert err <= numerics.tolerance(problem.in_dtype, problem.precision,
                                   problem.out_dtype), err


def _races_found() -> bool:
  from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
  return bool(interpret_pallas_call.get_races().races_found)


@pytest.mark.skipif(jax.default_backend() != "cpu",
                    reason="race detection runs in interpret mode")
def test_race_detector_is_live():
  """The control for the two tests below: two warpgroups write one shared
  buffer with nothing ordering them, and the detector must say so."""
  from jax.experimental import pallas as pl

  def body(x_gmem, out_gmem):
    del x_gmem

    def scoped(smem):
      wg = jax.lax.axis_index("wg")
      smem[...] = jnp.full(smem.shape, 1.0, jnp.float32) * wg.astype(
          jnp.float32)

      @pl.when(wg == 0)
      def _():
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(smem, out_gmem)
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(scoped, smem=plgpu.SMEM((8, 128), jnp.float32),
                  collective_axes="wg")

  racy = plgpu.kernel(
      body, out_type=jax.ShapeDtypeStruct((8, 128), jnp.float32), grid=(1,),
      grid_names=("x",), num_threads=2, thread_name="wg",
      interpret=plgpu.InterpretGPUParams(detect_races=True))
  jax.block_until_ready(racy(jnp.zeros((8, 128), jnp.float32)))
  assert _races_found()


@pytest.mark.skipif(jax.default_backend() != "cpu",
                    reason="race detection runs in interpret mode")
def test_ws_persistent_has_no_races():
  """Two CTAs, three warpgroups, a 2-stage ring reused across tiles, C and
  bias in the epilogue: the interpreter's happens-before check is clean."""
  epilogue = Epilogue(alpha=0.5, beta=-1.0, has_c=True, has_bias=True,
                      activation="silu")
  problem = GemmProblem(1, 70, 200, 150, "bfloat16", "float32",
                        transpose_b=True, epilogue=epilogue,
                        c_dtype="float32")
  _run_checked(ws_persistent.ws_persistent_matmul, problem, SMALL_WS,
                   detect_races=True)
  assert not _races_found()


@pytest.mark.skipif(jax.default_backend() != "cpu",
                    reason="race detection runs in interpret mode")
def test_small_m_split_k_has_no_races():
  problem = GemmProblem(1, 9, 130, 300, "bfloat16", "bfloat16")
  config = SmallMConfig(tile_n=64, tile_k=64, max_concurrent_steps=2,
                        k_splits=2)
  _run_checked(small_m.small_m_matmul, problem, config, detect_races=True)
  assert not _races_found()


@pytest.mark.skipif(jax.default_backend() != "cpu",
                    reason="race detection runs in interpret mode")
def test_split_k_has_no_races():
  """Row tiles, column strips and K splits over a 2-stage ring, the last
  row tile and K share ragged."""
  problem = GemmProblem(2, 200, 130, 300, "bfloat16", "bfloat16")
  config = SplitKConfig(tile_m=64, tile_n=64, max_concurrent_steps=2,
                        k_splits=2)
  _run_checked(split_k.split_k_matmul, problem, config, detect_races=True)
  assert not _races_found()


@pytest.mark.parametrize("transpose_a,transpose_b,epilogue", [
    (True, False, Epilogue()),
    (False, True, Epilogue(alpha=0.5, beta=1.0, has_c=True, has_bias=True,
                           activation="gelu"))])
def test_split_k_layouts_and_fused_epilogue(transpose_a, transpose_b,
                                            epilogue):
  """One split fuses the epilogue into the store; a transposed A is made
  K-major first."""
  problem = GemmProblem(1, 136, 72, 96, "float16", "float32",
                        transpose_a=transpose_a, transpose_b=transpose_b,
                        epilogue=epilogue,
                        c_dtype="float32" if epilogue.has_c else None)
  _run_checked(split_k.split_k_matmul, problem,
               SplitKConfig(tile_m=128, tile_n=64, max_concurrent_steps=2),
               detect_races=False)


def test_split_k_supports_only_few_tile_problems():
  few = GemmProblem(1, 640, 320, 880, "bfloat16", "bfloat16")
  assert split_k.supports(few, HOPPER) is None
  assert "small_m" in split_k.supports(
      GemmProblem(1, 64, 320, 880, "bfloat16", "bfloat16"), HOPPER)
  assert "ws_persistent" in split_k.supports(
      GemmProblem(1, 4096, 4096, 512, "bfloat16", "bfloat16"), HOPPER)
  assert "(n, k)" in split_k.supports(
      GemmProblem(1, 640, 320, 880, "float32", "float32", precision="tf32"),
      HOPPER)
  assert "Hopper" in split_k.supports(few, AMPERE)


@pytest.mark.parametrize("m,n,k", [(129, 64, 64), (640, 320, 880),
                                   (240, 192, 14720), (2000, 1000, 300)])
def test_split_k_heuristic_fits_and_splits_long_k(m, n, k):
  problem = GemmProblem(1, m, n, k, "bfloat16", "bfloat16")
  config = cfg.split_k_heuristic(problem, 132)
  assert config.fits(problem)
  assert config == cfg.split_k_heuristic(problem, 132)  # deterministic
  if k >= 8192:  # a few tiles, each with a long K loop: share it out
    assert config.k_splits > 1
  # It is the cheapest candidate the model sees.
  cost = cfg.split_k_cost(problem, config, 132)
  assert all(cost <= cfg.split_k_cost(problem, other, 132) * 1.0 / 0.99
             for other in split_k.search_space(problem, HOPPER))


def test_split_k_config_is_validated():
  with pytest.raises(ValueError, match="tile_m"):
    SplitKConfig(tile_m=96)
  with pytest.raises(ValueError, match="k_splits"):
    SplitKConfig(k_splits=0)
  with pytest.raises(TypeError, match="SplitKConfig"):
    split_k.split_k_matmul(None, None, None, None,
                           problem=GemmProblem(1, 200, 64, 64, "bfloat16",
                                               "bfloat16"),
                           config=SmallMConfig())


def test_ws_persistent_wg_split_along_m_and_batch():
  config = MosaicConfig(tile_m=64, tile_n=64, tile_k=64,
                        max_concurrent_steps=3, epi_tile_m=64, epi_tile_n=32,
                        grid_band=3, band_dim=Dim.N, wg_dimension=Dim.M)
  problem = GemmProblem(2, 130, 70, 90, "float16", "float16",
                        transpose_a=True)
  _run_checked(ws_persistent.ws_persistent_matmul, problem, config,
                   detect_races=False)


@pytest.mark.parametrize("m_tiles,n_tiles,band,band_dim", [
    (5, 7, 2, Dim.M), (5, 7, 3, Dim.N), (1, 9, 4, Dim.M), (8, 8, 8, Dim.N),
    (3, 1, 16, Dim.M)])
def test_tile_order_visits_every_tile_once(m_tiles, n_tiles, band, band_dim):
  batch = 2
  linear = jnp.arange(batch * m_tiles * n_tiles, dtype=jnp.int32)
  b, m, n = ws_persistent.tile_coordinates(
      linear, m_tiles=m_tiles, n_tiles=n_tiles,
      band_dim=band_dim, band=band)
  seen = {(int(x), int(y), int(z)) for x, y, z in zip(b, m, n)}
  assert len(seen) == batch * m_tiles * n_tiles
  assert all(0 <= y < m_tiles and 0 <= z < n_tiles for _, y, z in seen)


def test_configs_accept_numpy_and_json_values():
  config = MosaicConfig(tile_m=np.int64(64), tile_n=256, band_dim=0,
                        wg_dimension=1)
  assert type(config.tile_m) is int and config.band_dim is Dim.M
  assert config.wg_dimension is Dim.N
  assert SmallMConfig(k_splits=np.int32(2)).k_splits == 2
  # The removed schedules are no longer fields: a stale stored entry that
  # still names them is rejected (and dropped by the tuning cache).
  with pytest.raises(TypeError, match="pingpong"):
    MosaicConfig(pingpong=False)
  with pytest.raises(TypeError, match="cluster_dim"):
    MosaicConfig(cluster_dim=None)


def test_swizzle_span_is_checked_when_the_dtype_is_known():
  one = jnp.zeros((1, 64, 64), jnp.bfloat16)
  with pytest.raises(ValueError, match="tile_n=32"):
    ws_persistent.ws_persistent_matmul(
        one, one, None, None,
        problem=GemmProblem(1, 64, 64, 64, "bfloat16", "bfloat16"),
        config=MosaicConfig(tile_n=32, epi_tile_n=32), interpret=True)


def test_config_module_keeps_the_names_kernels_import():
  for name in ("tma_tiling", "pad_to_tiling", "pad_vector",
               "check_full_swizzle", "Dim", "MosaicConfig", "SmallMConfig",
               "ws_heuristic", "small_m_heuristic", "waves",
               "HOPPER_SMEM_BYTES", "MOSAIC_INPUT_DTYPES", "padded_dims",
               "unpad_output", "ws_candidates", "tiled_transforms"):
    assert hasattr(cfg, name), name
  for name in ("call_kernel", "interpret_params", "tile_coordinates"):
    assert hasattr(ws_persistent, name), name


def test_shared_memory_budget_is_checked_before_compiling():
  problem = GemmProblem(1, 4096, 4096, 4096, "bfloat16", "bfloat16")
  too_big = MosaicConfig(tile_m=128, tile_n=256, wg_dimension=Dim.N,
                         max_concurrent_steps=6)
  assert not too_big.fits(problem)
  with pytest.raises(ValueError, match="shared memory"):
    ws_persistent.ws_persistent_matmul(
        jnp.zeros((1, 64, 64), jnp.bfloat16), jnp.zeros((1, 64, 64),
                                                        jnp.bfloat16),
        None, None, problem=GemmProblem(1, 64, 64, 64, "bfloat16", "bfloat16"),
        config=too_big, interpret=True)
  candidates = cfg.ws_candidates(problem)
  assert candidates and all(c.fits(problem) for c in candidates)


@pytest.mark.parametrize("m,n,k", [(1, 8192, 8192), (16, 14336, 4096),
                                   (64, 4096, 14336), (128, 8192, 8192),
                                   (4095, 4097, 4093), (3, 5, 7)])
def test_heuristics_fit_in_shared_memory(m, n, k):
  for out_dtype, epilogue in (("bfloat16", Epilogue()), ("float32", Epilogue(
      beta=1.0, has_c=True, has_bias=True))):
    problem = GemmProblem(1, m, n, k, "bfloat16", out_dtype, epilogue=epilogue,
                          c_dtype="float32" if epilogue.has_c else None)
    assert cfg.ws_heuristic(problem, 132).fits(problem)
    if m <= 128:
      config = cfg.small_m_heuristic(problem, 132)
      tile_m = 64 if m <= 64 else 128
      assert config.smem_bytes(problem, tile_m) <= cfg.HOPPER_SMEM_BYTES


def test_supports_gives_reasons():
  ieee = GemmProblem(1, 64, 64, 64, "float32", "float32", precision="ieee")
  assert "fp32" in ws_persistent.supports(ieee, HOPPER)
  bf16 = GemmProblem(1, 4096, 4096, 4096, "bfloat16", "bfloat16")
  assert ws_persistent.supports(bf16, HOPPER) is None
  assert "Hopper" in ws_persistent.supports(bf16, AMPERE)
  assert "m=4096" in small_m.supports(bf16, HOPPER)
  decode = GemmProblem(1, 16, 4096, 4096, "bfloat16", "bfloat16")
  assert small_m.supports(decode, HOPPER) is None
  f32_weight_as_kn = GemmProblem(1, 16, 4096, 4096, "float32", "float32",
                                 precision="tf32")
  assert "(n, k)" in small_m.supports(f32_weight_as_kn, HOPPER)


def test_padding_only_touches_ragged_operands():
  aligned = jnp.ones((1, 256, 128), jnp.bfloat16)
  assert cfg.pad_to_tiling(aligned, (8, 64)) is aligned
  ragged = cfg.pad_to_tiling(jnp.ones((1, 13, 70), jnp.bfloat16), (8, 64),
                             (0, 128))
  assert ragged.shape == (1, 16, 128)
  np.testing.assert_array_equal(np.asarray(ragged[0, 13:], np.float32), 0)
  np.testing.assert_array_equal(np.asarray(ragged[0, :, 70:], np.float32), 0)


def test_one_consumer_kernels_read_16_element_rows_without_padding(
    monkeypatch):
  """Rows of 32- or 64-byte multiples get the widest swizzle they divide
  (no padding copy); 128-byte rows keep the 128-byte swizzle (the kernel
  unchanged); rows wgmma cannot read unswizzled (16-byte multiples) stay
  on the 128-byte swizzle and are padded."""
  from pallas_gemm import jaxpr_tools
  from pallas_gemm.mosaic_backend import tma
  assert tma.widest_swizzle("bfloat16", 4096, 640) == 128
  assert tma.widest_swizzle("bfloat16", 4096, 288) == 64
  assert tma.widest_swizzle("bfloat16", 592, 288) == 32
  assert tma.widest_swizzle("bfloat16", 600) == 128  # 16-byte rows: padded
  assert tma.widest_swizzle("float32", 8) == 32
  assert tma.swizzled_tiling(32, "bfloat16") == (8, 16)
  # Operands jnp.pad would not touch: no pad op in the traced kernel call.
  problem = GemmProblem(1, 200, 272, 592, "bfloat16", "bfloat16")
  config = split_k.heuristic(problem, HOPPER)
  a = jax.ShapeDtypeStruct((1, 200, 592), jnp.bfloat16)
  b = jax.ShapeDtypeStruct((1, 592, 272), jnp.bfloat16)

  def column_pads():
    jaxpr = jax.make_jaxpr(functools.partial(
        split_k.split_k_matmul, c=None, bias=None, problem=problem,
        config=config, interpret=True))(a, b)
    return [e for e in jaxpr_tools.equations(jaxpr.jaxpr)
            if e.primitive.name == "pad"
            and e.params["padding_config"][2] != (0, 0, 0)]

  assert not column_pads()
  # The 128-byte swizzle (the path before) pads A's K and B's N.
  monkeypatch.setattr(tma, "widest_swizzle",
                      lambda dtype, *dims: tma.SWIZZLE_BYTES)
  assert len(column_pads()) == 2


#: (source shape, output rows, output cols, source dtype, output dtype):
#: cuts, pads, a cut and pad at once, fp8 widened, one-column rows.
WINDOW_COPY_CASES = [
    ((2, 40, 64), 37, 61, "bfloat16", "bfloat16"),
    ((1, 24, 32), 23, 29, "float32", "float32"),
    ((2, 33, 77), 40, 128, "bfloat16", "bfloat16"),
    ((1, 30, 70), 40, 61, "float16", "float16"),
    ((3, 56, 61), 64, 64, "float8_e4m3fn", "bfloat16"),
    ((2, 9, 8), 7, 1, "bfloat16", "bfloat16"),
]


@pytest.mark.parametrize("case", WINDOW_COPY_CASES, ids=str)
def test_window_copy_cuts_pads_and_widens_as_xla_does(case):
  """Both copy kernels (the rule's tiled blocks, and a flat run) give XLA's
  slice, pad and convert of random values, in the interpreter."""
  from pallas_gemm.mosaic_backend import tma
  shape, rows, cols, dtype, out_dtype = case
  x = numerics.random_normal(jax.random.key(3), shape, dtype)
  padded = jnp.pad(x.astype(out_dtype),
                   ((0, 0), (0, max(rows - shape[1], 0)),
                    (0, max(cols - shape[2], 0))))
  want = np.asarray(padded[:, :rows, :cols], np.float32)
  for copy in (tma.row_tiling(cols), tma.TiledCut(rows=4, cols=16, warps=4),
               tma.FlatCut(elements=64, warps=4)):
    got = tma.window_copy(x, rows, cols, copy, dtype=out_dtype,
                          interpret=True)
    assert got.dtype == jnp.dtype(out_dtype), copy
    np.testing.assert_array_equal(np.asarray(got, np.float32), want,
                                  err_msg=str(copy))


def test_row_tiling_blocks_are_a_row_wide():
  """The cut's blocks are as wide as a row (at most 8192 columns), as many
  rows as make 4096 elements, 4-8 warps; copy fields must be powers of two
  and a cut must fit in its source."""
  from pallas_gemm.mosaic_backend import tma
  assert tma.row_tiling(4093) == tma.TiledCut(rows=1, cols=4096, warps=8)
  assert tma.row_tiling(77) == tma.TiledCut(rows=32, cols=128, warps=8)
  assert tma.row_tiling(12345) == tma.TiledCut(rows=1, cols=8192, warps=8)
  assert tma.row_tiling(1) == tma.TiledCut(rows=4096, cols=1, warps=8)
  for cols in (1, 3, 19, 300, 515, 1001, 2749, 6313, 8191, 70000):
    tiling = tma.row_tiling(cols)
    assert tiling.cols >= min(cols, tma.COPY_MAX_COLS) > tiling.cols // 2
    assert 4 <= tiling.warps <= 8
  with pytest.raises(ValueError, match="TiledCut.rows=3"):
    tma.TiledCut(rows=3, cols=128, warps=4)
  with pytest.raises(ValueError, match="FlatCut.warps=0"):
    tma.FlatCut(elements=1024, warps=0)
  x = jnp.zeros((1, 8, 8), jnp.bfloat16)
  with pytest.raises(ValueError, match=r"\(m, n\)=\(9, 8\)"):
    tma.cut_copy(x, 9, 8, tma.row_tiling(8), interpret=True)


def test_unpad_output_copies_only_rows_that_are_not_16_byte_units():
  """Compiled, a cut whose rows are whole 16-byte units stays XLA's slice
  (bfloat16 rows of 1504, float32 rows of 1500); others run the copy
  kernel, fp8 ones too (widened from bytes, which lowers for the GPU)."""
  from pallas_gemm import jaxpr_tools
  from pallas_gemm.mosaic_backend import tma

  def kernels(dtype, n):
    out = jax.ShapeDtypeStruct((1, 64, 1536), dtype)
    jaxpr = jax.make_jaxpr(lambda o: tma.unpad_output(o, 60, n,
                                                      on_gpu=True))(out)
    return [e.params["name"] for e in jaxpr_tools.equations(
        jaxpr.jaxpr, opaque=("pallas_call",))
            if e.primitive.name == "pallas_call"]

  assert kernels(jnp.bfloat16, 1504) == kernels(jnp.float32, 1500) == []
  assert kernels(jnp.bfloat16, 1500) == kernels(jnp.float32, 1501) == [
      "unpad_output"]
  lower_for_cuda(lambda x: tma.window_copy(x, 64, 7792, tma.row_tiling(7792),
                                           dtype=jnp.bfloat16),
                 jax.ShapeDtypeStruct((11, 56, 7792), jnp.float8_e4m3fn))


def test_cached_config_that_loses_a_wave_gives_way_to_the_heuristic():
  """A tuned 4096^3 entry (128x256 CTA tiles) makes 5 waves at N = 4097;
  the heuristic's 256x128 tiles make 4, so the heuristic is used there,
  while at 4096^3 itself the tuned entry stays."""
  odd = GemmProblem(1, 4095, 4097, 4093, "bfloat16", "bfloat16")
  even = GemmProblem(1, 4096, 4096, 4096, "bfloat16", "bfloat16")
  wide = MosaicConfig(tile_m=64, tile_n=256, wg_dimension=Dim.M)
  assert cfg.waves(odd, wide, 132) == 5
  assert cfg.waves(odd, cfg.ws_heuristic(odd, 132), 132) == 4
  entry = registry.get_kernel(ws_persistent.NAME)
  chosen = entry.default_config(odd, HOPPER)
  assert cfg.waves(odd, chosen, 132) == 4
  assert entry.default_config(even, HOPPER).cta_tile_n == 256


def test_stored_config_with_a_long_critical_path_gives_way():
  """A tuned 2048^3 entry (256x128 CTA tiles, one wave there) makes 20
  CTAs at 1024x640x1152, each twice the work of the heuristic's 40: the
  heuristic's tiles are used there, while at 2048^3 the entry stays."""
  tuned = MosaicConfig(tile_m=128, tile_n=128, wg_dimension=Dim.M)
  small = GemmProblem(1, 1024, 640, 1152, "bfloat16", "bfloat16")
  home = GemmProblem(1, 2048, 2048, 2048, "bfloat16", "bfloat16")
  reason = ws_persistent.check_config(tuned, small, HOPPER)
  assert reason is not None and "critical path" in reason
  assert ws_persistent.check_config(tuned, home, HOPPER) is None


def _check_public_call(problem, kernel, config, a, b, c, bias):
  """pallas_gemm.matmul on 2-D operands against the float64 reference."""
  out = pallas_gemm.matmul(
      a[0], b[0], transpose_a=problem.transpose_a,
      transpose_b=problem.transpose_b, c=None if c is None else c[0],
      bias=bias, alpha=problem.epilogue.alpha, beta=problem.epilogue.beta,
      activation=problem.epilogue.activation,
      preferred_element_type=problem.out_dtype, kernel=kernel, config=config)
  ref = numerics.reference_matmul(
      a, b, transpose_a=problem.transpose_a, transpose_b=problem.transpose_b,
      epilogue=problem.epilogue, c=c, bias=bias)[0]
  assert out.shape == ref.shape and out.dtype == jnp.dtype(problem.out_dtype)
  err = numerics.relative_error(out, ref)
  assert err <= numerics.tolerance(problem.in_dtype, problem.precision,
                                   problem.out_dtype), (kernel, err)


# Small problems (M <= 128, so both kernels take them), a fused epilogue on
# one, a transposed operand on the other.
_SMALL_PROBLEMS = (
    (GemmProblem(1, 9, 40, 64, "bfloat16", "float32",
                 epilogue=Epilogue(alpha=0.5, beta=1.0, has_c=True,
                                   has_bias=True, activation="relu"),
                 c_dtype="float32"), SMALL_WS),
    (GemmProblem(1, 70, 24, 96, "float16", "float16", transpose_b=True),
     SMALL_WS),
)


@pytest.mark.parametrize("kernel", ["mosaic/ws_persistent", "mosaic/small_m"])
def test_x64_mode_gives_the_same_results(kernel):
  """With x64 on (as many JAX users run) both kernels keep 32-bit index
  arithmetic and return the float64 reference's result."""
  for problem, ws_config in _SMALL_PROBLEMS:
    config = ws_config if kernel == "mosaic/ws_persistent" else None
    with jax.enable_x64(True):
      a, b, c, bias = _operands(problem, seed=None)
      _check_public_call(problem, kernel, config, a, b, c, bias)


@pytest.mark.parametrize("kernel", ["mosaic/ws_persistent", "mosaic/small_m"])
def test_compiled_kernels_trace_under_x64(kernel):
  """The compiled (GPU) path traces the kernel in the caller's x64 mode:
  its index arithmetic must not mix int32 and int64."""
  problem, ws_config = _SMALL_PROBLEMS[0]
  if kernel == "mosaic/ws_persistent":
    fn, config = ws_persistent.ws_persistent_matmul, ws_config
  else:
    fn, config = small_m.small_m_matmul, small_m.heuristic(problem, HOPPER)
  a, b, c, bias = _operands(problem, seed=3)
  with jax.enable_x64(True):
    jaxpr = jax.make_jaxpr(functools.partial(
        fn, problem=problem, config=config, interpret=False))(a, b, c, bias)
  assert jaxpr.out_avals[0].shape == (problem.batch, problem.m, problem.n)


def test_interpret_calls_from_threads_are_serialised():
  """The Mosaic GPU interpreter is not thread-safe: four threads, each
  calling both kernels on its own small problem, all get correct results."""
  failures = []

  def work(index):
    try:
      problem, ws_config = _SMALL_PROBLEMS[index % len(_SMALL_PROBLEMS)]
      problem = dataclasses.replace(problem, m=problem.m + index,
                                    n=problem.n + 8 * index)
      a, b, c, bias = _operands(problem, seed=index)
      for kernel, config in (("mosaic/ws_persistent", ws_config),
                             ("mosaic/small_m", None)):
        _check_public_call(problem, kernel, config, a, b, c, bias)
    except Exception as error:  # reported below, with the thread's index
      failures.append((index, repr(error)))

  threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
  for thread in threads:
    thread.start()
  for thread in threads:
    thread.join()
  assert not failures, failures
