"""fp8 scaling in the benchmark: the scale modes of --fp8_scaling, the scales
every target gets, and the scaled XLA baselines.

The scales cancel exactly: A's factors are powers of two and B's are their
inverses block by block (per tensor: 2 and 1/2; block-wise: 2^(kb mod 3 - 1)
and its inverse for the kb-th K block). So op(a)·op(b) of the stored fp8
values stays the reference the benchmark checks against, while every kernel
still does all of the scaling work, and one that applied a block's scale to
the wrong K block would fail the check.

Baselines (they run where the problem is fp8 and scaled):
  xla             the plain fp8 dot (no scales): XLA's fastest form, per layout
  xla_scaled      XLA's fp8 dot in f32, then x scales, rounded to the output
                  (block-wise: `pallas_gemm`'s XLA fallback, dequantize + dot)
  jax_scaled_matmul  `jax.nn.scaled_matmul` (NT only; per-tensor and
                  block-wise, B's 128x128 blocks given per row of B)
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

import pallas_gemm
from pallas_gemm.problem import FP8_DTYPES, SCALE_BLOCK, GemmProblem, cdiv

#: --fp8_scaling value -> (a_scale_mode, b_scale_mode).
FP8_SCALINGS = {"none": ("none", "none"), "tensor": ("tensor", "tensor"),
                "row": ("row", "col"), "block": ("block", "block")}
XLA_SCALED_NAME = "xla_scaled"
SCALED_MATMUL_NAME = "jax_scaled_matmul"


def check_scaling(value: str) -> str:
  if value not in FP8_SCALINGS:
    raise ValueError(f"--fp8_scaling={value!r} is not one of "
                     f"{sorted(FP8_SCALINGS)}")
  return value


def with_scaling(problem: GemmProblem, scaling: str) -> GemmProblem:
  """The problem with --fp8_scaling's modes when its inputs are fp8."""
  if problem.in_dtype not in FP8_DTYPES or scaling == "none":
    return problem
  a_mode, b_mode = FP8_SCALINGS[scaling]
  return dataclasses.replace(problem, a_scale_mode=a_mode,
                             b_scale_mode=b_mode)


def _block_exponents(k: int):
  return (jnp.arange(cdiv(k, SCALE_BLOCK)) % 3 - 1).astype(jnp.float32)


def bench_scales(problem: GemmProblem):
  """(a_scale, b_scale) in `pallas_gemm.matmul`'s shapes, or (None, None).
  Shared by every batch entry."""
  if not problem.is_scaled:
    return None, None
  m, n, k = problem.m, problem.n, problem.k
  mode = problem.a_scale_mode
  if mode == "tensor":
    return jnp.float32(2.0), jnp.float32(0.5)
  if mode == "row":
    return (jnp.full((m,), 2.0, jnp.float32),
            jnp.full((n,), 0.5, jnp.float32))
  exps = _block_exponents(k)
  a_scale = jnp.broadcast_to(2.0 ** exps, (m, exps.size))
  b_scale = jnp.broadcast_to((2.0 ** -exps)[:, None],
                             (exps.size, cdiv(n, SCALE_BLOCK)))
  if problem.transpose_b:
    b_scale = b_scale.T
  return a_scale, b_scale


def scaled_kwargs(problem: GemmProblem) -> dict:
  a_scale, b_scale = bench_scales(problem)
  if a_scale is None:
    return {}
  return dict(a_scale=a_scale, b_scale=b_scale)


def _unsupported_unless_scaled(problem: GemmProblem, device):
  del device
  if problem.in_dtype not in FP8_DTYPES or not problem.is_scaled:
    return "a scaled-fp8 baseline: runs with fp8 --dtypes and --fp8_scaling"
  return None


def xla_scaled_target(target_cls):
  def build(problem: GemmProblem, config):
    del config
    kwargs = scaled_kwargs(problem)

    def call(a, b):
      return pallas_gemm.matmul(
          a, b, kernel="xla", preferred_element_type=problem.out_dtype,
          transpose_a=problem.transpose_a, transpose_b=problem.transpose_b,
          **kwargs)
    return call

  return target_cls(
      name=XLA_SCALED_NAME, why_unsupported=_unsupported_unless_scaled,
      candidate_configs=lambda problem, device, autotune, limit: [None],
      build=build)


def scaled_matmul_target(target_cls):
  def why_unsupported(problem: GemmProblem, device):
    reason = _unsupported_unless_scaled(problem, device)
    if reason is None and problem.layout != "NT":
      reason = "jax.nn.scaled_matmul takes (B, M, K) x (B, N, K): NT only"
    if reason is None and problem.a_scale_mode == "row":
      reason = "jax.nn.scaled_matmul scales K blocks, not rows and columns"
    if reason is None and problem.k % SCALE_BLOCK and (
        problem.a_scale_mode == "block"):
      reason = f"jax.nn.scaled_matmul needs K a multiple of {SCALE_BLOCK}"
    return reason

  def build(problem: GemmProblem, config):
    del config
    m, n, k = problem.m, problem.n, problem.k
    if problem.a_scale_mode == "tensor":
      a_s = jnp.full((1, m, 1), 2.0, jnp.float32)
      b_s = jnp.full((1, n, 1), 0.5, jnp.float32)
    else:
      exps = _block_exponents(k)
      a_s = jnp.broadcast_to(2.0 ** exps, (1, m, exps.size))
      b_s = jnp.broadcast_to(2.0 ** -exps, (1, n, exps.size))

    def call(a, b):
      batched = a.ndim == 3
      a3, b3 = (a, b) if batched else (a[None], b[None])
      out = jax.nn.scaled_matmul(
          a3, b3, jnp.broadcast_to(a_s, (a3.shape[0],) + a_s.shape[1:]),
          jnp.broadcast_to(b_s, (b3.shape[0],) + b_s.shape[1:]),
          preferred_element_type=jnp.float32).astype(problem.out_dtype)
      return out if batched else out[0]
    return call

  return target_cls(
      name=SCALED_MATMUL_NAME, why_unsupported=why_unsupported,
      candidate_configs=lambda problem, device, autotune, limit: [None],
      build=build)
