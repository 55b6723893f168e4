"""Inputs and the correctness gate: a float64 reference every row must match before it is timed."""

from __future__ import annotations

import dataclasses
import pathlib
import zlib

import jax
import jax.numpy as jnp
import numpy as np

from pallas_gemm import numerics, timing
from pallas_gemm.problem import GemmProblem, cdiv

from experiments.bench.cases import (DtypeCase, FULL_CHECK_VOLUME, INPUT_SET_MEMORY_CAP, SAMPLE_EDGE, SAMPLE_TARGET)

_REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------- inputs ---


def make_problem(shape, case: DtypeCase, layout: str,
                 batch: int = 1) -> GemmProblem:
  m, n, k = shape
  return GemmProblem(batch=batch, m=m, n=n, k=k, in_dtype=case.in_dtype,
                     out_dtype=case.out_dtype, transpose_a=layout[0] == "T",
                     transpose_b=layout[1] == "T", precision=case.precision)


def _operand_shapes(problem: GemmProblem):
  a_shape = (problem.k, problem.m) if problem.transpose_a else (problem.m, problem.k)
  b_shape = (problem.n, problem.k) if problem.transpose_b else (problem.k, problem.n)
  if problem.batch > 1:
    return (problem.batch, *a_shape), (problem.batch, *b_shape)
  return a_shape, b_shape


def output_shape(problem: GemmProblem) -> tuple[int, ...]:
  batch = (problem.batch,) if problem.batch > 1 else ()
  return batch + (problem.m, problem.n)


def _itemsize(dtype: str) -> int:
  return jnp.dtype(dtype).itemsize


def input_set_count(problem: GemmProblem, on_gpu: bool) -> int:
  """How many (a, b) pairs to rotate through while timing."""
  if not on_gpu:
    return 2  # rotation is exercised; L2 effects do not matter on a host
  set_bytes = ((problem.m + problem.n) * problem.k * problem.batch
               * _itemsize(problem.in_dtype))
  wanted = timing.operand_set_count(problem, on_gpu=True)
  cap = INPUT_SET_MEMORY_CAP
  limit = timing.device_memory_bytes()
  if limit:
    cap = min(cap, limit // 5)
  return max(1, min(wanted, cap // max(set_bytes, 1)))


def make_input_sets(problem: GemmProblem, count: int, seed: int):
  """`count` (a, b) pairs of normal values. Each set's key depends on the
  seed, the problem and the set's index only, so a problem gets the same
  inputs whichever other problems, regimes or kernels the run includes."""
  a_shape, b_shape = _operand_shapes(problem)
  problem_key = jax.random.fold_in(
      jax.random.key(seed),
      zlib.crc32(problem.describe().encode()) & 0x7FFFFFFF)
  sets = []
  for index in range(count):
    key_a, key_b = jax.random.split(jax.random.fold_in(problem_key, index))
    a = numerics.random_normal(key_a, a_shape, problem.in_dtype)
    b = numerics.random_normal(key_b, b_shape, problem.in_dtype)
    sets.append((jax.block_until_ready(a), jax.block_until_ready(b)))
  return sets


def _sample_indices(size: int, rng: np.random.Generator) -> np.ndarray:
  """Both edges plus one random index in each of ~SAMPLE_TARGET strides."""
  if size <= SAMPLE_TARGET + 2 * SAMPLE_EDGE:
    return np.arange(size)
  stride = cdiv(size, SAMPLE_TARGET)
  starts = np.arange(0, size, stride)
  picks = starts + rng.integers(0, stride, size=starts.size)
  picks = picks[picks < size]
  edges = np.concatenate([np.arange(SAMPLE_EDGE),
                          np.arange(size - SAMPLE_EDGE, size)])
  return np.unique(np.concatenate([picks, edges]))


@dataclasses.dataclass
class ReferenceCheck:
  """The float64 reference of op(a) @ op(b) for input set 0, either whole
  (rows/cols None) or on a sample of rows and columns."""

  reference: np.ndarray
  rows: np.ndarray | None
  cols: np.ndarray | None
  # Batched problems are checked on batch entry 0.
  batched: bool = False

  @property
  def sampled(self) -> bool:
    return self.rows is not None

  def select(self, out) -> np.ndarray:
    if self.batched:
      out = out[0]
    if self.rows is None:
      return np.asarray(out.astype(jnp.float32))
    picked = jnp.take(jnp.take(out, self.rows, axis=0), self.cols, axis=1)
    return np.asarray(picked.astype(jnp.float32))


def build_reference(problem: GemmProblem, a, b, seed: int) -> ReferenceCheck:
  batched = problem.batch > 1
  if batched:
    a, b = a[0], b[0]
  if problem.m * problem.n * problem.k <= FULL_CHECK_VOLUME:
    ref = numerics.reference_matmul(a, b, transpose_a=problem.transpose_a,
                                    transpose_b=problem.transpose_b)
    return ReferenceCheck(ref, None, None, batched)
  rng = np.random.default_rng(seed)
  rows = _sample_indices(problem.m, rng)
  cols = _sample_indices(problem.n, rng)
  a_rows = jnp.take(a, rows, axis=1).T if problem.transpose_a else jnp.take(a, rows, axis=0)
  b_cols = jnp.take(b, cols, axis=0).T if problem.transpose_b else jnp.take(b, cols, axis=1)
  return ReferenceCheck(numerics.reference_matmul(a_rows, b_cols), rows, cols,
                        batched)
