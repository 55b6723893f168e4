"""`mosaic/split_k`: GEMMs with fewer output tiles than SMs, K shared out.

A problem of a few hundred to a couple of thousand rows and columns makes
fewer 128x128 output tiles than a Hopper GPU has SMs. A kernel that gives
each tile to one CTA leaves most SMs idle and takes as long as one tile's
whole K loop. Here each CTA owns one tile_m x tile_n output tile *and* one
contiguous share of K, so `tiles * k_splits` CTAs work at once, each on a
short K loop. The body is `small_m`'s (one consumer warpgroup, a TMA ring
into wgmma) with M tiled as well; with K split, each CTA writes its f32
partial tile and XLA adds the partials in a fixed order, then applies the
epilogue: deterministic.

The config comes from a cost model (`heuristics.split_k_cost`): waves of
CTAs, each a few ring steps plus a fixed cost, and the partials' reduction.
Whether the kernel runs at all is the dispatch table's measurement.
"""

from __future__ import annotations

from pallas_gemm import autotune, registry
from pallas_gemm.devices import DeviceInfo
from pallas_gemm.mosaic_backend import heuristics, small_m
from pallas_gemm.mosaic_backend.configs import (SplitKConfig,
                                                hopper_unsupported)
from pallas_gemm.problem import GemmProblem

NAME = "mosaic/split_k"
#: The output tile that decides whether a problem is "few-tile": with at
#: least a wave of these, `ws_persistent` keeps every SM busy without
#: splitting K.
FULL_TILE = (128, 128)


def split_k_matmul(a, b, c, bias, *, problem: GemmProblem,
                   config: SplitKConfig, interpret=False):
  if not isinstance(config, SplitKConfig):
    raise TypeError(
        f"config must be a SplitKConfig, got {type(config).__name__}")
  return small_m.one_consumer_matmul(a, b, c, bias, problem=problem,
                                     config=config, tile_m=config.tile_m,
                                     row_tiled=True, interpret=interpret)


def supports(problem: GemmProblem, device: DeviceInfo) -> str | None:
  reason = hopper_unsupported(problem, device)
  if reason is not None:
    return reason
  if problem.m <= small_m.MAX_M:
    return (f"m={problem.m} <= {small_m.MAX_M}: a decode shape "
            f"({small_m.NAME}'s job)")
  tiles = problem.output_tiles(*FULL_TILE)
  if tiles >= device.planning_sms:
    return (f"{tiles} output tiles of {FULL_TILE[0]}x{FULL_TILE[1]} fill "
            f"the {device.planning_sms} SMs without splitting K "
            "(mosaic/ws_persistent's job)")
  if problem.in_dtype == "float32" and not problem.transpose_b:
    return ("TF32 wgmma needs B as (n, k); this kernel does not transpose "
            "it")
  return None


def heuristic(problem: GemmProblem, device: DeviceInfo) -> SplitKConfig:
  """The cost model's choice (`heuristics.split_k_heuristic`)."""
  return heuristics.split_k_heuristic(problem, device.planning_sms)


def search_space(problem: GemmProblem, device: DeviceInfo):
  del device
  return heuristics.split_k_candidates(problem)


autotune.register_tunable(registry.KernelEntry(
    name=NAME, fn=split_k_matmul, config_cls=SplitKConfig, supports=supports,
    heuristic=heuristic, check_config=small_m.check_config, runs_on_cpu=True,
    description=("few-tile GEMM: output tiles x K splits over the SMs, one "
                 "wgmma warpgroup per CTA, deterministic split-K reduction"),
), search_space)
