"""How one measurement is timed: the rotated call (`timing.over_sets`),
CUPTI on a GPU (`pallas_gemm.timing`, which bounds the outputs in flight),
the host clock in interpret mode or when CUPTI is missing."""

from __future__ import annotations

import dataclasses
import functools
import re
import statistics
import time
from typing import Callable

import jax

from pallas_gemm import timing



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

  @functools.cached_property
  def lowered(self):
    """The call lowered (once per call, however many targets compare with
    it)."""
    return self.compiled.lower(*self.args)

  @functools.cached_property
  def compiled_program(self) -> str:
    """The call's compiled XLA program, without source locations."""
    return _canonical_hlo(self.lowered.compile().as_text())

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


def _cupti_samples_us(call: RotatingCall, iters: int) -> list[float]:
  """`iters` CUPTI samples of one GEMM of `call` (the harness times them in
  rounds whose outputs fit in memory)."""
  _, per_iteration_ms = timing.cupti_samples_ms(
      call.compiled, call.args, iterations=iters, warmup=0)
  return [ms * 1e3 / len(call.sets) for ms in per_iteration_ms]


def _warm_and_count(call: RotatingCall, *, iters: int, warmup: int,
                    cap_s: float) -> int:
  """Warms `call` up; returns how many timed iterations fit in `cap_s`."""
  for _ in range(max(1, warmup)):
    jax.block_until_ready(call.compiled(*call.args))
  start = time.perf_counter()
  jax.block_until_ready(call.compiled(*call.args))
  return _effective_iters(time.perf_counter() - start, iters, cap_s)


def time_on_gpu(call: RotatingCall, *, iters: int,
                warmup: int, cap_s: float) -> Timing:
  """CUPTI kernel time of one kernel call, median over iterations.

  CUPTI sums the device time of every kernel one rotated call launches (a
  split-K reduction or a layout copy counts too); divided by the number of
  sets that is the time of one GEMM. Launch gaps and Python overhead do not
  count.
  """
  iters = _warm_and_count(call, iters=iters, warmup=warmup, cap_s=cap_s)
  try:
    return Timing(tuple(_cupti_samples_us(call, iters)), "cupti")
  except (ImportError, RuntimeError) as e:
    reason = str(e).splitlines()[0][:80] if str(e) else type(e).__name__
    count = len(call.sets)
    samples = []
    for _ in range(iters):
      start = time.perf_counter()
      jax.block_until_ready(call.compiled(*call.args))
      samples.append((time.perf_counter() - start) * 1e6 / count)
    return Timing(tuple(samples), f"host-clock (no CUPTI: {reason})")


#: Rounds of a paired timing: each round times the baseline and the target
#: back to back, in alternating order (ABBA), so that a drift of the clocks
#: or of the power cap over the run falls on both alike.
PAIRED_ROUNDS = 4


def time_paired_on_gpu(baseline: RotatingCall, call: RotatingCall, *,
                       iters: int, warmup: int,
                       cap_s: float) -> tuple[Timing, Timing]:
  """CUPTI times of `baseline` and `call`, interleaved in rounds.

  Timed one after the other, two runs of one and the same cuBLAS kernel
  differ by up to a few percent (the later one runs warmer, nearer the power
  cap); interleaved, that drift cancels in their ratio. Returns the
  baseline's timing and the target's, each over `iters` samples (fewer when
  `cap_s` would be exceeded), or raises where CUPTI is missing.
  """
  iters = min(_warm_and_count(baseline, iters=iters, warmup=warmup, cap_s=cap_s),
              _warm_and_count(call, iters=iters, warmup=warmup, cap_s=cap_s))
  rounds = max(1, min(PAIRED_ROUNDS, iters))
  per_round = [iters // rounds + (r < iters % rounds) for r in range(rounds)]
  base_samples: list[float] = []
  call_samples: list[float] = []
  for r, step in enumerate(per_round):
    order = ((baseline, base_samples), (call, call_samples))
    for which, samples in (order if r % 2 == 0 else order[::-1]):
      samples.extend(_cupti_samples_us(which, step))
  return (Timing(tuple(base_samples), "cupti, paired"),
          Timing(tuple(call_samples), "cupti, paired"))


def _canonical_hlo(text: str) -> str:
  """Compiled HLO without what names where it was traced from."""
  blocks = [block for block in text.split("\n\n")
            if block.split("\n")[0] not in
            ("FileNames", "FunctionNames", "FileLocations", "StackFrames")]
  text = "\n\n".join(blocks)
  text = re.sub(r", metadata=\{[^}]*\}", "", text)
  text = re.sub(r", stack_frame_id=\d+", "", text)
  return re.sub(r"^HloModule \S+", "HloModule", text, flags=re.M)


def same_program(first: RotatingCall, second: RotatingCall) -> bool:
  """Whether both calls compile to one and the same XLA program.

  That is the case where `kernel=None` resolved to `xla`, which emits
  exactly jnp.dot's dot: their time ratio is then 1 by construction, and a
  measured difference is timing noise. A call that launches a custom kernel
  (Pallas, Mosaic, FFI) is never the same program, and is not compiled
  again to find out.
  """
  if "custom_call" in second.lowered.as_text():
    return False
  return first.compiled_program == second.compiled_program
