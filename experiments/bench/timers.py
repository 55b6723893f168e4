"""How one measurement is timed: the rotated call (`timing.over_sets`),
CUPTI on a GPU in chunks that bound the outputs in flight, the host clock in
interpret mode or when CUPTI is missing."""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Callable

import jax

from pallas_gemm import timing

from experiments.bench.cases import OUTPUTS_IN_FLIGHT_CAP


@dataclasses.dataclass(frozen=True)
class Timing:
  samples_us: tuple[float, ...]
  method: str

  @property
  def median_us(self) -> float:
    return statistics.median(self.samples_us)


def _effective_iters(seconds_per_iter: float, iters: int, cap_s: float) -> int:
  if cap_s <= 0 or seconds_per_iter <= 0:
    return iters
  return max(min(3, iters), min(iters, int(cap_s / seconds_per_iter)))


class RotatingCall:
  """One compiled kernel call over the rotated input sets.

  On a GPU one call runs the kernel once on every set inside one jitted
  function (`timing.over_sets`), so consecutive calls read different operands
  and never find them in L2; its first output is what the check looks at, so
  the function that is checked is the very one that is timed, and it
  compiles once. On a CPU a single-set function is jitted and the Python
  loop rotates the sets.
  """

  def __init__(self, fn: Callable, sets, *, on_gpu: bool):
    self.sets = tuple(tuple(s) for s in sets)
    self.on_gpu = on_gpu
    if on_gpu:
      self.compiled = timing.over_sets(fn)
      self.args = (self.sets,)
    else:
      self.compiled = jax.jit(fn)
      self.args = self.sets[0]

  def first_output(self):
    """The kernel's output on input set 0."""
    out = jax.block_until_ready(self.compiled(*self.args))
    return out[0] if self.on_gpu else out


def time_on_host(call: RotatingCall, *, iters: int, warmup: int,
                 cap_s: float) -> Timing:
  """Host clock around block_until_ready of the jitted call (interpret mode)."""
  sets = call.sets
  for i in range(max(1, warmup)):
    jax.block_until_ready(call.compiled(*sets[i % len(sets)]))
  start = time.perf_counter()
  jax.block_until_ready(call.compiled(*sets[0]))
  iters = _effective_iters(time.perf_counter() - start, iters, cap_s)
  samples = []
  for i in range(iters):
    a, b = sets[i % len(sets)]
    start = time.perf_counter()
    jax.block_until_ready(call.compiled(a, b))
    samples.append((time.perf_counter() - start) * 1e6)
  return Timing(tuple(samples), "host-clock (interpret mode, not meaningful)")


def time_on_gpu(call: RotatingCall, *, out_bytes: int, iters: int,
                warmup: int, cap_s: float) -> Timing:
  """CUPTI kernel time of one kernel call, median over iterations.

  CUPTI sums the device time of every kernel one rotated call launches (a
  split-K reduction or a layout copy counts too); divided by the number of
  sets that is the time of one GEMM. Launch gaps and Python overhead do not
  count.
  """
  count = len(call.sets)
  for _ in range(max(1, warmup)):
    jax.block_until_ready(call.compiled(*call.args))
  start = time.perf_counter()
  jax.block_until_ready(call.compiled(*call.args))
  iters = _effective_iters(time.perf_counter() - start, iters, cap_s)
  chunk = max(1, min(iters, OUTPUTS_IN_FLIGHT_CAP // max(1, count * out_bytes)))
  try:
    samples: list[float] = []
    remaining = iters
    while remaining > 0:
      step = min(chunk, remaining)
      _, per_iteration_ms = timing.cupti_samples_ms(
          call.compiled, call.args, iterations=step, warmup=0)
      samples.extend(ms * 1e3 / count for ms in per_iteration_ms)
      remaining -= step
    return Timing(tuple(samples), "cupti")
  except (ImportError, RuntimeError) as e:
    reason = str(e).splitlines()[0][:80] if str(e) else type(e).__name__
    samples = []
    for _ in range(iters):
      start = time.perf_counter()
      jax.block_until_ready(call.compiled(*call.args))
      samples.append((time.perf_counter() - start) * 1e6 / count)
    return Timing(tuple(samples), f"host-clock (no CUPTI: {reason})")
