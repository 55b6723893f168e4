"""The measurement grid: inputs, the check, then timing, row by row."""

from __future__ import annotations

import dataclasses
import pathlib
import sys
import time
from typing import Any, Callable

import jax

from pallas_gemm import numerics
from pallas_gemm.devices import device_info, peak_tflops
from pallas_gemm.problem import GemmProblem

from experiments.bench.cases import parse_dtypes, BASELINE_NAME, DtypeCase
from experiments.bench import fp8_targets
from experiments.bench.targets import BenchTarget, make_target
from experiments.bench.options import BenchmarkOptions
from experiments.bench.checks import (output_shape, ReferenceCheck, build_reference, input_set_count, make_input_sets, make_problem)
from experiments.bench.timers import (RotatingCall, Timing, same_program, time_on_gpu, time_on_host, time_paired_on_gpu)

_REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]


def tflops_text(value: float | None) -> str:
  """Enough digits for a GPU's hundreds and for interpret mode's 0.00x."""
  if value is None:
    return "-"
  if value >= 10:
    return f"{value:.1f}"
  if value >= 0.1:
    return f"{value:.2f}"
  return f"{value:.2g}"



# ------------------------------------------------------------ measurement ---


@dataclasses.dataclass
class Measurement:
  """One row of the results table."""

  kernel: str
  shape: str
  m: int
  n: int
  k: int
  dtype: str
  precision: str
  dtype_label: str
  out_dtype: str
  layout: str
  status: str  # OK | FAILED | SKIPPED
  reason: str = ""
  us: float | None = None
  us_min: float | None = None
  tflops: float | None = None
  pct_peak: float | None = None
  vs_jnp_dot: float | None = None
  config: str = ""
  candidates_tried: int = 0
  rel_error: float | None = None
  tolerance: float | None = None
  check: str = ""  # "full" or "sampled RxC"
  timer: str = ""
  iters: int = 0
  input_sets: int = 0
  flops: int = 0
  min_bytes: int = 0
  batch: int = 1
  regime: str = ""  # the wide suite's regime of this problem
  # Host seconds the row took: compilation, the check and the timing (the
  # first kernel of a problem also makes its inputs and float64 reference).
  # Says where a run's time budget goes.
  wall_s: float | None = None
  # Paired timing (--paired_timing, on a GPU): jnp.dot's median from the
  # samples interleaved with this row's, the ratio's numerator.
  paired_baseline_us: float | None = None
  # The row compiled to jnp.dot's very XLA program (kernel=None chose xla):
  # its ratio is 1 by construction, and `us` differs only by timing noise.
  same_program_as_baseline: bool = False


def describe_config(config) -> str:
  if config is None:
    return "-"
  if dataclasses.is_dataclass(config):
    parts = []
    for field in dataclasses.fields(config):
      value = getattr(config, field.name)
      if hasattr(value, "name") and not isinstance(value, (int, float, str)):
        value = value.name  # enums
      parts.append(f"{field.name}={value}")
    return " ".join(parts)
  return str(config)


def _short_config(text: str) -> str:
  """block_m=128 num_warps=4 -> bm=128 nw=4, for the console table."""
  def short(name):
    return "".join(part[0] for part in name.split("_") if part)
  return " ".join(
      f"{short(item.partition('=')[0])}={item.partition('=')[2]}"
      if "=" in item else item for item in text.split())


def _error_text(e: BaseException) -> str:
  first = str(e).strip().splitlines()[0] if str(e).strip() else ""
  return f"raised {type(e).__name__}: {first[:200]}"


class BenchmarkRun:
  """Runs the options' grid of measurements; `rows` holds the results."""

  def __init__(self, options: BenchmarkOptions, *, log=print):
    self.options = options
    self.log = log
    self.rows: list[Measurement] = []
    self._regime = ""
    self.device_obj = (jax.devices("cpu")[0] if options.interpret
                       else jax.devices()[0])
    self.device = device_info(self.device_obj)
    self.on_gpu = self.device.is_gpu and not options.interpret
    self.targets = [make_target(name) for name in options.kernels]
    self._deadline = (time.monotonic() + options.time_budget_s
                      if options.time_budget_s > 0 else None)
    # Hook for tests: called with (kernel, problem) right before timing.
    self.on_timing: Callable[[str, GemmProblem], None] | None = None
    # Called after every recorded row (run_benchmark saves partial results).
    self.on_row: Callable[[], Any] | None = None
    # Rows measured by an earlier run (--resume), by `_row_key`.
    self._earlier: dict[tuple, Measurement] = {}

  def carry_over(self, rows) -> None:
    """Rows of an earlier run of the same revision on the same GPU
    (--resume): a problem all of whose kernels have a measured row there is
    recorded from them instead of measured again."""
    self._earlier = {_row_key(row): row for row in rows
                     if row.status != "SKIPPED"}

  # -- bookkeeping --

  def _peak(self, case: DtypeCase):
    return peak_tflops(self.device.device_kind, case.in_dtype,
                       case.peak_precision)

  def cells(self):
    """(shape, dtype case, layout, batch, regime) of every problem: the
    suite's own problems, or the shapes crossed with dtypes and layouts."""
    if self.options.problems:
      for p in self.options.problems:
        yield p.shape, parse_dtypes([p.dtype], ("tf32",))[0], p.layout, \
            p.batch, p.regime
      return
    for shape in self.options.shapes:
      for case in self.options.dtype_cases:
        for layout in self.options.layouts:
          yield shape, case, layout, 1, ""

  def total(self) -> int:
    return sum(1 for _ in self.cells()) * len(self.targets)

  def _record(self, row: Measurement) -> None:
    self.rows.append(row)
    self.log(progress_line(row, len(self.rows), self.total()))
    sys.stdout.flush()
    if self.on_row is not None:
      self.on_row()

  # -- the grid --

  def run(self) -> list[Measurement]:
    with jax.default_device(self.device_obj):
      for shape, case, layout, batch, regime in self.cells():
        self._run_problem(shape, case, layout, batch, regime)
    return self.rows

  def _carried(self, problem: GemmProblem, case: DtypeCase) -> bool:
    """Records the problem's rows from the earlier run where every kernel
    has one; says whether it did."""
    if not self._earlier:
      return False
    keys = [_row_key(self._blank_row(t.name, problem, case))
            for t in self.targets]
    if not all(key in self._earlier for key in keys):
      return False
    for key in keys:
      self._record(self._earlier[key])
    return True

  def _blank_row(self, target_name, problem: GemmProblem,
                 case: DtypeCase) -> Measurement:
    return Measurement(
        kernel=target_name, shape=(f"{problem.batch}x" if problem.batch > 1 else "")
        + f"{problem.m}x{problem.n}x{problem.k}",
        m=problem.m, n=problem.n, k=problem.k, dtype=case.in_dtype,
        precision=case.precision, dtype_label=case.label,
        out_dtype=case.out_dtype, layout=problem.layout, status="SKIPPED",
        flops=problem.flops, min_bytes=problem.min_bytes,
        batch=problem.batch, regime=self._regime)

  def _run_problem(self, shape, case: DtypeCase, layout: str, batch: int = 1,
                   regime: str = "") -> None:
    problem = fp8_targets.with_scaling(make_problem(shape, case, layout, batch),
                                       self.options.fp8_scaling)
    self._regime = regime
    if self._carried(problem, case):
      return
    state: dict[str, Any] = {}
    baseline_us = None
    for target in self.targets:
      row = self._blank_row(target.name, problem, case)
      if self._deadline is not None and time.monotonic() > self._deadline:
        row.reason = (f"time budget of {self.options.time_budget_s:g} s "
                      "exhausted")
      else:
        reason = target.why_unsupported(problem, self.device)
        if reason is not None:
          row.reason = reason
        else:
          start = time.perf_counter()
          try:
            self._measure(target, problem, case, row, state)
          except Exception as e:  # noqa: BLE001 - one bad row must not end the run
            row.status, row.reason = "FAILED", _error_text(e)
          row.wall_s = time.perf_counter() - start
      if row.status == "OK":
        if target.name == BASELINE_NAME:
          baseline_us = row.us
        if baseline_us and row.vs_jnp_dot is None:
          row.vs_jnp_dot = baseline_us / row.us
      self._record(row)

  def _inputs(self, problem: GemmProblem, state: dict):
    if "sets" not in state:
      count = input_set_count(problem, self.on_gpu)
      state["sets"] = make_input_sets(problem, count, self.options.seed)
      a, b = state["sets"][0]
      state["reference"] = build_reference(problem, a, b, self.options.seed)
    return state["sets"], state["reference"]

  def _check(self, call: RotatingCall, problem, reference: ReferenceCheck):
    """Runs the call once; returns (rel_error, failure text or None)."""
    expected = output_shape(problem)
    if self.on_gpu:
      numerics.poison_allocator(expected, problem.out_dtype)
    try:
      out = call.first_output()
    except Exception as e:  # noqa: BLE001
      return None, _error_text(e)
    if tuple(out.shape) != expected:
      return None, (f"returned shape {tuple(out.shape)}, expected {expected}")
    return numerics.relative_error(reference.select(out), reference.reference), None

  def _time(self, target_name: str, call: RotatingCall, problem,
            iters: int) -> Timing:
    opts = self.options
    if self.on_timing:
      self.on_timing(target_name, problem)
    if self.on_gpu:
      return time_on_gpu(call, iters=iters, warmup=opts.warmup,
                         cap_s=opts.max_seconds_per_measurement)
    return time_on_host(call, iters=iters, warmup=opts.warmup,
                        cap_s=opts.max_seconds_per_measurement)

  def _time_against_baseline(self, target_name: str, call: RotatingCall,
                             problem, state: dict, row: Measurement) -> Timing:
    """Times `call`; with paired timing on a GPU, interleaved with jnp.dot's
    call of this problem, setting the row's ratio from the paired samples."""
    opts = self.options
    baseline = state.get("baseline_call")
    if target_name == BASELINE_NAME:
      timing = self._time(target_name, call, problem, opts.iters)
      state["baseline_call"], state["baseline_timing"] = call, timing
      return timing
    if baseline is None or not self.on_gpu or not opts.paired_timing:
      return self._time(target_name, call, problem, opts.iters)
    try:
      identical = same_program(baseline, call)
    except Exception:  # noqa: BLE001 - then it is timed as a different program
      identical = False
    if identical:
      # Timing the very same program again would measure only noise: the
      # row carries jnp.dot's own samples.
      row.same_program_as_baseline = True
      row.vs_jnp_dot = 1.0
      base = state["baseline_timing"]
      return Timing(base.samples_us, base.method + " (jnp.dot's, same program)")
    if self.on_timing:
      self.on_timing(target_name, problem)
    try:
      base_timing, timing = time_paired_on_gpu(
          baseline, call, iters=opts.iters, warmup=opts.warmup,
          cap_s=opts.max_seconds_per_measurement)
    except (ImportError, RuntimeError):
      # No CUPTI: time_on_gpu's host-clock fallback, unpaired.
      return self._time(target_name, call, problem, opts.iters)
    row.paired_baseline_us = base_timing.median_us
    row.vs_jnp_dot = base_timing.median_us / timing.median_us
    return timing

  def _measure(self, target: BenchTarget, problem: GemmProblem,
               case: DtypeCase, row: Measurement, state: dict) -> None:
    opts = self.options
    sets, reference = self._inputs(problem, state)
    tol = numerics.tolerance(case.in_dtype, case.precision, case.out_dtype)
    row.tolerance = tol
    row.input_sets = len(sets)
    row.check = ("full" if not reference.sampled else
                 f"sampled {len(reference.rows)}x{len(reference.cols)}")
    configs = target.candidate_configs(problem, self.device, opts.autotune,
                                       opts.max_candidates)
    row.candidates_tried = len(configs)
    passed = []  # (call, config, rel_error), each checked before any timing
    failures = []
    for config in configs:
      call = RotatingCall(target.build(problem, config), sets,
                          on_gpu=self.on_gpu)
      error, failure = self._check(call, problem, reference)
      if failure is None and not error <= tol:  # NaN and inf fail too
        failure = f"wrong result: relative error {error:.3g} > tolerance {tol:g}"
      if failure is not None:
        failures.append(f"[{describe_config(config)}] {failure}")
        if row.rel_error is None:
          row.rel_error = error
        continue
      passed.append((call, config, error))
    if not passed:
      row.status = "FAILED"
      row.reason = failures[0] + (
          f" (and {len(failures) - 1} more configs)" if len(failures) > 1 else "")
      return
    if len(passed) > 1:
      quick_iters = max(3, opts.iters // 4)
      scored = []
      for call, config, error in passed:
        try:
          quick = self._time(target.name, call, problem, quick_iters)
          scored.append((quick.median_us, call, config, error))
        except Exception as e:  # noqa: BLE001
          failures.append(f"[{describe_config(config)}] {_error_text(e)}")
      if not scored:
        row.status, row.reason = "FAILED", failures[0]
        return
      _, call, config, error = min(scored, key=lambda item: item[0])
    else:
      call, config, error = passed[0]
    timing = self._time_against_baseline(target.name, call, problem, state, row)
    row.status = "OK"
    row.rel_error = error
    row.config = describe_config(config)
    row.us = timing.median_us
    row.us_min = min(timing.samples_us)
    row.iters = len(timing.samples_us)
    row.timer = timing.method
    row.tflops = problem.flops / (row.us * 1e-6) / 1e12
    peak = self._peak(case)
    row.pct_peak = 100.0 * row.tflops / peak if peak else None
    if failures:
      row.reason = (f"{len(failures)} of {len(configs)} configs did not "
                    f"compile, raised or were wrong; first: {failures[0][:160]}")


def _row_key(row: Measurement) -> tuple:
  """What identifies a row across runs: kernel and problem."""
  return (row.kernel, row.shape, row.dtype_label, row.out_dtype, row.layout,
          row.batch, row.regime)


def progress_line(row: Measurement, index: int, total: int) -> str:
  head = (f"[{index:>{len(str(total))}}/{total}] {row.kernel:<28} {row.shape:<18} "
          f"{row.dtype_label:<13} {row.layout}  ")
  tail = f"  ({row.wall_s:.1f} s)" if row.wall_s is not None else ""
  if row.status != "OK":
    return head + f"{row.status}: {row.reason}" + tail
  extras = [f"{row.us:10.2f} us", f"{tflops_text(row.tflops):>8} TFLOP/s"]
  if row.pct_peak is not None:
    extras.append(f"{row.pct_peak:5.1f}% peak")
  if row.same_program_as_baseline:
    extras.append("same program as jnp.dot")
  elif row.vs_jnp_dot is not None:
    extras.append(f"{row.vs_jnp_dot:5.2f}x jnp.dot"
                  + (" (paired)" if row.paired_baseline_us else ""))
  extras.append(f"err {row.rel_error:.2g}")
  if row.config != "-":
    extras.append(f"[{_short_config(row.config)}]")
  return head + "OK " + "  ".join(extras) + tail
