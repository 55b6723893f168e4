"""`python -m pallas_gemm.ffi build [--arch 90a] [--driver] [-v]`
`python -m pallas_gemm.ffi sweep [--arch 90a] [-- sweep arguments]`

build: compiles the CUDA library into the cache ahead of first use and
prints where it is, with the ptxas report (registers, shared memory, spills)
when -v.
sweep: compiles the tuning sweep (csrc/sweep_driver.cu, with every kernel's
sweep-only candidates) and runs it on the GPU; arguments after `--` go to
the program (--sizes, --filter, --iters, --json).
"""

from __future__ import annotations

import argparse
import subprocess
import sys

from pallas_gemm.ffi import build


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m pallas_gemm.ffi")
  commands = parser.add_subparsers(dest="command", required=True)
  build_parser = commands.add_parser("build", help="compile into the cache")
  build_parser.add_argument("--arch", default=None,
                            help="e.g. 90a, 89, 80 (default: the GPU's)")
  build_parser.add_argument("--driver", action="store_true",
                            help="also build the compute-sanitizer driver")
  build_parser.add_argument("-v", "--verbose", action="store_true")
  commands.add_parser("where", help="print the cache folder of this build")
  sweep_parser = commands.add_parser(
      "sweep", help="build and run the tuning sweep on the GPU")
  sweep_parser.add_argument("--arch", default=None)
  sweep_parser.add_argument("program_args", nargs=argparse.REMAINDER)
  args = parser.parse_args(argv)
  try:
    if args.command == "where":
      print(build.plan_build().folder)
      return 0
    if args.command == "sweep":
      program = build.compile_sweep(args.arch)
      program_args = [a for a in args.program_args if a != "--"]
      sys.stdout.flush()
      return subprocess.run([str(program), *program_args]).returncode
    plan = build.compile_library(args.arch, with_driver=args.driver)
  except (build.NvccNotFoundError, build.BuildError) as error:
    print(error, file=sys.stderr)
    return 1
  print(plan.folder)
  if args.verbose:
    print((plan.folder / "ptxas.log").read_text())
  return 0


if __name__ == "__main__":
  sys.exit(main())
