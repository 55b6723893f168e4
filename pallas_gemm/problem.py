"""What one GEMM call asks for, as hashable data.

Every backend receives the same normalised description of the work, a
`GemmProblem`, and operands in one canonical form:

  a     (batch, m, k), or (batch, k, m) when `transpose_a`
  b     (batch, k, n), or (batch, n, k) when `transpose_b`
  c     (batch, m, n) or None           (only when `epilogue.has_c`)
  bias  (n,) or None                    (only when `epilogue.has_bias`)

and returns `(batch, m, n)` in `out_dtype`, equal to

  out = activation(alpha * (op(a) @ op(b)) + beta * c + bias)

computed in float32 and rounded once to `out_dtype`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

#: Input dtypes every backend is asked to handle (fp8 is opt-in per kernel).
SUPPORTED_INPUT_DTYPES = ("float32", "bfloat16", "float16")
FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")
SUPPORTED_OUTPUT_DTYPES = ("float32", "bfloat16", "float16")
#: float64 (what jnp arrays are with jax_enable_x64) runs on XLA's dot
#: only: no GPU kernel here computes in float64.
XLA_ONLY_DTYPES = ("float64",)
#: How an fp8 operand's dequantization scales are laid out (x ≈ q · s):
#: "none" (no scale), "tensor" (one scalar), "row" (A: one per row, (m,)),
#: "col" (B: one per output column, (n,)), "block" (A: (m, ceil(k/128)),
#: 1x128 blocks; B: (ceil(k/128), ceil(n/128)), 128x128 blocks).
SCALE_MODES = ("none", "tensor", "row", "col", "block")
#: The K (and, for B, N) extent of one block-wise scale.
SCALE_BLOCK = 128


def _gelu_tanh(x):
  return jax.nn.gelu(x, approximate=True)


#: Epilogue activations by name. They are written with jnp so that the same
#: function runs inside a Pallas kernel body and in the float64 reference.
ACTIVATIONS: dict[str, Callable] = {
    "relu": lambda x: jnp.maximum(x, 0),
    "gelu": _gelu_tanh,
    "silu": lambda x: x * (1 / (1 + jnp.exp(-x))),
    "sigmoid": lambda x: 1 / (1 + jnp.exp(-x)),
    "tanh": jnp.tanh,
}


@dataclasses.dataclass(frozen=True)
class Epilogue:
  """The fused tail `activation(alpha * acc + beta * c + bias)`.

  The default is the identity: no extra work is compiled in.
  """

  alpha: float = 1.0
  beta: float = 0.0
  has_c: bool = False
  has_bias: bool = False
  activation: str | None = None

  def __post_init__(self):
    if self.activation is not None and self.activation not in ACTIVATIONS:
      raise ValueError(
          f"activation={self.activation!r} is not one of "
          f"{sorted(ACTIVATIONS)} or None")
    for name in ("alpha", "beta"):
      value = getattr(self, name)
      if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise TypeError(
            f"{name} must be a Python float (it is compiled into the kernel), "
            f"got {type(value).__name__}")
      if not math.isfinite(value):
        raise ValueError(f"{name}={value} must be finite")

  @property
  def is_identity(self) -> bool:
    return (self.alpha == 1.0 and not self.has_c and not self.has_bias
            and self.activation is None)


def apply_epilogue(acc, epilogue: Epilogue, c=None, bias=None):
  """Applies the epilogue to a float32 accumulator tile (or whole matrix).

  `c` is a tile of the same shape as `acc`; `bias` broadcasts along rows.
  Terms that the epilogue does not ask for are never traced, so the identity
  epilogue adds no operations.
  """
  out = acc
  if epilogue.alpha != 1.0:
    out = out * jnp.asarray(epilogue.alpha, out.dtype)
  if epilogue.has_c and epilogue.beta != 0.0:
    out = out + jnp.asarray(epilogue.beta, out.dtype) * c.astype(out.dtype)
  if epilogue.has_bias:
    out = out + bias.astype(out.dtype)
  if epilogue.activation is not None:
    out = ACTIVATIONS[epilogue.activation](out)
  return out


@dataclasses.dataclass(frozen=True)
class GemmProblem:
  """A normalised GEMM request; see the module docstring for the layouts."""

  batch: int
  m: int
  n: int
  k: int
  in_dtype: str
  out_dtype: str
  transpose_a: bool = False
  transpose_b: bool = False
  # "ieee" (exact fp32 products) or "tf32" for float32 inputs; "default" for
  # 16-bit and fp8 inputs, whose products are exact in the f32 accumulator.
  precision: str = "default"
  epilogue: Epilogue = Epilogue()
  c_dtype: str | None = None
  # fp8 only: B's dtype when it differs from A's (the e4m3 x e5m2 pair), and
  # the layout of each operand's dequantization scales (`SCALE_MODES`).
  b_dtype: str | None = None
  a_scale_mode: str = "none"
  b_scale_mode: str = "none"

  def __post_init__(self):
    for name, allowed in (("a_scale_mode", ("none", "tensor", "row", "block")),
                          ("b_scale_mode", ("none", "tensor", "col", "block"))):
      if getattr(self, name) not in allowed:
        raise ValueError(f"GemmProblem.{name}={getattr(self, name)!r} is not "
                         f"one of {allowed}")
    if (self.is_scaled or self.b_dtype is not None) and (
        self.in_dtype not in FP8_DTYPES
        or (self.b_dtype or self.in_dtype) not in FP8_DTYPES):
      raise ValueError("scales and mixed operand dtypes are for fp8 inputs "
                       f"only, got {self.in_dtype} x {self.b_dtype}")

  @property
  def is_scaled(self) -> bool:
    return (self.a_scale_mode, self.b_scale_mode) != ("none", "none")

  @property
  def flops(self) -> int:
    return 2 * self.batch * self.m * self.n * self.k

  @property
  def layout(self) -> str:
    """Two letters, as in BLAS: N = as given, T = transposed (e.g. "NT")."""
    return ("T" if self.transpose_a else "N") + ("T" if self.transpose_b else "N")

  @property
  def min_bytes(self) -> int:
    """Bytes that must cross device memory at least once."""
    in_size = np.dtype(jnp.dtype(self.in_dtype)).itemsize
    out_size = np.dtype(jnp.dtype(self.out_dtype)).itemsize
    total = self.batch * (self.m * self.k + self.k * self.n) * in_size
    total += self.batch * self.m * self.n * out_size
    if self.epilogue.has_c:
      total += self.batch * self.m * self.n * np.dtype(
          jnp.dtype(self.c_dtype)).itemsize
    return total

  def output_tiles(self, tile_m: int, tile_n: int) -> int:
    """How many tile_m x tile_n tiles the output (every batch) cuts into."""
    return self.batch * cdiv(self.m, tile_m) * cdiv(self.n, tile_n)

  def describe(self) -> str:
    batch = f"{self.batch}x" if self.batch != 1 else ""
    in_dtype = self.in_dtype if self.b_dtype is None else (
        f"{self.in_dtype}x{self.b_dtype}")
    scaling = (f" scales={self.a_scale_mode}/{self.b_scale_mode}"
               if self.is_scaled else "")
    return (f"{batch}{self.m}x{self.n}x{self.k} {in_dtype}->"
            f"{self.out_dtype} {self.layout} precision={self.precision}"
            f"{scaling}")


def _as_preset(precision):
  """A `DotAlgorithmPreset` given as itself or by name (as jnp.dot takes
  it), else None."""
  if isinstance(precision, jax.lax.DotAlgorithmPreset):
    return precision
  if isinstance(precision, str) and (
      precision in jax.lax.DotAlgorithmPreset.__members__):
    return jax.lax.DotAlgorithmPreset[precision]
  return None


def preset_input_dtype(precision, in_dtype: str) -> str | None:
  """The dtype a `DotAlgorithmPreset` multiplies `in_dtype` operands in,
  when that differs from `in_dtype` (the caller casts the operands to it),
  else None. Raises for presets that no kernel here honours.

  As in lax: F16_F16_F32 reads its operands as float16, BF16_BF16_F32 as
  bfloat16 (its products round float32 inputs to bfloat16); presets that
  read float32 (TF32, F32 and the multi-pass ones) lose nothing on 16-bit
  or fp8 inputs, whose products are exact in the float32 accumulator.
  """
  preset = _as_preset(precision)
  if preset is None or preset.name == "DEFAULT":
    return None
  name = preset.name
  if name.startswith("ANY_F8"):
    # Our fp8 kernels accumulate in float32, which FAST_ACCUM and ANY allow.
    if in_dtype not in FP8_DTYPES:
      raise ValueError(
          f"precision={name} needs float8 operands, got {in_dtype}")
    return None
  if name in ("F16_F16_F16", "BF16_BF16_BF16"):
    raise ValueError(
        f"precision={name} accumulates in 16 bits; every pallas_gemm kernel "
        f"accumulates in float32, so none computes it (use "
        f"{name[:-3]}F32, or jax.lax.dot_general)")
  if name == "F64_F64_F64":
    if in_dtype != "float64":
      raise ValueError(
          f"precision={name} needs float64 operands, got {in_dtype}")
    return None
  if name == "F16_F16_F32":
    return None if in_dtype == "float16" else "float16"
  if name == "BF16_BF16_F32":
    return None if in_dtype == "bfloat16" else "bfloat16"
  return None


def normalize_precision(precision, in_dtype: str) -> str:
  """Maps a jax precision argument onto what the kernels distinguish.

  Only float32 inputs have a choice: `HIGHEST` asks for exact fp32 products
  ("ieee"); anything else allows the tensor cores' TF32 mode, which is what
  `jnp.dot` does on a GPU at default precision. A `DotAlgorithmPreset` that
  reads the operands in another dtype is applied first, by casting (see
  `preset_input_dtype`).
  """
  if isinstance(precision, jax.lax.DotAlgorithm):  # a NamedTuple, not a pair
    raise _not_a_precision(precision)
  if _as_preset(precision) is not None:
    precision = _as_preset(precision)
    cast_to = preset_input_dtype(precision, in_dtype)
    if cast_to is not None:
      raise ValueError(
          f"precision={precision} reads the operands as {cast_to}: cast "
          f"the {in_dtype} operands first (pallas_gemm.matmul does)")
  if in_dtype != "float32":
    _check_precision_value(precision)
    return "default"
  if precision is None:
    config_value = jax.config.jax_default_matmul_precision
    precision = config_value
    if _as_preset(precision) is not None:
      return normalize_precision(precision, in_dtype)
  if isinstance(precision, (tuple, list)):
    if len(precision) != 2:
      raise ValueError(f"precision={precision!r} must be one value or a pair")
    precisions = [normalize_precision(p, in_dtype) for p in precision]
    return "ieee" if "ieee" in precisions else "tf32"
  if precision is None:
    return "tf32"
  if isinstance(precision, str):
    name = precision.lower()
    if name in ("highest", "float32", "fp32", "ieee"):
      return "ieee"
    if name in ("default", "high", "fastest", "bfloat16", "tensorfloat32",
                "bfloat16_3x", "tf32"):
      return "tf32"
    raise ValueError(f"precision={precision!r} is not a known precision")
  if isinstance(precision, jax.lax.Precision):
    return "ieee" if precision == jax.lax.Precision.HIGHEST else "tf32"
  if isinstance(precision, jax.lax.DotAlgorithmPreset):
    return _preset_precision(precision)
  raise _not_a_precision(precision)


def _not_a_precision(precision):
  if isinstance(precision, jax.lax.DotAlgorithm):
    return TypeError(
        f"precision={precision} is a jax.lax.DotAlgorithm; pallas_gemm takes "
        "the jax.lax.DotAlgorithmPreset values (or their names) instead")
  return TypeError(
      f"precision must be None, a str, jax.lax.Precision or "
      f"jax.lax.DotAlgorithmPreset, got {type(precision).__name__}")


def _preset_precision(preset) -> str:
  """float32 inputs under a preset that reads them as float32: those that
  round the products to TF32 run as TF32; those asking for float32 accuracy
  (exact, or the bf16/tf32 multi-pass emulations of it) get exact products,
  which are at least as accurate."""
  name = preset.name
  if name in ("DEFAULT", "TF32_TF32_F32"):
    return "tf32"
  if name in ("F32_F32_F32", "TF32_TF32_F32_X3", "BF16_BF16_F32_X3",
              "BF16_BF16_F32_X6", "BF16_BF16_F32_X9"):
    return "ieee"
  raise ValueError(f"precision={preset} is not supported for float32 inputs")


def itemsize(dtype) -> int:
  """Bytes per element of a dtype or dtype name (bfloat16 and fp8 too)."""
  return jnp.dtype(dtype).itemsize


def _check_precision_value(precision) -> None:
  """16-bit and fp8 products are exact in the f32 accumulator, so every
  precision gives the same result; a value that is not a precision at all
  is still an error."""
  if isinstance(precision, (tuple, list)):
    for p in precision:
      _check_precision_value(p)
    return
  if precision is None or isinstance(
      precision, (jax.lax.Precision, jax.lax.DotAlgorithmPreset)):
    return
  if isinstance(precision, str):
    normalize_precision(precision, "float32")
    return
  raise _not_a_precision(precision)


def dtype_name(dtype) -> str:
  return jnp.dtype(dtype).name


def cdiv(a: int, b: int) -> int:
  return -(-a // b)


def power_of_two_at_most(n: int) -> int:
  """The largest power of two <= n (n >= 1)."""
  return 1 << (n.bit_length() - 1)


def as_array(value, name: str):
  """`value` as a JAX array (tracers and arrays pass through), or a
  TypeError that names the argument `name`."""
  if value is None:
    raise TypeError(f"{name} must be an array, got None")
  if isinstance(value, jax.Array) or hasattr(value, "aval"):
    return value
  try:
    return jnp.asarray(value)
  except (TypeError, ValueError) as e:
    raise TypeError(f"{name} cannot be converted to an array: {e}") from None
