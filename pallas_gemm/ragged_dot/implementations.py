"""The grouped-GEMM implementations and the one place that picks among them.

An implementation is a module (or any object) with

    NAME: str
    supports(problem, device) -> str | None     # None, or why it cannot run
    heuristic(problem, device) -> config | None
    ragged_matmul(lhs, rhs, group_sizes, row_offset, *, problem, config,
                  interpret=False) -> out

`resolve` is the only function that chooses an implementation and a config;
the primitive carries its answer and the implementations never choose.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import math

from pallas_gemm.devices import DeviceInfo
from pallas_gemm.ragged_dot import bfloat16_split, cost_model, xla
from pallas_gemm.ragged_dot.problem import RaggedProblem

IMPLEMENTATIONS: dict[str, object] = {"xla": xla}
#: Implementations that failed to import, with the error, for `explain`.
UNAVAILABLE: dict[str, str] = {}

_LOADED = False


def _load_optional() -> None:
  """Imports the Mosaic kernels on first use, not when pallas_gemm is
  imported: the kernels import other pallas_gemm backends, and a failure
  (a JAX without Mosaic GPU) must leave xla usable, with the reason kept."""
  global _LOADED
  if _LOADED:
    return
  _LOADED = True
  try:
    mosaic = importlib.import_module("pallas_gemm.ragged_dot.mosaic")
  except Exception as error:  # noqa: BLE001 - kept and reported
    UNAVAILABLE.setdefault("mosaic", f"{type(error).__name__}: {error}")
  else:
    IMPLEMENTATIONS.setdefault("mosaic", mosaic)


def available(name: str) -> bool:
  _load_optional()
  return name in IMPLEMENTATIONS


def config_type():
  """The Pallas kernels' config class, or None when it is not importable."""
  try:
    return importlib.import_module("pallas_gemm.ragged_dot.configs").RaggedConfig
  except Exception:  # noqa: BLE001 - then no config can be given
    return None


def register(implementation) -> None:
  """Adds (or replaces) an implementation under its NAME; tests use it to
  plug in a stand-in kernel."""
  _load_optional()
  IMPLEMENTATIONS[implementation.NAME] = implementation
  UNAVAILABLE.pop(implementation.NAME, None)
  clear_cache()


def unregister(name: str) -> None:
  if name == "xla":
    raise ValueError("the xla implementation cannot be removed")
  IMPLEMENTATIONS.pop(name, None)
  clear_cache()


def names() -> tuple[str, ...]:
  _load_optional()
  return tuple(IMPLEMENTATIONS)


@dataclasses.dataclass(frozen=True)
class Resolution:
  """What runs a problem and why."""
  implementation: str
  config: object
  reason: str


def get(name: str):
  _load_optional()
  if name in IMPLEMENTATIONS:
    return IMPLEMENTATIONS[name]
  if name in UNAVAILABLE:
    raise ValueError(f"kernel={name!r} is not available: {UNAVAILABLE[name]}")
  raise ValueError(f"kernel={name!r} is not one of "
                   f"{sorted(set(IMPLEMENTATIONS) | set(UNAVAILABLE))}")


def _check_config(name: str, config) -> None:
  if config is None:
    return
  if name == "xla":
    raise TypeError(f"config={config!r}: kernel='xla' takes no config")
  expected = getattr(IMPLEMENTATIONS[name], "CONFIG_TYPE", None) or config_type()
  if expected is not None and not isinstance(config, expected):
    raise TypeError(f"config must be a {expected.__name__} for kernel="
                    f"{name!r}, got {type(config).__name__}")


def resolve(problem: RaggedProblem, device: DeviceInfo, kernel: str | None = None,
            config=None) -> Resolution:
  """The implementation and config for `problem` on `device`.

  kernel given: it must support the problem, or this raises with its reason.
  kernel None: the Mosaic kernel on a Hopper GPU when it supports the
  problem, otherwise `xla`, with the reason recorded; float32 operands go
  to the Mosaic kernels only where `bfloat16_split`'s cost model has them
  faster than XLA, fp8 ones except where `cost_model` expects XLA faster
  for bfloat16 operands: with rhs read transposed, as for 16-bit ones;
  otherwise on calls of a few microseconds and weight gradients whose
  chain of steps stands for the kernels' time; 16-bit ones except where
  `cost_model` expects XLA's product to be `XLA_MARGIN` times faster, or
  faster on a call of a few microseconds (`cost_model.xla_chosen`: small
  calls, padded shapes). config given: checked and
  used as is; otherwise the implementation's heuristic picks one.
  Memoized: one decision per (problem, device, kernel, config)."""
  if not isinstance(problem, RaggedProblem):
    raise TypeError(f"problem must be a RaggedProblem, got {type(problem).__name__}")
  if kernel is not None and not isinstance(kernel, str):
    raise TypeError(f"kernel must be a str or None, got {type(kernel).__name__}")
  _load_optional()
  return _resolve(problem, device, kernel, config)


@functools.lru_cache(maxsize=4096)
def _resolve(problem, device, kernel, config) -> Resolution:
  if kernel is not None:
    implementation = get(kernel)
    why_not = implementation.supports(problem, device)
    if why_not is not None:
      raise ValueError(f"kernel={kernel!r} cannot run {problem}: {why_not}")
    _check_config(kernel, config)
    chosen, reason = kernel, "asked for by name"
  else:
    chosen, reason = _automatic_choice(problem, device)
    if config is not None:
      _check_config(chosen, config)
  if config is None:
    config = IMPLEMENTATIONS[chosen].heuristic(problem, device)
    reason += "; config from its heuristic" if config is not None else ""
  else:
    reason += "; config given by the caller"
  return Resolution(chosen, config, reason)


def _automatic_choice(problem, device) -> tuple[str, str]:
  if "mosaic" not in IMPLEMENTATIONS:
    return "xla", ("fallback to xla: the mosaic kernel is not importable ("
                   f"{UNAVAILABLE.get('mosaic', 'not registered')})")
  if not (device.is_gpu and device.is_hopper):
    return "xla", (f"fallback to xla: the mosaic kernel needs a Hopper GPU, "
                   f"this is {device.device_kind!r}")
  why_not = IMPLEMENTATIONS["mosaic"].supports(problem, device)
  if why_not is not None:
    return "xla", f"fallback to xla: mosaic does not support it: {why_not}"
  kernels = IMPLEMENTATIONS["mosaic"]
  if bfloat16_split.splits(problem):
    operands = f"these {problem.in_dtype} operands"
    if problem.in_dtype in bfloat16_split.XLA_COMPETES:
      # The parts' pads and cuts (k or n not whole 64-column spans) are
      # passes over them of their own, which the split's model adds.
      copies_us = cost_model.copies_us(
          problem, kernels, kernels.heuristic(problem, device), device)
    else:
      # fp8: XLA's bfloat16 estimate stands for its fp8 product where
      # that reads its operands as stored. Its fp8 GEMMs take both
      # operands with the contraction innermost: so does rhs read
      # transposed (dlhs), there the 16-bit choice holds at its margin
      # (two e5m2 operands, which those GEMMs do not take, were timed
      # alike on the problems tried).
      # The forward's weights and a weight gradient's operands are
      # transposed first, so there XLA is a candidate only on calls of a
      # few microseconds, where the widening pass and the kernels' fixed
      # costs outweigh the work, and where a weight gradient's chain of
      # steps stands for the kernels' time (`against_xla` then keeps its
      # margin) (experiments/results/nvidia_h200/random_ragged, sections
      # 8, 11 and 12).
      twin = dataclasses.replace(problem, in_dtype="bfloat16")
      short, estimates = cost_model.against_xla(twin, kernels, device,
                                                margin=math.inf)
      if short:
        return "xla", (f"xla: a short call or a weight gradient's long "
                       f"chain on {operands}: {estimates} for bfloat16 "
                       "operands")
      if cost_model.form(twin) == "transposed":
        xla_faster, estimates = cost_model.against_xla(twin, kernels, device)
        if xla_faster:
          return "xla", (f"xla: expected faster on {operands}, rhs read "
                         f"as stored: {estimates} for bfloat16 operands")
      copies_us = 0.0
    xla_faster, estimates = bfloat16_split.against_xla(problem, device,
                                                       copies_us)
    if xla_faster:
      return "xla", f"xla: faster on {operands}: {estimates}"
    return "mosaic", f"the mosaic kernel, faster on {operands}: {estimates}"
  # Small calls and shapes the kernels pad: XLA's one fusion can be faster.
  xla_faster, estimates = cost_model.against_xla(problem, kernels, device)
  if xla_faster:
    return "xla", f"xla: expected faster on this problem: {estimates}"
  return "mosaic", ("the mosaic kernel supports it on this Hopper GPU ("
                    f"{estimates})")


def clear_cache() -> None:
  _resolve.cache_clear()
