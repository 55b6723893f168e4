"""GPU smoke test and first timing of the Mosaic grouped-GEMM kernels.

Run from the repo root on an H100/H200 (it takes well under 150 s):

    PYTHONPATH=. python3 experiments/lab/gpu_smoke_ragged.py [--modes rows,contracting,dlhs]
        [--cases g8_even,g8_zipf,g64_even,g128_even,g128_zipf] [--budget-s 140]
        [--config tile_m=64,stages=5] [--skip-xla] [--sweep]

For every case (issue 18's shapes, even and Zipf group sizes) and mode it
compiles `pallas_gemm.ragged_dot.mosaic` with the heuristic's config (modes:
rows = forward, contracting = the weight gradient, dlhs = rows with rhs read
transposed, the input gradient), checks
a subsample of the result against float64 NumPy, and times (CUPTI median,
`pallas_gemm.timing`) the kernel, `jax.lax.ragged_dot(_general)` (XLA), a
dense `jnp.dot` of the same flops and a copy (measured bandwidth). It prints
TFLOP/s and the fraction of the roofline,

    roofline time = max(flops / dense rate, bytes(lhs + rhs + out) / copy bandwidth).

Errors are printed per case and the run goes on.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from pallas_gemm import timing
from pallas_gemm.devices import device_info
from pallas_gemm.ragged_dot import configs, mosaic
from pallas_gemm.ragged_dot.problem import RaggedProblem, group_bounds

# name: (groups, tokens, k, n, distribution)
CASES = {
    "g8_even": (8, 16384, 4096, 14336, "even"),
    "g8_zipf": (8, 16384, 4096, 14336, "zipf"),
    "g64_even": (64, 16384, 2048, 1408, "even"),
    "g128_even": (128, 8192, 7168, 2048, "even"),
    "g128_zipf": (128, 8192, 7168, 2048, "zipf"),
}
START = time.perf_counter()


def log(*parts):
  print(f"[{time.perf_counter() - START:6.1f}s]", *parts, flush=True)


def group_sizes_for(groups: int, tokens: int, distribution: str) -> np.ndarray:
  if distribution == "even":
    sizes = np.full(groups, tokens // groups, np.int64)
  else:  # Zipf: sizes proportional to 1 / rank
    weights = 1.0 / np.arange(1, groups + 1)
    sizes = np.floor(tokens * weights / weights.sum()).astype(np.int64)
  sizes[0] += tokens - sizes.sum()
  return sizes.astype(np.int32)


def median_ms(fn, args, iterations):
  return timing.median_time_ms(jax.jit(fn), args, iterations=iterations,
                               on_gpu=True)


def copy_bandwidth(nbytes: int) -> float:
  """Bytes/s of a device copy (read + write counted), the benchmark's
  measurement (experiments/bench/output.py)."""
  del nbytes
  from experiments.bench import output
  return output.measure_copy_bandwidth_tbs() * 1e12


def check_rows(out, lhs, rhs, sizes, rng):
  """Relative error on 256 rows x 256 columns, float64."""
  m, n = out.shape
  starts, ends = group_bounds(sizes, m)
  rows = np.sort(rng.choice(m, size=min(256, m), replace=False))
  cols = np.sort(rng.choice(n, size=min(256, n), replace=False))
  groups = np.searchsorted(ends, rows, side="right")
  got = np.asarray(out[rows][:, cols].astype(jnp.float32), np.float64)
  lhs_rows = np.asarray(lhs[rows].astype(jnp.float32), np.float64)
  want = np.zeros_like(got)
  for g in np.unique(groups):
    sel = groups == g
    weights = np.asarray(rhs[g][:, cols].astype(jnp.float32), np.float64)
    want[sel] = lhs_rows[sel] @ weights
  return np.linalg.norm(got - want) / np.linalg.norm(want)


def check_contracting(out, lhs, dout, sizes, rng):
  """Relative error on 3 non-empty groups x 128 x 256 entries, float64."""
  m = lhs.shape[0]
  starts, ends = group_bounds(sizes, m)
  nonempty = [g for g in range(len(sizes)) if ends[g] > starts[g]]
  picked = sorted({nonempty[0], nonempty[len(nonempty) // 2], nonempty[-1]})
  ks = np.sort(rng.choice(out.shape[1], size=128, replace=False))
  ns = np.sort(rng.choice(out.shape[2], size=256, replace=False))
  err_num = err_den = 0.0
  for g in picked:
    s, e = int(starts[g]), int(ends[g])
    a = np.asarray(lhs[s:e][:, ks].astype(jnp.float32), np.float64)
    b = np.asarray(dout[s:e][:, ns].astype(jnp.float32), np.float64)
    want = a.T @ b
    got = np.asarray(out[g][ks][:, ns].astype(jnp.float32), np.float64)
    err_num += np.linalg.norm(got - want) ** 2
    err_den += np.linalg.norm(want) ** 2
  return float(np.sqrt(err_num / err_den))


def xla_fn(mode):
  if mode == "rows":
    return lambda lhs, rhs, sizes: jax.lax.ragged_dot(lhs, rhs, sizes)
  if mode == "dlhs":
    return lambda dout, rhs, sizes: jax.lax.ragged_dot(
        dout, jnp.swapaxes(rhs, 1, 2), sizes)
  numbers = jax.lax.RaggedDotDimensionNumbers(
      dot_dimension_numbers=(((0,), (0,)), ((), ())),
      lhs_ragged_dimensions=[0], rhs_group_dimensions=[])
  return lambda lhs, dout, sizes: jax.lax.ragged_dot_general(
      lhs, dout, sizes, ragged_dot_dimension_numbers=numbers)


def sweep_case(name, mode, args):
  """Times every `configs.candidates` config of one case (no checks)."""
  groups, tokens, k, n, distribution = CASES[name]
  problem = RaggedProblem(mode, tokens, k, n, groups, "bfloat16", "bfloat16")
  keys = jax.random.split(jax.random.key(1), 2)
  lhs = jax.random.normal(keys[0], problem.lhs_shape,
                          jnp.float32).astype(jnp.bfloat16)
  rhs = jax.random.normal(keys[1], problem.rhs_shape,
                          jnp.float32).astype(jnp.bfloat16)
  sizes = jnp.asarray(group_sizes_for(groups, tokens, distribution))
  offset = jnp.zeros((1,), jnp.int32)
  chosen = mosaic.heuristic(problem, device_info())
  for config in [chosen] + [c for c in configs.candidates(problem)
                            if c != chosen]:
    if time.perf_counter() - START > args.budget_s:
      log(name, mode, "sweep stopped: over --budget-s")
      return
    try:
      kernel = jax.jit(lambda a, b, s, o, c=config: mosaic.ragged_matmul(
          a, b, s, o, problem=problem, config=c))
      ms = median_ms(kernel, (lhs, rhs, sizes, offset), args.iters)
      print(f"SWEEP {name:10s} {mode:11s} {ms:.3f} ms "
            f"{problem.flops / ms / 1e9:7.1f} TFLOP/s  {config}", flush=True)
    except Exception:  # one failing config must not stop the others
      log(name, mode, "FAILED:", config)
      traceback.print_exc()
      sys.stdout.flush()


def run_case(name, mode, args, rng, dense_cache):
  groups, tokens, k, n, distribution = CASES[name]
  dtype = jnp.bfloat16
  if mode == "dlhs":  # dout (tokens, n) times each rhs[g] (k, n) transposed
    problem = RaggedProblem("rows", tokens, n, k, groups, "bfloat16",
                            "bfloat16", transpose_rhs=True)
  else:
    problem = RaggedProblem(mode, tokens, k, n, groups, "bfloat16", "bfloat16")
  device = device_info()
  config = mosaic.heuristic(problem, device)
  if args.config:  # e.g. "tile_n=64,stages=5": the heuristic's, with these
    overrides = dict(item.split("=") for item in args.config.split(","))
    config = dataclasses.replace(config, **{
        key: (value.lower() in ("1", "true") if key == "split_rows"
              else int(value)) for key, value in overrides.items()})
  reason = mosaic.supports(problem, device)
  if reason:
    log(name, mode, "unsupported:", reason)
    return
  log(name, mode, "config", config)
  sizes_np = group_sizes_for(groups, tokens, distribution)
  keys = jax.random.split(jax.random.key(0), 2)
  lhs = jax.random.normal(keys[0], problem.lhs_shape, jnp.float32).astype(dtype)
  rhs = jax.random.normal(keys[1], problem.rhs_shape, jnp.float32).astype(dtype)
  sizes = jnp.asarray(sizes_np)
  offset = jnp.zeros((1,), jnp.int32)
  kernel = jax.jit(lambda a, b, s, o: mosaic.ragged_matmul(
      a, b, s, o, problem=problem, config=config))
  out = jax.block_until_ready(kernel(lhs, rhs, sizes, offset))
  log(name, mode, "compiled and ran")
  if mode == "contracting":
    err = check_contracting(out, lhs, rhs, sizes_np, rng)
  else:
    err = check_rows(out, lhs, jnp.swapaxes(rhs, 1, 2) if mode == "dlhs"
                     else rhs, sizes_np, rng)
  log(name, mode, f"rel err vs float64 (subsample) {err:.2e}",
      "OK" if err < 2e-2 else "FAILED")
  del out
  ours = median_ms(kernel, (lhs, rhs, sizes, offset), args.iters)
  flops = problem.flops
  log(name, mode, f"mosaic {ours:.3f} ms {flops / ours / 1e9:.1f} TFLOP/s")
  xla = None
  if not args.skip_xla:
    xla = median_ms(xla_fn(mode), (lhs, rhs, sizes), 2)
    log(name, mode, f"xla {xla:.3f} ms {flops / xla / 1e9:.1f} TFLOP/s")
  key = (tokens, problem.k, problem.n)
  if key not in dense_cache:
    a = jax.random.normal(keys[0], (tokens, problem.k),
                          jnp.float32).astype(dtype)
    b = jax.random.normal(keys[1], (problem.k, problem.n),
                          jnp.float32).astype(dtype)
    dense_cache[key] = median_ms(jnp.dot, (a, b), args.iters)
    del a, b
  dense = dense_cache[key]
  if "bw" not in dense_cache:
    dense_cache["bw"] = copy_bandwidth(1 << 30)
    log(f"copy bandwidth {dense_cache['bw'] / 1e12:.2f} TB/s")
  bandwidth = dense_cache["bw"]
  roofline = max(dense, problem.min_bytes / bandwidth * 1e3)
  log(name, mode, f"dense {dense:.3f} ms {flops / dense / 1e9:.1f} TFLOP/s")
  print(f"RESULT {name:10s} {mode:11s} mosaic {flops / ours / 1e9:7.1f} "
        f"TFLOP/s  xla {flops / xla / 1e9 if xla else float('nan'):7.1f}  "
        f"dense {flops / dense / 1e9:7.1f}  roofline {roofline:.3f} ms  "
        f"fraction {roofline / ours:.2f}  err {err:.1e}", flush=True)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--cases", default=",".join(CASES))
  parser.add_argument("--modes", default="rows,contracting")
  parser.add_argument("--config", default="",
                      help="RaggedConfig fields to override, e.g. "
                      "'tile_m=64,stages=5' or 'split_rows=0'")
  parser.add_argument("--iters", type=int, default=5)
  parser.add_argument("--budget-s", type=float, default=140.0)
  parser.add_argument("--sweep", action="store_true",
                      help="instead of the checks, time the few candidate "
                      "configs of each case (configs.candidates)")
  parser.add_argument("--skip-xla", action="store_true",
                      help="do not time jax.lax.ragged_dot (slow to compile)")
  args = parser.parse_args(argv)
  if jax.default_backend() != "gpu":
    sys.exit("needs a GPU (the kernels are compiled, not interpreted)")
  log("device", device_info())
  rng = np.random.default_rng(0)
  dense_cache = {}
  for name in args.cases.split(","):
    for mode in args.modes.split(","):
      if time.perf_counter() - START > args.budget_s:
        log(name, mode, "skipped: over --budget-s")
        continue
      if args.sweep:
        sweep_case(name, mode, args)
        continue
      try:
        run_case(name, mode, args, rng, dense_cache)
      except Exception:  # one failing case must not stop the others
        log(name, mode, "FAILED:")
        traceback.print_exc()
        sys.stdout.flush()


if __name__ == "__main__":
  main()
