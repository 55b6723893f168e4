"""The backward of a bfloat16 grouped GEMM whose forward asked for float32
output (`preferred_element_type=float32`), timed four ways on a GPU.

Its cotangent is float32. Since fb57070 `ragged_dot_p`'s transpose cuts
it into high and low bfloat16 parts and runs their products on the grouped
GEMM kernels (`primitive.splits_wide_cotangent`): the weight gradient as
one product over each token row twice, the input gradient as two products
added in float32. Before, it upcast the other operand to float32, a
problem only XLA's ragged product takes. Per case:

  lax      jax.vjp of jax.lax.ragged_dot, float32 output (XLA)
  upcast   the products the transpose ran before: float32 operands through
           pallas_gemm (which resolves them to XLA)
  split    jax.vjp of pallas_gemm.ragged_dot, float32 output (the split)
  bf16     jax.vjp of pallas_gemm.ragged_dot, bfloat16 output: the same
           products with a bfloat16 cotangent, for scale

CUPTI time of every kernel of the pullback (both gradients), median of
`--iterations` calls, and the relative error of `split` and `upcast`
against `lax` (which runs TF32 products; float64 is too slow here).

    PYTHONPATH=. python3 experiments/lab/mixed_precision_grad.py \
        [--layers qwen3_30b_a3b_up,g64] [--distributions even,zipf] \
        [--ways lax,upcast,split,bf16] [--iterations 10] [--budget_s 200]
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

import pallas_gemm
from pallas_gemm import numerics
from pallas_gemm.ragged_dot import arg_specs
from pallas_gemm.ragged_dot.problem import CONTRACTING_NUMBERS

from experiments.lab import ragged_lab_common as common

WAYS = ("lax", "upcast", "split", "bf16")


def pullbacks(group_sizes):
  """name -> f(x, w, ct) returning (dx, dw), each as one jitted call."""

  def vjp_of(forward):
    return jax.jit(lambda x, w, ct: jax.vjp(forward, x, w)[1](ct))

  lax_fwd = lambda x, w: jax.lax.ragged_dot(
      x, w, group_sizes, preferred_element_type=jnp.float32)
  ours = lambda out_dtype: (lambda x, w: pallas_gemm.ragged_dot(
      x, w, group_sizes, preferred_element_type=out_dtype))

  @jax.jit
  def upcast(x, w, ct):
    wide = jnp.float32
    dx = pallas_gemm.ragged_dot(ct, w.astype(wide), group_sizes,
                                transpose_rhs=True, preferred_element_type=x.dtype)
    dw = pallas_gemm.ragged_dot_general(x.astype(wide), ct, group_sizes,
                                        CONTRACTING_NUMBERS,
                                        preferred_element_type=w.dtype)
    return dx, dw

  bf16 = vjp_of(ours(jnp.bfloat16))
  return {"lax": vjp_of(lax_fwd), "upcast": upcast,
          "split": vjp_of(ours(jnp.float32)),
          "bf16": lambda x, w, ct: bf16(x, w, ct.astype(jnp.bfloat16))}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--layers", default="qwen3_30b_a3b_up,g64_t16384,"
                      "mixtral8x7b_up,deepseek_v3_up,granite3")
  parser.add_argument("--distributions", default="even,zipf")
  parser.add_argument("--ways", default=",".join(WAYS),
                      help=f"a subset of {WAYS}")
  parser.add_argument("--iterations", type=int, default=10)
  parser.add_argument("--budget_s", type=float, default=0.0,
                      help="start no new case after this long (0: no limit)")
  args = parser.parse_args(argv)
  ways = args.ways.split(",")
  if unknown := sorted(set(ways) - set(WAYS)):
    parser.error(f"--ways: {unknown} are not among {WAYS}")
  on_gpu = common.print_header(
      WAYS, ("lax / split", "split / bf16", "split error", "upcast error"),
      args.iterations)
  budget = common.Budget(args.budget_s)
  for name in args.layers.split(","):
    layer = common.suite_layer(name)
    for distribution in args.distributions.split(","):
      if budget.spent():
        return 0
      keys = jax.random.split(jax.random.key(0), 3)
      x = numerics.random_normal(keys[0], (layer.rows, layer.k), jnp.bfloat16)
      w = numerics.random_normal(keys[1], (layer.groups, layer.k, layer.n),
                                 jnp.bfloat16)
      ct = numerics.random_normal(keys[2], (layer.rows, layer.n), jnp.float32)
      sizes = jnp.asarray(arg_specs.group_sizes(distribution, layer.rows,
                                                layer.groups))
      label = f"{layer.name} {distribution}"
      times, grads = common.time_ways(
          {way: fn for way, fn in pullbacks(sizes).items() if way in ways},
          (x, w, ct), iterations=args.iterations, on_gpu=on_gpu, label=label)
      errors = {way: max(numerics.relative_error(np.asarray(a, np.float32),
                                                 np.asarray(b, np.float64))
                         for a, b in zip(grads[way], grads["lax"]))
                for way in ("split", "upcast")
                if way in grads and "lax" in grads}
      common.print_row(label, WAYS, times,
                       (("lax", "split"), ("split", "bf16")), errors,
                       ("split", "upcast"))
      del x, w, ct, grads
  return 0


if __name__ == "__main__":
  sys.exit(main())
