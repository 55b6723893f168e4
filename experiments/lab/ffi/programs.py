"""Builds the standalone CUDA developer programs of this folder.

    PYTHONPATH=. python3 experiments/lab/ffi/programs.py sanitizer_driver
    PYTHONPATH=. python3 experiments/lab/ffi/programs.py sweep

Each is linked with every kernel source of pallas_gemm/ffi/csrc/ (whose
kernels.def declares their launchers here too) and cached next to the
library in the build cache; the command prints the program's path.
  sanitizer_driver: every launcher once on ragged shapes against a CPU
    reference, the target for compute-sanitizer (gpu_check.py runs it);
  sweep: the tuning sweep (sweep_driver.cu), with the kernels compiled with
    -DPALLAS_GEMM_SWEEP so their sweep-only candidates (csrc/sweep.cuh)
    exist. Its arguments: --sizes, --filter, --iters, --json, --ceiling.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent


def sanitizer_driver(arch: str | None = None) -> pathlib.Path:
  from pallas_gemm.ffi import build
  return build.compile_program("sanitizer_driver",
                               [HERE / "sanitizer_driver.cu"], arch=arch)


def sweep_program(arch: str | None = None) -> pathlib.Path:
  from pallas_gemm.ffi import build
  return build.compile_program("ffi_sweep", [HERE / "sweep_driver.cu"],
                               arch=arch, defines=("PALLAS_GEMM_SWEEP",))


def main(argv=None) -> int:
  parser = argparse.ArgumentParser()
  parser.add_argument("program", choices=("sanitizer_driver", "sweep"))
  parser.add_argument("--arch", default=None, help="e.g. 90a (default: the "
                      "GPU's, else 90a)")
  args = parser.parse_args(argv)
  from pallas_gemm.ffi import build
  try:
    if args.program == "sweep":
      path = sweep_program(args.arch)
    else:
      path = sanitizer_driver(args.arch)
  except build.BuildError as error:
    print(f"error: {error}", file=sys.stderr)
    return 1
  print(path)
  return 0


if __name__ == "__main__":
  sys.exit(main())
