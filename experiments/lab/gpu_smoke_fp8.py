"""Is `mosaic/fp8` correct compiled on the GPU, and how fast against XLA's fp8?

For each shape, layout (NT: B stored N x K; NN: B stored K x N) and scaling
(per tensor; block-wise 1x128 / 128x128) it quantizes normal inputs with
`pallas_gemm.quantize_fp8`, runs `mosaic/fp8` to bf16, checks a subsample
of the output against a float64 product of the dequantized inputs, and
times it (CUPTI, `pallas_gemm.timing`, operands rotated past L2) next to
XLA's forms, once per shape:

  xla NN        lax.dot_general fp8 x fp8 -> bf16, B stored K x N
  xla NT        the same with B stored N x K (XLA's fast fp8 path)
  xla NT*s      NT into f32, times the per-tensor scales, -> bf16
  scaled_mm     jax.nn.scaled_matmul with 1x128 blocks on both (NT)

A case that raises prints its error and the run goes on. Usage (repository
root on PYTHONPATH):

  python experiments/lab/gpu_smoke_fp8.py [--shapes 4096x4096x4096,...]
      [--layouts NT,NN] [--scalings tensor,block] [--iters 20]
      [--budget_s 140]
"""

from __future__ import annotations

import argparse
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

import pallas_gemm
from pallas_gemm import timing
from pallas_gemm.devices import device_info, peak_tflops
from pallas_gemm.fp8 import quantize_fp8
from pallas_gemm.numerics import relative_error, tolerance
from pallas_gemm.problem import GemmProblem

DEFAULT_SHAPES = ("4096x4096x4096", "8192x8192x8192", "8192x14336x4096",
                  "4096x4096x14336")
#: Rows and columns of the output checked against float64.
SAMPLE = 192


def _parse_shape(text):
  m, n, k = (int(v) for v in text.lower().split("x"))
  return m, n, k


def _short(e: BaseException) -> str:
  first = (str(e).strip().splitlines() or [""])[0]
  return f"{type(e).__name__}: {first[:160]}"


#: Off a GPU (a smoke test of this script), wall clock in interpret mode.
ON_GPU = jax.default_backend() == "gpu"


def _time_us(fn, operand_sets, iters):
  ms = timing.time_over_sets(fn, operand_sets, iterations=iters,
                             on_gpu=ON_GPU)
  return ms * 1e3


class Case:
  """Quantized operand sets of one shape, in both layouts and scalings."""

  def __init__(self, m, n, k, seed):
    self.m, self.n, self.k = m, n, k
    problem = GemmProblem(1, m, n, k, "float8_e4m3fn", "bfloat16",
                          transpose_b=True)
    self.count = timing.operand_set_count(problem, on_gpu=ON_GPU)
    key = jax.random.key(seed)
    self.sets = {"tensor": [], "block": []}
    for i in range(self.count):
      ka, kb = jax.random.split(jax.random.fold_in(key, i))
      x = jax.random.normal(ka, (m, k), jnp.float32)
      w = jax.random.normal(kb, (n, k), jnp.float32)  # stored N x K
      for scaling, (a_block, b_block) in (("tensor", (None, None)),
                                          ("block", ((1, 128), (128, 128)))):
        qa, sa = quantize_fp8(x, block=a_block)
        qb, sb = quantize_fp8(w, block=b_block)
        self.sets[scaling].append((qa, qb, sa, sb))
      del x, w

  def operands(self, scaling, layout):
    """Operand sets as `pallas_gemm.matmul` takes them in `layout`."""
    out = []
    for qa, qb, sa, sb in self.sets[scaling]:
      if layout == "NN":
        qb = qb.T  # stored K x N; block scales follow the stored array
        sb = sb.T if sb.ndim == 2 else sb
      out.append((qa, jax.block_until_ready(qb), sa, sb))
    return out

  def reference(self, scaling, rows, cols):
    """float64 op(a) @ op(b) of the dequantized inputs at the sampled rows
    and columns (only those rows of A and of B are widened)."""
    qa, qb, sa, sb = self.sets[scaling][0]
    a64 = np.asarray(qa[rows].astype(jnp.float32), np.float64)
    b64 = np.asarray(qb[cols].astype(jnp.float32), np.float64)  # (n, k)
    if scaling == "tensor":
      a64 *= float(sa)
      b64 *= float(sb)
    else:
      k = self.k
      a_s = np.repeat(np.asarray(sa, np.float64)[rows], 128, axis=1)[:, :k]
      b_s = np.repeat(np.asarray(sb, np.float64)[cols // 128], 128,
                      axis=1)[:, :k]
      a64 *= a_s
      b64 *= b_s
    return a64 @ b64.T


def _sample(size):
  idx = np.unique(np.linspace(0, size - 1, SAMPLE).astype(int))
  return idx


def mosaic_call(layout):
  transpose_b = layout == "NT"

  def call(qa, qb, sa, sb):
    return pallas_gemm.matmul(qa, qb, a_scale=sa, b_scale=sb,
                              transpose_b=transpose_b, kernel="mosaic/fp8",
                              preferred_element_type=jnp.bfloat16)
  return call


def xla_call(layout, scaled):
  dims = (((1,), (1,)), ((), ())) if layout == "NT" else (((1,), (0,)), ((), ()))

  def call(qa, qb, sa, sb):
    if not scaled:
      return jax.lax.dot_general(qa, qb, dims,
                                 preferred_element_type=jnp.bfloat16)
    acc = jax.lax.dot_general(qa, qb, dims, preferred_element_type=jnp.float32)
    return (acc * (sa * sb)).astype(jnp.bfloat16)
  return call


def scaled_matmul_call(qa, qb, sa, sb):
  """jax.nn.scaled_matmul, 1x128 blocks for A and per-row blocks for B."""
  sb_rows = jnp.repeat(sb, 128, axis=0)[:qb.shape[0]]
  out = jax.nn.scaled_matmul(qa[None], qb[None], sa[None], sb_rows[None],
                             preferred_element_type=jnp.float32)
  return out[0].astype(jnp.bfloat16)


def add_run_arguments(parser, *, iters, budget_s):
  """The options of this run and of gpu_sweep_fp8 besides their cases: the
  timed iterations, the seconds after which no new shape starts, and the
  operands' seed."""
  parser.add_argument("--iters", type=int, default=iters)
  parser.add_argument("--budget_s", type=float, default=budget_s)
  parser.add_argument("--seed", type=int, default=0)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--shapes", default=",".join(DEFAULT_SHAPES))
  parser.add_argument("--layouts", default="NT,NN")
  parser.add_argument("--scalings", default="tensor,block")
  add_run_arguments(parser, iters=20, budget_s=140.0)
  args = parser.parse_args()

  device = device_info()
  peak = peak_tflops(device.device_kind, "float8_e4m3fn") or float("nan")
  print(f"device: {device.device_kind}  fp8 peak {peak} TFLOP/s  "
        f"jax {jax.__version__}")
  start = time.monotonic()
  rows = []

  def tflops(case, us):
    return 2 * case.m * case.n * case.k / (us * 1e-6) / 1e12

  for shape_text in args.shapes.split(","):
    if time.monotonic() - start > args.budget_s:
      print(f"budget of {args.budget_s:g} s spent: skipping {shape_text}")
      continue
    try:
      m, n, k = _parse_shape(shape_text)
      case = Case(m, n, k, args.seed)
    except Exception as e:  # noqa: BLE001 - report and go on
      print(f"{shape_text}: operands failed: {_short(e)}")
      continue
    baselines = {}
    for name, layout, fn in (
        ("xla NN", "NN", xla_call("NN", False)),
        ("xla NT", "NT", xla_call("NT", False)),
        ("xla NT*s", "NT", xla_call("NT", True)),
        ("scaled_mm", "block", scaled_matmul_call)):
      try:
        sets = (case.operands("block", "NT") if layout == "block"
                else case.operands("tensor", layout))
        baselines[name] = _time_us(fn, sets, args.iters)
      except Exception as e:  # noqa: BLE001
        baselines[name] = None
        print(f"{shape_text} {name}: {_short(e)}")
    for layout in args.layouts.split(","):
      for scaling in args.scalings.split(","):
        if time.monotonic() - start > args.budget_s:
          print(f"budget spent: skipping {shape_text} {layout} {scaling}")
          continue
        row = dict(shape=shape_text, layout=layout, scaling=scaling,
                   err=None, us=None, note="")
        try:
          sets = case.operands(scaling, layout)
          call = jax.jit(mosaic_call(layout))
          out = np.asarray(call(*sets[0]).astype(jnp.float32))
          r_idx, c_idx = _sample(m), _sample(n)
          ref = case.reference(scaling, r_idx, c_idx)
          row["err"] = relative_error(out[np.ix_(r_idx, c_idx)], ref)
          row["us"] = _time_us(mosaic_call(layout), sets, args.iters)
        except Exception as e:  # noqa: BLE001
          row["note"] = _short(e)
          traceback.print_exc(limit=3)
        rows.append((case, row, baselines))

  tol = tolerance("float8_e4m3fn", "default", "bfloat16")
  header = (f"{'shape':<17} {'lay':<3} {'scale':<6} {'err':>8} {'ok':<3} "
            f"{'fp8 TF/s':>8} {'%peak':>6} {'xlaNN':>6} {'xlaNT':>6} "
            f"{'NT*s':>6} {'scMM':>6}  ratios vs NT / NT*s / scMM")
  print()
  print(header)
  print("-" * len(header))
  for case, row, base in rows:
    err = row["err"]
    ok = "-" if err is None else ("yes" if err <= tol else "NO")
    mine = tflops(case, row["us"]) if row["us"] else None

    def tf(name):
      return tflops(case, base[name]) if base.get(name) else None

    def fmt(value, width=6):
      return f"{value:>{width}.0f}" if value else f"{'-':>{width}}"

    ratios = []
    for name in ("xla NT", "xla NT*s", "scaled_mm"):
      ratios.append(f"{base[name] / row['us']:.2f}x"
                    if row["us"] and base.get(name) else "-")
    print(f"{row['shape']:<17} {row['layout']:<3} {row['scaling']:<6} "
          f"{err if err is not None else float('nan'):>8.1e} {ok:<3} "
          f"{fmt(mine, 8)} {fmt(mine and 100 * mine / peak)} "
          f"{fmt(tf('xla NN'))} {fmt(tf('xla NT'))} {fmt(tf('xla NT*s'))} "
          f"{fmt(tf('scaled_mm'))}  {' / '.join(ratios)} {row['note']}")
  print(f"\n(tolerance {tol:g}; TFLOP/s from CUPTI kernel time, median of "
        f"{args.iters}; wall {time.monotonic() - start:.0f} s)")


if __name__ == "__main__":
  main()
