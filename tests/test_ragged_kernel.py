"""The Mosaic grouped-GEMM kernels (`pallas_gemm.ragged_dot.mosaic`).

On a CPU the kernels run in Mosaic GPU interpret mode (seconds per call, so
shapes stay tiny and the odd cases are packed into a few calls); on an
H100/H200 the same tests run the compiled kernels. The cross-lowering tests
compile the configs the heuristic picks for the GPU shapes of the `moe`
suite down to Mosaic GPU's MLIR on the CPU, without running them.
"""

from __future__ import annotations

import dataclasses
import math
import os
import pathlib
import subprocess
import sys
import warnings
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import strategies as st  # noqa: E402

import pallas_gemm
from pallas_gemm import numerics
from pallas_gemm.devices import DeviceInfo, device_info
from pallas_gemm.ragged_dot import arg_specs, configs, mosaic, mosaic_schedule
from pallas_gemm.ragged_dot import mosaic_contracting
from pallas_gemm.ragged_dot import work_list_kernel
from pallas_gemm.ragged_dot.configs import RaggedConfig
from pallas_gemm.ragged_dot.problem import RaggedProblem, group_bounds, reference
from pallas_gemm.mosaic_backend import bulk_stores, tile_claims, tma
from pallas_gemm.mosaic_backend.warp_specialised import interpret_params
from kernel_test_base import lower_for_cuda, ragged_sin_loss_grads

warnings.filterwarnings("ignore", category=DeprecationWarning)

HOPPER = DeviceInfo("gpu", "NVIDIA H200", (9, 0), 132, 227 * 1024)
AMPERE = DeviceInfo("gpu", "NVIDIA A100", (8, 0), 108, 163 * 1024)
ON_GPU = jax.default_backend() == "gpu"
#: Small tiles, so that tiny problems still span several tiles and CTAs.
SMALL = RaggedConfig(tile_m=64, tile_n=64, tile_k=64, stages=2, epi_tile_n=64,
                     grid_band=2)
#: 128-row tiles split into two 64-row halves, one per consumer.
SPLIT_ROWS = RaggedConfig(tile_m=128, tile_n=64, tile_k=64, stages=3,
                          epi_tile_n=64, grid_band=2, out_slots=2,
                          split_rows=True)

#: 256-row tiles, each consumer owns 128 of the rows.
TALL = RaggedConfig(tile_m=256, tile_n=64, tile_k=64, stages=2, epi_tile_n=64,
                    grid_band=2, split_rows=True)


#: Set in the child process `_cluster_case_in_child` starts.
_CLUSTER_CHILD_ENV = "PALLAS_GEMM_CLUSTER_CASE_CHILD"
#: Tries, and seconds each, of a 2-CTA cluster case in a child process
#: (about 10 s when it runs through).
_CLUSTER_CHILD_TRIES, _CLUSTER_CHILD_TIMEOUT_S = 3, 150
#: The least XLA CPU client pool (`NPROC`) of a cluster case's child: more
#: threads than the six simulated warpgroups a 2-CTA cluster blocks at once
#: (see `_cluster_case_in_child`). Only the children get it: the rest of
#: the suite blocks no more than one simulated warpgroup at a time.
_CLUSTER_CHILD_POOL_THREADS = 16


def _env_int(name: str) -> int:
  try:
    return int(os.environ.get(name, ""))
  except ValueError:
    return 0


def _cluster_case_in_child(config) -> bool:
  """Runs the current test in a child process where `config` is a 2-CTA
  cluster in the CPU interpreter, and returns True once one try passed
  (the caller then returns: the child ran the checks).

  Why: the interpreter hangs now and then on the cluster cases when XLA's
  CPU client has fewer pool threads than the cluster's six simulated
  warpgroups block at once: their computations queue behind a blocked one
  (experiments/results/cpu/interpreter_hang). XLA sizes that pool from
  NPROC, which the child gets at _CLUSTER_CHILD_POOL_THREADS or more; that
  stopped the hangs (counts in that note). The retry stays as a
  guard, since a hang would stall the whole suite and the interpreter's
  dispatch is JAX's to change: a child that hangs is killed and the case
  tried again, so that a hang costs time, not the run; a failure fails at
  once."""
  if ON_GPU or not config.clustered or os.environ.get(
      _CLUSTER_CHILD_ENV):
    return False
  node = os.environ["PYTEST_CURRENT_TEST"].rsplit(" ", 1)[0]
  root = pathlib.Path(__file__).resolve().parents[1]
  command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
             node]
  for _ in range(_CLUSTER_CHILD_TRIES):
    try:
      child = subprocess.run(
          command, cwd=root, capture_output=True, text=True,
          timeout=_CLUSTER_CHILD_TIMEOUT_S,
          env={**os.environ, _CLUSTER_CHILD_ENV: "1",
               "NPROC": str(max(_CLUSTER_CHILD_POOL_THREADS,
                                os.cpu_count() or 1, _env_int("NPROC")))})
    except subprocess.TimeoutExpired:
      continue
    assert child.returncode == 0, child.stdout[-4000:] + child.stderr[-4000:]
    return True
  pytest.fail(f"{node}: the interpreter hung on all {_CLUSTER_CHILD_TRIES} "
              f"tries ({_CLUSTER_CHILD_TIMEOUT_S} s each)")


def _run(problem, sizes, *, row_offset=0, config=SMALL, detect_races=False):
  keys = jax.random.split(numerics.fresh_key(), 2)
  lhs = numerics.random_normal(keys[0], problem.lhs_shape, problem.in_dtype)
  rhs = numerics.random_normal(keys[1], problem.rhs_shape, problem.in_dtype)
  # On a CPU the interpreter can also check that the warpgroups' accesses
  # to shared memory are ordered (the ring, the masking, the staged stores);
  # it costs time, so one case of each mode does.
  params = (False if ON_GPU
            else plgpu.InterpretGPUParams(detect_races=detect_races))
  out = mosaic.ragged_matmul(
      lhs, rhs, jnp.asarray(sizes, jnp.int32),
      jnp.asarray([row_offset], jnp.int32), problem=problem, config=config,
      interpret=params)
  if detect_races and not ON_GPU:
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
    assert not interpret_pallas_call.get_races().races_found
  assert out.shape == problem.out_shape
  assert out.dtype == jnp.dtype(problem.out_dtype)
  as64 = lambda x: np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)
  want = reference(as64(lhs), as64(rhs), sizes, problem, row_offset)
  got = as64(out)
  tol = numerics.tolerance(problem.in_dtype, problem.precision,
                           problem.out_dtype)
  scale = max(np.linalg.norm(want), 1.0)
  assert np.linalg.norm(got - want) / scale <= tol, (sizes, row_offset)
  # Rows (rows mode) or groups (contracting) with no data are exactly zero.
  # They are found from the absolute values' product, which is zero only
  # where no term contributes: a sum of a few products can also cancel to
  # exactly zero in float64 where the kernel's float32 sum leaves a rounding.
  no_data = reference(np.abs(as64(lhs)), np.abs(as64(rhs)), sizes,
                      dataclasses.replace(problem, activation=None),
                      row_offset) == 0
  assert np.all(got[no_data] == 0) or problem.activation == "sigmoid"
  return got, want


# (m, k, n, sizes, row_offset, in_dtype, out_dtype, transpose_rhs, activation)
ROWS_CASES = [
    # odd sizes, each group cut into 64-row items from its first row, an
    # empty group, bf16 -> f32
    (100, 64, 128, [30, 0, 50, 20], 0, "bfloat16", "float32", False, None),
    # rhs read as (G, n, k); rows before row_offset and after the last group
    # (sizes sum < m) are zero, also under sigmoid (sigmoid(0) != 0); f16
    (100, 128, 120, [30, 0, 50, 10], 5, "float16", "float16", True, "sigmoid"),
    # one group takes every token; odd k and n (padded to the TMA tiling);
    # the consumers split the rows, a half of the second block holds none
    (130, 72, 80, [0, 130, 0], 0, "bfloat16", "bfloat16", False, "silu",
     SPLIT_ROWS),
    # eight groups, several tiny or empty, sum < m (slow on a CPU)
    pytest.param((140, 64, 64, [3, 0, 17, 64, 1, 0, 40, 5], 0, "bfloat16",
                  "float32", True, None), marks=pytest.mark.slow),
    # Regression (compiled only; the interpreter clips any window): n is
    # below the second consumer's columns, and the 1- and 2-row stores of the
    # tiny groups are contiguous in memory, which Mosaic issues as linear
    # bulk copies that are not clipped per column: a store of the
    # out-of-range columns overwrote the next rows with zeros.
    # Two staging slots alternating over one store per tile, across tiles
    # and the second consumer's idle ones.
    (70, 64, 40, [1, 2, 0, 3, 60], 0, "bfloat16", "float32", False, None,
     dataclasses.replace(SMALL, out_slots=2)),
    # 256-row tiles: a group inside one consumer's half, one across both,
    # one across two tiles; rhs read transposed
    (300, 64, 128, [5, 250, 0, 40], 3, "bfloat16", "bfloat16", True, None,
     TALL),
    # 128-row tiles cut from each group's first row: a 3-row group and the
    # short last item of a group leave the second consumer idle; the last
    # items' tiles are held back to the last 128 rows of lhs, so their rows
    # sit at an offset, the rows after the groups in the second half only.
    # One staging slot: race-checked, and the interpreter counts each copy
    # of a store ladder as its own bulk group (its commit_group is a no-op),
    # so two slots would be flagged for a wait that the GPU honours.
    (300, 64, 64, [70, 3, 150, 60], 9, "bfloat16", "float32", False, None,
     dataclasses.replace(SPLIT_ROWS, out_slots=1)),
    # The consumers take turns at whole 64 x 64 tiles: an odd tile count per
    # CTA, short items, rows of no group (zeros under silu), rhs read
    # transposed. One staging slot, as above.
    (150, 128, 128, [40, 3, 0, 70], 11, "bfloat16", "bfloat16", True,
     "silu", dataclasses.replace(SMALL, ping_pong=True, stages=3)),
    # Turns at whole 128-row tiles, items within their tile's first 64 rows
    # multiplied by one 64-row wgmma (`short_items`): a group's 7-row last
    # item and a 7-row group (short), items reaching 71 and 72 rows into
    # their tiles (whole), the rows of no group after the last one (short,
    # zeros); f32 out.
    (420, 64, 128, [130, 64, 0, 193, 7], 5, "bfloat16", "float32", False,
     None, RaggedConfig(tile_m=128, tile_n=64, tile_k=64, stages=2,
                        epi_tile_n=64, grid_band=2, ping_pong=True,
                        short_items=True)),
    # The epilogue staged swizzled (`swizzled_staging`), its rows stored
    # through an untiled view of the same bytes: partial stores from every
    # row of a swizzle atom (a 3-row group, items from rows 30, 33 and 103),
    # split rows, then turns at whole tiles with short items and rhs read
    # transposed. The interpreter runs plain staging (it keeps a RefUnion's
    # views apart); compiled on the GPU these check the swizzled views.
    (300, 64, 128, [30, 3, 70, 150, 9], 5, "bfloat16", "bfloat16", False,
     None, dataclasses.replace(SPLIT_ROWS, swizzled_staging=True)),
    (420, 64, 128, [130, 64, 0, 193, 7], 5, "float16", "float16", True,
     "silu", RaggedConfig(tile_m=128, tile_n=64, tile_k=64, stages=2,
                          epi_tile_n=64, grid_band=2, ping_pong=True,
                          short_items=True, out_slots=2,
                          swizzled_staging=True)),
    # Each consumer's 128 rows staged and stored in 64-row halves
    # (`epi_tile_m`): items starting and ending in either half, a 3-row
    # group, short items (one half); turns at whole tiles from one slot,
    # then the consumers splitting the columns, from two.
    (300, 64, 128, [30, 3, 70, 150, 9], 5, "bfloat16", "bfloat16", False,
     "silu", RaggedConfig(tile_m=128, tile_n=64, tile_k=64, stages=2,
                          epi_tile_n=64, grid_band=2, ping_pong=True,
                          short_items=True, out_slots=1, epi_tile_m=64,
                          swizzled_staging=True)),
    (300, 64, 200, [100, 0, 66, 130], 0, "bfloat16", "bfloat16", True, None,
     RaggedConfig(tile_m=128, tile_n=128, tile_k=64, stages=2,
                  epi_tile_n=64, grid_band=2, out_slots=2, epi_tile_m=64,
                  swizzled_staging=True)),
    # 2-CTA clusters multicasting an item's lhs tile (`cluster_columns`),
    # three column strips, so the second CTA's last strip lies past the
    # output: turns at whole tiles, a 3-row group, rhs read transposed,
    # rows of no group under silu, group bands.
    (150, 128, 192, [40, 3, 0, 70], 11, "bfloat16", "bfloat16", True,
     "silu", dataclasses.replace(SMALL, ping_pong=True, stages=3,
                                 cluster_columns=True, group_bands=True)),
    # ... the consumers splitting the rows (a short item leaves the second
    # half idle), then splitting the columns (the last strip ends inside
    # the first consumer's half); f32 out.
    (300, 64, 300, [70, 3, 150, 60], 9, "bfloat16", "float32", False, None,
     dataclasses.replace(SPLIT_ROWS, out_slots=1, cluster_columns=True)),
    (130, 64, 330, [50, 0, 80], 0, "bfloat16", "bfloat16", False, None,
     dataclasses.replace(SMALL, cluster_columns=True)),
    # Token rows as wgmma's N (`swap_ab`), each group cut into equal items
    # (100 rows: two of 56), each run at the narrowest multiple of 8 that
    # holds its rows: items of 1, 9, 17, 33 and 64 rows (some reaching past
    # their start's 8-row tile), an empty group, rows of no group under
    # silu (zeros), the last items held back to lhs's last 64 rows (their
    # rows at an offset, the full width); the consumers splitting the
    # columns, the second one idle on the last strip; rhs read transposed.
    (300, 128, 192, [1, 9, 0, 17, 33, 64, 100, 40], 3, "bfloat16",
     "bfloat16", True, "silu",
     dataclasses.replace(SMALL, swap_ab=True, swizzled_staging=True)),
    # ... the consumers taking turns at whole 128-token tiles (widths in
    # steps of 16: a 193-row group is two items of 104), f16, two staging
    # slots.
    (420, 64, 128, [130, 64, 0, 193, 7, 1], 5, "float16", "float16", False,
     None, RaggedConfig(tile_m=128, tile_n=64, tile_k=64, stages=2,
                        epi_tile_n=64, grid_band=2, ping_pong=True,
                        out_slots=2, swizzled_staging=True, swap_ab=True)),
    # ... the consumers splitting each 256-row item's tokens (`split_rows`):
    # a 300-row group is two items of 152 (the second consumer's share 24
    # rows), a 129-row one two of 72 (the second consumer idle), a group
    # of 3 rows; rhs read transposed, silu. One staging slot: race-checked
    # (see short_items_split_rows).
    (560, 64, 128, [300, 0, 129, 3, 70], 6, "bfloat16", "bfloat16", True,
     "silu", dataclasses.replace(TALL, swap_ab=True, swizzled_staging=True)),
    # ... the consumers taking turns at whole 192-token tiles (widths in
    # steps of 16): a 273-row group is two items of 144, a 193-row one two
    # of 104 (run at 112), a 130-row one item of 136 (at 144), a 3-row
    # group, an empty one, rows of no group before and after the groups
    # (the last items held back to lhs's last 192 rows); rhs read
    # transposed, silu.
    (700, 64, 128, [273, 0, 193, 3, 130], 5, "bfloat16", "bfloat16", True,
     "silu", RaggedConfig(tile_m=192, tile_n=64, tile_k=64, stages=2,
                          epi_tile_n=64, grid_band=2, ping_pong=True,
                          out_slots=1, swizzled_staging=True, swap_ab=True)),
    # ... and at a 144-token tile, the width of two items of a 274-row
    # group: a 274-row group is two items of 137 (run at 144), a 145-row
    # one two of 73 (at 80), a 144-row one item of 144, a 3-row group, an
    # empty one; rhs not transposed, no activation.
    (600, 64, 128, [274, 0, 145, 3, 144], 5, "bfloat16", "bfloat16", False,
     None, RaggedConfig(tile_m=144, tile_n=64, tile_k=64, stages=2,
                        epi_tile_n=64, grid_band=2, ping_pong=True,
                        out_slots=1, swizzled_staging=True, swap_ab=True)),
    # ... and with one staging buffer the consumers take turns at
    # (`shared_staging`): 9 items in 2 column strips, so each of the
    # interpreter's 2 CTAs runs an odd number of tiles; rhs read
    # transposed, silu.
    (600, 64, 128, [274, 0, 145, 3, 144], 5, "bfloat16", "bfloat16", True,
     "silu", RaggedConfig(tile_m=144, tile_n=64, tile_k=64, stages=2,
                          epi_tile_n=64, grid_band=2, ping_pong=True,
                          out_slots=1, swizzled_staging=True, swap_ab=True,
                          shared_staging=True)),
    # ... and at 128 tokens by 192 columns (wgmma's M three 64-row
    # groups), one staging buffer: three column strips, the last 66
    # columns wide (its second store partial, its third past the output);
    # rows of no group before and after the groups, rhs read transposed,
    # silu.
    (600, 64, 450, [274, 0, 145, 3, 144], 5, "bfloat16", "bfloat16", True,
     "silu", RaggedConfig(tile_m=128, tile_n=192, tile_k=64, stages=2,
                          epi_tile_n=64, grid_band=2, ping_pong=True,
                          out_slots=1, swizzled_staging=True, swap_ab=True,
                          shared_staging=True)),
    # ... and at widths in steps of 8 (`token_width_step`) from 48 up
    # (`min_token_width`): a 273-row group is items of 96, 96 and 81 rows
    # (the last run at 88, not 96), a 41-row group one item at 48 (not
    # 64), a 7-row one at the narrowest, 48; rhs read transposed, silu.
    (420, 64, 128, [273, 0, 41, 7], 5, "bfloat16", "bfloat16", True, "silu",
     RaggedConfig(tile_m=128, tile_n=64, tile_k=64, stages=2, epi_tile_n=64,
                  grid_band=2, ping_pong=True, out_slots=1,
                  swizzled_staging=True, swap_ab=True, shared_staging=True,
                  token_width_step=8, min_token_width=48)),
    # Turns at 128 x 128 with short items and a shared staging buffer of
    # two slots, plain rows (a float32 output): an even number of tiles
    # per CTA.
    (300, 64, 128, [30, 3, 70, 150, 9], 5, "bfloat16", "float32", False,
     "silu", RaggedConfig(tile_m=128, tile_n=64, tile_k=64, stages=2,
                          epi_tile_n=64, grid_band=2, ping_pong=True,
                          short_items=True, out_slots=2,
                          shared_staging=True)),
    # The item table built by the Pallas-Triton work-list kernel (run by
    # the interpreter here): balanced items (swap_ab), an empty group, rows
    # of no group before and after the groups.
    (300, 128, 192, [1, 9, 0, 17, 33, 64, 100, 40], 3, "bfloat16",
     "bfloat16", True, "silu",
     dataclasses.replace(SMALL, swap_ab=True, swizzled_staging=True,
                         work_list_kernel=True)),
]


ROWS_IDS = ["odd_sizes", "transposed_offset_f16", "one_group", "eight_groups",
            "columns_past_n", "tall_tiles", "short_items_split_rows",
            "ping_pong", "ping_pong_short_items", "swizzled_split_rows",
            "swizzled_ping_pong", "row_halves_ping_pong", "row_halves",
            "cluster_ping_pong", "cluster_split_rows", "cluster_split_columns",
            "swap_ab_split_columns", "swap_ab_ping_pong",
            "swap_ab_split_rows", "swap_ab_ping_pong_192",
            "swap_ab_ping_pong_144", "swap_ab_shared_staging",
            "swap_ab_wide_columns", "swap_ab_fine_widths",
            "ping_pong_shared_staging", "work_list_kernel"]
#: The cases the CPU interpreter also race-checks (it costs time): one of
#: each way the consumers share a tile, turns, short items and clusters.
RACE_CHECKED_ROWS = {"odd_sizes", "short_items_split_rows", "ping_pong",
                     "ping_pong_short_items", "cluster_ping_pong",
                     "swap_ab_split_columns", "swap_ab_split_rows",
                     "swap_ab_shared_staging", "swap_ab_wide_columns",
                     "swap_ab_fine_widths", "ping_pong_shared_staging"}


def _named(ids, cases):
  """`cases` as pytest params (name, case), keeping each case's marks."""
  assert len(ids) == len(cases), (len(ids), len(cases))
  out = []
  for name, case in zip(ids, cases):
    values, marks = ((case.values[0], case.marks)
                     if isinstance(case, type(pytest.param(None)))
                     else (case, ()))
    out.append(pytest.param(name, values, marks=marks, id=name))
  return out


@pytest.mark.parametrize("name,case", _named(ROWS_IDS, ROWS_CASES))
def test_rows(name, case):
  m, k, n, sizes, offset, in_dtype, out_dtype, transpose, act = case[:9]
  config = case[9] if len(case) > 9 else SMALL
  if _cluster_case_in_child(config):
    return
  problem = RaggedProblem("rows", m, k, n, len(sizes), in_dtype, out_dtype,
                          transpose_rhs=transpose, activation=act)
  _run(problem, sizes, row_offset=offset, config=config,
       detect_races=name in RACE_CHECKED_ROWS)


CONTRACTING_CASES = [
    (150, 128, 64, [30, 0, 70, 20], 0, "bfloat16", "float32"),
    # The consumers take turns at whole 128 x 192 tiles: two K strips (the
    # second half past k), three column strips (the last 16 columns wide),
    # tiles of 1, 3 and 0 chunks, two staging slots over three stores per
    # tile (as the deepest ring that fits has them on the GPU).
    (230, 192, 400, [60, 130, 0, 33], 6, "bfloat16", "bfloat16",
     RaggedConfig(tile_m=128, tile_n=192, tile_k=64, stages=2, epi_tile_n=64,
                  grid_band=2, ping_pong=True, out_slots=2)),
    # row_offset, an empty last group, odd k and n, f16; two staging slots
    # alternating over one store per tile; tiles walked group index fastest
    (150, 100, 72, [30, 70, 20, 0], 7, "float16", "float16",
     dataclasses.replace(SMALL, out_slots=2, interleave_groups=True)),
    # Reductions cut into 64-row pieces: a 170-row group in four (the first
    # from its unaligned start), the others whole or empty; the pieces'
    # sums added after the kernel, in float32 before the bf16 rounding.
    (240, 128, 64, [30, 0, 170, 20], 7, "bfloat16", "bfloat16",
     dataclasses.replace(SMALL, piece_rows=64)),
    # Every token in one group, cut into 128-row pieces; f32 out.
    (300, 64, 72, [0, 300, 0], 0, "bfloat16", "float32",
     dataclasses.replace(SMALL, piece_rows=128)),
    # One group cut into 41 pieces, walked largest first (a single
    # expert's cut, past MAX_PIECES).
    (2600, 64, 64, [2600], 0, "bfloat16", "float32",
     dataclasses.replace(SMALL, piece_rows=64, largest_first=True)),
    # Pieces longer than any group can be: no piece beyond a first, one
    # kernel output.
    (100, 64, 64, [40, 50], 3, "float16", "float32",
     dataclasses.replace(SMALL, piece_rows=320)),
    # Groups walked largest first, dealt in a snake; an empty group among
    # them still stores zeros to its own output.
    (200, 128, 128, [20, 0, 150, 5, 25], 1, "bfloat16", "bfloat16",
     dataclasses.replace(SMALL, largest_first=True)),
    # ... and the pieces of a cut group sorted among the groups.
    (260, 64, 128, [10, 200, 0, 50], 0, "bfloat16", "float32",
     dataclasses.replace(SMALL, largest_first=True, piece_rows=64)),
    # ... and the further pieces listed first, then the groups by size,
    # ranked on the sizes alone: every row in one group (four further
    # pieces, one from row 64 on), then a cut group starting mid-piece
    # after a short one, with turns at whole tiles.
    (330, 64, 128, [0, 0, 330, 0], 0, "bfloat16", "bfloat16",
     dataclasses.replace(SMALL, cut_groups_first=True, piece_rows=64)),
    (260, 64, 128, [10, 200, 0, 45], 5, "bfloat16", "float32",
     dataclasses.replace(SMALL, ping_pong=True, cut_groups_first=True,
                         piece_rows=64, stages=3)),
    # The consumers take turns at whole tiles: an odd tile count per CTA,
    # tiles of 1, 3 and 0 chunks (the empty group's still stored, as
    # zeros), two staging slots over an odd number of stores per tile.
    (230, 192, 192, [60, 130, 0, 33], 5, "bfloat16", "float32",
     dataclasses.replace(SMALL, ping_pong=True, out_slots=2, stages=3)),
    # ... with the groups cut into pieces and walked largest first.
    (260, 64, 128, [10, 200, 0, 50], 0, "bfloat16", "bfloat16",
     dataclasses.replace(SMALL, ping_pong=True, largest_first=True,
                         piece_rows=64)),
    # The producer stores the empty groups' zero tiles (two boxes per
    # 128-row tile), the consumers skip them: most tokens in one group.
    (200, 128, 128, [0, 180, 0, 0, 20], 3, "bfloat16", "bfloat16",
     dataclasses.replace(SMALL, zeros_by_producer=True)),
    # ... with turns at whole tiles and the big group cut into pieces: the
    # unused pieces are skipped too, and never read by the merge.
    (260, 64, 128, [0, 200, 0, 50], 0, "bfloat16", "float32",
     dataclasses.replace(SMALL, ping_pong=True, zeros_by_producer=True,
                         piece_rows=64, stages=3)),
    # Pairs of CTAs in a cluster run neighbouring column strips, sharing
    # the lhs chunk by multicast: three strips (the second CTA's last one
    # past the edge), an empty group.
    (150, 128, 192, [30, 0, 70, 20], 2, "bfloat16", "float32",
     dataclasses.replace(SMALL, cluster_columns=True)),
    # ... with turns at whole tiles, cut pieces and producer-stored zeros.
    (260, 64, 128, [0, 200, 0, 50], 0, "bfloat16", "bfloat16",
     dataclasses.replace(SMALL, ping_pong=True, cluster_columns=True,
                         zeros_by_producer=True, piece_rows=64, stages=3)),
    # Pairs of CTAs running neighbouring K strips, sharing the dout chunk
    # by multicast: three K strips (the second CTA's last one past the
    # edge), an empty group, producer-stored zeros.
    (150, 320, 128, [30, 0, 70, 20], 2, "bfloat16", "bfloat16",
     dataclasses.replace(SMALL, cluster_rows=True, zeros_by_producer=True)),
    # Two staging slots over one store per tile: no tile may be skipped
    # (the slot follows the tile's number), so the consumers store the
    # zeros and every piece, used or not.
    (200, 64, 64, [0, 150, 0, 10], 1, "bfloat16", "bfloat16",
     dataclasses.replace(SMALL, out_slots=2, piece_rows=64)),
    # The heuristic's cut (pieces walked largest first, as it takes them
    # where a group's tiles leave most SMs idle), every row in one group:
    # six pieces, so the merge's loads wrap around its slots.
    (330, 64, 128, [0, 0, 330, 0], 0, "bfloat16", "bfloat16",
     dataclasses.replace(SMALL, largest_first=True, piece_rows=64)),
]


@pytest.mark.parametrize("case", CONTRACTING_CASES,
                         ids=lambda c: f"m{c[0]}_g{len(c[3])}_off{c[4]}")
def test_contracting(case):
  _run_contracting(case, detect_races=case is CONTRACTING_CASES[0]
                   or case is CONTRACTING_CASES[-8]
                   or case is CONTRACTING_CASES[-5]
                   or case is CONTRACTING_CASES[-3]
                   or case is CONTRACTING_CASES[-1])


def _run_contracting(case, *, detect_races):
  """Checks a weight-gradient case (m, k, n, sizes, row_offset, in_dtype,
  out_dtype[, config]) against float64; empty groups must be exactly
  zero."""
  m, k, n, sizes, offset, in_dtype, out_dtype = case[:7]
  config = case[7] if len(case) > 7 else SMALL
  if _cluster_case_in_child(config):
    return
  problem = RaggedProblem("contracting", m, k, n, len(sizes), in_dtype,
                          out_dtype)
  got, _ = _run(problem, sizes, row_offset=offset, config=config,
                detect_races=detect_races)
  empty = [g for g, size in enumerate(sizes) if size == 0]
  assert np.all(got[empty] == 0)


#: `RaggedConfig.claim_tiles`: the CTAs claim their tiles (in the
#: interpreter in the round-robin order) and each producer hands them to
#: its consumers through a queue in shared memory.
CLAIM_CASES = [
    # Consumers splitting each tile; an empty group (its zero tiles handed
    # over and stored by the consumers), rows of no group; more tiles per
    # CTA than the queue has slots.
    (230, 192, 128, [60, 130, 0, 33], 5, "bfloat16", "bfloat16",
     dataclasses.replace(SMALL, claim_tiles=True)),
    # Turns at whole tiles (the consumer of each follows the queue's turn
    # numbers), two staging slots over an odd number of stores per tile,
    # groups claimed largest first.
    (230, 192, 192, [60, 130, 0, 33], 5, "bfloat16", "float32",
     dataclasses.replace(SMALL, ping_pong=True, out_slots=2, stages=3,
                         largest_first=True, claim_tiles=True)),
    # Most tokens in one group, cut into pieces, the producer storing the
    # empty groups' zero tiles: neither those nor the unused pieces are
    # handed over.
    (260, 64, 128, [0, 200, 0, 50], 0, "bfloat16", "bfloat16",
     dataclasses.replace(SMALL, ping_pong=True, zeros_by_producer=True,
                         piece_rows=64, largest_first=True, stages=3,
                         claim_tiles=True)),
    # No rows at all: every tile a zero tile.
    (64, 64, 64, [0, 0, 0], 0, "bfloat16", "float32",
     dataclasses.replace(SMALL, claim_tiles=True)),
    # The empty groups' zero tiles claimed apart, a box after each load
    # (more boxes than loads: the rest claimed after the last tile); a cut
    # group's unused pieces after them, never walked.
    (260, 128, 128, [0, 200, 0, 0, 50], 0, "bfloat16", "bfloat16",
     dataclasses.replace(SMALL, zeros_by_producer=True, zero_drip=1,
                         largest_first=True, piece_rows=64,
                         claim_tiles=True)),
    # ... with the groups that have rows claimed in table order (empty
    # last) and the zero box as wide as the tile.
    (260, 128, 128, [0, 200, 0, 7, 50, 0], 5, "bfloat16", "bfloat16",
     dataclasses.replace(SMALL, zeros_by_producer=True, zero_drip=1,
                         empty_last=True, wide_zero_box=True, tile_n=128,
                         piece_rows=64, claim_tiles=True)),
    # ... with turns, and no empty group: nothing to claim apart.
    (200, 64, 128, [50, 100, 50], 3, "bfloat16", "float32",
     dataclasses.replace(SMALL, ping_pong=True, zeros_by_producer=True,
                         zero_drip=2, largest_first=True, stages=3,
                         claim_tiles=True)),
    # 2-CTA clusters claiming together (an odd strip count: the second
    # CTA's last strip lies past the edge), the zero boxes claimed per
    # rank; sharing lhs, then dout.
    (260, 128, 192, [0, 200, 0, 7, 50, 0], 5, "bfloat16", "bfloat16",
     dataclasses.replace(SMALL, zeros_by_producer=True, zero_drip=1,
                         empty_last=True, cluster_columns=True,
                         claim_tiles=True)),
    (260, 320, 128, [0, 200, 0, 7, 50, 0], 5, "bfloat16", "float32",
     dataclasses.replace(SMALL, zeros_by_producer=True, zero_drip=1,
                         empty_last=True, cluster_rows=True,
                         claim_tiles=True)),
    # The claimed zeros as runs of whole rows of the empty groups' output
    # (compiled; the interpreter stores the boxes): 200 rows, runs of 32,
    # the last run overlapping the one before.
    (260, 200, 128, [0, 200, 0, 7, 50, 0], 5, "bfloat16", "bfloat16",
     dataclasses.replace(SMALL, zeros_by_producer=True, zero_drip=1,
                         empty_last=True, wide_zero_box=True, tile_n=128,
                         claim_tiles=True, streamed_zeros=True)),
    # ... and as runs within a row, where a float32 row (2112 columns) is
    # longer than the zero box's 8 KB.
    (130, 64, 2112, [0, 100, 0, 30], 0, "bfloat16", "float32",
     dataclasses.replace(SMALL, zeros_by_producer=True, zero_drip=2,
                         empty_last=True, wide_zero_box=True,
                         claim_tiles=True, streamed_zeros=True)),
    # ... and with the zero buffer doubled (16 KB): runs of 64 rows.
    (260, 200, 128, [0, 200, 0, 7, 50, 0], 5, "bfloat16", "bfloat16",
     dataclasses.replace(SMALL, zeros_by_producer=True, zero_drip=1,
                         empty_last=True, wide_zero_box=True, tile_n=128,
                         claim_tiles=True, streamed_zeros=True,
                         double_zero_buffer=True)),
]


@pytest.mark.parametrize("case", range(len(CLAIM_CASES)),
                         ids=["split", "turns", "pieces", "no_rows",
                              "zeros_claimed", "empty_last", "zeros_none",
                              "clusters", "cluster_rows", "streamed_zeros",
                              "streamed_zeros_in_rows",
                              "streamed_zeros_double_buffer"])
def test_contracting_claim_tiles(case):
  _run_contracting(CLAIM_CASES[case], detect_races=case in (0, 2, 4, 5))


#: `RaggedConfig.spread_zero_tiles`: each CTA visits its empty groups' zero
#: tiles spread between its tiles with rows.
SPREAD_CASES = [
    # Turns at whole tiles (the tiles with rows still alternating between
    # the consumers), two staging slots over three stores a tile, most rows
    # in one group, rows of no group.
    (260, 192, 192, [0, 200, 0, 0, 50, 0], 5, "bfloat16", "bfloat16",
     dataclasses.replace(SMALL, ping_pong=True, tile_n=192, out_slots=2,
                         stages=3, empty_last=True, spread_zero_tiles=True)),
    # Consumers splitting each tile, every row in one group.
    (200, 256, 128, [0, 0, 200, 0], 0, "bfloat16", "float32",
     dataclasses.replace(SMALL, empty_last=True, spread_zero_tiles=True)),
    # No empty group: the walk as without it.
    (200, 128, 128, [50, 100, 50], 0, "bfloat16", "bfloat16",
     dataclasses.replace(SMALL, ping_pong=True, empty_last=True,
                         spread_zero_tiles=True)),
    # No rows at all: every tile a zero tile.
    (64, 64, 64, [0, 0, 0], 0, "bfloat16", "float32",
     dataclasses.replace(SMALL, empty_last=True, spread_zero_tiles=True)),
    # Compiled, the zero tiles stored as runs of the empty groups' output
    # under an evict-first policy (the interpreter stores the tiles): ten
    # runs of 21 rows over a group's three tiles, the last run overlapping
    # the one before; with turns, then split between two consumers.
    (260, 192, 192, [0, 200, 0, 0, 50, 0], 5, "bfloat16", "bfloat16",
     dataclasses.replace(SMALL, ping_pong=True, tile_n=192, out_slots=2,
                         stages=3, empty_last=True, spread_zero_tiles=True,
                         zero_tiles_evict_first=True)),
    (200, 256, 128, [0, 0, 200, 0], 0, "bfloat16", "float32",
     dataclasses.replace(SMALL, empty_last=True, spread_zero_tiles=True,
                         zero_tiles_evict_first=True)),
]


@pytest.mark.parametrize("case", range(len(SPREAD_CASES)),
                         ids=["turns", "split", "none_empty", "no_rows",
                              "evict_first_turns", "evict_first_split"])
def test_contracting_spread_zero_tiles(case):
  _run_contracting(SPREAD_CASES[case], detect_races=case in (0, 1))


@pytest.mark.parametrize("unit", [1, 2])
def test_spread_zero_visits_is_a_permutation_keeping_each_kind_in_order(unit):
  """`mosaic_schedule.spread_zero_visits`: every tile visited once, the
  tiles with rows and the zero tiles each in their own order, the first
  visit a tile with rows, the tiles with rows alternating between the
  `unit` consumers, and no run of zero tiles longer than the even share of
  one gap (plus a unit)."""
  for tiles in range(41):
    for with_rows in range(tiles + 1):
      spreads, tile_of = mosaic_schedule.spread_zero_visits(
          tiles=tiles, with_rows=with_rows, unit=unit)
      tile = np.asarray(tile_of(np.arange(tiles)))
      assert spreads == (0 < with_rows and -(-with_rows // unit)
                         < tiles // unit)
      assert spreads or (tile == np.arange(tiles)).all()
      assert sorted(tile) == list(range(tiles))
      rows = tile[tile < with_rows]
      zeros = tile[tile >= with_rows]
      assert (np.diff(rows) > 0).all() and (np.diff(zeros) > 0).all()
      if 0 < with_rows <= unit * (tiles // unit):
        assert tile[0] == 0
        lanes = np.flatnonzero(tile < with_rows) % unit
        assert (lanes == np.arange(with_rows) % unit).all()
        units = -(-with_rows // unit)
        if units > 1:
          gap = -(-(tiles // unit - units) // (units - 1))
          runs = np.diff(np.flatnonzero(tile < with_rows)) - 1
          assert runs.max(initial=0) <= unit * (gap + 1)


def test_spread_zero_tiles_needs_empty_last_and_excludes_what_reorders():
  """spread_zero_tiles needs empty_last and excludes the options that walk
  or store zero tiles their own way; each error names the option."""
  with pytest.raises(ValueError, match="spread_zero_tiles needs empty_last"):
    RaggedConfig(tile_m=64, tile_n=64, spread_zero_tiles=True)
  spread = dict(tile_m=64, tile_n=64, empty_last=True, spread_zero_tiles=True)
  for option, value in (("claim_tiles", True), ("zeros_by_producer", True),
                        ("piece_rows", 64), ("cluster_rows", True)):
    with pytest.raises(ValueError, match=f"spread_zero_tiles excludes "
                       f"{option}"):
      RaggedConfig(**spread, **{option: value})
  with pytest.raises(ValueError, match="is a \"contracting\"-mode"):
    RaggedConfig(**spread).check_mode("rows")
  with pytest.raises(ValueError, match="zero_tiles_evict_first needs "
                     "spread_zero_tiles"):
    RaggedConfig(tile_m=64, tile_n=64, zero_tiles_evict_first=True)
  assert "spread_zero_tiles" in configs.MODE_ONLY_OPTIONS["contracting"]


def test_cluster_rows_rejects_what_it_cannot_run():
  """cluster_rows: one shared operand a cluster (not with cluster_columns),
  a "contracting"-mode option; each error names the option."""
  with pytest.raises(ValueError, match="cluster_columns and cluster_rows "
                     "exclude each other"):
    RaggedConfig(tile_m=64, tile_n=64, cluster_rows=True,
                 cluster_columns=True)
  with pytest.raises(ValueError, match="cluster_rows is a \"contracting\""):
    RaggedConfig(cluster_rows=True).check_mode("rows")
  assert RaggedConfig(cluster_rows=True).clustered


@pytest.mark.parametrize("rows,cols,itemsize", [
    (200, 128, 2), (7168, 2048, 2), (5, 64, 4), (3, 2112, 4), (9, 6144, 2),
    (1, 64, 2)])
def test_zero_runs_cover_the_slab(rows, cols, itemsize):
  """`bulk_stores.zero_runs`: every element of a slab lies in some run,
  each run is inside the slab, contiguous (whole rows, or part of one),
  at most the buffer's bytes and a multiple of 16 of them."""
  buffer_bytes = 8192
  runs = bulk_stores.zero_runs(rows, cols, itemsize, buffer_bytes)
  covered = np.zeros((rows, cols), bool)
  for run in range(runs.runs):
    row, col = runs.start(run, rows=rows, cols=cols)
    assert 0 <= row <= rows - runs.run_rows and 0 <= col <= cols - runs.run_cols
    assert runs.run_rows == 1 or runs.run_cols == cols
    size = runs.run_rows * runs.run_cols * itemsize
    assert size <= buffer_bytes and size % 16 == 0
    covered[row:row + runs.run_rows, col:col + runs.run_cols] = True
  assert covered.all()


def test_streamed_zeros_need_claimed_zeros():
  """streamed_zeros streams the claimed zero units: it needs claim_tiles
  and zero_drip, excludes clusters, and the error names each."""
  claimed = dataclasses.replace(SMALL, zeros_by_producer=True, zero_drip=1,
                                empty_last=True, claim_tiles=True)
  assert dataclasses.replace(claimed, streamed_zeros=True).streamed_zeros
  for fields in (dict(claim_tiles=False), dict(zero_drip=0),
                 dict(cluster_rows=True)):
    with pytest.raises(ValueError, match="streamed_zeros needs claim_tiles"):
      dataclasses.replace(claimed, streamed_zeros=True, **fields)
  assert "streamed_zeros" in configs.MODE_ONLY_OPTIONS["contracting"]
  # double_zero_buffer doubles the streamed wide box's buffer, and needs it.
  wide = dataclasses.replace(claimed, wide_zero_box=True, tile_n=128,
                             streamed_zeros=True)
  doubled = dataclasses.replace(wide, double_zero_buffer=True)
  assert (math.prod(doubled.zero_box("bfloat16"))
          == 2 * math.prod(wide.zero_box("bfloat16")))
  for fields in (dict(streamed_zeros=False), dict(wide_zero_box=False)):
    with pytest.raises(ValueError, match="double_zero_buffer needs"):
      dataclasses.replace(doubled, **fields)


def test_claimed_zeros_need_largest_first():
  with pytest.raises(ValueError, match="zero_drip needs largest_first"):
    RaggedConfig(tile_m=64, tile_n=64, claim_tiles=True,
                 zeros_by_producer=True, zero_drip=2)


@pytest.mark.parametrize("fields,match", [
    (dict(), "cut_groups_first needs piece_rows"),
    (dict(piece_rows=64, largest_first=True), "excludes largest_first"),
    (dict(piece_rows=64, empty_last=True), "excludes empty_last"),
    (dict(piece_rows=64, zeros_by_producer=True, zero_drip=2),
     "excludes zero_drip")])
def test_cut_groups_first_needs_pieces_and_its_own_order(fields, match):
  with pytest.raises(ValueError, match=match):
    dataclasses.replace(SMALL, cut_groups_first=True, **fields)


def test_largest_first_and_empty_last_exclude_each_other():
  with pytest.raises(ValueError, match="largest_first and empty_last"):
    RaggedConfig(tile_m=64, tile_n=64, largest_first=True, empty_last=True)


def test_claim_tiles_is_a_contracting_option():
  config = dataclasses.replace(SMALL, claim_tiles=True)
  with pytest.raises(ValueError, match="claim_tiles is a \"contracting\""):
    config.check_mode("rows")


#: The weight gradient's output allocated at its own column count where the
#: last strip's stores end past it (compiled only: the interpreter pads),
#: with the short-reduction tile's one 256-column store per consumer.
UNPADDED_OUTPUT_CASES = [
    # 320 columns: the second strip's store reaches 192 columns past the
    # edge; an empty group (consumer-stored zeros), rows of no group.
    (200, 128, 320, [60, 0, 90, 33], 5, "bfloat16", "bfloat16",
     dataclasses.replace(SMALL, tile_m=64, tile_n=256, epi_tile_n=256)),
    # ... with the H200's claims and the producer's streamed zero drip; then
    # cut pieces merged in place.
    (260, 128, 320, [0, 200, 0, 7, 50, 0], 5, "bfloat16", "bfloat16",
     dataclasses.replace(SMALL, tile_m=64, tile_n=256, epi_tile_n=256,
                         zeros_by_producer=True, zero_drip=1,
                         empty_last=True, wide_zero_box=True,
                         claim_tiles=True, streamed_zeros=True)),
    (260, 64, 320, [0, 200, 0, 50], 0, "bfloat16", "bfloat16",
     dataclasses.replace(SMALL, tile_m=64, tile_n=256, epi_tile_n=256,
                         piece_rows=64, largest_first=True)),
]


@pytest.mark.parametrize("case", range(len(UNPADDED_OUTPUT_CASES)),
                         ids=["short_tile", "claimed_streamed_zeros",
                              "pieces"])
def test_contracting_output_unpadded(case):
  m, k, n, sizes, _, _, out_dtype, config = UNPADDED_OUTPUT_CASES[case]
  assert mosaic_contracting.output_columns(
      n, config, out_dtype, compiled=True) == n
  assert mosaic_contracting.output_columns(
      n, config, out_dtype, compiled=False) > n
  _run_contracting(UNPADDED_OUTPUT_CASES[case], detect_races=False)


@pytest.mark.parametrize("n,tile_n,out_dtype,want", [
    (1408, 256, "bfloat16", 1408),   # whole spans, wider than a box
    (1400, 256, "bfloat16", 1536),   # not whole 64-column spans
    (1400, 256, "float32", 1536),    # ... nor 32-column ones
    (1408, 128, "float32", 1408),
    (1440, 256, "float32", 1440),    # 32-column spans of float32
    (200, 256, "bfloat16", 256),     # narrower than one box
])
def test_output_columns(n, tile_n, out_dtype, want):
  config = RaggedConfig(tile_m=64, tile_n=tile_n, epi_tile_n=tile_n)
  assert mosaic_contracting.output_columns(
      n, config, out_dtype, compiled=True) == want
  assert mosaic_contracting.output_columns(
      n, config, out_dtype, compiled=False) == -(-n // tile_n) * tile_n


@pytest.mark.parametrize("n,narrow,want", [
    (24, False, 128),   # narrower than a strip: the whole strip allocated
    (136, False, 256),  # a last strip of 8 columns
    (24, True, 64),     # the narrow strip stores one 64-column box
    (136, True, 192),
])
def test_output_columns_hold_every_box_a_strip_stores(n, narrow, want):
  """Without narrow_last_strip every strip stores tile_n columns; its boxes
  past an output allocated narrower came back wrong on the H200 (the
  random sweep's g37 m65536 k312 n24 weight gradient)."""
  config = RaggedConfig(tile_m=128, tile_n=128, epi_tile_n=64,
                        narrow_last_strip=narrow)
  for compiled in (True, False):
    assert mosaic_contracting.output_columns(
        n, config, "bfloat16", compiled=compiled) == want


@pytest.mark.parametrize("k_out,n_out,want", [
    (320, 1408, (64, 128)),
    (312, 64, (8, 64)),     # K of 312: no tile reaches past a group's rows
    (336, 192, (16, 128)),
    (72, 136, (8, 128)),
])
def test_merge_tile_divides_the_rows(k_out, n_out, want):
  assert mosaic_contracting.merge_tile(k_out, n_out) == want


@pytest.mark.parametrize("k_out,n_out,dtype", [
    (72, 136, jnp.float32), (312, 64, jnp.bfloat16), (336, 192, jnp.float32)])
def test_merge_pieces_lowers_for_cuda_at_rows_of_no_whole_tile(k_out, n_out,
                                                               dtype):
  """The merge's tiles at K not a multiple of 64 lower for the GPU (an
  8 x 8 tile failed Mosaic's layout inference)."""
  spec = jax.ShapeDtypeStruct
  lower_for_cuda(
      lambda first, rest, extras: mosaic_contracting.merge_pieces(
          first, rest, extras, None),
      spec((4, k_out, n_out), dtype), spec((5, k_out, n_out), dtype),
      spec((3, 5), jnp.int32))


def test_short_tile_output_unpadded_lowers_for_cuda():
  """DeepSeek-V2-Lite's weight gradient at 96 rows per expert (the short
  tile, 256-column stores over 1408 columns), with claims and streamed
  zeros, lowers for the GPU with its output at 1408 columns."""
  problem = RaggedProblem("contracting", 6144, 2048, 1408, 64, "bfloat16",
                          "bfloat16")
  config = mosaic.heuristic(problem, HOPPER)
  assert (config.tile_n, config.epi_tile_n) == (256, 256)
  assert config.streamed_zeros
  text = _lower_for_cuda(problem, config).as_text()
  assert "1408x1536" not in text and "x1536x" not in text


@pytest.mark.parametrize("mode", ["rows", "contracting"])
def test_outputs_of_misaligned_rows_are_cut_by_the_copy_kernel(mode):
  """Compiled, an output of n columns not a multiple of 8 (rows starting at
  misaligned addresses) is cut by `tma.unpad_output`'s Pallas-Triton copy,
  which lowers for the GPU beside the Mosaic kernel; n a multiple of 8
  keeps XLA's slice."""
  for n, want in ((77, True), (80, False)):
    problem = RaggedProblem(mode, 300, 136, n, 4, "bfloat16", "bfloat16")
    text = _lower_for_cuda(problem, mosaic.heuristic(problem, HOPPER)).as_text()
    assert ("unpad_output" in text) == want, (mode, n)


#: `RaggedConfig.narrow_last_strip`: the last column strip's tiles compute
#: only the columns it holds (a narrower wgmma and accumulator, the stores
#: past them empty bulk groups).
NARROW_STRIP_CASES = [
    # Turns at whole 64 x 192 tiles, 256 columns: the second strip holds 64
    # of them. Three stores per tile over two slots (the slot follows the
    # tile's number), group boundaries mid-chunk, an empty group, rows of
    # no group.
    (230, 128, 256, [60, 130, 0, 33], 5, "bfloat16", "bfloat16",
     dataclasses.replace(SMALL, tile_n=192, ping_pong=True, out_slots=2,
                         stages=3, narrow_last_strip=True)),
    # Consumers splitting a 128 x 192 tile, 200 columns (stored as 256, a
    # last strip of 64), an f32 output.
    (150, 128, 200, [30, 0, 70, 45], 2, "bfloat16", "float32",
     dataclasses.replace(SMALL, tile_n=192, narrow_last_strip=True)),
    # float16 in, float32 out: 262 columns, staged as 320, so the second
    # strip computes 128 of them.
    (150, 128, 262, [30, 0, 70, 45], 2, "float16", "float32",
     dataclasses.replace(SMALL, tile_n=192, ping_pong=True, stages=3,
                         narrow_last_strip=True)),
    # 64-column planes: the last strip multiplies two of its three.
    (230, 128, 320, [60, 130, 0, 33], 5, "bfloat16", "bfloat16",
     dataclasses.replace(SMALL, tile_n=192, ping_pong=True, stages=3,
                         operand_planes=True, narrow_last_strip=True)),
    # Most tokens in one group, cut into pieces, producer-stored zeros,
    # claimed tiles (their turns from the queue): the narrow strip's pieces
    # are merged and its zero tiles stored whole.
    (260, 64, 256, [0, 200, 0, 50], 0, "bfloat16", "bfloat16",
     dataclasses.replace(SMALL, tile_n=192, ping_pong=True,
                         zeros_by_producer=True, piece_rows=64, stages=3,
                         largest_first=True, claim_tiles=True,
                         narrow_last_strip=True)),
]


@pytest.mark.parametrize("case", range(len(NARROW_STRIP_CASES)),
                         ids=["turns", "split", "f16_in_f32_out", "planes",
                              "claimed_pieces"])
def test_contracting_narrow_last_strip(case):
  n, config = NARROW_STRIP_CASES[case][2], NARROW_STRIP_CASES[case][-1]
  out_cols = configs.staged_columns(n, config)
  assert config.last_strip_columns(out_cols) < config.tile_n
  _run_contracting(NARROW_STRIP_CASES[case], detect_races=case == 0)


@pytest.mark.parametrize("tile_n,epi_tile_n,out_cols,want", [
    (192, 64, 1408, 64), (192, 64, 2048, 128), (192, 64, 768, 192),
    (128, 64, 1408, 128), (192, 64, 64, 64), (256, 128, 384, 128)])
def test_last_strip_columns(tile_n, epi_tile_n, out_cols, want):
  """The last strip computes the columns it holds with narrow_last_strip,
  the whole tile_n without; out_cols must be whole stores."""
  config = RaggedConfig(tile_n=tile_n, epi_tile_n=epi_tile_n,
                        narrow_last_strip=True)
  assert config.last_strip_columns(out_cols) == want
  plain = dataclasses.replace(config, narrow_last_strip=False)
  assert plain.last_strip_columns(out_cols) == tile_n
  with pytest.raises(ValueError, match="out_cols=.* multiple of epi_tile_n"):
    config.last_strip_columns(out_cols + 8)


def test_narrow_last_strip_rejects_what_it_cannot_run():
  """Not with cluster_columns (one width a cluster), and a "contracting"
  option; each error names the option."""
  with pytest.raises(ValueError, match="narrow_last_strip excludes "
                     "cluster_columns"):
    RaggedConfig(cluster_columns=True, narrow_last_strip=True)
  with pytest.raises(ValueError,
                     match="narrow_last_strip is a \"contracting\""):
    RaggedConfig(narrow_last_strip=True).check_mode("rows")


@pytest.mark.parametrize("groups,m,k,n,narrow", [
    (64, 16384, 2048, 1408, True),    # g64: seven strips of 192, one of 64
    (60, 16384, 1408, 2048, True),    # Qwen1.5-MoE down: ten, one of 128
    (32, 12000, 2880, 2880, False),   # gpt-oss-20b: fifteen whole strips
    (64, 32768, 2048, 1024, False),   # OLMoE: 128-column turns, whole
    (256, 32768, 7168, 2048, False),  # DeepSeek-V3: the short tile, whole
], ids=["g64", "qwen1.5_down", "gpt_oss", "olmoe", "deepseek_v3"])
def test_contracting_heuristic_narrows_a_partial_last_strip(groups, m, k, n,
                                                            narrow):
  """The weight gradient's heuristic computes only the columns its last
  strip holds exactly where that strip is partial, on every GPU, and so
  do the sweep's candidates."""
  problem = RaggedProblem("contracting", m, k, n, groups, "bfloat16",
                          "bfloat16")
  h100 = dataclasses.replace(HOPPER, device_kind="NVIDIA H100 80GB HBM3")
  for device in (HOPPER, h100):
    config = mosaic.heuristic(problem, device)
    out_cols = configs.staged_columns(n, config)
    partial = out_cols % config.tile_n != 0
    assert config.narrow_last_strip == partial
    if device is HOPPER:
      assert partial == narrow
  for config in configs.candidates(problem):
    out_cols = configs.staged_columns(n, config)
    assert config.narrow_last_strip == (out_cols % config.tile_n != 0
                                        and not config.cluster_columns)


@pytest.mark.parametrize("groups,m,k,n,cut", [
    (32, 32768, 1024, 512, True),     # Granite-3.0-1B: 16 tiles a group
    (128, 32768, 2048, 768, False),   # Qwen3-30B: 96 (measured no gain)
    (64, 32768, 2048, 1024, False),   # OLMoE: 128
    (32, 3000, 1024, 512, False),     # pieces of fewer than 2048 rows
    (4, 96, 64, 128, False),          # tiny: one tile, but tiny pieces
], ids=["granite", "qwen3", "olmoe", "short_pieces", "tiny"])
def test_contracting_heuristic_cuts_where_one_group_idles_the_sms(
    groups, m, k, n, cut):
  """The weight gradient's heuristic cuts the reductions into pieces, walked
  largest first, exactly where one group's tiles are at most a quarter of
  the SMs and the pieces are long; on every GPU."""
  problem = RaggedProblem("contracting", m, k, n, groups, "bfloat16",
                          "bfloat16")
  h100 = dataclasses.replace(HOPPER, device_kind="NVIDIA H100 80GB HBM3")
  for device in (HOPPER, h100):
    config = mosaic.heuristic(problem, device)
    assert bool(config.piece_rows) == cut
    if cut:
      assert config.largest_first and not config.empty_last
      assert config.piece_rows >= configs.PIECES_MIN_ROWS
      assert config.piece_rows == configs.filling_piece_rows(
          problem, dataclasses.replace(config, piece_rows=0),
          device.planning_sms)
      assert config.fits(problem)


@pytest.mark.parametrize("groups,m,k,n,spread", [
    (16, 8192, 5120, 8192, True),     # Llama-4-Scout: 0.69 TFLOP
    (32, 12000, 2880, 2880, True),    # gpt-oss-20b: 0.20 TFLOP
    (128, 32768, 2048, 768, False),   # Qwen3-30B: 0.10 TFLOP
    (256, 32768, 7168, 2048, False),  # DeepSeek-V3: the short tile
    (32, 32768, 1024, 512, False),    # Granite-3.0-1B: cut into pieces
    (1, 16384, 4096, 4096, False),    # one group: none to be empty
    (8, 16384, 4096, 14336, True),    # Mixtral 8x7B: the split tile
], ids=["llama4", "gpt_oss", "qwen3", "short_tile", "pieces", "one_group",
        "split_tile"])
def test_contracting_heuristic_spreads_zero_tiles_on_long_calls(
    groups, m, k, n, spread):
  """The weight gradient's heuristic spreads the empty groups' zero tiles
  between the tiles with rows exactly where the consumers store them on
  long reductions and the call does SPREAD_ZERO_TILES_MIN_FLOPS, stored
  evicted from L2 first where the consumers take turns or read operand
  planes; on every GPU; the config lowers."""
  problem = RaggedProblem("contracting", m, k, n, groups, "bfloat16",
                          "bfloat16")
  h100 = dataclasses.replace(HOPPER, device_kind="NVIDIA H100 80GB HBM3")
  for device in (HOPPER, h100):
    config = mosaic.heuristic(problem, device)
    assert config.spread_zero_tiles == spread
    assert config.zero_tiles_evict_first == (
        spread and (config.ping_pong or config.operand_planes))
    if spread:
      assert config.empty_last and config.fits(problem)
      _lower_for_cuda(problem, config)


def test_narrow_last_strip_lowers_for_cuda():
  """g64's weight gradient at the 128 x 192 turns (1408 columns: seven
  strips of 192 and one of 64) with the narrow last strip, and with its
  operands read in place as planes (12282 rows), lower for the GPU."""
  for m in (16384, 12282):
    problem = RaggedProblem("contracting", m, 2048, 1408, 64, "bfloat16",
                            "bfloat16")
    config = dataclasses.replace(mosaic.heuristic(problem, HOPPER),
                                 narrow_last_strip=True)
    assert config.cta_tile("contracting") == (128, 192)
    assert config.operand_planes == (m % 8 != 0)
    _lower_for_cuda(problem, config)


#: `RaggedConfig.operand_planes`: lhs and dout held as 64-column planes, one
#: 64 x 64 wgmma per pair. On the GPU, rows not a multiple of 8 are read in
#: place (m = 230, 150, 261); in the interpreter they are padded.
PLANES_CASES = [
    # Consumers splitting a 128-row K tile (two lhs planes each), a group
    # boundary mid-chunk, an empty group, rows of no group.
    (230, 256, 128, [60, 130, 0, 33], 5, "bfloat16", "bfloat16",
     dataclasses.replace(SMALL, tile_m=128, tile_n=128, operand_planes=True)),
    # Turns at whole 128 x 128 tiles, an f32 output, K past one tile.
    (150, 192, 128, [30, 0, 70, 45], 2, "bfloat16", "float32",
     dataclasses.replace(SMALL, tile_m=128, tile_n=128, ping_pong=True,
                         stages=3, out_slots=2, operand_planes=True)),
    # The short-reduction tile (64 x 256 per consumer, one store each),
    # cut pieces walked largest first.
    (261, 128, 256, [5, 200, 0, 56], 0, "float16", "float16",
     dataclasses.replace(SMALL, tile_m=64, tile_n=256, epi_tile_n=256,
                         piece_rows=64, largest_first=True,
                         operand_planes=True)),
    # The producer stores the empty groups' zeros, most tokens in one group.
    (203, 128, 128, [0, 180, 0, 0, 23], 3, "bfloat16", "bfloat16",
     dataclasses.replace(SMALL, zeros_by_producer=True, operand_planes=True)),
]


@pytest.mark.parametrize("case", range(len(PLANES_CASES)),
                         ids=["split", "turns", "short_tile", "zeros"])
def test_contracting_operand_planes(case):
  _run_contracting(PLANES_CASES[case], detect_races=case == 1)


#: 32-row reduction chunks (`tile_k=32`, operands swizzled by 64 bytes): the
#: chunks that hold other groups' rows are masked through their transpose.
CHUNK32_CASES = [
    # Consumers splitting the tile, group boundaries mid-chunk, an empty
    # group, rows of no group; f32 out.
    (150, 128, 64, [30, 0, 70, 20], 3, "bfloat16", "float32",
     dataclasses.replace(SMALL, tile_k=32, stages=3)),
    # Turns at whole 128 x 128 tiles, f16, K past one tile.
    (230, 192, 128, [60, 130, 0, 33], 5, "float16", "float16",
     dataclasses.replace(SMALL, tile_m=128, tile_n=128, tile_k=32,
                         ping_pong=True, stages=4, out_slots=2)),
    # The short-reduction tile (64 x 256 per consumer), 32-row pieces walked
    # largest first, producer-stored zeros.
    (261, 128, 256, [5, 200, 0, 56], 0, "bfloat16", "bfloat16",
     dataclasses.replace(SMALL, tile_m=64, tile_n=256, epi_tile_n=256,
                         tile_k=32, piece_rows=32, largest_first=True,
                         zeros_by_producer=True)),
]


@pytest.mark.parametrize("case", range(len(CHUNK32_CASES)),
                         ids=["split", "turns", "short_tile"])
def test_contracting_32_row_chunks(case):
  _run_contracting(CHUNK32_CASES[case], detect_races=case == 1)


def test_32_row_chunks_lower_for_cuda():
  """The weight gradient's 32-row chunks at Qwen1.5-MoE's shape lower for
  the GPU: turns (the heuristic's tile there) and the split tile, with the
  ring as deep as fits and at eight stages."""
  problem = RaggedProblem("contracting", 16384, 2048, 1408, 60, "bfloat16",
                          "bfloat16")
  base = mosaic.heuristic(problem, HOPPER)
  assert configs.contracting_operand_swizzle(
      dataclasses.replace(base, tile_k=32), jnp.bfloat16) == 64
  assert configs.contracting_operand_swizzle(base, jnp.bfloat16) is None
  for fields in (dict(), dict(ping_pong=False)):
    config = configs._most_stages(
        dataclasses.replace(base, tile_k=32, **fields), problem)
    _lower_for_cuda(problem, config)
  _lower_for_cuda(problem, dataclasses.replace(base, tile_k=32, stages=8))


def test_32_row_chunks_are_contracting_only():
  with pytest.raises(ValueError, match="tile_k=32 excludes operand_planes"):
    RaggedConfig(tile_k=32, operand_planes=True)
  with pytest.raises(ValueError, match="tile_k=32 excludes cluster_columns"):
    RaggedConfig(tile_k=32, cluster_columns=True)
  with pytest.raises(ValueError, match="tile_k=32 excludes cluster_rows"):
    RaggedConfig(tile_k=32, cluster_rows=True)
  with pytest.raises(ValueError, match="tile_k"):
    RaggedConfig(tile_k=16)
  rows = RaggedProblem("rows", 256, 128, 128, 4, "bfloat16", "bfloat16")
  with pytest.raises(ValueError, match="tile_k=32 is a \"contracting\""):
    RaggedConfig(tile_k=32).check_mode(rows.mode)


#: `RaggedConfig.halve_last_round`: with the interpreter's two CTAs, an odd
#: tile count ends on a round of one tile, which runs as two half tiles.
HALVED_ROUND = dataclasses.replace(SPLIT_ROWS, halve_last_round=True)
HALVE_LAST_ROUND_CASES = [
    # Three items in one strip: the third runs as its two column halves,
    # the second of which ends past n; an empty group.
    (200, 72, 100, [70, 0, 130], 0, "bfloat16", "float32", False, None),
    # Rows of no group before and after the groups, rhs read as (G, n, k),
    # silu; five items in three strips, the last tile's second half wholly
    # past n; f16.
    (150, 128, 300, [30, 0, 70, 20], 5, "float16", "float16", True, "silu"),
    # An even tile count: nothing halved.
    (130, 64, 256, [0, 130, 0], 0, "bfloat16", "bfloat16", False, None),
]


@pytest.mark.parametrize("case", range(len(HALVE_LAST_ROUND_CASES)),
                         ids=["odd", "transposed_past_n", "even"])
def test_rows_halve_last_round(case):
  m, k, n, sizes, offset, in_dtype, out_dtype, transpose, act = (
      HALVE_LAST_ROUND_CASES[case])
  problem = RaggedProblem("rows", m, k, n, len(sizes), in_dtype, out_dtype,
                          transpose_rhs=transpose, activation=act)
  _run(problem, sizes, row_offset=offset, config=HALVED_ROUND,
       detect_races=case == 0)


@pytest.mark.parametrize("transpose", [False, True], ids=["forward", "dlhs"])
def test_rows_halve_last_round_lowers_for_cuda(transpose):
  """The halved round lowers for the GPU at Granite-3.0-1B's expert shape,
  on the heuristic's split tile."""
  problem = RaggedProblem("rows", 32768, 1024 if not transpose else 512,
                          512 if not transpose else 1024, 32, "bfloat16",
                          "bfloat16", transpose_rhs=transpose)
  config = mosaic.heuristic(problem, HOPPER)
  assert config.split_rows and not config.swap_ab
  _lower_for_cuda(problem, dataclasses.replace(config, halve_last_round=True))


@pytest.mark.parametrize("layer", ["granite3_1b_t4096_up", "dbrx_t3001_down",
                                   "deepseek_v3_up", "qwen3_30b_a3b_up"])
def test_heuristic_halves_the_split_tiles_last_round(layer):
  """The split 128-row tile halves a short last round; the turns, the
  transposed tiles and the 64-row tile do not have the option."""
  layers = {l.name: l for ls in arg_specs.SUITES.values() for l in ls}
  for direction in ("forward", "dlhs"):
    problem = arg_specs.MoeCase(layers[layer], "even", direction).problem
    config = mosaic.heuristic(problem, HOPPER)
    assert config.halve_last_round == (
        config.split_rows and config.tile_m == 128 and not config.swap_ab)
    assert config.halve_last_round == (layer != "qwen3_30b_a3b_up")


def test_halve_last_round_is_checked():
  with pytest.raises(ValueError, match="halve_last_round needs split_rows"):
    dataclasses.replace(SMALL, halve_last_round=True)
  with pytest.raises(ValueError, match="halve_last_round excludes swap_ab"):
    dataclasses.replace(HALVED_ROUND, swap_ab=True, swizzled_staging=True)
  problem = RaggedProblem("contracting", 64, 64, 64, 2, "bfloat16",
                          "float32")
  # The error names it, not the split_rows it needs.
  with pytest.raises(ValueError, match="halve_last_round is a \"rows\"-mode "
                     "option: the \"contracting\" kernel cuts"):
    HALVED_ROUND.check_mode(problem.mode)


#: `RaggedConfig.split_k`: each tile's reduction in shares, float32 partial
#: sums added after the kernel.
SPLIT_K_CASES = [
    # Three shares of 3, 3 and 1 K steps (k = 7 steps, the last partial);
    # an empty group; rows of no group after the groups.
    (100, 420, 128, [30, 0, 50], 0, "bfloat16", "bfloat16", False, None, 3),
    # rhs read as (G, n, k), sigmoid on the groups' rows only (rows before
    # row_offset and after the groups stay 0); odd n; f16.
    (90, 256, 100, [20, 0, 40], 7, "float16", "float16", True, "sigmoid", 4),
    # More shares asked for than K steps: two of one step each; one group
    # of every row, a float32 output.
    (70, 128, 64, [70], 0, "bfloat16", "float32", False, "silu", 5),
]


@pytest.mark.parametrize("case", SPLIT_K_CASES,
                         ids=["uneven_last_share", "transposed_sigmoid",
                              "more_shares_than_steps"])
def test_rows_split_k(case):
  m, k, n, sizes, offset, in_dtype, out_dtype, transpose, act, shares = case
  problem = RaggedProblem("rows", m, k, n, len(sizes), in_dtype, out_dtype,
                          transpose_rhs=transpose, activation=act)
  config = dataclasses.replace(SMALL, split_k=shares)
  _run(problem, sizes, row_offset=offset, config=config,
       detect_races=case is SPLIT_K_CASES[0])


@pytest.mark.parametrize("k_iters, split_k, want", [
    (7, 3, (3, 3)), (8, 4, (4, 2)), (9, 4, (3, 3)), (2, 5, (2, 1)),
    (117, 11, (11, 11)),
    (1, 1, (1, 1))])
def test_k_splits_give_every_share_a_step(k_iters, split_k, want):
  shares, per_share = configs.k_splits(
      dataclasses.replace(SMALL, split_k=split_k), k_iters)
  assert (shares, per_share) == want
  assert (shares - 1) * per_share < k_iters <= shares * per_share


def test_split_k_is_checked():
  with pytest.raises(ValueError, match="split_k excludes swap_ab"):
    dataclasses.replace(SMALL, split_k=2, ping_pong=True, swap_ab=True,
                        swizzled_staging=True)
  with pytest.raises(ValueError, match="split_k excludes swizzled_staging"):
    dataclasses.replace(SMALL, split_k=2, swizzled_staging=True)
  with pytest.raises(ValueError, match="split_k excludes halve_last_round"):
    dataclasses.replace(HALVED_ROUND, split_k=2)
  with pytest.raises(ValueError, match="split_k"):
    dataclasses.replace(SMALL, split_k=0)
  problem = RaggedProblem("contracting", 64, 64, 64, 2, "bfloat16",
                          "bfloat16")
  with pytest.raises(ValueError, match="split_k is a \"rows\"-mode option"):
    dataclasses.replace(SMALL, split_k=2).check_mode(problem.mode)


def test_split_k_shared_memory_holds_float32_staging():
  """The shares stage float32 partial sums: twice a bfloat16 output's
  staging bytes, which the fit check counts."""
  problem = RaggedProblem("rows", 64, 4096, 512, 1, "bfloat16", "bfloat16")
  config = dataclasses.replace(SMALL, split_k=2)
  staging = (config.staging_buffers * config.out_slots
             * config.staged_rows("rows") * config.epi_tile_n)
  assert (config.smem_bytes(problem) - SMALL.smem_bytes(problem)
          == staging * 2)


@pytest.mark.parametrize("g, m, k, n, transpose, shares", [
    # One expert's dlhs of 129 rows over a 7488-long reduction, four
    # output strips: 12 tiles.
    (1, 129, 7488, 512, True, 11),
    # Mixtral 8x7B's down projection at one token (top-2).
    (8, 2, 14336, 4096, False, 2),
    # Rows not a multiple of 8 (lhs read in place), silu.
    (2, 33, 4000, 200, False, 7),
])
def test_heuristic_splits_few_tiles_over_long_reductions(g, m, k, n,
                                                         transpose, shares):
  problem = RaggedProblem("rows", m, k, n, g, "bfloat16", "bfloat16",
                          transpose_rhs=transpose,
                          activation="silu" if m == 33 else None)
  config = mosaic.heuristic(problem, HOPPER)
  assert config.split_k == shares and config.fits(problem)
  _lower_for_cuda(problem, config)


def test_heuristic_splits_no_suite_layer_but_decode_steps():
  """Of every suite's "rows" cases only two one-token decode steps are
  split: Mixtral 8x7B's dlhs (2 items x 32 strips of 128 columns) on the
  64 x 64 tile, and DeepSeek-V3's forward (8 items x 8 strips) on the
  heuristic's own 256-column strips. The model layers fill the SMs with
  tiles."""
  split = {case.label: mosaic.heuristic(case.problem, HOPPER)
           for layers in arg_specs.SUITES.values()
           for case in arg_specs.cases(layers)}
  split = {label: config for label, config in split.items()
           if config.split_k > 1}
  routings = ("even", "zipf", "one_hot")
  assert set(split) == ({f"mixtral8x7b_t1_up {d} dlhs" for d in routings}
                        | {f"deepseek_v3_t1_up {d} forward" for d in routings})
  for label, config in split.items():
    assert config.split_k == 2 and not config.swizzled_staging
    assert config.tile_n == (128 if label.startswith("deepseek") else 64)


@hypothesis.settings(max_examples=150, deadline=None, derandomize=True)
@hypothesis.given(groups=st.integers(1, 256), m=st.integers(1, 70000),
                  k=st.integers(1, 20000), n=st.integers(1, 20000),
                  transpose=st.booleans(),
                  out_dtype=st.sampled_from(["bfloat16", "float32"]),
                  activation=st.sampled_from([None, "silu"]))
def test_rows_heuristic_splits_only_few_tiles_of_long_reductions(
    groups, m, k, n, transpose, out_dtype, activation):
  """On any "rows" problem the heuristic's config fits and is a "rows"
  config; where it splits, each share holds at least SPLIT_K_MIN_STEPS K
  steps and the shares of its likely tiles fit the SMs."""
  problem = RaggedProblem("rows", m, k, n, groups, "bfloat16", out_dtype,
                          transpose_rhs=transpose, activation=activation)
  h100 = dataclasses.replace(HOPPER, device_kind="NVIDIA H100 80GB HBM3")
  for device in (HOPPER, h100):
    config = mosaic.heuristic(problem, device)
    assert config.fits(problem)
    config.check_mode("rows")
    if config.split_k == 1:
      continue
    shares, per_share = configs.k_splits(config, math.ceil(k / config.tile_k))
    assert 2 <= shares <= config.split_k
    assert per_share >= configs.SPLIT_K_MIN_STEPS
    assert (configs._likely_tiles(problem, config) * shares  # noqa: SLF001
            <= device.planning_sms)


def test_split_on_the_heuristics_own_strips_lowers_for_cuda():
  problem = arg_specs.MoeCase(
      {l.name: l for l in arg_specs.MOE_EDGE_LAYERS}["deepseek_v3_t1_up"],
      "zipf", "forward").problem
  config = mosaic.heuristic(problem, HOPPER)
  assert (config.tile_m, config.tile_n, config.split_k) == (64, 128, 2)
  _lower_for_cuda(problem, config)


#: `RaggedConfig.group_bands`: the bands of row items restart at each group.
GROUP_BANDS_CASES = [
    # Groups of 1, 3 and 5 items in bands of 2, an empty group, rows of no
    # group before and after them; three column strips.
    (460, 64, 192, [64, 0, 150, 3, 260], 9, "bfloat16", "float32", False,
     None, dataclasses.replace(SMALL, group_bands=True)),
    # rhs read transposed, turns at whole tiles, silu, a band taller than
    # any group; f16.
    (300, 128, 128, [40, 130, 0, 70, 1], 0, "float16", "float16", True,
     "silu", dataclasses.replace(SMALL, group_bands=True, ping_pong=True,
                                 grid_band=8, stages=3)),
    # 128-row tiles split between the consumers, one group of every token.
    (390, 64, 128, [0, 390], 0, "bfloat16", "bfloat16", False, None,
     dataclasses.replace(SPLIT_ROWS, group_bands=True, out_slots=1)),
]


@pytest.mark.parametrize("case", GROUP_BANDS_CASES,
                         ids=["bands_of_2", "transposed_turns", "one_group"])
def test_rows_group_bands(case):
  m, k, n, sizes, offset, in_dtype, out_dtype, transpose, act, config = case
  problem = RaggedProblem("rows", m, k, n, len(sizes), in_dtype, out_dtype,
                          transpose_rhs=transpose, activation=act)
  _run(problem, sizes, row_offset=offset, config=config,
       detect_races=case is GROUP_BANDS_CASES[0])


def test_group_bands_is_a_rows_mode_option():
  problem = RaggedProblem("contracting", 64, 64, 64, 2, "bfloat16",
                          "bfloat16")
  with pytest.raises(ValueError, match="group_bands is a \"rows\""):
    mosaic.ragged_matmul(
        jnp.ones(problem.lhs_shape, jnp.bfloat16),
        jnp.ones(problem.rhs_shape, jnp.bfloat16),
        jnp.array([32, 32], jnp.int32), jnp.zeros((1,), jnp.int32),
        problem=problem, config=dataclasses.replace(SMALL, group_bands=True),
        interpret=True)


#: `RaggedConfig.zero_drip`: the producer stores the empty groups' zero
#: tiles through a cursor of its own, a few boxes after each load.
_DRIP = dataclasses.replace(SMALL, zeros_by_producer=True)
ZERO_DRIP_CASES = [
    # One box per load: more zero boxes than the CTA has loads, so the
    # cursor crosses tiles between loads and stores the rest at the end.
    (200, 128, 128, [0, 180, 0, 0, 20], 3, "bfloat16", "bfloat16",
     dataclasses.replace(_DRIP, zero_drip=1)),
    # No empty group: the cursor starts past the CTA's last tile.
    (200, 128, 64, [50, 100, 50], 0, "bfloat16", "float32",
     dataclasses.replace(_DRIP, zero_drip=2)),
    # Every token in one group of eight, f16 out; a budget larger than the
    # CTA's zero boxes stores them all after its first load.
    (128, 192, 128, [0, 0, 0, 0, 0, 0, 128, 0], 0, "float16", "float16",
     dataclasses.replace(_DRIP, zero_drip=16)),
    # Turns at whole tiles, a cut group walked largest first (its unused
    # pieces are neither stored nor zeroed by the cursor).
    (260, 64, 128, [0, 200, 0, 50], 0, "bfloat16", "float32",
     dataclasses.replace(_DRIP, ping_pong=True, largest_first=True,
                         piece_rows=64, stages=3, zero_drip=3)),
    # 2-CTA clusters: each CTA's cursor stores its own column strips.
    (150, 128, 192, [30, 0, 70, 0], 2, "bfloat16", "bfloat16",
     dataclasses.replace(_DRIP, cluster_columns=True, zero_drip=2)),
    # The zero box as wide as the 256-column CTA tile (16 rows of bf16),
    # and for a float32 output (8 rows) on 64-column tiles (32 rows).
    (130, 128, 256, [0, 100, 0, 30], 0, "bfloat16", "bfloat16",
     dataclasses.replace(_DRIP, tile_n=256, epi_tile_n=128, out_slots=2,
                         zero_drip=2, wide_zero_box=True)),
    (200, 128, 128, [0, 180, 0, 0, 20], 3, "bfloat16", "float32",
     dataclasses.replace(_DRIP, zero_drip=1, wide_zero_box=True)),
]


@pytest.mark.parametrize("case", ZERO_DRIP_CASES,
                         ids=lambda c: f"m{c[0]}_g{len(c[3])}_drip"
                         f"{c[7].zero_drip}"
                         f"{'_wide_box' if c[7].wide_zero_box else ''}")
def test_contracting_zero_drip(case):
  _run_contracting(case, detect_races=case is ZERO_DRIP_CASES[0])


def test_wide_zero_box_shapes():
  """`RaggedConfig.wide_zero_box`: the CTA tile's columns (at most 256) in
  ZERO_BOX's bytes; ZERO_BOX without it."""
  short = RaggedConfig(tile_m=64, tile_n=256, epi_tile_n=128, out_slots=2,
                       zeros_by_producer=True, wide_zero_box=True)
  assert short.zero_box("bfloat16") == (16, 256)
  assert short.zero_box("float32") == (8, 256)
  turns = RaggedConfig(tile_m=128, tile_n=192, ping_pong=True,
                       zeros_by_producer=True, wide_zero_box=True)
  assert turns.zero_box("bfloat16") == (16, 192)
  assert dataclasses.replace(short, wide_zero_box=False).zero_box(
      "bfloat16") == configs.ZERO_BOX


def test_wide_zero_box_needs_zeros_by_producer():
  with pytest.raises(ValueError, match="wide_zero_box needs zeros_by_prod"):
    RaggedConfig(tile_m=64, tile_n=64, wide_zero_box=True)


def test_zero_drip_needs_zeros_by_producer():
  # (which "rows" mode refuses, so zero_drip needs no check of its own there)
  with pytest.raises(ValueError, match="zero_drip=2 needs zeros_by_producer"):
    RaggedConfig(tile_m=64, tile_n=64, zero_drip=2)


#: `RaggedConfig.short_tile_lookahead`: while loading a tile of at most L
#: reduction chunks the producer keeps at most L ring steps in flight.
LOOKAHEAD_CASES = [
    # Tiles of 1 to 4 chunks on a ring of 4: short and long tiles in turn,
    # the cap changing from tile to tile; an empty group; rows of no group.
    (400, 64, 128, [64, 0, 130, 20, 180], 3, "bfloat16", "bfloat16",
     dataclasses.replace(SMALL, stages=4, short_tile_lookahead=2)),
    # A cap of 3 on a ring of 4, turns at whole tiles, producer-stored zeros
    # dripped between the loads.
    (300, 128, 64, [0, 150, 10, 0, 140], 0, "bfloat16", "float32",
     dataclasses.replace(SMALL, stages=4, short_tile_lookahead=3,
                         ping_pong=True, zeros_by_producer=True,
                         zero_drip=2)),
    # 2-CTA clusters (a stage is released by both CTAs' consumers).
    (200, 64, 192, [70, 0, 60, 70], 1, "bfloat16", "bfloat16",
     dataclasses.replace(SMALL, stages=3, short_tile_lookahead=2,
                         cluster_columns=True)),
]


@pytest.mark.parametrize("case", LOOKAHEAD_CASES,
                         ids=["ring4_cap2", "turns_drip_cap3", "clusters"])
def test_contracting_short_tile_lookahead(case):
  _run_contracting(case, detect_races=case is LOOKAHEAD_CASES[0])


@pytest.mark.parametrize("lookahead, stages", [(1, 4), (3, 3), (5, 4)])
def test_short_tile_lookahead_bounds(lookahead, stages):
  with pytest.raises(ValueError, match="short_tile_lookahead"):
    dataclasses.replace(SMALL, stages=stages, short_tile_lookahead=lookahead)


def test_short_tile_lookahead_lowers_for_cuda():
  """The capped producer (a while loop of releases before each load) lowers
  for the GPU at the heuristic's short-reduction tile of DeepSeek-V3."""
  (problem,) = [c.problem for c in arg_specs.cases()
                if c.label == "deepseek_v3_up even drhs"]
  config = configs.heuristic(problem, HOPPER)
  assert config.stages >= 3
  _lower_for_cuda(problem, dataclasses.replace(config, short_tile_lookahead=2))


@pytest.mark.parametrize("mode", ["rows", "contracting"])
def test_zero_tokens(mode):
  problem = RaggedProblem(mode, 0, 64, 64, 3, "bfloat16", "float32")
  out = mosaic.ragged_matmul(
      jnp.zeros(problem.lhs_shape, jnp.bfloat16),
      jnp.ones(problem.rhs_shape, jnp.bfloat16),
      jnp.zeros((3,), jnp.int32), jnp.zeros((1,), jnp.int32),
      problem=problem, config=SMALL, interpret=True)
  assert out.shape == problem.out_shape
  assert not np.any(np.asarray(out))


def test_no_groups_gives_zeros():
  problem = RaggedProblem("rows", 16, 64, 64, 0, "bfloat16", "float32",
                          activation="sigmoid")
  out = mosaic.ragged_matmul(
      jnp.ones((16, 64), jnp.bfloat16), jnp.ones((0, 64, 64), jnp.bfloat16),
      jnp.zeros((0,), jnp.int32), jnp.zeros((1,), jnp.int32),
      problem=problem, config=SMALL, interpret=True)
  assert out.shape == (16, 64) and not np.any(np.asarray(out))


def test_rows_zero_k_applies_activation_to_group_rows():
  problem = RaggedProblem("rows", 10, 0, 8, 2, "bfloat16", "float32",
                          activation="sigmoid")
  out = mosaic.ragged_matmul(
      jnp.zeros((10, 0), jnp.bfloat16), jnp.zeros((2, 0, 8), jnp.bfloat16),
      jnp.asarray([3, 4], jnp.int32), jnp.asarray([1], jnp.int32),
      problem=problem, config=SMALL, interpret=True)
  want = reference(np.zeros((10, 0)), np.zeros((2, 0, 8)), [3, 4], problem, 1)
  np.testing.assert_array_equal(np.asarray(out), want)


def _checked_row_items(sizes, offset, m, tile_m, balanced=False):
  """The "rows" work list, checked for what the compiled kernel relies on
  and the interpreter does not check: every item's tile lies inside lhs
  and holds the item's rows, with lhs padded to whole 8-row tiles (the
  tile starts on a multiple of 8 rows: Mosaic divides a TMA load's start
  by the swizzled tile's 8 rows) and with lhs read in place (any row count
  of at least tile_m; a tile held back to its last rows may start
  anywhere, the others start as padded); the items cover every row once,
  with its own group, and fit the static
  table. With `balanced` (`RaggedConfig.swap_ab`), a piece's items are
  as many and equally long, a multiple of 8 rows. Returns (item count,
  owner group of each row)."""
  items = jax.jit(mosaic_schedule.row_items,
                  static_argnames=("m", "tile_m", "row_align", "balanced"))
  table = np.asarray(items(jnp.asarray(sizes, jnp.int32),
                           jnp.asarray([offset], jnp.int32), m=m,
                           tile_m=tile_m, row_align=8, balanced=balanced))
  count = int(mosaic_schedule.item_count(table))
  # The count sits in an extra last column; the entries past it are zeros.
  table = table[:, :-1]
  assert count <= table.shape[1]
  assert not np.any(table[:, count:])
  lhs_rows = tma.padded_dims(m, 64, (8, 64), (tile_m, 64))[0]
  starts, ends = group_bounds(sizes, m, offset)
  owner = np.full(m, -1)
  for g, (s, e) in enumerate(zip(starts, ends)):
    owner[s:e] = g
  covered = np.zeros(m, int)
  for item, (group, lo, hi, first, items) in enumerate(table[:, :count].T):
    # Each item names its piece's items, which hold it.
    assert first <= item < first + items <= count
    piece = table[:, first:first + items]
    assert np.all(piece[mosaic_schedule.ITEM_PIECE_FIRST] == first)
    assert np.all(piece[mosaic_schedule.ITEM_PIECE_ITEMS] == items)
    assert np.all(piece[mosaic_schedule.ITEM_GROUP] == group)
    tile_row = int(mosaic_schedule.tile_first_row(
        np.int32(lo), row_align=8, lhs_rows=lhs_rows, tile_m=tile_m))
    assert tile_row % 8 == 0 and 0 <= tile_row <= lo < hi
    assert hi <= tile_row + tile_m <= lhs_rows
    in_place_rows = max(m, tile_m)
    in_place_row = int(mosaic_schedule.tile_first_row(
        np.int32(lo), row_align=8, lhs_rows=in_place_rows, tile_m=tile_m))
    assert 0 <= in_place_row <= lo < hi
    assert hi <= in_place_row + tile_m <= in_place_rows
    assert in_place_row in (tile_row, in_place_rows - tile_m)
    if balanced and item > first:  # the same stride from the piece's start
      start = int(piece[mosaic_schedule.ITEM_ROW_LO, 0]) // 8 * 8
      stride = int(piece[mosaic_schedule.ITEM_ROW_LO, 1]) - start
      assert stride % 8 == 0 and lo == start + (item - first) * stride
    assert np.all(owner[lo:hi] == group)
    covered[lo:hi] += 1
  np.testing.assert_array_equal(covered, 1)
  return count, owner


@pytest.mark.parametrize("sizes,offset,m,tile_m", [
    ([30, 0, 50, 20], 0, 100, 64),
    ([0, 0, 0], 0, 70, 64),
    ([200, 5], 3, 128, 64),        # clipped at m
    ([1] * 256, 10, 300, 128),     # G = 256
    ([64] * 4, 0, 256, 64),        # tile-aligned groups: one item each
])
def test_row_items_cover_every_row_once(sizes, offset, m, tile_m):
  count, owner = _checked_row_items(sizes, offset, m, tile_m)
  # Each piece (a group, or the rows of no group before or after them) is
  # cut into tiles from its first row rounded down to 8 rows.
  bounds = np.flatnonzero(np.diff(owner, prepend=-2, append=-3))
  assert count == sum(-(-(int(hi) - int(lo) // 8 * 8) // tile_m)
                      for lo, hi in zip(bounds[:-1], bounds[1:]))


@st.composite
def _group_layouts(draw):
  """Group sizes (empty, tiny, around tile multiples, one large), a row
  offset and an m that may cut the last groups off."""
  tile_m = draw(st.sampled_from([64, 128, 256]))
  sizes = draw(st.lists(st.sampled_from(
      [0, 1, 3, 7, 8, 9, 63, 64, 65, 127, 128, 129, 200, 257, 700]),
      min_size=1, max_size=12))
  offset = draw(st.sampled_from([0, 1, 5, 8, 100]))
  m = draw(st.sampled_from([1, 7, 64, 100, 300, offset + sum(sizes),
                            offset + sum(sizes) + 9]))
  return sizes, offset, max(m, 1), tile_m


@hypothesis.settings(max_examples=25, deadline=None, derandomize=True)
@hypothesis.given(_group_layouts())
def test_row_item_tiles_start_on_row_tiles_inside_lhs(layout):
  count = _checked_row_items(*layout)[0]
  # Balanced items are as many.
  assert _checked_row_items(*layout, balanced=True)[0] == count


def _work_list_kernel_table(sizes, offset, m, tile_m, balanced,
                            interpret=True):
  return np.asarray(work_list_kernel.row_items(
      jnp.asarray(sizes, jnp.int32), jnp.asarray([offset], jnp.int32), m=m,
      tile_m=tile_m, row_align=8, balanced=balanced, interpret=interpret))


@hypothesis.settings(max_examples=8, deadline=None, derandomize=True)
@hypothesis.given(_group_layouts(), st.booleans())
def test_work_list_kernel_builds_the_row_items_table(layout, balanced):
  """The Pallas-Triton work-list kernel (interpreted) writes the table of
  `mosaic_schedule.row_items` entry by entry, count column included."""
  sizes, offset, m, tile_m = layout
  want = mosaic_schedule.row_items(
      jnp.asarray(sizes, jnp.int32), jnp.asarray([offset], jnp.int32), m=m,
      tile_m=tile_m, row_align=8, balanced=balanced)
  np.testing.assert_array_equal(
      _work_list_kernel_table(sizes, offset, m, tile_m, balanced), want)


@pytest.mark.parametrize("groups", [1, 257, work_list_kernel.MAX_GROUPS])
def test_work_list_kernel_at_one_and_many_groups(groups):
  """One group, and more groups than the kernel runs in one warp (several
  programs of one column, group vectors padded to 512 and 1024 over more
  warps), with negative sizes (read as empty) and a row offset; compiled
  where there is a GPU."""
  rng = np.random.default_rng(groups)
  sizes = rng.integers(-2, 40, groups)
  m = int(np.maximum(sizes, 0).sum()) + 11
  want = mosaic_schedule.row_items(
      jnp.asarray(sizes, jnp.int32), jnp.asarray([5], jnp.int32), m=m,
      tile_m=64, row_align=8)
  np.testing.assert_array_equal(
      _work_list_kernel_table(sizes, 5, m, 64, False,
                              interpret=jax.default_backend() != "gpu"),
      want)


def test_work_list_kernel_option_is_checked():
  """The heuristic sets the kernel on GPUs only; it is a "rows"-mode
  option, and a call with more groups than it takes raises, naming it."""
  rows = RaggedProblem("rows", 16384, 2048, 1408, 64, "bfloat16", "bfloat16")
  assert mosaic.heuristic(rows, HOPPER).work_list_kernel
  assert not mosaic.heuristic(rows, DeviceInfo("cpu", "cpu")).work_list_kernel
  many = RaggedProblem("rows", 64, 64, 64, work_list_kernel.MAX_GROUPS + 1,
                       "bfloat16", "float32")
  assert not mosaic.heuristic(many, HOPPER).work_list_kernel
  with pytest.raises(ValueError, match="work_list_kernel"):
    mosaic.ragged_matmul(
        jnp.ones(many.lhs_shape, jnp.bfloat16),
        jnp.ones(many.rhs_shape, jnp.bfloat16),
        jnp.ones((many.groups,), jnp.int32), jnp.zeros((1,), jnp.int32),
        problem=many, config=dataclasses.replace(SMALL,
                                                 work_list_kernel=True),
        interpret=True)
  contracting = RaggedProblem("contracting", 64, 64, 64, 2, "bfloat16",
                              "float32")
  with pytest.raises(ValueError, match="work_list_kernel"):
    mosaic.ragged_matmul(
        jnp.ones((64, 64), jnp.bfloat16), jnp.ones((64, 64), jnp.bfloat16),
        jnp.asarray([30, 34], jnp.int32), jnp.zeros((1,), jnp.int32),
        problem=contracting,
        config=dataclasses.replace(SMALL, work_list_kernel=True),
        interpret=True)


def test_contracting_groups_table():
  table = np.asarray(mosaic_schedule.contracting_groups(
      jnp.asarray([30, 0, 70, 100, 57], jnp.int32),
      jnp.asarray([7], jnp.int32), m=250, chunk=64, row_align=8))
  np.testing.assert_array_equal(table[mosaic_schedule.GROUP_ROW_LO],
                                [7, 37, 37, 107, 207])
  np.testing.assert_array_equal(table[mosaic_schedule.GROUP_ROW_HI],
                                [37, 37, 107, 207, 250])
  # Chunks start at the group's first row rounded down to 8 rows: the 70
  # rows from 37 take rows 32-159 (two chunks, not the three of 0-191),
  # and the 43 rows from 207 one chunk from 200 (not two from 192).
  np.testing.assert_array_equal(table[mosaic_schedule.GROUP_FIRST_ROW],
                                [0, 32, 32, 104, 200])
  np.testing.assert_array_equal(table[mosaic_schedule.GROUP_CHUNKS],
                                [1, 0, 2, 2, 1])


def test_config_split_rows_needs_whole_halves():
  with pytest.raises(ValueError, match="split_rows"):
    RaggedConfig(tile_m=64, split_rows=True)
  with pytest.raises(ValueError, match="split_rows"):
    RaggedConfig(tile_m=256, tile_n=128, split_rows=True)
  with pytest.raises(ValueError, match="tile_m=256"):
    RaggedConfig(tile_m=256, tile_n=64)


def test_rows_rejects_interleave_groups():
  problem = RaggedProblem("rows", 64, 64, 64, 2, "bfloat16", "float32")
  with pytest.raises(ValueError, match="interleave_groups"):
    mosaic.ragged_matmul(
        jnp.zeros((64, 64), jnp.bfloat16), jnp.zeros((2, 64, 64), jnp.bfloat16),
        jnp.asarray([30, 34], jnp.int32), jnp.zeros((1,), jnp.int32),
        problem=problem, config=dataclasses.replace(SMALL,
                                                    interleave_groups=True),
        interpret=True)


@hypothesis.settings(max_examples=30, deadline=None, derandomize=True)
@hypothesis.given(
    sizes=st.lists(st.integers(0, 300), min_size=1, max_size=9),
    offset=st.integers(0, 70), slack=st.integers(0, 90),
    chunk=st.sampled_from([64, 128]), steps=st.integers(1, 4),
    row_align=st.sampled_from([1, 8]), one_group=st.booleans(),
    long_list=st.booleans())
def test_contracting_pieces_cover_each_group_once(sizes, offset, slack,
                                                  chunk, steps, row_align,
                                                  one_group, long_list):
  """Every group's rows are covered exactly once by its pieces, each at
  most piece_rows long; each piece's chunks start on a row_align boundary
  at most row_align - 1 rows before it and cover it; a group is cut only
  where it holds more than piece_rows rows, at the multiples of piece_rows
  inside it, the x-th multiple being further piece x; the pieces beyond the
  first name their group and its first such piece. With
  cut_groups_first, the same entries, the further pieces first, then the
  groups' first pieces by size, with their outputs. The masked sum and the
  long list's search agree."""
  if one_group:  # most rows in one group, cut several times
    sizes = [0] * (len(sizes) - 1) + [sum(sizes) + 5 * chunk * steps]
  # The search over the groups rather than the masked sum.
  with mock.patch.object(mosaic_schedule, "MASKED_SUM_MAX_ENTRIES",
                         0 if long_list else
                         mosaic_schedule.MASKED_SUM_MAX_ENTRIES):
    _check_contracting_pieces(sizes, offset, slack, chunk, steps, row_align)


def _check_contracting_pieces(sizes, offset, slack, chunk, steps, row_align):
  piece_rows = chunk * steps
  m = offset + sum(sizes) + slack
  sizes_in, offset_in = (jnp.asarray(sizes, jnp.int32),
                         jnp.asarray([offset], jnp.int32))
  table, extras = (np.asarray(a) for a in mosaic_schedule.contracting_pieces(
      sizes_in, offset_in, m=m, chunk=chunk, row_align=row_align,
      piece_rows=piece_rows))
  groups = len(sizes)
  extra_count = mosaic_schedule.max_extra_pieces(m, piece_rows)
  assert extra_count == max(m - 1, 0) // piece_rows
  assert table.shape == (4, groups + extra_count)
  assert extras.shape == (3, extra_count)
  lo, hi, first_row, chunks = table
  assert np.all(first_row % row_align == 0)
  assert np.all((first_row <= lo) & (lo - first_row < row_align))
  assert np.all(chunks == np.where(hi > lo, -(-(hi - first_row) // chunk),
                                   0))
  assert np.all(hi - lo <= piece_rows) and np.all(hi >= lo)
  owner = np.concatenate([np.arange(groups), extras[0]])
  starts, ends = group_bounds(sizes, m, offset)
  for g, (start, end) in enumerate(zip(starts, ends)):
    mine = [(lo[p], hi[p]) for p in np.flatnonzero(owner == g) if hi[p] > lo[p]]
    covered = sorted(mine)
    assert sum(b - a for a, b in covered) == end - start
    assert len(covered) == (1 + (end - 1) // piece_rows - start // piece_rows
                            if end - start > piece_rows else min(1, end - start))
    if covered:
      assert covered[0][0] == start and covered[-1][1] == end
      assert all(a == prev_b and a % piece_rows == 0
                 for (_, prev_b), (a, _) in zip(covered, covered[1:]))
    firsts = [x for x in range(extra_count) if extras[0, x] == g]
    if firsts:  # consecutive, each naming the first
      assert firsts == list(range(firsts[0], firsts[0] + len(firsts)))
      assert all(lo[groups + x] == (x + 1) * piece_rows for x in firsts)
      assert all(extras[1, x] == firsts[0] for x in firsts)
      assert all(extras[2, x] == len(firsts) for x in firsts)
  unused = extras[0] < 0
  assert np.all(lo[groups:][unused] == hi[groups:][unused])
  assert np.all(extras[1:, unused] == 0)
  first_listed, _ = (np.asarray(a) for a in mosaic_schedule.contracting_pieces(
      sizes_in, offset_in, m=m, chunk=chunk, row_align=row_align,
      piece_rows=piece_rows, cut_groups_first=True))
  # The further pieces, then the groups' first pieces, largest group
  # first (ties in group order).
  order = np.concatenate([groups + np.arange(extra_count),
                          np.argsort(-np.asarray(sizes), kind="stable")])
  np.testing.assert_array_equal(first_listed,
                                np.concatenate([table[:, order], order[None]]))
  # The kernel's entry counts (the empty groups, the entries with rows)
  # are the same in every order of the entries.
  want = [sum(e <= s for s, e in zip(starts, ends)), np.sum(chunks > 0)]
  for listed in (table, first_listed,
                 mosaic_schedule.largest_first(jnp.asarray(table)),
                 mosaic_schedule.empty_last(jnp.asarray(table))):
    assert np.asarray(mosaic_schedule.entry_counts(
        jnp.asarray(listed), groups)).tolist() == want


@pytest.mark.parametrize("num_ctas,num_tiles", [(1, 5), (4, 4), (4, 10),
                                                (4, 12), (132, 1000)])
def test_snake_deal_is_a_permutation_reversing_whole_odd_rounds(num_ctas,
                                                                 num_tiles):
  slots = np.arange(num_tiles)
  tiles = np.asarray(mosaic_schedule.snake_deal(slots, num_ctas, num_tiles))
  assert sorted(tiles.tolist()) == slots.tolist()
  for start in range(0, num_tiles, num_ctas):
    dealt = tiles[start:start + num_ctas]
    whole = start + num_ctas <= num_tiles
    backwards = (start // num_ctas) % 2 == 1 and whole
    want = slots[start:start + num_ctas]
    assert dealt.tolist() == (want[::-1] if backwards else want).tolist()


def test_largest_first_sorts_entries_and_names_their_outputs():
  table = jnp.asarray([[0, 5, 5, 40], [5, 5, 40, 42],
                       [0, 0, 0, 0], [1, 0, 1, 1]], jnp.int32)
  got = np.asarray(mosaic_schedule.largest_first(table))
  assert got[4].tolist() == [2, 0, 3, 1]  # 35, 5, 2, 0 rows; ties in order
  assert np.array_equal(got[:4], np.asarray(table)[:, got[4]])


def test_empty_last_moves_only_the_empty_entries():
  table = jnp.asarray([[0, 5, 5, 40, 42], [5, 5, 40, 42, 42],
                       [0, 0, 0, 0, 0], [1, 0, 1, 1, 0]], jnp.int32)
  got = np.asarray(mosaic_schedule.empty_last(table))
  assert got[4].tolist() == [0, 2, 3, 1, 4]  # rows in order, then empty
  assert np.array_equal(got[:4], np.asarray(table)[:, got[4]])


@pytest.mark.parametrize("entries", [1, 7, 136, 300], ids=str)
def test_largest_first_matches_a_stable_sort(entries, monkeypatch):
  """The masked-sum ranks against a stable argsort, with many ties (few
  distinct row counts), on both sides of the masked sum's size limit."""
  rng = np.random.default_rng(entries)
  lo = rng.integers(0, 1000, entries)
  hi = lo + rng.choice([0, 0, 64, 65, 300], entries)
  table = np.stack([lo, hi, lo // 8 * 8, rng.integers(0, 9, entries)])
  order = np.argsort(lo - hi, kind="stable")
  want = np.concatenate([table[:, order], order[None, :]])
  got = np.asarray(jax.jit(mosaic_schedule.largest_first)(
      jnp.asarray(table, jnp.int32)))
  assert np.array_equal(got, want)
  monkeypatch.setattr(mosaic_schedule, "MASKED_SUM_MAX_ENTRIES", 4)
  got = np.asarray(mosaic_schedule.largest_first(jnp.asarray(table,
                                                             jnp.int32)))
  assert np.array_equal(got, want)


@pytest.mark.parametrize("option", [dict(largest_first=True),
                                    dict(piece_rows=64)], ids=str)
def test_rows_rejects_contracting_options(option):
  problem = RaggedProblem("rows", 64, 64, 64, 2, "bfloat16", "float32")
  with pytest.raises(ValueError, match=next(iter(option))):
    mosaic.ragged_matmul(
        jnp.ones(problem.lhs_shape, jnp.bfloat16),
        jnp.ones(problem.rhs_shape, jnp.bfloat16), jnp.asarray([32, 32]),
        jnp.zeros((1,), jnp.int32), problem=problem,
        config=dataclasses.replace(SMALL, **option), interpret=True)


def test_contracting_rejects_split_rows():
  problem = RaggedProblem("contracting", 64, 64, 64, 2, "bfloat16", "float32")
  with pytest.raises(ValueError, match="split_rows"):
    mosaic.ragged_matmul(
        jnp.zeros((64, 64), jnp.bfloat16), jnp.zeros((64, 64), jnp.bfloat16),
        jnp.asarray([30, 34], jnp.int32), jnp.zeros((1,), jnp.int32),
        problem=problem, config=SPLIT_ROWS, interpret=True)


def test_swizzled_staging_needs_rows_of_one_swizzle_span():
  """A 64-column staged row of f32 is 256 bytes, wider than a swizzle
  span, and "contracting" mode stages swizzled tiles already: both raise,
  naming the option."""
  swizzled = dataclasses.replace(SMALL, swizzled_staging=True)
  for mode, out_dtype in (("rows", "float32"), ("contracting", "bfloat16")):
    problem = RaggedProblem(mode, 64, 64, 64, 2, "bfloat16", out_dtype)
    with pytest.raises(ValueError, match="swizzled_staging"):
      mosaic.ragged_matmul(
          jnp.ones((64, 64), jnp.bfloat16),
          jnp.ones(problem.rhs_shape, jnp.bfloat16), jnp.asarray([32, 32]),
          jnp.zeros((1,), jnp.int32), problem=problem, config=swizzled,
          interpret=True)


def test_row_halves_are_a_rows_mode_option_needing_whole_slot_rounds():
  problem = RaggedProblem("contracting", 64, 64, 64, 2, "bfloat16",
                          "bfloat16")
  with pytest.raises(ValueError, match="epi_tile_m"):
    mosaic.ragged_matmul(
        jnp.ones((64, 64), jnp.bfloat16), jnp.ones((64, 64), jnp.bfloat16),
        jnp.asarray([32, 32]), jnp.zeros((1,), jnp.int32), problem=problem,
        config=dataclasses.replace(SMALL, epi_tile_m=64), interpret=True)
  # One store per tile row and two slots: a tile's store count would set
  # its first slot.
  with pytest.raises(ValueError, match="epi_tile_m needs out_slots=2"):
    dataclasses.replace(SMALL, epi_tile_m=64, out_slots=2)


def _lower_for_cuda(problem, config):
  """Traces the Mosaic kernel at `problem`'s shapes and lowers it for the
  GPU (no GPU needed)."""
  spec = jax.ShapeDtypeStruct
  return lower_for_cuda(lambda lhs, rhs, sizes, offset: mosaic.ragged_matmul(
      lhs, rhs, sizes, offset, problem=problem, config=config),
                 spec(problem.lhs_shape, problem.in_dtype),
                 spec(problem.rhs_shape, problem.in_dtype),
                 spec((problem.groups,), jnp.int32), spec((1,), jnp.int32))


@pytest.mark.parametrize("cluster", [False, True],
                         ids=["one_cta", "cluster_columns"])
@pytest.mark.parametrize("tile", [(128, 128), (64, 256)], ids=str)
def test_ping_pong_lowers_for_cuda(tile, cluster):
  """Consumers taking turns at whole tiles, at the two tile shapes of the
  weight gradient (Qwen1.5-MoE's up projection), lower for the GPU, also
  as 2-CTA clusters sharing lhs (11 column strips: an odd count)."""
  problem = RaggedProblem("contracting", 16384, 2048, 1408, 60, "bfloat16",
                          "bfloat16")
  config = [c for c in configs.candidates(problem)
            if c.ping_pong and (c.tile_m, c.tile_n) == tile][0]
  config = dataclasses.replace(config, cluster_columns=cluster)
  assert config.cta_tile("contracting") == tile
  _lower_for_cuda(problem, config)


@pytest.mark.parametrize("case", ["deepseek_v3_up", "qwen3_30b_a3b_up"])
def test_zero_drip_lowers_for_cuda(case):
  """The producer's zero cursor (a while loop between its loads) lowers
  for the GPU at the heuristic's tiles of a weight gradient: the
  short-reduction tile of DeepSeek-V3 (2-CTA clusters) and Qwen3's
  turn-taking 128 x 128 tiles."""
  (problem,) = [c.problem for c in arg_specs.cases()
                if c.label == f"{case} one_hot drhs"]
  config = configs._most_stages(dataclasses.replace(
      configs.heuristic(problem, HOPPER), claim_tiles=False,
      streamed_zeros=False, double_zero_buffer=False,
      zeros_by_producer=True, zero_drip=2), problem)
  _lower_for_cuda(problem, config)


@pytest.mark.parametrize("case", ["deepseek_v3_up", "qwen3_30b_a3b_up"])
def test_claim_tiles_lower_for_cuda(case):
  """The claims (an atomic add in inline PTX, the queue's barriers) lower
  for the GPU at the heuristic's tiles of a weight gradient: the
  short-reduction tile, where the H200 heuristic claims already, and
  Qwen3's turn-taking 128 x 128 tiles, largest first."""
  (problem,) = [c.problem for c in arg_specs.cases()
                if c.label == f"{case} one_hot drhs"]
  config = configs._most_stages(dataclasses.replace(
      configs.heuristic(problem, HOPPER), claim_tiles=True,
      largest_first=True, empty_last=False), problem)
  _lower_for_cuda(problem, config)


@pytest.mark.parametrize("drip", [0, 4], ids=["zeros_walked", "zero_drip"])
@pytest.mark.parametrize("shared", ["cluster_columns", "cluster_rows"])
def test_claims_in_clusters_lower_for_cuda(drip, shared):
  """2-CTA clusters claiming together (the leader's atomic, the mailbox's
  spins and releases in inline PTX), the zero boxes claimed per rank, lower
  for the GPU at the H200 heuristic's short-reduction tile of DeepSeek-V3,
  sharing lhs or dout (the interpreter claims round-robin, so only the GPU
  runs them)."""
  (problem,) = [c.problem for c in arg_specs.cases()
                if c.label == "deepseek_v3_up one_hot drhs"]
  config = dataclasses.replace(configs.heuristic(problem, HOPPER),
                               zero_drip=drip, streamed_zeros=False,
                               double_zero_buffer=False, **{shared: True})
  assert config.claim_tiles and config.empty_last
  _lower_for_cuda(problem, config)


def _ptx_as_cuda_asm(ptx: str) -> str:
  """`ptx` (an `mgpu_utils.inline_ptx` string) as a CUDA asm statement:
  operands in brackets are 64-bit addresses, an atom's or ld's $0 its
  result, any other a 32-bit value."""
  import re
  numbers = sorted({int(n) for n in re.findall(r"\$(\d+)", ptx)})
  addresses = {int(n) for n in re.findall(r"\[\$(\d+)\]", ptx)}
  returns = ptx.startswith(("atom.", "ld.")) and numbers[:1] == [0]
  outputs = ['"=r"(result)'] if returns else []
  inputs = [f'"l"(word + {n})' if n in addresses else '"r"(value)'
            for n in numbers if not (returns and n == 0)]
  text = re.sub(r"\$(\d+)", r"%\1", ptx)
  return (f'asm volatile("{text}" : {", ".join(outputs)} : '
          f'{", ".join(inputs)} : "memory");')


def test_inline_ptx_assembles_for_sm_90a(tmp_path):
  """Every PTX instruction the claims and the streamed zeros inline
  (`tile_claims.INLINE_PTX`, `bulk_stores.INLINE_PTX`) assembles for
  sm_90a: nvcc checks it on a CPU, where the interpreter never runs it."""
  from pallas_gemm.ffi import build
  try:
    nvcc = build.find_nvcc()
  except build.NvccNotFoundError:
    pytest.skip("no nvcc")
  body = "\n  ".join(_ptx_as_cuda_asm(ptx) for ptx in (
      *tile_claims.INLINE_PTX, *bulk_stores.INLINE_PTX))
  source = tmp_path / "claims_ptx.cu"
  source.write_text(
      "__global__ void claims_ptx(unsigned* word, unsigned value) {\n"
      "  unsigned result = 0;\n"
      f"  {body}\n"
      "  word[0] = result;\n"
      "}\n")
  done = subprocess.run([nvcc, "-arch=sm_90a", "-c", str(source), "-o",
                         str(tmp_path / "claims_ptx.o")],
                        capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-3000:] + source.read_text()


def test_claimed_zeros_lower_for_cuda():
  """The H200 heuristic's short-reduction tile, the groups with rows
  claimed in table order, its claimed zero drip streamed as runs of the
  size of a box as wide as DeepSeek-V3's 128 x 256 tile (16 rows of 256
  columns), lowers for the GPU, with the evict-first copies in it; and
  with the TMA boxes themselves."""
  (problem,) = [c.problem for c in arg_specs.cases()
                if c.label == "deepseek_v3_up one_hot drhs"]
  config = configs.heuristic(problem, HOPPER)
  assert config.empty_last and config.zero_drip and config.streamed_zeros
  assert config.zero_box(problem.out_dtype) == (32, 256)  # doubled
  streamed = _lower_for_cuda(problem, config).as_text()
  assert all(ptx in streamed for ptx in bulk_stores.INLINE_PTX)
  boxes = dataclasses.replace(config, streamed_zeros=False,
                              double_zero_buffer=False)
  assert "L2::evict_first" not in _lower_for_cuda(problem, boxes).as_text()


def test_group_bands_lower_for_cuda():
  """Bands restarting at each group (the piece's first item and count read
  from the item table) lower for the GPU at DeepSeek-V3's forward tiles."""
  (problem,) = [c.problem for c in arg_specs.cases()
                if c.label == "deepseek_v3_up zipf forward"]
  _lower_for_cuda(problem, dataclasses.replace(
      configs.heuristic(problem, HOPPER), group_bands=True, grid_band=8))


def test_zeros_by_producer_needs_slots_dividing_a_tiles_stores():
  with pytest.raises(ValueError, match="zeros_by_producer needs out_slots=2"):
    RaggedConfig(tile_m=64, tile_n=64, epi_tile_n=64, out_slots=2,
                 zeros_by_producer=True)
  problem = RaggedProblem("contracting", 300, 128, 64, 3, "bfloat16",
                          "bfloat16")
  deepest = configs._most_stages(
      RaggedConfig(tile_m=64, tile_n=64, epi_tile_n=64,
                   zeros_by_producer=True), problem)
  assert deepest.out_slots == 1 and deepest.fits(problem)


def test_short_items_need_whole_128_row_consumer_tiles():
  with pytest.raises(ValueError, match="short_items needs ping_pong=True"):
    RaggedConfig(tile_m=128, tile_n=64, split_rows=True, short_items=True)
  with pytest.raises(ValueError, match="short_items needs ping_pong=True"):
    RaggedConfig(tile_m=64, tile_n=64, ping_pong=True, short_items=True)
  problem = RaggedProblem("contracting", 64, 64, 64, 2, "bfloat16",
                          "bfloat16")
  config = RaggedConfig(tile_m=128, tile_n=64, ping_pong=True,
                        short_items=True)
  with pytest.raises(ValueError, match="short_items is a \"rows\"-mode"):
    mosaic.ragged_matmul(jnp.ones((64, 64), jnp.bfloat16),
                         jnp.ones((64, 64), jnp.bfloat16),
                         jnp.asarray([30, 34], jnp.int32),
                         jnp.zeros((1,), jnp.int32), problem=problem,
                         config=config, interpret=True)


def test_swap_ab_options():
  with pytest.raises(ValueError, match="swap_ab needs swizzled_staging"):
    RaggedConfig(tile_m=128, tile_n=64, swap_ab=True)
  for option in ("short_items", "cluster_columns"):
    fields = dict(tile_m=128, tile_n=64, swap_ab=True, swizzled_staging=True,
                  ping_pong=option == "short_items", **{option: True})
    with pytest.raises(ValueError, match=f"swap_ab excludes {option}"):
      RaggedConfig(**fields)
  with pytest.raises(ValueError, match="swap_ab needs a consumer accumulator"):
    RaggedConfig(tile_m=128, tile_n=256, swap_ab=True, swizzled_staging=True)
  assert configs.swap_ab_widths(128) == (128, 112, 96, 80, 64, 48, 32, 16)
  assert configs.swap_ab_widths(128, 8) == tuple(range(128, 0, -8))
  assert configs.swap_ab_widths(144, 32) == (144, 112, 80, 48, 16)
  assert configs.swap_ab_widths(128, 0, 64) == (128, 112, 96, 80, 64)
  assert configs.swap_ab_widths(64, 0, 64) == (64,)
  with pytest.raises(ValueError, match="min_token_width=64 needs swap_ab"):
    RaggedConfig(tile_m=128, tile_n=64, min_token_width=64)
  with pytest.raises(ValueError, match="token_width_step=8 needs swap_ab"):
    RaggedConfig(tile_m=128, tile_n=64, token_width_step=8)
  # In the weight gradient the error names the width option, not swap_ab.
  for option, value in (("min_token_width", 64), ("token_width_step", 32)):
    turns = RaggedConfig(tile_m=128, tile_n=64, swap_ab=True,
                         swizzled_staging=True, **{option: value})
    with pytest.raises(ValueError, match=f"{option} is a \"rows\"-mode"):
      turns.check_mode("contracting")
  assert configs.swap_ab_widths(64) == (64, 56, 48, 40, 32, 24, 16, 8)
  # 192 tokens: a turn-taking swap_ab consumer only, up to 128 columns.
  assert configs.swap_ab_widths(192) == tuple(range(192, 0, -16))
  # The turn-taking token widths between 128 and 192 step by 16 too.
  for tokens in configs.SWAP_AB_TURN_TOKENS:
    assert configs.swap_ab_widths(tokens) == tuple(range(tokens, 0, -16))
  with pytest.raises(ValueError, match="tile_m"):
    RaggedConfig(tile_m=136, tile_n=128, swap_ab=True, swizzled_staging=True,
                 ping_pong=True)
  wide = dict(tile_m=192, tile_n=128, swap_ab=True, swizzled_staging=True,
              ping_pong=True)
  assert RaggedConfig(**wide).consumer_tile("rows") == (192, 128)
  for fields in (dict(ping_pong=False), dict(swap_ab=False)):
    for tokens in configs.SWAP_AB_TURN_TOKENS:
      with pytest.raises(ValueError, match=f"tile_m={tokens} needs "
                         "ping_pong=True and swap_ab=True"):
        RaggedConfig(**{**wide, "tile_m": tokens, **fields})
  with pytest.raises(ValueError, match="ping_pong needs a consumer tile"):
    RaggedConfig(**{**wide, "tile_n": 192})
  # 128 x 192 is the weight gradient's tile, and in "rows" mode only
  # transposed: 128 token rows by 192 columns.
  wide_columns = RaggedConfig(tile_m=128, tile_n=192, ping_pong=True)
  wide_columns.check_mode("contracting")
  with pytest.raises(ValueError, match="ping_pong in \"rows\" mode"):
    wide_columns.check_mode("rows")
  dataclasses.replace(wide_columns, swap_ab=True,
                      swizzled_staging=True).check_mode("rows")
  with pytest.raises(ValueError, match="ping_pong needs a consumer tile"):
    RaggedConfig(tile_m=144, tile_n=192, ping_pong=True, swap_ab=True,
                 swizzled_staging=True)
  with pytest.raises(ValueError, match="swap_ab needs a consumer "
                     "accumulator"):
    RaggedConfig(tile_m=128, tile_n=192, swap_ab=True, swizzled_staging=True)
  # A sweep offers it where token rows can be transposed (16-bit outputs).
  for out_dtype, offered in (("bfloat16", True), ("float32", False)):
    rows = RaggedProblem("rows", 16384, 2048, 1408, 60, "bfloat16", out_dtype)
    assert any(c.tile_m == 192 for c in configs.candidates(rows)) is offered
  # A 32-bit output has no swizzled staging, which swap_ab needs.
  problem = RaggedProblem("rows", 64, 64, 64, 2, "bfloat16", "float32")
  with pytest.raises(ValueError, match="swizzled_staging needs a staged row"):
    mosaic.ragged_matmul(
        jnp.ones((64, 64), jnp.bfloat16), jnp.ones((2, 64, 64), jnp.bfloat16),
        jnp.asarray([30, 34], jnp.int32), jnp.zeros((1,), jnp.int32),
        problem=problem, interpret=True,
        config=dataclasses.replace(SMALL, swap_ab=True,
                                   swizzled_staging=True))


@pytest.mark.parametrize("transpose", [False, True], ids=["fwd", "dlhs"])
def test_rows_swap_ab_lowers_for_cuda(transpose):
  """Token rows as wgmma's N at Qwen1.5-MoE's shapes lower for the GPU:
  turn-taking 128 x 128, 192-token x 128 and 128-token x 192 tiles, and
  128-token tiles whose consumers split 256 columns."""
  k, n = (1408, 2048) if transpose else (2048, 1408)
  problem = RaggedProblem("rows", 16384, k, n, 60, "bfloat16", "bfloat16",
                          transpose_rhs=transpose)
  base = dataclasses.replace(mosaic.heuristic(problem, HOPPER),
                             tile_m=128, shared_staging=False)
  for fields in (dict(ping_pong=True), dict(ping_pong=True, tile_m=192),
                 dict(ping_pong=True, tile_m=144),
                 dict(ping_pong=True, tile_m=176),
                 dict(ping_pong=True, tile_m=144, shared_staging=True),
                 dict(ping_pong=True, tile_m=192, shared_staging=True),
                 dict(ping_pong=True, tile_n=192, shared_staging=True),
                 dict(ping_pong=True, token_width_step=8),
                 dict(ping_pong=True, min_token_width=64),
                 dict(ping_pong=True, tile_m=144, shared_staging=True,
                      token_width_step=32),
                 dict(ping_pong=False, split_rows=False, tile_n=128),
                 dict(ping_pong=False, split_rows=True, tile_m=256,
                      tile_n=64)):
    _lower_for_cuda(problem, configs._most_stages(dataclasses.replace(
        base, swap_ab=True, swizzled_staging=True, **fields), problem))


def test_shared_staging_needs_turns():
  for fields in (dict(ping_pong=False),
                 dict(ping_pong=True, cluster_columns=True)):
    with pytest.raises(ValueError, match="shared_staging needs ping_pong"):
      RaggedConfig(tile_m=128, tile_n=64, shared_staging=True, **fields)
  # One buffer for both consumers: the ring may take what it frees.
  problem = RaggedProblem("rows", 16384, 2048, 1408, 60, "bfloat16",
                          "bfloat16")
  config = RaggedConfig(tile_m=144, tile_n=128, ping_pong=True, swap_ab=True,
                        swizzled_staging=True)
  own = configs._most_stages(config, problem)
  shared = configs._most_stages(
      dataclasses.replace(config, shared_staging=True), problem)
  assert (own.stages, shared.stages) == (5, 6)
  assert shared.staging_buffers == 1 and own.staging_buffers == 2


def test_ping_pong_needs_one_warpgroup_tile():
  with pytest.raises(ValueError, match="ping_pong.*tile_m=128, tile_n=256"):
    RaggedConfig(tile_m=128, tile_n=256, ping_pong=True)
  with pytest.raises(ValueError, match="ping_pong and split_rows"):
    RaggedConfig(tile_m=128, tile_n=64, ping_pong=True, split_rows=True)


@pytest.mark.parametrize("short_items", [False, True],
                         ids=["whole", "short_items"])
@pytest.mark.parametrize("transpose", [False, True], ids=["fwd", "dlhs"])
def test_rows_ping_pong_lowers_for_cuda(transpose, short_items):
  """Turn-taking consumers in "rows" mode at Qwen1.5-MoE's shapes (the
  forward, and the lhs gradient reading rhs transposed) lower for the GPU,
  also with the short items' 64-row wgmmas."""
  k, n = (1408, 2048) if transpose else (2048, 1408)
  problem = RaggedProblem("rows", 16384, k, n, 60, "bfloat16", "bfloat16",
                          transpose_rhs=transpose)
  config = [c for c in configs.candidates(problem)
            if c.ping_pong and c.tile_m == 128][0]
  config = dataclasses.replace(config, short_items=short_items)
  assert config.cta_tile("rows") == (config.tile_m, config.tile_n)
  _lower_for_cuda(problem, config)
  _lower_for_cuda(problem, dataclasses.replace(config, swizzled_staging=True))
  # Two staging slots of 64-row halves in the shared memory of one whole
  # slot, the ring as deep.
  halves = dataclasses.replace(config, swizzled_staging=True, epi_tile_m=64,
                               out_slots=2)
  assert halves.smem_bytes(problem) == config.smem_bytes(problem)
  assert (config.out_slots, config.stages) == (1, 6)
  _lower_for_cuda(problem, halves)


@pytest.mark.parametrize("transpose", [False, True], ids=["fwd", "dlhs"])
def test_rows_clusters_lower_for_cuda(transpose):
  """2-CTA clusters sharing each item's lhs tile in "rows" mode lower for
  the GPU at the heuristic's tiles: turn-taking 128 x 128 tiles at
  Qwen1.5-MoE's shapes (11 column strips forward: an odd count) and the
  split-rows 128 x 256 tile at DeepSeek-V3's."""
  for groups, m, k, n in ((60, 16384, 2048, 1408), (256, 32768, 7168, 2048)):
    if transpose:
      k, n = n, k
    problem = RaggedProblem("rows", m, k, n, groups, "bfloat16", "bfloat16",
                            transpose_rhs=transpose)
    config = mosaic.heuristic(problem, HOPPER)
    if config.swap_ab:  # the heuristic's tiles before swap_ab
      config = dataclasses.replace(
          config, swap_ab=False, tile_m=128, shared_staging=False,
          min_token_width=0,
          **(dict(tile_n=128) if config.split_rows else {}))
    config = dataclasses.replace(config, cluster_columns=True,
                                 halve_last_round=False)
    assert config.fits(problem)
    _lower_for_cuda(problem, config)


def test_supports():
  problem = RaggedProblem("rows", 64, 64, 64, 2, "bfloat16", "bfloat16")
  assert mosaic.supports(problem, HOPPER) is None
  assert "Hopper" in mosaic.supports(problem, AMPERE)
  # float32 runs as bfloat16 parts, except where exact products are asked
  # for; float64 not at all.
  f32 = RaggedProblem("rows", 64, 64, 64, 2, "float32", "float32")
  assert mosaic.supports(f32, HOPPER) is None
  exact = dataclasses.replace(f32, precision="ieee")
  assert "exact float32" in mosaic.supports(exact, HOPPER)
  f64 = RaggedProblem("rows", 64, 64, 64, 2, "float64", "float64")
  assert "float64" in mosaic.supports(f64, HOPPER)


def test_bad_operands_name_the_argument():
  problem = RaggedProblem("rows", 64, 64, 64, 2, "bfloat16", "bfloat16")
  with pytest.raises(ValueError, match="rhs"):
    mosaic.ragged_matmul(
        jnp.zeros((64, 64), jnp.bfloat16), jnp.zeros((3, 64, 64), jnp.bfloat16),
        jnp.zeros((2,), jnp.int32), jnp.zeros((1,), jnp.int32),
        problem=problem, config=SMALL)


# The GPU shapes of issue 18 (G, tokens, K, N).
GPU_SHAPES = [(8, 16384, 4096, 14336), (64, 16384, 2048, 1408),
              (128, 8192, 7168, 2048), (256, 4096, 7168, 2048)]
LOWERING_CASES = [(shape, mode, transpose, "bfloat16", "bfloat16")
                  for shape in GPU_SHAPES
                  for mode, transpose in (("rows", False), ("rows", True),
                                          ("contracting", False))] + [
    # float32 weight gradients; float16 inputs
    (GPU_SHAPES[2], "contracting", False, "bfloat16", "float32"),
    (GPU_SHAPES[0], "contracting", False, "float16", "float32"),
    (GPU_SHAPES[1], "rows", False, "float16", "float16"),
]


@pytest.mark.parametrize("shape,mode,transpose,in_dtype,out_dtype",
                         LOWERING_CASES, ids=lambda v: str(v))
def test_heuristic_config_lowers_for_cuda(shape, mode, transpose, in_dtype,
                                          out_dtype):
  groups, m, k, n = shape
  if mode == "rows" and transpose:  # the lhs gradient: (m, n) x (G, k, n)^T
    k, n = n, k
  problem = RaggedProblem(mode, m, k, n, groups, in_dtype, out_dtype,
                          transpose_rhs=transpose,
                          activation="silu" if mode == "rows" and not transpose
                          else None)
  config = mosaic.heuristic(problem, HOPPER)
  assert config.fits(problem)
  _lower_for_cuda(problem, config)


@pytest.mark.parametrize(
    "case", [c for layers in (arg_specs.MOE_HOLDOUT_LAYERS,
                              arg_specs.MOE_UNSEEN_LAYERS)
             for c in arg_specs.cases(layers, distributions=("even",))],
    ids=lambda c: c.label)
def test_holdout_suite_heuristic_configs_lower_for_cuda(case):
  """The layers no config was chosen on (rows not a multiple of 8, other
  widths, 16 to 4096 rows per expert) get a config that fits and lowers
  for the GPU, in every direction."""
  config = mosaic.heuristic(case.problem, HOPPER)
  assert config.fits(case.problem)
  _lower_for_cuda(case.problem, config)


@pytest.mark.parametrize("transpose", [False, True], ids=["forward", "dlhs"])
@pytest.mark.parametrize("m", [8198, 130], ids=lambda m: f"m{m}")
def test_rows_not_a_multiple_of_8_are_read_in_place(m, transpose):
  """Compiled, lhs of a row count not in whole 8-row tiles (at least a
  tile) is read as it is and the output has exactly m rows: the lowered
  program is the kernel and its work list, with no pad of lhs and no slice
  of the output (each a full copy). The interpreter pads, and rows in
  whole tiles keep the tiled load view (`mosaic.lhs_in_place`)."""
  problem = RaggedProblem("rows", m, 4096, 640, 16, "bfloat16", "bfloat16",
                          transpose_rhs=transpose)
  config = mosaic.heuristic(problem, HOPPER)
  assert mosaic.lhs_in_place(config, problem, params=None)
  assert not mosaic.lhs_in_place(config, problem,
                                 params=interpret_params(True))
  text = _lower_for_cuda(problem, config).as_text()
  assert "stablehlo.pad" not in text and "stablehlo.slice" not in text
  whole_tiles = dataclasses.replace(problem, m=m // 8 * 8)
  assert not mosaic.lhs_in_place(config, whole_tiles, params=None)


@pytest.mark.parametrize("m,groups", [(8198, 16), (8198, 4), (2051, 64)],
                         ids=["turns", "split", "short_tile"])
def test_weight_gradient_reads_rows_not_a_multiple_of_8_in_place(m, groups):
  """The heuristic holds the weight gradient's operands as 64-column planes
  where rows are not whole 8-row tiles, and, compiled, reads lhs and dout
  as they are (`mosaic_contracting.operands_in_place`), at its three tile
  shapes: the lowered program has no pad. The interpreter pads; rows in
  whole tiles keep the tiled stages."""
  from pallas_gemm.ragged_dot import mosaic_contracting
  problem = RaggedProblem("contracting", m, 2048, 1408, groups, "bfloat16",
                          "bfloat16")
  config = mosaic.heuristic(problem, HOPPER)
  assert config.operand_planes
  in_place = mosaic_contracting.operands_in_place
  assert in_place(config, problem, params=None)
  assert not in_place(config, problem, params=interpret_params(True))
  whole_tiles = dataclasses.replace(problem, m=m // 8 * 8)
  assert not mosaic.heuristic(whole_tiles, HOPPER).operand_planes
  # 32-bit rows keep the tiled stages (float32 operands reach the kernels
  # as bfloat16 parts, so only the configs' own heuristic sees them).
  f32 = dataclasses.replace(problem, in_dtype="float32")
  assert not configs.heuristic(f32, HOPPER).operand_planes
  # A sweep's candidates read the rows in place too.
  assert all(c.operand_planes for c in configs.candidates(problem))
  text = _lower_for_cuda(problem, config).as_text()
  assert "stablehlo.pad" not in text


@pytest.mark.parametrize("groups,m,k,n", [(128, 32768, 2048, 768),
                                           (60, 16384, 2048, 1408)],
                         ids=["qwen3_up", "qwen1.5_up"])
def test_contracting_wide_turns_lower_for_cuda(groups, m, k, n):
  """The weight gradient's turn-taking 128 x 192 tiles lower for the GPU
  at Qwen3-30B's and Qwen1.5-MoE's up projections (768 columns: four
  strips; 1408: seven and a third), at the deepest ring that fits."""
  problem = RaggedProblem("contracting", m, k, n, groups, "bfloat16",
                          "bfloat16")
  config = configs._most_stages(dataclasses.replace(
      mosaic.heuristic(problem, HOPPER), tile_n=192, ping_pong=True),
      problem)
  assert (config.stages, config.out_slots) == (4, 2)
  assert config.cta_tile("contracting") == (128, 192)
  _lower_for_cuda(problem, config)


@pytest.mark.parametrize("groups,m,k,n,wide", [
    (60, 16384, 2048, 1408, True),    # Qwen1.5-MoE up: 1408 -> 1536 columns
    (60, 16384, 1408, 2048, True),    # ... down
    (32, 12000, 2880, 2880, True),    # gpt-oss-20b up: 15 strips of 192
    (128, 32768, 2048, 768, False),   # Qwen3-30B up: one-hot idles SMs
    (128, 32768, 768, 2048, False),   # ... down
    (64, 32768, 2048, 1024, False),   # OLMoE up: 1024 -> 1152 columns
], ids=["qwen1.5_up", "qwen1.5_down", "gpt_oss_up", "qwen3_up", "qwen3_down",
        "olmoe_up"])
def test_contracting_turns_widen_where_both_routings_gain(groups, m, k, n,
                                                          wide):
  """The weight gradient's turn-taking tile is 128 x 192 where the model of
  `_wide_turn_tile_pays` has it faster with even groups and with one group
  holding every row: on the layers measured, exactly where it was faster
  on every routing."""
  problem = RaggedProblem("contracting", m, k, n, groups, "bfloat16",
                          "bfloat16")
  config = mosaic.heuristic(problem, HOPPER)
  assert config.ping_pong
  assert config.cta_tile("contracting") == (128, 192 if wide else 128)
  assert config.fits(problem)
  # Only on the GPUs it was measured on (WIDE_TURN_TILE_DEVICES).
  h100 = dataclasses.replace(HOPPER, device_kind="NVIDIA H100 80GB HBM3")
  assert h100.key not in configs.WIDE_TURN_TILE_DEVICES
  assert mosaic.heuristic(problem, h100).cta_tile("contracting") == (128, 128)


@pytest.mark.parametrize("groups,m,k,n,transpose,tokens,columns", [
    (128, 32768, 2048, 768, False, 128, 192),  # Qwen3-30B up: 4 strips
    (128, 32768, 768, 2048, False, 128, 192),  # ... down: 2048 -> 2112
    (128, 32768, 768, 2048, True, 128, 192),   # ... up's dlhs
    (64, 12282, 1408, 2048, False, 128, 192),  # DeepSeek-V2-Lite down
    (32, 12000, 2048, 2880, False, 128, 192),  # gpt-oss-20b up: 15 strips
    (64, 16384, 2048, 1408, False, 128, 128),  # g64: 1408 -> 1536
    (64, 32768, 2048, 1024, False, 128, 128),  # OLMoE up: 1024 -> 1152
    (60, 16384, 2048, 2048, False, 144, 128),  # Qwen1.5-MoE: 144 tokens
], ids=["qwen3_up", "qwen3_down", "qwen3_up_dlhs", "deepseek_v2_lite_down",
        "gpt_oss_up", "g64", "olmoe_up", "qwen1.5_tokens_144"])
def test_rows_turns_widen_columns_where_they_pad_little(groups, m, k, n,
                                                        transpose, tokens,
                                                        columns):
  """On the H200 the forward's and dlhs's 128-token turns run 192-column
  strips where those pad the columns by less than about 4 %
  (`_wide_column_turns_pay`); a wider token tile (fewer items) keeps 128
  columns, and the H100 keeps its 128 x 128 turns."""
  problem = RaggedProblem("rows", m, k, n, groups, "bfloat16", "bfloat16",
                          transpose_rhs=transpose)
  config = mosaic.heuristic(problem, HOPPER)
  assert config.ping_pong and config.swap_ab
  assert (config.tile_m, config.tile_n) == (tokens, columns)
  assert config.fits(problem)
  if columns == 192:
    assert config.shared_staging and config.stages == 5
    _lower_for_cuda(problem, config)
  h100 = dataclasses.replace(HOPPER, device_kind="NVIDIA H100 80GB HBM3")
  assert mosaic.heuristic(problem, h100).tile_n == 128


def test_turns_keep_no_token_width_below_64_on_the_h200():
  """The H200's transposed turns run an item of fewer than 64 rows at
  width 64 (`configs.TURN_MIN_TOKEN_WIDTH`), at every turn tile: 128 x 128,
  128 x 192, 144 x 128 and the 192-token tile above 512 rows per expert;
  the H100's keep every width."""
  h100 = dataclasses.replace(HOPPER, device_kind="NVIDIA H100 80GB HBM3")
  tiles = set()
  for groups, m, k, n in ((64, 16384, 2048, 1408), (128, 32768, 2048, 768),
                          (60, 16384, 2048, 1408), (16, 8198, 4096, 6400)):
    problem = RaggedProblem("rows", m, k, n, groups, "bfloat16", "bfloat16")
    config = mosaic.heuristic(problem, HOPPER)
    assert config.ping_pong and config.swap_ab, problem
    assert config.min_token_width == configs.TURN_MIN_TOKEN_WIDTH == 64
    assert min(config.token_widths()) == 64
    tiles.add((config.tile_m, config.tile_n))
    assert mosaic.heuristic(problem, h100).min_token_width == 0
  assert tiles == {(128, 128), (128, 192), (144, 128), (192, 128)}


@pytest.mark.parametrize("groups,m,k,n", [
    (256, 32768, 7168, 2048),   # DeepSeek-V3 up
    (256, 32768, 2048, 7168),   # ... down
    (128, 8192, 7168, 2048),    # g128
    (256, 2048, 7168, 2048),    # DeepSeek-V3 decode batch
    (96, 5000, 520, 136),       # odd columns, 52 rows per group
], ids=["deepseek_v3_up", "deepseek_v3_down", "g128", "decode", "odd"])
def test_short_reduction_tile_claims_tiles_on_the_h200(groups, m, k, n,
                                                       monkeypatch):
  """On the H200 the weight gradient's short-reduction tile has its CTAs
  claim their tiles, the empty groups' last, and its producer store those
  groups' zeros in wide boxes (`configs.CLAIMED_TILES_DEVICES`), where the
  zero buffer costs no ring stage; elsewhere its config is the one
  without. (The odd layer's output is below SHORT_TILE_MIN_OUTPUT_BYTES,
  lowered to reach the tile.)"""
  monkeypatch.setattr(configs, "SHORT_TILE_MIN_OUTPUT_BYTES", 0)
  problem = RaggedProblem("contracting", m, k, n, groups, "bfloat16",
                          "bfloat16")
  config = mosaic.heuristic(problem, HOPPER)
  assert config.short_tile_lookahead and config.zeros_by_producer
  assert config.claim_tiles and config.empty_last and config.wide_zero_box
  assert not config.largest_first
  # The empty groups' zeros claimed between loads, streamed, where one
  # group's tiles are at least half the SMs (every layer here but the odd
  # one's 2 x 2).
  cta_m, cta_n = config.cta_tile("contracting")
  fills = (-(-k // cta_m) * -(-n // cta_n)
           >= configs.CLAIMED_ZERO_DRIP_MIN_TILES_PER_SM * HOPPER.planning_sms)
  assert fills == (n != 136)
  # ... in runs of the doubled buffer, half as many a load (every layer
  # here has room for it at the same ring depth).
  assert config.zero_drip == (configs.CLAIMED_ZERO_DRIP_DOUBLED if fills
                              else 0)
  assert config.double_zero_buffer == fills
  h100 = dataclasses.replace(HOPPER, device_kind="NVIDIA H100 80GB HBM3")
  assert h100.key not in configs.CLAIMED_TILES_DEVICES
  plain = mosaic.heuristic(problem, h100)
  assert not (plain.zeros_by_producer or plain.claim_tiles
              or plain.reorders_entries or plain.zero_drip
              or plain.wide_zero_box)
  assert config.streamed_zeros == bool(config.zero_drip)
  assert config == dataclasses.replace(plain, zeros_by_producer=True,
                                       claim_tiles=True, empty_last=True,
                                       wide_zero_box=True,
                                       zero_drip=config.zero_drip,
                                       streamed_zeros=config.streamed_zeros,
                                       double_zero_buffer=fills)
  assert config.fits(problem)


@pytest.mark.parametrize("m,k,n,sizes,offset,planes", [
    # Columns past a tile's width; empty groups before, between and after.
    (500, 136, 264, [0, 90, 0, 0, 130, 7, 0, 0], 11, False),
    # Rows not in whole 8-row tiles: the operands held as 64-column planes.
    (1001, 128, 256, [0, 300, 0, 0, 200, 7, 0, 0, 1, 0, 0, 0, 400, 0, 0, 0],
     3, True),
], ids=["odd_columns", "operand_planes"])
def test_h200_short_reduction_tile_config_is_correct(m, k, n, sizes, offset,
                                                     planes, monkeypatch):
  """The H200 heuristic's short-reduction weight-gradient config (tiles
  claimed, the empty groups' last, zeros stored by the producer, lookahead
  capped) on odd shapes, with rows of no group. The heuristic takes that
  tile from SHORT_TILE_MIN_OUTPUT_BYTES of output, which these shapes are
  far below, so the bound is lowered here."""
  monkeypatch.setattr(configs, "SHORT_TILE_MIN_OUTPUT_BYTES", 0)
  problem = RaggedProblem("contracting", m, k, n, len(sizes), "bfloat16",
                          "bfloat16")
  config = mosaic.heuristic(problem, HOPPER)
  assert config.claim_tiles and config.short_tile_lookahead
  assert config.operand_planes == planes
  _run(problem, sizes, row_offset=offset, config=config,
       detect_races=planes)


@pytest.mark.parametrize("mode", ["rows", "contracting"])
def test_negative_sizes_are_empty_groups(mode):
  """Sizes are runtime data, so a negative one cannot raise: the kernel
  reads it as an empty group, and the groups after it keep their rows (as
  the xla implementation and the reference do)."""
  problem = RaggedProblem(mode, 40, 32, 64, 4, "bfloat16", "bfloat16")
  _run(problem, [9, -5, 20, 7])


def test_h200_balanced_turns_config_is_correct():
  """The H200 heuristic's config above 512 rows per expert (turns at
  192-token tiles, its balanced items) on an odd shape: columns below one
  tile, K not a whole stage, a group of 1026 rows and an empty one."""
  problem = RaggedProblem("rows", 1539, 72, 40, 3, "bfloat16", "bfloat16")
  config = mosaic.heuristic(problem, HOPPER)
  assert config.ping_pong and config.cta_tile("rows") == (192, 128)
  _run(problem, [1026, 0, 513], config=config)


@pytest.mark.parametrize("rows,columns,waves_128,waves_144", [
    (8704, 1408, 6, 6),    # 68 x 11 tiles or 61 x 11: six waves either way
    (8704, 1024, 5, 4),    # 68 x 8 or 61 x 8: a wave fewer at 144
    (6528, 1408, 5, 4),    # 51 x 11 or 46 x 11
])
def test_one_hot_turn_rows_counts_waves_of_balanced_items(
    rows, columns, waves_128, waves_144):
  """The one-hot prediction behind the wider turns' guard: one expert's
  rows in balanced items, times the column tiles, dealt over 132 SMs; each
  wave costs its item width (all items here fill their width)."""
  problem = RaggedProblem("rows", rows, 2048, columns, 64, "bfloat16",
                          "bfloat16")
  turns = RaggedConfig(tile_m=128, tile_n=128, ping_pong=True, swap_ab=True,
                       swizzled_staging=True, split_rows=False)
  wide = dataclasses.replace(turns, tile_m=144)
  assert configs._one_hot_turn_rows(turns, problem, 132) == waves_128 * 128
  assert configs._one_hot_turn_rows(wide, problem, 132) == waves_144 * 144


def test_h200_turns_take_the_fewest_items():
  """On the H200 the heuristic's turns run each expert at the token width
  that cuts the average group into the fewest items on an equally deep
  ring, sharing one staging buffer where that deepens it; the H100 keeps
  128-token turns with a buffer per consumer."""
  h100 = dataclasses.replace(HOPPER, device_kind="NVIDIA H100 80GB HBM3")
  def config(m, groups, out_dtype="bfloat16", device=HOPPER, n=1408):
    return mosaic.heuristic(RaggedProblem("rows", m, 2048, n, groups,
                                          "bfloat16", out_dtype), device)
  # 273 rows: two items at 144 tokens, three at 128.
  qwen = config(16384, 60)
  assert (qwen.tile_m, qwen.stages, qwen.shared_staging) == (144, 6, True)
  # 140 and 400 rows: one item and three at 144 tokens, two and four at 128.
  assert config(140 * 64, 64, n=1024).tile_m == 144
  assert config(400 * 64, 64).tile_m == 144
  # ... but not where one expert holding all 8960 tokens would run its
  # wider tiles in as many waves: 70 x 11 tiles at 128 tokens and 63 x 11
  # at 144 are both six waves on 132 SMs.
  assert config(140 * 64, 64).tile_m == 128
  # 256, 300 and 450 rows: as many items either way.
  for rows in (256, 300, 450):
    same = config(rows * 64, 64)
    assert (same.tile_m, same.stages, same.shared_staging) == (128, 6, False)
  # 513 rows: 192-token items, a fifth stage in the shared buffer's room.
  phi = config(513 * 16, 16)
  assert (phi.tile_m, phi.stages, phi.shared_staging) == (192, 5, True)
  # A float32 output stages plain 128 x 128 tiles, where sharing was
  # measured and not taken: each consumer keeps its own (sharing would
  # give a sixth stage, and lowers for the GPU).
  wide_out = config(16384, 60, "float32")
  assert (wide_out.tile_m, wide_out.swap_ab) == (128, False)
  assert (wide_out.stages, wide_out.shared_staging) == (5, False)
  problem = RaggedProblem("rows", 16384, 2048, 1408, 60, "bfloat16",
                          "float32")
  shared = configs._deeper_with_shared_staging(wide_out, problem)
  assert (shared.stages, shared.shared_staging) == (6, True)
  _lower_for_cuda(problem, shared)
  old = config(16384, 60, device=h100)
  assert (old.tile_m, old.shared_staging) == (128, False)


def test_reduction_pieces_lower_for_cuda():
  """The pieces candidate of a drhs whose group's tiles leave SMs idle
  (Qwen3-30B's up projection), walked largest first, lowers for the GPU,
  merge included."""
  problem = RaggedProblem("contracting", 32768, 2048, 768, 128, "bfloat16",
                          "bfloat16")
  pieces = [c for c in configs.candidates(problem)
            if c.piece_rows and c.largest_first]
  assert pieces and pieces[0].piece_rows % pieces[0].tile_k == 0
  _lower_for_cuda(problem, pieces[0])


def test_heuristic_prefers_64_rows_for_few_tokens_per_group():
  few = RaggedProblem("rows", 8192, 7168, 2048, 128, "bfloat16", "bfloat16")
  many = RaggedProblem("rows", 16384, 4096, 14336, 8, "bfloat16", "bfloat16")
  assert mosaic.heuristic(few, HOPPER).tile_m == 64
  assert mosaic.heuristic(many, HOPPER).tile_m == 128
  # On whatever this runs on too (the H200's own rules, e.g. its work
  # list, make its config differ from the CPU's in other fields).
  for device in (device_info(), DeviceInfo("cpu", "cpu")):
    assert mosaic.heuristic(many, device).tile_m == 128


def test_weight_gradient_walks_narrow_outputs_one_k_strip_at_a_time():
  """The short-reduction weight-gradient tile (at most 128 rows per
  expert) walks an output of at most NARROW_OUTPUT_STRIPS column tiles one
  K strip at a time, a wider one in bands; longer reductions keep their
  band."""
  def band(m, k, n, groups):
    problem = RaggedProblem("contracting", m, k, n, groups, "bfloat16",
                            "bfloat16")
    config = mosaic.heuristic(problem, HOPPER)
    return config.tile_n, config.grid_band

  assert band(32768, 7168, 2048, 256) == (256, 1)  # 8 column tiles
  assert band(8192, 7168, 2048, 128) == (256, 1)
  assert band(32768, 2048, 7168, 256) == (256, 8)  # 28 column tiles
  assert band(16384, 2048, 1408, 60)[1] == 8  # 273 rows per expert


def test_short_reductions_take_turns_below_the_short_tiles_output_size():
  """The weight gradient of at most two chunks per expert takes the short,
  wide tile (and on the H200 its claims) from SHORT_TILE_MIN_OUTPUT_BYTES
  of output on, and the plain tile taking turns below: the tables of the
  short tile's claims cost more than its stores gain on a small output."""
  def config(m, k, n, groups, out_dtype="bfloat16"):
    return mosaic.heuristic(RaggedProblem(
        "contracting", m, k, n, groups, "bfloat16", out_dtype), HOPPER)

  bound = configs.SHORT_TILE_MIN_OUTPUT_BYTES
  # 64 rows per expert; 2**21 output elements per group, 2 bytes each.
  groups_at_bound = bound // (2 * 2**21)
  for groups, out_dtype, short in [
      (groups_at_bound, "bfloat16", True),
      (groups_at_bound - 1, "bfloat16", False),
      (groups_at_bound // 2, "float32", True),  # four bytes an element
      (2, "bfloat16", False)]:
    chosen = config(64 * groups, 2048, 1024, groups, out_dtype)
    assert (chosen.tile_m, chosen.tile_n) == ((64, 256) if short
                                              else (128, 128)), groups
    assert chosen.ping_pong == (not short)
    if out_dtype == "bfloat16":  # float32's ring is too short for the cap
      assert bool(chosen.short_tile_lookahead) == chosen.claim_tiles == short
  # The suite's short-reduction layers all lie above the bound.
  for label in ("deepseek_v3_up even drhs", "deepseek_v3_up_decode even drhs",
                "g128_t8192_k7168_n2048 even drhs"):
    (problem,) = [c.problem for c in arg_specs.cases() if c.label == label]
    assert mosaic.heuristic(problem, HOPPER).short_tile_lookahead, label


def test_long_reductions_take_turns_where_split_tiles_idle_half_the_sms():
  """More than 512 rows per expert take turns only where the split tile's
  CTA tiles would leave at least half the SMs idle (the turns' tiles, twice
  as many, at most one per SM), and neither tile cuts the reductions into
  pieces, which fill idle SMs their own way."""
  def config(m, k, n, groups):
    return mosaic.heuristic(RaggedProblem(
        "contracting", m, k, n, groups, "bfloat16", "bfloat16"), HOPPER)

  sms = HOPPER.planning_sms
  # Two experts of 1024 rows, 256 columns: a split tile is 256 x 128 of
  # an expert's output, so 4 per 256 of K over the two experts, 8 turns.
  widest = sms // 8 * 256
  for k, turns in [(widest, True), (widest + 256, False), (256, True)]:
    chosen = config(2048, k, 256, 2)
    assert chosen.ping_pong == turns, k
    assert chosen.piece_rows == 0 and (chosen.tile_m, chosen.tile_n) == (
        128, 128), k
  # Long enough reductions cut pieces instead (4096 rows per expert).
  assert config(4096, 1024, 1024, 2).ping_pong
  long = config(8192, 1024, 1024, 2)
  assert long.piece_rows and not long.ping_pong
  # The suite's long-reduction layers are far above half a wave.
  for label in ("mixtral8x7b_up even drhs", "g8_t16384_k4096_n14336 even drhs"):
    (problem,) = [c.problem for c in arg_specs.cases() if c.label == label]
    assert not mosaic.heuristic(problem, HOPPER).ping_pong, label


def test_one_long_group_is_cut_into_pieces_shorter_than_the_minimum():
  """A single group (its routing known) of at least
  ONE_GROUP_PIECES_MIN_ROWS rows is cut into the pieces that fill the SMs
  even where they hold fewer than PIECES_MIN_ROWS rows; shorter groups, and
  several groups (whose even routing would pay the pieces unused), keep
  the minimum."""
  def config(m, k, groups):
    return mosaic.heuristic(RaggedProblem(
        "contracting", m, k, k, groups, "bfloat16", "bfloat16"), HOPPER)

  rows = configs.ONE_GROUP_PIECES_MIN_ROWS
  assert configs.PIECES_MIN_ROWS > rows // 8  # the pieces below are shorter
  cut = config(rows, 384, 1)
  assert 0 < cut.piece_rows < configs.PIECES_MIN_ROWS
  assert cut.largest_first and not cut.ping_pong
  assert cut.piece_rows == configs.filling_piece_rows(
      RaggedProblem("contracting", rows, 384, 384, 1, "bfloat16", "bfloat16"),
      cut, HOPPER.planning_sms)
  assert config(rows // 2, 384, 1).piece_rows == 0
  assert config(2 * rows, 384, 2).piece_rows == 0
  # Where one group's tiles fill the SMs, nothing is cut.
  assert config(rows, 4096, 1).piece_rows == 0


def test_one_long_group_takes_more_pieces_of_a_minimum_length():
  """A single group may be cut into more than MAX_PIECES pieces, up to
  ONE_GROUP_MAX_PIECES, each at least ONE_GROUP_MIN_PIECE_ROWS rows; several
  groups keep MAX_PIECES."""
  def pieces(m, k, groups):
    problem = RaggedProblem("contracting", m, k, k, groups, "bfloat16",
                            "bfloat16")
    config = mosaic.heuristic(problem, HOPPER)
    return config.piece_rows and -(-m // config.piece_rows)

  least = configs.ONE_GROUP_MIN_PIECE_ROWS
  # 256 x 256: four tiles a piece, so the SMs take 32 pieces' tiles.
  assert pieces(32 * least, 256, 1) == configs.ONE_GROUP_MAX_PIECES
  assert pieces(16 * least, 256, 1) == 16
  assert pieces(8 * least, 256, 1) == configs.MAX_PIECES
  assert pieces(64 * least, 256, 1) == configs.ONE_GROUP_MAX_PIECES
  # Pieces never shorter than the minimum (rounded up to whole chunks).
  for m in (8 * least, 12288, 15000, 16384):
    config = mosaic.heuristic(RaggedProblem(
        "contracting", m, 256, 256, 1, "bfloat16", "bfloat16"), HOPPER)
    assert config.piece_rows >= least
  assert pieces(8 * configs.PIECES_MIN_ROWS, 256, 2) <= configs.MAX_PIECES


def test_short_reduction_tile_caps_the_producers_lookahead():
  """The short-reduction weight-gradient tile keeps SHORT_TILE_LOOKAHEAD ring
  steps in flight on a deeper ring; longer reductions keep the whole ring,
  and a ring no deeper than the cap drops it rather than fail."""
  def config(m, k, n, groups, in_dtype="bfloat16"):
    problem = RaggedProblem("contracting", m, k, n, groups, in_dtype,
                            in_dtype)
    return mosaic.heuristic(problem, HOPPER)

  short = config(32768, 2048, 7168, 256)  # 128 rows per expert
  assert short.short_tile_lookahead == configs.SHORT_TILE_LOOKAHEAD
  assert short.stages > short.short_tile_lookahead
  assert config(16384, 2048, 1408, 60).short_tile_lookahead == 0
  assert config(16384, 4096, 14336, 8).short_tile_lookahead == 0
  # A ring of two stages only (float32 operands): the cap is dropped.
  problem = RaggedProblem("contracting", 2048, 1024, 1024, 32, "float32",
                          "float32")
  capped = dataclasses.replace(SMALL, tile_n=256, epi_tile_n=256, stages=3,
                               short_tile_lookahead=2)
  deepest = configs._most_stages(capped, problem)
  assert (deepest.stages, deepest.short_tile_lookahead) == (2, 0)


def test_heuristic_stages_16_bit_rows_swizzled():
  """The "rows" epilogue is staged swizzled wherever a staged row is one
  swizzle span (16-bit outputs), in every tile shape the heuristic picks;
  f32 outputs and "contracting" mode keep their staging."""
  shapes = [(16384, 2048, 1408, 60), (8192, 7168, 2048, 128),
            (16384, 4096, 14336, 8)]
  for m, k, n, groups in shapes:
    for out_dtype, swizzled in (("bfloat16", True), ("float16", True),
                                ("float32", False)):
      rows = RaggedProblem("rows", m, k, n, groups, "bfloat16", out_dtype)
      assert mosaic.heuristic(rows, HOPPER).swizzled_staging is swizzled
      assert all(c.swizzled_staging is swizzled
                 for c in configs.candidates(rows))
    contracting = RaggedProblem("contracting", m, k, n, groups, "bfloat16",
                                "bfloat16")
    assert not mosaic.heuristic(contracting, HOPPER).swizzled_staging


@pytest.mark.slow
@pytest.mark.parametrize("mode,transpose", [("rows", False), ("rows", True),
                                            ("contracting", False)])
def test_sweep_candidates_lower_for_cuda(mode, transpose):
  """Every config the GPU sweep (`configs.candidates`) times compiles."""
  groups, m, k, n = GPU_SHAPES[2]
  problem = RaggedProblem(mode, m, k, n, groups, "bfloat16", "bfloat16",
                          transpose_rhs=transpose)
  for config in configs.candidates(problem):
    _lower_for_cuda(problem, config)


@pytest.mark.parametrize("groups,rows,tile_m,restarts,band", [
    (256, 32768, 128, True, 8),  # 128 rows: one item (the H200's tile)
    # 273 rows: turns at 144 tokens on the H200 (two items, not three).
    (60, 16384, 144, True, 4),
    (8, 16384, 128, False, 8),   # 2048 rows: more items than the band
])
def test_heuristic_band_spans_at_most_one_groups_row_items(
    groups, rows, tile_m, restarts, band):
  """Where an expert's items are fewer than the band, the bands restart at
  each group (so a band holds one expert's items, however the tokens are
  routed), and the band keeps its own height for the groups above the
  average."""
  problem = RaggedProblem("rows", rows, 7168, 2048, groups, "bfloat16",
                          "bfloat16")
  config = mosaic.heuristic(problem, HOPPER)
  assert config.tile_m == tile_m
  assert config.group_bands == restarts
  assert config.grid_band == band


def test_heuristic_weighs_column_padding_and_output_bursts():
  # One 128-row item per expert (split tiles, f32 out: no swap_ab):
  # N = 11 x 128, where 256-wide tiles would compute a twelfth strip of
  # padding, and N = 8 x 256.
  padded = RaggedProblem("rows", 16384, 2048, 1408, 128, "bfloat16",
                         "float32")
  exact = RaggedProblem("rows", 32768, 7168, 2048, 256, "bfloat16",
                        "float32")
  assert mosaic.heuristic(padded, HOPPER).cta_tile("rows") == (128, 128)
  assert mosaic.heuristic(exact, HOPPER).cta_tile("rows") == (128, 256)
  # With a 16-bit output, both run the transposed 256-token items on the
  # H100, where they measured faster, and not on the H200.
  h100 = dataclasses.replace(HOPPER, device_kind="NVIDIA H100 80GB HBM3")
  for problem in (padded, exact):
    problem = dataclasses.replace(problem, out_dtype="bfloat16")
    tall = mosaic.heuristic(problem, h100)
    assert tall.swap_ab and tall.cta_tile("rows") == (256, 128)
    assert not mosaic.heuristic(problem, HOPPER).swap_ab
  # 256 rows per expert: the bands restart at each group of two items.
  two_items = RaggedProblem("rows", 16384, 2048, 1408, 64, "bfloat16",
                            "bfloat16")
  assert mosaic.heuristic(two_items, HOPPER).group_bands
  # A chunk of rows per expert: the weight gradient is its output write.
  few = RaggedProblem("contracting", 8192, 7168, 2048, 128, "bfloat16",
                      "bfloat16")
  many = RaggedProblem("contracting", 16384, 2048, 1408, 64, "bfloat16",
                       "bfloat16")
  few_config = mosaic.heuristic(few, HOPPER)
  assert (few_config.tile_m, few_config.tile_n) == (64, 256)
  assert few_config.epi_tile_n == few_config.tile_n  # one store per consumer
  assert mosaic.heuristic(many, HOPPER).epi_tile_n == 64


def test_heuristic_takes_turns_where_measured_faster():
  short = RaggedProblem("contracting", 16384, 2048, 1408, 64, "bfloat16",
                        "bfloat16")  # 256 rows per expert
  long = RaggedProblem("contracting", 16384, 4096, 14336, 8, "bfloat16",
                       "bfloat16")  # 2048 rows per expert
  config = mosaic.heuristic(short, HOPPER)
  assert config.ping_pong and config.cta_tile("contracting") == (128, 192)
  assert not mosaic.heuristic(long, HOPPER).ping_pong
  # At most two chunks per expert: the 64 x 256 tiles stay split.
  few = RaggedProblem("contracting", 8192, 7168, 2048, 128, "bfloat16",
                      "bfloat16")
  assert not mosaic.heuristic(few, HOPPER).ping_pong
  # "rows" mode: turns for experts of a few 128-row items, split tiles for
  # one item or fewer, and for many (compute-bound).
  for groups, want in ((64, True), (32, True), (8, False), (128, False)):
    rows = RaggedProblem("rows", 16384, 2048, 1408, groups, "bfloat16",
                         "bfloat16")
    config = mosaic.heuristic(rows, HOPPER)
    assert config.ping_pong == want, groups
    if want:
      assert config.cta_tile("rows") == (128, 128) and config.fits(rows)
      # ... transposed (token rows as wgmma's N) where the output is 16-bit.
      assert config.swap_ab
      f32 = dataclasses.replace(rows, out_dtype="float32")
      assert not mosaic.heuristic(f32, HOPPER).swap_ab
  many = RaggedProblem("rows", 16384, 4096, 14336, 8, "bfloat16", "bfloat16")
  assert not mosaic.heuristic(many, HOPPER).swap_ab
  # Just above PING_PONG_MAX_ROWS (513 rows: a 1-row fifth 128-row item)
  # the balanced items pad far less: on the H200 the turns stay, at 192
  # tokens (three items of 171 at width 176), on the H100 the 256-token
  # split tile runs them (three of 171 at width 192). Not at 600 rows (no
  # clear gain on either tile), nor where staging is not swizzled (no
  # balanced items).
  h100 = dataclasses.replace(HOPPER, device_kind="NVIDIA H100 80GB HBM3")
  assert configs.BALANCED_ITEMS_TILE_M[HOPPER.key] == 192
  assert configs.BALANCED_ITEMS_TILE_M[h100.key] == 256
  for rows_per_group, want in ((513, True), (560, True), (600, False),
                               (650, True), (4096, False)):
    rows = RaggedProblem("rows", 16 * rows_per_group, 4096, 6400, 16,
                         "bfloat16", "bfloat16")
    config = mosaic.heuristic(rows, HOPPER)
    assert config.ping_pong == want and config.swap_ab == want, rows_per_group
    if want:
      assert config.cta_tile("rows") == (192, 128) and config.fits(rows)
    config = mosaic.heuristic(rows, h100)
    assert not config.ping_pong
    assert config.swap_ab == want, rows_per_group
    assert config.cta_tile("rows")[0] == (256 if want else 128)
    assert config.fits(rows)
  # A GPU with no balanced-items tile keeps 128-row items.
  other = dataclasses.replace(HOPPER, device_kind="NVIDIA GH200 480GB")
  assert other.key not in configs.BALANCED_ITEMS_TILE_M
  config = mosaic.heuristic(
      RaggedProblem("rows", 16 * 513, 4096, 6400, 16, "bfloat16", "bfloat16"),
      other)
  assert not config.swap_ab and config.cta_tile("rows") == (128, 256)
  f32 = RaggedProblem("rows", 16 * 513, 4096, 6400, 16, "bfloat16", "float32")
  assert not mosaic.heuristic(f32, HOPPER).ping_pong
  assert not mosaic.heuristic(f32, h100).swap_ab


def test_merge_pieces_adds_each_cut_groups_pieces_in_place():
  """Two cut groups (three and one extra piece) and an unused slot, whose
  contents (NaN) must never be read; groups that were not cut keep their
  values bit for bit."""
  from pallas_gemm.ragged_dot import mosaic_contracting
  rng = np.random.default_rng(0)
  first = jnp.asarray(rng.normal(size=(4, 72, 136)), jnp.float32)
  rest = rng.normal(size=(5, 72, 136)).astype(np.float32)
  rest[4] = np.nan
  extras = jnp.asarray([[1, 1, 1, 3, -1],    # the pieces' groups
                        [0, 0, 0, 3, 0],     # each group's first extra
                        [3, 3, 3, 1, 0]],    # each group's extra count
                       jnp.int32)
  params = None if ON_GPU else plgpu.InterpretGPUParams(detect_races=True)
  got = np.asarray(mosaic_contracting.merge_pieces(
      first, jnp.asarray(rest), extras, params))
  want = np.asarray(first).copy()
  want[1] += rest[0] + rest[1] + rest[2]
  want[3] += rest[3]
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
  assert np.array_equal(got[[0, 2]], np.asarray(first)[[0, 2]])
  if not ON_GPU:
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
    assert not interpret_pallas_call.get_races().races_found


def test_operand_planes_rejects_what_it_cannot_run():
  """operand_planes: excludes 2-CTA clusters, a "contracting"-mode option,
  16-bit inputs only (the kernel's own check: through `ragged_matmul`,
  float32 operands become bfloat16 parts first); each error names the
  option."""
  for shared in ("cluster_columns", "cluster_rows"):
    with pytest.raises(ValueError, match="operand_planes excludes "
                       "cluster_columns and cluster_rows"):
      RaggedConfig(operand_planes=True, **{shared: True})
  with pytest.raises(ValueError, match="operand_planes"):
    RaggedConfig(operand_planes=True).check_mode("rows")
  problem = RaggedProblem("contracting", 150, 128, 128, 2, "float32",
                          "float32")
  ones = jnp.ones((150, 128), jnp.float32)
  with pytest.raises(ValueError, match="operand_planes needs 16-bit"):
    mosaic_contracting.contracting_matmul(
        ones, ones, jnp.array([100, 50], jnp.int32),
        jnp.zeros((1,), jnp.int32), problem=problem,
        config=RaggedConfig(tile_m=64, tile_n=128, stages=2,
                            operand_planes=True),
        params=interpret_params(True))


@pytest.mark.parametrize("count", [
    0, 1, 7, mosaic_schedule.MASKED_SUM_MAX_ENTRIES,
    mosaic_schedule.MASKED_SUM_MAX_ENTRIES + 1, 5000])
def test_inclusive_sum_is_cumsum_at_any_length(count):
  """The schedule's prefix sums, as one masked reduction for short lists
  and as a scan for long ones (a vmapped batch folded into the groups),
  agree with NumPy's cumsum, negative entries included."""
  values = np.random.default_rng(count).integers(-50, 3000, count,
                                                 dtype=np.int32)
  got = jax.jit(mosaic_schedule.inclusive_sum)(jnp.asarray(values))
  assert got.dtype == jnp.int32
  np.testing.assert_array_equal(np.asarray(got), np.cumsum(values))


def _sin_loss_on_the_kernels(dtype, transpose_rhs, seed, n, **options):
  """(loss(lhs, rhs), lhs, rhs, float64 (dlhs, drhs)): sum(weights *
  sin(ragged_dot(lhs, rhs))) on the Mosaic kernels (interpreted on a
  CPU) with `options`, over odd and empty groups and rows past the last."""
  sizes = [5, 0, 11, 3, 17, 1]
  m, k = 41, 64
  keys = jax.random.split(jax.random.key(seed), 3)
  lhs = numerics.random_normal(keys[0], (m, k), dtype)
  rhs = numerics.random_normal(
      keys[1], (len(sizes), n, k) if transpose_rhs else (len(sizes), k, n),
      dtype)
  weights = numerics.random_normal(keys[2], (m, n), jnp.float32)
  group_sizes = jnp.asarray(sizes, jnp.int32)

  def loss(l, r):
    out = pallas_gemm.ragged_dot(l, r, group_sizes, kernel="mosaic",
                                 transpose_rhs=transpose_rhs, **options)
    return jnp.sum(weights * jnp.sin(out))
  return loss, lhs, rhs, ragged_sin_loss_grads(
      lhs, rhs, sizes, weights, transpose_rhs=transpose_rhs)


@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_float32_output_gradients_run_on_the_kernels(transpose_rhs):
  """The backward of a float32 output on bfloat16 operands, through the
  Mosaic kernels: the float32 cotangent's two bfloat16 parts, the weight
  gradient over each token row twice; against float64."""
  loss, lhs, rhs, expected = _sin_loss_on_the_kernels(
      jnp.bfloat16, transpose_rhs, 7, 64, preferred_element_type=jnp.float32)
  grads = jax.jit(jax.grad(loss, (0, 1)))(lhs, rhs)
  tol = numerics.tolerance("bfloat16", "default", "bfloat16")
  for got, want in zip(grads, expected):
    assert got.dtype == jnp.bfloat16
    assert numerics.relative_error(got, want) <= tol


# ------------------------------------------------------- float32 operands ---

#: The split's error budget: its three bfloat16 products leave about 2^-16
#: of each product, where TF32 (precision="default") would leave 2^-11 and
#: the high parts alone (a dropped low part) about 2^-8.
THREE_PRODUCTS_TOLERANCE = 1e-4


@pytest.mark.parametrize("problem, sizes, row_offset", [
    (RaggedProblem("rows", 100, 72, 40, 4, "float32", "float32",
                   precision="tf32"), [30, 0, 50, 15], 0),
    # rhs stored (groups, n, k), an activation, a bfloat16 output, a group
    # offset whose groups run past m.
    (RaggedProblem("rows", 90, 64, 48, 3, "float32", "bfloat16",
                   transpose_rhs=True, activation="gelu", precision="tf32"),
     [40, 7, 60], 5),
    # Each token row three times: sums past m, a negative size, an offset.
    (RaggedProblem("contracting", 77, 40, 56, 4, "float32", "float32",
                   precision="tf32"), [20, -3, 31, 40], 4),
], ids=["rows", "rows_transposed_activation_bf16_out", "contracting"])
def test_float32_operands_run_as_three_bfloat16_products(problem, sizes,
                                                         row_offset):
  """float32 operands on the bfloat16 kernels: high x high + high x low +
  low x high in one call, against float64, well inside what TF32 or a
  dropped low part would give."""
  assert mosaic.supports(problem, HOPPER) is None
  got, want = _run(problem, sizes, row_offset=row_offset)
  if problem.out_dtype == "float32":
    error = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert error <= THREE_PRODUCTS_TOLERANCE, error


@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_float32_operands_keep_infinities_and_nans(transpose_rhs):
  """An infinity meets the other operand's high part only: where the float32
  product is an infinity the split gives the same one, not the NaN a cross
  term (infinity times a low part of zero) would add; NaNs stay NaNs."""
  m, k, n, sizes = 40, 64, 24, [10, 14, 16]
  keys = jax.random.split(jax.random.key(3), 2)
  lhs = np.array(numerics.random_normal(keys[0], (m, k), jnp.float32))
  rhs = np.array(numerics.random_normal(keys[1], (3, k, n), jnp.float32))
  # bfloat16 holds these exactly, so their own low parts are zero.
  lhs[:, :8] = 0.5
  rhs[:, :8, :] = -2.0
  lhs[2, 3] = np.inf  # group 0
  lhs[13, 9] = np.nan  # group 1
  rhs[2, 5, 7] = -np.inf  # group 2's rows, column 7
  problem = RaggedProblem("rows", m, k, n, 3, "float32", "float32",
                          transpose_rhs=transpose_rhs, precision="tf32")
  stored = np.swapaxes(rhs, 1, 2) if transpose_rhs else rhs
  out = mosaic.ragged_matmul(
      jnp.asarray(lhs), jnp.asarray(stored), jnp.asarray(sizes, jnp.int32),
      jnp.zeros((1,), jnp.int32), problem=problem, config=SMALL,
      interpret=False if ON_GPU else plgpu.InterpretGPUParams())
  got = np.asarray(out, np.float64)
  with np.errstate(invalid="ignore"):
    want = reference(lhs, stored, sizes, problem)
  assert np.isinf(want).sum() > n  # row 2, and column 7 of group 2's rows
  np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
  np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
  np.testing.assert_array_equal(got[np.isinf(want)], want[np.isinf(want)])
  finite = np.isfinite(want)
  assert (np.linalg.norm(got[finite] - want[finite])
          / np.linalg.norm(want[finite])) <= THREE_PRODUCTS_TOLERANCE


def test_float32_operands_at_exact_precision_are_not_split():
  """precision="highest" asks for float32 products, which three bfloat16
  ones do not give: the kernels decline (the automatic choice then falls
  back to xla) and raise when run anyway."""
  exact = RaggedProblem("rows", 64, 64, 64, 2, "float32", "float32",
                        precision="ieee")
  assert "exact float32" in mosaic.supports(exact, HOPPER)
  with pytest.raises(ValueError, match="exact float32"):
    mosaic.ragged_matmul(jnp.ones((64, 64)), jnp.ones((2, 64, 64)),
                         jnp.asarray([32, 32], jnp.int32),
                         jnp.zeros((1,), jnp.int32), problem=exact,
                         config=SMALL, interpret=True)
  huge = RaggedProblem("contracting", 2**30, 64, 64, 2, "float32", "float32",
                       precision="tf32")
  assert "int32" in mosaic.supports(huge, HOPPER)


def test_float32_operands_get_the_bfloat16_problems_config():
  """The config is the heuristic's for the bfloat16 problem the kernels
  run: three times the contraction (rows), three times the rows
  (contracting)."""
  for problem in (RaggedProblem("rows", 4096, 2048, 768, 128, "float32",
                                "float32", precision="tf32"),
                  RaggedProblem("contracting", 4096, 2048, 768, 128,
                                "float32", "float32", precision="tf32")):
    parts = mosaic.bfloat16_split.bfloat16_problem(problem)
    assert parts.in_dtype == "bfloat16" and parts.flops == 3 * problem.flops
    assert mosaic.heuristic(problem, HOPPER) == configs.heuristic(parts,
                                                                  HOPPER)


@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_float32_operand_gradients_run_on_the_kernels(transpose_rhs):
  """The pullback of float32 operands through the Mosaic kernels: every
  product (forward, dlhs, drhs) is a float32 `ragged_dot_p` that runs as
  three bfloat16 products; against float64."""
  loss, lhs, rhs, expected = _sin_loss_on_the_kernels(
      jnp.float32, transpose_rhs, 11, 40, precision="default")
  jaxpr = jax.make_jaxpr(jax.grad(loss, (0, 1)))(lhs, rhs)
  products = [e for e in jaxpr.eqns if e.primitive.name == "pallas_ragged_dot"]
  assert len(products) == 3
  assert all(e.params["kernel"] == "mosaic" and e.params["precision"] == "tf32"
             for e in products)
  grads = jax.jit(jax.grad(loss, (0, 1)))(lhs, rhs)
  # The cotangent, cos(out), takes the forward's error in absolute terms
  # (out is about sqrt(k) in size), so the gradients get ten times the
  # forward's budget, still well under what TF32 products would give.
  for got, want in zip(grads, expected):
    assert got.dtype == jnp.float32
    assert (numerics.relative_error(got, want)
            <= 10 * THREE_PRODUCTS_TOLERANCE)


def test_automatic_choice_for_float32_operands_follows_the_cost_model():
  """float32 operands: the split where its memory passes pay off (many
  rows, where XLA's product does groups times the flops), XLA on decode
  batches (a pass over the weights, or over the gathered weights of the
  groups with rows, is all either does, and the split makes four), and
  XLA where exact products are asked for; each with its reason."""
  from pallas_gemm.ragged_dot import bfloat16_split, implementations

  def choice(m, mode="rows", precision="tf32"):
    problem = RaggedProblem(mode, m, 2048, 768, 128, "float32", "float32",
                            precision=precision)
    return implementations.resolve(problem, HOPPER)
  for m in (16, 64, 256):
    decode = choice(m)
    assert decode.implementation == "xla" and "estimates" in decode.reason
    split, xla = bfloat16_split.estimated_seconds(
        RaggedProblem("rows", m, 2048, 768, 128, "float32", "float32",
                      precision="tf32"), HOPPER)
    assert split > 1.5 * xla
  # The gather pays only well below one row per group for float32 weights
  # (its mask pass); fp8 weights are gathered whenever rows are fewer.
  gathers = lambda m, dtype: bfloat16_split.gathers(
      RaggedProblem("rows", m, 2048, 768, 128, dtype, "float32"))
  assert gathers(64, "float32") and not gathers(100, "float32")
  assert gathers(127, "float8_e4m3fn") and not gathers(128, "float8_e4m3fn")
  for mode in ("rows", "contracting"):
    training = choice(32768, mode)
    assert training.implementation == "mosaic", training.reason
    assert "3 bfloat16 products about" in training.reason
  exact = choice(32768, precision="ieee")
  assert exact.implementation == "xla" and "exact float32" in exact.reason


def test_automatic_choice_for_float32_operands_counts_the_parts_pads():
  """Weights whose n is not whole 64-column spans: the kernels' path pads
  the parts (a pass over 3 x the weights), which the split's estimate adds
  (`cost_model.copies_us`); here that turns the choice to XLA, which the
  same shape at whole spans does not."""
  from pallas_gemm.ragged_dot import bfloat16_split, cost_model, \
      implementations

  def choice(n):
    return implementations.resolve(
        RaggedProblem("rows", 1156, 1152, n, 5, "float32", "float32",
                      precision="tf32"), HOPPER)
  padded, whole = choice(7988), choice(8000)
  assert whole.implementation == "mosaic", whole.reason
  assert padded.implementation == "xla", padded.reason
  problem = RaggedProblem("rows", 1156, 1152, 7988, 5, "float32", "float32",
                          precision="tf32")
  pads = cost_model.copies_us(problem, mosaic, mosaic.heuristic(problem,
                                                                HOPPER),
                              HOPPER)
  assert pads > 0
  without, _ = bfloat16_split.estimated_seconds(problem, HOPPER)
  with_pads, _ = bfloat16_split.estimated_seconds(problem, HOPPER, pads)
  assert with_pads == pytest.approx(without + 1e-6 * pads)


def _sparse_sizes(groups, sizes_of):
  """`groups` group sizes, zero but for the {group: size} given."""
  return [sizes_of.get(g, 0) for g in range(groups)]


@pytest.mark.parametrize("in_dtype", ["float32", "float8_e4m3fn"])
@pytest.mark.parametrize("m, groups, sizes, row_offset, transpose_rhs", [
    # 40 rows in 4 of 64 groups, one of them negative (so empty).
    (40, 64, _sparse_sizes(64, {3: 9, 17: -4, 18: 11, 40: 13, 62: 7}), 0,
     False),
    # An offset, the last group running past m, weights stored (g, n, k).
    (30, 48, _sparse_sizes(48, {0: 5, 10: 12, 47: 20}), 6, True),
    # Every row its own group: as many groups with rows as rows.
    (16, 24, [1] * 16 + [0] * 8, 0, False),
], ids=["gaps", "offset_past_m_transposed", "one_row_each"])
def test_decode_batches_split_only_the_groups_with_rows(
    in_dtype, m, groups, sizes, row_offset, transpose_rhs):
  """With fewer rows than groups, the weights of the groups with rows are
  gathered on the device before their parts are made: the kernels run m
  groups, and the result is the full product's."""
  problem = RaggedProblem("rows", m, 64, 40, groups, in_dtype, "float32",
                          transpose_rhs=transpose_rhs,
                          activation="silu" if transpose_rhs else None,
                          precision="tf32" if in_dtype == "float32"
                          else "default")
  assert mosaic.bfloat16_split.bfloat16_problem(problem).groups == m
  got, want = _run(problem, sizes, row_offset=row_offset)
  budget = THREE_PRODUCTS_TOLERANCE if in_dtype == "float32" else 1e-6
  assert np.linalg.norm(got - want) / np.linalg.norm(want) <= budget


@pytest.mark.parametrize("problem, sizes, row_offset", [
    (RaggedProblem("rows", 90, 64, 40, 3, "float8_e4m3fn", "float32"),
     [30, 0, 50], 0),
    (RaggedProblem("rows", 70, 48, 64, 3, "float8_e5m2", "bfloat16",
                   transpose_rhs=True, activation="silu"), [20, 31, 40], 2),
    (RaggedProblem("contracting", 77, 40, 56, 4, "float8_e4m3fn", "float32"),
     [20, -3, 31, 40], 4),
], ids=["rows_e4m3", "rows_e5m2_transposed_silu_bf16_out", "contracting"])
def test_fp8_operands_run_as_one_exact_bfloat16_product(problem, sizes,
                                                        row_offset):
  """fp8 operands on the bfloat16 kernels: bfloat16 holds every fp8 value,
  so the widened product is exact up to the float32 sums."""
  assert mosaic.supports(problem, HOPPER) is None
  assert mosaic.bfloat16_split.bfloat16_problem(problem).k == problem.k
  got, want = _run(problem, sizes, row_offset=row_offset)
  if problem.out_dtype == "float32":
    assert np.linalg.norm(got - want) / np.linalg.norm(want) <= 1e-6


def test_automatic_choice_for_fp8_operands_is_the_kernels_but_small_calls():
  """fp8 operands: widened on the kernels at any row count, decode batches
  included; except on calls of a few microseconds, which go to XLA where
  the bfloat16 model expects it faster in under SMALL_CALL_US, and with
  rhs read transposed, where the bfloat16 model's choice holds."""
  from pallas_gemm.ragged_dot import bfloat16_split, cost_model, \
      implementations
  for m, mode in ((16, "rows"), (32768, "rows"), (16, "contracting")):
    problem = RaggedProblem(mode, m, 7168, 2048, 256, "float8_e5m2",
                            "float32")
    chosen = implementations.resolve(problem, HOPPER)
    assert chosen.implementation == "mosaic", chosen.reason
    assert "widened exactly" in chosen.reason
  # One expert's dlhs of 464 rows by 264 x 224: about ten microseconds.
  small = RaggedProblem("rows", 464, 224, 264, 1, "float8_e4m3fn",
                        "bfloat16", transpose_rhs=True)
  chosen = implementations.resolve(small, HOPPER)
  assert chosen.implementation == "xla", chosen.reason
  assert "a short call" in chosen.reason
  mosaic_us, xla_us = cost_model.estimated_us(
      dataclasses.replace(small, in_dtype="bfloat16"), mosaic,
      mosaic.heuristic(small, HOPPER), HOPPER)
  assert xla_us < cost_model.SMALL_CALL_US and xla_us < mosaic_us
  # A few times that size, where XLA's fp8 product falls behind: kernels.
  larger = dataclasses.replace(small, m=3514, k=904, n=48, groups=9)
  assert implementations.resolve(larger, HOPPER).implementation == "mosaic"
  # rhs read transposed, XLA's fp8 GEMMs take the weights as stored: the
  # 16-bit choice, at its margin (XLA measured faster on this draw:
  # experiments/results/nvidia_h200/random_ragged, section 12). Not
  # transposed, XLA would transpose them first: there it is chosen on
  # short calls only, and this one is not.
  as_stored = RaggedProblem("rows", 317, 32, 5461, 7, "float8_e4m3fn",
                            "bfloat16", transpose_rhs=True)
  chosen = implementations.resolve(as_stored, HOPPER)
  assert chosen.implementation == "xla", chosen.reason
  assert "rhs read as stored" in chosen.reason
  stored_k_by_n = dataclasses.replace(as_stored, transpose_rhs=False)
  assert implementations.resolve(stored_k_by_n,
                                 HOPPER).implementation == "mosaic"
  with pytest.raises(ValueError, match="no cost model"):
    bfloat16_split.estimated_seconds(problem, HOPPER)
