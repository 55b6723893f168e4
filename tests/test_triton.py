"""The Pallas-Triton ladder (rungs 1-6) through the shared suite, plus what
only this backend has: grouped order, split-K, edge-mask elision, smem
filtering, config validation, x64 mode and the ladder's structure (no rung
imports another).

On a CPU every kernel runs in interpret mode; on a GPU the same tests run
the compiled Triton kernels.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import pathlib
import warnings

import jax
import numpy as np
import pytest

import pallas_gemm
from kernel_test_base import KernelTestBase, check_matmul, make_operands
from pallas_gemm import autotune, dispatch, numerics, registry
from pallas_gemm.devices import DeviceInfo
from pallas_gemm.problem import GemmProblem
from pallas_gemm.triton_backend import (common, k01_naive, k05_split_k,
                                        k06_tuned, tuned_kernels)

warnings.filterwarnings("ignore", category=DeprecationWarning,
                        message=".*[Tt]riton.*")

H200_LIKE = DeviceInfo("gpu", "NVIDIA H200", (9, 0), 132, 227 * 1024)
ADA_LIKE = DeviceInfo("gpu", "NVIDIA L4", (8, 9), 58, 99 * 1024)


class TestNaive(KernelTestBase):
  KERNELS = ("triton/01_naive",)
  SHAPES = ((1, 37, 53), (97, 61, 131), (130, 66, 70))


class TestKLoop(KernelTestBase):
  KERNELS = ("triton/02_k_loop",)


class TestPipelined(KernelTestBase):
  KERNELS = ("triton/03_pipelined",)
  # The tile-shape logic is rung 2's; rungs 3-4 change compile options and
  # program order, so a few odd shapes cover their masking.
  SHAPES = ((1, 37, 53), (97, 61, 131), (130, 66, 70))


class TestGrouped(KernelTestBase):
  KERNELS = ("triton/04_grouped",)
  SHAPES = ((1, 37, 53), (97, 61, 131), (130, 66, 70))


class TestSplitK(KernelTestBase):
  KERNELS = ("triton/05_split_k",)
  # Split-K declines short K; these are long enough for two or more splits.
  SHAPES = ((1, 96, 1100), (17, 33, 1031), (130, 20, 1600))
  PROBE_SHAPE = (37, 45, 1100)

  def test_batched(self, kernel):
    # The base's batched shape has K=40, too short to split.
    check_matmul(kernel, (33, 20, 1100), "float32", batch=3,
                 precision="highest")


class TestTuned(KernelTestBase):
  KERNELS = ("triton/06_tuned",)


@pytest.mark.parametrize("shape", [(16, 40, 2000), (1, 80, 1500)])
def test_tuned_split_k_path(shape):
  """06_tuned's split-K dispatch, with an explicit config (no GPU needed)."""
  problem = GemmProblem(1, *shape, "bfloat16", "bfloat16")
  config = k06_tuned.TritonConfig(16, 32, 64, split_k=3, group_m=4)
  a, b = make_operands(shape, "bfloat16", batch=1)
  out = k06_tuned.tuned_matmul(a, b, None, None, problem=problem,
                               config=config, interpret=True)
  ref = numerics.reference_matmul(a, b)
  assert numerics.relative_error(out, ref) <= numerics.tolerance(
      "bfloat16", "default")


_PERSISTENT_CASES = [
    # (batch, m, n, k, dtype, layout, epilogue, programs_per_sm)
    (1, 130, 70, 90, "bfloat16", "NN", {}, 1),
    (2, 97, 61, 131, "float16", "TT",
     dict(alpha=0.5, beta=-1.0, with_c=True, with_bias=True,
          activation="gelu"), 2),
    (1, 64, 128, 64, "float32", "NT", {}, 1),
    (1, 1, 96, 80, "bfloat16", "TN", dict(with_bias=True), 3),
]


@pytest.mark.parametrize("case", _PERSISTENT_CASES)
def test_tuned_persistent_grid(case):
  """Rung 6 on a persistent grid: few programs, each looping over many
  tiles, with ragged edges, every layout, a batch and the full epilogue."""
  batch, m, n, k, dtype, layout, epi, programs_per_sm = case
  precision = "ieee" if dtype == "float32" else "default"
  epilogue = pallas_gemm.Epilogue(
      alpha=epi.get("alpha", 1.0), beta=epi.get("beta", 0.0),
      has_c=epi.get("with_c", False), has_bias=epi.get("with_bias", False),
      activation=epi.get("activation"))
  out_dtype = "float32" if epilogue.has_c else dtype
  problem = GemmProblem(batch, m, n, k, dtype, out_dtype,
                        transpose_a=layout[0] == "T",
                        transpose_b=layout[1] == "T", precision=precision,
                        epilogue=epilogue,
                        c_dtype="float32" if epilogue.has_c else None)
  a, b = make_operands((m, n, k), dtype, layout=layout, batch=batch)
  key = numerics.fresh_key()
  kc, kd = jax.random.split(key)
  c = (numerics.random_normal(kc, (batch, m, n), "float32")
       if epilogue.has_c else None)
  bias = (numerics.random_normal(kd, (n,), "float32")
          if epilogue.has_bias else None)
  config = common.TritonConfig(32, 32, 16, num_warps=4, num_stages=2,
                               group_m=2, programs_per_sm=programs_per_sm)
  out = k06_tuned.tuned_matmul(a, b, c, bias, problem=problem, config=config,
                               interpret=jax.default_backend() == "cpu")
  ref = numerics.reference_matmul(a, b, transpose_a=problem.transpose_a,
                                  transpose_b=problem.transpose_b,
                                  epilogue=epilogue, c=c, bias=bias)
  assert numerics.relative_error(out, ref) <= numerics.tolerance(
      dtype, precision, out_dtype)


def test_heuristic_is_persistent_for_16bit_on_hopper_only():
  problem = GemmProblem(1, 4096, 4096, 4096, "bfloat16", "bfloat16")
  assert k06_tuned.heuristic_config(problem, H200_LIKE).programs_per_sm == 1
  assert k06_tuned.heuristic_config(problem, ADA_LIKE).programs_per_sm == 0
  ieee = GemmProblem(1, 4096, 4096, 4096, "float32", "float32",
                     precision="ieee")
  assert k06_tuned.heuristic_config(ieee, H200_LIKE).programs_per_sm == 0
  with pytest.raises(ValueError, match="programs_per_sm"):
    common.TritonConfig(programs_per_sm=-1)


def test_split_k_is_deterministic():
  shape = (17, 33, 1031)
  a, b = make_operands(shape, "float32")
  run = jax.jit(lambda a, b: pallas_gemm.matmul(
      a, b, kernel="triton/05_split_k", precision="highest"))
  first = np.asarray(run(a, b))
  second = np.asarray(run(a, b))
  assert first.tobytes() == second.tobytes()


def test_split_k_epilogue_applied_once():
  # beta·c and the bias must be added after the reduction, not per split.
  check_matmul("triton/05_split_k", (9, 24, 2100), "bfloat16",
               out_dtype="float32", alpha=2.0, beta=0.5, with_c=True,
               with_bias=True, activation="silu")


def test_split_k_declines_full_outputs():
  problem = GemmProblem(1, 4096, 4096, 4096, "bfloat16", "bfloat16")
  reason = k05_split_k.supports(problem, H200_LIKE)
  assert reason is not None and "fill" in reason


def test_split_k_accepts_skinny_long_k():
  problem = GemmProblem(1, 16, 1024, 16384, "bfloat16", "bfloat16")
  assert k05_split_k.supports(problem, H200_LIKE) is None
  assert k05_split_k.heuristic_config(problem, H200_LIKE).split_k >= 2


def test_naive_declines_long_k_with_reason():
  problem = GemmProblem(1, 64, 64, 8192, "float32", "float32",
                        precision="ieee")
  reason = k01_naive.supports(problem, H200_LIKE)
  assert reason is not None and "k=8192" in reason


@pytest.mark.parametrize("grid_m,grid_n,group_m",
                         [(5, 7, 3), (1, 9, 8), (8, 1, 4), (6, 6, 1)])
def test_grouped_order_is_a_permutation(grid_m, grid_n, group_m):
  tiles = np.arange(grid_m * grid_n, dtype=np.int32)
  i, j = common.grouped_tile_index(tiles, grid_m=grid_m, grid_n=grid_n,
                                   group_m=group_m)
  pairs = set(zip(np.asarray(i).tolist(), np.asarray(j).tolist()))
  assert pairs == {(r, c) for r in range(grid_m) for c in range(grid_n)}


def test_grouped_order_walks_columns_within_group():
  i, j = common.grouped_tile_index(np.arange(6, dtype=np.int32), grid_m=4,
                                   grid_n=5,
                                   group_m=3)
  assert np.asarray(i).tolist() == [0, 1, 2, 0, 1, 2]
  assert np.asarray(j).tolist() == [0, 0, 0, 1, 1, 1]


def test_edge_masks_only_where_ragged():
  config = common.TritonConfig(64, 64, 32)
  exact = GemmProblem(1, 128, 64, 96, "bfloat16", "bfloat16")
  assert tuned_kernels.edge_masks_for(exact, config) == (
      tuned_kernels.EdgeMasks(False, False, False))
  ragged = GemmProblem(1, 130, 64, 97, "bfloat16", "bfloat16")
  assert tuned_kernels.edge_masks_for(ragged, config) == (
      tuned_kernels.EdgeMasks(True, False, True))


def test_smem_bytes_counts_stages_and_dtype():
  config = common.TritonConfig(128, 256, 64, num_stages=3)
  assert config.smem_bytes("bfloat16") == (128 + 256) * 64 * 2 * 3
  assert config.smem_bytes("float32") == 2 * config.smem_bytes("bfloat16")


def test_supports_rejects_config_over_smem():
  big = common.TritonConfig(256, 256, 128, num_warps=8, num_stages=4)
  problem = GemmProblem(1, 4096, 4096, 4096, "float32", "float32",
                        precision="ieee")
  reason = common.triton_supports(problem, ADA_LIKE, big)
  assert reason is not None and "shared memory" in reason


def test_split_k_declines_one_wave_decode():
  # 128 tiles on 132 SMs: the H200 sweep measured every split slower.
  problem = GemmProblem(1, 1, 8192, 8192, "bfloat16", "bfloat16")
  assert k05_split_k.supports(problem, H200_LIKE) is not None
  assert k06_tuned.heuristic_config(problem, H200_LIKE).split_k == 1


def test_tf32_heuristic_is_k_major_on_hopper_only():
  problem = GemmProblem(1, 4096, 4096, 4096, "float32", "float32",
                        precision="tf32")
  assert k06_tuned.heuristic_config(problem, H200_LIKE).k_major
  assert not k06_tuned.heuristic_config(problem, ADA_LIKE).k_major
  ieee = dataclasses.replace(problem, precision="ieee")
  assert not k06_tuned.heuristic_config(ieee, H200_LIKE).k_major


@pytest.mark.parametrize("layout", ["NN", "NT", "TN", "TT"])
def test_k_major_copy_all_layouts(layout):
  shape = (37, 45, 71)
  problem = GemmProblem(1, *shape, "float32", "float32",
                        transpose_a=layout[0] == "T",
                        transpose_b=layout[1] == "T", precision="ieee")
  a, b = make_operands(shape, "float32", layout=layout, batch=1)
  config = k06_tuned.TritonConfig(32, 32, 32, k_major=True)
  out = k06_tuned.tuned_matmul(a, b, None, None, problem=problem,
                               config=config, interpret=True)
  ref = numerics.reference_matmul(a, b, transpose_a=layout[0] == "T",
                                  transpose_b=layout[1] == "T")
  assert numerics.relative_error(out, ref) <= 1e-5


def test_shipped_h200_defaults_load():
  from pallas_gemm import autotune
  for shape, dtype, precision in [((8192, 8192, 8192), "bfloat16", "default"),
                                  ((4096, 4096, 4096), "float32", "tf32"),
                                  ((16, 8192, 8192), "bfloat16", "default")]:
    problem = GemmProblem(1, *shape, dtype, dtype, precision=precision)
    config = autotune.lookup(problem, "triton/06_tuned", H200_LIKE,
                             common.TritonConfig)
    assert config is not None, problem.describe()
    assert autotune.fits_device(config, problem, H200_LIKE)


def test_heuristic_fits_small_smem_devices():
  problem = GemmProblem(1, 4096, 4096, 4096, "bfloat16", "bfloat16")
  for device in (H200_LIKE, ADA_LIKE):
    config = k06_tuned.heuristic_config(problem, device)
    assert config.smem_bytes("bfloat16") <= device.smem_per_block
  assert (k06_tuned.heuristic_config(problem, ADA_LIKE)
          != k06_tuned.heuristic_config(problem, H200_LIKE))


def test_search_space_is_filtered_by_smem():
  from pallas_gemm import autotune
  problem = GemmProblem(1, 4096, 4096, 4096, "float32", "float32",
                        precision="tf32")
  space = k06_tuned.search_space(problem, ADA_LIKE)
  kept = [c for c in space if autotune.fits_device(c, problem, ADA_LIKE)]
  assert 0 < len(kept) < len(space)


TRITON_KERNELS = ["triton/01_naive", "triton/02_k_loop", "triton/03_pipelined",
                  "triton/04_grouped", "triton/05_split_k", "triton/06_tuned"]


@pytest.mark.parametrize("kernel", TRITON_KERNELS)
def test_registered_with_docstring(kernel):
  entry = registry.get_kernel(kernel)
  assert entry.runs_on_cpu and entry.config_cls is common.TritonConfig
  module = __import__(entry.fn.__module__, fromlist=["_"])
  rung = int(kernel.split("/")[1][:2])
  if rung == 1:
    assert module.__doc__.startswith("Rung 1")
  elif rung < 6:
    # A teaching rung names the one change it makes over the previous one.
    assert f"The one change over rung {rung - 1}" in module.__doc__
  else:
    assert "What it adds over rungs 3-5" in module.__doc__


def test_no_rung_imports_another_rung():
  """The teaching rungs are self-contained; shared modules hold only what
  the package README says they do."""
  folder = pathlib.Path(k06_tuned.__file__).parent
  for path in sorted(folder.glob("*.py")):
    tree = ast.parse(path.read_text())
    imported = {alias.name for node in ast.walk(tree)
                if isinstance(node, ast.ImportFrom)
                and node.module == "pallas_gemm.triton_backend"
                for alias in node.names}
    imported |= {node.module.rsplit(".", 1)[1] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.module
                 and node.module.startswith("pallas_gemm.triton_backend.")}
    rungs = {name for name in imported
             if name[:1] == "k" and name[1:3].isdigit()}
    if path.name != "__init__.py":
      assert not rungs, f"{path.name} imports rung(s) {sorted(rungs)}"


def test_bad_config_names_the_field():
  with pytest.raises(ValueError, match="block_k=24"):
    common.TritonConfig(64, 64, 24)
  with pytest.raises(ValueError, match="split_k=0"):
    dataclasses.replace(common.TritonConfig(), split_k=0)


@pytest.mark.parametrize("field,value,error", [
    ("split_k", 2.0, TypeError), ("group_m", 2.0, TypeError),
    ("block_m", "64", TypeError), ("num_stages", 2.5, TypeError),
    ("num_warps", True, TypeError), ("programs_per_sm", 1.0, TypeError),
    ("k_major", 1, TypeError), ("block_n", None, TypeError),
    ("block_m", 48, ValueError), ("block_k", 8, ValueError),
    ("num_warps", 3, ValueError), ("num_warps", 32, ValueError),
    ("split_k", 0, ValueError), ("num_stages", 0, ValueError),
    ("group_m", -1, ValueError), ("programs_per_sm", -1, ValueError),
    ("programs_per_sm", 9, ValueError)])
def test_config_fields_are_validated(field, value, error):
  with pytest.raises(error, match=f"{field}={value!r}"):
    common.TritonConfig(**{field: value})


def test_config_accepts_numpy_ints_as_ints():
  config = common.TritonConfig(block_m=np.int64(128), split_k=np.int32(2))
  assert type(config.block_m) is int and type(config.split_k) is int
  assert config == common.TritonConfig(block_m=128, split_k=2)


def test_every_shipped_triton_config_constructs():
  path = autotune.shipped_path(H200_LIKE.key)
  text = json.loads(path.read_text())
  records = list(text.get("entries", {}).values()) + [
      r for r in text.get("dispatch", {}).values()
      if str(r.get("kernel", "")).startswith("triton/")]
  triton = [r for r in records if isinstance(r, dict) and isinstance(
      r.get("config"), dict) and "block_m" in r["config"]]
  assert triton
  for record in triton:
    common.TritonConfig(**record["config"])


def test_cache_entry_with_fractional_split_k_is_dropped(tmp_path, monkeypatch,
                                                        request):
  """A tuning-cache entry with "split_k": 2.5 once reached the grid and
  failed there; now TritonConfig rejects it, the cache drops it with a
  warning, and matmul runs on the heuristic."""
  monkeypatch.setenv(autotune.CACHE_DIR_ENV, str(tmp_path))
  monkeypatch.delenv(autotune.AUTOTUNE_ENV, raising=False)
  dispatch.clear_cache()
  request.addfinalizer(dispatch.clear_cache)
  a = numerics.random_normal(jax.random.key(0), (48, 40), "float32")
  b = numerics.random_normal(jax.random.key(1), (40, 56), "float32")
  problem = GemmProblem(1, 48, 56, 40, "float32", "float32",
                        precision="ieee")
  cpu = pallas_gemm.device_info()
  if cpu.platform != "cpu":
    pytest.skip("checks the CPU cache file")
  key = autotune.CacheKey.for_problem(problem, "triton/06_tuned", cpu)
  path = autotune.cache_path(cpu.key)
  path.parent.mkdir(parents=True)
  fields = dataclasses.asdict(common.TritonConfig(32, 32, 16, split_k=2))
  fields["split_k"] = 2.5
  path.write_text(json.dumps({"version": 1, "entries": {
      key.entry_name: {"config": fields, "config_cls": "TritonConfig"}}}))
  with pytest.warns(RuntimeWarning, match="dropped 1 invalid"):
    out = pallas_gemm.matmul(a, b, kernel="triton/06_tuned",
                             precision="highest")
  ref = numerics.reference_matmul(a, b)
  assert numerics.relative_error(out, ref) <= numerics.tolerance(
      "float32", "ieee")
  assert json.loads(path.read_text())["entries"] == {}
  resolution = dispatch.resolve(problem, cpu, "triton/06_tuned")
  assert resolution.config_source == "heuristic"


# Every rung under x64, with a shape each accepts (rung 5 needs a long K).
_X64_CASES = [(kernel, (9, 24, 2100) if kernel == "triton/05_split_k"
               else (37, 45, 70)) for kernel in TRITON_KERNELS]


@pytest.mark.parametrize("kernel,shape", _X64_CASES)
def test_x64_mode(kernel, shape):
  """With jax_enable_x64 the Python ints in the index arithmetic used to
  become int64 and meet the int32 program ids (lax.div raised)."""
  with jax.enable_x64(True):
    check_matmul(kernel, shape, "bfloat16", layout="TN", out_dtype="float32",
                 beta=0.5, with_c=True, with_bias=True, activation="relu")


@pytest.mark.parametrize("config", [
    common.TritonConfig(16, 32, 16, group_m=2, programs_per_sm=2),
    common.TritonConfig(16, 32, 64, group_m=2, split_k=3),
    common.TritonConfig(32, 32, 32, k_major=True)])
def test_x64_mode_tuned_paths(config):
  """Rung 6's persistent, split-K and K-major paths under x64."""
  shape = (40, 70, 300)
  problem = GemmProblem(1, *shape, "float32", "float32", precision="ieee")
  with jax.enable_x64(True):
    a, b = make_operands(shape, "float32", batch=1)
    out = k06_tuned.tuned_matmul(a, b, None, None, problem=problem,
                                 config=config, interpret=True)
    assert out.dtype == np.float32
    ref = numerics.reference_matmul(a, b)
  assert numerics.relative_error(out, ref) <= numerics.tolerance(
      "float32", "ieee")


def test_x64_default_path():
  """The issue's reproducer: `matmul` of two f32 matrices, no kernel named."""
  with jax.enable_x64(True):
    a = numerics.random_normal(jax.random.key(2), (64, 64), "float32")
    b = numerics.random_normal(jax.random.key(3), (64, 64), "float32")
    out = pallas_gemm.matmul(a, b)
    assert out.dtype == np.float32
    ref = numerics.reference_matmul(a, b)
  assert numerics.relative_error(out, ref) <= numerics.tolerance(
      "float32", "tf32")


def test_cpu_auto_order_picks_tuned():
  problem = GemmProblem(1, 31, 29, 37, "float32", "float32", precision="ieee")
  device = pallas_gemm.device_info()
  if device.platform != "cpu":
    pytest.skip("checks the CPU auto order")
  assert registry.select_kernel(problem, device).name == "triton/06_tuned"


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 8192, 8192), (128, 8192, 8192),
                                   (4096, 4096, 4096)])
def test_gpu_tuned_large(shape):
  check_matmul("triton/06_tuned", shape, "bfloat16")
