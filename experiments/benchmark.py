"""The benchmark: every kernel against jnp.dot, checked before it is timed.

    python experiments/benchmark.py                    # on a CPU: interpret mode, `cpu` suite
    python experiments/benchmark.py --suite=large --dtypes=bfloat16
    python experiments/benchmark.py --kernels='triton/*,jax_hopper' \\
        --shapes=4096x4096x4096,8192x8192x1024 --layouts=NN,NT
    python experiments/benchmark.py --suite=ladder     # the optimisation ladder tables
    python experiments/benchmark.py --helpfull         # every flag

For every (kernel, shape, dtype, layout):

  1. SKIPPED when the kernel cannot run the problem, with the kernel's own
     reason (`registry.why_unsupported`);
  2. the kernel runs once on fresh standard-normal inputs and its output is
     compared with a float64 NumPy reference (`pallas_gemm.numerics`); a
     result outside the dtype's tolerance, or an exception, is FAILED and is
     never timed;
  3. otherwise it is timed. On a GPU: CUPTI kernel time
     (`jax.experimental.mosaic.gpu.profiler.measure`), median of --iters
     after --warmup, with the inputs rotated over enough sets to exceed twice
     the L2 cache, so that a repeated call does not find its operands there.
     On a CPU the kernels run in Pallas interpret mode and are timed with a
     host clock: those numbers say nothing about GPU speed.

`jnp.dot` (kernel name `xla`) always runs too, in the same process and at
the same precision, as the baseline of the "x jnp.dot" column: float32 with
precision "ieee" against `precision=HIGHEST`, "tf32" against the default.

Outputs, in --output_dir: results.csv, results.json (rows plus metadata:
device, driver, versions, git sha, date, input distribution, command line),
results.md (the full table), summary.md (TFLOP/s pivot, spliced into the
README by experiments/update_readme.py), tflops.png, roofline.png (decode
suite) and ladder.md (ladder suite).
"""

from __future__ import annotations

import csv
import dataclasses
import datetime
import fnmatch
import functools
import json
import os
import pathlib
import re
import shlex
import signal
import statistics
import subprocess
import sys
import time
import warnings
from typing import Any, Callable, Sequence

_REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
if __package__ in (None, ""):
  # Run as a script: make `experiments` and `pallas_gemm` importable from the
  # checkout without installing it (the GPU machine runs it this way).
  sys.path.insert(0, str(_REPO_ROOT))

warnings.filterwarnings("ignore", category=DeprecationWarning,
                        message=".*[Tt]riton.*")

from absl import app, flags  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import pallas_gemm  # noqa: E402
from pallas_gemm import autotune, numerics, registry, timing  # noqa: E402
from pallas_gemm.devices import DeviceInfo, device_info, peak_tflops  # noqa: E402
from pallas_gemm.problem import FP8_DTYPES, GemmProblem, cdiv  # noqa: E402

from experiments import shapes as shape_suites  # noqa: E402

# ------------------------------------------------------------------ flags ---

FLAGS = flags.FLAGS

flags.DEFINE_list(
    "kernels", ["all"],
    "Kernels to run: registered names or globs over pallas_gemm.list_kernels() "
    "(e.g. 'triton/*'), the baselines 'xla' (jnp.dot) and 'jax_hopper' "
    "(JAX's hopper_matmul_mgpu, Hopper only), or 'all'. jnp.dot always runs "
    "as the baseline of the 'x jnp.dot' column.")
flags.DEFINE_list(
    "skip_kernels", [],
    "Globs of kernels to leave out of --kernels (e.g. 'triton/0[1-4]*' to "
    "drop the early ladder rungs from a large suite); a glob that matches "
    "nothing is not an error. jnp.dot is never left out.")
flags.DEFINE_list(
    "dtypes", None,
    "Input dtypes: bfloat16, float16, float32 (once per --f32_precisions), "
    "tf32 (float32 inputs, TF32 products only), float8_e4m3fn, float8_e5m2. "
    "Default: bfloat16 on a GPU (bfloat16,float32 for the ladder), float32 "
    "on a CPU.")
flags.DEFINE_list(
    "f32_precisions", ["ieee", "tf32"],
    "For float32 inputs: 'ieee' (exact products, compared with "
    "jnp.dot(precision=HIGHEST)) and/or 'tf32' (compared with jnp.dot at "
    "default precision).")
flags.DEFINE_string(
    "suite", None,
    "A shape suite from experiments/shapes.py: "
    + ", ".join(sorted(shape_suites.SUITES))
    + ". 'ladder' also prints and writes the optimisation ladder. Default: "
    "'cpu' in interpret mode, 'large' on a GPU.")
flags.DEFINE_list(
    "shapes", None,
    "Explicit shapes MxNxK (out[M,N] = A[M,K] @ B[K,N]), comma-separated; "
    "they replace the suite's shapes (a --suite given too then only names "
    "the run, e.g. --suite=ladder --shapes=4096x4096x4096).")
flags.DEFINE_list(
    "layouts", ["NN"],
    "Operand layouts, BLAS-style: NN, NT, TN, TT (T = the operand is stored "
    "transposed and read as stored).")
flags.DEFINE_integer(
    "iters", None,
    "Timed iterations; the median is reported. Default 30 on a GPU, 5 in "
    "interpret mode.", lower_bound=1)
flags.DEFINE_integer(
    "warmup", None,
    "Untimed calls before timing (the first also compiles). Default 3 on a "
    "GPU, 1 in interpret mode.", lower_bound=0)
flags.DEFINE_string(
    "output_dir", None,
    "Where results go. Default: experiments/results/<gpu>/<suite> on a GPU, "
    "build/bench/<suite> in interpret mode.")
flags.DEFINE_bool("plot", True, "Write PNG plots (matplotlib).")
flags.DEFINE_bool(
    "autotune", False,
    "Try several configs per kernel (up to --max_candidates, each checked "
    "before it is timed) and report the fastest.")
flags.DEFINE_integer(
    "max_candidates", 4,
    "Most configs tried per kernel and shape by --autotune and by the "
    "jax_hopper sweep.", lower_bound=1)
flags.DEFINE_bool(
    "interpret", None,
    "Run on the host CPU in Pallas interpret mode. Default: on when JAX has "
    "no GPU.")
flags.DEFINE_integer("seed", 0, "Seed for the random inputs.")
flags.DEFINE_bool(
    "strict", False,
    "Exit with status 1 when any measurement FAILED (for CI); by default "
    "failures are reported in the table and the exit status is 0.")
flags.DEFINE_float(
    "time_budget_s", 0.0,
    "Stop starting new measurements after this many seconds (0: no limit); "
    "the rest are reported SKIPPED.", lower_bound=0.0)
flags.DEFINE_float(
    "max_seconds_per_measurement", 5.0,
    "Fewer timed iterations (at least 3) for a kernel so slow that --iters "
    "would take longer than this.", lower_bound=0.0)

# -------------------------------------------------------------- constants ---

LAYOUTS = ("NN", "NT", "TN", "TT")
BASELINE_NAME = "xla"
HOPPER_NAME = "jax_hopper"
# The rotated input sets add up to twice L2 so that no timed call finds its
# operands still cached: the same rule as the autotuner's.
MAX_INPUT_SETS = timing.MAX_OPERAND_SETS
INPUT_SET_MEMORY_CAP = 8 * 2**30
# CUPTI's measure keeps every iteration's outputs alive until it syncs.
OUTPUTS_IN_FLIGHT_CAP = 4 * 2**30
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


# ---------------------------------------------------------------- targets ---


@dataclasses.dataclass(frozen=True)
class BenchTarget:
  """Something the benchmark can run: a registered kernel or a baseline.

  `build(problem, config)` returns a function of the stored operands (a, b)
  that computes op(a) @ op(b) in `problem.out_dtype`.
  """

  name: str
  why_unsupported: Callable[[GemmProblem, DeviceInfo], "str | None"]
  candidate_configs: Callable[[GemmProblem, DeviceInfo, bool, int], list]
  build: Callable[[GemmProblem, Any], Callable]


def _precision_arg(problem: GemmProblem):
  if problem.precision == "ieee":
    return jax.lax.Precision.HIGHEST
  return jax.lax.Precision.DEFAULT


def _dot_dimension_numbers(problem: GemmProblem):
  contract_a = 0 if problem.transpose_a else 1
  contract_b = 1 if problem.transpose_b else 0
  return ((contract_a,), (contract_b,)), ((), ())


def _build_jnp_dot(problem: GemmProblem, config):
  del config
  dims = _dot_dimension_numbers(problem)
  out_dtype = jnp.dtype(problem.out_dtype)
  precision = _precision_arg(problem)
  # jnp.dot on 16-bit inputs returns 16-bit outputs from an f32 accumulator;
  # only fp8 needs an explicit output type.
  preferred = out_dtype if problem.in_dtype in FP8_DTYPES else None

  def jnp_dot(a, b):
    # dot_general puts A's free dimension first whatever the layout.
    out = jax.lax.dot_general(a, b, dims, precision=precision,
                              preferred_element_type=preferred)
    return out.astype(out_dtype)
  return jnp_dot


def baseline_target() -> BenchTarget:
  return BenchTarget(
      name=BASELINE_NAME,
      why_unsupported=lambda problem, device: None,
      candidate_configs=lambda problem, device, autotune, limit: [None],
      build=_build_jnp_dot)


def _triton_variants(problem: GemmProblem, default):
  """A few tile shapes around the default for --autotune on Triton rungs."""
  from pallas_gemm.triton_backend import common  # noqa: PLC0415
  wide_k = 64 if problem.in_dtype in ("bfloat16", "float16") else 32
  variants = [
      dataclasses.replace(default, block_m=128, block_n=128, block_k=wide_k,
                          num_warps=8, num_stages=max(default.num_stages, 3)),
      dataclasses.replace(default, block_m=128, block_n=64, block_k=wide_k,
                          num_warps=4, num_stages=max(default.num_stages, 3)),
      dataclasses.replace(default, block_m=64, block_n=128, block_k=wide_k,
                          num_warps=4, num_stages=max(default.num_stages, 4)),
  ]
  return [common.small_problem_config(problem, v) for v in variants]


def _spread(items: list, count: int) -> list:
  """`count` items evenly spaced through `items` (all when fewer)."""
  if len(items) <= count:
    return list(items)
  step = len(items) / count
  return [items[int(i * step)] for i in range(count)]


def _registered_candidates(entry: registry.KernelEntry, problem, device,
                           autotune: bool, limit: int) -> list:
  default = entry.default_config(problem, device)
  if not autotune or entry.config_cls is None:
    return [default]
  space = None
  try:
    from pallas_gemm import autotune as tuner  # noqa: PLC0415
    space = [c for c in tuner.search_space(problem, entry.name, device)
             if tuner.fits_device(c, problem, device)]
  except (ImportError, ValueError, AttributeError):
    pass  # no search space registered for this kernel
  if space is None and type(default).__name__ == "TritonConfig":
    space = _triton_variants(problem, default)
  space = [c for c in space or [] if c != default]
  return [default] + _spread(space, limit - 1)


def registered_target(name: str) -> BenchTarget:
  entry = registry.get_kernel(name)

  def why_unsupported(problem, device):
    reason = registry.why_unsupported(entry, problem, device)
    if reason is None and device.platform == "cpu" and (
        problem.flops > registry.CPU_INTERPRET_FLOP_BUDGET):
      reason = (f"interpret mode on a CPU: {problem.flops:.3g} flops is past "
                f"the {registry.CPU_INTERPRET_FLOP_BUDGET:.3g} budget")
    return reason

  def build(problem: GemmProblem, config):
    precision = _precision_arg(problem) if problem.in_dtype == "float32" else None

    def call(a, b):
      return pallas_gemm.matmul(
          a, b, kernel=name, config=config, precision=precision,
          preferred_element_type=problem.out_dtype,
          transpose_a=problem.transpose_a, transpose_b=problem.transpose_b)
    return call

  return BenchTarget(
      name=name, why_unsupported=why_unsupported,
      candidate_configs=functools.partial(_registered_candidates, entry),
      build=build)


# JAX's own Hopper kernel: a small sweep of its TuningConfig, best kept.
# (tile_m, tile_n, warpgroups split along, grid_minor_dim, grid_tile_width)
_HOPPER_SWEEP = (
    (128, 128, "N", "N", 8),   # CTA tile 128 x 256
    (128, 128, "M", "M", 8),   # CTA tile 256 x 128
    (128, 64, "N", "N", 4),    # CTA tile 128 x 128
    (64, 128, "N", "N", 4),    # CTA tile 64 x 256: M = 64 decode batches
)
_HOPPER_TILE_K = 64
_HOPPER_STAGES = 4


def _hopper_module():
  from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu  # noqa: PLC0415
  return hopper_matmul_mgpu


def _hopper_configs(problem: GemmProblem) -> list:
  module = _hopper_module()
  dim = module.MatmulDimension
  configs = []
  for tile_m, tile_n, wg, minor, width in _HOPPER_SWEEP:
    cta_m = tile_m * (2 if wg == "M" else 1)
    cta_n = tile_n * (2 if wg == "N" else 1)
    if problem.m % cta_m or problem.n % cta_n or problem.k % _HOPPER_TILE_K:
      continue
    configs.append(module.TuningConfig(
        tile_m=tile_m, tile_n=tile_n, tile_k=_HOPPER_TILE_K,
        max_concurrent_steps=_HOPPER_STAGES, wg_dimension=dim[wg],
        grid_minor_dim=dim[minor], grid_tile_width=width))
  return configs


def hopper_target() -> BenchTarget:
  def why_unsupported(problem: GemmProblem, device: DeviceInfo):
    if not device.is_hopper:
      return "JAX's hopper_matmul_mgpu needs a Hopper (sm_90) GPU"
    if problem.in_dtype not in ("bfloat16", "float16"):
      return "hopper_matmul_mgpu takes bfloat16 or float16 inputs only"
    if problem.layout != "NN":
      return "hopper_matmul_mgpu reads A as (M, K) and B as (K, N): layout NN only"
    try:
      configs = _hopper_configs(problem)
    except ImportError as e:
      return f"hopper_matmul_mgpu does not import: {e}"
    if not configs:
      return (f"hopper_matmul_mgpu needs tile-divisible shapes: no swept tile "
              f"divides M={problem.m}, N={problem.n}, K={problem.k} "
              f"(K must be a multiple of {_HOPPER_TILE_K})")
    return None

  def candidates(problem, device, autotune, limit):
    del device, autotune  # the sweep is this baseline's own tuning
    return _hopper_configs(problem)[:limit]

  def build(problem, config):
    module = _hopper_module()
    return lambda a, b: module.matmul(a, b, None, config)

  return BenchTarget(name=HOPPER_NAME, why_unsupported=why_unsupported,
                     candidate_configs=candidates, build=build)


def resolve_kernels(patterns: Sequence[str],
                    skip: Sequence[str] = ()) -> tuple[str, ...]:
  """Expands names and globs, less those matching a `skip` glob; jnp.dot
  comes first, always."""
  registered = [n for n in pallas_gemm.list_kernels() if n != BASELINE_NAME]
  universe = registered + [HOPPER_NAME]
  chosen: list[str] = [BASELINE_NAME]
  for raw in patterns:
    pattern = raw.strip()
    if not pattern:
      continue
    if pattern == "all":
      matches = universe
    elif pattern == BASELINE_NAME:
      matches = []
    else:
      matches = [n for n in universe if fnmatch.fnmatchcase(n, pattern)]
      if not matches:
        raise ValueError(
            f"--kernels entry {pattern!r} matches no kernel; registered: "
            f"{registered}, baselines: {[BASELINE_NAME, HOPPER_NAME]}")
    chosen.extend(m for m in matches if m not in chosen)
  skip = [g.strip() for g in skip if g.strip()]
  return tuple(n for n in chosen if n == BASELINE_NAME
               or not any(fnmatch.fnmatchcase(n, g) for g in skip))


def make_target(name: str) -> BenchTarget:
  if name == BASELINE_NAME:
    return baseline_target()
  if name == HOPPER_NAME:
    return hopper_target()
  return registered_target(name)


# ---------------------------------------------------------------- options ---


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


def options_from_flags(argv: Sequence[str]) -> BenchmarkOptions:
  del argv  # absl leaves only positional arguments there; there are none
  interpret = FLAGS.interpret
  if interpret is None:
    interpret = not _gpu_available()
  if FLAGS.shapes:
    # --suite then only names the run (and turns on ladder mode).
    shapes, suite = parse_shape_list(FLAGS.shapes), FLAGS.suite or "custom"
    if suite != "custom":
      suite_shapes(suite)  # an unknown name is still an error
  else:
    suite = FLAGS.suite or ("cpu" if interpret else "large")
    shapes = suite_shapes(suite)
  if FLAGS.dtypes:
    dtype_names = FLAGS.dtypes
  elif interpret:
    dtype_names = ["float32"]
  elif suite == "ladder":
    dtype_names = ["bfloat16", "float32"]
  else:
    dtype_names = ["bfloat16"]
  return BenchmarkOptions(
      kernels=resolve_kernels(FLAGS.kernels, FLAGS.skip_kernels),
      shapes=shapes,
      suite=suite,
      dtype_cases=parse_dtypes(dtype_names, FLAGS.f32_precisions),
      layouts=parse_layouts(FLAGS.layouts),
      iters=FLAGS.iters if FLAGS.iters is not None else (5 if interpret else 30),
      warmup=FLAGS.warmup if FLAGS.warmup is not None else (1 if interpret else 3),
      output_dir=FLAGS.output_dir,
      plot=FLAGS.plot,
      autotune=FLAGS.autotune,
      max_candidates=FLAGS.max_candidates,
      interpret=interpret,
      seed=FLAGS.seed,
      time_budget_s=FLAGS.time_budget_s,
      max_seconds_per_measurement=FLAGS.max_seconds_per_measurement,
      command_line=command_line(sys.argv),
  )


# ----------------------------------------------------------------- inputs ---


def make_problem(shape, case: DtypeCase, layout: str) -> GemmProblem:
  m, n, k = shape
  return GemmProblem(batch=1, m=m, n=n, k=k, in_dtype=case.in_dtype,
                     out_dtype=case.out_dtype, transpose_a=layout[0] == "T",
                     transpose_b=layout[1] == "T", precision=case.precision)


def _operand_shapes(problem: GemmProblem):
  a_shape = (problem.k, problem.m) if problem.transpose_a else (problem.m, problem.k)
  b_shape = (problem.n, problem.k) if problem.transpose_b else (problem.k, problem.n)
  return a_shape, b_shape


def _itemsize(dtype: str) -> int:
  return jnp.dtype(dtype).itemsize


def input_set_count(problem: GemmProblem, on_gpu: bool) -> int:
  """How many (a, b) pairs to rotate through while timing."""
  if not on_gpu:
    return 2  # rotation is exercised; L2 effects do not matter on a host
  set_bytes = (problem.m + problem.n) * problem.k * _itemsize(problem.in_dtype)
  wanted = timing.operand_set_count(problem, on_gpu=True)
  cap = INPUT_SET_MEMORY_CAP
  try:
    limit = jax.devices()[0].memory_stats().get("bytes_limit")
    if limit:
      cap = min(cap, limit // 5)
  except Exception:  # noqa: BLE001 - memory_stats is optional per backend
    pass
  return max(1, min(wanted, cap // max(set_bytes, 1)))


def make_input_sets(problem: GemmProblem, count: int, seed: int):
  a_shape, b_shape = _operand_shapes(problem)
  sets = []
  for _ in range(count):
    key_a, key_b = jax.random.split(numerics.fresh_key(seed))
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

  @property
  def sampled(self) -> bool:
    return self.rows is not None

  def select(self, out) -> np.ndarray:
    if self.rows is None:
      return np.asarray(out.astype(jnp.float32))
    picked = jnp.take(jnp.take(out, self.rows, axis=0), self.cols, axis=1)
    return np.asarray(picked.astype(jnp.float32))


def build_reference(problem: GemmProblem, a, b, seed: int) -> ReferenceCheck:
  if problem.m * problem.n * problem.k <= FULL_CHECK_VOLUME:
    ref = numerics.reference_matmul(a, b, transpose_a=problem.transpose_a,
                                    transpose_b=problem.transpose_b)
    return ReferenceCheck(ref, None, None)
  rng = np.random.default_rng(seed)
  rows = _sample_indices(problem.m, rng)
  cols = _sample_indices(problem.n, rng)
  a_rows = jnp.take(a, rows, axis=1).T if problem.transpose_a else jnp.take(a, rows, axis=0)
  b_cols = jnp.take(b, cols, axis=0).T if problem.transpose_b else jnp.take(b, cols, axis=1)
  return ReferenceCheck(numerics.reference_matmul(a_rows, b_cols), rows, cols)


# ----------------------------------------------------------------- timing ---


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
  function, so consecutive calls read different operands and never find them
  in L2; its first output is what the check looks at, so the function that
  is checked is the very one that is timed, and it compiles once. On a CPU a
  single-set function is jitted and the Python loop rotates the sets.
  """

  def __init__(self, fn: Callable, sets, *, on_gpu: bool):
    self.sets = sets
    self.on_gpu = on_gpu
    if on_gpu:
      count = len(sets)

      def every_set(*flat):
        return tuple(fn(flat[2 * i], flat[2 * i + 1]) for i in range(count))

      self.compiled = jax.jit(every_set)
      self.flat = [x for pair in sets for x in pair]
    else:
      self.compiled = jax.jit(fn)

  def first_output(self):
    """The kernel's output on input set 0."""
    if self.on_gpu:
      return jax.block_until_ready(self.compiled(*self.flat))[0]
    return jax.block_until_ready(self.compiled(*self.sets[0]))


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
    jax.block_until_ready(call.compiled(*call.flat))
  start = time.perf_counter()
  jax.block_until_ready(call.compiled(*call.flat))
  iters = _effective_iters(time.perf_counter() - start, iters, cap_s)
  chunk = max(1, min(iters, OUTPUTS_IN_FLIGHT_CAP // max(1, count * out_bytes)))
  try:
    samples: list[float] = []
    remaining = iters
    while remaining > 0:
      step = min(chunk, remaining)
      _, per_iteration_ms = timing.cupti_samples_ms(
          call.compiled, call.flat, iterations=step, warmup=0)
      samples.extend(ms * 1e3 / count for ms in per_iteration_ms)
      remaining -= step
    return Timing(tuple(samples), "cupti")
  except (ImportError, RuntimeError) as e:
    reason = str(e).splitlines()[0][:80] if str(e) else type(e).__name__
    samples = []
    for _ in range(iters):
      start = time.perf_counter()
      jax.block_until_ready(call.compiled(*call.flat))
      samples.append((time.perf_counter() - start) * 1e6 / count)
    return Timing(tuple(samples), f"host-clock (no CUPTI: {reason})")


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

  # -- bookkeeping --

  def _peak(self, case: DtypeCase):
    return peak_tflops(self.device.device_kind, case.in_dtype,
                       case.peak_precision)

  def total(self) -> int:
    return (len(self.options.shapes) * len(self.options.dtype_cases)
            * len(self.options.layouts) * len(self.targets))

  def _record(self, row: Measurement) -> None:
    self.rows.append(row)
    self.log(progress_line(row, len(self.rows), self.total()))
    sys.stdout.flush()
    if self.on_row is not None:
      self.on_row()

  # -- the grid --

  def run(self) -> list[Measurement]:
    with jax.default_device(self.device_obj):
      for shape in self.options.shapes:
        for case in self.options.dtype_cases:
          for layout in self.options.layouts:
            self._run_problem(shape, case, layout)
    return self.rows

  def _blank_row(self, target_name, problem: GemmProblem,
                 case: DtypeCase) -> Measurement:
    return Measurement(
        kernel=target_name, shape=f"{problem.m}x{problem.n}x{problem.k}",
        m=problem.m, n=problem.n, k=problem.k, dtype=case.in_dtype,
        precision=case.precision, dtype_label=case.label,
        out_dtype=case.out_dtype, layout=problem.layout, status="SKIPPED",
        flops=problem.flops, min_bytes=problem.min_bytes)

  def _run_problem(self, shape, case: DtypeCase, layout: str) -> None:
    problem = make_problem(shape, case, layout)
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
          try:
            self._measure(target, problem, case, row, state)
          except Exception as e:  # noqa: BLE001 - one bad row must not end the run
            row.status, row.reason = "FAILED", _error_text(e)
      if row.status == "OK":
        if target.name == BASELINE_NAME:
          baseline_us = row.us
        if baseline_us:
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
    if self.on_gpu:
      numerics.poison_allocator((problem.m, problem.n), problem.out_dtype)
    try:
      out = call.first_output()
    except Exception as e:  # noqa: BLE001
      return None, _error_text(e)
    if tuple(out.shape) != (problem.m, problem.n):
      return None, (f"returned shape {tuple(out.shape)}, expected "
                    f"{(problem.m, problem.n)}")
    return numerics.relative_error(reference.select(out), reference.reference), None

  def _time(self, target_name: str, call: RotatingCall, problem,
            iters: int) -> Timing:
    opts = self.options
    if self.on_timing:
      self.on_timing(target_name, problem)
    if self.on_gpu:
      out_bytes = problem.m * problem.n * _itemsize(problem.out_dtype)
      return time_on_gpu(call, out_bytes=out_bytes, iters=iters,
                         warmup=opts.warmup,
                         cap_s=opts.max_seconds_per_measurement)
    return time_on_host(call, iters=iters, warmup=opts.warmup,
                        cap_s=opts.max_seconds_per_measurement)

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
    timing = self._time(target.name, call, problem, opts.iters)
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


def progress_line(row: Measurement, index: int, total: int) -> str:
  head = (f"[{index:>{len(str(total))}}/{total}] {row.kernel:<28} {row.shape:<18} "
          f"{row.dtype_label:<13} {row.layout}  ")
  if row.status != "OK":
    return head + f"{row.status}: {row.reason}"
  extras = [f"{row.us:10.2f} us", f"{tflops_text(row.tflops):>8} TFLOP/s"]
  if row.pct_peak is not None:
    extras.append(f"{row.pct_peak:5.1f}% peak")
  if row.vs_jnp_dot is not None:
    extras.append(f"{row.vs_jnp_dot:5.2f}x jnp.dot")
  extras.append(f"err {row.rel_error:.2g}")
  if row.config != "-":
    extras.append(f"[{_short_config(row.config)}]")
  return head + "OK " + "  ".join(extras)


# ---------------------------------------------------------------- reports ---

TABLE_COLUMNS = ("kernel", "shape", "dtype", "layout", "us", "TFLOP/s",
                 "% peak", "x jnp.dot", "config")


def _fmt(value, spec: str) -> str:
  return "-" if value is None else format(value, spec)


def tflops_text(value: float | None) -> str:
  """Enough digits for a GPU's hundreds and for interpret mode's 0.00x."""
  if value is None:
    return "-"
  if value >= 10:
    return f"{value:.1f}"
  if value >= 0.1:
    return f"{value:.2f}"
  return f"{value:.2g}"


def table_cells(row: Measurement) -> list[str]:
  if row.status != "OK":
    return [row.kernel, row.shape, row.dtype_label, row.layout, row.status,
            "-", "-", "-", row.reason]
  return [row.kernel, row.shape, row.dtype_label, row.layout,
          _fmt(row.us, ".1f"), tflops_text(row.tflops),
          _fmt(row.pct_peak, ".1f"), _fmt(row.vs_jnp_dot, ".2f"),
          _short_config(row.config)]


def format_text_table(header: Sequence[str], body: Sequence[Sequence[str]]) -> str:
  widths = [max(len(str(x)) for x in column) for column in zip(header, *body)]
  def line(cells):
    return "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()
  return "\n".join([line(header), line(["-" * w for w in widths])]
                   + [line(r) for r in body])


def format_markdown_table(header: Sequence[str],
                          body: Sequence[Sequence[str]]) -> str:
  def escape(cell):
    return str(cell).replace("|", "\\|")
  lines = ["| " + " | ".join(escape(h) for h in header) + " |",
           "|" + "|".join("---" for _ in header) + "|"]
  lines += ["| " + " | ".join(escape(c) for c in r) + " |" for r in body]
  return "\n".join(lines)


def final_table(rows: Sequence[Measurement]) -> str:
  """The measured and failed rows; skipped ones are summarised once each."""
  shown = [table_cells(r) for r in rows if r.status != "SKIPPED"]
  text = format_text_table(TABLE_COLUMNS, shown) if shown else "(nothing ran)"
  skipped: dict[tuple[str, str], int] = {}
  for row in rows:
    if row.status == "SKIPPED":
      skipped[(row.kernel, row.reason)] = skipped.get((row.kernel, row.reason), 0) + 1
  if skipped:
    text += "\n\nSKIPPED:\n" + "\n".join(
        f"  {kernel} ({count}x): {reason}"
        for (kernel, reason), count in sorted(skipped.items()))
  return text


def summary_markdown(rows: Sequence[Measurement], device_kind: str) -> str:
  """TFLOP/s per shape (rows) and kernel (columns), per dtype and layout."""
  sections = []
  groups: dict[tuple[str, str], list[Measurement]] = {}
  for row in rows:
    groups.setdefault((row.dtype_label, row.layout), []).append(row)
  for (label, layout), group in groups.items():
    kernels = []
    for row in group:
      if row.status == "OK" and row.kernel not in kernels:
        kernels.append(row.kernel)
    if not kernels:
      continue
    shapes = []
    for row in group:
      if row.shape not in shapes:
        shapes.append(row.shape)
    cells = {(r.shape, r.kernel): r for r in group}
    body = []
    for shape in shapes:
      line = [shape]
      best = max((cells[(shape, k)].tflops or 0) for k in kernels
                 if (shape, k) in cells)
      for kernel in kernels:
        row = cells.get((shape, kernel))
        if row is None or row.status != "OK":
          line.append("—" if row is None or row.status == "SKIPPED" else "FAIL")
          continue
        text = tflops_text(row.tflops)
        line.append(f"**{text}**" if row.tflops == best else text)
      body.append(line)
    header = ["M×N×K"] + ["jnp.dot" if k == BASELINE_NAME else k for k in kernels]
    sections.append(f"TFLOP/s, {label}, layout {layout}, {device_kind} "
                    "(best per shape in bold; — unsupported, FAIL wrong result):\n\n"
                    + format_markdown_table(header, body))
  return "\n\n".join(sections) + "\n"


# ----------------------------------------------------------------- ladder ---

_RUNG_NUMBER = re.compile(r"(\d+)")


def ladder_group(kernel: str) -> str:
  """The ladder a kernel belongs to: its backend ("triton", "ffi", "mosaic").

  A backend's float32 and 16-bit rungs (ffi's sgemm_NN and mma_sync) land in
  different tables anyway, because each table is for one dtype.
  """
  return kernel.partition("/")[0]


def _rung_key(kernel: str):
  rest = kernel.partition("/")[2]
  number = _RUNG_NUMBER.search(rest)
  return (int(number.group(1)) if number else 10**6, kernel)


_GROUP_ORDER = ("triton", "ffi", "mosaic")


def ladder_markdown(rows: Sequence[Measurement], device_kind: str) -> str:
  """For each backend's ladder, shape and dtype: each rung's TFLOP/s, % of
  peak and gain over the previous rung that ran."""
  measured = [r for r in rows if r.kernel not in (BASELINE_NAME, HOPPER_NAME)]
  groups = sorted({ladder_group(r.kernel) for r in measured},
                  key=lambda g: (_GROUP_ORDER.index(g) if g in _GROUP_ORDER
                                 else len(_GROUP_ORDER), g))
  baselines = {(r.shape, r.dtype_label, r.layout): r for r in rows
               if r.kernel == BASELINE_NAME and r.status == "OK"}
  hopper = {(r.shape, r.dtype_label, r.layout): r for r in rows
            if r.kernel == HOPPER_NAME and r.status == "OK"}
  sections = []
  for group in groups:
    members = [r for r in measured if ladder_group(r.kernel) == group]
    keys = []
    for row in members:
      key = (row.shape, row.dtype_label, row.layout)
      if key not in keys:
        keys.append(key)
    for key in keys:
      rungs = sorted((r for r in members
                      if (r.shape, r.dtype_label, r.layout) == key),
                     key=lambda r: _rung_key(r.kernel))
      if not any(r.status == "OK" for r in rungs):
        continue  # e.g. an fp32-only ladder at bfloat16
      body, previous = [], None
      for row in rungs:
        if row.status == "SKIPPED":
          continue
        if row.status != "OK":
          body.append([row.kernel, "FAILED", "-", "-", row.reason[:80]])
          continue
        gain = "-" if previous is None else f"{row.tflops / previous:.2f}x"
        body.append([row.kernel, tflops_text(row.tflops), _fmt(row.pct_peak, ".1f"),
                     gain, _short_config(row.config)])
        previous = row.tflops
      for label, reference in (("jnp.dot (reference)", baselines.get(key)),
                               ("JAX hopper_matmul_mgpu (reference)",
                                hopper.get(key))):
        if reference is not None:
          body.append([label, tflops_text(reference.tflops),
                       _fmt(reference.pct_peak, ".1f"), "-",
                       _short_config(reference.config)])
      title = (f"**{group}** — {key[0]}, {key[1]}, {key[2]}, {device_kind}")
      sections.append(title + "\n\n" + format_markdown_table(
          ["rung", "TFLOP/s", "% peak", "gain vs previous rung", "config"], body))
  if not sections:
    return "(no ladder rung ran)\n"
  return "\n\n".join(sections) + "\n"


# --------------------------------------------------------------- metadata ---


def _run_quiet(argv, cwd=None) -> str | None:
  try:
    done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True,
                          timeout=20, check=False)
  except (OSError, subprocess.SubprocessError):
    return None
  return done.stdout.strip() if done.returncode == 0 else None


def git_revision() -> str:
  # A copy of the tree shipped to a GPU machine gets the revision from
  # whoever shipped it: its .git, if it has one, may be a stale snapshot.
  shipped = os.environ.get("PALLAS_GEMM_GIT_SHA")
  if shipped:
    return shipped
  sha = _run_quiet(["git", "rev-parse", "--short=12", "HEAD"], cwd=_REPO_ROOT)
  if not sha:
    return "n/a"
  dirty = _run_quiet(["git", "status", "--porcelain", "--untracked-files=no"],
                     cwd=_REPO_ROOT)
  return sha + ("-dirty" if dirty else "")


def driver_version() -> str:
  out = _run_quiet(["nvidia-smi", "--query-gpu=driver_version",
                    "--format=csv,noheader"])
  return out.splitlines()[0].strip() if out else "n/a"


def collect_metadata(run: BenchmarkRun) -> dict:
  import jaxlib  # noqa: PLC0415
  opts = run.options
  return {
      "device": run.device.device_kind,
      "device_key": run.device.key,
      "platform": "cpu (interpret mode)" if not run.on_gpu else run.device.platform,
      "compute_capability": run.device.compute_capability,
      "num_sms": run.device.num_sms,
      "driver_version": driver_version(),
      "jax_version": jax.__version__,
      "jaxlib_version": getattr(jaxlib, "__version__", None)
      or jaxlib.version.__version__,
      "pallas_gemm_version": pallas_gemm.__version__,
      "git": git_revision(),
      "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(
          timespec="seconds"),
      "input_distribution": (
          "standard normal N(0, 1) from jax.random.normal in float32, cast to "
          f"the input dtype; seed {opts.seed}; timing rotates over several "
          "input sets (2 on a CPU, enough to exceed 2x a 60 MB L2 on a GPU, "
          f"at most {MAX_INPUT_SETS})"),
      "timing": ("CUPTI kernel time, median of the timed iterations"
                 if run.on_gpu else CPU_TIMING_NOTE),
      "check": ("relative Frobenius error against a float64 NumPy reference; "
                f"full when M*N*K <= {FULL_CHECK_VOLUME}, else a strided "
                "sample of rows and columns"),
      "suite": opts.suite,
      "iters": opts.iters,
      "warmup": opts.warmup,
      "autotune": opts.autotune,
      "command_line": opts.command_line,
      "backend_errors": pallas_gemm.backend_errors(),
  }


# ----------------------------------------------------------------- output ---


def default_output_dir(options: BenchmarkOptions, device: DeviceInfo,
                       on_gpu: bool) -> pathlib.Path:
  if on_gpu:
    return _REPO_ROOT / "experiments" / "results" / device.key / options.suite
  return _REPO_ROOT / "build" / "bench" / options.suite


def roofline_bandwidth(device_kind: str, *, measure: bool):
  """The memory roof: the higher of an elementwise copy measured now and the
  device-to-device copy rate known for this GPU type.

  XLA's elementwise copy reads and writes at once and lands below what a
  kernel that only streams reads achieves (3.4 vs 4.1 TB/s on an H200), so a
  roof from it alone would sit under real data points.
  """
  candidates = []
  if measure:
    measured = measure_copy_bandwidth_tbs()
    if measured is not None:
      candidates.append((measured, "elementwise copy measured now"))
  for name, value in KNOWN_BANDWIDTH_TBS.items():
    if name in device_kind:
      candidates.append((value, "device-to-device copy on this GPU type"))
  if not candidates:
    return None, "unknown"
  return max(candidates)


def measure_copy_bandwidth_tbs() -> float | None:
  """Device copy bandwidth from a 1 GiB read + 1 GiB write, CUPTI-timed."""
  try:
    x = jnp.ones((2**29,), jnp.bfloat16)
    double = jax.jit(lambda v: v * 2)
    ms = timing.median_time_ms(double, (x,), iterations=10, on_gpu=True)
    return 2 * x.nbytes / (ms * 1e-3) / 1e12
  except Exception:  # noqa: BLE001 - the roofline falls back to known ceilings
    return None


def write_records(output_dir: pathlib.Path, metadata: dict,
                  rows: Sequence[Measurement]) -> list[pathlib.Path]:
  """results.csv and results.json. Also called after every row, so that a
  run killed half-way (a timeout, a hung kernel) leaves what it measured."""
  output_dir.mkdir(parents=True, exist_ok=True)
  records = [dataclasses.asdict(r) for r in rows]
  csv_path = output_dir / "results.csv"
  with csv_path.open("w", newline="") as f:
    for key in ("device", "driver_version", "jax_version", "jaxlib_version",
                "git", "date_utc", "input_distribution", "timing",
                "command_line", "complete"):
      f.write(f"# {key}: {metadata[key]}\n")
    writer = csv.DictWriter(f, fieldnames=[fl.name for fl in
                                           dataclasses.fields(Measurement)])
    writer.writeheader()
    writer.writerows(records)
  json_path = output_dir / "results.json"
  json_path.write_text(json.dumps({"metadata": metadata, "results": records},
                                  indent=1, default=str) + "\n")
  return [csv_path, json_path]


def write_outputs(run: BenchmarkRun, output_dir: pathlib.Path,
                  metadata: dict) -> list[pathlib.Path]:
  rows = run.rows
  records = [dataclasses.asdict(r) for r in rows]
  written = write_records(output_dir, metadata, rows)

  provenance = (f"{metadata['device']}, jax {metadata['jax_version']}, "
                f"git {metadata['git']}, {metadata['date_utc']}, "
                f"`{metadata['command_line']}`")
  note = "" if run.on_gpu else f"\n\n> {CPU_TIMING_NOTE}"
  body = [table_cells(r) for r in rows]
  md_path = output_dir / "results.md"
  md_path.write_text(f"Results: {provenance}{note}\n\n"
                     + format_markdown_table(TABLE_COLUMNS, body) + "\n")
  written.append(md_path)

  summary_path = output_dir / "summary.md"
  summary_path.write_text(summary_markdown(rows, metadata["device"])
                          + f"\n<sub>{provenance}</sub>{note}\n")
  written.append(summary_path)

  if run.options.suite == "ladder":
    ladder_path = output_dir / "ladder.md"
    ladder_path.write_text(ladder_markdown(rows, metadata["device"])
                           + f"\n<sub>{provenance}</sub>{note}\n")
    written.append(ladder_path)

  if run.options.plot:
    from experiments import plotting  # noqa: PLC0415 - matplotlib is optional
    timing_kind = "CUPTI" if run.on_gpu else "interpret mode, not meaningful"
    title = (f"{metadata['device']} — suite {run.options.suite} "
             f"({timing_kind}) — git {metadata['git']}")
    png = output_dir / "tflops.png"
    if plotting.plot_tflops_vs_size(records, str(png), title=title):
      written.append(png)
    if run.options.suite == "decode":
      bandwidth, source = roofline_bandwidth(
          run.device.device_kind, measure=run.on_gpu)
      peaks = {case.label: run._peak(case) for case in run.options.dtype_cases}
      png = output_dir / "roofline.png"
      if plotting.plot_roofline(records, str(png), title="Roofline: " + title,
                                bandwidth_tbs=bandwidth,
                                bandwidth_source=source, peaks=peaks):
        written.append(png)
  return written


def _exit_on_sigterm(signum, frame):
  del frame
  # `timeout` sends SIGTERM: unwind through run_benchmark's `finally` so that
  # the tables and plots of what was measured are still written.
  raise SystemExit(128 + signum)


def run_benchmark(options: BenchmarkOptions, *, log=print,
                  on_timing=None) -> BenchmarkRun:
  """Runs, prints the final table and writes the outputs."""
  run = BenchmarkRun(options, log=log)
  run.on_timing = on_timing
  output_dir = (pathlib.Path(options.output_dir) if options.output_dir
                else default_output_dir(options, run.device, run.on_gpu))
  metadata = collect_metadata(run)
  metadata["complete"] = False
  run.on_row = lambda: write_records(output_dir, metadata, run.rows)
  log(f"pallas_gemm benchmark on {run.device.device_kind}"
      f"{'' if run.on_gpu else ' (CPU, Pallas interpret mode)'}; "
      f"suite {options.suite}, {len(options.shapes)} shapes, "
      f"dtypes {[c.label for c in options.dtype_cases]}, layouts "
      f"{list(options.layouts)}, kernels {list(options.kernels)}; "
      f"writing to {output_dir}")
  if not run.on_gpu:
    log("NOTE: " + CPU_TIMING_NOTE)
  for backend, error in pallas_gemm.backend_errors().items():
    log(f"NOTE: backend {backend} did not import: {error}")
  sys.stdout.flush()
  try:
    run.run()
    metadata["complete"] = True
  finally:
    if not metadata["complete"]:
      log(f"\nINTERRUPTED after {len(run.rows)} of {run.total()} "
          "measurements; writing what was measured")
    log("\n" + final_table(run.rows))
    if options.suite == "ladder":
      log("\nLadder:\n\n" + ladder_markdown(run.rows, run.device.device_kind))
    written = write_outputs(run, output_dir, metadata)
    log("\nwrote " + ", ".join(str(p) for p in written))
    if not run.on_gpu:
      log("NOTE: " + CPU_TIMING_NOTE)
    sys.stdout.flush()
  return run


def main(argv):
  try:
    options = options_from_flags(argv)
  except ValueError as e:
    print(f"error: {e}\n(see --helpfull)", file=sys.stderr)
    return 2
  signal.signal(signal.SIGTERM, _exit_on_sigterm)
  run = run_benchmark(options)
  failed = [r for r in run.rows if r.status == "FAILED"]
  if failed:
    print(f"\n{len(failed)} measurement(s) FAILED the correctness check or "
          "raised; see the table.", flush=True)
  return 1 if failed and FLAGS.strict else 0


if __name__ == "__main__":
  app.run(main)
