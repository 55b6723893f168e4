"""What ptxas made of a Mosaic kernel: registers, spills, wgmma serialisation
warnings, and a static SASS opcode count per case.

Mosaic GPU compiles PTX to a cubin in-process; with `MOSAIC_GPU_DUMP_PTXAS`,
`MOSAIC_GPU_DUMP_SASS` and `MOSAIC_GPU_DUMP_TO=<dir>` set before jax starts
it writes ptxas's verbose report and the SASS there. This script sets them,
compiles (and runs once) each named case in a fresh sub-folder, and prints a
digest per case:

  - every ptxas line that mentions registers, spills or "wgmma" (ptxas warns
    when it has to serialise wgmma.mma_async, which costs the overlap the
    kernel was written for);
  - counts of the SASS opcodes that matter for a GEMM main loop (HGMMA,
    WARPGROUP.DEPBAR/ARRIVE, FFMA/FMUL/FADD, LDS, SYNCS, spills LDL/STL).

Usage (repository root on PYTHONPATH, on a GPU):

  python experiments/lab/mosaic_ptxas.py --out DIR [--cases a,b,...]

Cases: fp8_block_g2, fp8_block_g1, fp8_tensor, fp8_tensor_64x128 (per
tensor, on the block-wise heuristic's tile: the difference to fp8_block_g2 is
what promotion costs), bf16_ws, ragged_qwen. `--case NAME` compiles and runs
one case without dumping: `mosaic_ncu.sh` profiles it so.

`--ragged "LABEL|FIELDS;..."` compiles grouped-GEMM cases instead: a `moe`
case label and RaggedConfig fields over the heuristic's (as in a
`ragged_pairs` plan line; empty fields for the heuristic's own), e.g.
`--ragged "qwen3_30b_a3b_down even forward|;qwen3_30b_a3b_down even
forward|token_width_step=64"`. Each digest also gives the kernel's PTX
line count and its static SASS instruction count (where a SASS dump is
written), a measure of what the instruction cache holds.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import pathlib
import re
import sys

CASES = ("fp8_block_g2", "fp8_block_g1", "fp8_tensor", "fp8_tensor_64x128",
         "bf16_ws", "ragged_qwen")
#: SASS opcodes (the first dotted word) worth counting in a GEMM.
OPCODES = ("HGMMA", "WARPGROUP", "FFMA", "FMUL", "FADD", "LDS", "STS", "LDG",
           "STG", "LDL", "STL", "SYNCS", "BAR", "UTMALDG", "UTMASTG", "MOV",
           "F2FP", "BRA", "ISETP")


def _compile_case(name: str):
  import jax
  import jax.numpy as jnp

  import pallas_gemm
  from pallas_gemm.devices import device_info
  from pallas_gemm.fp8 import quantize_fp8
  from pallas_gemm.mosaic_backend.fp8_config import fp8_heuristic
  from pallas_gemm.problem import GemmProblem
  key = jax.random.key(0)
  if name.startswith("fp8"):
    m = n = k = 4096
    block = name.startswith("fp8_block")
    x = jax.random.normal(key, (m, k), jnp.float32)
    w = jax.random.normal(jax.random.fold_in(key, 1), (n, k), jnp.float32)
    qa, sa = quantize_fp8(x, block=(1, 128) if block else None)
    qb, sb = quantize_fp8(w, block=(128, 128) if block else None)
    mode = "block" if block else "tensor"
    problem = GemmProblem(1, m, n, k, "float8_e4m3fn", "bfloat16",
                          transpose_b=True, a_scale_mode=mode,
                          b_scale_mode=mode)
    config = fp8_heuristic(problem, device_info())
    if name == "fp8_tensor_64x128":
      block_problem = dataclasses.replace(problem, a_scale_mode="block",
                                          b_scale_mode="block")
      config = dataclasses.replace(fp8_heuristic(block_problem, device_info()),
                                   promote_group=1)
    if name == "fp8_block_g1":
      config = dataclasses.replace(config, promote_group=1)
    print(f"{name}: {config}", flush=True)
    out = pallas_gemm.matmul(qa, qb, a_scale=sa, b_scale=sb, transpose_b=True,
                             kernel="mosaic/fp8", config=config,
                             preferred_element_type=jnp.bfloat16)
  elif name == "bf16_ws":
    a = jax.random.normal(key, (4096, 4096), jnp.bfloat16)
    out = pallas_gemm.matmul(a, a, kernel="mosaic/ws_persistent")
  elif name == "ragged_qwen":
    groups, tokens, k, n = 60, 16384, 2048, 1408
    lhs = jax.random.normal(key, (tokens, k), jnp.bfloat16)
    rhs = jax.random.normal(key, (groups, k, n), jnp.bfloat16)
    sizes = jnp.full((groups,), tokens // groups, jnp.int32)
    sizes = sizes.at[0].add(tokens - int(sizes.sum()))
    out = pallas_gemm.ragged_dot(lhs, rhs, sizes, kernel="mosaic")
  elif name.startswith("ragged|"):
    from experiments import bench_moe
    from experiments.lab.ragged_profile_case import _call, find_case
    _, label, fields = name.split("|")
    case = find_case(label)
    fn, _ = _call(case.problem, "mosaic", fields)
    operands = bench_moe.operand_sets(case.problem, case.group_sizes(), 1,
                                      case.seed)[0]
    out = fn(*operands)
  else:
    raise ValueError(f"unknown case {name!r}; known: {CASES}")
  jax.block_until_ready(out)


def _digest(folder: pathlib.Path, stdout_text: str) -> str:
  lines = []
  dumps = [(p, p.read_text(errors="replace"))
           for p in sorted(folder.rglob("*")) if p.is_file()]
  for text in [stdout_text] + [text for _, text in dumps]:
    for line in text.splitlines():
      low = line.lower()
      if ("registers" in low or "spill" in low or "wgmma" in low
          and ("serial" in low or "warning" in low) or "warning" in low):
        lines.append("  ptxas: " + line.strip()[:300])
  counts = collections.Counter()
  total = ptx_lines = 0
  for path, text in dumps:
    text_lines = text.splitlines()
    if path.suffix == ".ptx":
      ptx_lines += len(text_lines)
    for line in text_lines:
      match = re.match(r"\s*/\*[0-9a-f]+\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_]+)",
                       line)
      if match:
        total += 1
      if match and match.group(2).split(".")[0] in OPCODES:
        counts[match.group(2).split(".")[0]] += 1
  lines.append(f"  PTX lines: {ptx_lines}; SASS instructions: {total}")
  lines.append("  SASS opcodes: " + ", ".join(
      f"{op} {counts[op]}" for op in OPCODES if counts[op]))
  files = [path.name for path, _ in dumps]
  lines.append(f"  dump files: {files[:12]}")
  return "\n".join(dict.fromkeys(lines))


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out")
  parser.add_argument("--cases", default=",".join(CASES))
  parser.add_argument("--case", help="compile and run this one case here")
  parser.add_argument("--ragged", default="", help=(
      "';'-separated grouped-GEMM cases, each 'moe case label|RaggedConfig "
      "fields', instead of --cases"))
  args = parser.parse_args()
  if args.case:
    _compile_case(args.case)
    return
  import subprocess
  if not args.out:
    parser.error("--out is required")
  root = pathlib.Path(args.out)
  names = ([f"ragged|{entry}" for entry in args.ragged.split(";")]
           if args.ragged else args.cases.split(","))
  for name in names:
    folder = root / re.sub(r"[^A-Za-z0-9_.=-]+", "_", name)
    folder.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, MOSAIC_GPU_DUMP_PTXAS="1", MOSAIC_GPU_DUMP_SASS="1",
               MOSAIC_GPU_DUMP_TO=str(folder))
    proc = subprocess.run([sys.executable, __file__, "--out", str(root),
                           "--case", name], env=env, capture_output=True,
                          text=True, timeout=400)
    (folder / "stdout.txt").write_text(proc.stdout + proc.stderr)
    print(f"== {name}: exit {proc.returncode}", flush=True)
    if proc.returncode:
      print(proc.stderr[-2000:], flush=True)
    print(_digest(folder, ""), flush=True)


if __name__ == "__main__":
  main()
