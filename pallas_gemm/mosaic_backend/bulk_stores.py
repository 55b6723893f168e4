"""Stores of zeros with an L2 eviction hint, which Mosaic's copies lack.

Mosaic's TMA stores take no cache policy, so the zeros of a weight
gradient's empty groups (most of its output where one group holds most
tokens) allocate L2 lines like any other store, and can evict the operand
chunks that the long tiles beside them read again from L2 (every column
strip of a group's tiles reads the same lhs chunk). `store_zeros` copies a
run of contiguous output bytes from a zeroed shared-memory buffer with one
plain bulk copy (`cp.async.bulk`, no tensor map) under an evict-first
policy, so that those lines are the first to leave.

A group's output is one contiguous (rows, columns) slab, so a run is whole
rows of it, or part of one row where a row is longer than the buffer
(`zero_runs`).
"""

from __future__ import annotations

import math
from typing import NamedTuple

from jax.experimental.pallas import mosaic_gpu as plgpu

#: The inlined PTX (operands $0, $1, ... as `mgpu_utils.inline_ptx` numbers
#: them). The tests assemble each for sm_90a with nvcc on a CPU.
PTX_STORE_EVICT_FIRST = (
    "{ .reg .b64 policy; "
    "createpolicy.fractional.L2::evict_first.b64 policy, 1.0; "
    "cp.async.bulk.global.shared::cta.bulk_group.L2::cache_hint "
    "[$0], [$1], $2, policy; }")
PTX_COMMIT = "cp.async.bulk.commit_group;"
PTX_AWAIT_READS = "cp.async.bulk.wait_group.read 0;"
INLINE_PTX = (PTX_STORE_EVICT_FIRST, PTX_COMMIT, PTX_AWAIT_READS)


class ZeroRuns(NamedTuple):
  """How a (rows, columns) slab is cut into runs of at most a buffer's
  bytes: each run `run_rows` whole rows (`run_cols` the row's columns), or
  where a row is longer than the buffer one row's `run_cols` columns;
  `row_runs` runs per run row, `runs` in the slab. The last run of each
  direction starts early enough to end at the slab's edge (it overlaps
  the one before, which stores the same zeros again)."""
  run_rows: int
  run_cols: int
  row_runs: int
  runs: int

  def start(self, run, *, rows: int, cols: int, minimum=min):
    """(first row, first column) of run number `run` (traced or not) of a
    `rows` x `cols` slab; `minimum` the min of its values."""
    if self.row_runs == 1:
      return minimum(run * self.run_rows, rows - self.run_rows), 0
    return run // self.row_runs, minimum((run % self.row_runs) * self.run_cols,
                                         cols - self.run_cols)


def zero_runs(rows: int, cols: int, itemsize: int,
              buffer_bytes: int) -> ZeroRuns:
  """The runs of a `rows` x `cols` slab of `itemsize`-byte elements that a
  zeroed buffer of `buffer_bytes` stores one at a time."""
  row_bytes = cols * itemsize
  if row_bytes <= buffer_bytes:
    run_rows = min(buffer_bytes // row_bytes, rows)
    return ZeroRuns(run_rows, cols, 1, math.ceil(rows / run_rows))
  run_cols = buffer_bytes // itemsize
  row_runs = math.ceil(cols / run_cols)
  return ZeroRuns(1, run_cols, row_runs, rows * row_runs)


def buffer_bytes(zeros_smem) -> int:
  """The bytes of the zeroed buffer: the longest run it stores."""
  return math.prod(zeros_smem.shape) * zeros_smem.dtype.itemsize


def store_zeros(zeros_smem, run_gmem, *, smem_transforms=()):
  """Copies the first bytes of `zeros_smem` (zero) over `run_gmem`, a
  contiguous region of global memory of at most its bytes, in 16-byte
  units, evicted from L2 first; one bulk group, issued by one thread of
  the warpgroup and never awaited here (`await_zero_stores`).
  `smem_transforms`: the buffer's layout transforms (a tiled, swizzled
  staging slot), which only its bytes' order depends on, and every byte is
  zero."""
  from jax._src.lib.mlir import ir
  from jax.experimental.mosaic.gpu import utils as mgpu_utils
  run_bytes = math.prod(run_gmem.shape) * run_gmem.dtype.itemsize
  if run_bytes % 16 or run_bytes > buffer_bytes(zeros_smem):
    raise ValueError(f"a zero run of {run_bytes} bytes must be a multiple of "
                     f"16 and fit the zero buffer {zeros_smem.shape}")

  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(tuple(smem_transforms)),
                                 plgpu.RefType()))
  def store(_, zeros, run):
    i32 = ir.IntegerType.get_signless(32)
    with mgpu_utils.single_thread(scope=mgpu_utils.ThreadSubset.WARPGROUP):
      mgpu_utils.inline_ptx(PTX_STORE_EVICT_FIRST, mgpu_utils.memref_ptr(run),
                            mgpu_utils.memref_ptr(zeros),
                            mgpu_utils.c(run_bytes, i32),
                            has_side_effects=True)
      mgpu_utils.inline_ptx(PTX_COMMIT, has_side_effects=True)

  store(zeros_smem, run_gmem)


def await_zero_stores(zeros_smem):
  """The thread that issued `store_zeros` waits until every one of them has
  read the buffer (before the CTA's shared memory goes). The buffer is
  passed only to tie the wait to it; this is the form the GPU ran."""
  from jax.experimental.mosaic.gpu import utils as mgpu_utils

  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),))
  def await_reads(_, zeros):
    del zeros  # only orders the wait after the stores that read it
    with mgpu_utils.single_thread(scope=mgpu_utils.ThreadSubset.WARPGROUP):
      mgpu_utils.inline_ptx(PTX_AWAIT_READS, has_side_effects=True)

  await_reads(zeros_smem)
