"""Reference results and error budgets shared by the tests and the benchmark.

Every check compares against float64 NumPy on the same (rounded) inputs with
the relative Frobenius error ‖out − ref‖ / ‖ref‖, against a budget per
input dtype and precision.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_gemm.problem import ACTIVATIONS, Epilogue

#: Relative Frobenius error budgets. Exact fp32 lands near 1e-7 with a K of a
#: few thousand; TF32 keeps 10 mantissa bits (≈5e-4 per product); bf16/f16
#: outputs are rounded to 8/11 bits, so their budget is set by the output.
TOLERANCES = {
    ("float32", "ieee"): 1e-5,
    ("float32", "tf32"): 5e-3,
    ("float64", "default"): 1e-12,
    ("bfloat16", "default"): 2e-2,
    ("float16", "default"): 1e-2,
    ("float8_e4m3fn", "default"): 2e-2,
    ("float8_e5m2", "default"): 2e-2,
}


def tolerance(in_dtype: str, precision: str, out_dtype: str | None = None) -> float:
  tol = TOLERANCES[(in_dtype, precision)]
  if out_dtype in ("bfloat16",):
    tol = max(tol, 2e-2)
  elif out_dtype in ("float16",):
    tol = max(tol, 1e-2)
  return tol


_seed_counter = itertools.count()
#: The base seed of `fresh_key` calls that give none (`seed_fresh_keys`);
#: None: a new one from the OS on every call.
_default_seed: int | None = None


def seed_fresh_keys(seed: int | None) -> None:
  """Makes `fresh_key()` calls without a base seed draw from `seed` (None:
  from the OS again), counting their keys from the first: the tests seed
  each test this way, so that a failure reproduces from the seed it
  reports."""
  global _default_seed, _seed_counter
  _default_seed = seed
  _seed_counter = itertools.count()


def fresh_key(base_seed: int | None = None):
  """A new PRNG key on every call: tests never reuse inputs by accident.

  With `base_seed` the sequence is reproducible (the benchmark passes its
  --seed flag); otherwise it comes from the seed `seed_fresh_keys` set, or
  where none is set from the OS.
  """
  if base_seed is None:
    base_seed = (_default_seed if _default_seed is not None
                 else int(np.random.SeedSequence().generate_state(1)[0]))
  return jax.random.fold_in(jax.random.key(base_seed), next(_seed_counter))


def random_normal(key, shape, dtype):
  """Standard-normal values in `dtype`, never all zeros."""
  x = jax.random.normal(key, shape, jnp.float32)
  return x.astype(dtype)


def reference_matmul(a, b, *, transpose_a=False, transpose_b=False,
                     epilogue: Epilogue = Epilogue(), c=None, bias=None):
  """float64 NumPy: activation(alpha * op(a) @ op(b) + beta * c + bias)."""
  a64 = np.asarray(jnp.asarray(a).astype(jnp.float32), np.float64)
  b64 = np.asarray(jnp.asarray(b).astype(jnp.float32), np.float64)
  if transpose_a:
    a64 = np.swapaxes(a64, -1, -2)
  if transpose_b:
    b64 = np.swapaxes(b64, -1, -2)
  out = np.matmul(a64, b64) * epilogue.alpha
  if epilogue.has_c:
    out = out + epilogue.beta * np.asarray(
        jnp.asarray(c).astype(jnp.float32), np.float64)
  if epilogue.has_bias:
    out = out + np.asarray(jnp.asarray(bias).astype(jnp.float32), np.float64)
  if epilogue.activation is not None:
    out = np.asarray(ACTIVATIONS[epilogue.activation](jnp.asarray(out)),
                     np.float64) if jax.config.jax_enable_x64 else _np_activation(
                         epilogue.activation, out)
  return out


def _np_activation(name, x):
  if name == "relu":
    return np.maximum(x, 0)
  if name == "gelu":
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))
  if name == "silu":
    return x / (1 + np.exp(-x))
  if name == "sigmoid":
    return 1 / (1 + np.exp(-x))
  if name == "tanh":
    return np.tanh(x)
  raise ValueError(f"unknown activation {name!r}")


def relative_error(out, ref) -> float:
  """‖out − ref‖_F / ‖ref‖_F in float64; NaN anywhere in `out` gives inf."""
  out64 = np.asarray(jnp.asarray(out).astype(jnp.float32), np.float64)
  ref64 = np.asarray(ref, np.float64)
  if out64.shape != ref64.shape:
    raise ValueError(f"shape mismatch: out {out64.shape} vs ref {ref64.shape}")
  if not np.all(np.isfinite(out64)):
    return float("inf")
  denom = np.linalg.norm(ref64)
  if denom == 0:
    return float(np.linalg.norm(out64))
  return float(np.linalg.norm(out64 - ref64) / denom)


def poison_allocator(shape, dtype, copies: int = 2) -> None:
  """Fills and frees NaN buffers of this shape on the default device.

  Interpret mode already starts every Pallas output as NaN. On a GPU, XLA's
  allocator hands a new output the memory a freed buffer of the same size
  just left, so a kernel that skips an element leaves NaN there and fails
  the check, instead of passing on stale correct values.
  """
  buffers = [jnp.full(shape, jnp.nan, dtype) for _ in range(copies)]
  for buffer in buffers:
    buffer.block_until_ready()
  del buffers
