"""The Pallas-Triton knobs that no config field covers, measured on the GPU.

`triton_sweep.py` covers the config fields (tiles, warps, stages, group
size). This script times the remaining knobs of issue #4 on rung 6's best
configs, as kernel variants written here (tile-multiple NN problems only,
plain epilogue, so that nothing but the knob changes):

  base        rung 6 (`triton/06_tuned`) with the given config;
              base_persistent the same on its persistent grid
  evict_last  A and B loads marked evict_last (keep operands in L2)
  unroll2     the K loop written with two K steps (two dots) per iteration,
              each half as deep
  persistent  one program per SM looping over its output tiles (grouped
              order), the K loop inside; persistent_evict_loads/_store/_both
              add evict_last operand loads and/or evict_first output stores
  out_f32     the epilogue stores an f32 tile and XLA converts it (the
              epilogue dtype knob)
  config:BMxBNxBK/wW/sS/gG/pP
              rung 6 itself with that config (warps, stages, group size,
              programs per SM; omitted fields keep the case's config), for
              configs outside the search space

Every variant is checked against jnp.dot before it is timed. Timing: CUPTI
(`jax.experimental.mosaic.gpu.profiler.measure`), every kernel a call
launches counted, a warm-up call, then the median of --iters; jnp.dot (16-bit
output for 16-bit inputs, HIGHEST for f32) is timed in the same process
before each shape's variants.

    PYTHONPATH=. python3 experiments/lab/triton_knobs.py --out knobs.jsonl
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
import warnings

warnings.filterwarnings("ignore", category=DeprecationWarning)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import triton as pltriton  # noqa: E402

from pallas_gemm import numerics, registry  # noqa: E402
from pallas_gemm.problem import GemmProblem, cdiv  # noqa: E402
from pallas_gemm.triton_backend import common  # noqa: E402
from pallas_gemm.triton_backend.common import TritonConfig  # noqa: E402

START = time.time()
INTERPRET = False  # --dry-run: interpret mode on a CPU at small sizes

BF16_CONFIG = TritonConfig(128, 256, 64, num_warps=8, num_stages=3, group_m=8)
IEEE_CONFIG = TritonConfig(64, 128, 32, num_warps=4, num_stages=3, group_m=8)
BF16_SHAPES = [(4096, 4096, 4096), (8192, 8192, 8192), (8192, 14336, 4096),
               (16384, 4096, 4096)]
IEEE_SHAPES = [(4096, 4096, 4096), (8192, 8192, 8192)]


def _dot(a_tile, b_tile, problem):
  return jnp.dot(a_tile, b_tile, precision=common.dot_precision(problem),
                 preferred_element_type=jnp.float32)


def _tile_loop(a_ref, b_ref, problem, config, rows0, cols0, *,
               load_kwargs=None, steps_per_iter=1):
  """acc for the tile at (rows0, cols0) of whole-K refs a (bm, K), b (K, bn)
  or, with rows0/cols0 given, of whole-array refs."""
  bm, bn, bk = config.block_m, config.block_n, config.block_k
  load_kwargs = load_kwargs or {}
  k_steps = cdiv(problem.k, bk)
  assert k_steps % steps_per_iter == 0

  def load_a(kk):
    start = pl.multiple_of(kk * bk, bk)
    rows = slice(None) if rows0 is None else pl.ds(rows0, bm)
    return pltriton.load(a_ref.at[rows, pl.ds(start, bk)], **load_kwargs)

  def load_b(kk):
    start = pl.multiple_of(kk * bk, bk)
    cols = slice(None) if cols0 is None else pl.ds(cols0, bn)
    return pltriton.load(b_ref.at[pl.ds(start, bk), cols], **load_kwargs)

  def body(it, acc):
    for step in range(steps_per_iter):
      kk = it * steps_per_iter + step
      acc = acc + _dot(load_a(kk), load_b(kk), problem)
    return acc

  acc = jnp.zeros((bm, bn), jnp.float32)
  return jax.lax.fori_loop(0, k_steps // steps_per_iter, body, acc)


def parse_config(spec: str, base: TritonConfig) -> TritonConfig:
  """`BMxBNxBK/w8/s2/g8/p1` -> a TritonConfig (missing fields from `base`)."""
  names = {"w": "num_warps", "s": "num_stages", "g": "group_m",
           "p": "programs_per_sm"}
  block, *fields = spec.split("/")
  try:
    bm, bn, bk = (int(x) for x in block.split("x"))
    changes = {names[f[0]]: int(f[1:]) for f in fields}
  except (KeyError, IndexError, ValueError):
    raise ValueError(
        f"config spec {spec!r} must look like 128x256x64/w8/s3/g8/p1 "
        f"(fields after the block: {', '.join(names)})") from None
  return dataclasses.replace(base, block_m=bm, block_n=bn, block_k=bk,
                             **changes)


def variant_fn(variant, problem, config, num_sms):
  """A jitted (a, b) -> out for one knob variant."""
  if variant.startswith("config:"):
    config = parse_config(variant.removeprefix("config:"), config)
    entry = registry.get_kernel("triton/06_tuned")
    return jax.jit(lambda a, b: entry.fn(a, b, None, None, problem=problem,
                                         config=config, interpret=INTERPRET))
  if variant in ("base", "base_persistent"):
    if variant == "base_persistent":
      config = dataclasses.replace(config, programs_per_sm=1)
    entry = registry.get_kernel("triton/06_tuned")
    return jax.jit(lambda a, b: entry.fn(a, b, None, None, problem=problem,
                                         config=config, interpret=INTERPRET))
  bm, bn = config.block_m, config.block_n
  grid_m, grid_n = cdiv(problem.m, bm), cdiv(problem.n, bn)
  out_dtype = jnp.float32 if variant == "out_f32" else jnp.dtype(
      problem.out_dtype)
  params = pltriton.CompilerParams(num_warps=config.num_warps,
                                   num_stages=config.num_stages)
  if variant.startswith("persistent"):
    load_evict = ({"eviction_policy": "evict_last"}
                  if variant in ("persistent_evict_loads",
                                 "persistent_evict_both") else {})
    store_evict = ({"eviction_policy": "evict_first"}
                   if variant in ("persistent_evict_store",
                                  "persistent_evict_both") else {})
    num_tiles = grid_m * grid_n
    programs = min(num_sms, num_tiles)

    def kernel(a_ref, b_ref, o_ref):
      pid = pl.program_id(0)

      def tile_body(t, carry):
        tile = pid + t * programs
        i, j = common.grouped_tile_index(tile, grid_m=grid_m, grid_n=grid_n,
                                         group_m=config.group_m)
        rows0 = pl.multiple_of(i * bm, bm)
        cols0 = pl.multiple_of(j * bn, bn)
        acc = _tile_loop(a_ref, b_ref, problem, config, rows0, cols0,
                         load_kwargs=load_evict)
        pltriton.store(o_ref.at[pl.ds(rows0, bm), pl.ds(cols0, bn)],
                       acc.astype(out_dtype), **store_evict)
        return carry

      my_tiles = jax.lax.div(num_tiles - pid + programs - 1, programs)
      jax.lax.fori_loop(0, my_tiles, tile_body, 0)

    whole = lambda shape: pl.BlockSpec(shape, lambda p: (0, 0))
    call = pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((problem.m, problem.n),
                                               out_dtype),
        grid=(programs,),
        in_specs=[whole((problem.m, problem.k)),
                  whole((problem.k, problem.n))],
        out_specs=whole((problem.m, problem.n)),
        compiler_params=params, interpret=INTERPRET, name="knob_persistent")
    return jax.jit(lambda a, b: call(a[0], b[0])[None].astype(
        problem.out_dtype))

  load_kwargs = {}
  steps_per_iter = 1
  if variant == "evict_last":
    # cache_modifier is unusable in jax 0.11.2: the lowering accepts ".cg"
    # but looks it up without the dot (KeyError), so eviction only.
    load_kwargs = dict(eviction_policy="evict_last")
  elif variant == "unroll2":
    # Two K steps of half the depth, so the pipelined footprint is the
    # same as the base's (two full steps overflowed shared memory).
    steps_per_iter = 2
    config = dataclasses.replace(config, block_k=config.block_k // 2)

  def kernel(a_ref, b_ref, o_ref):
    i, j = common.grouped_tile_index(pl.program_id(0), grid_m=grid_m,
                                     grid_n=grid_n, group_m=config.group_m)
    del i, j  # the BlockSpecs already placed the refs on this tile
    acc = _tile_loop(a_ref, b_ref, problem, config, None, None,
                     load_kwargs=load_kwargs, steps_per_iter=steps_per_iter)
    value = acc.astype(out_dtype)
    pltriton.store(o_ref, value)

  def tile_ij(t):
    return common.grouped_tile_index(t, grid_m=grid_m, grid_n=grid_n,
                                     group_m=config.group_m)

  call = pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((problem.m, problem.n), out_dtype),
      grid=(grid_m * grid_n,),
      in_specs=[pl.BlockSpec((bm, problem.k), lambda t: (tile_ij(t)[0], 0)),
                pl.BlockSpec((problem.k, bn), lambda t: (0, tile_ij(t)[1]))],
      out_specs=pl.BlockSpec((bm, bn), lambda t: tile_ij(t)),
      compiler_params=params, interpret=INTERPRET, name=f"knob_{variant}")
  return jax.jit(lambda a, b: call(a[0], b[0])[None].astype(
      problem.out_dtype))


VARIANTS = ("base", "base_persistent", "evict_last", "unroll2", "persistent",
            "persistent_evict_loads", "persistent_evict_store",
            "persistent_evict_both", "out_f32")


def jnp_dot(problem):
  precision = common.dot_precision(problem)
  return jax.jit(lambda a, b: jnp.matmul(a, b, precision=precision).astype(
      problem.out_dtype))


def measure(fn, a, b, iters):
  if INTERPRET:
    out = jax.block_until_ready(fn(a, b))
    return out, 1.0
  from pallas_gemm import timing
  out, times = timing.cupti_samples_ms(fn, (a, b), iterations=iters)
  return out, statistics.median(times)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out", required=True)
  parser.add_argument("--iters", type=int, default=20)
  parser.add_argument("--budget-s", type=float, default=400)
  parser.add_argument("--variants", default=",".join(VARIANTS))
  parser.add_argument("--families", default="bf16,ieee",
                      help="which of bf16, ieee to run")
  parser.add_argument("--shapes", default="",
                      help="MxNxK,... for every family (default: built-in)")
  parser.add_argument("--dry-run", action="store_true",
                      help="interpret mode on a CPU at small sizes")
  args = parser.parse_args()
  global INTERPRET, BF16_SHAPES, IEEE_SHAPES, BF16_CONFIG, IEEE_CONFIG
  device = jax.devices()[0]
  from pallas_gemm.devices import device_info
  num_sms = max(device_info().num_sms, 1)
  if args.dry_run:
    INTERPRET = True
    num_sms = 3
    BF16_SHAPES = [(256, 512, 128)]
    IEEE_SHAPES = [(128, 256, 64)]
    BF16_CONFIG = dataclasses.replace(BF16_CONFIG, block_m=64, block_n=128,
                                      block_k=32)
    IEEE_CONFIG = dataclasses.replace(IEEE_CONFIG, block_k=16)
  from experiments.bench.output import git_revision
  sha = git_revision()

  def emit(record):
    record["t"] = round(time.time() - START, 1)
    line = json.dumps(record)
    print(line, flush=True)
    with open(args.out, "a") as f:
      f.write(line + "\n")

  emit({"env": device.device_kind, "jax": jax.__version__, "git_sha": sha,
        "num_sms": num_sms, "command": "python3 experiments/lab/triton_knobs.py "
        + " ".join(f"--{k.replace('_', '-')}={v}" for k, v in
                   vars(args).items() if k != "out")})
  if args.shapes:
    BF16_SHAPES = IEEE_SHAPES = [
        tuple(int(x) for x in shape.split("x"))
        for shape in args.shapes.split(",")]
  families = set(args.families.split(","))
  cases = [("bfloat16", "default", s, BF16_CONFIG) for s in BF16_SHAPES
           if "bf16" in families] + [
      ("float32", "ieee", s, IEEE_CONFIG) for s in IEEE_SHAPES
      if "ieee" in families]
  key = numerics.fresh_key()
  for dtype, precision, (m, n, k), config in cases:
    problem = GemmProblem(1, m, n, k, dtype, dtype, precision=precision)
    key, ka, kb = jax.random.split(key, 3)
    a = numerics.random_normal(ka, (1, m, k), dtype)
    b = numerics.random_normal(kb, (1, k, n), dtype)
    ref, ref_ms = measure(jnp_dot(problem), a, b, args.iters)
    emit({"problem": problem.describe(), "variant": "jnp.dot", "ms": ref_ms,
          "tflops": problem.flops / ref_ms / 1e9})
    ref32 = ref.astype(jnp.float32)
    for variant in args.variants.split(","):
      if time.time() - START > args.budget_s:
        emit({"skipped": "budget"})
        return
      shown = config
      if variant.startswith("config:"):
        shown = parse_config(variant.removeprefix("config:"), config)
      elif variant == "base_persistent":
        shown = dataclasses.replace(config, programs_per_sm=1)
      record = {"problem": problem.describe(), "variant": variant,
                "config": str(shown)}
      try:
        out, ms = measure(variant_fn(variant, problem, config, num_sms), a, b,
                          args.iters)
        err = float(jnp.linalg.norm(out.astype(jnp.float32) - ref32)
                    / jnp.linalg.norm(ref32))
        record.update(ms=ms, tflops=problem.flops / ms / 1e9,
                      vs_jnp=ref_ms / ms, err_vs_jnp=err,
                      ok=err < 1e-2)
      except Exception as e:  # noqa: BLE001
        record["error"] = f"{type(e).__name__}: {str(e)[-800:]}"
      emit(record)


if __name__ == "__main__":
  main()
