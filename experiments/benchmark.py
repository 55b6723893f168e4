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

import os
import pathlib
import signal
import sys
import warnings
from typing import Sequence

_REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
if __package__ in (None, ""):
  # Run as a script: make `experiments` and `pallas_gemm` importable from the
  # checkout without installing it (the GPU machine runs it this way).
  sys.path.insert(0, str(_REPO_ROOT))

warnings.filterwarnings("ignore", category=DeprecationWarning,
                        message=".*[Tt]riton.*")

from absl import app, flags  # noqa: E402

import pallas_gemm  # noqa: E402
from pallas_gemm import devices  # noqa: E402
from pallas_gemm import shapes as shape_suites  # noqa: E402
from experiments.bench.cases import (CPU_TIMING_NOTE, parse_dtypes, parse_layouts, parse_shape_list, suite_shapes)  # noqa: E402
from experiments.bench.targets import resolve_kernels  # noqa: E402
from experiments.bench.options import BenchmarkOptions, _gpu_available, command_line  # noqa: E402
from experiments.bench.runner import BenchmarkRun  # noqa: E402
from experiments.bench.report import final_table, ladder_markdown, regime_markdown  # noqa: E402
from experiments.bench.output import (ResumeError, collect_metadata, default_output_dir, load_earlier_run, write_outputs, write_records)  # noqa: E402

# ------------------------------------------------------------------ flags ---

FLAGS = flags.FLAGS
GPU_DEFAULT_KERNELS = ["auto", "mosaic/*", "triton/06_tuned", "jax_hopper"]

flags.DEFINE_list(
    "kernels", None,
    "Kernels to run: registered names or globs over pallas_gemm.list_kernels() "
    "(e.g. 'triton/*'), the baselines 'xla' (jnp.dot) and 'jax_hopper' "
    "(JAX's hopper_matmul_mgpu, Hopper only), 'auto' (kernel=None: what a "
    "user's call runs), or 'all' (every one of them). jnp.dot always runs "
    "as the baseline of the 'x jnp.dot' column. Default: all in interpret "
    "mode; on a GPU the automatic choice and the production kernels ("
    + ",".join(GPU_DEFAULT_KERNELS) + "): the teaching rungs take minutes "
    "on the large suite, so name them to time them.")
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
flags.DEFINE_enum(
    "fp8_scaling", "none", ["none", "tensor", "row", "block"],
    "For fp8 --dtypes: the dequantization scales every kernel applies: none, "
    "tensor (per tensor), row (A per row, B per column) or block (A 1x128, "
    "B 128x128). The baselines xla_scaled and jax_scaled_matmul time XLA's "
    "scaled forms; xla stays the unscaled fp8 dot.")
flags.DEFINE_list(
    "f32_precisions", ["ieee", "tf32"],
    "For float32 inputs: 'ieee' (exact products, compared with "
    "jnp.dot(precision=HIGHEST)) and/or 'tf32' (compared with jnp.dot at "
    "default precision).")
flags.DEFINE_string(
    "suite", None,
    "A shape suite from pallas_gemm/shapes.py: "
    + ", ".join(sorted(shape_suites.SUITES))
    + ". 'ladder' also prints and writes the optimisation ladder; 'wide' is "
    "a seeded list of whole problems (each with its own dtype, layout and "
    "batch) in eight regimes, and reports auto/jnp.dot per regime. Default: "
    "'cpu' in interpret mode, 'large' on a GPU.")
flags.DEFINE_list(
    "regimes", None,
    "With --suite=wide: only these regimes (default: all of "
    + ", ".join(shape_suites.WIDE_REGIMES) + ").")
flags.DEFINE_integer(
    "problems_per_regime", None,
    "With --suite=wide: only the first this many problems of each selected "
    "regime (a quick look, or a CPU smoke run with --allow_large_interpret).",
    lower_bound=1)
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
flags.DEFINE_bool(
    "allow_large_interpret", False,
    "Run suites sized for a GPU in interpret mode anyway (hours).")
flags.DEFINE_bool(
    "paired_timing", True,
    "On a GPU, time every kernel interleaved with jnp.dot (rounds in ABBA "
    "order) and take its x-jnp.dot ratio from those paired samples, so that "
    "clock and power drift over the run cancel; a kernel that compiles to "
    "jnp.dot's very program (kernel=None choosing xla) gets 1.0.")
flags.DEFINE_bool(
    "resume", False,
    "Carry over the problems already measured in --output_dir's results.json "
    "(written by the same git revision on the same GPU, else an error) and "
    "measure only the rest: a suite longer than one device call's budget "
    "completes over several calls. A problem is carried over whole, every "
    "kernel's row measured; one cut short by the budget is measured again.")
flags.DEFINE_float(
    "max_seconds_per_measurement", 5.0,
    "Fewer timed iterations (at least 3) for a kernel so slow that --iters "
    "would take longer than this.", lower_bound=0.0)

def _given_but_empty(name: str) -> bool:
  return FLAGS[name].present and not [v for v in FLAGS[name].value or ()
                                      if v.strip()]


def _wide_problems(interpret: bool) -> tuple:
  """The wide suite's problems, less the regimes --regimes leaves out."""
  for name in ("dtypes", "layouts", "shapes"):
    if FLAGS[name].present:
      raise ValueError(f"--{name} cannot be combined with --suite=wide: its "
                       "problems carry their own shapes, dtypes and layouts")
  regimes = FLAGS.regimes or list(shape_suites.WIDE_REGIMES)
  for regime in regimes:
    if regime not in shape_suites.WIDE_REGIMES:
      raise ValueError(f"--regimes entry {regime!r} is not one of "
                       f"{shape_suites.WIDE_REGIMES}")
  if interpret and not FLAGS.allow_large_interpret:
    raise ValueError("--suite=wide is sized for a GPU; in interpret mode its "
                     "problems would take hours (--allow_large_interpret "
                     "runs it anyway)")
  limit = FLAGS.problems_per_regime or len(shape_suites.WIDE)
  taken = {regime: 0 for regime in regimes}
  problems = []
  for problem in shape_suites.WIDE:
    if problem.regime in taken and taken[problem.regime] < limit:
      taken[problem.regime] += 1
      problems.append(problem)
  return tuple(problems)


def _check_output_dir(path: str | None) -> None:
  """Fails now, not after measuring, when results could not be written."""
  if not path:
    return
  target = pathlib.Path(path)
  try:
    target.mkdir(parents=True, exist_ok=True)
    probe = target / ".write_test"
    probe.write_text("")
    probe.unlink()
  except OSError as e:
    raise ValueError(f"--output_dir={path!r} is not writable: {e}") from None


def options_from_flags(argv: Sequence[str]) -> BenchmarkOptions:
  if len(argv) > 1:
    raise ValueError(f"unexpected positional arguments {argv[1:]}; every "
                     "option is a --flag")
  for name in ("shapes", "dtypes", "kernels", "layouts", "regimes",
               "f32_precisions"):
    if _given_but_empty(name):
      raise ValueError(f"--{name} is given but empty")
  interpret = FLAGS.interpret
  if interpret is None:
    interpret = not _gpu_available()
  problems = ()
  for name in ("regimes", "problems_per_regime"):
    if FLAGS[name].present and FLAGS.suite != "wide":
      raise ValueError(f"--{name} needs --suite=wide")
  if FLAGS.suite == "wide":
    problems = _wide_problems(interpret)
    shapes, suite = tuple(p.shape for p in problems), "wide"
    if not problems:
      raise ValueError("--regimes selects no problem")
  elif FLAGS.shapes:
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
  _check_output_dir(FLAGS.output_dir)
  return BenchmarkOptions(
      kernels=resolve_kernels(
          FLAGS.kernels or (["all"] if interpret else GPU_DEFAULT_KERNELS),
          FLAGS.skip_kernels),
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
      fp8_scaling=FLAGS.fp8_scaling,
      time_budget_s=FLAGS.time_budget_s,
      max_seconds_per_measurement=FLAGS.max_seconds_per_measurement,
      paired_timing=FLAGS.paired_timing,
      resume=FLAGS.resume,
      command_line=command_line(sys.argv),
      problems=problems,
  )


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
  if options.resume:
    earlier, dates = load_earlier_run(output_dir, metadata)
    run.carry_over(earlier)
    metadata["resumed"] = {"rows": len(earlier), "earlier_dates_utc": dates}
    log(f"--resume: {len(earlier)} rows measured earlier in {output_dir}")
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
    regimes = regime_markdown(run.rows, run.device.device_kind)
    if regimes:
      log("\n" + regimes)
    written = write_outputs(run, output_dir, metadata)
    log("\nwrote " + ", ".join(str(p) for p in written))
    if not run.on_gpu:
      log("NOTE: " + CPU_TIMING_NOTE)
    sys.stdout.flush()
  return run


def main(argv):
  problem = devices.unused_nvidia_gpu()
  if problem and os.environ.get("PALLAS_GEMM_ALLOW_CPU") != "1":
    print(f"error: {problem}", file=sys.stderr)
    return 2
  try:
    options = options_from_flags(argv)
  except ValueError as e:
    print(f"error: {e}\n(see --helpfull)", file=sys.stderr)
    return 2
  signal.signal(signal.SIGTERM, _exit_on_sigterm)
  try:
    run = run_benchmark(options)
  except ResumeError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  failed = [r for r in run.rows if r.status == "FAILED"]
  if failed:
    print(f"\n{len(failed)} measurement(s) FAILED the correctness check or "
          "raised; see the table.", flush=True)
  return 1 if failed and FLAGS.strict else 0


if __name__ == "__main__":
  app.run(main)
