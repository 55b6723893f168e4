"""The XLA form of the gated linear unit: two dots and an elementwise
fusion. It is the fallback where the Mosaic kernel cannot run, and the
baseline the kernel is measured against."""

from __future__ import annotations

import jax.numpy as jnp

from pallas_gemm.gated_linear_unit.problem import GLU_ACTIVATIONS


def glu_products(x, w_gate, w_up, *, precision=None, out_dtype):
  """(gate, up) = (x @ w_gate, x @ w_up), each rounded to `out_dtype`, as
  `jnp.dot` with a float32 accumulator writes them. Where `out_dtype` is
  at least as wide as x's, the dot writes it directly (XLA accumulates in
  float32 either way): a float32 product cast afterwards is a float32
  write and read of each product that XLA does not fold into the GEMM."""
  out_dtype = jnp.dtype(out_dtype)
  written = (out_dtype if out_dtype.itemsize >= x.dtype.itemsize
             else jnp.dtype(jnp.float32))
  return tuple(jnp.dot(x, w, precision=precision,
                       preferred_element_type=written).astype(out_dtype)
               for w in (w_gate, w_up))


def gate(gate_products, up_products, activation: str, out_dtype):
  """activation(gate) * up, computed in float32, rounded once."""
  g = gate_products.astype(jnp.float32)
  u = up_products.astype(jnp.float32)
  return (GLU_ACTIVATIONS[activation](g) * u).astype(out_dtype)


def glu_xla(x, w_gate, w_up, *, activation: str = "silu", precision=None,
            out_dtype=None):
  """activation(x @ w_gate) * (x @ w_up) with jnp, for a 2-D x."""
  out_dtype = x.dtype if out_dtype is None else out_dtype
  g, u = glu_products(x, w_gate, w_up, precision=precision,
                      out_dtype=out_dtype)
  return gate(g, u, activation, out_dtype)
