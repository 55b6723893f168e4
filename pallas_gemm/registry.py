"""The kernel registry and the automatic choice between kernels.

Each backend registers its kernels here with `register`. A kernel is a
function with the signature

    fn(a, b, c, bias, *, problem: GemmProblem, config, interpret: bool) -> out

over the canonical operands described in `pallas_gemm.problem`, plus a
`supports(problem, device)` check that returns None when the kernel can run
the problem, or a sentence saying why not.

Which kernel and config a call gets is decided in one place,
`pallas_gemm.dispatch.resolve`. This module holds what it decides from: the
registered kernels, their checks, and the fixed order used where no measured
dispatch table exists (a CPU, or a GPU without one), ending in XLA's own
dot, which supports everything:

  Hopper (sm_90):     mosaic/small_m -> mosaic/ws_persistent -> mosaic/split_k
                      -> triton/06_tuned -> xla (mosaic/split_k, for
                      few-tile problems, runs where a dispatch table
                      measured it faster: ws_persistent comes first)
  Hopper, fp8:        ffi/fp8_nn -> mosaic/fp8 -> xla (for the fp8
                      classes neither a GPU's dispatch table nor its
                      sibling's has measured: B's dtype and the scale
                      modes are part of the class.
                      ffi/fp8_nn takes only per-tensor scaled fp8 with B
                      stored (k, n), which mosaic/fp8 runs after an XLA
                      transpose of B; it needs nvcc for its first build)
  Hopper, exact fp32: xla (wgmma has no exact-fp32 mode; see the results
                      notes in experiments/results/nvidia_h200/ for how the
                      exact-fp32 kernels compare)
  other CUDA GPUs:    triton/05_split_k (skinny) -> triton/06_tuned -> xla
  CPU:                triton/06_tuned in interpret mode (small problems) -> xla

Kernels that are not registered (say, a backend that failed to import) are
skipped.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from typing import Any, Callable

from pallas_gemm.devices import DeviceInfo
from pallas_gemm.problem import FP8_DTYPES, GemmProblem

SupportsFn = Callable[[GemmProblem, DeviceInfo], "str | None"]


@dataclasses.dataclass(frozen=True)
class KernelEntry:
  name: str  # "<backend>/<kernel>", e.g. "triton/02_k_loop"
  fn: Callable[..., Any]
  supports: SupportsFn
  # The untuned config for a problem: a pure function of (problem, device)
  # that reads no file. Stored configs come from `dispatch.resolve`.
  heuristic: Callable[[GemmProblem, DeviceInfo], Any]
  config_cls: type | None = None
  # True if the kernel also runs on a CPU (Pallas interpret mode or plain XLA).
  runs_on_cpu: bool = False
  description: str = ""
  # Why a stored config must not serve this problem (None if it may), e.g.
  # a tuned tile that makes more waves here than the heuristic's.
  check_config: Callable[[Any, GemmProblem, DeviceInfo], "str | None"] | None = None
  # True if `fn` takes fp8 dequantization scales (`a_scale=`, `b_scale=`)
  # and mixed e4m3 x e5m2 operands.
  takes_scales: bool = False
  # What the kernel does around the problem that a user should know (e.g.
  # an operand copied into another layout first), for `explain`; or None.
  note: Callable[[GemmProblem], "str | None"] | None = None

  def default_config(self, problem: GemmProblem, device: DeviceInfo):
    """The config `kernel=<this kernel>` gets with no explicit config: what
    `dispatch.resolve` chooses (tuning cache, shipped table, heuristic)."""
    from pallas_gemm import dispatch
    return dispatch.resolve(problem, device, self.name).config


_REGISTRY: dict[str, KernelEntry] = {}

# Interpret mode evaluates a Pallas kernel block by block with XLA ops on the
# CPU; past about this many flops it takes minutes, so the automatic choice
# leaves larger CPU problems to XLA.
CPU_INTERPRET_FLOP_BUDGET = 2 * 512**3

_AUTO_ORDER = {
    "hopper": ("mosaic/small_m", "mosaic/ws_persistent", "mosaic/split_k",
               "triton/06_tuned", "xla"),
    "hopper_ieee": ("xla",),
    "hopper_fp8": ("ffi/fp8_nn", "mosaic/fp8", "xla"),
    "gpu": ("triton/05_split_k", "triton/06_tuned", "xla"),
    "cpu": ("triton/06_tuned", "xla"),
}


def register(entry: KernelEntry) -> KernelEntry:
  if "/" not in entry.name and entry.name != "xla":
    raise ValueError(f"kernel name {entry.name!r} must be '<backend>/<name>'")
  _REGISTRY[entry.name] = entry
  return entry


def unregister(name: str) -> None:
  """Removes a kernel (tests register throwaway kernels); unknown names are
  an error so that a typo does not pass silently."""
  if name not in _REGISTRY:
    raise ValueError(f"kernel={name!r} is not registered")
  del _REGISTRY[name]


def list_kernels(pattern: str | None = None) -> list[str]:
  """Registered kernel names, sorted, optionally filtered by a glob."""
  names = sorted(_REGISTRY)
  if pattern is not None:
    names = [n for n in names if fnmatch.fnmatch(n, pattern)]
  return names


def get_kernel(name: str) -> KernelEntry:
  if not isinstance(name, str):
    raise TypeError(f"kernel must be a str, got {type(name).__name__}")
  try:
    return _REGISTRY[name]
  except KeyError:
    raise ValueError(
        f"kernel={name!r} is not registered; choose one of "
        f"{list_kernels()}") from None


def auto_order(device: DeviceInfo,
               problem: GemmProblem | None = None) -> tuple[str, ...]:
  if device.platform == "cpu":
    return _AUTO_ORDER["cpu"]
  if device.is_hopper:
    if problem is not None and problem.precision == "ieee":
      return _AUTO_ORDER["hopper_ieee"]
    if problem is not None and problem.in_dtype in FP8_DTYPES:
      return _AUTO_ORDER["hopper_fp8"]
    return _AUTO_ORDER["hopper"]
  if device.is_gpu:
    return _AUTO_ORDER["gpu"]
  return ("xla",)


#: The kernels index their operands with int32 offsets.
INT32_LIMIT = 2**31 - 1


def int32_overflow(problem: GemmProblem) -> str | None:
  """Why `problem` is too large for int32 indexing, or None."""
  sizes = {"A": problem.batch * problem.m * problem.k,
           "B": problem.batch * problem.k * problem.n,
           "the output": problem.batch * problem.m * problem.n}
  for name, size in sizes.items():
    if size > INT32_LIMIT:
      return (f"{name} has {size} elements, past the 2**31 - 1 that int32 "
              f"indexing reaches; kernel='xla' (or kernel=None) runs it")
  return None


def why_unsupported(entry: KernelEntry, problem: GemmProblem,
                    device: DeviceInfo) -> str | None:
  if device.platform == "cpu" and not entry.runs_on_cpu:
    return f"{entry.name} needs a CUDA GPU"
  if entry.name != "xla":
    if "float64" in (problem.in_dtype, problem.out_dtype):
      return "float64 runs on XLA's dot only (kernel='xla' or kernel=None)"
    overflow = int32_overflow(problem)
    if overflow is not None:
      return overflow
    if (problem.is_scaled or problem.b_dtype is not None) and (
        not entry.takes_scales):
      return (f"{entry.name} takes no fp8 scales or mixed fp8 operands "
              "(mosaic/fp8 and xla do)")
  return entry.supports(problem, device)


def select_kernel(problem: GemmProblem, device: DeviceInfo,
                  requested: str | None = None) -> KernelEntry:
  """The kernel that will run `problem`: the requested one, or the first
  supported kernel in `auto_order(device)`."""
  if requested is not None:
    entry = get_kernel(requested)
    reason = why_unsupported(entry, problem, device)
    if reason is not None:
      raise ValueError(
          f"kernel={requested!r} cannot run {problem.describe()} on "
          f"{device.device_kind}: {reason}")
    return entry
  for name in auto_order(device, problem):
    entry = _REGISTRY.get(name)
    if entry is None:
      continue
    if device.platform == "cpu" and name != "xla" and (
        problem.flops > CPU_INTERPRET_FLOP_BUDGET):
      continue
    if why_unsupported(entry, problem, device) is None:
      return entry
  return _REGISTRY["xla"]
