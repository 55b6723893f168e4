"""float32 (or fp8) grouped GEMMs: XLA's ragged product against the Mosaic
kernels running bfloat16 products of the operands' parts
(`pallas_gemm.ragged_dot.bfloat16_split`: three for float32, one widened
product for fp8), from decode batches to training steps, on a GPU.

Per (layer, rows, routing), each timed in one process against the others:

  xla    jax.lax.ragged_dot on the operands, precision="default"
  ours_xla  pallas_gemm.ragged_dot(kernel="xla"): XLA's product with what
         pallas_gemm adds around it (clipped sizes, a gather)
  split  pallas_gemm.ragged_dot(kernel="mosaic") on the operands
  auto   pallas_gemm.ragged_dot as resolved automatically
  bf16   pallas_gemm.ragged_dot on the operands cast to bfloat16, for scale

`--direction forward` times the rows product x @ w, `drhs` the weight
gradient's contracting product of x and a float32 cotangent, `grad` the
pullback of both operands. CUPTI time of every kernel of one call,
median of `--iterations`. The group sizes are an argument of the jitted
call, as in a model, not a constant XLA could fold. Where the product is small enough for NumPy, the
relative error of xla and split against float64 is printed too. With
`--breakdown`, a line per way after each row gives its kernels one by one
(how many, and the CUPTI medians of those over 1 us): the split's passes
over the operands (a gather, the parts) against the grouped GEMM itself,
or what pallas_gemm's `xla` adds around XLA's product.

    PYTHONPATH=. python3 experiments/lab/float32_ragged.py \
        [--layers qwen3_30b_a3b_up,mixtral8x7b_up] [--rows 64,1024,0] \
        [--distributions even,zipf] [--direction forward|drhs|grad] \
        [--ways xla,ours_xla,split,auto,bf16] [--dtype float32|float8_e4m3fn|float8_e5m2] \
        [--iterations 10] [--budget_s 200] [--breakdown]

`--rows 0` stands for the layer's own rows (its training step).
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

import pallas_gemm
from pallas_gemm import numerics, timing
from pallas_gemm.ragged_dot import arg_specs
from pallas_gemm.ragged_dot.problem import (CONTRACTING_NUMBERS, RaggedProblem,
                                            reference)

from experiments.lab import ragged_lab_common as common

WAYS = ("xla", "ours_xla", "split", "auto", "bf16")
#: The largest product (flops) whose float64 NumPy reference is computed.
_REFERENCE_FLOPS = 4e10


DIRECTIONS = ("forward", "drhs", "grad")


def _product(way: str, direction: str):
  """f(a, b, group sizes): the forward's rows product of x and w, or (drhs)
  the contracting product of x and the cotangent."""
  if way == "xla":
    if direction == "drhs":
      return lambda a, b, s: jax.lax.ragged_dot_general(
          a, b, s, CONTRACTING_NUMBERS, preferred_element_type=jnp.float32)
    return lambda a, b, s: jax.lax.ragged_dot(
        a, b, s, preferred_element_type=jnp.float32)
  cast = ((lambda v: v.astype(jnp.bfloat16)) if way == "bf16"
          else (lambda v: v))
  kernel = {"split": "mosaic", "ours_xla": "xla"}.get(way)
  if direction == "drhs":
    return lambda a, b, s: pallas_gemm.ragged_dot_general(
        cast(a), cast(b), s, CONTRACTING_NUMBERS, kernel=kernel,
        preferred_element_type=jnp.float32)
  return lambda a, b, s: pallas_gemm.ragged_dot(
      cast(a), cast(b), s, kernel=kernel, preferred_element_type=jnp.float32)


def _call(way: str, direction: str):
  product = _product(way, direction)
  if direction == "forward":
    return jax.jit(lambda x, w, ct, s: product(x, w, s))
  if direction == "drhs":
    return jax.jit(lambda x, w, ct, s: product(x, ct, s))
  return jax.jit(lambda x, w, ct, s: jax.vjp(
      lambda a, b: product(a, b, s), x, w)[1](ct))


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--layers", default="qwen3_30b_a3b_up,mixtral8x7b_up,"
                      "deepseek_v3_up,g64_t16384")
  parser.add_argument("--rows", default="16,256,2048,0",
                      help="lhs rows per case; 0: the layer's own")
  parser.add_argument("--distributions", default="even,zipf")
  parser.add_argument("--direction", choices=DIRECTIONS, default="forward")
  parser.add_argument("--ways", default=",".join(WAYS),
                      help=f"a subset of {WAYS}")
  parser.add_argument("--dtype", default="float32",
                      choices=("float32", "float8_e4m3fn", "float8_e5m2"))
  parser.add_argument("--iterations", type=int, default=10)
  parser.add_argument("--budget_s", type=float, default=0.0,
                      help="start no new case after this long (0: no limit)")
  parser.add_argument("--breakdown", action="store_true",
                      help="print each way's kernels one by one (a GPU only)")
  args = parser.parse_args(argv)
  ways = args.ways.split(",")
  if unknown := sorted(set(ways) - set(WAYS)):
    parser.error(f"--ways: {unknown} are not among {WAYS}")
  try:
    rows_list = [int(r) for r in args.rows.split(",")]
  except ValueError:
    parser.error(f"--rows={args.rows!r} must be integers")
  if any(r < 0 for r in rows_list):
    parser.error(f"--rows={args.rows!r} must be >= 0")
  if args.direction == "grad" and args.dtype != "float32":
    parser.error("--direction grad takes --dtype float32 only")
  if args.breakdown and jax.default_backend() != "gpu":
    parser.error("--breakdown needs a GPU (CUPTI's kernel records)")
  dtype = jnp.dtype(args.dtype)
  on_gpu = common.print_header(
      WAYS, ("xla / split", "split / bf16", "ours_xla / xla", "xla error",
             "split error"),
      args.iterations, args.direction, args.dtype)
  budget = common.Budget(args.budget_s)
  for name in args.layers.split(","):
    layer = common.suite_layer(name)
    for rows in rows_list:
      rows = rows or layer.rows
      for distribution in args.distributions.split(","):
        if budget.spent():
          return 0
        label = (f"{layer.name} g{layer.groups} k{layer.k} n{layer.n} "
                 f"m{rows} {distribution}")
        keys = jax.random.split(jax.random.key(0), 3)
        x = numerics.random_normal(keys[0], (rows, layer.k), dtype)
        w = numerics.random_normal(keys[1], (layer.groups, layer.k, layer.n),
                                   dtype)
        ct = numerics.random_normal(keys[2], (rows, layer.n), dtype)
        sizes = arg_specs.group_sizes(distribution, rows, layer.groups)
        operands = (x, w, ct, jnp.asarray(sizes, jnp.int32))
        times, outs = common.time_ways(
            {way: _call(way, args.direction) for way in ways}, operands,
            iterations=args.iterations,
            on_gpu=on_gpu, label=label)
        errors = {}
        mode = "contracting" if args.direction == "drhs" else "rows"
        problem = RaggedProblem(mode, rows, layer.k, layer.n, layer.groups,
                                args.dtype, "float32")
        if args.direction != "grad" and problem.flops <= _REFERENCE_FLOPS:
          wide = lambda v: np.asarray(v.astype(jnp.float32))
          want = reference(wide(x), wide(ct if mode == "contracting" else w),
                           sizes, problem)
          errors = {way: numerics.relative_error(outs[way], want)
                    for way in ("xla", "split") if way in outs}
        common.print_row(label, WAYS, times,
                         (("xla", "split"), ("split", "bf16"),
                          ("ours_xla", "xla")), errors,
                         ("xla", "split"))
        for way in (w for w in ways if args.breakdown and w in times):
          kernels = timing.kernel_medians_us(
              _call(way, args.direction), operands,
              iterations=args.iterations)
          print(f"# {label} {way}: {len(kernels)} kernels (us): " + ", ".join(
              f"{name[:32]} {us:.1f}" for name, us in kernels if us > 1),
              flush=True)
        del x, w, ct, operands, outs
  return 0


if __name__ == "__main__":
  sys.exit(main())
