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

Its config, `Fp8NnConfig`, is chosen for short M (decode), where the
256 x 128 output tile wastes tensor time on rows past M and leaves fewer
tiles than SMs, so that each busy SM streams its strip of B alone:
  tile_m    rows of out per tile, 256 or 64 (the wgmma's N);
  k_splits  every tile's K cut into that many shares, each run by its own
            CTA, which stores a float32 partial sum; XLA adds the partials
            in a fixed order (the same bits run to run) and rounds to
            bfloat16.
The heuristic takes the 64-row tile for M <= 64, and splits only where
tiles are few and the partials' traffic is small next to B's.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from pallas_gemm import registry
from pallas_gemm.config_fields import checked, in_range, one_of, validate
from pallas_gemm.devices import DeviceInfo
from pallas_gemm.ffi import build, kernel_list
from pallas_gemm.problem import FP8_DTYPES, GemmProblem, cdiv

NAME = "ffi/fp8_nn"
_TARGET = kernel_list.ffi_target("fp8_nn")

#: The kernel's tile rows (tall, short), columns and K block: the constants
#: of csrc/fp8_nn_wgmma.cu.
TALL_ROWS, SHORT_ROWS, TILE_N, BLOCK_K = 256, 64, 128, 128
MAX_K_SPLITS = 16
#: The heuristic gives each K share at least this many K blocks, so that
#: the ring's fill and the partial store stay small next to a share's loop.
MIN_BLOCKS_PER_SPLIT = 4
#: ... and keeps the partials' float32 traffic (written once, read once)
#: under this fraction of B's bytes.
MAX_PARTIAL_TRAFFIC = 0.25


@dataclasses.dataclass(frozen=True)
class Fp8NnConfig:
  """k_splits: shares of K run by separate CTAs (1: none); it must leave no
  share empty, i.e. equal ceil(k_blocks / ceil(k_blocks / k_splits)) for
  the problem's 128-deep K blocks (`check_config` says so). tile_m: rows
  of out per tile."""
  k_splits: int = checked(1, in_range(1, MAX_K_SPLITS))
  tile_m: int = checked(TALL_ROWS, one_of(SHORT_ROWS, TALL_ROWS))

  def __post_init__(self):
    validate(self)


def effective_splits(k: int, k_splits: int) -> int:
  """How many non-empty shares of ceil(k_blocks / k_splits) blocks K makes."""
  k_blocks = cdiv(k, BLOCK_K)
  if k_blocks == 0:
    return 1
  return cdiv(k_blocks, cdiv(k_blocks, k_splits))


def heuristic(problem: GemmProblem, device: DeviceInfo) -> Fp8NnConfig:
  tile_m = SHORT_ROWS if problem.m <= SHORT_ROWS else TALL_ROWS
  tiles = cdiv(problem.m, tile_m) * cdiv(problem.n, TILE_N)
  k_blocks = cdiv(problem.k, BLOCK_K)
  sms = max(device.planning_sms, 1)
  if tiles == 0 or 2 * tiles > sms:
    return Fp8NnConfig(tile_m=tile_m)
  # Partials: 8 bytes (f32 written and read) per output element per split,
  # against k bytes of B per output column.
  by_traffic = int(MAX_PARTIAL_TRAFFIC * problem.k / (8 * max(problem.m, 1)))
  splits = min(sms // tiles, k_blocks // MIN_BLOCKS_PER_SPLIT, by_traffic,
               MAX_K_SPLITS)
  if splits < 2:
    return Fp8NnConfig(tile_m=tile_m)
  return Fp8NnConfig(effective_splits(problem.k, splits), tile_m)


def check_config(config: Fp8NnConfig, problem: GemmProblem,
                 device: DeviceInfo) -> str | None:
  del device
  if config.k_splits > 1 and effective_splits(
      problem.k, config.k_splits) != config.k_splits:
    return (f"k_splits={config.k_splits} leaves a share of k={problem.k} "
            f"without K blocks of {BLOCK_K} (use "
            f"{effective_splits(problem.k, config.k_splits)})")
  return None


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


def fp8_nn_matmul(a, b, c, bias, *, problem: GemmProblem,
                  config: Fp8NnConfig, interpret: bool, a_scale=None,
                  b_scale=None):
  del c, bias  # supports() admits no epilogue
  if interpret:
    raise ValueError(f"{NAME} runs compiled on a GPU only")
  if not isinstance(config, Fp8NnConfig):
    raise TypeError(f"config must be an Fp8NnConfig, got "
                    f"{type(config).__name__}")
  reason = check_config(config, problem, None)
  if reason is not None:
    raise ValueError(f"config={config}: {reason}")
  splits = config.k_splits if problem.k else 1
  build.load_library()  # first lowering: compile/load and register handlers
  operands = (a[0], b[0], _scale(a_scale), _scale(b_scale))
  if splits == 1:
    call = jax.ffi.ffi_call(
        _TARGET, jax.ShapeDtypeStruct((problem.m, problem.n), jnp.bfloat16))
    return call(*operands, k_splits=np.int32(1),
                tile_m=np.int32(config.tile_m))[None]
  call = jax.ffi.ffi_call(_TARGET, jax.ShapeDtypeStruct(
      (splits, problem.m, problem.n), jnp.float32))
  partials = call(*operands, k_splits=np.int32(splits),
                  tile_m=np.int32(config.tile_m))
  # An elementwise chain, one fixed order, no atomics: the same bits on
  # every run.
  total = partials[0]
  for share in range(1, splits):
    total = total + partials[share]
  return total.astype(jnp.bfloat16)[None]


registry.register(registry.KernelEntry(
    name=NAME, fn=fp8_nn_matmul, supports=supports,
    heuristic=heuristic, config_cls=Fp8NnConfig, check_config=check_config,
    runs_on_cpu=False, takes_scales=True,
    description=("CUDA fp8 (e4m3/e5m2) GEMM for B stored (k, n): per-tensor "
                 "scales, bf16 out; B^T built in registers, no transpose "
                 "pass")))
