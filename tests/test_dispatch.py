"""The one resolver: kernel and config chosen once per call, the measured
dispatch table read as data (xla chosen where it measured faster, the
nearest-bucket rule with its margin), and caches that survive bad files and
concurrent writers."""

from __future__ import annotations

import json
import multiprocessing
import os
import pathlib
import warnings

import jax
import jax.numpy as jnp
import pytest

import pallas_gemm
from pallas_gemm import autotune, dispatch, numerics
from pallas_gemm.devices import DeviceInfo
from pallas_gemm.problem import Epilogue, GemmProblem
from pallas_gemm.triton_backend.common import TritonConfig

warnings.filterwarnings("ignore", category=DeprecationWarning,
                        message=".*[Tt]riton.*")

HOPPER = DeviceInfo("gpu", "NVIDIA H200", (9, 0), 132, 227 * 1024)
WS = "mosaic/ws_persistent"


@pytest.fixture
def cache(isolated_cache):
  return isolated_cache


def problem(m=4096, n=4096, k=4096, dtype="bfloat16", **kwargs):
  return GemmProblem(1, m, n, k, dtype, dtype, **kwargs)


def write_table(tmp_path, records: dict[GemmProblem, dict]):
  """Each record measured on its key problem (as the builder lists them)."""
  path = tmp_path / "shipped" / f"{HOPPER.key}.json"
  autotune.update_section(path, "dispatch", {
      dispatch.DispatchKey.for_problem(p).name: {"problems": [p.describe()],
                                                 **r}
      for p, r in records.items()})
  return path


def assert_xla_in_its_bucket(other: GemmProblem, measured: GemmProblem,
                             why: str) -> None:
  """`other` shares `measured`'s bucket, yet resolves to xla for `why`."""
  assert (dispatch.DispatchKey.for_problem(other)
          == dispatch.DispatchKey.for_problem(measured))
  chosen = dispatch.resolve(other, HOPPER)
  assert chosen.kernel == "xla" and why in chosen.reason, chosen


# ---------------------------------------------------------- resolve once ---


def test_one_matmul_call_resolves_once(cache):
  a = numerics.random_normal(jax.random.key(0), (24, 40), jnp.float32)
  b = numerics.random_normal(jax.random.key(1), (40, 56), jnp.float32)
  before = dict(dispatch.STATS), dict(autotune.STATS)
  jax.jit(pallas_gemm.matmul)(a, b).block_until_ready()
  assert dispatch.STATS["resolutions"] - before[0]["resolutions"] == 1
  # The device has no tuning files: none was opened.
  assert autotune.STATS["json_reads"] == before[1]["json_reads"]
  # Tracing again (a new jit) is served from the memo.
  jax.jit(lambda x, y: pallas_gemm.matmul(x, y))(a, b).block_until_ready()
  assert dispatch.STATS["resolutions"] - before[0]["resolutions"] == 1


def test_table_file_is_parsed_once_for_many_resolutions(cache):
  write_table(cache, {problem(): {"kernel": WS, "ratio_to_xla": 1.1}})
  before = autotune.STATS["json_reads"]
  for m in (512, 1024, 2048, 4096, 8192):
    dispatch.resolve(problem(m=m), HOPPER)
  # The shipped file once; the user file does not exist.
  assert autotune.STATS["json_reads"] - before == 1


# ------------------------------------------------------ the dispatch table ---


def test_xla_chosen_where_xla_measured_faster(cache):
  write_table(cache, {
      problem(): {"kernel": "xla", "ratio_to_xla": 1.0},
      problem(16384, 16384, 16384): {"kernel": WS, "ratio_to_xla": 1.05},
  })
  chosen = dispatch.resolve(problem(), HOPPER)
  assert (chosen.kernel, chosen.kernel_source) == ("xla", "dispatch table")
  assert "xla measured fastest" in chosen.reason
  big = dispatch.resolve(problem(16384, 16384, 16384), HOPPER)
  assert (big.kernel, big.kernel_source) == (WS, "dispatch table")
  assert big.config is not None


def test_an_unmeasured_shape_of_a_measured_bucket_needs_the_margin(cache):
  write_table(cache, {
      problem(1216, 704, 256): {"kernel": WS, "ratio_to_xla": 1.025},
      problem(8192, 8192, 8192): {"kernel": WS, "ratio_to_xla": 1.20},
  })
  # The measured problem itself runs its bucket's winner.
  assert dispatch.resolve(problem(1216, 704, 256), HOPPER).kernel == WS
  # Another shape of the same bucket: a 2.5 % lead is within what a tile
  # count changes inside a bucket, so xla.
  same = problem(1152, 656, 272)
  assert (dispatch.DispatchKey.for_problem(same)
          == dispatch.DispatchKey.for_problem(problem(1216, 704, 256)))
  chosen = dispatch.resolve(same, HOPPER)
  assert (chosen.kernel, chosen.kernel_source) == ("xla", "dispatch table")
  assert "not measured itself" in chosen.reason
  # A wide lead carries to the bucket's other shapes.
  assert dispatch.resolve(problem(8192, 8192, 7168), HOPPER).kernel == WS


def test_a_tiled_kernel_needs_a_wave_of_tiles_off_its_measured_shape(cache):
  measured = problem(1536, 1024, 1536)  # a few dozen CTA tiles
  write_table(cache, {measured: {"kernel": WS, "ratio_to_xla": 1.5}})
  # The measured shape itself runs its winner.
  assert dispatch.resolve(measured, HOPPER).kernel == WS
  # Another shape of the bucket, under a wave of tiles: xla.
  assert_xla_in_its_bucket(problem(1408, 1216, 1664), measured,
                           "less than a wave")
  # Rows that are not 16-byte aligned are cuBLAS's slow path whatever the
  # tile count: the winner keeps them.
  ragged = problem(1537, 1024, 1537)
  write_table(cache, {ragged: {"kernel": WS, "ratio_to_xla": 2.0}})
  dispatch.clear_cache()
  assert dispatch.resolve(problem(1401, 1216, 1663), HOPPER).kernel == WS


def test_a_lead_measured_without_output_padding_is_not_lent_to_a_padded_shape(
    cache):
  """split_k won a bucket on a shape whose output rows are whole 128-byte
  spans (N = 320 bf16). A shape of that bucket with N = 336 pads and
  slices its output back, a copy no measured problem paid: xla runs. One
  with N = 384 pays none and keeps the winner."""
  measured = problem(640, 320, 896)
  write_table(cache, {measured: {"kernel": "mosaic/split_k",
                                 "ratio_to_xla": 2.0}})
  assert_xla_in_its_bucket(problem(640, 336, 896), measured, "sliced back")
  assert dispatch.resolve(problem(640, 384, 896), HOPPER).kernel == (
      "mosaic/split_k")


def test_a_lead_on_fast_reads_is_not_lent_to_a_narrow_swizzle_with_tall_tiles(
    cache):
  """split_k won a bucket on 1856x384x640, read through the 128-byte
  swizzle with 128-row tiles. 1856x384x624 (K rows of 32-byte spans) falls
  in the same bucket but would take the narrow swizzle with the same tall
  tiles, a path whose K steps are over twice as slow: xla runs. Once the
  bucket holds a problem measured on that path with that tile, the lead
  is lent."""
  config = {"tile_m": 128, "tile_n": 64, "tile_k": 64,
            "max_concurrent_steps": 6, "k_splits": 1}
  fast = problem(1856, 384, 640)
  write_table(cache, {fast: {"kernel": "mosaic/split_k", "ratio_to_xla": 2.0,
                             "configs": {fast.describe(): config}}})
  narrow = problem(1856, 384, 624)
  assert_xla_in_its_bucket(narrow, fast, "32-byte swizzle")
  # The same bucket measured on the narrow path with this tile.
  measured_narrow = problem(1792, 384, 624)
  key = dispatch.DispatchKey.for_problem(fast).name
  autotune.update_section(cache / "shipped" / f"{HOPPER.key}.json",
                          "dispatch", {key: {
      "kernel": "mosaic/split_k", "ratio_to_xla": 2.0,
      "problems": [fast.describe(), measured_narrow.describe()],
      "configs": {fast.describe(): config,
                  measured_narrow.describe(): config}}})
  dispatch.clear_cache()
  assert dispatch.resolve(narrow, HOPPER).kernel == "mosaic/split_k"


def test_nearest_bucket_with_margin(cache):
  write_table(cache, {
      problem(8192, 8192, 8192): {"kernel": WS, "ratio_to_xla": 1.10},
      problem(2048, 2048, 2048): {"kernel": WS, "ratio_to_xla": 1.01},
  })
  # 8192x8192x6144 is unmeasured; 8192^3 is half an octave away and won by
  # more than the margin there.
  near = dispatch.resolve(problem(8192, 8192, 6144), HOPPER)
  assert (near.kernel, near.kernel_source) == (WS, "nearest bucket")
  # 2048x2048x1536 is near 2048^3, whose lead is under the margin: xla.
  thin = dispatch.resolve(problem(2048, 2048, 1536), HOPPER)
  assert (thin.kernel, thin.kernel_source) == ("xla", "nearest bucket")
  assert "margin" in thin.reason
  # Nothing within reach: xla, said plainly.
  far = dispatch.resolve(problem(64, 64, 64), HOPPER)
  assert (far.kernel, far.kernel_source) == ("xla", "fallback")


@pytest.mark.parametrize("winner_ratio,neighbour_ratio,vetoed", [
    (1.10, 0.93, True),
    # Within 1 % of xla: timing noise, the same band a bucket's win must
    # clear, so no veto.
    (1.15, 0.995, False),
], ids=["loss", "tie"])
def test_a_nearby_loss_vetoes_the_nearest_winner_and_a_tie_does_not(
    cache, winner_ratio, neighbour_ratio, vetoed):
  write_table(cache, {
      problem(8192, 8192, 8192): {"kernel": WS, "ratio_to_xla": winner_ratio,
                                  "ratios": {WS: [winner_ratio]}},
      problem(8192, 8192, 3072): {"kernel": "xla", "ratio_to_xla": 1.0,
                                  "ratios": {WS: [neighbour_ratio]}},
  })
  assert dispatch.VETO_BELOW == 0.99
  between = dispatch.resolve(problem(8192, 8192, 6144), HOPPER)
  if vetoed:
    assert between.kernel == "xla" and "lost to xla" in between.reason
  else:
    assert between.kernel == WS, between.reason
  # Measured buckets still get their own winner.
  assert dispatch.resolve(problem(8192, 8192, 8192), HOPPER).kernel == WS


@pytest.mark.parametrize("loss_at_m,m,vetoed", [
    (2, 16, False),  # three octaves apart in M: no veto
    (2, 4, True),
    (32, 16, True),
    (2, 96, True),  # 96 is outside the streaming row: any loss vetoes
])
def test_a_streaming_row_loss_vetoes_only_nearby_rows(cache, loss_at_m, m,
                                                      vetoed):
  small_m = "mosaic/small_m"
  write_table(cache, {
      problem(64, 7168, 9728): {"kernel": small_m, "ratio_to_xla": 1.15,
                                "ratios": {small_m: [1.15]}},
      problem(64, 8576, 10496): {
          "kernel": "xla", "ratio_to_xla": 1.0,
          "problems": [problem(64, 8576, 10496).describe(),
                       problem(loss_at_m, 7552, 10496).describe()],
          "ratios": {small_m: [1.03, 0.95]}},
  })
  assert dispatch.DispatchKey.for_problem(problem(
      loss_at_m, 7552, 10496)) == dispatch.DispatchKey.for_problem(
          problem(64, 8576, 10496))
  chosen = dispatch.resolve(problem(m, 8192, 8192), HOPPER)
  if vetoed:
    assert chosen.kernel == "xla" and "lost to xla" in chosen.reason, chosen
  else:
    assert chosen.kernel == small_m, chosen.reason


def test_class_rule_when_a_kernel_wins_a_whole_class(cache):
  ragged = [problem(1024 * f + 1, 1024 * f, 1024 * f + 3) for f in (1, 2, 4)]
  write_table(cache, {p: {"kernel": WS, "ratio_to_xla": 1.5} for p in ragged})
  far = dispatch.resolve(problem(16385, 20000, 24577), HOPPER)
  assert (far.kernel, far.kernel_source) == (WS, "class rule")
  # One bucket of the class where xla won breaks the rule.
  write_table(cache, {problem(3000, 100, 301): {"kernel": "xla",
                                                "ratio_to_xla": 1.0}})
  dispatch.clear_cache()
  assert dispatch.resolve(problem(16385, 20000, 24577), HOPPER).kernel == "xla"


def test_no_class_rule_for_b_rows_of_8_byte_units_and_every_fp8_loss_counts(
    cache):
  """"ub8" (B's rows at 8-byte units, where cuBLAS is near its aligned
  speed on some shapes) is not decided by the class rule: out of the
  buckets' reach it falls back to xla. For fp8 a loss far below the
  problem counts against the class's wins."""
  ub8 = [problem(1024 * f, 1024 * f + 4, 1024 * f) for f in (1, 2, 4)]
  assert {dispatch.alignment(p) for p in ub8} == {"ub8"}
  fp8 = [_fp8(1024 * f + 1, 1024 * f, 1024 * f, scales="none",
              transpose_a=True) for f in (1, 2, 4)]
  write_table(cache, {p: {"kernel": k, "ratio_to_xla": 1.5}
                      for ps, k in ((ub8, WS), (fp8, "mosaic/fp8"))
                      for p in ps})
  far = dispatch.resolve(problem(16384, 20004, 16384), HOPPER)
  assert (far.kernel, far.kernel_source) == ("xla", "fallback"), far
  far_fp8 = _fp8(16385, 20000, 16384, scales="none", transpose_a=True)
  chosen = dispatch.resolve(far_fp8, HOPPER)
  assert (chosen.kernel, chosen.kernel_source) == ("mosaic/fp8",
                                                   "class rule"), chosen
  write_table(cache, {_fp8(1025, 64, 1024, scales="none", transpose_a=True):
                      {"kernel": "xla", "ratio_to_xla": 1.0,
                       "ratios": {"mosaic/fp8": [0.5]}}})
  dispatch.clear_cache()
  assert dispatch.resolve(far_fp8, HOPPER).kernel_source != "class rule"


def test_class_rule_does_not_reach_far_below_its_measured_sizes(cache):
  """A class's lead holds above its measured sizes and up to an octave
  below them, not at one row or a few narrow columns, where the kernels'
  pads of unaligned rows are most of the call; the fallback says why."""
  ragged = [problem(1024 * f + 1, 1024 * f, 1024 * f + 3) for f in (1, 2, 4)]
  write_table(cache, {p: {"kernel": WS, "ratio_to_xla": 1.5} for p in ragged})
  for m, n in ((16385, 20000), (600, 20000), (16385, 600)):
    assert dispatch.resolve(problem(m, n, 24577), HOPPER).kernel == WS, (m, n)
  for m, n in ((1, 20000), (64, 20000), (16385, 77)):
    chosen = dispatch.resolve(problem(m, n, 24577), HOPPER)
    assert (chosen.kernel, chosen.kernel_source) == ("xla", "fallback")
    assert "measured only at a batch, M, N or K more than" in chosen.reason


def test_class_rule_leaves_out_losses_far_below_the_problem(cache):
  """A problem of a few columns lost to xla on its pads: that says nothing
  of a problem more than an octave larger, which the class's leads speak
  for, and everything of one near it."""
  ragged = [problem(1024 * f + 1, 1024 * f, 1024 * f + 3) for f in (1, 2, 4)]
  records = {p: {"kernel": WS, "ratio_to_xla": 1.5, "ratios": {WS: [1.5]}}
             for p in ragged}
  records[problem(3000, 100, 301)] = {"kernel": "xla", "ratio_to_xla": 1.0,
                                      "ratios": {WS: [0.5]}}
  write_table(cache, records)
  far = dispatch.resolve(problem(16385, 20000, 24577), HOPPER)
  assert (far.kernel, far.kernel_source) == (WS, "class rule")
  assert "100% of the 3 measured buckets" in far.reason
  near_the_loss = dispatch.resolve(problem(6001, 150, 600), HOPPER)
  assert (near_the_loss.kernel, near_the_loss.kernel_source) == (
      "xla", "fallback")
  # Leads far above it alone do not reach down to it either.
  assert dispatch.resolve(problem(65, 20000, 24577), HOPPER).kernel == "xla"


def test_class_rule_counts_a_kernel_that_beat_xla_where_another_won(cache):
  """The rule asks that a kernel beat xla everywhere in the class, not that
  it be each bucket's winner: with another kernel faster in one bucket,
  the one that beat xla by the margin in all of them still carries."""
  ragged = [problem(1024 * f + 1, 1024 * f, 1024 * f + 3) for f in (1, 2, 4)]
  other = "mosaic/small_m"
  records = {p: {"kernel": WS, "ratio_to_xla": 1.5,
                 "ratios": {WS: [1.5], other: [1.2]}} for p in ragged[:2]}
  records[ragged[2]] = {"kernel": other, "ratio_to_xla": 1.6,
                        "ratios": {WS: [1.4], other: [1.6]}}
  write_table(cache, records)
  far = dispatch.resolve(problem(16385, 20000, 24577), HOPPER)
  assert (far.kernel, far.kernel_source) == (WS, "class rule")
  assert "100% of the 3 measured buckets" in far.reason
  # A bucket where it only tied xla keeps the rule while the clear leads
  # are at least CLASS_RULE_SHARE of the buckets (here 3 of 4 are not) ...
  # Not within reach of either query, and at most an octave below both.
  near = problem(32769, 12289, 14337)
  write_table(cache, {near: {
      "kernel": "xla", "ratio_to_xla": 1.0, "ratios": {WS: [0.995]}}})
  dispatch.clear_cache()
  assert dispatch.resolve(problem(16385, 20000, 24577), HOPPER).kernel == "xla"
  more = [problem(1024 * f + 1, 1024 * f, 1024 * f + 3)
          for f in (6, 8, 12, 16, 24, 32)]
  write_table(cache, {p: {"kernel": WS, "ratio_to_xla": 1.5,
                          "ratios": {WS: [1.5]}} for p in more})
  dispatch.clear_cache()
  assert dispatch.resolve(problem(65537, 20000, 24577), HOPPER).kernel == WS
  # ... and a loss anywhere in the class (below VETO_BELOW) breaks it.
  write_table(cache, {near: {
      "kernel": "xla", "ratio_to_xla": 1.0, "ratios": {WS: [0.95]}}})
  dispatch.clear_cache()
  assert dispatch.resolve(problem(65537, 20000, 24577), HOPPER).kernel == "xla"


def test_bucket_classes_do_not_mix(cache):
  write_table(cache, {problem(): {"kernel": WS, "ratio_to_xla": 1.2}})
  # Same sizes, another layout: not the same class, so no bucket.
  other = dispatch.resolve(problem(transpose_b=True), HOPPER)
  assert other.kernel_source == "fallback"
  fused = dispatch.resolve(problem(epilogue=Epilogue(activation="relu")),
                           HOPPER)
  assert fused.kernel_source == "fallback"


def _fp8(m=4096, n=4096, k=4096, scales="tensor", **kwargs):
  return GemmProblem(1, m, n, k, "float8_e4m3fn", "bfloat16",
                     a_scale_mode=scales,
                     b_scale_mode="col" if scales == "row" else scales,
                     **kwargs)


def test_fp8_buckets_are_classed_by_scales_and_old_keys_parse(cache):
  tensor, unscaled = _fp8(), _fp8(scales="none")
  key = dispatch.DispatchKey.for_problem(tensor)
  assert key.name.split("|")[6] == "float8_e4m3fn:tensor/tensor"
  assert dispatch.DispatchKey.parse(key.name) == key
  assert not key.same_class(dispatch.DispatchKey.for_problem(unscaled))
  # A 16-bit key has no scales field: tables written before fp8 buckets
  # parse to the same keys.
  bf16 = dispatch.DispatchKey.for_problem(problem())
  assert bf16.name.count("|") == 6 and bf16.operands == ""
  assert dispatch.DispatchKey.parse(bf16.name) == bf16


def test_fp8_takes_the_table_once_its_class_is_measured(cache):
  """xla runs an fp8 bucket where it measured faster, the kernel where it
  won; a class with no bucket (other scales) keeps the fp8 order."""
  write_table(cache, {
      _fp8(16, 8192, 8192): {"kernel": "xla", "ratio_to_xla": 1.0},
      _fp8(8192, 8192, 8192): {"kernel": "mosaic/fp8",
                               "ratio_to_xla": 1.2},
  })
  decode = dispatch.resolve(_fp8(16, 8192, 8192), HOPPER)
  assert (decode.kernel, decode.kernel_source) == ("xla", "dispatch table")
  big = dispatch.resolve(_fp8(8192, 8192, 8192), HOPPER)
  assert (big.kernel, big.kernel_source) == ("mosaic/fp8", "dispatch table")
  # Unscaled fp8 was not measured: not the tensor-scaled buckets' class,
  # so the order decides (mosaic/fp8 or ffi/fp8_nn first, never a
  # fallback to xla for want of a bucket).
  unscaled = dispatch.resolve(_fp8(128, 8192, 8192, scales="none"), HOPPER)
  assert unscaled.kernel_source == "order" and unscaled.kernel != "xla"
  assert dispatch.resolve(_fp8(16, 8192, 8192, scales="none"),
                          HOPPER).kernel_source == "order"


def test_an_fp8_class_this_gpu_never_measured_borrows_a_siblings(cache):
  """The H200's table has no fp8 bucket: an fp8 problem there is decided by
  the H100's buckets for its class, said so in the reason; without a
  sibling's bucket either, the fixed order; 16-bit classes never borrow."""
  write_table(cache, {problem(): {"kernel": WS, "ratio_to_xla": 1.2}})
  h100 = cache / "shipped" / "nvidia_h100.json"
  autotune.update_section(h100, "dispatch", {
      dispatch.DispatchKey.for_problem(p).name: {
          "problems": [p.describe()], "kernel": "xla", "ratio_to_xla": 1.0}
      for p in (_fp8(16, 4096, 4096, transpose_b=True),
                problem(1024, 1024, 1024))})
  chosen = dispatch.resolve(_fp8(16, 4096, 4096, transpose_b=True), HOPPER)
  assert chosen.kernel == "xla"
  assert "from the nvidia_h100 table" in chosen.reason
  # A class neither table measured keeps the order.
  other = dispatch.resolve(_fp8(128, 4096, 4096, scales="none"), HOPPER)
  assert other.kernel_source == "order"
  # bf16: this GPU's own table, as before.
  assert dispatch.resolve(problem(), HOPPER).kernel == WS
  assert "nvidia_h100" not in dispatch.resolve(problem(1024, 1024, 1024),
                                               HOPPER).reason


def test_an_unmeasured_fp8_class_of_unaligned_rows_follows_its_aligned_twin(
    cache):
  """No table measured fp8 with rows that are not 16-byte units: where the
  aligned sizes (N and K rounded up to 16, M as it is) resolve to xla, so
  does the unaligned problem; where they take a kernel, the order's
  kernel runs (above STREAMING_ROWS rows: at fewer, xla)."""
  write_table(cache, {
      _fp8(128, 4096, 4096, transpose_b=True): {"kernel": "xla",
                                                "ratio_to_xla": 1.0},
      _fp8(8192, 8192, 8192, transpose_b=True): {"kernel": "mosaic/fp8",
                                                 "ratio_to_xla": 1.2}})
  odd = dispatch.resolve(_fp8(128, 4093, 4090, transpose_b=True), HOPPER)
  assert (odd.kernel, odd.kernel_source) == ("xla", "aligned twin")
  assert "128x4096x4096" in odd.reason
  big = dispatch.resolve(_fp8(8192, 8191, 8192, transpose_b=True), HOPPER)
  assert big.kernel_source == "order" and big.kernel != "xla"
  # Aligned rows are the measured class's own: its buckets decide.
  assert dispatch.resolve(_fp8(128, 4096, 4096, transpose_b=True),
                          HOPPER).kernel_source == "dispatch table"


def test_an_aligned_fp8_class_measured_here_out_of_reach_asks_the_sibling(
    cache):
  """An aligned fp8 class this GPU measured only far away (narrow outputs)
  is decided by the sibling's bucket in reach before falling back to
  xla; where the sibling has none in reach either, xla."""
  write_table(cache, {_fp8(8192, 32, 2048, scales="none"):
                      {"kernel": "xla", "ratio_to_xla": 1.0}})
  h100 = cache / "shipped" / "nvidia_h100.json"
  autotune.update_section(h100, "dispatch", {
      dispatch.DispatchKey.for_problem(p).name: {
          "problems": [p.describe()], "kernel": "mosaic/fp8",
          "ratio_to_xla": 1.6}
      for p in (_fp8(1024, 1024, 1024, scales="none"),)})
  near = dispatch.resolve(_fp8(1024, 1024, 1024, scales="none"), HOPPER)
  assert near.kernel == "mosaic/fp8", near
  assert "from the nvidia_h100 table" in near.reason
  far = dispatch.resolve(_fp8(128, 16384, 16384, scales="none"), HOPPER)
  assert (far.kernel, far.kernel_source) == ("xla", "fallback"), far
  assert "nvidia_h100" not in far.reason


def test_an_unaligned_fp8_class_measured_only_out_of_reach_is_unmeasured_there(
    cache):
  """Buckets of unaligned fp8 decide within their reach; beyond it (where a
  few scattered buckets, some of them losses, give the class rule nothing)
  the problem follows its aligned twin and the order as an unmeasured
  class does, not xla for want of a bucket. An aligned fp8 class keeps the
  16-bit classes' fallback."""
  write_table(cache, {
      _fp8(128, 4096, 4096, transpose_b=True): {"kernel": "xla",
                                                "ratio_to_xla": 1.0},
      _fp8(8192, 8192, 8192, transpose_b=True): {"kernel": "mosaic/fp8",
                                                 "ratio_to_xla": 1.2},
      _fp8(7, 285, 801, transpose_b=True): {"kernel": "xla",
                                            "ratio_to_xla": 1.0},
      _fp8(94, 5459, 2065, transpose_b=True): {"kernel": "mosaic/fp8",
                                               "ratio_to_xla": 1.23}})
  # In reach of a bucket of its own class: that bucket decides.
  measured = dispatch.resolve(_fp8(7, 285, 801, transpose_b=True), HOPPER)
  assert (measured.kernel, measured.kernel_source) == ("xla",
                                                       "dispatch table")
  # Out of reach: the aligned twin (xla at 128x4096x4096) ...
  odd = dispatch.resolve(_fp8(128, 4093, 4090, transpose_b=True), HOPPER)
  assert (odd.kernel, odd.kernel_source) == ("xla", "aligned twin")
  # ... or, where the twin takes a kernel, the order.
  big = dispatch.resolve(_fp8(8192, 8191, 8192, transpose_b=True), HOPPER)
  assert big.kernel_source == "order" and big.kernel != "xla", big
  # Aligned fp8 with no bucket in reach of its measured class: xla.
  far = dispatch.resolve(_fp8(1, 256, 256, transpose_b=True), HOPPER)
  assert (far.kernel, far.kernel_source) == ("xla", "fallback"), far


def test_fp8_with_no_bucket_in_reach_follows_its_layouts_nearest_problems(
    cache):
  """An fp8 problem no bucket decides follows the FP8_NEIGHBOURS nearest
  problems measured in its layout and scales, of any alignment: a kernel
  where it beat xla on each of them, xla where it lost on one. Other
  scales are not neighbours, nor are tables without per-problem ratios;
  unaligned rows up to STREAMING_ROWS keep their rule."""
  def measured(*ratios):
    sizes = ((4096, 128, 2048), (8192, 64, 8192), (4096, 96, 4096))
    write_table(cache, {
        _fp8(*size, scales="none", transpose_a=True):
            {"kernel": "mosaic/fp8" if ratio > 1 else "xla",
             "ratio_to_xla": max(ratio, 1.0),
             "ratios": {"mosaic/fp8": [ratio]}}
        for size, ratio in zip(sizes, ratios)})
    dispatch.clear_cache()

  odd = _fp8(8192, 77, 4096, scales="none", transpose_a=True)
  assert dispatch.alignment(odd) == "ub"
  measured(1.8, 2.5, 1.3)
  won = dispatch.resolve(odd, HOPPER)
  assert (won.kernel, won.kernel_source) == ("mosaic/fp8", "fp8 neighbours")
  assert "every one of the 3 nearest" in won.reason, won
  measured(1.8, 2.5, 0.8)
  lost = dispatch.resolve(odd, HOPPER)
  assert (lost.kernel, lost.kernel_source) == ("xla", "fp8 neighbours"), lost
  measured(1.8, 2.5, 1.3)
  scaled = dispatch.resolve(
      _fp8(8192, 77, 4096, scales="tensor", transpose_a=True), HOPPER)
  assert scaled.kernel_source != "fp8 neighbours", scaled
  few = dispatch.resolve(_fp8(48, 77, 4096, scales="none", transpose_a=True),
                         HOPPER)
  assert (few.kernel, few.kernel_source) == ("xla", "fallback"), few
  write_table(cache, {_fp8(4096, 256, 2048, scales="none", transpose_b=True):
                      {"kernel": "mosaic/fp8", "ratio_to_xla": 1.8}})
  dispatch.clear_cache()
  unrated = dispatch.resolve(
      _fp8(8192, 77, 4096, scales="none", transpose_b=True), HOPPER)
  assert unrated.kernel_source != "fp8 neighbours", unrated


def test_decode_rows_share_a_bucket_but_a_gemv_has_its_own(cache):
  """M = 8 speaks for M = 48 (one streaming row); it does not speak for
  M = 1, where XLA runs a matrix-vector product."""
  write_table(cache, {problem(8, 8192, 8192): {"kernel": "mosaic/small_m",
                                               "ratio_to_xla": 1.15}})
  assert dispatch.resolve(problem(48, 8192, 8192), HOPPER).kernel == "mosaic/small_m"
  gemv = dispatch.resolve(problem(1, 8192, 8192), HOPPER)
  assert gemv.kernel == "xla" and gemv.kernel_source == "fallback"


def test_table_winner_that_cannot_run_falls_back(cache):
  write_table(cache, {problem(): {"kernel": "no/such_kernel",
                                  "ratio_to_xla": 2.0}})
  chosen = dispatch.resolve(problem(), HOPPER)
  assert chosen.kernel == "xla" and "not registered" in chosen.reason


def test_user_dispatch_overrides_shipped(cache):
  write_table(cache, {problem(): {"kernel": WS, "ratio_to_xla": 1.2}})
  autotune.update_section(autotune.cache_path(HOPPER.key), "dispatch", {
      dispatch.DispatchKey.for_problem(problem()).name: {
          "kernel": "xla", "ratio_to_xla": 1.0}})
  assert dispatch.resolve(problem(), HOPPER).kernel == "xla"


def test_table_config_is_used(cache):
  tuned = dispatch.resolve(problem(), HOPPER, WS).config
  import dataclasses
  other = dataclasses.replace(tuned, grid_band=tuned.grid_band * 2)
  write_table(cache, {problem(): {"kernel": WS, "ratio_to_xla": 1.2,
                                  "config": autotune.config_to_json(other)}})
  chosen = dispatch.resolve(problem(), HOPPER)
  assert chosen.config == other and chosen.config_source == "dispatch table"



def test_a_measured_config_serves_only_the_shape_it_was_measured_on(cache):
  measured = problem(8192, 8192, 8192)
  unmeasured = problem(8192, 8192, 7168)  # the same bucket
  heuristic = dispatch.resolve(unmeasured, HOPPER, WS).config
  import dataclasses
  other = dataclasses.replace(heuristic, grid_band=heuristic.grid_band * 2)
  write_table(cache, {measured: {
      "kernel": WS, "ratio_to_xla": 1.5, "ratios": {WS: [1.5]},
      "configs": {measured.describe(): autotune.config_to_json(other)}}})
  own = dispatch.resolve(measured, HOPPER)
  assert (own.kernel, own.config, own.config_source) == (
      WS, other, "dispatch table")
  near = dispatch.resolve(unmeasured, HOPPER)
  assert near.kernel == WS and near.config != other
  assert near.config_source != "dispatch table"

def test_alignment_is_part_of_the_bucket():
  assert dispatch.alignment(problem(4096, 4096, 4096)) == "a16"
  assert dispatch.alignment(problem(4096, 4096, 4095)) == "ua"
  # B's rows misaligned (A's whole units): at 2- or 4-byte units, or 8.
  assert dispatch.alignment(problem(4096, 4095, 4096)) == "ub"
  assert dispatch.alignment(problem(4096, 4094, 4096)) == "ub"
  assert dispatch.alignment(problem(4096, 4092, 4096)) == "ub8"
  # B stored (n, k): only the output's rows are misaligned.
  assert dispatch.alignment(problem(4096, 4095, 4096,
                                    transpose_b=True)) == "uc"
  # A stored (k, m): its rows are M's.
  assert dispatch.alignment(problem(4095, 4096, 4096,
                                    transpose_a=True)) == "ua"
  assert dispatch.alignment(problem(4095, 4096, 4096)) == "a16"  # M is free


ON_CPU = jax.default_backend() == "cpu"


@pytest.mark.skipif(not ON_CPU, reason="checks the CPU kernel order")
def test_explain_names_source_and_reason(cache):
  f32 = jnp.float32
  text = str(pallas_gemm.explain(jnp.ones((64, 64), f32),
                                 jnp.ones((64, 32), f32)))
  assert "triton/06_tuned (order)" in text and "heuristic" in text
  big = pallas_gemm.explain(jnp.ones((600, 600), f32), jnp.ones((600, 600), f32))
  assert big.kernels == ("xla",) and "interpret mode" in str(big)


def test_config_without_kernel_is_a_clear_error(cache):
  with pytest.raises(ValueError, match="name it too"):
    pallas_gemm.matmul(jnp.ones((600, 600)), jnp.ones((600, 600)),
                       config=TritonConfig())


# ----------------------------------------------------------------- caches ---


def test_bad_entry_is_dropped_rewritten_and_matmul_works(cache):
  path = autotune.cache_path(pallas_gemm.device_info().key)
  path.parent.mkdir(parents=True)
  bad = {"version": 1, "entries": {
      "triton/06_tuned|float32|NN|tf32|1x64x128x64": "x",
      "triton/06_tuned|float32|NN|tf32|1x64x64x64": {"config": {
          "block_m": 64, "block_n": 64, "block_k": 32, "no_field": 1}},
      "garbage key": {"config": {}}}}
  path.write_text(json.dumps(bad))
  a, b = jnp.ones((64, 64), jnp.float32), jnp.ones((64, 128), jnp.float32)
  with pytest.warns(RuntimeWarning, match="dropped 3 invalid"):
    out = pallas_gemm.matmul(a, b)
  assert float(out[0, 0]) == 64.0
  assert json.loads(path.read_text())["entries"] == {}


def test_fifo_in_place_of_the_cache_is_not_opened(cache):
  path = autotune.cache_path(HOPPER.key)
  path.parent.mkdir(parents=True)
  os.mkfifo(path)
  assert autotune.read_entries(path) == {}
  assert dispatch.resolve(problem(), HOPPER, WS).config_source == "heuristic"


def test_cache_dir_that_is_a_file(tmp_path, monkeypatch):
  not_a_dir = tmp_path / "file"
  not_a_dir.write_text("x")
  monkeypatch.setenv(autotune.CACHE_DIR_ENV, str(not_a_dir))
  assert autotune.read_entries(autotune.cache_path("cpu")) == {}
  with pytest.raises(autotune.CacheError, match="is a file|not a folder"):
    autotune.store(problem(), "triton/06_tuned", TritonConfig(),
                   device=HOPPER)


def test_tune_keeps_its_result_when_the_cache_is_read_only(cache,
                                                           monkeypatch):
  def refuse(*args, **kwargs):
    raise autotune.CacheError("cannot write to the cache folder (test)")
  monkeypatch.setattr(autotune, "write_payload", refuse)
  tiny = GemmProblem(1, 16, 16, 16, "float32", "float32", precision="ieee")
  cpu = DeviceInfo("cpu", "cpu")
  with pytest.warns(RuntimeWarning, match="not saved"):
    result = autotune.tune(tiny, "triton/02_k_loop",
                           [TritonConfig(16, 16, 16)], device=cpu,
                           iterations=1)
  assert result.best == TritonConfig(16, 16, 16)


def _store_many(args):
  cache_dir, worker, count = args
  os.environ[autotune.CACHE_DIR_ENV] = cache_dir
  for i in range(count):
    autotune.store(GemmProblem(1, 2 ** (worker % 8), 2 ** (i % 12 + 1),
                               2 ** (i // 12 + 1) * (worker + 1) + 1,
                               "bfloat16", "bfloat16"),
                   "triton/06_tuned", TritonConfig(), device=HOPPER)


def test_concurrent_writers_keep_every_entry(cache):
  cache_dir = str(cache / "cache")
  workers, per_worker = 8, 12
  ctx = multiprocessing.get_context("spawn")
  with ctx.Pool(workers) as pool:
    pool.map(_store_many, [(cache_dir, w, per_worker) for w in range(workers)])
  entries = autotune.read_entries(
      pathlib.Path(cache_dir) / "tuning" / f"{HOPPER.key}.json")
  expected = {autotune.CacheKey.for_problem(GemmProblem(
      1, 2 ** (w % 8), 2 ** (i % 12 + 1), 2 ** (i // 12 + 1) * (w + 1) + 1,
      "bfloat16", "bfloat16"), "triton/06_tuned", HOPPER).entry_name
              for w in range(workers) for i in range(per_worker)}
  assert expected <= set(entries)


def test_nearest_bucket_margin_is_per_kernel(cache):
  """A tiled kernel needs a wider lead than a streaming one to be trusted
  half an octave away (margins chosen on held-out measurements)."""
  assert dispatch.required_margin(0.5, WS) > dispatch.required_margin(
      0.5, "mosaic/small_m")
  write_table(cache, {
      problem(8192, 8192, 8192): {"kernel": WS, "ratio_to_xla": 1.06},
      problem(16, 8192, 8192): {"kernel": "mosaic/small_m",
                                "ratio_to_xla": 1.06},
  })
  assert dispatch.resolve(problem(8192, 8192, 6144), HOPPER).kernel == "xla"
  assert dispatch.resolve(problem(16, 8192, 6144),
                          HOPPER).kernel == "mosaic/small_m"



def test_unaligned_fp8_streaming_rows_with_no_bucket_in_reach_run_xla(cache):
  """At most STREAMING_ROWS rows of fp8 with unaligned rows and no bucket
  of its class in reach (here A stored transposed, which no table
  measured, of 4095 columns): xla, where the order's tiled kernel and its
  pads lost; with more rows, or aligned rows, the order decides."""
  write_table(cache, {problem(): {"kernel": WS, "ratio_to_xla": 1.2}})
  for m in (1, 16, dispatch.STREAMING_ROWS):
    few = dispatch.resolve(_fp8(m, 4095, 4096, transpose_a=True), HOPPER)
    assert (few.kernel, few.kernel_source) == ("xla", "fallback"), few
    assert f"{m} rows" in few.reason
  more = dispatch.resolve(_fp8(dispatch.STREAMING_ROWS + 1, 4095, 4096,
                               transpose_a=True), HOPPER)
  assert more.kernel_source == "order" and more.kernel != "xla", more
  aligned = dispatch.resolve(_fp8(16, 4096, 4096, transpose_a=True), HOPPER)
  assert aligned.kernel_source == "order", aligned
