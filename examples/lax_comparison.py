"""What both framework examples print: how much of the training step runs
on pallas_gemm, and its losses next to the same model's on lax."""

from __future__ import annotations

import jax

import pallas_gemm


def training_primitive_counts(loss_of_params, params):
  """Equations of each primitive in the jaxpr of `loss_of_params` and its
  gradient at `params`."""
  jaxpr = jax.make_jaxpr(jax.value_and_grad(loss_of_params))(params)
  return pallas_gemm.primitive_counts(jaxpr)


def print_comparison(counts, losses, lax_losses):
  """`counts`: the pallas_gemm model's `training_primitive_counts`."""
  print(f"pallas_gemm equations in the training jaxpr: "
        f"{counts['pallas_gemm']}")
  print(f"dot_general equations left: {counts['dot_general']}")
  for i, (ours, theirs) in enumerate(zip(losses, lax_losses)):
    print(f"step {i}: loss {ours:.6f} (lax: {theirs:.6f})")
