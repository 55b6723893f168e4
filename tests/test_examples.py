"""The framework examples train on pallas_gemm and match the same models on
lax: a Flax nnx transformer block and an Equinox MLP (tiny, CPU)."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

# The test extra installs them; an offline environment may lack them.
for _module in ("flax", "equinox", "optax"):
  pytest.importorskip(_module, reason=f"{_module} is not installed "
                      "(pip install -e '.[examples]')")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))), "examples"))

import equinox_mlp  # noqa: E402
import flax_transformer  # noqa: E402

# Both models train in float32 at default precision (TF32 where a GPU runs
# the kernels); a few steps of Adam keep the losses this close.
LOSS_RTOL = 2e-2


def test_flax_transformer_trains_on_pallas_gemm():
  model, losses = flax_transformer.train(flax_transformer.PALLAS, steps=2)
  _, lax_losses = flax_transformer.train(flax_transformer.LAX, steps=2)
  np.testing.assert_allclose(losses, lax_losses, rtol=LOSS_RTOL)
  assert losses[-1] < losses[0]
  # Linear, LinearGeneral (one and two contracting axes), Einsum and the
  # attention einsums, forward and backward: all pallas_gemm, no lax dot.
  counts = flax_transformer.primitive_counts(model)
  assert counts["pallas_gemm"] >= 20 and counts["dot_general"] == 0


def test_equinox_mlp_trains_on_pallas_gemm():
  dense = equinox_mlp.pallas_dense
  model, losses = equinox_mlp.train(dense, steps=2)
  _, lax_losses = equinox_mlp.train(equinox_mlp.lax_dense, steps=2)
  np.testing.assert_allclose(losses, lax_losses, rtol=LOSS_RTOL)
  assert losses[-1] < losses[0]
  # Three layers forward; dW for each and dX for the two past the first.
  counts = equinox_mlp.primitive_counts(model, dense)
  assert counts["pallas_gemm"] == 8 and counts["dot_general"] == 0


def test_every_form_the_flax_example_uses_is_in_the_docs_table():
  """The docs table (rendered from test_dot_general.FORMS) lists each
  dot_general form the Flax example calls."""
  import functools

  import jax.numpy as jnp
  import pallas_gemm
  from test_dot_general import FORMS

  seen = set()

  def recording(lhs, rhs, dims, *args, **kwargs):
    (lc, rc), (lb, rb) = dims
    seen.add((lhs.ndim, rhs.ndim, ((tuple(lc), tuple(rc)),
                                   (tuple(lb), tuple(rb)))))
    return pallas_gemm.dot_general(lhs, rhs, dims, *args, **kwargs)

  ops = {"dot_general": recording,
         "einsum": functools.partial(jnp.einsum, _dot_general=recording)}
  model = flax_transformer.make_model(ops)
  assert flax_transformer.primitive_counts(model)["pallas_gemm"] >= 20
  listed = {(len(l), len(r), d) for _, l, r, d in FORMS}
  assert seen and seen <= listed, seen - listed
