"""How fast can an fp8 (K, N) -> (N, K) copy be, and what does it buy the NN
layout of `mosaic/fp8`?

fp8 wgmma reads K-major tiles only, so `mosaic/fp8` runs NN as an XLA
transpose of B followed by the NT kernel (`fp8_operands.py`). This probe times,
per shape (CUPTI, operands rotated past L2):

  xla          jnp.swapaxes of the fp8 array (what the NN path runs today)
  triton BxB   a Pallas-Triton kernel copying (BK, BN) blocks transposed, on
               the bytes (uint8 bitcast), for a few block sizes and warps

and checks every transposed result against numpy. Then, with
`--matmul`, the kernels one per-tensor scaled `mosaic/fp8` call launches
for each layout at K = K, N = N, M = --m (per-kernel CUPTI times, median).

Usage (GPU):

  PYTHONPATH=. python3 experiments/lab/fp8_transpose_probe.py \
      [--shapes 4096x4096,8192x8192,4096x14336] [--iters 20]
      [--matmul] [--m 4096]
"""

from __future__ import annotations

import argparse
import functools


import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

import pallas_gemm
from pallas_gemm import timing
from pallas_gemm.fp8 import quantize_fp8

ON_GPU = jax.default_backend() == "gpu"


def triton_transpose(x, *, block_k: int, block_n: int, num_warps: int):
  """(K, N) uint8 -> (N, K), one (block_k, block_n) block per program."""
  k, n = x.shape

  def body(x_ref, o_ref):
    o_ref[...] = x_ref[...].T

  return pl.pallas_call(
      body,
      out_shape=jax.ShapeDtypeStruct((n, k), x.dtype),
      grid=(pl.cdiv(k, block_k), pl.cdiv(n, block_n)),
      in_specs=[pl.BlockSpec((block_k, block_n), lambda i, j: (i, j))],
      out_specs=pl.BlockSpec((block_n, block_k), lambda i, j: (j, i)),
      compiler_params=pltriton.CompilerParams(num_warps=num_warps,
                                              num_stages=1),
      interpret=not ON_GPU,
  )(x)


def as_bytes(fn):
  def call(x):
    out = fn(jax.lax.bitcast_convert_type(x, jnp.uint8))
    return jax.lax.bitcast_convert_type(out, x.dtype)
  return call


def matmul_breakdown(m, k, n, iters):
  """Per-kernel median times of per-tensor scaled mosaic/fp8, NT and NN."""
  x = jax.random.normal(jax.random.key(0), (m, k), jnp.float32)
  w = jax.random.normal(jax.random.key(1), (n, k), jnp.float32)
  qa, sa = quantize_fp8(x)
  qb, sb = quantize_fp8(w)
  for layout, b in (("NT", qb), ("NN", jax.block_until_ready(qb.T))):
    fn = jax.jit(functools.partial(
        pallas_gemm.matmul, transpose_b=layout == "NT", kernel="mosaic/fp8",
        preferred_element_type=jnp.bfloat16))
    medians = timing.kernel_medians_us(
        lambda a, b, fn=fn: fn(a, b, a_scale=sa, b_scale=sb), (qa, b),
        iterations=iters)
    total = sum(us for _, us in medians)
    parts = ", ".join(f"{name[:40]} {us:.1f} us" for name, us in medians)
    print(f"{m}x{n}x{k} {layout}: {total:.1f} us = {parts}", flush=True)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--shapes", default="4096x4096,8192x8192,4096x14336")
  parser.add_argument("--iters", type=int, default=20)
  parser.add_argument("--matmul", action="store_true")
  parser.add_argument("--m", type=int, default=4096)
  args = parser.parse_args()
  print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}")
  variants = {"xla": lambda x: jnp.swapaxes(x, 0, 1)}
  for bk, bn, warps in ((64, 64, 4), (128, 128, 4), (128, 128, 8),
                        (64, 256, 4), (256, 64, 4), (128, 64, 4)):
    variants[f"triton {bk}x{bn} w{warps}"] = as_bytes(functools.partial(
        triton_transpose, block_k=bk, block_n=bn, num_warps=warps))
  if args.matmul:
    for text in args.shapes.split(","):
      k, n = (int(v) for v in text.split("x"))
      matmul_breakdown(args.m, k, n, args.iters)
    return
  for text in args.shapes.split(","):
    k, n = (int(v) for v in text.split("x"))
    count = max(2, min(16, (2 * 60 * 2**20) // (k * n) + 1)) if ON_GPU else 2
    sets = []
    for i in range(count):
      x = jax.random.normal(jax.random.key(i), (k, n), jnp.float32)
      sets.append((x.astype(jnp.float8_e4m3fn),))
    expected = np.asarray(sets[0][0]).view(np.uint8).T
    for name, fn in variants.items():
      try:
        out = jax.jit(fn)(*sets[0])
        ok = np.array_equal(np.asarray(out).view(np.uint8), expected)
        ms = timing.time_over_sets(fn, sets, iterations=args.iters,
                                   on_gpu=ON_GPU)
        gbs = 2 * k * n / (ms * 1e-3) / 1e9
        print(f"{text:<12} {name:<22} {ms * 1e3:9.1f} us {gbs:8.0f} GB/s "
              f"{'ok' if ok else 'WRONG'}", flush=True)
      except Exception as e:  # noqa: BLE001 - report and go on
        print(f"{text:<12} {name:<22} failed: {type(e).__name__}: "
              f"{str(e).splitlines()[0][:150]}", flush=True)


if __name__ == "__main__":
  main()
