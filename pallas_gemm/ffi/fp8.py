"""`ffi/fp8_nn`: per-tensor scaled fp8 GEMM with B stored (k, n), in CUDA.

fp8 wgmma reads only K-major operands from shared memory, so for B stored
(k, n) (the NN layout, `transpose_b=False`) `mosaic/fp8` first has XLA
transpose B. This kernel needs no transpose pass: it computes
out^T = B^T A^T with B^T built in registers from the N-major tile
(csrc/fp8_nn_wgmma.cu says how; experiments/lab/fp8_wgmma/ has the steps
that led to it and experiments/results/nvidia_h100/fp8_cuda/ their
numbers).

What it takes, and `supports()` says which part a problem misses:
float8_e4m3fn or float8_e5m2 for each operand, A stored (m, k) and B stored
(k, n), no scale or one per tensor for each operand, a bfloat16 output with
no epilogue, one matrix (no batch), n and k multiples of 16 (TMA row
strides), an sm_90 GPU, and nvcc to build the CUDA library on first use (see
`pallas_gemm.ffi.build`). Anything else runs on `mosaic/fp8` or XLA.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_gemm import registry
from pallas_gemm.devices import DeviceInfo
from pallas_gemm.ffi import build, kernel_list
from pallas_gemm.problem import FP8_DTYPES, GemmProblem

NAME = "ffi/fp8_nn"
_TARGET = kernel_list.ffi_target("fp8_nn")


def _toolkit_problem() -> str | None:
  """Why the CUDA library cannot be built here, or None."""
  try:
    build.find_nvcc()
  except build.BuildError as error:  # NvccNotFoundError is one
    return f"{NAME} builds its CUDA library with nvcc, and {error}"
  return None


def supports(problem: GemmProblem, device: DeviceInfo) -> str | None:
  if not device.is_hopper:
    return f"{NAME} needs an sm_90 (Hopper) GPU: fp8 wgmma and the TMA"
  for name, dtype in (("a", problem.in_dtype),
                      ("b", problem.b_dtype or problem.in_dtype)):
    if dtype not in FP8_DTYPES:
      return (f"{NAME} takes {' or '.join(FP8_DTYPES)} operands; {name} is "
              f"{dtype}")
  if problem.transpose_a:
    return f"{NAME} takes A stored (m, k): transpose_a must be False"
  if problem.transpose_b:
    return (f"{NAME} is for B stored (k, n); B stored (n, k) "
            "(transpose_b=True) is mosaic/fp8's native layout")
  for name, mode in (("a_scale", problem.a_scale_mode),
                     ("b_scale", problem.b_scale_mode)):
    if mode not in ("none", "tensor"):
      return (f"{NAME} takes per-tensor scales only; {name} is {mode!r} "
              "(mosaic/fp8 takes it)")
  if problem.out_dtype != "bfloat16":
    return f"{NAME} writes bfloat16, not {problem.out_dtype}"
  if not problem.epilogue.is_identity:
    return f"{NAME} has no epilogue (alpha, beta * c, bias, activation)"
  if problem.batch != 1:
    return f"{NAME} takes one matrix, not a batch of {problem.batch}"
  if problem.n % 16 or problem.k % 16:
    return (f"{NAME} needs n and k multiples of 16 (TMA row strides); "
            f"n={problem.n}, k={problem.k}")
  return _toolkit_problem()


def _scale(scale):
  """A per-tensor scale ((batch,) = (1,) here) or None as one float32."""
  if scale is None:
    return jnp.ones((1,), jnp.float32)
  return jnp.reshape(scale, (1,)).astype(jnp.float32)


def fp8_nn_matmul(a, b, c, bias, *, problem: GemmProblem, config,
                  interpret: bool, a_scale=None, b_scale=None):
  del c, bias, config  # supports() admits no epilogue and takes no config
  if interpret:
    raise ValueError(f"{NAME} runs compiled on a GPU only")
  build.load_library()  # first lowering: compile/load and register handlers
  call = jax.ffi.ffi_call(
      _TARGET, jax.ShapeDtypeStruct((problem.m, problem.n), jnp.bfloat16))
  out = call(a[0], b[0], _scale(a_scale), _scale(b_scale))
  return out[None]


registry.register(registry.KernelEntry(
    name=NAME, fn=fp8_nn_matmul, supports=supports,
    heuristic=lambda problem, device: None, config_cls=None,
    runs_on_cpu=False, takes_scales=True,
    description=("CUDA fp8 (e4m3/e5m2) GEMM for B stored (k, n): per-tensor "
                 "scales, bf16 out; B^T built in registers, no transpose "
                 "pass")))
