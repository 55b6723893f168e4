"""`mosaic/fp8`: fp8 (e4m3 / e5m2, mixed too) GEMM with fused dequantization.

The CTA has `mosaic/ws_persistent`'s structure and uses the same helpers
(`warp_specialised.py`): a producer warpgroup streams A and B tiles through
a TMA ring that runs on across output tiles of a persistent grid, and two
consumer warpgroups run fp8 wgmma with float32 accumulators and a TMA-store
epilogue.

Scales (`pallas_gemm.fp8` has the conventions) are applied in one of two
places:

  epilogue   per-tensor, per-row and per-column scales (and mixes of them)
             multiply the finished f32 accumulator. A per-tensor scale is
             one float each thread reads from global memory before the main
             loop: no XLA op prepares it and it takes no shared memory, so
             the ring is as deep as without scales. Row and column scales
             are copied into a small per-consumer buffer at the start of the
             tile, landing while the main loop runs.
  per K      when either operand is block-wise, every 128-deep K step is a
             separate wgmma into a fresh f32 accumulator, and its partial
             product is promoted into the running f32 sum times
             a_scale[row, kb] * b_scale[kb, col] (the scales ride the same
             TMA ring as the operand tiles). fp8 products then never sum
             past one block before being scaled. The other operand's
             per-tensor/row/column scale is expanded to the same per-K form.
             When B's factor is one number across a consumer's columns (B
             block-wise with the consumer tile inside one 128-column block,
             or per tensor) the promotion is one multiply-add per element by
             a per-row factor. With `Fp8Config.promote_group` > 1 the next
             block's wgmma is issued before the previous block is promoted,
             so the tensor cores keep running during the promotion; with
             `alternate_consumers` the two consumers take turns issuing, so
             one promotes while the other's wgmma runs.

With `Fp8Config.cluster_dim`, two CTAs form a cluster owning neighbouring
tiles, and the operand tile they share is multicast by the TMA. With
`Fp8Config.pingpong` each consumer owns alternate whole tiles, so one's
epilogue overlaps the other's main loop.

Layouts. fp8 wgmma reads both operands K-major only: A as (m, k), B as
(n, k). So the NT layout (`transpose_b=True`) is native. NN, TN and TT run
as: XLA transposes the MN-major operand(s) into a K-major copy (one extra
pass over B, or A), then this NT kernel; `layout_note()` says so and the
registry description repeats it. `fp8_operands` lists what was tried in
Mosaic to keep the transpose in the kernel, and why each failed.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_gemm import autotune, registry
from pallas_gemm.devices import DeviceInfo, device_info
from pallas_gemm.mosaic_backend import tma
from pallas_gemm.mosaic_backend.configs import CLUSTER_CTAS, Dim, MosaicConfig
from pallas_gemm.mosaic_backend.fp8_config import (  # noqa: F401 - re-exported
    FP8_TILE_K, Fp8Config, check_fp8_config, cluster_dim_of, cluster_units,
    fp8_candidates, fp8_heuristic, layout_note, smem_bytes, supports)
from pallas_gemm.mosaic_backend.fp8_kernel import kernel_body
from pallas_gemm.mosaic_backend.fp8_operands import (kernel_scales,
                                                     prepare_operands,
                                                     scaling_kind)
from pallas_gemm.mosaic_backend.warp_specialised import (
    INTERPRET_CTAS, call_kernel, interpret_params, warp_specialised_kernel)
from pallas_gemm.problem import GemmProblem, cdiv

NAME = "mosaic/fp8"


def fp8_matmul(a, b, c, bias, *, problem: GemmProblem, config: MosaicConfig,
               interpret=False, a_scale=None, b_scale=None):
  params = interpret_params(interpret)
  if not isinstance(config, MosaicConfig):
    raise TypeError(f"config must be a MosaicConfig, got {type(config).__name__}")
  error = check_fp8_config(config, problem)
  if error is not None:
    raise ValueError(f"config={config}: {error}")
  cluster_size = 1 if cluster_dim_of(config) is None else CLUSTER_CTAS
  num_sms = (INTERPRET_CTAS * cluster_size if params is not None
             else max(device_info().num_sms, 1))
  a, b, c, bias, (m_out, n_out) = prepare_operands(a, b, c, bias, problem,
                                                   config)
  m_tiles = cdiv(problem.m, config.cta_tile_m)
  n_tiles = cdiv(problem.n, config.cta_tile_n)
  k_iters = cdiv(problem.k, config.tile_k)
  m_units, n_units = cluster_units(config, m_tiles, n_tiles)
  scales = []
  if scaling_kind(problem) != "none":
    # Padded to whole cluster tiles: a cluster's second tile may lie past
    # the edge, and its scale copies must stay inside the arrays.
    cluster_dim = cluster_dim_of(config)
    scales = list(kernel_scales(
        problem, a_scale, b_scale,
        m_units * config.cta_tile_m * (2 if cluster_dim == Dim.M else 1),
        n_units * config.cta_tile_n * (2 if cluster_dim == Dim.N else 1)))
  num_clusters = min(num_sms // cluster_size,
                     problem.batch * m_units * n_units)
  cluster_kwargs = ({} if cluster_size == 1 else
                    dict(cluster=(cluster_size,), cluster_names=("cluster",)))
  out_type = jax.ShapeDtypeStruct((problem.batch, m_out, n_out),
                                  jnp.dtype(problem.out_dtype))
  kernel = warp_specialised_kernel(
      functools.partial(kernel_body, problem=problem, config=config,
                        k_iters=k_iters, m_tiles=m_tiles, n_tiles=n_tiles),
      out_type=out_type, grid=(num_clusters,), interpret=params,
      warpgroup_semantics=config.warpgroup_semantics, **cluster_kwargs)
  operands = [a, b] + [x for x in (c, bias) if x is not None] + scales
  out = call_kernel(kernel, operands, out_type, params)
  return tma.unpad_output(out, problem.m, problem.n, on_gpu=params is None)


# ------------------------------------------------- registry and heuristics ---


def check_config(config: MosaicConfig, problem: GemmProblem,
                 device: DeviceInfo) -> str | None:
  del device
  return check_fp8_config(config, problem)


autotune.register_tunable(registry.KernelEntry(
    name=NAME, fn=fp8_matmul, config_cls=Fp8Config, supports=supports,
    heuristic=fp8_heuristic, check_config=check_config, runs_on_cpu=True,
    takes_scales=True, note=layout_note,
    description=("persistent warp-specialised fp8 wgmma GEMM with fused "
                 "dequantization (per tensor/row/column in the epilogue, "
                 "block-wise per 128-deep K step); NT native, other layouts "
                 "transposed by XLA first"),
), fp8_candidates)
