"""The one timing harness: CUPTI kernel time, median, over rotated operands.

Autotuning, the dispatch-table builder, the benchmark and every lab sweep
time through these functions, so that all their numbers mean the same:

  * on a GPU, the sum of the kernels one call launches, measured by CUPTI
    (`jax.experimental.mosaic.gpu.profiler`), median of `iterations` calls
    after a warm-up call (compilation and first-touch stay out);
  * operands rotated over enough independent sets that together they are
    twice L2's size, so no call finds its inputs in L2 left by the previous
    one (a model's GEMMs seldom do);
  * on a host (tests only), wall clock around `block_until_ready`.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp

from pallas_gemm import numerics
from pallas_gemm.problem import GemmProblem

#: L2 of the H100/H200 is 50 MiB; a margin on top.
L2_BYTES = 60 * 2**20
#: At most this many operand sets are rotated through.
MAX_OPERAND_SETS = 16
#: The CUPTI profiler keeps every timed call's outputs alive until it
#: returns; their bytes may take at most this share of the device's memory,
#: and a longer run is timed in several rounds.
OUTPUTS_IN_FLIGHT_SHARE = 0.25


def operand_set_count(problem: GemmProblem, on_gpu: bool) -> int:
  """How many operand sets to rotate through so that together they are
  twice L2's size (one on a host, where L2 does not matter)."""
  if not on_gpu:
    return 1
  in_size = jnp.dtype(problem.in_dtype).itemsize
  set_bytes = (problem.m + problem.n) * problem.k * in_size * problem.batch
  return max(1, min(MAX_OPERAND_SETS, -(-2 * L2_BYTES // max(set_bytes, 1))))


def random_operands(problem: GemmProblem, seed: int = 0):
  """Normal-distributed canonical operands (a, b, c, bias) for `problem`."""
  key = numerics.fresh_key(seed)
  keys = jax.random.split(key, 4)
  a_shape = ((problem.batch, problem.k, problem.m) if problem.transpose_a
             else (problem.batch, problem.m, problem.k))
  b_shape = ((problem.batch, problem.n, problem.k) if problem.transpose_b
             else (problem.batch, problem.k, problem.n))
  a = numerics.random_normal(keys[0], a_shape, problem.in_dtype)
  b = numerics.random_normal(keys[1], b_shape, problem.in_dtype)
  c = bias = None
  if problem.epilogue.has_c:
    c = numerics.random_normal(keys[2], (problem.batch, problem.m, problem.n),
                               problem.c_dtype or problem.out_dtype)
  if problem.epilogue.has_bias:
    bias = numerics.random_normal(keys[3], (problem.n,), problem.out_dtype)
  return a, b, c, bias


def cupti_samples_ms(fn, args, *, iterations: int, per_kernel: bool = False,
                     warmup: int = 1):
  """(output, samples) of `fn(*args)` run `iterations` times under CUPTI.

  A sample is one call's kernel time in ms (the sum over the kernels it
  launches), or with `per_kernel` the list of (kernel name, ms) of that
  call. Raises RuntimeError when CUPTI saw no kernel.
  """
  if iterations < 1:
    raise ValueError(f"iterations={iterations} must be >= 1")
  from jax.experimental.mosaic.gpu import profiler
  out = None
  for _ in range(warmup):  # compilation and first touch stay out
    out = jax.block_until_ready(fn(*args))
  # Rounds of as many calls as their outputs fit in memory; without a
  # warm-up, a first round of one call shows the outputs' size.
  per_round = None if out is None else calls_in_memory(out, iterations)
  samples = []
  while len(samples) < iterations:
    count = min(per_round or 1, iterations - len(samples))
    out = None  # the last round's outputs are freed before the next
    out, got = profiler.measure(fn, aggregate=not per_kernel,
                                iterations=count)(*args)
    if got is None:
      raise RuntimeError("CUPTI recorded no kernels")
    if count == 1:  # measure() drops the per-iteration level for one
      got = [got]
    samples.extend(got)
    if per_round is None:
      per_round = calls_in_memory(out, iterations)
  return out, samples


def kernel_medians_us(fn, args, *, iterations: int):
  """[(kernel name, median µs)] of the kernels one call of `fn(*args)`
  launches, in launch order, over `iterations` calls under CUPTI. Raises
  RuntimeError when the calls launched different kernel counts."""
  _, calls = cupti_samples_ms(fn, args, iterations=iterations,
                              per_kernel=True)
  launches = len(calls[0])
  if any(len(call) != launches for call in calls):
    raise RuntimeError("the calls launched different kernel counts")
  return [(calls[0][i][0], 1e3 * statistics.median(c[i][1] for c in calls))
          for i in range(launches)]


def device_memory_bytes() -> int:
  """The default device's memory that JAX may allocate, in bytes; 0 where
  the backend does not say."""
  try:
    return int(jax.devices()[0].memory_stats().get("bytes_limit", 0) or 0)
  except Exception:  # noqa: BLE001 - memory_stats is optional per backend
    return 0


def calls_in_memory(out, iterations: int) -> int:
  """How many timed calls whose outputs look like `out` may be kept alive
  at once (`OUTPUTS_IN_FLIGHT_SHARE` of the device's memory), at most
  `iterations`; all of them where the output or the memory size is
  unknown. A grouped GEMM's weight gradient (G x K x N) is gigabytes
  (experiments/results/nvidia_h100/moe_all_directions)."""
  out_bytes = sum(getattr(leaf, "nbytes", 0) for leaf in jax.tree.leaves(out))
  limit = device_memory_bytes()
  if not out_bytes or not limit:
    return iterations
  return max(1, min(iterations,
                    int(limit * OUTPUTS_IN_FLIGHT_SHARE) // out_bytes))


def median_time_ms(fn, args, *, iterations: int, on_gpu: bool) -> float:
  """Median per-call time of `fn(*args)` in ms: CUPTI kernel time on a GPU
  (the sum of the kernels one call launches), wall clock elsewhere."""
  if iterations < 1:
    raise ValueError(f"iterations={iterations} must be >= 1")
  if on_gpu:
    _, samples = cupti_samples_ms(fn, args, iterations=iterations)
    return float(statistics.median(samples))
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(iterations):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append((time.perf_counter() - start) * 1e3)
  return float(statistics.median(times))


def over_sets(call: Callable) -> Callable:
  """One jitted function of a tuple of operand sets that runs `call` once on
  every set and returns the tuple of outputs: timed as one call, consecutive
  GEMMs read different operands and never find them in L2.

  `call` is jitted on its own first, so that its kernel is lowered once and
  called once per set; inlined per set, a Pallas kernel would be lowered and
  compiled as many times as there are sets."""
  single = jax.jit(call)
  return jax.jit(lambda operand_sets: tuple(single(*operands)
                                            for operands in operand_sets))


def time_over_sets(call: Callable, operand_sets: Sequence[tuple], *,
                   iterations: int, on_gpu: bool) -> float:
  """Median ms of one `call(*operands)`, timed as one jitted function that
  calls it once on every operand set (`over_sets`), divided by the number of
  sets."""
  operand_sets = tuple(tuple(s) for s in operand_sets)
  if not operand_sets:
    raise ValueError("operand_sets must not be empty")
  return median_time_ms(over_sets(call), (operand_sets,),
                        iterations=iterations, on_gpu=on_gpu) / len(operand_sets)
