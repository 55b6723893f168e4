"""Benchmark constants, dtype cases and shape/layout parsing."""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Sequence


from pallas_gemm import timing
from pallas_gemm import shapes as shape_suites
from pallas_gemm.problem import FP8_DTYPES


_REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]


# -------------------------------------------------------------- constants ---

LAYOUTS = ("NN", "NT", "TN", "TT")
BASELINE_NAME = "xla"
# kernel=None: the automatic choice a user's call gets.
AUTO_NAME = "auto"
HOPPER_NAME = "jax_hopper"
# The rotated input sets add up to twice L2 so that no timed call finds its
# operands still cached: the same rule as the autotuner's.
MAX_INPUT_SETS = timing.MAX_OPERAND_SETS
INPUT_SET_MEMORY_CAP = 8 * 2**30
# Above this M*N*K the float64 host reference of the full product takes
# seconds; the check then covers a strided sample of rows and columns that
# hits every 128-row and 128-column tile plus both edges.
FULL_CHECK_VOLUME = 2**31
SAMPLE_TARGET = 256
SAMPLE_EDGE = 16
# Device-to-device copy rates measured on these GPU types in this workplace
# (bytes read + written per second, TB/s): the roofline's memory roof.
KNOWN_BANDWIDTH_TBS = {"H200": 4.3, "H100": 3.0}
DTYPE_ALIASES = {"bf16": "bfloat16", "f16": "float16", "fp16": "float16",
                 "f32": "float32", "fp32": "float32"}
CPU_TIMING_NOTE = ("CPU timings are Pallas interpret mode on the host: they "
                   "check that the pipeline runs and are not meaningful as "
                   "performance numbers.")


# ------------------------------------------------------------ dtype cases ---


@dataclasses.dataclass(frozen=True)
class DtypeCase:
  """An input dtype with the precision its products are computed in."""

  in_dtype: str
  precision: str  # "ieee" | "tf32" | "default"

  @property
  def out_dtype(self) -> str:
    # fp8 products land in bfloat16, as fp8 GEMMs in LLM inference do.
    return "bfloat16" if self.in_dtype in FP8_DTYPES else self.in_dtype

  @property
  def label(self) -> str:
    if self.in_dtype == "float32":
      return f"float32/{self.precision}"
    return self.in_dtype

  @property
  def peak_precision(self) -> str:
    return "tf32" if self.precision == "tf32" else "default"


def parse_dtypes(names: Sequence[str],
                 f32_precisions: Sequence[str]) -> tuple[DtypeCase, ...]:
  """Turns --dtypes/--f32_precisions into cases; errors name the bad entry."""
  for precision in f32_precisions:
    if precision not in ("ieee", "tf32"):
      raise ValueError(
          f"--f32_precisions entry {precision!r} must be 'ieee' or 'tf32'")
  cases: list[DtypeCase] = []
  for raw in names:
    name = DTYPE_ALIASES.get(raw.strip().lower(), raw.strip().lower())
    if name == "float32":
      new = [DtypeCase("float32", p) for p in f32_precisions]
    elif name == "tf32":
      new = [DtypeCase("float32", "tf32")]
    elif name in ("bfloat16", "float16") + FP8_DTYPES:
      new = [DtypeCase(name, "default")]
    else:
      raise ValueError(
          f"--dtypes entry {raw!r} is not one of bfloat16, float16, float32, "
          f"tf32, {', '.join(FP8_DTYPES)}")
    cases.extend(c for c in new if c not in cases)
  if not cases:
    raise ValueError("--dtypes selects no dtype")
  return tuple(cases)


def parse_layouts(names: Sequence[str]) -> tuple[str, ...]:
  layouts = []
  for raw in names:
    layout = raw.strip().upper()
    if layout not in LAYOUTS:
      raise ValueError(f"--layouts entry {raw!r} is not one of {LAYOUTS}")
    if layout not in layouts:
      layouts.append(layout)
  if not layouts:
    raise ValueError("--layouts selects no layout")
  return tuple(layouts)


def parse_shape_list(entries: Sequence[str]) -> tuple[tuple[int, int, int], ...]:
  """Shapes from --shapes entries; the error names the bad entry."""
  shapes = []
  for entry in entries:
    try:
      shapes.extend(shape_suites.parse_shapes(entry))
    except ValueError as e:
      raise ValueError(f"--shapes: {e}") from None
  if not shapes:
    raise ValueError("--shapes is empty")
  return tuple(shapes)


def suite_shapes(suite: str) -> tuple[tuple[int, int, int], ...]:
  try:
    return tuple(shape_suites.SUITES[suite])
  except KeyError:
    raise ValueError(
        f"--suite={suite!r} is not one of {sorted(shape_suites.SUITES)}"
    ) from None
