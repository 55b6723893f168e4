"""What does `pallas_gemm.ragged_dot(kernel="xla")` cost over a bare
`jax.lax.ragged_dot_general`? The `xla` implementation gives XLA the group
sizes' `maximum` with 0 (a negative size counts as zero), which the bare
call does not; on a GPU that can cost a kernel of its own (the sizes'
cumulative sum, no longer fused into XLA's selects).

    PYTHONPATH=. python3 experiments/lab/xla_path_overhead.py \\
        [--problems "g2 m8192 k16 n256 even drhs;..."] [--iterations 20] \\
        [--breakdown] [--forms] [--dtype bfloat16]

Ways, each on the same operands in one process: `lax` (the bare call),
`lax_maximum` (the bare call on `jnp.maximum(sizes, 0)`), `xla`
(`pallas_gemm`'s implementation) and `auto` (the automatic choice). Each
problem is named as `random_ragged_sweep.py` labels its draws.
`--breakdown` adds each way's kernels and their CUPTI medians; `--forms`
times the bare call on other forms of the sizes' clamp (FORMS) too.
`--dtype` is the operands' (an fp8 one gives a bfloat16 output, as the
sweep does).
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp

import pallas_gemm
from pallas_gemm import numerics, timing

from experiments.lab import ragged_lab_common as common
from experiments.lab import random_ragged_sweep as sweep

#: Weight gradients and products `auto` ran on XLA a little slower than the
#: bare call (random_ragged, sections 9 and 11), and a forward.
DEFAULT_PROBLEMS = (
    "g2 m8192 k16 n256 even drhs",
    "g2 m8192 k64 n384 even drhs",
    "g1 m2048 k1024 n256 even drhs",
    "g15 m159 k80 n88 random drhs",
    "g3 m294 k976 n5736 random drhs",
    "g6 m4026 k48 n136 even forward",
    "g4 m512 k512 n512 even dlhs",
)
WAYS = ("lax", "lax_maximum", "xla", "auto")
#: Other forms of "a negative size counts as zero", with `--forms`: does
#: any of them leave XLA's fusion of the sizes' cumulative sum as it is?
FORMS = {
    "lax_where": lambda s: jnp.where(s < 0, 0, s),
    "lax_bits": lambda s: s & ~(s >> 31),
    "lax_clip": lambda s: jnp.clip(s, 0, None),
    # The clamp kept out of XLA's fusions of the sizes' uses: a small
    # kernel of its own, but the masks fuse as on the bare call?
    "lax_barrier": lambda s: jax.lax.optimization_barrier(jnp.maximum(s, 0)),
}


def way_calls(problem):
  numbers = problem.dimension_numbers
  out_dtype = jnp.dtype(problem.out_dtype)
  bare = lambda l, r, s: jax.lax.ragged_dot_general(
      l, r, s, numbers, preferred_element_type=out_dtype)
  ours = lambda kernel: lambda l, r, s: pallas_gemm.ragged_dot_general(
      l, r, s, numbers, preferred_element_type=out_dtype, kernel=kernel)
  calls = {"lax": jax.jit(bare),
           "lax_maximum": jax.jit(lambda l, r, s: bare(l, r,
                                                       jnp.maximum(s, 0))),
           "xla": jax.jit(ours("xla")), "auto": jax.jit(ours(None))}
  for name, form in FORMS.items():
    calls[name] = jax.jit(lambda l, r, s, form=form: bare(l, r, form(s)))
  return calls


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--problems", default=";".join(DEFAULT_PROBLEMS))
  parser.add_argument("--iterations", type=int, default=20)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--breakdown", action="store_true")
  parser.add_argument("--forms", action="store_true",
                      help="also time the bare call on FORMS' sizes")
  parser.add_argument("--dtype", default="bfloat16",
                      choices=tuple(sweep.LAX_RATE))
  args = parser.parse_args(argv)
  ways = WAYS + (tuple(FORMS) if args.forms else ())
  if args.iterations < 1:
    raise SystemExit(f"--iterations={args.iterations} must be >= 1")
  out_dtype = sweep.default_out_dtype(args.dtype)
  cases = [sweep.parse_case(text, args.seed, args.dtype, out_dtype)
           for text in args.problems.split(";") if text.strip()]
  on_gpu = common.print_header(ways, ("xla / lax", "lax_maximum / lax",
                                      "auto / lax"), args.iterations,
                               sweep.dtypes_note(args.dtype, out_dtype))
  keys = jax.random.split(jax.random.key(args.seed), 2)
  for label, case, sizes in cases:
    problem = case.problem
    lhs = numerics.random_normal(keys[0], problem.lhs_shape, args.dtype)
    rhs = numerics.random_normal(keys[1], problem.rhs_shape, args.dtype)
    operands = (lhs, rhs, jnp.asarray(sizes))
    calls = {way: call for way, call in way_calls(problem).items()
             if way in ways}
    times, _ = common.time_ways(calls, operands, iterations=args.iterations,
                                on_gpu=on_gpu, label=label)
    common.print_row(label, ways, times, (("xla", "lax"),
                                          ("lax_maximum", "lax"),
                                          ("auto", "lax")), {}, ())
    for way in (ways if args.breakdown and on_gpu else ()):
      kernels = timing.kernel_medians_us(calls[way], operands,
                                         iterations=args.iterations)
      print(f"#   {way}: " + ", ".join(f"{name[:40]} {us:.1f}"
                                       for name, us in kernels), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
