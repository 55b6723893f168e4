"""TMA tiling, swizzles and the operand padding the Mosaic kernels need.

Ragged shapes. The TMA handles a box that runs past the end of an array
(zero fill on load, clipping on store), but Mosaic copies a swizzled tile
with a *tiled* TMA descriptor: it views the whole global array as tiles of
(8 rows x one 128-byte swizzle span), so both of an operand's last two dims
must be multiples of that tile (on the H200 a 66-column B was rejected at
compile time and a 1x1 operand silently computed garbage: runs 1 and 2 of
experiments/results/nvidia_h200/mosaic/README.md). An operand whose dims
are not multiples is therefore zero-padded on the device up to the next
multiple (at most 7 rows and one swizzle span minus one column), and a
padded output is sliced back. Zero padding along K adds nothing; padded
rows/columns of the output are dropped. Tile-aligned shapes (every
power-of-two size) pay nothing; other shapes pay one copy of each
misaligned operand, which the benchmark measures. The one-consumer kernels
(`small_m`, `split_k`) avoid most of those copies: they read rows of 32- or
64-byte multiples with that narrower swizzle (`widest_swizzle`), whose
tile the rows divide.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_gemm.problem import cdiv

#: The TMA needs every non-minor stride to be a multiple of this many bytes.
TMA_STRIDE_ALIGN_BYTES = 16
#: 128-byte swizzle is the only one that lets wgmma read tiles conflict-free
#: at full rate, so every operand tile's minor dimension spans 128 bytes.
SWIZZLE_BYTES = 128


def swizzle_elems(dtype) -> int:
  return SWIZZLE_BYTES // jnp.dtype(dtype).itemsize


def check_full_swizzle(in_dtype, **dims: int) -> None:
  """wgmma reads A and B with one swizzle; every operand tile dimension
  that can end up minor in shared memory must span whole 128-byte swizzle
  atoms, or A and B would get different swizzles (and a warpgroup's half of
  a tile would start mid-atom)."""
  elems = swizzle_elems(in_dtype)
  for name, value in dims.items():
    if value % elems:
      raise ValueError(
          f"{name}={value} must be a multiple of {elems} for "
          f"{jnp.dtype(in_dtype).name} inputs (one 128-byte swizzle span)")


def tma_tiling(minor_elems: int, dtype) -> tuple[int, int]:
  """The (rows, columns) tile of a swizzled shared-memory buffer whose minor
  dimension holds `minor_elems` elements: the widest swizzle that fits."""
  bits = jnp.dtype(dtype).itemsize * 8
  for swizzle in (128, 64, 32, 16):
    if (minor_elems * bits) % (swizzle * 8) == 0:
      return swizzled_tiling(swizzle, dtype)
  raise ValueError(
      f"a tile row of {minor_elems} {jnp.dtype(dtype).name} elements is not a "
      "multiple of 16 bytes")


def tiled_transforms(minor_elems: int, dtype):
  """Tiling + swizzle for a shared-memory tile whose minor dimension holds
  `minor_elems` elements: the widest swizzle that the row allows."""
  swizzle = tma_tiling(minor_elems, dtype)[1] * jnp.dtype(dtype).itemsize
  return swizzled_transforms(swizzle, dtype)


#: The swizzles wgmma reads operands with (16 bytes, no swizzle at all, it
#: cannot).
WGMMA_SWIZZLES = (128, 64, 32)


def widest_swizzle(dtype, *minor_dims: int) -> int:
  """The widest wgmma swizzle (bytes) whose span divides every one of
  `minor_dims` (elements of `dtype`): arrays whose rows are those dims then
  need no padding, where the 128-byte swizzle would pad each one (a copy)
  to whole 128-byte rows. 128 when none divides them all: they are padded
  as before."""
  size = jnp.dtype(dtype).itemsize
  for swizzle in WGMMA_SWIZZLES:
    if all(d * size % swizzle == 0 for d in minor_dims):
      return swizzle
  return SWIZZLE_BYTES


def swizzled_tiling(swizzle: int, dtype) -> tuple[int, int]:
  """The TMA tile (8 rows x one swizzle span) of `swizzle` bytes."""
  return 8, swizzle // jnp.dtype(dtype).itemsize


def swizzled_transforms(swizzle: int, dtype):
  """Tiling + swizzle for a shared-memory tile read with `swizzle` bytes."""
  return (plgpu.TilingTransform(swizzled_tiling(swizzle, dtype)),
          plgpu.SwizzleTransform(swizzle))


def pad_to_tiling(x, tiling: tuple[int, int],
                  min_shape: tuple[int, int] = (0, 0)):
  """Zero-pads the last two axes of `x` up to multiples of `tiling`, and to
  at least `min_shape` (one TMA box: a box larger than the whole array came
  back wrong on the H200). No copy when nothing changes."""
  rows, cols = x.shape[-2:]
  padded_rows, padded_cols = padded_dims(rows, cols, tiling, min_shape)
  if (padded_rows, padded_cols) == (rows, cols):
    return x
  pad = [(0, 0)] * (x.ndim - 2) + [(0, padded_rows - rows),
                                    (0, padded_cols - cols)]
  return jnp.pad(x, pad)


def padded_dims(rows: int, cols: int, tiling: tuple[int, int],
                min_shape: tuple[int, int] = (0, 0)):
  return (cdiv(max(rows, min_shape[0]), tiling[0]) * tiling[0],
          cdiv(max(cols, min_shape[1]), tiling[1]) * tiling[1])


def pad_vector(x, multiple: int):
  target = cdiv(x.shape[-1], multiple) * multiple
  if target == x.shape[-1]:
    return x
  return jnp.pad(x, [(0, target - x.shape[-1])])


@dataclasses.dataclass(frozen=True)
class TiledCut:
  """`window_copy` as blocks of `rows` x `cols` of the output, one per
  program of `warps` warps: wide loads of the aligned source rows, masked
  stores at the misaligned destination (`row_tiling` picks one)."""
  rows: int
  cols: int
  warps: int

  def __post_init__(self):
    _check_copy_fields(self, ("rows", "cols", "warps"))


@dataclasses.dataclass(frozen=True)
class FlatCut:
  """`window_copy` with the output read as one flat run of rows x cols
  elements, `elements` of it a program of `warps` warps: stores of whole
  aligned runs, each element's source found from its row and column (a
  gather along the source's rows)."""
  elements: int
  warps: int

  def __post_init__(self):
    _check_copy_fields(self, ("elements", "warps"))


def _check_copy_fields(copy, names) -> None:
  # Triton blocks are powers of two.
  for name in names:
    value = getattr(copy, name)
    if not isinstance(value, int) or value < 1 or value & (value - 1):
      raise ValueError(f"{type(copy).__name__}.{name}={value!r} must be a "
                       "positive power of two")


#: Elements one program of the tiled copy moves, where rows are narrower:
#: as many whole rows as make this many.
COPY_BLOCK_ELEMENTS = 4096
#: The widest block: longer rows take several.
COPY_MAX_COLS = 8192
#: Elements a thread moves in a block of COPY_BLOCK_ELEMENTS or more: a few
#: 16-byte loads each (blocks of many more per thread ran slower).
COPY_THREAD_ELEMENTS = 16


def row_tiling(cols: int) -> TiledCut:
  """The tiled copy of rows `cols` elements long: blocks as wide as a row
  (the next power of two, at most COPY_MAX_COLS), so that few of a block's
  lanes are masked off, of as many rows as make COPY_BLOCK_ELEMENTS, with
  4 to 8 warps at COPY_THREAD_ELEMENTS each."""
  width = min(1 << max(cols - 1, 0).bit_length(), COPY_MAX_COLS)
  rows = max(1, COPY_BLOCK_ELEMENTS // width)
  warps = rows * width // (32 * COPY_THREAD_ELEMENTS)
  return TiledCut(rows=rows, cols=width, warps=max(4, min(8, warps)))


def unpad_output(out, m: int, n: int, *, on_gpu: bool,
                 copy: TiledCut | FlatCut | None = None):
  """`out[:, :m, :n]` of a padded kernel output.

  When rows of n elements are not whole 16-byte units, every row of the
  result starts at a misaligned address, and XLA's slice of such an array
  runs far below the copy bandwidth (on the H200 it took a quarter of a ragged
  4095x4097x4093 call: experiments/results/nvidia_h200/mosaic/README.md,
  "Ragged shapes"). A Pallas-Triton copy kernel (`copy`, by default
  `row_tiling(n)`) with masked edges runs much faster. Off a GPU, or where
  the Triton lowering is not available, the XLA slice stays.
  """
  if out.shape[1:] == (m, n):
    return out
  if not on_gpu or n * out.dtype.itemsize % TMA_STRIDE_ALIGN_BYTES == 0:
    return out[:, :m, :n]
  try:
    from jax.experimental.pallas import triton
    del triton  # only whether it imports
  except ImportError:
    return out[:, :m, :n]
  return cut_copy(out, m, n, copy or row_tiling(n))


def unpad_matrix(out, m: int, n: int, *, on_gpu: bool):
  """`out[:m, :n]` of a padded 2-D kernel output, cut as `unpad_output`
  cuts a batch of them."""
  if out.shape == (m, n):
    return out
  return unpad_output(out[None], m, n, on_gpu=on_gpu)[0]


def cut_copy(out, m: int, n: int, copy: TiledCut | FlatCut, *,
             interpret: bool = False):
  """`out[:, :m, :n]` by the Pallas-Triton kernel `copy` describes."""
  if not (0 < m <= out.shape[1] and 0 < n <= out.shape[2]):
    raise ValueError(f"cut_copy: (m, n)=({m}, {n}) must be positive and "
                     f"within out's {out.shape[1:]}")
  return window_copy(out, m, n, copy, interpret=interpret)


def window_copy(x, rows: int, cols: int, copy: TiledCut | FlatCut, *,
                dtype=None, interpret: bool = False):
  """A (batch, rows, cols) array whose [b, r, c] is `x[b, r, c]` where x has
  it and 0 elsewhere (a cut, a zero pad, or both), cast to `dtype`, by the
  Pallas-Triton kernel `copy` describes (under the interpreter where
  `interpret`, e.g. in CPU tests). A flat copy of 2**31 elements a batch or
  more runs tiled (`row_tiling`): its indices are int32."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import triton as pltriton

  batch, src_rows, src_cols = x.shape
  dtype = jnp.dtype(dtype or x.dtype)
  # Pallas-Triton builds no fp8 constant (the masked load's fill): 1-byte
  # floats travel as bytes and are read as floats once loaded.
  stored_dtype = x.dtype
  if x.dtype.itemsize == 1 and jnp.issubdtype(x.dtype, jnp.floating):
    x = jax.lax.bitcast_convert_type(x, jnp.uint8)

  def converted(values):
    if values.dtype != stored_dtype:
      values = jax.lax.bitcast_convert_type(values, stored_dtype)
    return values.astype(dtype)

  out_shape = jax.ShapeDtypeStruct((batch, rows, cols), dtype)
  params = pltriton.CompilerParams(num_warps=copy.warps, num_stages=1)
  # The cost model counts the cut by this name (`cost_model.CUT_KERNELS`).
  name = ("unpad_output" if rows <= src_rows and cols <= src_cols
          else "pad_window")
  if isinstance(copy, FlatCut) and max(src_rows * src_cols,
                                       rows * cols) >= 2**31:
    copy = row_tiling(cols)
  if isinstance(copy, FlatCut):
    per = copy.elements

    def flat_kernel(src_ref, dst_ref):
      start = pl.program_id(1) * per
      index = start + jnp.arange(per, dtype=jnp.int32)
      row = index // cols
      col = index - row * cols
      stored = index < rows * cols
      loaded = stored & (row < src_rows) & (col < src_cols)
      source = jnp.where(loaded, row * src_cols + col, 0)
      run = pltriton.load(src_ref.at[source], mask=loaded, other=0)
      pltriton.store(dst_ref.at[pl.ds(start, per)], converted(run),
                     mask=stored)

    def flat(size):
      return pl.BlockSpec((None, size), lambda b, j: (b, 0))

    copied = pl.pallas_call(
        flat_kernel,
        out_shape=jax.ShapeDtypeStruct((batch, rows * cols), dtype),
        grid=(batch, cdiv(rows * cols, per)),
        in_specs=[flat(src_rows * src_cols)], out_specs=flat(rows * cols),
        compiler_params=params, interpret=interpret, name=name,
    )(x.reshape(batch, src_rows * src_cols))
    return copied.reshape(out_shape.shape)

  rows_per, cols_per = copy.rows, copy.cols

  def kernel(src_ref, dst_ref):
    i, j = pl.program_id(1), pl.program_id(2)
    row = (i * rows_per + jnp.arange(rows_per, dtype=jnp.int32))[:, None]
    col = (j * cols_per + jnp.arange(cols_per, dtype=jnp.int32))[None, :]
    block = (pl.ds(i * rows_per, rows_per), pl.ds(j * cols_per, cols_per))
    tile = pltriton.load(src_ref.at[block],
                         mask=(row < src_rows) & (col < src_cols), other=0)
    pltriton.store(dst_ref.at[block], converted(tile),
                   mask=(row < rows) & (col < cols))

  def whole(shape):
    return pl.BlockSpec((None, *shape), lambda b, i, j: (b, 0, 0))

  return pl.pallas_call(
      kernel, out_shape=out_shape,
      grid=(batch, cdiv(rows, rows_per), cdiv(cols, cols_per)),
      in_specs=[whole(x.shape[1:])], out_specs=whole((rows, cols)),
      compiler_params=params, interpret=interpret, name=name,
  )(x)
