"""A Flax nnx transformer block whose every product runs on pallas_gemm.

    python examples/flax_transformer.py

The attention projections are `nnx.Einsum` (queries: 'btd,dnh->bnth') and
`nnx.LinearGeneral` (keys and values: d -> (heads, head_dim); the output:
(heads, head_dim) -> d, two contracting axes); the MLP is two `nnx.Linear`.
Each takes `pallas_gemm.dot_general` (the Einsum through `jnp.einsum`'s
`_dot_general`), and so do the attention's own einsums. The block trains for
a few optax steps; the same model on lax trains alongside for comparison.
On a CPU the kernels run in interpret mode, so the sizes are tiny.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from lax_comparison import print_comparison, training_primitive_counts

import pallas_gemm

LAX = {"dot_general": jax.lax.dot_general, "einsum": jnp.einsum}
PALLAS = {"dot_general": pallas_gemm.dot_general,
          "einsum": functools.partial(jnp.einsum,
                                      _dot_general=pallas_gemm.dot_general)}


class Block(nnx.Module):
  """Pre-norm self-attention and MLP, with residuals."""

  def __init__(self, dim, heads, hidden, *, ops, rngs):
    head_dim = dim // heads
    dot, einsum = ops["dot_general"], ops["einsum"]
    self.einsum = einsum
    self.norm1 = nnx.LayerNorm(dim, rngs=rngs)
    self.norm2 = nnx.LayerNorm(dim, rngs=rngs)
    self.query = nnx.Einsum("btd,dnh->bnth", (dim, heads, head_dim),
                            einsum_op=einsum, rngs=rngs)
    self.key = nnx.LinearGeneral(dim, (heads, head_dim), dot_general=dot,
                                 rngs=rngs)
    self.value = nnx.LinearGeneral(dim, (heads, head_dim), dot_general=dot,
                                   rngs=rngs)
    self.out = nnx.LinearGeneral((heads, head_dim), dim, axis=(-2, -1),
                                 dot_general=dot, rngs=rngs)
    self.up = nnx.Linear(dim, hidden, dot_general=dot, rngs=rngs)
    self.down = nnx.Linear(hidden, dim, dot_general=dot, rngs=rngs)

  def __call__(self, x):
    h = self.norm1(x)
    # Heads before positions: both attention products are then batched
    # GEMMs that read their operands as stored (no copy inside dot_general).
    heads_first = lambda t: jnp.transpose(t, (0, 2, 1, 3))
    q = self.query(h)
    k, v = heads_first(self.key(h)), heads_first(self.value(h))
    scale = q.shape[-1] ** -0.5
    logits = self.einsum("bnth,bnsh->bnts", q * scale, k)
    causal = jnp.tril(jnp.ones(logits.shape[-2:], bool))
    weights = jax.nn.softmax(jnp.where(causal, logits, -1e9), axis=-1)
    attended = self.einsum("bnts,bnsh->bnth", weights, v)
    x = x + self.out(heads_first(attended))
    return x + self.down(jax.nn.gelu(self.up(self.norm2(x))))


def make_model(ops, *, dim=16, heads=2, hidden=32, seed=0):
  return Block(dim, heads, hidden, ops=ops, rngs=nnx.Rngs(seed))


def batch(seed=1, *, size=2, length=8, dim=16):
  """A toy regression: predict the running mean of the inputs."""
  # float32 stated: with jax_enable_x64 the defaults would be float64,
  # which no GPU kernel computes (dot_general would leave it to lax).
  x = jax.random.normal(jax.random.key(seed), (size, length, dim), jnp.float32)
  y = jnp.cumsum(x, axis=1) / jnp.arange(1, length + 1, dtype=jnp.float32)[:, None]
  return x, y


def loss_fn(model, x, y):
  return jnp.mean((model(x) - y) ** 2)


def train(ops, steps=3, learning_rate=1e-2):
  """Trains a fresh block; returns the model and the loss before each step."""
  model = make_model(ops)
  optimizer = nnx.Optimizer(model, optax.adam(learning_rate), wrt=nnx.Param)
  x, y = batch()

  @nnx.jit
  def step(model, optimizer):
    loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
    optimizer.update(model, grads)
    return loss

  return model, [float(step(model, optimizer)) for _ in range(steps)]


def primitive_counts(model):
  """Equations of each primitive in the jaxpr of the loss and its
  gradient."""
  graphdef, state = nnx.split(model)
  x, y = batch()

  def loss_of_state(state):
    return loss_fn(nnx.merge(graphdef, state), x, y)

  return training_primitive_counts(loss_of_state, state)


def main():
  model, losses = train(PALLAS)
  _, lax_losses = train(LAX)
  print_comparison(primitive_counts(model), losses, lax_losses)
  return losses, lax_losses


if __name__ == "__main__":
  main()
