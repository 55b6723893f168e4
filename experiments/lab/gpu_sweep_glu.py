"""Which GLU kernel configs and backward variants are fastest, in one GPU
call (issue #20, tasks: forward at least two plain dots, fwd+bwd >= 1.03x).

    python3 experiments/lab/gpu_sweep_glu.py [--max_seconds 195]
        [--decode_shapes MxNxK,...]    # pass 4 alone, on these shapes
        [--residual_shapes MxNxK,...]  # pass 5 alone, on these shapes

Pair weights (w_gate, w_up), bf16, silu, on a few representative shapes.
One line per candidate: time, TFLOP/s, and the ratio against XLA's pair
form `silu(x @ wg) * (x @ wu)` and against two plain `jnp.dot`s (forward;
for fwd+bwd and the backward parts, against XLA's fwd+bwd / the matching
jnp.dot). In order of priority, as far as the budget goes: (1) baselines,
the heuristic and fast_math, forward and fwd+bwd, every shape; (2) one
knob at a time; (3) the parts of the backward; (4) a decode shape; (5)
only when asked, what writing the gate and up residuals costs each
candidate.

Timing: `pallas_gemm.timing.time_over_sets` (CUPTI kernel time, median,
operand sets rotated past L2), as the benchmark. On a CPU it runs one tiny
shape in interpret mode as a smoke test (timings mean nothing).
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys
import time

_ROOT = pathlib.Path(__file__).resolve().parents[2]
if str(_ROOT) not in sys.path:
  sys.path.insert(0, str(_ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import pallas_gemm  # noqa: E402
from pallas_gemm import timing  # noqa: E402
from pallas_gemm.devices import device_info  # noqa: E402
from pallas_gemm.gated_linear_unit import gated_linear_unit  # noqa: E402
from pallas_gemm.gated_linear_unit.problem import GluProblem  # noqa: E402
from pallas_gemm.gated_linear_unit.configs import glu_heuristic  # noqa: E402
from pallas_gemm.mosaic_backend.config import Dim  # noqa: E402
from pallas_gemm.shapes import parse_shapes  # noqa: E402

from experiments.bench.output import git_revision  # noqa: E402
from experiments.bench_glu import _operand_sets, _set_count  # noqa: E402

#: (label, m, n, k): one large prefill, one at each side of M = 2048 / 4096,
#: one small batch (the M < 2048 class).
GPU_SHAPES = (("llama2_7b", 8192, 11008, 4096),
              ("llama2_7b", 4096, 11008, 4096),
              ("llama3_8b", 2048, 14336, 4096),
              ("llama3_8b", 512, 14336, 4096))
#: Last, as far as the budget goes: a decode-sized batch (weight-bound).
DECODE_SHAPE = ("llama3_8b", 128, 14336, 4096)
CPU_SHAPES = (("smoke", 128, 128, 64),)


def silu(v):
  return v * jax.nn.sigmoid(v)


def xla_pair(x, w, dy=None):
  return silu(x @ w[0]) * (x @ w[1])


def two_dots(x, w, dy=None):
  return x @ w[0], x @ w[1]


def fwd_bwd(forward):
  def run(x, w, dy):
    out, pullback = jax.vjp(forward, x, w)
    return out, pullback(dy)
  return run


def mosaic_fwd(config):
  return lambda x, w, dy=None: gated_linear_unit(x, w, kernel="mosaic",
                                                 config=config)


def mosaic_residuals(config, problem, on_gpu):
  from pallas_gemm.gated_linear_unit import mosaic
  return lambda x, w, dy: mosaic.glu_forward(x, w, problem=problem,
                                             config=config, residuals=True,
                                             interpret=not on_gpu)


def short(config):
  """The config's fields, compactly."""
  return (f"[{config.tile_m}x{config.tile_n} wg={config.wg_dimension.name} "
          f"st={config.max_concurrent_steps} epi={config.epi_tile_n} "
          f"band={config.band_dim.name}{config.grid_band} "
          f"fast={int(config.fast_math)} lag={config.consumer_lag} "
          f"x_regs={int(config.x_in_registers)} splits={config.k_splits}]")


def fwd_candidates(problem, num_sms):
  """(label, config): the heuristic's config with the exact and the
  approximate epilogue, then one knob changed at a time."""
  base = dataclasses.replace(glu_heuristic(problem, num_sms), fast_math=False)
  fast = dataclasses.replace(base, fast_math=True)
  first = [("exact epilogue", base), ("fast_math", fast)]
  for lag in (1, 2):
    if lag < fast.max_concurrent_steps:
      first.append((f"fast_math+lag={lag}",
                    dataclasses.replace(fast, consumer_lag=lag)))
  second = []
  for label, change in (
      ("stages=3", dict(max_concurrent_steps=3)),
      ("band=4", dict(grid_band=4)),
      ("band=16", dict(grid_band=16)),
      ("band_dim=N", dict(band_dim=Dim.N)),
      ("epi_n=32", dict(epi_tile_n=32)),
      ("epi_n=128", dict(epi_tile_n=128)),
      ("tile 128x64 M", dict(tile_m=128, tile_n=64, wg_dimension=Dim.M)),
      ("tile 64x128 N", dict(tile_m=64, tile_n=128, wg_dimension=Dim.N)),
      ("tile 64x64 N", dict(tile_m=64, tile_n=64, wg_dimension=Dim.N))):
    try:
      config = dataclasses.replace(fast, **change)
    except (ValueError, TypeError):
      continue
    if config != fast and config.fits(problem):
      second.append(("fast_math+" + label, config))
  return first, second


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--max_seconds", type=float, default=195)
  parser.add_argument("--iters", type=int, default=10)
  parser.add_argument("--decode_shapes", default="",
                      help="comma-separated MxNxK: run only pass 4 (every "
                      "forward candidate) on these shapes")
  parser.add_argument("--residual_shapes", default="",
                      help="comma-separated MxNxK: run only pass 5 (the "
                      "forward with residuals, every candidate) on these")
  args = parser.parse_args(argv)

  decode_shapes = tuple(("decode", *shape)
                        for shape in parse_shapes(args.decode_shapes))
  residual_shapes = tuple(("residuals", *shape)
                          for shape in parse_shapes(args.residual_shapes))
  device = device_info()
  on_gpu = device.is_gpu
  shapes = GPU_SHAPES if on_gpu else CPU_SHAPES
  if decode_shapes or residual_shapes:  # passes 4 and 5 alone
    shapes = ()
  iters = args.iters if on_gpu else 1
  start = time.monotonic()
  print(f"# {device.device_kind}, jax {jax.__version__}, git "
        f"{git_revision()}, pair weights, bf16, silu; ratios: baseline time "
        "/ candidate time", flush=True)

  state = {}

  def setup(shape):
    if shape not in state:
      name, m, n, k = shape
      sets = _operand_sets(m, n, k, False, _set_count(m, n, k, on_gpu), 0)
      problem = GluProblem(m=m, n=n, k=k, in_dtype="bfloat16",
                           out_dtype="bfloat16")
      state[shape] = dict(sets=sets, problem=problem, base={})
    return state[shape]

  def check(shape, fn, fused):
    """Relative error of a forward against XLA's pair form on the first
    operand set (both bf16-rounded: about 1e-2 is agreement; a race or a
    wrong tile shows as O(1))."""
    st = setup(shape)
    x, w, dy = st["sets"][0]
    if "reference" not in st:
      st["reference"] = jax.jit(xla_pair)(x, w).astype(jnp.float32)
    operands = st["fused_sets"][0] if fused else st["sets"][0]
    out = jax.jit(fn)(*operands[:2]).astype(jnp.float32)
    ref = st["reference"]
    return float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))

  def timed(shape, label, fn, flops, baselines=(), fused=False, err=False):
    if time.monotonic() - start > args.max_seconds:
      print(f"{shape[0]} {shape[1]}x{shape[2]}x{shape[3]} | {label} | "
            "skipped (budget)", flush=True)
      return None
    st = setup(shape)
    if fused and "fused_sets" not in st:
      # The same values as the pair sets, as one (k, 2, n) array.
      st["fused_sets"] = [(x, jnp.stack(w, axis=1), dy)
                          for x, w, dy in st["sets"]]
    try:
      ms = timing.time_over_sets(fn, st["fused_sets" if fused else "sets"],
                                 iterations=iters,
                                 on_gpu=on_gpu)
    except Exception as e:  # noqa: BLE001 - a failing candidate is a result
      print(f"{shape[0]} {shape[1]}x{shape[2]}x{shape[3]} | {label} | ERROR "
            f"{type(e).__name__}: {str(e).splitlines()[0][:200]}",
            flush=True)
      return None
    us = ms * 1e3
    if err:
      try:
        baselines = tuple(baselines) + (f"err={check(shape, fn, fused):.1e}",)
      except Exception as e:  # noqa: BLE001
        baselines = tuple(baselines) + (f"err={type(e).__name__}",)
    ratios = " ".join(b for b in baselines if b.startswith("err=")) + " "
    ratios += " ".join(f"x{b}={st['base'][b] / us:.3f}" for b in baselines
                       if st["base"].get(b))
    print(f"{shape[0]} {shape[1]}x{shape[2]}x{shape[3]} | {label} | "
          f"{us:9.1f} us | {flops / (us * 1e-6) / 1e12:6.0f} TFLOP/s | "
          f"{ratios}", flush=True)
    return us

  def explain_backward(shape):
    _, m, n, k = shape
    bf = jnp.bfloat16
    spec = jax.ShapeDtypeStruct
    for label, a, b, kw in (
        ("dx_part d_gate@wg^T", spec((m, n), bf), spec((k, n), bf),
         dict(transpose_b=True)),
        ("dW x^T@d_gate", spec((m, k), bf), spec((m, n), bf),
         dict(transpose_a=True))):
      try:
        text = str(pallas_gemm.explain(a, b, **kw)).replace("\n", " / ")
      except Exception as e:  # noqa: BLE001
        text = f"{type(e).__name__}: {e}"
      print(f"{shape[0]} {m}x{n}x{k} | explain {label} | {text}", flush=True)

  # Pass 1: baselines, the heuristic and fast_math, forward and fwd+bwd.
  for shape in shapes:
    _, m, n, k = shape
    st = setup(shape)
    fwd_flops = 4 * m * n * k
    first, _ = fwd_candidates(st["problem"], device.planning_sms)
    st["base"]["xla"] = timed(shape, "fwd xla pair form", xla_pair, fwd_flops)
    st["base"]["dots"] = timed(shape, "fwd two jnp.dot", two_dots, fwd_flops,
                               ("xla",))
    for label, config in first:
      timed(shape, f"fwd {label} {short(config)}", mosaic_fwd(config),
            fwd_flops, ("xla", "dots"), err=True)
    st["base"]["xla_fb"] = timed(shape, "fwd+bwd xla pair form",
                                 fwd_bwd(xla_pair), 3 * fwd_flops)
    explain_backward(shape)
    for label, config in first[:2]:
      timed(shape, f"fwd+bwd {label}", fwd_bwd(mosaic_fwd(config)),
            3 * fwd_flops, ("xla_fb",))
    if shape == shapes[0]:
      # Fused (k, 2, n) weights: the backward is one GEMM each for dx and
      # dW; against XLA's pair form (the faster XLA form).
      for label, config in first[:2]:
        timed(shape, f"fwd fused weights {label}", mosaic_fwd(config),
              fwd_flops, ("xla", "dots"), fused=True, err=True)
        timed(shape, f"fwd+bwd fused weights {label}",
              fwd_bwd(mosaic_fwd(config)), 3 * fwd_flops, ("xla_fb",),
              fused=True)

  # Pass 2: one knob at a time around fast_math (the second shape is the
  # first one's half).
  for shape in shapes[:1] + shapes[2:]:
    _, m, n, k = shape
    st = setup(shape)
    _, second = fwd_candidates(st["problem"], device.planning_sms)
    for label, config in second:
      timed(shape, f"fwd {label} {short(config)}", mosaic_fwd(config),
            4 * m * n * k, ("xla", "dots"), err=True)

  # Pass 3: the parts of the backward, each against its jnp.dot.
  for shape in shapes[:3]:
    _, m, n, k = shape
    st = setup(shape)
    fwd_flops, gemm_flops = 4 * m * n * k, 2 * m * n * k
    first, _ = fwd_candidates(st["problem"], device.planning_sms)
    for label, config in first[:2]:
      timed(shape, f"part: fwd with residuals ({label})",
            mosaic_residuals(config, st["problem"], on_gpu), fwd_flops,
            ("dots",))
    st["base"]["dx_dot"] = timed(
        shape, "part: dx jnp.dot d@wg.T + d@wu.T",
        lambda x, w, dy: dy @ w[0].T + dy @ w[1].T, 2 * gemm_flops)
    timed(shape, "part: dx matmul auto, f32 partial as c (beta=1)",
          lambda x, w, dy: pallas_gemm.matmul(
              dy, w[1], transpose_b=True,
              c=pallas_gemm.matmul(dy, w[0], transpose_b=True,
                                   preferred_element_type=jnp.float32),
              beta=1.0, preferred_element_type=jnp.bfloat16),
          2 * gemm_flops, ("dx_dot",))
    for kernel in (None, "mosaic/ws_persistent"):
      timed(shape, f"part: dx matmul kernel={kernel}, two GEMMs + add",
            lambda x, w, dy, kernel=kernel: (
                pallas_gemm.matmul(dy, w[0], transpose_b=True, kernel=kernel)
                + pallas_gemm.matmul(dy, w[1], transpose_b=True,
                                     kernel=kernel)),
            2 * gemm_flops, ("dx_dot",))
    st["base"]["dw_dot"] = timed(shape, "part: dW jnp.dot x.T@d (one)",
                                 lambda x, w, dy: x.T @ dy, gemm_flops)
    timed(shape, "part: dW matmul kernel=mosaic/ws_persistent (one)",
          lambda x, w, dy: pallas_gemm.matmul(
              x, dy, transpose_a=True, kernel="mosaic/ws_persistent"),
          gemm_flops, ("dw_dot",))

  # Pass 4: a decode-sized shape, every candidate.
  only_residuals = residual_shapes and not decode_shapes
  for shape in ((decode_shapes or (DECODE_SHAPE,))
                if on_gpu and not only_residuals else ()):
    _, m, n, k = shape
    st = setup(shape)
    st["base"]["xla"] = timed(shape, "fwd xla pair form", xla_pair,
                              4 * m * n * k)
    st["base"]["dots"] = timed(shape, "fwd two jnp.dot", two_dots,
                               4 * m * n * k, ("xla",))
    first, second = fwd_candidates(st["problem"], device.planning_sms)
    for label, config in first + second:
      timed(shape, f"fwd {label} {short(config)}", mosaic_fwd(config),
            4 * m * n * k, ("xla", "dots"), err=True)

  # Pass 5: what writing the gate and up residuals (the forward under
  # autodiff) costs each candidate, against the same config without them.
  for shape in (residual_shapes if on_gpu else ()):
    _, m, n, k = shape
    st = setup(shape)
    st["base"]["dots"] = timed(shape, "fwd two jnp.dot", two_dots,
                               4 * m * n * k)
    first, second = fwd_candidates(st["problem"], device.planning_sms)
    for label, config in first[1:] + second:
      st["base"]["plain"] = timed(shape, f"fwd {label} {short(config)}",
                                  mosaic_fwd(config), 4 * m * n * k,
                                  ("dots",))
      timed(shape, f"fwd+residuals {label}",
            mosaic_residuals(config, st["problem"], on_gpu), 4 * m * n * k,
            ("dots", "plain"))
  print(f"# done in {time.monotonic() - start:.0f} s", flush=True)


if __name__ == "__main__":
  main()
