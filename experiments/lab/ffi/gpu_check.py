"""One GPU session's worth of evidence for the ffi/* kernels.

    PYTHONPATH=. python3 experiments/lab/ffi/gpu_check.py --out DIR [--quick]

(from the repository root). Steps, each written to DIR:
  1. build (with PTX/SASS kept) and the sanitizer driver (programs.py);
     ptxas.log holds registers, shared memory and spills per kernel;
  2. the standalone driver (sanitizer_driver.cu beside this file) plain, then under
     compute-sanitizer memcheck and racecheck: sanitizer.txt;
  3. SASS evidence for the tensor-core kernel (HMMA, LDSM, no LDL/STL local
     memory traffic): sass_summary.txt;
  4. CUPTI timings (median of >= 20 after a warm-up; random-normal inputs):
     every SIMT rung at 4096^3 float32 against jnp.dot(precision=HIGHEST),
     mma_sync at 4096^3 and 8192^3 bf16 against jnp.dot bf16: timings.json
     and a table in gpu_check.txt.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import time


def _log(out_dir: pathlib.Path, text: str) -> None:
  print(text, flush=True)
  with open(out_dir / "gpu_check.txt", "a") as f:
    f.write(text + "\n")


def _sanitizer() -> str | None:
  found = shutil.which("compute-sanitizer")
  if found:
    return found
  for candidate in ("/usr/local/cuda/bin/compute-sanitizer",
                    "/usr/local/cuda/compute-sanitizer/compute-sanitizer"):
    if os.path.exists(candidate):
      return candidate
  return None


def run_sanitizers(driver: pathlib.Path, out_dir: pathlib.Path,
                   timeout: int, tools: list[str]) -> None:
  driver = str(driver)
  sanitizer = _sanitizer() if tools else None
  commands = [("plain", [driver])]
  if not tools:
    _log(out_dir, "no compute-sanitizer tools asked for; ran the driver plain")
  elif sanitizer:
    for tool in tools:
      commands.append((tool, [sanitizer, "--tool", tool,
                              "--error-exitcode", "3", driver]))
  else:
    _log(out_dir, "compute-sanitizer not found; ran the driver plain only")
  with open(out_dir / "sanitizer.txt", "w") as f:
    for label, command in commands:
      start = time.time()
      try:
        result = subprocess.run(command, capture_output=True, text=True,
                                timeout=timeout)
        output, code = result.stdout + result.stderr, result.returncode
      except subprocess.TimeoutExpired as e:
        output, code = f"timed out after {timeout}s: {e}", "timeout"
      shown = " ".join(os.path.basename(part) for part in command)
      f.write(f"==== {label}: {shown}\n{output}\n"
              f"exit={code} ({time.time() - start:.1f}s)\n\n")
      f.flush()
      summary = [line for line in output.splitlines()
                 if "ERROR SUMMARY" in line or "RACECHECK SUMMARY" in line
                 or "ALL OK" in line or "FAIL" in line]
      _log(out_dir, f"[{label}] exit={code}: " + " | ".join(summary[-3:]))


def summarize_sass(plan, out_dir: pathlib.Path) -> None:
  sass_path = plan.folder / "sass.txt"
  if not sass_path.exists():
    _log(out_dir, "no sass.txt (set PALLAS_GEMM_KEEP_PTX=1)")
    return
  functions: dict[str, list[str]] = {}
  current = None
  for line in sass_path.read_text().splitlines():
    match = re.search(r"Function : (\S+)", line)
    if match:
      current = match.group(1)
      functions[current] = []
    elif current:
      functions[current].append(line)
  lines = []
  for name, body in sorted(functions.items()):
    text = "\n".join(body)
    counts = {op: len(re.findall(rf"\b{op}\b", text))
              for op in ("HMMA", "LDSM", "LDGSTS", "FFMA", "LDL", "STL",
                         "LDS", "STS")}
    lines.append(f"{name}: " + ", ".join(f"{k}={v}" for k, v in counts.items()))
  (out_dir / "sass_summary.txt").write_text("\n".join(lines) + "\n")
  _log(out_dir, "SASS op counts per kernel:\n" + "\n".join(lines))


def time_kernels(out_dir: pathlib.Path, quick: bool) -> dict:
  import jax
  import jax.numpy as jnp
  from pallas_gemm import timing

  import pallas_gemm
  from pallas_gemm import numerics
  from pallas_gemm.ffi.kernels import (MMA_SYNC_VARIANTS, SGEMM_LADDER,
                                       MmaSyncConfig)

  def median_ms(fn, args, iterations):
    return timing.median_time_ms(fn, args, iterations=iterations, on_gpu=True)

  def operands(size, dtype):
    key = numerics.fresh_key(0)
    ka, kb = jax.random.split(key)
    return (numerics.random_normal(ka, (size, size), dtype),
            numerics.random_normal(kb, (size, size), dtype))

  results = {"float32": {}, "bfloat16": {}}
  size = 4096
  a, b = operands(size, jnp.float32)
  flops = 2 * size**3
  reference = jax.jit(lambda a, b: jnp.dot(
      a, b, precision=jax.lax.Precision.HIGHEST))
  ref_ms = median_ms(reference, (a, b), 20)
  results["float32"][f"jnp.dot HIGHEST {size}"] = ref_ms
  _log(out_dir, f"{'kernel':34s} {'size':>6s} {'ms':>9s} {'TFLOP/s':>8s} "
       f"{'x ref':>6s}")
  _log(out_dir, f"{'jnp.dot(HIGHEST) f32':34s} {size:6d} {ref_ms:9.3f} "
       f"{flops / ref_ms / 1e9:8.1f} {1.0:6.2f}")
  for kernel in SGEMM_LADDER:
    name = kernel.registry_name
    fn = jax.jit(lambda a, b, name=name: pallas_gemm.matmul(
        a, b, kernel=name, precision=jax.lax.Precision.HIGHEST))
    slow = name.endswith(("01_naive", "02_coalesced"))
    if quick and slow:
      continue
    ms = median_ms(fn, (a, b), 5 if slow else 20)
    results["float32"][f"{name} {size}"] = ms
    _log(out_dir, f"{name:34s} {size:6d} {ms:9.3f} {flops / ms / 1e9:8.1f} "
         f"{ref_ms / ms:6.2f}")
  del a, b

  for size in (4096, 8192):
    flops = 2 * size**3
    a, b = operands(size, jnp.bfloat16)
    ref_ms = median_ms(jax.jit(jnp.dot), (a, b), 20)
    results["bfloat16"][f"jnp.dot bf16 {size}"] = ref_ms
    _log(out_dir, f"{'jnp.dot bf16':34s} {size:6d} {ref_ms:9.3f} "
         f"{flops / ref_ms / 1e9:8.1f} {1.0:6.2f}")
    for variant in sorted(MMA_SYNC_VARIANTS):
      config = MmaSyncConfig(*variant)
      fn = jax.jit(lambda a, b, config=config: pallas_gemm.matmul(
          a, b, kernel="ffi/mma_sync", config=config))
      ms = median_ms(fn, (a, b), 20)
      label = f"mma_sync {config.label}"
      results["bfloat16"][f"{label} {size}"] = ms
      _log(out_dir, f"{label:34s} {size:6d} {ms:9.3f} "
           f"{flops / ms / 1e9:8.1f} {ref_ms / ms:6.2f}")
    del a, b

  if not quick:
    size = 8192
    flops = 2 * size**3
    a, b = operands(size, jnp.float32)
    ref_ms = median_ms(reference, (a, b), 20)
    results["float32"][f"jnp.dot HIGHEST {size}"] = ref_ms
    _log(out_dir, f"{'jnp.dot(HIGHEST) f32':34s} {size:6d} {ref_ms:9.3f} "
         f"{flops / ref_ms / 1e9:8.1f} {1.0:6.2f}")
    for name in ("ffi/sgemm_07_double_buffered", "ffi/sgemm_08_warptile",
                 "ffi/sgemm_09_two_blocks_per_sm", "ffi/sgemm_10_pipelined"):
      fn = jax.jit(lambda a, b, name=name: pallas_gemm.matmul(
          a, b, kernel=name, precision=jax.lax.Precision.HIGHEST))
      ms = median_ms(fn, (a, b), 20)
      results["float32"][f"{name} {size}"] = ms
      _log(out_dir, f"{name:34s} {size:6d} {ms:9.3f} "
           f"{flops / ms / 1e9:8.1f} {ref_ms / ms:6.2f}")
  return results


def main(argv=None) -> int:
  parser = argparse.ArgumentParser()
  parser.add_argument("--out", default=os.environ.get("OUT", "."))
  parser.add_argument("--quick", action="store_true",
                      help="skip the slowest rungs and the 8192^3 f32 runs")
  parser.add_argument("--skip", default="",
                      help="comma list of steps to skip: sanitize,sass,time")
  parser.add_argument("--sanitizer-timeout", type=int, default=120)
  parser.add_argument("--sanitizer-tools", default="memcheck,racecheck",
                      help="compute-sanitizer tools to run the driver under "
                      "after its plain run; 'none' for the plain run only")
  args = parser.parse_args(argv)
  out_dir = pathlib.Path(args.out)
  out_dir.mkdir(parents=True, exist_ok=True)
  skip = set(filter(None, args.skip.split(",")))
  os.environ.setdefault("PALLAS_GEMM_KEEP_PTX", "1")

  import jax
  import jaxlib
  from experiments.bench.output import git_revision
  from experiments.lab.ffi import programs
  from pallas_gemm.devices import device_info
  from pallas_gemm.ffi import build

  info = device_info()
  _log(out_dir, f"device: {info.device_kind} cc={info.compute_capability} "
       f"sms={info.num_sms}; jax {jax.__version__}, jaxlib "
       f"{jaxlib.__version__}; git {git_revision()}")
  _log(out_dir, "command: python3 experiments/lab/ffi/gpu_check.py "
       + " ".join(argv or sys.argv[1:]))
  start = time.time()
  plan = build.compile_library()
  driver = programs.sanitizer_driver(plan.arch)
  _log(out_dir, f"built {plan.key} and the sanitizer driver with "
       f"{plan.toolkit.version} ({plan.toolkit.origin}) in "
       f"{time.time() - start:.1f}s")
  shutil.copy2(plan.folder / "ptxas.log", out_dir / "ptxas.log")
  if "sanitize" not in skip:
    tools = [] if args.sanitizer_tools == "none" else [
        t for t in args.sanitizer_tools.split(",") if t]
    run_sanitizers(driver, out_dir, args.sanitizer_timeout, tools)
  if "sass" not in skip:
    summarize_sass(plan, out_dir)
  if "time" not in skip:
    results = time_kernels(out_dir, args.quick)
    (out_dir / "timings.json").write_text(json.dumps(
        {"device": info.device_kind, "jax": jax.__version__,
         "git": git_revision(), "median_ms": results}, indent=2))
  return 0


if __name__ == "__main__":
  sys.exit(main())
