"""`python -m pallas_gemm.ffi build [--arch 90a] [-v]`
`python -m pallas_gemm.ffi where [--arch 90a]`

build: compiles the CUDA library into the build cache ahead of first use
(or checks the one there, rebuilding it when it is corrupt) and prints
where it is, with the ptxas report (registers, shared memory, spills) when
-v. Exits 1, with the reason, when nvcc is missing or broken, a compile
fails, or the library left in the cache does not pass its check.
where: prints the cache folder of this build and which nvcc it uses.

The developer tools (compute-sanitizer driver, tuning sweep, gpu_check)
live outside the package, in experiments/lab/ffi/.
"""

from __future__ import annotations

import argparse
import sys
import warnings

from pallas_gemm.ffi import build


def _show_warning(message, category, filename, lineno, file=None, line=None):
  del category, filename, lineno, line
  print(f"warning: {message}", file=file or sys.stderr)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m pallas_gemm.ffi")
  commands = parser.add_subparsers(dest="command", required=True)
  build_parser = commands.add_parser("build", help="compile into the cache")
  build_parser.add_argument("--arch", default=None,
                            help="e.g. 90a, 89, 80 (default: the GPU's)")
  build_parser.add_argument("-v", "--verbose", action="store_true")
  where_parser = commands.add_parser(
      "where", help="print the cache folder of this build and its nvcc")
  where_parser.add_argument("--arch", default=None)
  args = parser.parse_args(argv)
  with warnings.catch_warnings():
    warnings.showwarning = _show_warning
    return _run(args)


def _run(args) -> int:
  try:
    if args.arch:
      args.arch = build.normalize_arch(args.arch, "--arch")
    if args.command == "where":
      plan = build.plan_build(args.arch)
      print(plan.folder)
      print(f"nvcc: {plan.nvcc} ({plan.toolkit.origin}; "
            f"{plan.toolkit.version})")
      return 0
    plan = build.compile_library(args.arch)
  except build.BuildError as error:
    print(f"error: {error}", file=sys.stderr)
    return 1
  problem = build.build_problem(plan.folder)
  if problem is not None:
    print(f"error: {plan.library} is invalid after the build: {problem}",
          file=sys.stderr)
    return 1
  print(plan.folder)
  if args.verbose:
    print((plan.folder / "ptxas.log").read_text())
  return 0


if __name__ == "__main__":
  sys.exit(main())
