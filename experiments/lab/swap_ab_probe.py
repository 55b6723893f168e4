"""Can a Mosaic GPU kernel put the grouped GEMM's token rows on wgmma's N
side ("swap AB"), where their step is 8 rows instead of 64?

    PYTHONPATH=. python3 experiments/lab/swap_ab_probe.py --tokens 8,16,32,64

Issue 18's even-routing forward of Qwen1.5-MoE (273 rows per expert) runs
1.41x its token rows as 128-row items and would still run 1.17x as 64-row
ones, too many for its target on the H200
(`ragged_padding_bound.py`). With the product transposed, one expert's
tile is acc (columns, tokens) = W^T x^T: the weight columns are wgmma's M
(64 per warpgroup) and the tokens its N, any multiple of 8. The output
rows are then the accumulator's columns, so the epilogue stores it
through a transposed view of the staging tile.

For each token count this builds one such tile (one CTA, one 64-deep K
step: x (tokens, 64) and W (64, 64) loaded by TMA, one wgmma with both
operands read transposed, the transposed store, a TMA store), lowers it
for the GPU (no GPU needed) and runs it in interpret mode against float64.
It answers whether Mosaic takes the pieces, not how fast they run.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

_ROOT = pathlib.Path(__file__).resolve().parents[2]
if str(_ROOT) not in sys.path:
  sys.path.insert(0, str(_ROOT))

from pallas_gemm.mosaic_backend.tma import tiled_transforms  # noqa: E402

#: Weight columns of one warpgroup's accumulator (wgmma's M) and the K step.
COLUMNS, DEPTH = 64, 64
DTYPE = jnp.bfloat16


def load_and_multiply(sources, buffers, landed, operands, acc_shape):
  """TMA-loads each gmem ref of `sources` into its smem buffer, waits, and
  returns the float32 accumulator (`acc_shape`) of one wgmma of
  `operands(*buffers)`, its (A, B) views."""
  for src, dst in zip(sources, buffers):
    plgpu.copy_gmem_to_smem(src, dst, landed)
  plgpu.barrier_wait(landed)

  def product(acc_ref):
    plgpu.wgmma(acc_ref, *operands(*buffers))
    plgpu.wgmma_wait(0)
    return acc_ref[...]

  return pl.run_scoped(product, plgpu.ACC(acc_shape, jnp.float32))


def swapped_tile_kernel(tokens: int, interpret: bool):
  """out (tokens, COLUMNS) = x (tokens, DEPTH) @ w (DEPTH, COLUMNS),
  computed as its transpose."""
  def body(x_gmem, w_gmem, out_gmem):
    def scoped(x_smem, w_smem, out_smem, landed):
      # A = W^T (columns x depth), B = x^T (depth x tokens).
      acc = load_and_multiply((x_gmem, w_gmem), (x_smem, w_smem), landed,
                              lambda x, w: (w.T, x.T), (COLUMNS, tokens))
      out_smem.T[...] = acc.astype(out_smem.dtype)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(out_smem, out_gmem)
      plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(
        scoped,
        plgpu.SMEM((tokens, DEPTH), DTYPE,
                   transforms=tiled_transforms(DEPTH, DTYPE)),
        plgpu.SMEM((DEPTH, COLUMNS), DTYPE,
                   transforms=tiled_transforms(COLUMNS, DTYPE)),
        plgpu.SMEM((tokens, COLUMNS), DTYPE,
                   transforms=tiled_transforms(COLUMNS, DTYPE)),
        plgpu.Barrier(num_arrivals=2))

  return plgpu.kernel(
      body, out_type=jax.ShapeDtypeStruct((tokens, COLUMNS), DTYPE),
      **({"interpret": plgpu.InterpretGPUParams()} if interpret else {}))


def probe(tokens: int) -> float:
  """Lowers the tile for the GPU, then returns its interpret-mode error
  against float64 (relative, Frobenius)."""
  spec = jax.ShapeDtypeStruct
  jax.jit(swapped_tile_kernel(tokens, interpret=False)).trace(
      spec((tokens, DEPTH), DTYPE), spec((DEPTH, COLUMNS), DTYPE)).lower(
          lowering_platforms=("cuda",))
  rng = np.random.default_rng(tokens)
  x = jnp.asarray(rng.standard_normal((tokens, DEPTH)), DTYPE)
  w = jnp.asarray(rng.standard_normal((DEPTH, COLUMNS)), DTYPE)
  got = np.asarray(swapped_tile_kernel(tokens, interpret=True)(x, w),
                   np.float64)
  want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
  return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--tokens", default="8,16,32,64",
                      help="comma-separated token counts (multiples of 8)")
  args = parser.parse_args(argv)
  for tokens in (int(t) for t in args.tokens.split(",")):
    if tokens <= 0 or tokens % 8:
      raise SystemExit(f"--tokens: {tokens} is not a positive multiple of 8")
    error = probe(tokens)
    print(f"tokens={tokens}: lowered for the GPU; interpret-mode relative "
          f"error {error:.1e}", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
