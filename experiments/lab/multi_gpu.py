"""Data-parallel scaling of `pallas_gemm.matmul` over the GPUs of one host.

    python experiments/lab/multi_gpu.py                       # 1 GPU vs all GPUs
    python experiments/lab/multi_gpu.py --shape=16384x8192x8192 --kernel=mosaic/ws_persistent
    python experiments/lab/multi_gpu.py --cpu_smoke           # logic check, 8 fake CPU devices

The acceptance run for multi-device partitioning: A (M×K, bf16) sharded by
rows over a one-axis mesh, B (K×N) replicated, the output sharded by rows.
Partitioned like `jnp.dot`, each device multiplies its M/d rows with no
collective at all, so d GPUs should reach close to d times the throughput of
one.

For each device count (1, and every count up to --max_devices, default: all
GPUs) and for both `pallas_gemm.matmul` and `jnp.dot`:

  * the compiled program's collectives are listed (expected: none);
  * the output is compared with `jnp.dot` under the same sharding (relative
    Frobenius error, on device, against the bf16 tolerance);
  * time per step. GPU: CUPTI kernel time
    (`jax.experimental.mosaic.gpu.profiler.measure`), median of --iters steps
    after a warm-up. CUPTI reports the kernels of every device in the
    process, so a step's time per device is the sum over its kernels divided
    by the device count (the devices run the same SPMD program at once); the
    wall-clock time of --iters back-to-back steps is reported beside it as
    evidence that the devices really overlap. CPU (--cpu_smoke): host clock
    only; those numbers mean nothing.

Writes multi_gpu.json and multi_gpu.md to --output_dir (default
experiments/results/<gpu>/multi_gpu/, or build/bench/multi_gpu/ on a CPU).
Exits 1 when an output is outside the tolerance.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import re
import statistics
import sys
import time
import warnings

_REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]


def _parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--shape", default="16384x8192x8192",
                      help="MxNxK of the whole problem")
  parser.add_argument("--dtype", default="bfloat16")
  parser.add_argument("--kernel", default=None,
                      help="a registered kernel name; default: automatic")
  parser.add_argument("--max_devices", type=int, default=0,
                      help="largest device count to run (0: all)")
  parser.add_argument("--iters", type=int, default=20)
  parser.add_argument(
      "--output_dir", default=None,
      help="default: experiments/results/<gpu>/multi_gpu on a GPU, "
      "build/bench/multi_gpu on a CPU (not kept)")
  parser.add_argument("--cpu_smoke", action="store_true",
                      help="8 simulated CPU devices and a small shape")
  return parser.parse_args(argv)


ARGS = _parse_args() if __name__ == "__main__" else None
if ARGS is not None and ARGS.cpu_smoke:
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=8")
  os.environ["JAX_PLATFORMS"] = "cpu"
if __package__ in (None, ""):
  sys.path.insert(0, str(_REPO_ROOT))
warnings.filterwarnings("ignore", category=DeprecationWarning,
                        message=".*[Tt]riton.*")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec  # noqa: E402

import pallas_gemm  # noqa: E402
from pallas_gemm import numerics  # noqa: E402
from pallas_gemm.devices import device_info, peak_tflops  # noqa: E402


def _collectives(hlo_text: str) -> list[str]:
  return re.findall(
      r"= \S+ (all-gather|all-reduce|reduce-scatter|all-to-all|"
      r"collective-permute)(?:-start)?\(", hlo_text)


def _device_counts(available: int, limit: int) -> list[int]:
  top = available if limit <= 0 else min(limit, available)
  counts = [1]
  d = 2
  while d <= top:
    counts.append(d)
    d *= 2
  if top not in counts:
    counts.append(top)
  return counts


def _cupti_ms_per_step(compiled, args, iters: int, num_devices: int):
  """Median CUPTI kernel time of one step, per device; None without CUPTI."""
  from pallas_gemm import timing
  try:
    _, per_step = timing.cupti_samples_ms(compiled, args, iterations=iters,
                                          per_kernel=True, warmup=0)
  except Exception as e:  # noqa: BLE001 - reported in the results
    return None, f"CUPTI failed: {type(e).__name__}: {e}"
  sums = [sum(ms for _, ms in kernels) for kernels in per_step]
  kernels_per_step = len(per_step[0])
  return statistics.median(sums) / num_devices, (
      f"{kernels_per_step} kernels per step over {num_devices} device(s)")


def _wall_ms_per_step(compiled, args, iters: int) -> float:
  jax.block_until_ready(compiled(*args))
  start = time.perf_counter()
  outs = [compiled(*args) for _ in range(iters)]
  jax.block_until_ready(outs)
  return (time.perf_counter() - start) * 1e3 / iters


def run(args) -> dict:
  m, n, k = (int(x) for x in args.shape.lower().split("x"))
  on_gpu = jax.default_backend() == "gpu"
  devices = jax.devices()
  info = device_info()
  key = numerics.fresh_key()
  key_a, key_b = jax.random.split(key)
  # Generated on the first device; each mesh below places its own copy.
  a = numerics.random_normal(key_a, (m, k), args.dtype)
  b = numerics.random_normal(key_b, (k, n), args.dtype)
  flops = 2 * m * n * k
  tol = numerics.tolerance(args.dtype, "default", args.dtype)

  def ours(a, b):
    return pallas_gemm.matmul(a, b, kernel=args.kernel)

  def reference(a, b):
    return jnp.dot(a, b)

  rows = []
  for count in _device_counts(len(devices), args.max_devices):
    if m % count:
      rows.append(dict(devices=count, skipped=f"M={m} is not a multiple of "
                       f"{count}"))
      continue
    mesh = Mesh(devices[:count], ("data",), axis_types=(AxisType.Auto,))
    rows_sharded = NamedSharding(mesh, PartitionSpec("data", None))
    replicated = NamedSharding(mesh, PartitionSpec())
    a_d = jax.device_put(a, rows_sharded)
    b_d = jax.device_put(b, replicated)
    outputs = {}
    for name, fn in (("pallas_gemm", ours), ("jnp.dot", reference)):
      compiled = jax.jit(fn, in_shardings=(rows_sharded, replicated),
                         out_shardings=rows_sharded).lower(a_d, b_d).compile()
      out = compiled(a_d, b_d)
      outputs[name] = out
      cupti_ms, cupti_note = (_cupti_ms_per_step(compiled, (a_d, b_d),
                                                 args.iters, count)
                              if on_gpu else (None, "not a GPU"))
      wall_ms = _wall_ms_per_step(compiled, (a_d, b_d), args.iters)
      step_ms = cupti_ms if cupti_ms is not None else wall_ms
      rows.append(dict(
          devices=count, impl=name,
          kernel=args.kernel or "auto", collectives=_collectives(
              compiled.as_text()),
          cupti_ms_per_device=cupti_ms, cupti_note=cupti_note,
          wall_ms_per_step=wall_ms,
          tflops=flops / (step_ms * 1e-3) / 1e12,
          tflops_wall=flops / (wall_ms * 1e-3) / 1e12,
          output_sharding=str(out.sharding.spec)))
      del compiled
    diff = (outputs["pallas_gemm"].astype(jnp.float32) -
            outputs["jnp.dot"].astype(jnp.float32))
    err = float(jnp.linalg.norm(diff) /
                jnp.linalg.norm(outputs["jnp.dot"].astype(jnp.float32)))
    for row in rows[-2:]:
      row["relative_error_vs_jnp_dot"] = err
      row["within_tolerance"] = err <= tol
    del outputs, diff, a_d, b_d

  by_impl = {}
  for row in rows:
    if "impl" in row:
      by_impl.setdefault(row["impl"], {})[row["devices"]] = row
  for impl_rows in by_impl.values():
    base = impl_rows.get(1)
    for count, row in impl_rows.items():
      if base is not None:
        row["speedup_vs_1"] = row["tflops"] / base["tflops"]
        row["wall_speedup_vs_1"] = base["wall_ms_per_step"] / row[
            "wall_ms_per_step"]
        row["scaling_efficiency"] = row["speedup_vs_1"] / count

  return dict(
      shape=dict(m=m, n=n, k=k), dtype=args.dtype, kernel=args.kernel,
      device_kind=info.device_kind, device_count=len(devices),
      peak_tflops_per_device=(peak_tflops(info.device_kind, args.dtype)
                              if on_gpu else None),
      timing="cupti" if on_gpu else "host clock (CPU smoke run)",
      iters=args.iters, jax_version=jax.__version__,
      date=datetime.datetime.now(datetime.timezone.utc).isoformat(
          timespec="seconds"),
      tolerance=tol, rows=rows)


def to_markdown(result: dict) -> str:
  shape = result["shape"]
  lines = [
      f"# Data-parallel matmul, {shape['m']}x{shape['n']}x{shape['k']} "
      f"{result['dtype']}, A sharded by rows",
      "",
      f"{result['device_kind']} x{result['device_count']}, timing: "
      f"{result['timing']} (median of {result['iters']}), jax "
      f"{result['jax_version']}, {result['date']}.",
      "",
      "| devices | impl | ms/step (per device) | TFLOP/s | % of peak | "
      "speedup | efficiency | wall ms/step | wall speedup | collectives | "
      "rel. error |",
      "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
  ]
  for row in result["rows"]:
    if "skipped" in row:
      lines.append(f"| {row['devices']} | skipped: {row['skipped']} |"
                   " | | | | | | | | |")
      continue
    ms = row["cupti_ms_per_device"]
    ms = row["wall_ms_per_step"] if ms is None else ms
    peak = result["peak_tflops_per_device"]
    percent = (f"{row['tflops'] / (peak * row['devices']):.0%}" if peak
               else "n/a")
    lines.append(
        f"| {row['devices']} | {row['impl']} | {ms:.3f} | "
        f"{row['tflops']:.1f} | {percent} | "
        f"{row.get('speedup_vs_1', float('nan')):.2f}x "
        f"| {row.get('scaling_efficiency', float('nan')):.0%} | "
        f"{row['wall_ms_per_step']:.3f} | "
        f"{row.get('wall_speedup_vs_1', float('nan')):.2f}x | "
        f"{', '.join(row['collectives']) or 'none'} | "
        f"{row['relative_error_vs_jnp_dot']:.2e}"
        f"{'' if row['within_tolerance'] else ' (FAIL)'} |")
  return "\n".join(lines) + "\n"


def main(args):
  if args.cpu_smoke and args.shape == "16384x8192x8192":
    args.shape = "256x128x96"
  result = run(args)
  if args.output_dir is not None:
    out_dir = pathlib.Path(args.output_dir)
  elif jax.default_backend() == "gpu":
    out_dir = (_REPO_ROOT / "experiments" / "results" / device_info().key /
               "multi_gpu")
  else:
    out_dir = _REPO_ROOT / "build" / "bench" / "multi_gpu"
  out_dir.mkdir(parents=True, exist_ok=True)
  (out_dir / "multi_gpu.json").write_text(json.dumps(result, indent=2) + "\n")
  markdown = to_markdown(result)
  (out_dir / "multi_gpu.md").write_text(markdown)
  print(markdown)
  failed = [r for r in result["rows"] if r.get("within_tolerance") is False]
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main(ARGS))
