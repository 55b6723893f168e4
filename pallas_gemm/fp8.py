"""fp8 quantization and dequantization scales.

Convention: a scale is a *dequantization* factor, float32: x ≈ q · s, where
q is the stored fp8 value. The layouts (`pallas_gemm.problem.SCALE_MODES`):

  per tensor   one scalar s, shape ();
  per row      A (m, k): shape (m,), one per row of op(A);
  per column   B (k, n): shape (n,), one per column of op(B);
  block-wise   A (m, k): 1x128 blocks, shape (m, ceil(k/128));
               B stored (k, n): 128x128 blocks, shape (ceil(k/128), ceil(n/128));
               B stored (n, k) (`transpose_b=True`): (ceil(n/128), ceil(k/128)).

`quantize_fp8(x, block=...)` returns scales in the shape of the array as it
is stored, so its results go straight into `pallas_gemm.matmul`: quantize B
stored (n, k) with `block=(128, 128)` and pass `transpose_b=True`.

Quantization divides each block by amax / dtype_max (amax: the block's
largest magnitude), rounds to the nearest fp8 value (ties to even) and
saturates to ±dtype_max, so values never become inf or NaN. An all-zero
block gets scale 1.
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_gemm.problem import FP8_DTYPES, SCALE_BLOCK, cdiv, dtype_name

__all__ = ["quantize_fp8", "dequantize_fp8", "fp8_max"]


def fp8_max(dtype) -> float:
  """The largest finite value of an fp8 dtype (448 for e4m3fn, 57344 for
  e5m2)."""
  return float(jnp.finfo(dtype).max)


def _check_fp8_dtype(dtype, name="dtype"):
  try:
    dtype_str = dtype_name(dtype)
  except TypeError:
    raise TypeError(f"{name}={dtype!r} is not a dtype") from None
  if dtype_str not in FP8_DTYPES:
    raise TypeError(f"{name}={dtype_str} is not one of {FP8_DTYPES}")
  return jnp.dtype(dtype)


def _check_block(block, shape):
  if block is None:
    return None
  if (not isinstance(block, (tuple, list)) or len(block) != 2
      or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 1
                 for b in block)):
    raise ValueError(f"block={block!r} must be None or a (rows, cols) pair "
                     "of positive ints, e.g. (1, 128) or (128, 128)")
  if len(shape) < 2:
    raise ValueError(f"block={block!r} needs an array of rank >= 2, got "
                     f"shape {shape}")
  return tuple(block)


def _block_grid(shape, block) -> tuple[int, int]:
  """(R, C): the blocks over the last two axes of `shape`, the last ones
  partial; a block-scaled array's scales are (..., R, C)."""
  return cdiv(shape[-2], block[0]), cdiv(shape[-1], block[1])


def _blocks_view(x, block):
  """x (..., r, c) zero-padded and viewed as (..., R, br, C, bc)."""
  rows, cols = x.shape[-2:]
  (br, bc), (grid_r, grid_c) = block, _block_grid(x.shape, block)
  pad = [(0, 0)] * (x.ndim - 2) + [(0, grid_r * br - rows),
                                   (0, grid_c * bc - cols)]
  xp = jnp.pad(x, pad)
  return xp.reshape(x.shape[:-2] + (grid_r, br, grid_c, bc))


def expand_block_scales(scales, block, shape):
  """Block scales (..., R, C) repeated to an array of `shape` (..., r, c)."""
  rows, cols = shape[-2:]
  out = jnp.repeat(jnp.repeat(scales, block[0], axis=-2), block[1], axis=-1)
  return out[..., :rows, :cols]


def quantize_fp8(x, *, dtype=jnp.float8_e4m3fn, block=None):
  """Quantizes `x` to fp8 with dequantization scales: returns (q, s), x ≈ q·s.

  Args:
    x: a float array.
    dtype: jnp.float8_e4m3fn (default) or jnp.float8_e5m2.
    block: None for one scale per tensor (s has shape ()), or a (rows, cols)
      block over the last two axes, e.g. (1, 128) for activations and
      (128, 128) for weights; s then has shape
      (..., ceil(rows_x / rows), ceil(cols_x / cols)). Leading axes get
      their own scales.

  Scales come from the finite values. A non-finite value stays non-finite
  rather than clipping, or spoiling its block's other values: nan stays
  nan, and inf becomes inf in e5m2 and nan in e4m3fn (which has no inf).
  """
  dtype = _check_fp8_dtype(dtype)
  x = jnp.asarray(x)
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"x has dtype {x.dtype}; it must be a float array")
  block = _check_block(block, x.shape)
  max_value = fp8_max(dtype)
  x32 = x.astype(jnp.float32)
  finite = jnp.isfinite(x32)
  magnitude = jnp.where(finite, jnp.abs(x32), 0.0)

  def quantized(full_scale):
    return jnp.where(finite,
                     jnp.clip(x32 / full_scale, -max_value, max_value),
                     x32).astype(dtype)

  if block is None:
    amax = jnp.max(magnitude) if x.size else jnp.float32(0)
    scale = jnp.where(amax > 0, amax / max_value, 1.0).astype(jnp.float32)
    return quantized(scale), scale
  amax = jnp.max(_blocks_view(magnitude, block), axis=(-3, -1))
  scale = jnp.where(amax > 0, amax / max_value, 1.0).astype(jnp.float32)
  return quantized(expand_block_scales(scale, block, x.shape)), scale


def dequantize_fp8(q, scale, *, block=None):
  """q · s in float32, for `quantize_fp8`'s layouts (the inverse up to
  rounding): `block` must be the one `q` and `scale` were made with."""
  q32 = jnp.asarray(q).astype(jnp.float32)
  scale = jnp.asarray(scale, jnp.float32)
  block = _check_block(block, q32.shape)
  want = (() if block is None
          else q32.shape[:-2] + _block_grid(q32.shape, block))
  if scale.shape != want:
    raise ValueError(
        f"scale.shape={scale.shape} does not match q.shape={q32.shape} with "
        f"block={block}: quantize_fp8 makes scales of shape {want} there; "
        f"pass the block the scales were made with")
  if block is None:
    return q32 * scale
  return q32 * expand_block_scales(scale, block, q32.shape)


# ------------------------------------------- canonical (primitive) operands ---


def dequantize_operand(x, scale, mode: str, *, operand: str, transposed: bool):
  """x · s in float32 for a canonical batched operand of `pallas_gemm_p`.

  x is (batch, m, k) for A, (batch, k, n) for B, with the last two axes
  swapped when `transposed`; scale has the canonical batched shape
  (`pallas_gemm.primitive`), B's block scales being (batch, kb, nb).
  """
  x32 = x.astype(jnp.float32)
  if mode == "none":
    return x32
  if transposed:
    x32 = jnp.swapaxes(x32, 1, 2)
  # Now A is (batch, m, k) and B (batch, k, n).
  if mode == "tensor":
    full = scale[:, None, None]
  elif mode == "row":
    full = scale[:, :, None]
  elif mode == "col":
    full = scale[:, None, :]
  else:
    blocks = (1, SCALE_BLOCK) if operand == "a" else (SCALE_BLOCK, SCALE_BLOCK)
    full = expand_block_scales(scale, blocks, x32.shape)
  out = x32 * full
  return jnp.swapaxes(out, 1, 2) if transposed else out


def output_scale(a_scale, a_mode: str, b_scale, b_mode: str):
  """The (batch, m, n)-broadcastable factor of per-tensor/row/column scales,
  or None when there is none."""
  factor = None
  if a_mode == "tensor":
    factor = a_scale[:, None, None]
  elif a_mode == "row":
    factor = a_scale[:, :, None]
  if b_mode in ("tensor", "col"):
    b_factor = b_scale[:, None, None] if b_mode == "tensor" else (
        b_scale[:, None, :])
    factor = b_factor if factor is None else factor * b_factor
  return factor


def reference_operand(x, scale, mode: str, *, operand: str,
                      transposed: bool):
  """float64 NumPy dequantization of an unbatched API operand (tests)."""
  import numpy as np
  x64 = np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)
  if mode == "none":
    return x64
  s = np.asarray(scale, np.float64)
  if transposed:
    x64 = x64.T
  if mode == "tensor":
    full = s
  elif mode == "row":
    full = s[:, None]
  elif mode == "col":
    full = s[None, :]
  else:
    if operand == "b" and transposed:
      s = s.T  # stored (nb, kb)
    br, bc = (1, SCALE_BLOCK) if operand == "a" else (SCALE_BLOCK, SCALE_BLOCK)
    full = np.repeat(np.repeat(s, br, 0), bc, 1)[:x64.shape[0], :x64.shape[1]]
  out = x64 * full
  return out.T if transposed else out

