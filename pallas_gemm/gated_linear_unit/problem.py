"""What one gated-linear-unit call asks for, as hashable data.

    out = activation(x @ w_gate) * (x @ w_up)

x is (m, k) (leading batch dims are flattened into m by the API), each
weight is (k, n); with fused weights they are one (k, 2, n) array whose
[:, 0] is the gate and [:, 1] the up projection. Both products accumulate
in float32, the gating runs in float32, and the result is rounded once to
`out_dtype`.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from pallas_gemm.config_fields import check_sizes
from pallas_gemm.problem import itemsize


def _silu(x):
  return x * (1 / (1 + jnp.exp(-x)))


def _sigmoid(x):
  return 1 / (1 + jnp.exp(-x))


def _gelu_exact(x):
  return 0.5 * x * (1 + jax.lax.erf(x * np.float32(1 / np.sqrt(2))))


#: Gate activations by name, written with jnp so that one function serves
#: the kernel epilogue, the XLA form and (under x64) the reference. "gelu"
#: is the tanh approximation, as `jax.nn.gelu`'s default; "gelu_exact" the
#: erf form.
GLU_ACTIVATIONS: dict[str, Callable] = {
    "silu": _silu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_exact": _gelu_exact,
    "relu": lambda x: jnp.maximum(x, 0),
    "sigmoid": _sigmoid,
    "identity": lambda x: x,
}


def np_activation(name: str, x: np.ndarray) -> np.ndarray:
  """The activations in float64 NumPy, for the reference."""
  if name == "silu":
    return x / (1 + np.exp(-x))
  if name == "gelu":
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))
  if name == "gelu_exact":
    from math import erf
    return 0.5 * x * (1 + np.vectorize(erf)(x / np.sqrt(2)))
  if name == "relu":
    return np.maximum(x, 0)
  if name == "sigmoid":
    return 1 / (1 + np.exp(-x))
  if name == "identity":
    return x
  raise ValueError(f"unknown activation {name!r}")


@dataclasses.dataclass(frozen=True)
class GluProblem:
  """A normalised gated-linear-unit request (x already flattened to 2-D)."""

  m: int
  n: int
  k: int
  in_dtype: str
  out_dtype: str
  activation: str = "silu"
  fused_weights: bool = False
  # "ieee" or "tf32" for float32 inputs, "default" otherwise (see
  # pallas_gemm.problem.normalize_precision).
  precision: str = "default"

  def __post_init__(self):
    check_sizes(self, ("m", "n", "k"), minimum=0)
    if self.activation not in GLU_ACTIVATIONS:
      raise ValueError(f"GluProblem.activation={self.activation!r} is not one "
                       f"of {sorted(GLU_ACTIVATIONS)}")

  @property
  def flops(self) -> int:
    """Two GEMMs of m x n x k."""
    return 4 * self.m * self.n * self.k

  @property
  def min_bytes(self) -> int:
    """x and both weights read once, the output written once."""
    return ((self.m * self.k + 2 * self.k * self.n) * itemsize(self.in_dtype)
            + self.m * self.n * itemsize(self.out_dtype))

  def describe(self) -> str:
    weights = "fused" if self.fused_weights else "pair"
    return (f"glu {self.m}x{self.n}x{self.k} {self.in_dtype}->"
            f"{self.out_dtype} {self.activation} weights={weights}")


def reference_glu(x, w_gate, w_up, activation: str) -> np.ndarray:
  """float64 NumPy: activation(x @ w_gate) * (x @ w_up), x of any rank."""
  def f64(v):
    return np.asarray(jnp.asarray(v).astype(jnp.float32), np.float64)
  x64 = f64(x)
  gate = x64 @ f64(w_gate)
  up = x64 @ f64(w_up)
  return np_activation(activation, gate) * up
