"""Which kernels XLA launches for `bench_moe.py`'s `batched` target (the
vendor library's dense products for a routing known in advance), beside
ours, with each kernel's CUPTI median: cuBLAS's kernel names carry its
tile shape and cluster, the first thing to compare where the batched GEMM
is faster than the grouped one (experiments/results/nvidia_h200/
moe_vendor_844ccfc).

    PYTHONPATH=. python3 experiments/lab/vendor_kernels.py \
        --case "qwen1.5_moe_up even forward" --case "qwen1.5_moe_up even drhs"

A case is `<layer> <distribution> <direction>` as `bench_moe.py` labels
it; `batched` has a product for the even routing and the one-hot weight
gradient only. Both products are checked against float64 first. On a CPU
it checks a small layer's products and prints no timings.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

import jax  # noqa: E402

from experiments import bench_moe  # noqa: E402
from experiments.lab.ragged_profile_case import find_case  # noqa: E402
from pallas_gemm import timing  # noqa: E402


def _first_set(problem, shapes, seed):
  return bench_moe._normal_pairs(jax.random.key(seed), *shapes,
                                 problem.in_dtype, 1)[0]


def report(label: str, iterations: int, on_gpu: bool) -> None:
  case = find_case(label)
  problem, distribution = case.problem, case.distribution
  ours = jax.jit(bench_moe.target_call("auto", problem))
  ours_args = tuple(bench_moe.operand_sets(problem, case.group_sizes(), 1,
                                           case.seed)[0])
  vendor = jax.jit(bench_moe.batched_call(problem, distribution))
  vendor_args = _first_set(problem, bench_moe.batched_shapes(
      problem, distribution), case.seed + 2)
  errors = (bench_moe.check_error(problem, *ours_args, ours(*ours_args)),
            bench_moe.batched_error(problem, distribution, *vendor_args,
                                    vendor(*vendor_args)))
  print(f"{label}: relative error auto {errors[0]:.1e}, batched "
        f"{errors[1]:.1e}", flush=True)
  if not on_gpu:
    return
  for name, fn, args in (("auto", ours, ours_args),
                         ("batched", vendor, vendor_args)):
    for kernel, us in timing.kernel_medians_us(fn, args,
                                               iterations=iterations):
      print(f"{label}: {name}: {us:9.1f} us  {kernel}", flush=True)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--case", action="append", required=True,
                      help="a bench_moe case label; repeat for more")
  parser.add_argument("--iters", type=int, default=10,
                      help="CUPTI calls per product (GPU only)")
  args = parser.parse_args(argv)
  if args.iters < 1:
    parser.error(f"--iters={args.iters} must be at least 1")
  for label in args.case:
    case = find_case(label)
    if not bench_moe.batched_applies(case.distribution, case.direction):
      parser.error(f"--case {label!r}: `batched` has no product for a "
                   f"{case.distribution} {case.direction} (even routings "
                   f"and the one-hot drhs only)")
  on_gpu = jax.default_backend() == "gpu"
  for label in args.case:
    # On a CPU: a small layer, with the asked-for distribution and direction.
    report(label if on_gpu else
           " ".join(["small_g8_odd"] + label.split()[-2:]),
           args.iters, on_gpu)


if __name__ == "__main__":
  main()
