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
import statistics
import sys

_ROOT = pathlib.Path(__file__).resolve().parents[2]
if str(_ROOT) not in sys.path:
  sys.path.insert(0, str(_ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from pallas_gemm import numerics, timing  # noqa: E402
from pallas_gemm.gated_linear_unit import gated_linear_unit  # noqa: E402


def _forwards():
  return {
      "mosaic": lambda x, w: gated_linear_unit(x, w, activation="silu",
                                               kernel="mosaic"),
      "xla": lambda x, w: jax.nn.silu(x @ w[0]) * (x @ w[1]),
  }


def _fwd_bwd(forward):
  def run(x, w, dy):
    out, pullback = jax.vjp(forward, x, w)
    return out, pullback(dy)
  return jax.jit(run)


def _operands(m, n, k, seed=0):
  keys = jax.random.split(numerics.fresh_key(seed), 4)
  x = numerics.random_normal(keys[0], (m, k), jnp.bfloat16)
  w = tuple((jax.random.normal(key, (k, n), jnp.float32) / k ** 0.5
             ).astype(jnp.bfloat16) for key in keys[1:3])
  dy = numerics.random_normal(keys[3], (m, n), jnp.bfloat16)
  return x, w, dy


def breakdown(fn, args, iters):
  """[(kernel name, median µs)] in launch order."""
  _, calls = timing.cupti_samples_ms(fn, args, iterations=iters,
                                     per_kernel=True)
  launches = len(calls[0])
  if any(len(call) != launches for call in calls):
    raise RuntimeError("the calls launched different kernel counts")
  return [(calls[0][i][0], 1e3 * statistics.median(c[i][1] for c in calls))
          for i in range(launches)]


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--shapes", default="8192x11008x4096,4096x11008x4096")
  parser.add_argument("--iters", type=int, default=10)
  args = parser.parse_args(argv)
  on_gpu = jax.default_backend() == "gpu"
  shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
  if not on_gpu:
    print("no GPU: one tiny shape in interpret mode, times mean nothing")
    shapes = [(64, 128, 64)]
  for m, n, k in shapes:
    operands = _operands(m, n, k)
    totals = {}
    for name, forward in _forwards().items():
      fn = _fwd_bwd(forward)
      if on_gpu:
        kernels = breakdown(fn, operands, args.iters)
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
