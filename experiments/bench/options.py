"""One benchmark run's options, independent of how they were given."""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import shlex
from typing import Sequence

import jax

from experiments.bench.cases import DtypeCase, LAYOUTS

_REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------- options ---


#: Timed iterations of the op benchmarks (`bench_moe`, `bench_glu`) where
#: --iters is not given: a GPU's medians need a few samples, a CPU's
#: interpreted runs only show that the path works.
OP_BENCH_ITERS = {"gpu": 20, "cpu": 2}


def positive_int(text: str) -> int:
  value = int(text)
  if value < 1:
    raise argparse.ArgumentTypeError(f"{value} must be at least 1")
  return value


def add_iters_flag(parser: argparse.ArgumentParser) -> None:
  """The op benchmarks' --iters flag: a whole number of at least 1, or
  None for `op_bench_iters`'s default."""
  parser.add_argument(
      "--iters", type=positive_int, default=None,
      help=f"timed iterations (default {OP_BENCH_ITERS['gpu']} on a GPU, "
      f"{OP_BENCH_ITERS['cpu']} on a CPU)")


def op_bench_iters(flag: int | None, on_gpu: bool) -> int:
  """--iters as given, else OP_BENCH_ITERS for the device."""
  return flag or OP_BENCH_ITERS["gpu" if on_gpu else "cpu"]


@dataclasses.dataclass(frozen=True)
class BenchmarkOptions:
  """Everything one benchmark run needs; `from_flags` builds it from argv."""

  kernels: tuple[str, ...]
  shapes: tuple[tuple[int, int, int], ...]
  suite: str  # a suite name, or "custom" for --shapes
  dtype_cases: tuple[DtypeCase, ...]
  layouts: tuple[str, ...] = ("NN",)
  iters: int = 30
  warmup: int = 3
  output_dir: str | None = None
  plot: bool = True
  autotune: bool = False
  max_candidates: int = 4
  interpret: bool = False
  seed: int = 0
  time_budget_s: float = 0.0
  max_seconds_per_measurement: float = 5.0
  command_line: str = ""
  # A suite of whole problems (shapes.SuiteProblem), run as listed instead
  # of crossing `shapes` with `dtype_cases` and `layouts`.
  problems: tuple = ()
  # fp8 inputs: "none", "tensor", "row" (A per row, B per column) or "block"
  # (1x128 / 128x128); see experiments/bench/fp8_targets.py.
  fp8_scaling: str = "none"
  # On a GPU, time each kernel interleaved with jnp.dot (experiments/bench/
  # timers.py: time_paired_on_gpu) and take its ratio from those samples.
  paired_timing: bool = True
  # Carry over the problems measured in output_dir's results.json (same
  # git revision and GPU) and measure the rest (benchmark.py --resume).
  resume: bool = False

  def __post_init__(self):
    if not self.kernels:
      raise ValueError("kernels must name at least one kernel")
    if not self.shapes:
      raise ValueError("shapes must hold at least one (M, N, K)")
    for shape in self.shapes:
      if len(shape) != 3 or min(shape) < 1:
        raise ValueError(f"shape {shape} must be (M, N, K) with sizes >= 1")
    for layout in self.layouts:
      if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r} is not one of {LAYOUTS}")
    if self.iters < 1:
      raise ValueError(f"iters={self.iters} must be >= 1")
    if self.warmup < 0:
      raise ValueError(f"warmup={self.warmup} must be >= 0")
    from experiments.bench.fp8_targets import check_scaling  # noqa: PLC0415
    check_scaling(self.fp8_scaling)
    if self.max_candidates < 1:
      raise ValueError(f"max_candidates={self.max_candidates} must be >= 1")


def _gpu_available() -> bool:
  try:
    return bool(jax.devices("gpu"))
  except RuntimeError:
    return False


def command_line(argv: Sequence[str]) -> str:
  """The command as typed, with the script named relative to the repo so
  that results files carry no path of the machine they ran on."""
  script = pathlib.Path(argv[0]).resolve() if argv else None
  if script is not None and script.is_relative_to(_REPO_ROOT):
    first = str(script.relative_to(_REPO_ROOT))
  else:
    first = argv[0] if argv else "benchmark.py"
  return " ".join(shlex.quote(a) for a in ["python", first, *argv[1:]])


