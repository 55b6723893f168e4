"""Does a pallas_gemm kernel plus a transpose copy still beat lax.dot_general?

For dot_general forms whose operands must be transposed before one GEMM
(batch dims in the middle, attention's 'btnh,bsnh->bnts'), this times three
ways through `pallas_gemm.timing` (CUPTI on a GPU, operands rotated past L2):

  lax      jax.lax.dot_general as given
  copy     transpose + the pallas_gemm GEMM, always (the kernel the dispatch
           picks for the copied problem; `xla` included)
  routed   pallas_gemm.dot_general as shipped: copy + kernel, or lax where
           the dispatch gives the GEMM to XLA

and prints one JSON line per form with the ratios to lax. On a CPU,
`--cpu_smoke` runs tiny sizes in interpret mode, only to check the script.

    PYTHONPATH=. python3 experiments/lab/dot_general_copies.py --out copies.jsonl
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

import pallas_gemm
from pallas_gemm import dimension_numbers, timing

# (name, lhs shape, rhs shape, dimension numbers) at sizes a model runs.
FORMS = [
    ("attention logits btnh,bsnh->bnts", (4, 2048, 16, 128),
     (4, 2048, 16, 128), (((3,), (3,)), ((0, 2), (0, 2)))),
    ("attention values bsnh,bnts->bnht", (4, 2048, 16, 128),
     (4, 16, 2048, 2048), (((1,), (3,)), ((0, 2), (0, 1)))),
    ("batch dim in the middle", (4096, 8, 1024), (1024, 8, 4096),
     (((2,), (0,)), ((1,), (1,)))),
    ("two contracting dims, opposite orders", (4096, 64, 64),
     (64, 64, 4096), (((1, 2), (1, 0)), ((), ()))),
]


def _smoke_shape(shape):
  return tuple(min(s, 8) for s in shape)


def copied(lhs, rhs, dims):
  """Transpose + matmul, whatever the dispatch would say about lax."""
  plan = dimension_numbers.plan(lhs.shape, rhs.shape, dims)
  a = dimension_numbers.arrange(lhs, plan.lhs_order, plan.lhs_copy,
                                plan.lhs_shape)
  b = dimension_numbers.arrange(rhs, plan.rhs_order, plan.rhs_copy,
                                plan.rhs_shape)
  out = pallas_gemm.matmul(a, b, transpose_a=plan.transpose_a,
                           transpose_b=plan.transpose_b)
  return out.reshape(plan.out_shape)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--dtype", default="bfloat16")
  # CUPTI keeps every timed call's outputs alive until it syncs: sets x
  # iterations outputs of up to 512 MiB each must fit beside the operands.
  parser.add_argument("--sets", type=int, default=2,
                      help="operand sets rotated per timed call")
  parser.add_argument("--iterations", type=int, default=10)
  parser.add_argument("--cpu_smoke", action="store_true")
  parser.add_argument("--out", default=None, help="append JSON lines here")
  args = parser.parse_args()
  on_gpu = jax.default_backend() == "gpu"
  if not on_gpu and not args.cpu_smoke:
    parser.error("no GPU: pass --cpu_smoke to check the script on a CPU")
  dtype = jnp.dtype(args.dtype)
  rng = np.random.default_rng(0)
  for name, lhs_shape, rhs_shape, dims in FORMS:
    if args.cpu_smoke:
      lhs_shape, rhs_shape = _smoke_shape(lhs_shape), _smoke_shape(rhs_shape)
    plan = dimension_numbers.plan(lhs_shape, rhs_shape, dims)
    sets = [tuple(jnp.asarray(rng.standard_normal(s, np.float32), dtype)
                  for s in (lhs_shape, rhs_shape)) for _ in range(args.sets)]
    ways = {
        "lax": lambda a, b: jax.lax.dot_general(a, b, dims),
        "copy": lambda a, b: copied(a, b, dims),
        "routed": lambda a, b: pallas_gemm.dot_general(a, b, dims),
    }
    reference = np.asarray(ways["lax"](*sets[0]), np.float32)
    row = {"form": name, "lhs": lhs_shape, "rhs": rhs_shape,
           "dims": str(dims), "dtype": dtype.name, "copies": plan.copies,
           "device": jax.devices()[0].device_kind}
    for way, fn in ways.items():
      out = np.asarray(fn(*sets[0]), np.float32)
      row[f"{way}_max_abs_diff"] = float(np.max(np.abs(out - reference)))
      row[f"{way}_ms"] = timing.time_over_sets(
          fn, sets, iterations=args.iterations, on_gpu=on_gpu)
    explanation = pallas_gemm.explain(*sets[0], fn=pallas_gemm.dot_general,
                                      dimension_numbers=dims)
    row["routed_kernels"] = explanation.kernels
    row["routed_lax"] = explanation.lax
    for way in ("copy", "routed"):
      row[f"{way}_speedup_vs_lax"] = row["lax_ms"] / row[f"{way}_ms"]
    line = json.dumps(row)
    print(line, flush=True)
    if args.out:
      with open(args.out, "a", encoding="utf-8") as f:
        f.write(line + "\n")


if __name__ == "__main__":
  main()
