"""Does a change alter the grouped-GEMM kernels the heuristic picks? No GPU.

    PYTHONPATH=. python experiments/lab/kernel_jaxpr_identity.py --base <sha>

Traces `ragged_dot.mosaic.ragged_matmul` with the heuristic's config (for an
H200's 132 SMs) on the moe suite's shapes, both modes and the transposed
rows form, here and at `--base` (checked out into a temporary git
worktree and traced in a subprocess), and compares the jaxprs with source
locations stripped. Equal jaxprs lower to the same kernel, so GPU numbers
measured at the base still hold. Prints one line per shape and exits 1 if
any differs.
"""

from __future__ import annotations

import argparse
import hashlib
import pathlib
import re
import subprocess
import sys
import tempfile

_ROOT = pathlib.Path(__file__).resolve().parents[2]

# (mode, rows, k, n, groups, transpose_rhs): one per kind of moe layer.
SHAPES = (("rows", 16384, 2048, 1408, 60, False),
          ("rows", 16384, 1408, 2048, 60, True),
          ("rows", 32768, 7168, 2048, 256, False),
          ("rows", 16384, 4096, 14336, 8, False),
          ("contracting", 32768, 2048, 768, 128, False),
          ("contracting", 32768, 7168, 2048, 256, False),
          ("contracting", 16384, 4096, 14336, 8, False),
          # A narrow last strip (1408 columns at 192), its rows read in place.
          ("contracting", 16384, 2048, 1408, 64, False),
          ("contracting", 12282, 2048, 1408, 64, False))


def fingerprints() -> list[str]:
  """`mode rows k n groups transpose sha1` per shape, for the checkout on
  sys.path."""
  import jax
  import jax.numpy as jnp

  from pallas_gemm.devices import DeviceInfo
  from pallas_gemm.ragged_dot import configs, mosaic
  from pallas_gemm.ragged_dot.problem import RaggedProblem

  device = DeviceInfo("gpu", "NVIDIA H200", (9, 0), 132, 227 * 1024)
  spec = jax.ShapeDtypeStruct
  lines = []
  for mode, m, k, n, groups, transpose in SHAPES:
    problem = RaggedProblem(mode, m, k, n, groups, "bfloat16", "bfloat16",
                            transpose_rhs=transpose)
    config = configs.heuristic(problem, device)
    jaxpr = jax.make_jaxpr(
        lambda l, r, s, o, p=problem, c=config: mosaic.ragged_matmul(
            l, r, s, o, problem=p, config=c))(
                spec(problem.lhs_shape, problem.in_dtype),
                spec(problem.rhs_shape, problem.in_dtype),
                spec((groups,), jnp.int32), spec((1,), jnp.int32))
    text = re.sub(r"\S*\.py:\d+", "", str(jaxpr))
    digest = hashlib.sha1(text.encode()).hexdigest()[:12]
    lines.append(f"{mode} {m} {k} {n} {groups} {transpose} {digest}")
  return lines


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--base", help="the revision to compare with")
  parser.add_argument("--print_only", action="store_true",
                      help="print this checkout's fingerprints and stop")
  args = parser.parse_args(argv)
  here = fingerprints()
  if args.print_only:
    print("\n".join(here))
    return 0
  if not args.base:
    parser.error("--base is required unless --print_only")
  with tempfile.TemporaryDirectory() as tmp:
    tree = pathlib.Path(tmp) / "base"
    subprocess.run(["git", "-C", str(_ROOT), "worktree", "add", "--detach",
                    "-q", str(tree), args.base], check=True)
    try:
      # This file's tracer, with the base's package first on the path.
      code = ("import sys; sys.path[:0] = [sys.argv[1], sys.argv[2]];"
              "import kernel_jaxpr_identity as k;"
              "print(chr(10).join(k.fingerprints()))")
      result = subprocess.run(
          [sys.executable, "-c", code, str(tree), str(_ROOT / "experiments/lab")],
          cwd=tree, capture_output=True, text=True, check=True)
    finally:
      subprocess.run(["git", "-C", str(_ROOT), "worktree", "remove",
                      "--force", str(tree)], check=False)
  base = [line for line in result.stdout.splitlines() if line.strip()][-len(
      SHAPES):]
  differs = 0
  for mine, theirs in zip(here, base):
    same = mine == theirs
    differs += not same
    print(("same     " if same else "DIFFERS  ") + mine
          + ("" if same else f"  (base {theirs.split()[-1]})"))
  return 1 if differs else 0


if __name__ == "__main__":
  if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))
  sys.exit(main())
