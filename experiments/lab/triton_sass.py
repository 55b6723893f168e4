"""Which MMA instructions a `triton/06_tuned` kernel compiles to, no GPU needed.

    PYTHONPATH=. python experiments/lab/triton_sass.py --case tf32:NN --k-major \
        --triton-python /path/to/venv-with-triton/bin/python

Step 1 (JAX, any machine): lowers the Pallas kernel for CUDA sm_90 and
captures the Triton IR (TTIR) that Pallas hands to XLA. Step 2 (the `triton`
Python package, e.g. `pip install triton==3.6.0` in a separate venv; it
carries ptxas and cuobjdump): compiles that TTIR for sm_90a and counts the
MMA and copy instructions in TTGIR, PTX and SASS.

Why not XLA's own dump: with jaxlib 0.11.2, `--xla_dump_to` wrote HLO and
thunk files but no PTX for the Triton custom call (see
results/nvidia_h200/triton/xla_dump_attempt.txt). The pip Triton is not the
Triton build inside jaxlib, so treat the counts as evidence of what the TTIR
asks for, not as XLA's exact binary. Step 2 runs Triton's own TTIR passes
first, as XLA does. It does not run the pass XLA adds in front of them,
which rounds every operand of a TF32 dot to TF32 (`cvt.rna`) and so routes
both operands through registers: for TF32 the binary XLA runs differs a lot.
`triton_ncu.sh` profiles that binary on the GPU; use it for the real SASS.
"""

from __future__ import annotations

import argparse
import pathlib
import subprocess
import sys
import tempfile
import types
import warnings

warnings.filterwarnings("ignore", category=DeprecationWarning)

COMPILE_SNIPPET = r'''
import os, subprocess, sys
import triton
from triton._C.libtriton import ir
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import CUDABackend
path, warps, stages = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
target = GPUTarget("cuda", 90, 32)
options = {"num_warps": warps, "num_stages": stages}
# triton.compile starts a .ttir file *after* make_ttir; XLA runs those passes
# (canonicalize, combine: acc + dot(a, b, 0) -> dot(a, b, acc), ...) on the
# TTIR Pallas hands it, so run them here too before compiling.
context = ir.context()
ir.load_dialects(context)
backend = CUDABackend(target)
backend.load_dialects(context)
module = ir.parse_mlir_module(path, context)
module.context = context
module = CUDABackend.make_ttir(module, {}, backend.parse_options(options),
                               target.arch)
path = path.replace(".ttir", ".combined.ttir")
open(path, "w").write(str(module))
kernel = triton.compile(path, target=target, options=options)
ttgir, ptx = kernel.asm["ttgir"], kernel.asm["ptx"]
cubin = path + ".cubin"
open(cubin, "wb").write(kernel.asm["cubin"])
tool = os.path.join(os.path.dirname(triton.__file__),
                    "backends/nvidia/bin/cuobjdump")
sass = subprocess.run([tool, "--dump-sass", cubin], capture_output=True,
                      text=True).stdout
def count(text, *words):
  return "  ".join(f"{w}={text.count(w)}" for w in words)
usage = subprocess.run([tool, "--dump-resource-usage", cubin],
                       capture_output=True, text=True).stdout
print("triton", triton.__version__, " shared bytes:", kernel.metadata.shared)
print("resources:", " ".join(
    line.strip() for line in usage.splitlines() if "REG" in line))
print("TTGIR:", count(ttgir, "warp_group_dot", "async_copy_global_to_local",
                      "local_alloc"))
print("PTX:  ", count(ptx, "wgmma.mma_async", "mma.sync", "cp.async.cg",
                      "cp.async.ca", "cp.async.bulk.tensor"))
print("SASS: ", count(sass, "HGMMA", "HMMA", "FFMA", "LDGSTS", "UTMALDG"))
import collections, re
shared_loads = collections.Counter(re.findall(r"\b(LDS(?:\.[A-Z0-9]+)*)", sass))
print("SASS shared loads:", dict(sorted(shared_loads.items())))
for line in ttgir.splitlines():
  if line.startswith("#blocked"):
    print("  ", line)
for line in ttgir.splitlines():
  if line.startswith("#") and ("nvmma_shared" in line or "nvidia_mma" in line):
    print("  ", line)
for line in sass.splitlines():
  if "HGMMA" in line or "HMMA" in line:
    print("  first MMA:", " ".join(line.split()[1:5]))
    break
'''


def lower_to_ttir(problem, config) -> str:
  """The TTIR of the (last) Triton kernel in 06_tuned for this problem."""
  import jax
  from jax._src.pallas.triton import pallas_call_registration as registration
  from pallas_gemm.triton_backend import k06_tuned

  captured = []
  original = registration.lowering.lower_jaxpr_to_triton_module

  def capture(*args, **kwargs):
    result = original(*args, **kwargs)
    captured.append(result.module.operation.get_asm(enable_debug_info=False))
    return result

  class Sm90:
    compute_capability = "9.0"

  registration.lowering.lower_jaxpr_to_triton_module = capture
  saved_info = registration.gpu_info_lib
  # Cross-lowering on a machine without a GPU: tell Pallas the target.
  registration.gpu_info_lib = types.SimpleNamespace(get_gpu_info=Sm90)
  try:
    a_shape = ((1, problem.k, problem.m) if problem.transpose_a
               else (1, problem.m, problem.k))
    b_shape = ((1, problem.n, problem.k) if problem.transpose_b
               else (1, problem.k, problem.n))
    f = jax.jit(lambda a, b: k06_tuned.tuned_matmul(
        a, b, None, None, problem=problem, config=config, interpret=False))
    f.trace(jax.ShapeDtypeStruct(a_shape, problem.in_dtype),
            jax.ShapeDtypeStruct(b_shape, problem.in_dtype)).lower(
                lowering_platforms=("cuda",))
  finally:
    registration.lowering.lower_jaxpr_to_triton_module = original
    registration.gpu_info_lib = saved_info
  if not captured:
    raise RuntimeError("no Triton kernel was lowered")
  return captured[-1]


def case_problem(case: str, dims):
  """The problem for `--case` FAMILY:LAYOUT (FAMILY in bf16, tf32, ieee;
  LAYOUT in NN, NT, TN, TT) at dims (M, N, K)."""
  from pallas_gemm.problem import GemmProblem

  family, _, layout = case.partition(":")
  if family not in ("bf16", "tf32", "ieee") or layout not in (
      "NN", "NT", "TN", "TT"):
    raise ValueError(f"--case={case!r} must look like tf32:NN")
  dtype = "bfloat16" if family == "bf16" else "float32"
  precision = {"bf16": "default"}.get(family, family)
  m, n, k = dims
  return GemmProblem(1, m, n, k, dtype, dtype, transpose_a=layout[0] == "T",
                     transpose_b=layout[1] == "T", precision=precision)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--case", default="tf32:NN",
                      help="FAMILY:LAYOUT, FAMILY in bf16, tf32, ieee")
  parser.add_argument("--size", type=int, default=4096)
  parser.add_argument("--block", default="128x128x32")
  parser.add_argument("--num-warps", type=int, default=4)
  parser.add_argument("--num-stages", type=int, default=4)
  parser.add_argument("--k-major", action="store_true")
  parser.add_argument("--triton-python", default=None,
                      help="python with the `triton` package (step 2)")
  parser.add_argument("--keep", default=None, help="folder to keep the TTIR")
  args = parser.parse_args(argv)

  from pallas_gemm.triton_backend.common import TritonConfig

  try:
    problem = case_problem(args.case, (args.size,) * 3)
  except ValueError as err:
    parser.error(str(err))
  family, _, layout = args.case.partition(":")
  bm, bn, bk = (int(x) for x in args.block.split("x"))
  config = TritonConfig(bm, bn, bk, num_warps=args.num_warps,
                        num_stages=args.num_stages, group_m=8,
                        k_major=args.k_major)
  ttir = lower_to_ttir(problem, config)
  folder = pathlib.Path(args.keep or tempfile.mkdtemp())
  folder.mkdir(parents=True, exist_ok=True)
  name = f"{family}_{layout}{'_kmajor' if args.k_major else ''}"
  path = folder / f"{name}.ttir"
  path.write_text(ttir)
  print(f"{name}: {problem.describe()} {config}")
  print("TTIR dot:", [l.strip() for l in ttir.splitlines() if "tt.dot" in l])
  if args.triton_python:
    out = subprocess.run(
        [args.triton_python, "-c", COMPILE_SNIPPET, str(path),
         str(args.num_warps), str(args.num_stages)],
        capture_output=True, text=True)
    print(out.stdout, out.stderr[-2000:] if out.returncode else "", sep="")
    return out.returncode
  return 0


if __name__ == "__main__":
  sys.exit(main())
