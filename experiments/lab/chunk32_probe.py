"""Can the grouped GEMM's weight gradient reduce token rows in chunks of 32
instead of 64?

    PYTHONPATH=. python3 experiments/lab/chunk32_probe.py

The weight gradient, out[g] = lhs[rows of g]^T @ dout[rows of g], reduces
each expert's tokens in chunks of `RaggedConfig.tile_k` rows. The token
rows are wgmma's K and both operands are read transposed relative to
their rows, and with the 128-byte swizzle every operand stage uses,
Mosaic GPU's `wgmma` requires that K be a multiple of the swizzle span (64
16-bit elements): a 32-row chunk raises "K must be a multiple of 64" when
lowered. An expert whose rows end mid-chunk computes the rest of the
chunk as zeros (273 rows run as 320 on Qwen1.5-MoE's even routing; about
half a chunk per expert on a Zipf routing), so a 32-row chunk would halve
that padding.

For each (chunk rows, swizzle) this builds one tile (one CTA: lhs chunk
(rows, M) and dout chunk (rows, N) loaded by TMA with that swizzle, one
wgmma of A = lhs^T and B = dout, a TMA store of the float32 product),
lowers it for the GPU (no GPU needed: Mosaic's checks and lowering run,
ptxas only on a GPU) and, where it lowers, runs it in interpret mode
against float64. It answers whether Mosaic takes the
pieces, not how fast they run: a narrower swizzle means TMA boxes of 32
columns (four copies per 128-column operand stage) and twice the ring
steps per expert, which only a GPU A/B can weigh against the padding.
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

from experiments.lab.swap_ab_probe import load_and_multiply  # noqa: E402
from pallas_gemm.mosaic_backend.tma import swizzled_transforms  # noqa: E402

DTYPE = jnp.bfloat16
#: (chunk rows, swizzle bytes): today's chunk, the 32-row chunk at today's
#: swizzle (expected to be refused), and the 32- and 16-row chunks at the
#: swizzles whose spans they fill.
DEFAULT_CASES = "64:128,32:128,32:64,16:32"


def contraction_tile_kernel(rows: int, swizzle: int, m: int, n: int,
                            interpret: bool):
  """out (m, n) = lhs (rows, m)^T @ dout (rows, n), in float32."""
  transforms = swizzled_transforms(swizzle, DTYPE)

  def body(lhs_gmem, dout_gmem, out_gmem):
    def scoped(lhs_smem, dout_smem, out_smem, landed):
      # The token rows are K: A = lhs^T (m x rows), B = dout (rows x n).
      out_smem[...] = load_and_multiply(
          (lhs_gmem, dout_gmem), (lhs_smem, dout_smem), landed,
          lambda lhs, dout: (lhs.T, dout), (m, n))
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(out_smem, out_gmem)
      plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(scoped,
                  plgpu.SMEM((rows, m), DTYPE, transforms=transforms),
                  plgpu.SMEM((rows, n), DTYPE, transforms=transforms),
                  plgpu.SMEM((m, n), jnp.float32),
                  plgpu.Barrier(num_arrivals=2))

  return plgpu.kernel(
      body, out_type=jax.ShapeDtypeStruct((m, n), jnp.float32),
      **({"interpret": plgpu.InterpretGPUParams()} if interpret else {}))


def probe(rows: int, swizzle: int, m: int, n: int) -> float:
  """Lowers the tile for the GPU (raising where Mosaic refuses it), then
  returns its interpret-mode error against float64 (relative,
  Frobenius)."""
  spec = jax.ShapeDtypeStruct
  jax.jit(contraction_tile_kernel(rows, swizzle, m, n, interpret=False)
          ).trace(spec((rows, m), DTYPE), spec((rows, n), DTYPE)).lower(
              lowering_platforms=("cuda",))
  rng = np.random.default_rng(rows * 1000 + swizzle)
  lhs = jnp.asarray(rng.standard_normal((rows, m)), DTYPE)
  dout = jnp.asarray(rng.standard_normal((rows, n)), DTYPE)
  got = np.asarray(
      contraction_tile_kernel(rows, swizzle, m, n, interpret=True)(lhs, dout),
      np.float64)
  want = np.asarray(lhs, np.float64).T @ np.asarray(dout, np.float64)
  return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def _cases(text: str) -> list[tuple[int, int]]:
  cases = []
  for item in text.split(","):
    rows, _, swizzle = item.partition(":")
    try:
      case = (int(rows), int(swizzle))
    except ValueError:
      raise SystemExit(f"--cases: {item!r} is not ROWS:SWIZZLE") from None
    if case[0] <= 0 or case[0] % 8 or case[1] not in (32, 64, 128):
      raise SystemExit(f"--cases: {item!r} needs rows a positive multiple "
                       "of 8 and a swizzle of 32, 64 or 128 bytes")
    cases.append(case)
  return cases


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--cases", default=DEFAULT_CASES,
                      help="comma-separated ROWS:SWIZZLE pairs")
  parser.add_argument("--m", type=int, default=64,
                      help="output rows (lhs columns; wgmma's M, 64)")
  parser.add_argument("--n", type=int, default=128,
                      help="output columns (dout columns; wgmma's N)")
  args = parser.parse_args(argv)
  for rows, swizzle in _cases(args.cases):
    try:
      error = probe(rows, swizzle, args.m, args.n)
    except Exception as e:  # Mosaic's refusal is the answer, not a crash.
      first = (str(e).strip().splitlines() or [type(e).__name__])[0]
      print(f"chunk={rows} swizzle={swizzle}: refused: {first}", flush=True)
      continue
    print(f"chunk={rows} swizzle={swizzle}: lowered for the GPU; "
          f"interpret-mode relative error {error:.1e}", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
