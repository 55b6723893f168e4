"""What the benchmark runs: jnp.dot, registered kernels, `auto` and JAX's Hopper kernel."""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import pathlib
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

import pallas_gemm
from pallas_gemm import registry
from pallas_gemm.devices import DeviceInfo
from pallas_gemm.problem import FP8_DTYPES, GemmProblem

from experiments.bench import fp8_targets
from experiments.bench.cases import AUTO_NAME, BASELINE_NAME, HOPPER_NAME

_REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------- targets ---


@dataclasses.dataclass(frozen=True)
class BenchTarget:
  """Something the benchmark can run: a registered kernel or a baseline.

  `build(problem, config)` returns a function of the stored operands (a, b)
  that computes op(a) @ op(b) in `problem.out_dtype`.
  """

  name: str
  why_unsupported: Callable[[GemmProblem, DeviceInfo], "str | None"]
  candidate_configs: Callable[[GemmProblem, DeviceInfo, bool, int], list]
  build: Callable[[GemmProblem, Any], Callable]


def _precision_arg(problem: GemmProblem):
  if problem.precision == "ieee":
    return jax.lax.Precision.HIGHEST
  return jax.lax.Precision.DEFAULT


def _dot_dimension_numbers(problem: GemmProblem):
  contract_a = 0 if problem.transpose_a else 1
  contract_b = 1 if problem.transpose_b else 0
  if problem.batch > 1:  # a leading batch axis on both operands
    return ((contract_a + 1,), (contract_b + 1,)), ((0,), (0,))
  return ((contract_a,), (contract_b,)), ((), ())


def _build_jnp_dot(problem: GemmProblem, config):
  del config
  dims = _dot_dimension_numbers(problem)
  out_dtype = jnp.dtype(problem.out_dtype)
  precision = _precision_arg(problem)
  # jnp.dot on 16-bit inputs returns 16-bit outputs from an f32 accumulator;
  # only fp8 needs an explicit output type.
  preferred = out_dtype if problem.in_dtype in FP8_DTYPES else None

  def jnp_dot(a, b):
    # dot_general puts A's free dimension first whatever the layout.
    out = jax.lax.dot_general(a, b, dims, precision=precision,
                              preferred_element_type=preferred)
    return out.astype(out_dtype)
  return jnp_dot


def baseline_target() -> BenchTarget:
  return BenchTarget(
      name=BASELINE_NAME,
      why_unsupported=lambda problem, device: None,
      candidate_configs=lambda problem, device, autotune, limit: [None],
      build=_build_jnp_dot)


def _triton_variants(problem: GemmProblem, default):
  """A few tile shapes around the default for --autotune on Triton rungs."""
  from pallas_gemm.triton_backend import common  # noqa: PLC0415
  wide_k = 64 if problem.in_dtype in ("bfloat16", "float16") else 32
  variants = [
      dataclasses.replace(default, block_m=128, block_n=128, block_k=wide_k,
                          num_warps=8, num_stages=max(default.num_stages, 3)),
      dataclasses.replace(default, block_m=128, block_n=64, block_k=wide_k,
                          num_warps=4, num_stages=max(default.num_stages, 3)),
      dataclasses.replace(default, block_m=64, block_n=128, block_k=wide_k,
                          num_warps=4, num_stages=max(default.num_stages, 4)),
  ]
  return [common.small_problem_config(problem, v) for v in variants]


def _spread(items: list, count: int) -> list:
  """`count` items evenly spaced through `items` (all when fewer)."""
  if len(items) <= count:
    return list(items)
  step = len(items) / count
  return [items[int(i * step)] for i in range(count)]


def _registered_candidates(entry: registry.KernelEntry, problem, device,
                           autotune: bool, limit: int) -> list:
  default = entry.default_config(problem, device)
  if not autotune or entry.config_cls is None:
    return [default]
  space = None
  try:
    from pallas_gemm import autotune as tuner  # noqa: PLC0415
    space = [c for c in tuner.search_space(problem, entry.name, device)
             if tuner.fits_device(c, problem, device)]
  except (ImportError, ValueError, AttributeError):
    pass  # no search space registered for this kernel
  if space is None and type(default).__name__ == "TritonConfig":
    space = _triton_variants(problem, default)
  space = [c for c in space or [] if c != default]
  return [default] + _spread(space, limit - 1)


def registered_target(name: str) -> BenchTarget:
  entry = registry.get_kernel(name)

  def why_unsupported(problem, device):
    reason = registry.why_unsupported(entry, problem, device)
    if reason is None and device.platform == "cpu" and (
        problem.flops > registry.CPU_INTERPRET_FLOP_BUDGET):
      reason = (f"interpret mode on a CPU: {problem.flops:.3g} flops is past "
                f"the {registry.CPU_INTERPRET_FLOP_BUDGET:.3g} budget")
    return reason

  def build(problem: GemmProblem, config):
    precision = _precision_arg(problem) if problem.in_dtype == "float32" else None
    scales = fp8_targets.scaled_kwargs(problem)

    def call(a, b):
      return pallas_gemm.matmul(
          a, b, kernel=name, config=config, precision=precision,
          preferred_element_type=problem.out_dtype,
          transpose_a=problem.transpose_a, transpose_b=problem.transpose_b,
          **scales)
    return call

  return BenchTarget(
      name=name, why_unsupported=why_unsupported,
      candidate_configs=functools.partial(_registered_candidates, entry),
      build=build)


# JAX's own Hopper kernel: a small sweep of its TuningConfig, best kept.
# (tile_m, tile_n, warpgroups split along, grid_minor_dim, grid_tile_width)
_HOPPER_SWEEP = (
    (128, 128, "N", "N", 8),   # CTA tile 128 x 256
    (128, 128, "M", "M", 8),   # CTA tile 256 x 128
    (128, 64, "N", "N", 4),    # CTA tile 128 x 128
    (64, 128, "N", "N", 4),    # CTA tile 64 x 256: M = 64 decode batches
)
_HOPPER_TILE_K = 64
_HOPPER_STAGES = 4


def _hopper_module():
  from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu  # noqa: PLC0415
  return hopper_matmul_mgpu


def _hopper_configs(problem: GemmProblem) -> list:
  module = _hopper_module()
  dim = module.MatmulDimension
  configs = []
  for tile_m, tile_n, wg, minor, width in _HOPPER_SWEEP:
    cta_m = tile_m * (2 if wg == "M" else 1)
    cta_n = tile_n * (2 if wg == "N" else 1)
    if problem.m % cta_m or problem.n % cta_n or problem.k % _HOPPER_TILE_K:
      continue
    configs.append(module.TuningConfig(
        tile_m=tile_m, tile_n=tile_n, tile_k=_HOPPER_TILE_K,
        max_concurrent_steps=_HOPPER_STAGES, wg_dimension=dim[wg],
        grid_minor_dim=dim[minor], grid_tile_width=width))
  return configs


def hopper_target() -> BenchTarget:
  def why_unsupported(problem: GemmProblem, device: DeviceInfo):
    if not device.is_hopper:
      return "JAX's hopper_matmul_mgpu needs a Hopper (sm_90) GPU"
    if problem.in_dtype not in ("bfloat16", "float16"):
      return "hopper_matmul_mgpu takes bfloat16 or float16 inputs only"
    if problem.layout != "NN":
      return "hopper_matmul_mgpu reads A as (M, K) and B as (K, N): layout NN only"
    if problem.batch > 1:
      return "hopper_matmul_mgpu multiplies matrices: batch 1 only"
    try:
      configs = _hopper_configs(problem)
    except ImportError as e:
      return f"hopper_matmul_mgpu does not import: {e}"
    if not configs:
      return (f"hopper_matmul_mgpu needs tile-divisible shapes: no swept tile "
              f"divides M={problem.m}, N={problem.n}, K={problem.k} "
              f"(K must be a multiple of {_HOPPER_TILE_K})")
    return None

  def candidates(problem, device, autotune, limit):
    del device, autotune  # the sweep is this baseline's own tuning
    return _hopper_configs(problem)[:limit]

  def build(problem, config):
    module = _hopper_module()
    return lambda a, b: module.matmul(a, b, None, config)

  return BenchTarget(name=HOPPER_NAME, why_unsupported=why_unsupported,
                     candidate_configs=candidates, build=build)


def auto_target() -> BenchTarget:
  """`kernel=None`: exactly what a user's call runs (the dispatch table,
  the fixed order, or the fallback), with the config it resolves."""
  def build(problem: GemmProblem, config):
    del config
    precision = _precision_arg(problem) if problem.in_dtype == "float32" else None
    scales = fp8_targets.scaled_kwargs(problem)

    def call(a, b):
      return pallas_gemm.matmul(
          a, b, precision=precision, preferred_element_type=problem.out_dtype,
          transpose_a=problem.transpose_a, transpose_b=problem.transpose_b,
          **scales)
    return call

  return BenchTarget(
      name=AUTO_NAME, why_unsupported=lambda problem, device: None,
      candidate_configs=lambda problem, device, autotune, limit: [None],
      build=build)


def resolve_kernels(patterns: Sequence[str],
                    skip: Sequence[str] = ()) -> tuple[str, ...]:
  """Expands names and globs, less those matching a `skip` glob; jnp.dot
  comes first, always."""
  registered = [n for n in pallas_gemm.list_kernels() if n != BASELINE_NAME]
  universe = [AUTO_NAME] + registered + [HOPPER_NAME,
                                          fp8_targets.XLA_SCALED_NAME,
                                          fp8_targets.SCALED_MATMUL_NAME]
  chosen: list[str] = [BASELINE_NAME]
  for raw in patterns:
    pattern = raw.strip()
    if not pattern:
      continue
    if pattern == "all":
      matches = universe
    elif pattern == BASELINE_NAME:
      matches = []
    else:
      matches = [n for n in universe if fnmatch.fnmatchcase(n, pattern)]
      if not matches:
        raise ValueError(
            f"--kernels entry {pattern!r} matches no kernel; registered: "
            f"{registered}, baselines: {[BASELINE_NAME, HOPPER_NAME]}, "
            f"and {AUTO_NAME!r} (kernel=None)")
    chosen.extend(m for m in matches if m not in chosen)
  skip = [g.strip() for g in skip if g.strip()]
  return tuple(n for n in chosen if n == BASELINE_NAME
               or not any(fnmatch.fnmatchcase(n, g) for g in skip))


def make_target(name: str) -> BenchTarget:
  if name == BASELINE_NAME:
    return baseline_target()
  if name == HOPPER_NAME:
    return hopper_target()
  if name == AUTO_NAME:
    return auto_target()
  if name == fp8_targets.XLA_SCALED_NAME:
    return fp8_targets.xla_scaled_target(BenchTarget)
  if name == fp8_targets.SCALED_MATMUL_NAME:
    return fp8_targets.scaled_matmul_target(BenchTarget)
  return registered_target(name)
