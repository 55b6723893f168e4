"""Can the Mosaic kernels read a weight matrix whose rows are not whole
64-column spans in place? Lowers (for CUDA, on any machine) a one-tile
kernel that TMA-loads a (64, 64) block of a (64, N) bfloat16 global array
into shared memory and multiplies it with wgmma, for each N and each
shared-memory layout of the block:

- `tiled`: the 8 x 64 tiles and 128-byte swizzle every kernel here uses.
  Mosaic views the whole global array as tiles, and raises unless N is a
  multiple of 64 or below it ("When no rounding mode is specified ...";
  its `TileTransform` has a `Rounding.DOWN` that Pallas does not expose).
- `swizzle_only`: the swizzle without the tiling transform, which would
  let the TMA read an untiled view. Mosaic's wgmma cannot infer a layout
  for it, whatever N.

    PYTHONPATH=. python3 experiments/lab/tiled_partial_span_probe.py \\
        [--widths 128,200,40,100]

Each line prints the layout, N and "lowers" or the error. (N of 100 rows
are 200 bytes: not a multiple of 16, which the TMA needs of every stride.)
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

_ROOT = pathlib.Path(__file__).resolve().parents[2]
for path in (_ROOT, _ROOT / "tests"):
  if str(path) not in sys.path:
    sys.path.insert(0, str(path))

from kernel_test_base import lower_for_cuda  # noqa: E402

SPAN = 64  # 16-bit elements of one 128-byte swizzle span
TILED = (plgpu.TilingTransform((8, SPAN)), plgpu.SwizzleTransform(128))
LAYOUTS = {"tiled": TILED, "swizzle_only": (plgpu.SwizzleTransform(128),)}


def one_tile_kernel(width: int, b_transforms):
  """out (64, 64) f32 = a (64, 64) @ b[:, last whole-or-partial span]."""
  last_span = (width - 1) // SPAN * SPAN

  def body(a_gmem, b_gmem, out_gmem):
    def scoped(a_smem, b_smem, out_smem, barrier):
      plgpu.copy_gmem_to_smem(a_gmem, a_smem, barrier.at[0])
      # A traced start, as the kernels' column strips are: a static one
      # past the array's end is refused before Mosaic sees it.
      start = pl.multiple_of(jax.lax.axis_index("tile") + last_span, SPAN)
      plgpu.copy_gmem_to_smem(b_gmem.at[:, pl.ds(start, SPAN)], b_smem,
                              barrier.at[0])
      plgpu.barrier_wait(barrier.at[0])

      def multiply(acc_ref):
        plgpu.wgmma(acc_ref, a_smem, b_smem)
        plgpu.wgmma_wait(0)
        return acc_ref[...]
      out_smem[...] = pl.run_scoped(multiply,
                                    plgpu.ACC((64, SPAN), jnp.float32))
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(out_smem, out_gmem)
      plgpu.wait_smem_to_gmem(0)
    pl.run_scoped(scoped,
                  plgpu.SMEM((64, SPAN), jnp.bfloat16, transforms=TILED),
                  plgpu.SMEM((64, SPAN), jnp.bfloat16,
                             transforms=b_transforms),
                  plgpu.SMEM((64, SPAN), jnp.float32),
                  plgpu.Barrier(num_barriers=1))

  return plgpu.kernel(body,
                      out_type=jax.ShapeDtypeStruct((64, SPAN), jnp.float32),
                      grid=(1,), grid_names=("tile",))


def probe(layout: str, width: int) -> str:
  spec = jax.ShapeDtypeStruct
  try:
    lower_for_cuda(one_tile_kernel(width, LAYOUTS[layout]),
                   spec((64, SPAN), jnp.bfloat16),
                   spec((64, width), jnp.bfloat16))
  except Exception as error:  # noqa: BLE001 - the answer being probed
    return f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
  return "lowers"


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--widths", default="128,200,40,100")
  args = parser.parse_args(argv)
  try:
    widths = [int(w) for w in args.widths.split(",")]
  except ValueError:
    raise SystemExit(f"--widths={args.widths!r} must be comma-separated "
                     "integers")
  if not widths or min(widths) < 1:
    raise SystemExit(f"--widths={args.widths!r} must be positive")
  for layout in LAYOUTS:
    for width in widths:
      print(f"{layout} N={width}: {probe(layout, width)}", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
