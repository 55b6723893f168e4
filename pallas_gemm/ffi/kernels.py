"""The ffi/* kernels in the pallas_gemm registry, and their XLA-side glue.

Each kernel is one CUDA handler (see csrc/) that computes, per batch,

    out = alpha * a @ b + beta * c        a (m, k), b (k, n), row-major

accumulating in float32. Around the FFI call, the wrapper does with XLA ops
what the handler does not:

  * transpose_a / transpose_b: an on-device transpose of that operand first
    (one extra read and write of it; the kernels only take the NN layout);
  * padding: k and n are zero-padded to the kernel's vector width (4 floats
    for SIMT rungs 05-08, 8 elements for mma_sync), and the padded output
    columns are sliced off. Zero columns of k add nothing to the dot products;
  * bias and activation: applied by XLA after the call on the float32 result,
    then rounded once to the output dtype;
  * c is converted to the kernel's output dtype (exact when that is f32).

Registering here compiles nothing: the CUDA library is built and its
handlers registered with XLA the first time a kernel is lowered.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from pallas_gemm import registry
from pallas_gemm.config_fields import validate
from pallas_gemm.devices import DeviceInfo
from pallas_gemm.problem import ACTIVATIONS, GemmProblem
from pallas_gemm.ffi import build, kernel_list

# Grid limits baked into the launchers (grid y holds N tiles, z or y the batch).
_MAX_BATCH = 65535
_MAX_N = 2_000_000
_MAX_MATRIX_ELEMENTS = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class FfiKernel:
  """One registered ffi/* kernel."""

  name: str              # registry name without the "ffi/" prefix
  description: str
  in_dtypes: tuple[str, ...]
  align: int             # k and n are padded to a multiple of this
  min_compute_capability: tuple[int, int] = (7, 0)

  @property
  def registry_name(self) -> str:
    return f"ffi/{self.name}"


@dataclasses.dataclass(frozen=True)
class MmaSyncConfig:
  """Block tile of ffi/mma_sync: block_m x block_n x block_k with num_warps
  warps and `stages` cp.async stages.

  pipelined=False: the first kernel (csrc/mma_sync.cu): block_m 128, 4
  stages; 8 warps (one block per SM) or 4 (64x64 warp tiles, two per SM).
  pipelined=True: csrc/mma_sync_pipelined.cu: 64x64 warp tiles, ldmatrix
  fragments double-buffered in registers across k16 slices and K tiles,
  one barrier per K tile.
  tma=True (pipelined only): one thread loads each stage with the TMA
  instead of every thread with cp.async; on a GPU before Hopper the same
  tiling runs with cp.async.

  Compiled variants: the PALLAS_GEMM_MMA lines of csrc/kernels.def, i.e.
  the keys of MMA_SYNC_VARIANTS; any other combination is refused. Fields
  must be ints (the flags bools); errors name the field and value.
  """

  block_n: int = 256
  block_k: int = 32
  num_warps: int = 8
  block_m: int = 128
  stages: int = 4
  pipelined: bool = False
  tma: bool = False

  def __post_init__(self):
    validate(self)
    if self.key not in MMA_SYNC_VARIANTS:
      raise ValueError(
          f"MmaSyncConfig (block_n, block_k, num_warps, block_m, stages, "
          f"pipelined, tma)={self.key} is not a compiled variant "
          f"(csrc/kernels.def); choose one of {sorted(MMA_SYNC_VARIANTS)}")

  @property
  def key(self) -> tuple[int, int, int, int, int, bool, bool]:
    return dataclasses.astuple(self)

  @property
  def target(self) -> str:
    return MMA_SYNC_VARIANTS[self.key]

  @property
  def label(self) -> str:
    kind = "pipelined" if self.pipelined else "basic"
    return (f"{kind} {self.block_m}x{self.block_n}x{self.block_k} "
            f"w{self.num_warps} s{self.stages}" + (" tma" if self.tma else ""))


def _variants() -> dict[tuple, str]:
  _, tilings = kernel_list.entries()
  return {(t.block_n, t.block_k, t.num_warps, t.block_m, t.stages,
           t.pipelined, t.tma): kernel_list.ffi_target(t.id) for t in tilings}


#: (block_n, block_k, num_warps, block_m, stages, pipelined, tma) -> FFI
#: target, for every PALLAS_GEMM_MMA entry of csrc/kernels.def.
MMA_SYNC_VARIANTS = _variants()

#: The SIMT rungs, one per PALLAS_GEMM_SGEMM entry of csrc/kernels.def.
SGEMM_LADDER = tuple(
    FfiKernel(rung.id, rung.description, ("float32",), rung.align)
    for rung in kernel_list.entries()[0])

MMA_SYNC = FfiKernel(
    "mma_sync",
    "tensor cores via mma.sync m16n8k16 + ldmatrix, multi-stage cp.async "
    "(TMA loads on Hopper), swizzled smem, grouped order, smem-staged "
    "epilogue",
    ("bfloat16", "float16"), 8, min_compute_capability=(8, 0))


def _common_reason(kernel: FfiKernel, problem: GemmProblem,
                   device: DeviceInfo) -> str | None:
  if not device.is_gpu:
    return f"{kernel.registry_name} needs a CUDA GPU"
  cc = device.compute_capability
  if cc is not None and cc < kernel.min_compute_capability:
    return (f"{kernel.registry_name} needs compute capability "
            f">= {kernel.min_compute_capability}, the device has {cc}")
  if problem.in_dtype not in kernel.in_dtypes:
    return (f"{kernel.registry_name} takes {' or '.join(kernel.in_dtypes)} "
            f"inputs, not {problem.in_dtype}")
  if problem.batch > _MAX_BATCH:
    return f"batch={problem.batch} exceeds {_MAX_BATCH} (CUDA grid limit)"
  n = _round_up(problem.n, kernel.align)
  k = _round_up(problem.k, kernel.align)
  if n > _MAX_N:
    return f"n={problem.n} exceeds {_MAX_N} (CUDA grid limit)"
  if max(problem.m * k, k * n, problem.m * n) > _MAX_MATRIX_ELEMENTS:
    return "each matrix must have fewer than 2**31 elements (32-bit indexing)"
  return None


def _sgemm_supports(kernel: FfiKernel):
  def supports(problem: GemmProblem, device: DeviceInfo) -> str | None:
    reason = _common_reason(kernel, problem, device)
    if reason is not None:
      return reason
    if problem.precision != "ieee":
      return (f"{kernel.registry_name} computes exact fp32 FFMA products; "
              f"precision={problem.precision!r} asks for TF32 (pass "
              f"precision=jax.lax.Precision.HIGHEST to use it)")
    return None
  return supports


def _mma_supports(problem: GemmProblem, device: DeviceInfo) -> str | None:
  return _common_reason(MMA_SYNC, problem, device)


def _round_up(x: int, multiple: int) -> int:
  return -(-x // multiple) * multiple


def _kernel_out_dtype(kernel: FfiKernel, problem: GemmProblem) -> str:
  """What the CUDA kernel writes: the final dtype when nothing follows the
  call, else float32 so the XLA tail rounds only once."""
  epilogue = problem.epilogue
  if epilogue.has_bias or epilogue.activation is not None:
    return "float32"
  if epilogue.has_c and problem.c_dtype != problem.out_dtype:
    return "float32"
  if kernel.in_dtypes == ("float32",):
    return "float32"
  if problem.out_dtype in ("float32", problem.in_dtype):
    return problem.out_dtype
  return "float32"


def _pad_last_two(x, rows: int, cols: int):
  pad_rows, pad_cols = rows - x.shape[-2], cols - x.shape[-1]
  if pad_rows == 0 and pad_cols == 0:
    return x
  return jnp.pad(x, ((0, 0), (0, pad_rows), (0, pad_cols)))


def run_ffi_kernel(kernel: FfiKernel, target: str, a, b, c, bias, *,
                   problem: GemmProblem):
  """The XLA ops around one FFI call; see the module docstring."""
  build.load_library()  # first lowering: compile/load and register handlers
  if problem.transpose_a:
    a = jnp.swapaxes(a, 1, 2)
  if problem.transpose_b:
    b = jnp.swapaxes(b, 1, 2)
  batch, m = problem.batch, problem.m
  k = _round_up(problem.k, kernel.align)
  n = _round_up(problem.n, kernel.align)
  a = _pad_last_two(a, m, k)
  b = _pad_last_two(b, k, n)
  epilogue = problem.epilogue
  out_dtype = _kernel_out_dtype(kernel, problem)
  operands = [a, b]
  beta = 0.0
  if epilogue.has_c and epilogue.beta != 0.0:
    operands.append(_pad_last_two(c.astype(out_dtype), m, n))
    beta = epilogue.beta
  call = jax.ffi.ffi_call(
      target, jax.ShapeDtypeStruct((batch, m, n), jnp.dtype(out_dtype)))
  out = call(*operands, alpha=np.float32(epilogue.alpha),
             beta=np.float32(beta))
  if n != problem.n:
    out = out[:, :, :problem.n]
  if epilogue.has_bias:
    out = out.astype(jnp.float32) + bias.astype(jnp.float32)
  if epilogue.activation is not None:
    out = ACTIVATIONS[epilogue.activation](out.astype(jnp.float32))
  return out.astype(problem.out_dtype)


def _register_sgemm(kernel: FfiKernel) -> None:
  target = f"pallas_gemm_{kernel.name}"

  def fn(a, b, c, bias, *, problem, config, interpret):
    del config, interpret  # no config; never lowered for CPU (runs_on_cpu)
    return run_ffi_kernel(kernel, target, a, b, c, bias, problem=problem)

  registry.register(registry.KernelEntry(
      name=kernel.registry_name, fn=fn, supports=_sgemm_supports(kernel),
      heuristic=lambda problem, device: None, config_cls=None,
      runs_on_cpu=False, description=f"CUDA SIMT SGEMM: {kernel.description}"))


#: Defaults, both software-pipelined. 128x256x64 with 3 stages and TMA loads
#: (cp.async before Hopper) was the fastest shipped tiling on the H200 at
#: 4096^3 and 8192^3; the measurements behind it are gathered in
#: experiments/results/nvidia_h200/ffi/README.md ("The shipped `mma_sync`
#: defaults, in one place"). The 128x128x32 tiling with 4 warps (two blocks
#: per SM) keeps smaller tiles for grids too small to fill the SMs with
#: 128x256 tiles; that choice is by tile count, not timed.
MMA_SYNC_DEFAULT_LARGE = MmaSyncConfig(block_n=256, block_k=64, num_warps=8,
                                       block_m=128, stages=3, pipelined=True,
                                       tma=True)
MMA_SYNC_DEFAULT_SMALL = MmaSyncConfig(block_n=128, block_k=32, num_warps=4,
                                       block_m=128, stages=4, pipelined=True)


def _mma_heuristic(problem: GemmProblem, device: DeviceInfo) -> MmaSyncConfig:
  """The large tiling once its tiles fill every SM, else the small one."""
  large_tiles = problem.batch * (-(-problem.m // 128)) * (-(-problem.n // 256))
  if large_tiles >= device.planning_sms:
    return MMA_SYNC_DEFAULT_LARGE
  return MMA_SYNC_DEFAULT_SMALL


def _mma_fn(a, b, c, bias, *, problem, config, interpret):
  del interpret
  return run_ffi_kernel(MMA_SYNC, config.target, a, b, c, bias,
                        problem=problem)


for _kernel in SGEMM_LADDER:
  _register_sgemm(_kernel)

registry.register(registry.KernelEntry(
    name=MMA_SYNC.registry_name, fn=_mma_fn, supports=_mma_supports,
    heuristic=_mma_heuristic, config_cls=MmaSyncConfig,
    runs_on_cpu=False,
    description=f"CUDA tensor cores: {MMA_SYNC.description}"))
