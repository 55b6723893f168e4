"""The operands `mosaic/fp8` reads: K-major fp8 tiles and its scale arrays.

Everything here runs in XLA before the kernel: the layout change for
operands that are not K-major (see below for why), the
TMA padding, and the scales reshaped into what the kernel streams (row and
column vectors for the epilogue, or per-K-block vectors riding the TMA
ring).

fp8 wgmma reads both operands K-major only, so an MN-major operand (B in
NN, A in TN) is transposed here by XLA: one copy of that operand (fused
with the TMA padding when there is any), before the kernel. What was tried
in Mosaic (jax 0.11.2, cross-lowered for sm_90a) to keep the transpose in
the kernel:

  * wgmma on an MN-major fp8 B tile (the 16-bit kernels' way):
    "ValueError: Only f16 WGMMA supports transposes".
  * out^T = B^T A^T with B^T as wgmma's register operand (fp8 A-from-
    registers is accepted as a (64, 128) fragment): loading the transposed
    view of a swizzled (k, n) fp8 tile into the WGMMA_8BIT (or WGMMA)
    layout fails with "UnsupportedTransferError: Tiled strides must be a
    multiple of the vector length, except for the load vectorized
    dimension"; and the output tile would then need a transpose too.
  * a register transpose: FragmentedArray only transposes 16- and 32-bit
    arrays (WGMMA_LAYOUT <-> WGMMA_TRANSPOSED_LAYOUT).
  * a transposing pass through shared memory: a WG_STRIDED load of a
    swizzled tile raises "NotImplementedError: WGStridedFragLayout"; through
    unswizzled buffers, reading the transposed copy back into WGMMA_8BIT
    fails with "TransferPlanDerivationError: Failed to synthesize a transfer
    pattern that avoids bank conflicts", and with `optimized=False` with a
    verifier error ("'vector.load' op most minor memref dim must have unit
    stride").

The next step is the raw-CUDA FFI path or a Mosaic version whose 8-bit
transfers cover transposed views.
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_gemm.mosaic_backend import tma
from pallas_gemm.mosaic_backend.configs import MosaicConfig
from pallas_gemm.mosaic_backend.warp_specialised import pad_epilogue_operands
from pallas_gemm.problem import SCALE_BLOCK, GemmProblem, cdiv


def scaling_kind(problem: GemmProblem) -> str:
  """"none", "epilogue" (tensor/row/col scales) or "per_k" (block-wise)."""
  if "block" in (problem.a_scale_mode, problem.b_scale_mode):
    return "per_k"
  return "epilogue" if problem.is_scaled else "none"


def _pad_last(x, size: int):
  return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, size - x.shape[-1])],
                 constant_values=1.0)


def _scale_vector(scale, mode: str, batch: int, size: int):
  """A per-tensor / per-row / per-column scale as (batch, size) float32."""
  if mode == "none":
    return jnp.ones((batch, size), jnp.float32)
  if mode == "tensor":
    return jnp.broadcast_to(scale[:, None], (batch, size))
  return scale


def kernel_scales(problem: GemmProblem, a_scale, b_scale, m_rows: int,
                  n_cols: int):
  """The scale arrays the kernel reads, padded to whole CTA tiles:
  epilogue: per operand that has a scale, (batch,) for a per-tensor scale
            (read as is: no XLA op runs) or (batch, m_rows) / (batch,
            n_cols) for row / column scales;
  per K:    (batch, k_blocks, m_rows) and (batch, k_blocks, n_cols)."""
  kind = scaling_kind(problem)
  batch, m, n = problem.batch, problem.m, problem.n
  if kind == "epilogue":
    out = []
    for scale, mode, size in ((a_scale, problem.a_scale_mode, m_rows),
                              (b_scale, problem.b_scale_mode, n_cols)):
      if mode == "tensor":  # a reshape of a scalar: no XLA kernel runs
        out.append(jnp.broadcast_to(jnp.reshape(scale, (-1,)), (batch,)))
      elif mode != "none":
        out.append(_pad_last(scale, size))
    return tuple(out)
  k_blocks = cdiv(problem.k, SCALE_BLOCK)
  if problem.a_scale_mode == "block":
    a_k = jnp.swapaxes(a_scale, 1, 2)
  else:
    a_k = jnp.broadcast_to(
        _scale_vector(a_scale, problem.a_scale_mode, batch, m)[:, None],
        (batch, k_blocks, m))
  if problem.b_scale_mode == "block":
    b_k = jnp.repeat(b_scale, SCALE_BLOCK, axis=2)
  else:
    b_k = jnp.broadcast_to(
        _scale_vector(b_scale, problem.b_scale_mode, batch, n)[:, None],
        (batch, k_blocks, n))
  # Padded with the last column's scale, not 1: where B's factor is one
  # number across a consumer's columns the kernel reads it from any of
  # them, past N included (a per-tensor scale padded with 1 gave the rows
  # of a last, partial column tile a factor of 1).
  b_k = jnp.pad(b_k, [(0, 0), (0, 0), (0, max(n_cols - b_k.shape[2], 0))],
                mode="edge")[:, :, :n_cols]
  return _pad_last(a_k, m_rows), b_k


def prepare_operands(a, b, c, bias, problem: GemmProblem,
                     config: MosaicConfig):
  """K-major operands (see the module docstring: MN-major ones are
  transposed by XLA), padded to the TMA tiling; returns them and the padded
  output dims."""
  if problem.transpose_a:
    a = jnp.swapaxes(a, 1, 2)
  if not problem.transpose_b:
    b = jnp.swapaxes(b, 1, 2)
  cta_m, cta_n, tile_k = config.cta_tile_m, config.cta_tile_n, config.tile_k
  a = tma.pad_to_tiling(a, tma.tma_tiling(tile_k, a.dtype), (cta_m, tile_k))
  b = tma.pad_to_tiling(b, tma.tma_tiling(tile_k, b.dtype), (cta_n, tile_k))
  c, bias, out_dims = pad_epilogue_operands(c, bias, problem, config)
  return a, b, c, bias, out_dims
