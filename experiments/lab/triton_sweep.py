"""Checks and tunes the Pallas-Triton ladder on a GPU; re-runnable.

    PYTHONPATH=. python3 experiments/lab/triton_sweep.py --phase check
    PYTHONPATH=. python3 experiments/lab/triton_sweep.py --phase bf16 --phase skinny \
        --out results/ --shipped pallas_gemm/tuned/
    PYTHONPATH=. python3 experiments/lab/triton_sweep.py --phase sass --sass-case tf32_nn

Phases:
  check   every rung compiled on the GPU at a ragged and a tile-multiple
          shape, all dtypes, two layouts; relative error vs float64 NumPy.
  ladder  each rung's default config at the LADDER shapes, bf16.
  bf16 / tf32 / ieee
          `triton/06_tuned`'s search space (the configs `autotune.tune`
          times) on large shapes against jnp.dot (same dtype/precision)
          measured in the same process.
  skinny  the same search space (split-K included) for M in {1, 16, 128},
          N = K = 8192, bf16.
  sass    compiles one 06_tuned kernel (`--sass-case`); run it with
          XLA_FLAGS=--xla_dump_to=DIR and grep/disassemble the dump.

Timing: CUPTI kernel time (jax.experimental.mosaic.gpu.profiler.measure),
median of --iterations after a warm-up call, normal random inputs. The
winner of each tuned shape is written in `pallas_gemm.autotune`'s cache
format to `<shipped>/<device_key>.json` when --shipped is given, merged with
what is there. A global --budget-s stops starting new work when it is spent,
so a run under a time limit still writes its results.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
import time
import warnings

warnings.filterwarnings("ignore", category=DeprecationWarning)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import pallas_gemm  # noqa: E402
from pallas_gemm import autotune, numerics, registry, timing  # noqa: E402
from pallas_gemm.problem import Epilogue, GemmProblem  # noqa: E402
from pallas_gemm.triton_backend.common import TritonConfig  # noqa: E402

START = time.time()

BF16_SHAPES = [(4096, 4096, 4096), (8192, 8192, 8192), (8192, 4096, 14336)]
F32_SHAPES = [(4096, 4096, 4096), (8192, 8192, 8192)]
SKINNY_SHAPES = [(1, 8192, 8192), (16, 8192, 8192), (128, 8192, 8192)]
LADDER_SHAPES = [(4096, 4096, 4096), (8192, 8192, 8192)]

# The sweep times the configs `autotune.tune` searches for rung 6 (its one
# search space, `k06_tuned.search_space`), so a winner here is a winner there;
# the hand-picked candidate lists of earlier runs are in the git history.
KERNEL = "triton/06_tuned"
#: How many of the search space's configs a phase times (--dry-run: two).
CANDIDATE_LIMIT = None


def candidates(problem) -> list[TritonConfig]:
  space = autotune.search_space(problem, KERNEL, pallas_gemm.device_info())
  return space[:CANDIDATE_LIMIT]


def log(*parts):
  print(f"[{time.time() - START:6.1f}s]", *parts, flush=True)


def budget_left(args) -> float:
  return args.budget_s - (time.time() - START)


def make_problem(shape, family, layout="NN"):
  m, n, k = shape
  dtype = "bfloat16" if family in ("bf16", "skinny") else (
      "float16" if family == "f16" else "float32")
  precision = {"tf32": "tf32", "ieee": "ieee"}.get(family, "default")
  return GemmProblem(1, m, n, k, dtype, dtype, transpose_a=layout[0] == "T",
                     transpose_b=layout[1] == "T", precision=precision)


INTERPRET = False  # --dry-run: interpret mode on a CPU, tiny shapes


def kernel_fn(kernel, problem, config):
  entry = registry.get_kernel(kernel)
  return jax.jit(lambda a, b: entry.fn(a, b, None, None, problem=problem,
                                       config=config, interpret=INTERPRET))


def xla_fn(problem):
  precision = (jax.lax.Precision.HIGHEST if problem.precision == "ieee"
               else jax.lax.Precision.DEFAULT)
  dims = (((2 if not problem.transpose_a else 1,),
           (1 if not problem.transpose_b else 2,)), ((0,), (0,)))

  def run(a, b):
    # 16-bit inputs give a 16-bit output straight from cuBLAS, as in
    # benchmark.py. An f32 result cast afterwards timed a slower GEMM plus a
    # convert kernel (747 against ~800 TFLOP/s at 4096^3 on the H200).
    out = jax.lax.dot_general(a, b, dims, precision=precision)
    return out.astype(problem.out_dtype)
  return jax.jit(run)


def time_ms(fn, args, iterations):
  return timing.median_time_ms(fn, args, iterations=iterations,
                                 on_gpu=not INTERPRET)


def try_time(args, kernel, problem, config, operands, *, label):
  """The kernel's median ms, or None (logged as FAIL) when it raises."""
  try:
    return time_ms(kernel_fn(kernel, problem, config), operands,
                   args.iterations)
  except Exception as e:  # noqa: BLE001 - one failing config must not end a sweep
    log(f"  {label}: FAIL {type(e).__name__}: {str(e)[:200]}")
    return None


def tflops(problem, ms):
  return problem.flops / (ms * 1e-3) / 1e12


def rel_error_vs(out, ref):
  out = np.asarray(out.astype(jnp.float32), np.float64)
  ref = np.asarray(ref, np.float64)
  return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


# --------------------------------------------------------------------- check
def phase_check(args, results):
  # Ragged, tile-multiple, and skinny with long K (split-K's case).
  shapes = [(257, 391, 515), (512, 256, 1024), (33, 520, 4100)]
  # The production kernel gets every dtype; the teaching rungs two cases.
  all_families = [("bf16", "NN"), ("bf16", "TT"), ("f16", "NT"),
                  ("ieee", "NN"), ("ieee", "TN"), ("tf32", "NN")]
  rung_families = [("bf16", "NN"), ("ieee", "TN")]
  for kernel in pallas_gemm.list_kernels("triton/*"):
    entry = registry.get_kernel(kernel)
    device = pallas_gemm.device_info()
    families = (all_families if kernel == "triton/06_tuned"
                else rung_families)
    # Rung 1 holds all of K in registers and declines K past a few hundred.
    kernel_shapes = [(257, 391, 120)] if kernel == "triton/01_naive" else shapes
    for shape in kernel_shapes:
      for family, layout in families:
        if budget_left(args) < 0:
          return
        problem = make_problem(shape, family, layout)
        if family == "bf16" and layout == "NN":
          problem = dataclasses.replace(problem, epilogue=Epilogue(
              alpha=0.5, beta=1.0, has_c=True, has_bias=True,
              activation="gelu"), c_dtype="float32")
        reason = entry.supports(problem, device)
        if reason is not None:
          continue
        config = entry.default_config(problem, device)
        a, b, c, bias = timing.random_operands(problem)
        try:
          numerics.poison_allocator((1, problem.m, problem.n),
                                    problem.out_dtype)
          out = jax.jit(lambda a, b, c, bias: entry.fn(
              a, b, c, bias, problem=problem, config=config,
              interpret=INTERPRET))(a, b, c, bias)
          ref = numerics.reference_matmul(
              a, b, transpose_a=problem.transpose_a,
              transpose_b=problem.transpose_b, epilogue=problem.epilogue,
              c=c, bias=bias)
          err = numerics.relative_error(out, ref)
          tol = numerics.tolerance(problem.in_dtype, problem.precision,
                                   problem.out_dtype)
          status = "ok" if err <= tol else "FAIL"
        except Exception as e:  # report and go on
          err, status = float("nan"), f"ERROR {type(e).__name__}: {e}"[:300]
        results["check"].append(dict(kernel=kernel,
                                     problem=problem.describe(),
                                     error=err, status=status))
        log(f"check {kernel:22s} {problem.describe():52s} err={err:.2e} "
            f"{status}")


# ------------------------------------------------------------------- timings
def sweep_shape(args, results, kernel, problem, candidates, tag):
  a, b, _, _ = timing.random_operands(problem)
  xla_ms = time_ms(xla_fn(problem), (a, b), args.iterations)
  log(f"{tag} {problem.describe()}: jnp.dot {xla_ms:.4f} ms = "
      f"{tflops(problem, xla_ms):.1f} TFLOP/s")
  device = pallas_gemm.device_info()
  best = None
  for config in candidates:
    if budget_left(args) < 0:
      log("budget spent; stopping this sweep")
      break
    if not autotune.fits_device(config, problem, device):
      log(f"  skip (smem) {config}")
      continue
    ms = try_time(args, kernel, problem, config, (a, b), label=str(config))
    if ms is None:
      continue
    ratio = xla_ms / ms
    log(f"  {ms:9.4f} ms {tflops(problem, ms):7.1f} TFLOP/s "
        f"{ratio:5.3f}x jnp.dot  {config}")
    results["sweep"].append(dict(tag=tag, kernel=kernel,
                                 problem=problem.describe(),
                                 config=dataclasses.asdict(config), ms=ms,
                                 xla_ms=xla_ms, ratio=ratio))
    if best is None or ms < best[1]:
      best = (config, ms)
  if best is not None:
    config, ms = best
    out = kernel_fn(kernel, problem, config)(a, b)
    ref = xla_fn(dataclasses.replace(problem, precision="ieee")
                 if problem.in_dtype == "float32" else problem)(
                     a.astype(jnp.float32), b.astype(jnp.float32))
    err = rel_error_vs(out, ref)
    log(f"  best {config} {ms:.4f} ms {xla_ms / ms:.3f}x jnp.dot, "
        f"rel err vs f32 HIGHEST dot {err:.2e}")
    results["best"].append(dict(tag=tag, problem=problem.describe(),
                                config=dataclasses.asdict(config), ms=ms,
                                xla_ms=xla_ms, ratio=xla_ms / ms, error=err))
    if args.shipped:
      path = pathlib.Path(args.shipped) / f"{device.key}.json"
      autotune.store(problem, kernel, config, device=device, time_ms=ms,
                     path=path)


def phase_family(args, results, family):
  shapes = BF16_SHAPES if family == "bf16" else F32_SHAPES
  for shape in shapes:
    if budget_left(args) < 0:
      return
    problem = make_problem(shape, family, args.layout)
    sweep_shape(args, results, KERNEL, problem, candidates(problem), family)


def phase_skinny(args, results):
  for shape in SKINNY_SHAPES:
    if budget_left(args) < 0:
      return
    problem = make_problem(shape, "skinny", args.layout)
    sweep_shape(args, results, KERNEL, problem, candidates(problem), "skinny")


def phase_ladder(args, results):
  device = pallas_gemm.device_info()
  for shape in LADDER_SHAPES:
    problem = make_problem(shape, "bf16")
    a, b, _, _ = timing.random_operands(problem)
    xla_ms = time_ms(xla_fn(problem), (a, b), args.iterations)
    log(f"ladder {problem.describe()}: jnp.dot {xla_ms:.4f} ms "
        f"{tflops(problem, xla_ms):.1f} TFLOP/s")
    for kernel in pallas_gemm.list_kernels("triton/*"):
      if budget_left(args) < 0:
        return
      entry = registry.get_kernel(kernel)
      reason = entry.supports(problem, device)
      if reason is not None:
        log(f"  {kernel}: declines: {reason}")
        continue
      config = entry.default_config(problem, device)
      ms = try_time(args, kernel, problem, config, (a, b), label=kernel)
      if ms is None:
        continue
      log(f"  {kernel:22s} {ms:9.4f} ms {tflops(problem, ms):7.1f} TFLOP/s "
          f"{xla_ms / ms:5.3f}x  {config}")
      results["ladder"].append(dict(kernel=kernel, problem=problem.describe(),
                                    config=dataclasses.asdict(config), ms=ms,
                                    xla_ms=xla_ms))


def phase_sass(args, results):
  """One kernel, compiled and run once, for the XLA dump to capture."""
  family, layout = args.sass_case.split("_")
  problem = make_problem((4096, 4096, 4096), family, layout.upper())
  config = candidates(problem)[0]
  a, b, _, _ = timing.random_operands(problem)
  ms = time_ms(kernel_fn("triton/06_tuned", problem, config), (a, b),
               args.iterations)
  log(f"sass case {args.sass_case}: {problem.describe()} {config} "
      f"{ms:.4f} ms {tflops(problem, ms):.1f} TFLOP/s")
  results["sass"].append(dict(case=args.sass_case, ms=ms,
                              tflops=tflops(problem, ms)))


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--phase", action="append", required=True,
                      choices=["check", "ladder", "bf16", "tf32", "ieee",
                               "skinny", "sass"])
  parser.add_argument("--layout", default="NN",
                      choices=["NN", "NT", "TN", "TT"])
  parser.add_argument("--iterations", type=int, default=20)
  parser.add_argument("--budget-s", type=float, default=float("inf"))
  parser.add_argument("--out", default=None,
                      help="folder for results JSON (default: print only)")
  parser.add_argument("--shipped", default=None,
                      help="folder to merge tuned winners into")
  parser.add_argument("--sass-case", default="tf32_nn")
  parser.add_argument("--dry-run", action="store_true",
                      help="CPU smoke test of this script: interpret mode, "
                      "tiny shapes, wall-clock times (meaningless numbers)")
  args = parser.parse_args(argv)
  if args.iterations < 20:
    parser.error(f"--iterations={args.iterations} must be >= 20")
  if args.dry_run:
    global INTERPRET, BF16_SHAPES, F32_SHAPES, SKINNY_SHAPES, LADDER_SHAPES
    global CANDIDATE_LIMIT
    INTERPRET = True
    BF16_SHAPES = F32_SHAPES = [(64, 64, 128)]
    SKINNY_SHAPES = [(1, 64, 1024)]
    LADDER_SHAPES = [(64, 64, 128)]
    CANDIDATE_LIMIT = 2
  elif jax.default_backend() != "gpu":
    parser.error("this script needs a CUDA GPU (or --dry-run)")
  log("device", pallas_gemm.device_info())
  results = {"device": pallas_gemm.device_info().device_kind,
             "jax": jax.__version__, "check": [], "sweep": [], "best": [],
             "ladder": [], "sass": []}
  for phase in args.phase:
    if budget_left(args) < 0:
      log(f"budget spent before phase {phase}")
      break
    if phase == "check":
      phase_check(args, results)
    elif phase == "ladder":
      phase_ladder(args, results)
    elif phase == "skinny":
      phase_skinny(args, results)
    elif phase == "sass":
      phase_sass(args, results)
    else:
      phase_family(args, results, phase)
  if args.out:
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    name = "_".join(args.phase) + f"_{args.layout}.json"
    (out_dir / name).write_text(json.dumps(results, indent=1))
    log("wrote", out_dir / name)
  failures = [r for r in results["check"] if r["status"] != "ok"]
  return 1 if failures else 0


if __name__ == "__main__":
  sys.exit(main())
