"""GPU check and timing sweep for the Mosaic (Hopper) kernels.

Run from the repo root on an H100/H200:

    PYTHONPATH=. python3 experiments/lab/mosaic_sweep.py --stages check,large,decode \
        --out results.jsonl [--budget-s 270]

Stages:
  check    compile + correctness of both kernels at odd shapes, every
           layout, f16/bf16/TF32, the fused epilogue, a batch, misaligned K.
  large    bf16 timing against jnp.dot (and JAX's hopper_matmul_mgpu) at
           4096^3 / 8192^3, the heuristic config plus a few candidates.
  suite    the bf16 acceptance suite (shapes.LARGE), default config only.
  tf32     float32 (TF32) timing against jnp.dot at default precision.
  decode   small_m against jnp.dot on the decode suite, with achieved
           bandwidth (bytes of A, B and out over the kernel time).
  odd      non-tile-multiple shapes next to their divisible neighbours.
  odd_parts  where a ragged shape's time goes (pads, kernel, output slice).
  sweep    every fitting candidate config at --sweep-shape.
(The pingpong and cluster stages measured the consumer schedules and 2-CTA
clusters that were removed from ws_persistent; see
experiments/results/nvidia_h200/mosaic/README.md.)

Timing: CUPTI (`jax.experimental.mosaic.gpu.profiler.measure`), every kernel
launched by the call counted (pads and transposes included), one warm-up
call, the median of --iters runs. Inputs are random normal.
Each result is one JSON line, flushed as it is produced, so a run cut off by
its time limit keeps what it measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
import warnings

warnings.filterwarnings("ignore", category=DeprecationWarning)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import pallas_gemm  # noqa: E402
from pallas_gemm import shapes  # noqa: E402
from pallas_gemm import numerics, registry, timing  # noqa: E402
from pallas_gemm.mosaic_backend import config as cfg  # noqa: E402
from pallas_gemm.mosaic_backend.config import Dim, MosaicConfig, SmallMConfig  # noqa: E402
from pallas_gemm.mosaic_backend.small_m import small_m_matmul  # noqa: E402
from pallas_gemm.mosaic_backend.ws_persistent import ws_persistent_matmul  # noqa: E402
from pallas_gemm.problem import Epilogue  # noqa: E402
from experiments.lab.mosaic_common import (  # noqa: E402
    jnp_dot_fn, problem_for, short_error, time_fn)

START = time.time()
OUT_FILE = None
BUDGET_S = 270.0


def emit(record):
  record["t"] = round(time.time() - START, 1)
  line = json.dumps(record, default=str)
  print(line, flush=True)
  if OUT_FILE:
    with open(OUT_FILE, "a") as f:
      f.write(line + "\n")


def over_budget() -> bool:
  return time.time() - START > BUDGET_S


INTERPRET = False


def _num_sms() -> int:
  return pallas_gemm.device_info().num_sms


def kernel_fn(kernel, problem, config):
  """The jitted kernel with `config`; None means the config a user's
  `kernel="mosaic/<kernel>"` call gets (dispatch: tuned table, heuristic)."""
  if config is None:
    config = registry.get_kernel(f"mosaic/{kernel}").default_config(
        problem, pallas_gemm.device_info())
  fn = ws_persistent_matmul if kernel == "ws_persistent" else small_m_matmul
  return jax.jit(lambda a, b, c, bias: fn(a, b, c, bias, problem=problem,
                                          config=config, interpret=INTERPRET))


def stage_check(args):
  cases = []
  for layout in ("NN", "NT", "TN", "TT"):
    cases.append(("ws_persistent", problem_for(130, 66, 70, layout=layout), None))
  for m, n, k in ((1, 1, 1), (1, 37, 53), (17, 1, 33), (97, 61, 131),
                  (1000, 520, 300)):
    cases.append(("ws_persistent", problem_for(m, n, k), None))
  cases.append(("ws_persistent", problem_for(197, 133, 261, "float16", "TT"), None))
  cases.append(("ws_persistent", problem_for(197, 133, 261, "float32", "NN"), None))
  cases.append(("ws_persistent", problem_for(197, 133, 261, "float32", "TN"), None))
  epi = Epilogue(alpha=0.5, beta=-1.5, has_c=True, has_bias=True,
                 activation="gelu")
  cases.append(("ws_persistent", problem_for(
      300, 200, 150, "bfloat16", "NT", epilogue=epi, out_dtype="float32",
      c_dtype="float32"), None))
  cases.append(("ws_persistent", problem_for(
      300, 200, 150, "bfloat16", "NN", epilogue=Epilogue(has_bias=True,
                                                         activation="relu")),
      None))
  cases.append(("ws_persistent", problem_for(333, 257, 129, batch=3), None))
  cases.append(("ws_persistent", problem_for(1023, 1025, 1021), None))
  cases.append(("ws_persistent", problem_for(513, 700, 640), MosaicConfig(
      tile_m=128, tile_n=128, wg_dimension=Dim.N, max_concurrent_steps=4)))
  cases.append(("ws_persistent", problem_for(513, 700, 640), dataclasses.replace(
      cfg.ws_heuristic(problem_for(513, 700, 640), _num_sms()), warpgroup_semantics=True)))
  for m, layout in ((1, "NN"), (16, "NT"), (100, "TN"), (128, "NN")):
    cases.append(("small_m", problem_for(m, 4096, 4096, layout=layout), None))
  cases.append(("small_m", problem_for(7, 1000, 3000, "float16", "NN"),
                SmallMConfig(tile_n=128, k_splits=3, max_concurrent_steps=3)))
  cases.append(("small_m", problem_for(
      33, 520, 700, "bfloat16", "NN", epilogue=epi, out_dtype="bfloat16",
      c_dtype="float32"), SmallMConfig(tile_n=64, k_splits=1)))
  cases.append(("small_m", problem_for(
      33, 520, 700, "bfloat16", "NN", epilogue=epi, out_dtype="bfloat16",
      c_dtype="float32"), SmallMConfig(tile_n=64, k_splits=2)))
  for kernel, problem, config in cases:
    if over_budget():
      emit({"stage": "check", "skipped": "budget"})
      return
    rec = {"stage": "check", "kernel": kernel, "problem": problem.describe(),
           "epilogue": str(problem.epilogue), "config": str(config)}
    try:
      a, b, c, bias = timing.random_operands(problem)
      t = time.time()
      out = kernel_fn(kernel, problem, config)(a, b, c, bias)
      out = np.asarray(out.astype(jnp.float32))
      rec["compile_and_run_s"] = round(time.time() - t, 2)
      ref = numerics.reference_matmul(
          a, b, transpose_a=problem.transpose_a,
          transpose_b=problem.transpose_b, epilogue=problem.epilogue, c=c,
          bias=bias)
      if problem.batch == 1:
        ref = ref.reshape(out.shape)
      err = float(numerics.relative_error(out, ref))
      tol = float(numerics.tolerance(problem.in_dtype, problem.precision,
                                     problem.out_dtype))
      rec.update(err=err, tol=tol, ok=bool(err <= tol and np.isfinite(out).all()))
    except Exception as e:  # noqa: BLE001 - reported per case
      rec.update(ok=False, error=short_error(e))
    emit(rec)
  # The public API on the GPU, automatic choice included.
  try:
    a = jax.random.normal(jax.random.key(5), (300, 200), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(6), (200, 170), jnp.bfloat16)
    chosen = pallas_gemm.select_kernel(
        problem_for(300, 170, 200), pallas_gemm.device_info()).name
    out = jax.jit(lambda a, b: pallas_gemm.matmul(a, b))(a, b)
    ref = numerics.reference_matmul(a, b)
    emit({"stage": "check", "kernel": "api auto", "chosen": chosen,
          "err": float(numerics.relative_error(np.asarray(out, np.float32), ref))})
  except Exception as e:  # noqa: BLE001
    emit({"stage": "check", "kernel": "api auto", "error": short_error(e)})


# ----------------------------------------------------------------- timing ---

def time_problem(stage, problem, configs, *, iters, kernel="ws_persistent",
                 compare_hopper_example=False):
  a, b, c, bias = timing.random_operands(problem)
  flops = problem.flops
  try:
    _, ref_ms = time_fn(jnp_dot_fn(problem), a, b, c, bias, iters=iters)
  except Exception as e:  # noqa: BLE001
    emit({"stage": stage, "problem": problem.describe(), "kernel": "jnp.dot",
          "error": short_error(e)})
    return
  emit({"stage": stage, "problem": problem.describe(), "kernel": "jnp.dot",
        "ms": ref_ms, "tflops": flops / ref_ms / 1e9,
        "gbps": problem.min_bytes / ref_ms / 1e6})
  if compare_hopper_example and problem.layout == "NN" and problem.batch == 1:
    time_hopper_example(stage, problem, a, b, ref_ms, iters)
  best = None
  for config in configs:
    if over_budget():
      emit({"stage": stage, "skipped": "budget"})
      return
    rec = {"stage": stage, "problem": problem.describe(), "kernel": kernel,
           "config": str(config)}
    try:
      fn = kernel_fn(kernel, problem, config)
      out, ms = time_fn(fn, a, b, c, bias, iters=iters)
      ref = jnp_dot_fn(problem)(a, b, c, bias).astype(jnp.float32)
      err = float(jnp.linalg.norm(out.astype(jnp.float32) - ref)
                  / jnp.linalg.norm(ref))
      rec.update(ms=ms, tflops=flops / ms / 1e9,
                 gbps=problem.min_bytes / ms / 1e6, vs_jnp=ref_ms / ms,
                 err_vs_jnp=err)
      if best is None or ms < best[0]:
        best = (ms, str(config))
    except Exception as e:  # noqa: BLE001
      rec.update(error=short_error(e))
    emit(rec)
  if best:
    emit({"stage": stage, "problem": problem.describe(), "best_ms": best[0],
          "best_vs_jnp": ref_ms / best[0], "best_config": best[1]})


def time_hopper_example(stage, problem, a, b, ref_ms, iters):
  try:
    from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm
  except Exception as e:  # noqa: BLE001
    emit({"stage": stage, "kernel": "hopper_matmul_mgpu", "error": short_error(e)})
    return
  # Its default tiles, without and with a 2-CTA cluster along M (a 128x256
  # warpgroup tile does not fit in shared memory with 4 stages).
  for cluster in (None, hm.MatmulDimension.M):
    if over_budget():
      return
    tc = hm.TuningConfig(tile_m=128, tile_n=128, tile_k=64,
                         max_concurrent_steps=4, epi_tile_m=64, epi_tile_n=64,
                         grid_minor_dim=hm.MatmulDimension.N,
                         grid_tile_width=8, wg_dimension=hm.MatmulDimension.M,
                         cluster_dimension=cluster)
    rec = {"stage": stage, "problem": problem.describe(),
           "kernel": "hopper_matmul_mgpu", "config": str(tc)}
    try:
      fn = jax.jit(lambda a, b: hm.matmul(a, b, None, tc))
      _, ms = time_fn(fn, a[0], b[0], iters=iters)
      rec.update(ms=ms, tflops=problem.flops / ms / 1e9, vs_jnp=ref_ms / ms)
    except Exception as e:  # noqa: BLE001
      rec.update(error=short_error(e))
    emit(rec)


def large_configs(problem):
  heur = cfg.ws_heuristic(problem, _num_sms())
  extra = [
      MosaicConfig(tile_m=128, tile_n=128, tile_k=64, max_concurrent_steps=4,
                   wg_dimension=Dim.N, grid_band=8),
      dataclasses.replace(heur, grid_band=16),
      dataclasses.replace(heur, grid_band=4),
      dataclasses.replace(heur, max_concurrent_steps=3),
  ]
  return [heur] + [c for c in extra if c.fits(problem) and c != heur]


def stage_large(args):
  for size in (4096, 8192):
    problem = problem_for(size, size, size)
    time_problem("large", problem, large_configs(problem), iters=args.iters,
                 compare_hopper_example=True)


def stage_suite(args):
  """The acceptance suite (shapes.LARGE) with the default config only."""
  for m, n, k in shapes.LARGE:
    problem = problem_for(m, n, k)
    time_problem("suite", problem, [cfg.ws_heuristic(problem, _num_sms())],
                 iters=args.iters)


def stage_tf32(args):
  for size in (4096, 8192):
    problem = problem_for(size, size, size, "float32")
    heur = cfg.ws_heuristic(problem, _num_sms())
    time_problem("tf32", problem, [heur], iters=args.iters)
    if args.tf32_nt:
      problem_t = problem_for(size, size, size, "float32", "NT")
      time_problem("tf32", problem_t, [heur], iters=args.iters)


def stage_decode(args):
  num_sms = pallas_gemm.device_info().num_sms
  for m, n, k in shapes.DECODE:
    problem = problem_for(m, n, k)
    heur = cfg.small_m_heuristic(problem, num_sms)
    configs = [heur]
    alt = SmallMConfig(tile_n=64 if heur.tile_n != 64 else 128,
                       k_splits=heur.k_splits)
    if args.decode_alternatives:
      configs.append(alt)
    time_problem("decode", problem, configs, iters=args.iters,
                 kernel="small_m")


def stage_odd(args):
  for m, n, k in shapes.ODD_LARGE:
    problem = problem_for(m, n, k)
    time_problem("odd", problem, [cfg.ws_heuristic(problem, _num_sms())], iters=args.iters)


def stage_odd_parts(args):
  """Where a ragged shape's time goes: the whole call, the kernel alone on
  operands padded beforehand, each pad, the output slice, and a pad
  written as an update of a zero buffer instead of jnp.pad."""
  from pallas_gemm.mosaic_backend.ws_persistent import prepare_operands
  for m, n, k in shapes.ODD_LARGE[::2]:
    problem = problem_for(m, n, k)
    config = cfg.ws_heuristic(problem, _num_sms())
    a, b, c, bias = timing.random_operands(problem)
    pa, pb, _, _, _ = prepare_operands(a, b, c, bias, problem, config)
    padded = dataclasses.replace(problem, m=pa.shape[1], k=pa.shape[2],
                                 n=pb.shape[2])
    kernel_on_padded = jax.jit(lambda a, b: ws_persistent_matmul(
        a, b, None, None, problem=padded, config=config))
    out = kernel_on_padded(pa, pb)

    def pad_by_update(x, shape):
      return jnp.zeros(shape, x.dtype).at[:, :x.shape[1], :x.shape[2]].set(x)

    parts = {
        "whole call": (kernel_fn("ws_persistent", problem, config),
                       (a, b, c, bias)),
        "kernel on padded operands": (kernel_on_padded, (pa, pb)),
        "pad A (jnp.pad)": (jax.jit(lambda a: cfg.pad_to_tiling(
            a, (pa.shape[1], pa.shape[2]))), (a,)),
        "pad B (jnp.pad)": (jax.jit(lambda b: cfg.pad_to_tiling(
            b, (pb.shape[1], pb.shape[2]))), (b,)),
        "pad A (zeros + update)": (jax.jit(
            lambda a: pad_by_update(a, pa.shape)), (a,)),
        "pad B (zeros + update)": (jax.jit(
            lambda b: pad_by_update(b, pb.shape)), (b,)),
        "slice out (XLA)": (jax.jit(lambda o: o[:, :m, :n]), (out,)),
        "slice out (unpad_output)": (jax.jit(lambda o: cfg.unpad_output(
            o, m, n, on_gpu=True)), (out,)),
    }
    for name, (fn, fn_args) in parts.items():
      rec = {"stage": "odd_parts", "problem": problem.describe(),
             "part": name, "config": str(config)}
      try:
        _, ms = time_fn(fn, *fn_args, iters=args.iters)
        moved = sum(x.size * x.dtype.itemsize for x in fn_args
                    if x is not None)
        rec.update(ms=ms, input_gb_per_s=moved / ms / 1e6)
      except Exception as e:  # noqa: BLE001
        rec.update(error=short_error(e))
      emit(rec)




def stage_sweep(args):
  m, n, k = args.sweep_shape
  problem = problem_for(m, n, k, args.sweep_dtype)
  time_problem("sweep", problem, cfg.ws_candidates(problem)[:args.sweep_max],
               iters=args.iters)


STAGES = {"check": stage_check, "large": stage_large, "suite": stage_suite,
          "tf32": stage_tf32,
          "decode": stage_decode, "odd": stage_odd, "sweep": stage_sweep,
          "odd_parts": stage_odd_parts}


def main():
  global OUT_FILE, BUDGET_S, INTERPRET
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--stages", default="check,large,decode")
  parser.add_argument("--out", default=None)
  parser.add_argument("--budget-s", type=float, default=270.0)
  parser.add_argument("--iters", type=int, default=20)
  parser.add_argument("--sweep-shape", type=int, nargs=3,
                      default=(8192, 8192, 8192))
  parser.add_argument("--sweep-dtype", default="bfloat16")
  parser.add_argument("--sweep-max", type=int, default=12)
  parser.add_argument("--decode-alternatives", action="store_true")
  parser.add_argument("--tf32-nt", action="store_true",
                      help="also time TF32 with B given as (n, k)")
  parser.add_argument("--interpret", action="store_true",
                      help="CPU dry run of the script in GPU interpret mode")
  args = parser.parse_args()
  OUT_FILE, BUDGET_S, INTERPRET = args.out, args.budget_s, args.interpret
  from experiments.bench.output import git_revision
  sha = git_revision()  # honours PALLAS_GEMM_GIT_SHA (stale .git on devices)
  emit({"stage": "env", "device": str(jax.devices()[0].device_kind),
        "jax": jax.__version__, "git_sha": sha, "argv": sys.argv,
        "num_sms": pallas_gemm.device_info().num_sms,
        "backend_errors": pallas_gemm.backend_errors()})
  for stage in args.stages.split(","):
    if over_budget():
      emit({"stage": stage, "skipped": "budget"})
      continue
    try:
      STAGES[stage](args)
    except Exception as e:  # noqa: BLE001
      emit({"stage": stage, "error": short_error(e)})


if __name__ == "__main__":
  main()
