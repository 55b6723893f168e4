"""An Equinox MLP whose layers multiply with `pallas_gemm.matmul`.

    python examples/equinox_mlp.py

Each layer is `activation(x @ W + b)` as one fused GEMM: the bias and the
activation run in the kernel's epilogue. The MLP trains for a few optax
steps on a toy regression; the same MLP on `jnp.matmul` trains alongside for
comparison. On a CPU the kernels run in interpret mode, so the sizes are
tiny.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from lax_comparison import print_comparison, training_primitive_counts

import pallas_gemm


def pallas_dense(x, weight, bias, activation):
  return pallas_gemm.matmul(x, weight, bias=bias, activation=activation)


def lax_dense(x, weight, bias, activation):
  out = jnp.matmul(x, weight) + bias
  return out if activation is None else pallas_gemm.ACTIVATIONS[activation](out)


class Dense(eqx.Module):
  weight: jax.Array
  bias: jax.Array
  activation: str | None = eqx.field(static=True)

  def __init__(self, fan_in, fan_out, activation, *, key):
    self.weight = jax.random.normal(key, (fan_in, fan_out)) * fan_in ** -0.5
    self.bias = jnp.zeros((fan_out,))
    self.activation = activation

  def __call__(self, x, dense):
    return dense(x, self.weight, self.bias, self.activation)


class MLP(eqx.Module):
  layers: tuple[Dense, ...]

  def __init__(self, sizes, *, key):
    keys = jax.random.split(key, len(sizes) - 1)
    last = len(sizes) - 2
    self.layers = tuple(
        Dense(fan_in, fan_out, None if i == last else "gelu", key=k)
        for i, (fan_in, fan_out, k) in enumerate(
            zip(sizes[:-1], sizes[1:], keys)))

  def __call__(self, x, dense):
    for layer in self.layers:
      x = layer(x, dense)
    return x


def batch(seed=1, size=16, features=8):
  """A toy regression: y = sin(x · w)."""
  x = jax.random.normal(jax.random.key(seed), (size, features))
  w = jax.random.normal(jax.random.key(seed + 1), (features, 1))
  return x, jnp.sin(x @ w)


def loss_fn(model, dense, x, y):
  return jnp.mean((model(x, dense) - y) ** 2)


def train(dense, steps=3, learning_rate=1e-2, sizes=(8, 32, 32, 1)):
  """Trains a fresh MLP; returns the model and the loss before each step."""
  model = MLP(sizes, key=jax.random.key(0))
  optimizer = optax.adam(learning_rate)
  opt_state = optimizer.init(eqx.filter(model, eqx.is_array))
  x, y = batch()

  @eqx.filter_jit
  def step(model, opt_state):
    loss, grads = eqx.filter_value_and_grad(loss_fn)(model, dense, x, y)
    updates, opt_state = optimizer.update(grads, opt_state)
    return eqx.apply_updates(model, updates), opt_state, loss

  losses = []
  for _ in range(steps):
    model, opt_state, loss = step(model, opt_state)
    losses.append(float(loss))
  return model, losses


def primitive_counts(model, dense):
  """Equations of each primitive in the jaxpr of the loss and its
  gradient."""
  x, y = batch()
  params, static = eqx.partition(model, eqx.is_array)

  def loss_of_params(params):
    return loss_fn(eqx.combine(params, static), dense, x, y)

  return training_primitive_counts(loss_of_params, params)


def main():
  model, losses = train(pallas_dense)
  _, lax_losses = train(lax_dense)
  print_comparison(primitive_counts(model, pallas_dense), losses, lax_losses)
  return losses, lax_losses


if __name__ == "__main__":
  main()
