"""Where does a GLU forward + backward spend its time, kernel by kernel,
for the fused Mosaic forward and for XLA's pair form (issue #20)?

    PYTHONPATH=. python3 experiments/lab/glu_kernel_breakdown.py \
        [--shapes 8192x11008x4096,4096x11008x4096] [--iters 10]

For each M x N x K (x: M x K, each weight K x N, silu, bf16) both programs
are jitted once and run `--iters` times under CUPTI
(`pallas_gemm.timing.cupti_samples_ms`, per kernel). Each kernel launch is
listed in launch order with its median time over the calls, then the sum:
what the forward saves and whether the backward's kernels are the same as
XLA's. One operand set is used (all operands are far larger than L2). On a
CPU it runs one tiny shape in interpret mode as a smoke test (times mean
nothing there).
"""

from __future__ import annotations

import argparse
import pathlib
import sys

_ROOT = pathlib.Path(__file__).resolve().parents[2]
if str(_ROOT) not in sys.path:
  sys.path.insert(0, str(_ROOT))

import jax  # noqa: E402

from experiments.bench_glu import (_forward_fn, _operand_sets,  # noqa: E402
                                   _timed_fn)
from pallas_gemm import timing  # noqa: E402
from pallas_gemm.shapes import parse_shapes  # noqa: E402

#: The two programs compared: the fused Mosaic forward, and XLA's pair form
#: `silu(x @ wg) * (x @ wu)`, each with its autodiff backward.
TARGETS = ("mosaic", "xla")


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--shapes", default="8192x11008x4096,4096x11008x4096")
  parser.add_argument("--iters", type=int, default=10)
  args = parser.parse_args(argv)
  on_gpu = jax.default_backend() == "gpu"
  shapes = parse_shapes(args.shapes)
  if not on_gpu:
    print("no GPU: one tiny shape in interpret mode, times mean nothing")
    shapes = [(64, 128, 64)]
  for m, n, k in shapes:
    operands = _operand_sets(m, n, k, False, 1, 0)[0]
    totals = {}
    for name in TARGETS:
      fn = jax.jit(_timed_fn(_forward_fn(name, "silu", False), "fwd+bwd"))
      if on_gpu:
        kernels = timing.kernel_medians_us(fn, operands,
                                           iterations=args.iters)
      else:
        jax.block_until_ready(fn(*operands))
        kernels = []
      totals[name] = sum(us for _, us in kernels)
      print(f"\n{m}x{n}x{k} {name} fwd+bwd: {len(kernels)} kernels, "
            f"{totals[name]:.1f} us", flush=True)
      for kernel, us in kernels:
        print(f"  {us:9.1f} us  {kernel[:100]}")
    if totals["mosaic"]:
      print(f"{m}x{n}x{k}: xla / mosaic = "
            f"{totals['xla'] / totals['mosaic']:.3f}")


if __name__ == "__main__":
  main()
