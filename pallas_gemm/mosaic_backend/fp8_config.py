"""`mosaic/fp8`'s launch config, what it costs in shared memory and
registers, the heuristic and autotune search space that pick it, and which
problems the kernel takes.

`Fp8Config` is a `MosaicConfig` plus one fp8-only field, so everything that
handles Mosaic configs (validation, the autotune cache, explain) handles it.
"""

from __future__ import annotations

import dataclasses
import itertools

import jax.numpy as jnp

from pallas_gemm.config_fields import at_least, checked
from pallas_gemm.devices import DeviceInfo
from pallas_gemm.mosaic_backend import tma
from pallas_gemm.mosaic_backend.configs import (HOPPER_SMEM_BYTES, Dim,
                                                MosaicConfig)
from pallas_gemm.mosaic_backend.fp8_operands import scaling_kind
from pallas_gemm.mosaic_backend.heuristics import wave_cost
from pallas_gemm.problem import FP8_DTYPES, SCALE_BLOCK, GemmProblem

#: One stage's K extent: 128 fp8 bytes, the full swizzle span, and one
#: block-wise scale's K extent.
FP8_TILE_K = 128
#: f32 registers one consumer thread may spend on accumulators (of the 232
#: it gets, the rest hold addresses, scales and loop state).
ACC_REGISTER_BUDGET = 200


@dataclasses.dataclass(frozen=True)
class Fp8Config(MosaicConfig):
  """A `MosaicConfig` (see there) for `mosaic/fp8`, plus:

  promote_group: block-wise scaling only. K blocks are multiplied in groups
    of this many (>= 1): inside a group each block's wgmma is issued before
    the previous block's partial product is scaled and added to the running
    sum, so the tensor cores keep working during the promotion; between
    groups the pipeline drains once. 1 waits for every block's wgmma before
    promoting it. Each extra block in flight costs one more f32
    accumulator tile in registers.
  cluster_dim: None, or Dim.M / Dim.N: pairs of CTAs form 2-CTA clusters
    that own neighbouring CTA tiles along that dimension, and the operand
    tile they share (B for Dim.M, A for Dim.N) is loaded once and multicast
    to both by the TMA, halving its L2 traffic; a ring stage is then free
    only when both CTAs' consumers have released it.
  pingpong: each consumer owns alternate whole CTA tiles (the CTA tile is
    then tile_m x tile_n, wg_dimension unused) and passes over the other's
    stages; the ring serialises the two main loops, so one consumer's
    epilogue runs while the other's wgmma keeps the tensor cores busy.
  alternate_consumers: block-wise scaling with cooperative consumers only.
    The two consumers take turns issuing each K block's wgmma (consumer 0,
    then 1, then 0 ...), so that each promotes its previous block while the
    other's wgmma runs, instead of both promoting at once while the tensor
    cores idle.
  stagger_groups: block-wise scaling with cooperative consumers and
    promote_group > 1 only. Consumer 1's first promotion group in each tile
    is a single block, so its groups end one block after consumer 0's: the
    pipeline drain at the end of a group (wait for the last wgmma, promote
    it, zero the next group's accumulators) then falls while the other
    consumer still has a wgmma in flight, instead of both draining at once.
    No barrier is added (unlike alternate_consumers).
  """

  promote_group: int = checked(1, at_least(1))
  cluster_dim: Dim | None = None
  pingpong: bool = False
  alternate_consumers: bool = False
  stagger_groups: bool = False

  @property
  def cta_tile_m(self) -> int:
    return self.tile_m if self.pingpong else super().cta_tile_m

  @property
  def cta_tile_n(self) -> int:
    return self.tile_n if self.pingpong else super().cta_tile_n

  def __post_init__(self):
    super().__post_init__()  # validates every field, these ones too
    if self.pingpong and self.alternate_consumers:
      raise ValueError("Fp8Config.alternate_consumers=True needs cooperative "
                       "consumers (pingpong=False)")
    if self.stagger_groups and (self.pingpong or self.alternate_consumers
                                or self.promote_group < 2):
      raise ValueError("Fp8Config.stagger_groups=True needs cooperative "
                       "consumers (pingpong=False), promote_group >= 2 and "
                       "alternate_consumers=False")


def promote_group_of(config: MosaicConfig) -> int:
  """A plain `MosaicConfig` promotes every block on its own."""
  return getattr(config, "promote_group", 1)


def pingpong_of(config: MosaicConfig) -> bool:
  return getattr(config, "pingpong", False)


def alternate_of(config: MosaicConfig) -> bool:
  return getattr(config, "alternate_consumers", False)


def stagger_of(config: MosaicConfig) -> bool:
  return getattr(config, "stagger_groups", False)


def cluster_dim_of(config: MosaicConfig) -> Dim | None:
  return getattr(config, "cluster_dim", None)


def cluster_units(config: MosaicConfig, m_tiles: int, n_tiles: int):
  """(m, n) counts of what the persistent grid hands out: CTA tiles, or
  pairs of them along cluster_dim."""
  cluster_dim = cluster_dim_of(config)
  m_units = -(-m_tiles // 2) if cluster_dim == Dim.M else m_tiles
  n_units = -(-n_tiles // 2) if cluster_dim == Dim.N else n_tiles
  return m_units, n_units


def scale_smem_bytes(config: MosaicConfig, problem: GemmProblem) -> int:
  """Block-wise scales ride the ring; row and column scales get one buffer
  per consumer; per-tensor scales are read from global memory (none)."""
  if scaling_kind(problem) == "per_k":
    return config.max_concurrent_steps * (config.cta_tile_m
                                          + config.cta_tile_n) * 4
  rows = config.tile_m if problem.a_scale_mode == "row" else 0
  cols = config.tile_n if problem.b_scale_mode == "col" else 0
  return 2 * (rows + cols) * 4


def smem_bytes(config: MosaicConfig, problem: GemmProblem) -> int:
  return config.smem_bytes(problem) + scale_smem_bytes(config, problem)


def column_factor_is_uniform(problem: GemmProblem,
                             config: MosaicConfig) -> bool:
  """Block-wise scaling: whether B's scale is one number across each
  consumer's columns for a K block (B per tensor, or B block-wise with a
  consumer tile inside one 128-column block), so the promotion multiplies
  by a per-row factor instead of a full row x column product. The kernel
  reads that number as a row-shaped slice of the column scales, hence
  tile_m <= tile_n."""
  if problem.b_scale_mode not in ("none", "tensor", "block"):
    return False
  if config.tile_m > config.tile_n:
    return False
  return problem.b_scale_mode != "block" or SCALE_BLOCK % config.tile_n == 0


def accumulator_registers(config: MosaicConfig, kind: str) -> int:
  """f32 accumulator registers per consumer thread (128 threads)."""
  tile = config.tile_m * config.tile_n // 128
  if kind != "per_k":
    return tile
  # The running sum, plus one partial product per block of a promotion
  # group (all zeroed before the group's first wgmma).
  return tile * (1 + promote_group_of(config))


def check_fp8_config(config: MosaicConfig, problem: GemmProblem):
  """Why `config` cannot run `problem` on this kernel, or None."""
  if config.tile_k != FP8_TILE_K:
    return (f"MosaicConfig.tile_k={config.tile_k} must be {FP8_TILE_K} for "
            "fp8 (one 128-byte swizzle span, one scale block)")
  if smem_bytes(config, problem) > HOPPER_SMEM_BYTES:
    return (f"needs {smem_bytes(config, problem)} bytes of shared memory, "
            f"more than the {HOPPER_SMEM_BYTES} an sm_90 block has")
  kind = scaling_kind(problem)
  if kind != "per_k" and (promote_group_of(config) > 1
                          or alternate_of(config) or stagger_of(config)):
    return ("promote_group, alternate_consumers and stagger_groups apply to "
            "block-wise scaling only; this problem has none")
  registers = accumulator_registers(config, kind)
  if registers > ACC_REGISTER_BUDGET:
    what = ("block-wise scales keep the running sum and "
            f"{promote_group_of(config)} partial product(s) in registers"
            if kind == "per_k" else
            "the accumulator lives in registers")
    return (f"tile {config.tile_m}x{config.tile_n} needs {registers} f32 "
            f"accumulator registers per thread, more than "
            f"{ACC_REGISTER_BUDGET} ({what})")
  return None


#: (tile_m, tile_n, split) per consumer, and how much slower each runs per
#: unit of work than the first (a narrower consumer tile reads more shared
#: memory per flop); the factors follow the H200 sweep in
#: experiments/results/nvidia_h200/fp8_sweep.
FP8_TILES = ((64, 256, Dim.M, 1.0), (128, 128, Dim.N, 1.01),
             (64, 128, Dim.M, 1.06))
#: Block-wise: the running sum and partial products share the registers.
FP8_BLOCK_TILES = ((64, 128, Dim.M, 1.0),)
#: The consumer schedule the heuristic uses, per scaling kind: pingpong or
#: cooperative consumers, 2-CTA clusters, and (block-wise) how many K blocks
#: one promotion group overlaps.
TENSOR_SCHEDULE = dict(pingpong=False, cluster_dim=None)
BLOCK_SCHEDULE = dict(pingpong=False, cluster_dim=None, promote_group=2)


def _epi_tile_n(problem: GemmProblem) -> int:
  return tma.SWIZZLE_BYTES // jnp.dtype(problem.out_dtype).itemsize


def deepest_fitting(base: Fp8Config, problem: GemmProblem) -> Fp8Config:
  """The deepest ring (then the widest epilogue sub-tile) that fits: the
  ring depth hides load latency, the epilogue tile only batches stores."""
  widest = min(_epi_tile_n(problem), base.tile_n)
  for stages, epi_n in itertools.product((6, 5, 4, 3, 2),
                                         (widest, widest // 2)):
    config = dataclasses.replace(base, max_concurrent_steps=stages,
                                 epi_tile_n=epi_n)
    if check_fp8_config(config, problem) is None:
      return config
  return dataclasses.replace(base, max_concurrent_steps=2)


def _cost(problem: GemmProblem, config: Fp8Config, slowdown: float,
          num_sms: int) -> float:
  return wave_cost(problem, config.cta_tile_m, config.cta_tile_n, slowdown,
                   num_sms)


def heuristic_choices(problem: GemmProblem):
  """[(config, slowdown)]: every config the heuristic may pick for a problem
  with these dtypes and scale modes (shape only weighs between them)."""
  per_k = scaling_kind(problem) == "per_k"
  out = []
  for tile_m, tile_n, split, slowdown in (FP8_BLOCK_TILES if per_k
                                          else FP8_TILES):
    base = Fp8Config(tile_m=tile_m, tile_n=tile_n, tile_k=FP8_TILE_K,
                     wg_dimension=split,
                     **(BLOCK_SCHEDULE if per_k else TENSOR_SCHEDULE))
    out.append((deepest_fitting(base, problem), slowdown))
  return out


def fp8_heuristic(problem: GemmProblem, device: DeviceInfo) -> Fp8Config:
  """The CTA tile whose waves cost least, then the deepest ring that fits."""
  num_sms = device.planning_sms
  config, _ = min(heuristic_choices(problem),
                  key=lambda choice: _cost(problem, *choice, num_sms))
  return config


def fp8_candidates(problem: GemmProblem, device: DeviceInfo):
  """The autotuner's search space: the heuristic's config first (and its
  wider L2 band), then the consumer tiles, schedules (cooperative,
  pingpong, 2-CTA clusters), ring depths, epilogue widths and (block-wise)
  promotion groups and turn-taking consumers that fit."""
  per_k = scaling_kind(problem) == "per_k"
  tiles = ([(64, 128, Dim.M), (64, 128, Dim.N)] if per_k else
           [(64, 256, Dim.M), (128, 128, Dim.N), (128, 128, Dim.M),
            (64, 128, Dim.M)])
  schedules = ((False, None), (True, None), (False, Dim.M), (True, Dim.M))
  groups = (1, 2) if per_k else (1,)
  alternates = (False, True) if per_k else (False,)
  widest = _epi_tile_n(problem)
  first = fp8_heuristic(problem, device)
  out = [first, dataclasses.replace(first, grid_band=16)]
  for ((tile_m, tile_n, wg_dim), (pingpong, cluster), stages, group, epi_n,
       alternate) in itertools.product(tiles, schedules, (6, 5, 4, 3), groups,
                                       (widest, widest // 2), alternates):
    if pingpong and (wg_dim == Dim.N or alternate):
      continue  # pingpong consumers neither split a tile nor take turns
    config = Fp8Config(tile_m=tile_m, tile_n=tile_n, tile_k=FP8_TILE_K,
                       max_concurrent_steps=stages,
                       epi_tile_n=min(epi_n, tile_n), wg_dimension=wg_dim,
                       promote_group=group, pingpong=pingpong,
                       cluster_dim=cluster, alternate_consumers=alternate)
    if config not in out and check_fp8_config(config, problem) is None:
      out.append(config)
  return out


def layout_note(problem: GemmProblem) -> str:
  if (problem.transpose_a, problem.transpose_b) == (False, True):
    return "NT: native (both operands K-major)"
  copies = [name for name, moved in (("A", problem.transpose_a),
                                     ("B", not problem.transpose_b)) if moved]
  return (f"{problem.layout}: XLA first transposes {' and '.join(copies)} "
          "into a K-major copy (fp8 wgmma reads K-major tiles only)")


def supports(problem: GemmProblem, device: DeviceInfo) -> str | None:
  if device.is_gpu and not device.is_hopper:
    return "needs an sm_90 (Hopper) GPU: fp8 wgmma and the TMA"
  if not device.is_gpu and device.platform != "cpu":
    return f"platform {device.platform} is not a CUDA GPU"
  for name, dtype in (("a", problem.in_dtype),
                      ("b", problem.b_dtype or problem.in_dtype)):
    if dtype not in FP8_DTYPES:
      return f"{name} has dtype {dtype}; this kernel takes {FP8_DTYPES} only"
  if problem.out_dtype not in ("float32", "bfloat16", "float16"):
    return f"output dtype {problem.out_dtype} is not supported"
  if problem.epilogue.has_c and problem.c_dtype not in (
      "float32", "bfloat16", "float16"):
    return f"c dtype {problem.c_dtype} is not supported"
  return None
