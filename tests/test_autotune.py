"""The tuning cache: keys, round trip, atomic writes, env override, shipped
defaults, stale entries, smem filtering and the tune() loop (wall clock on a
CPU, in interpret mode, tiny problem)."""

from __future__ import annotations

import json
import os
import pathlib
import warnings

import pytest

from pallas_gemm import autotune, dispatch
from pallas_gemm.devices import DeviceInfo
from pallas_gemm.problem import GemmProblem
from pallas_gemm.triton_backend.common import TritonConfig

warnings.filterwarnings("ignore", category=DeprecationWarning,
                        message=".*[Tt]riton.*")

GPU = DeviceInfo("gpu", "NVIDIA H200", (9, 0), 132, 227 * 1024)
SMALL_SMEM_GPU = DeviceInfo("gpu", "NVIDIA L4", (8, 9), 58, 99 * 1024)
CPU = DeviceInfo("cpu", "cpu")
KERNEL = "triton/06_tuned"


@pytest.fixture
def cache_dir(isolated_cache):
  return isolated_cache / "cache"


def problem(m=4096, n=4096, k=4096, dtype="bfloat16", **kwargs):
  return GemmProblem(1, m, n, k, dtype, dtype, **kwargs)


def test_shape_bucket():
  assert [autotune.shape_bucket(s) for s in (1, 2, 3, 4096, 4097)] == [
      1, 2, 4, 4096, 8192]
  with pytest.raises(ValueError, match="size=0"):
    autotune.shape_bucket(0)


def test_key_has_every_field():
  key = autotune.CacheKey.for_problem(
      problem(4000, 100, 9000, "float32", transpose_b=True,
              precision="tf32"), KERNEL, GPU)
  assert key.device == "nvidia_h200"
  assert key.entry_name == (
      "triton/06_tuned|float32|NT|tf32|1x4096x128x16384")
  assert autotune.CacheKey.parse(key.device, key.entry_name) == key


def test_keys_differ_by_dtype_layout_precision():
  base = problem(dtype="float32", precision="ieee")
  variants = [base, problem(dtype="bfloat16"),
              problem(dtype="float32", precision="tf32"),
              problem(dtype="float32", precision="ieee", transpose_a=True)]
  names = {autotune.CacheKey.for_problem(p, KERNEL, GPU).entry_name
           for p in variants}
  assert len(names) == len(variants)


def test_round_trip(cache_dir):
  config = TritonConfig(128, 256, 64, num_warps=8, num_stages=3, group_m=8)
  autotune.store(problem(), KERNEL, config, device=GPU, time_ms=0.25)
  assert autotune.lookup(problem(), KERNEL, GPU, TritonConfig) == config
  # Same bucket, other exact shape.
  assert autotune.lookup(problem(3000, 4000, 4096), KERNEL, GPU,
                         TritonConfig) == config
  assert autotune.lookup(problem(dtype="float16"), KERNEL, GPU,
                         TritonConfig) is None
  data = json.loads((cache_dir / "tuning" / "nvidia_h200.json").read_text())
  (record,) = data["entries"].values()
  assert record["time_ms"] == 0.25 and record["tflops"] > 0


def test_env_override_and_xdg(tmp_path, monkeypatch):
  monkeypatch.delenv(autotune.CACHE_DIR_ENV, raising=False)
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
  assert autotune.cache_dir() == tmp_path / "xdg" / "pallas_gemm"
  monkeypatch.setenv(autotune.CACHE_DIR_ENV, str(tmp_path / "mine"))
  assert autotune.cache_dir() == tmp_path / "mine"
  monkeypatch.delenv(autotune.CACHE_DIR_ENV)
  monkeypatch.delenv("XDG_CACHE_HOME")
  assert autotune.cache_dir() == pathlib.Path.home() / ".cache" / "pallas_gemm"


def test_write_is_atomic(cache_dir, monkeypatch):
  config = TritonConfig(64, 64, 32)
  autotune.store(problem(), KERNEL, config, device=GPU)
  path = cache_dir / "tuning" / "nvidia_h200.json"
  before = path.read_bytes()

  def crash(*args, **kwargs):
    raise OSError("disk full")
  monkeypatch.setattr(os, "replace", crash)
  with pytest.raises(OSError, match="disk full"):
    autotune.store(problem(8192, 8192, 8192), KERNEL, config, device=GPU)
  assert path.read_bytes() == before
  assert sorted(p.name for p in path.parent.iterdir()) == [
      "nvidia_h200.json", "nvidia_h200.json.lock"]


def test_store_merges_with_file(cache_dir):
  first, second = TritonConfig(64, 64, 32), TritonConfig(128, 128, 32)
  autotune.store(problem(), KERNEL, first, device=GPU)
  autotune.store(problem(8192, 8192, 8192), KERNEL, second, device=GPU)
  assert autotune.lookup(problem(), KERNEL, GPU, TritonConfig) == first
  assert autotune.lookup(problem(8192, 8192, 8192), KERNEL, GPU,
                         TritonConfig) == second


def test_corrupt_and_stale_entries_are_ignored(cache_dir):
  path = cache_dir / "tuning" / "nvidia_h200.json"
  path.parent.mkdir(parents=True)
  path.write_text("{not json")
  assert autotune.lookup(problem(), KERNEL, GPU, TritonConfig) is None
  key = autotune.CacheKey.for_problem(problem(), KERNEL, GPU)
  path.write_text(json.dumps({"version": 1, "entries": {
      key.entry_name: {"config": {"block_m": 24, "block_n": 64,
                                  "block_k": 32}}}}))
  with pytest.warns(RuntimeWarning, match="dropped 1 invalid"):
    assert autotune.lookup(problem(), KERNEL, GPU, TritonConfig) is None
  path.write_text(json.dumps({"version": 1, "entries": {
      key.entry_name: {"config": {"no_such_field": 1}, "pad": "x" * 40}}}))
  with pytest.warns(RuntimeWarning, match="dropped 1 invalid"):
    assert autotune.lookup(problem(), KERNEL, GPU, TritonConfig) is None


def test_shipped_defaults_nearest_bucket(cache_dir, tmp_path, monkeypatch):
  shipped = tmp_path / "shipped"
  monkeypatch.setattr(autotune, "SHIPPED_DIR", shipped)
  config = TritonConfig(256, 128, 64, num_warps=8, num_stages=4)
  autotune.store(problem(8192, 8192, 8192), KERNEL, config, device=GPU,
                 path=shipped / "nvidia_h200.json")
  # One bucket away in M: served by the shipped entry.
  assert autotune.lookup(problem(4096, 8192, 8192), KERNEL, GPU,
                         TritonConfig) == config
  # Far away (M=1): not.
  assert autotune.lookup(problem(1, 8192, 8192), KERNEL, GPU,
                         TritonConfig) is None
  # The user's cache wins over shipped defaults.
  mine = TritonConfig(64, 64, 32)
  autotune.store(problem(8192, 8192, 8192), KERNEL, mine, device=GPU)
  assert autotune.lookup(problem(8192, 8192, 8192), KERNEL, GPU,
                         TritonConfig) == mine


def test_resolve_skips_cached_config_over_smem(cache_dir):
  big = TritonConfig(256, 256, 64, num_stages=4)
  autotune.store(problem(), KERNEL, big, device=SMALL_SMEM_GPU)
  resolution = dispatch.resolve(problem(), SMALL_SMEM_GPU, KERNEL)
  assert resolution.config != big
  assert resolution.config_source == "heuristic"


def test_fits_device():
  big = TritonConfig(256, 256, 64, num_stages=3)
  assert autotune.fits_device(big, problem(), GPU)
  assert not autotune.fits_device(big, problem(), SMALL_SMEM_GPU)
  assert autotune.fits_device(big, problem(), CPU)  # no limit known


def test_fits_device_counts_the_problem_not_only_its_dtype():
  # small_m stages one 64-row group of A up to M = 64, two above: a deep
  # ring of 64-column strips fits a decode problem and not one of M = 128.
  from pallas_gemm.mosaic_backend.config import SmallMConfig
  hopper = DeviceInfo("gpu", "NVIDIA H200", (9, 0), 132, 227 * 1024)
  deep = SmallMConfig(tile_n=64, tile_k=128, max_concurrent_steps=6)
  decode = GemmProblem(1, 8, 8192, 8192, "bfloat16", "bfloat16")
  wider = GemmProblem(1, 128, 8192, 8192, "bfloat16", "bfloat16")
  assert autotune.fits_device(deep, decode, hopper)
  assert not autotune.fits_device(deep, wider, hopper)


def test_tune_skips_smem_and_stores_best(cache_dir):
  small = problem(32, 48, 64, "float32", precision="ieee")
  fits = [TritonConfig(16, 16, 16), TritonConfig(32, 64, 32)]
  too_big = TritonConfig(256, 256, 128, num_stages=4)
  fake_cpu_with_limit = DeviceInfo("cpu", "cpu", None, 1, 99 * 1024)
  result = autotune.tune(small, KERNEL, fits + [too_big],
                         device=fake_cpu_with_limit, iterations=2)
  assert result.skipped_for_smem == (too_big,)
  assert result.best in fits
  assert len(result.timings) == 2
  assert autotune.lookup(small, KERNEL, fake_cpu_with_limit,
                         TritonConfig) == result.best


def test_tune_rejects_bad_arguments(cache_dir):
  with pytest.raises(ValueError, match="candidates"):
    autotune.tune(problem(32, 32, 32), KERNEL, [], device=CPU)
  with pytest.raises(ValueError, match="iterations"):
    autotune.tune(problem(32, 32, 32), KERNEL, [TritonConfig()], device=CPU,
                  iterations=0)
  with pytest.raises(ValueError, match="no registered search space"):
    autotune.search_space(problem(), "xla", GPU)


def test_search_space_registered_for_tuned():
  space = autotune.search_space(problem(), KERNEL, GPU)
  assert space and all(isinstance(c, TritonConfig) for c in space)
  assert len(set(space)) == len(space)


def test_tuning_rotates_operands_past_l2_for_small_problems():
  small = GemmProblem(1, 2048, 2048, 2048, "bfloat16", "bfloat16")
  large = GemmProblem(1, 8192, 8192, 8192, "bfloat16", "bfloat16")
  count = autotune.operand_set_count(small, on_gpu=True)
  set_bytes = (2048 + 2048) * 2048 * 2
  assert count * set_bytes >= 2 * autotune.L2_BYTES
  assert count <= autotune.MAX_OPERAND_SETS
  assert autotune.operand_set_count(large, on_gpu=True) == 1
  assert autotune.operand_set_count(small, on_gpu=False) == 1


def test_tune_shipped_rejects_exact_precision_for_16bit_dtypes(capsys):
  from experiments import tune_shipped
  with pytest.raises(SystemExit):
    tune_shipped._parse_args(["--precision=ieee", "--dtypes=bfloat16"])
  assert "--precision=ieee" in capsys.readouterr().err
  args = tune_shipped._parse_args(["--precision=ieee", "--dtypes=float32"])
  assert args.precision == "ieee"
