"""Rung 6: the production Pallas-Triton kernel.

This file chooses the config (the heuristic, the autotuning search space)
and `tuned_kernels` holds the kernels; unlike the teaching rungs, which
write each step out once, rung 6 shares its loads, K loop and store across
three launch shapes. The numbers behind its choices are in
experiments/results/nvidia_h200/triton/README.md ("the results note"
below).

What it adds over rungs 3-5, all of which it combines:

  * grouped program order (rung 4) with a software-pipelined K loop
    (rung 3), on tiles and stage counts chosen per device, dtype, layout,
    precision and shape bucket by `pallas_gemm.autotune` (measured cache,
    shipped defaults for the GPUs we have measured, else the heuristic in
    `heuristic_config`);
  * split-K (rung 5) when the output is too small to fill the GPU;
  * for TF32, K-major operands (`TritonConfig.k_major`): wgmma takes
    32-bit operands only K-major, so an XLA transpose of a non-K-major
    operand buys full-width copies. TF32 stays well behind cuBLAS on the
    H200 all the same: XLA rounds every TF32 dot operand to TF32 in
    registers before the MMA (a pass of its own that Pallas cannot opt out
    of), so `kernel=None` sends Hopper TF32 to Mosaic (the results note,
    "The binaries XLA runs");
  * only the edge masks the shape needs: when M, N or K divides its block
    the compare-and-select on that edge is compiled out, and the K offset
    carries a `pl.multiple_of` hint, so Triton can issue full-width
    aligned loads in the common case of tile-multiple shapes;
  * a persistent grid (`TritonConfig.programs_per_sm`): a fixed number of
    programs per SM, each looping over output tiles taken in grouped order
    with a stride of the program count. Triton's pipeliner only overlaps
    loads within one K loop, but a resident program skips the launch and
    scheduling of a new block per tile and starts its next tile's loads
    right after its stores. For 16-bit inputs on the H200 that was the one
    knob that moved bf16 (the results note, "Persistent grid and the
    remaining knobs"); exact f32, whose FFMA blocks need several resident
    programs per SM, lost with it.

Loop nest (split_k = 1, programs_per_sm = 0):

    for t, batch in grid (cdiv(M, BM) * cdiv(N, BN), B):         # parallel
      i, j = grouped(t, GROUP_M)
      acc = zeros(BM, BN)                                         # f32
      for kk in range(cdiv(K, BK)):            # pipelined, num_stages deep
        k0 = multiple_of(kk * BK, BK)
        acc += A[batch, i, k0:k0+BK] @ B[batch, k0:k0+BK, j]      # masks only
      C[batch, i, j] = epilogue(acc)                              # if ragged

With programs_per_sm = p > 0 the outer loop becomes

    for prog, batch in grid (min(tiles, p * SMs), B):               # parallel
      for t in range(prog, tiles, p * SMs):                      # sequential
        i, j = grouped(t, GROUP_M); acc = ...; C[batch, i, j] = ...

It accepts every problem the primitive can ask of a Triton kernel: both
transposes, f32 (exact "ieee" or TF32), bf16 and f16 with f32 accumulation,
any batch, any M/N/K, the fused epilogue. This is the first kernel of the
CPU auto order (interpret mode) and of the non-Hopper GPU order.

Mosaic GPU kernels are faster on Hopper (wgmma + TMA + warp specialisation
written out by hand); this kernel is for Ampere and Ada, where Triton's
mma.sync path is what the hardware has.
"""

from __future__ import annotations

import dataclasses

from pallas_gemm import autotune, registry
from pallas_gemm.triton_backend import common, split_k_common, tuned_kernels

NAME = "triton/06_tuned"
TritonConfig = common.TritonConfig

# Preferred untuned configs, best first; the first whose shared memory fits
# the device wins. Chosen from the H200 sweep (experiments/lab/triton_sweep.py);
# the smaller fall-backs are for Ampere/Ada's 99-163 KiB of shared memory.
_PREFERRED = {
    "16bit": (
        TritonConfig(128, 256, 64, num_warps=8, num_stages=3, group_m=8),
        TritonConfig(128, 128, 64, num_warps=4, num_stages=4, group_m=8),
        TritonConfig(128, 128, 32, num_warps=4, num_stages=4, group_m=8),
        TritonConfig(64, 64, 32, num_warps=4, num_stages=3, group_m=8),
    ),
    "tf32": (
        TritonConfig(128, 128, 32, num_warps=4, num_stages=4, group_m=8),
        TritonConfig(128, 64, 32, num_warps=4, num_stages=3, group_m=8),
        TritonConfig(64, 64, 32, num_warps=4, num_stages=3, group_m=8),
    ),
    "ieee": (
        TritonConfig(64, 128, 32, num_warps=4, num_stages=3, group_m=8),
        TritonConfig(64, 64, 32, num_warps=4, num_stages=3, group_m=8),
    ),
}
# Candidates searched before the generic grid (see `search_space`): for
# 16-bit the persistent grid, which led on the large shapes tuned on the
# H200. Exact f32 has none: persistent grids (an FFMA block needs several
# resident programs per SM) and 16-warp FFMA blocks (<= 128 registers, so
# 16 warps per SM) both lost to the 4-warp 64x128x32 block on the H200 (the
# results note, "Exact f32 stays").
_PERSISTENT_16BIT = TritonConfig(128, 256, 64, num_warps=8, num_stages=3,
                                 group_m=8, programs_per_sm=1)
_SEARCH_FIRST = {
    "16bit": (_PERSISTENT_16BIT,) + tuple(
        dataclasses.replace(_PERSISTENT_16BIT, **change) for change in (
            dict(block_m=256, block_n=128), dict(num_stages=4),
            dict(group_m=16), dict(group_m=4),
            dict(block_k=32, num_stages=4))),
    "tf32": (
        TritonConfig(128, 128, 32, num_warps=4, num_stages=4, group_m=8,
                     k_major=True, programs_per_sm=1),
    ),
    "ieee": (),
}

# Interpret mode cost grows with the number of grid steps times K steps;
# moderate tiles keep the CPU path quick without huge padded tiles.
_INTERPRET_CONFIG = TritonConfig(64, 64, 32, num_warps=4, num_stages=1,
                                 group_m=8)


def _family(problem) -> str:
  if problem.in_dtype != "float32":
    return "16bit"
  return "ieee" if problem.precision == "ieee" else "tf32"


def heuristic_config(problem, device) -> TritonConfig:
  """The untuned choice: split-K for skinny outputs, else the first
  preferred tile that fits the device, shrunk for tiny dimensions."""
  if not device.is_gpu:
    return common.small_problem_config(problem, _INTERPRET_CONFIG)
  if problem.m <= split_k_common.MAX_SKINNY_M:
    # Few rows: the skinny plan rung 5 also uses, split only where that pays.
    skinny = split_k_common.skinny_config(problem, device)
    if autotune.fits_device(skinny, problem, device):
      return skinny
  # wgmma takes 32-bit operands from shared memory only K-major.
  k_major = _family(problem) == "tf32" and device.is_hopper
  # The persistent grid was measured faster for 16-bit on the H200 only (see
  # `_SEARCH_FIRST`); other GPUs keep the one-program-per-tile launch.
  programs_per_sm = 1 if (_family(problem) == "16bit"
                          and device.is_hopper) else 0
  for config in _PREFERRED[_family(problem)]:
    if autotune.fits_device(config, problem, device):
      return common.small_problem_config(
          problem, dataclasses.replace(config, k_major=k_major,
                                       programs_per_sm=programs_per_sm))
  return common.small_problem_config(problem, _PREFERRED[_family(problem)][-1])


def search_space(problem, device) -> list[TritonConfig]:
  """Configs `autotune.tune` times for this kernel (before smem filtering)."""
  family = _family(problem)
  if family == "16bit":
    tiles = [(128, 256, 64), (256, 128, 64), (128, 128, 64), (128, 128, 32),
             (64, 256, 64), (256, 64, 64)]
  elif family == "tf32":
    tiles = [(128, 128, 32), (128, 256, 32), (256, 128, 32), (128, 64, 32),
             (64, 128, 32), (128, 128, 64)]
  else:
    tiles = [(128, 128, 16), (64, 128, 32), (128, 64, 32), (64, 64, 32),
             (128, 128, 32), (64, 64, 16)]
  k_majors = (False, True) if family == "tf32" else (False,)
  space = list(_SEARCH_FIRST[family]) + [
      TritonConfig(bm, bn, bk, num_warps=warps, num_stages=stages,
                   group_m=8, k_major=k_major)
      for bm, bn, bk in tiles for warps in (4, 8) for stages in (3, 4)
      for k_major in k_majors]
  skinny = split_k_common.skinny_config(problem, device)
  if skinny.split_k > 1:
    space += [dataclasses.replace(skinny, split_k=s)
              for s in sorted({max(2, skinny.split_k // 2), skinny.split_k,
                               min(2 * skinny.split_k,
                                   split_k_common.MAX_SPLIT_K)})]
  seen, unique = set(), []
  for config in (common.small_problem_config(problem, c) for c in space):
    if config not in seen:
      seen.add(config)
      unique.append(config)
  return unique


def tuned_matmul(a, b, c, bias, *, problem, config, interpret):
  if config.k_major:
    a, b, problem = tuned_kernels.to_k_major(a, b, problem)
  masks = tuned_kernels.edge_masks_for(problem, config)
  if config.split_k > 1:
    partials = tuned_kernels.split_k_partials(
        a, b, problem=problem, config=config, masks=masks,
        interpret=interpret)
    return split_k_common.reduce_partials(partials, c, bias, problem=problem)
  launch = (tuned_kernels.persistent_matmul if config.programs_per_sm
            else tuned_kernels.grouped_matmul)
  return launch(a, b, c, bias, problem=problem, config=config, masks=masks,
                interpret=interpret)


def supports(problem, device):
  return common.triton_supports(problem, device,
                                heuristic_config(problem, device))


autotune.register_tunable(registry.KernelEntry(
    name=NAME, fn=tuned_matmul, config_cls=TritonConfig, supports=supports,
    heuristic=heuristic_config, runs_on_cpu=True,
    description="grouped, pipelined, autotuned; split-K for skinny outputs",
), search_space)
