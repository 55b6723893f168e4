"""Do batched output-bound products run faster through the grouped GEMM's
turn-taking kernel than through cuBLAS? (issue 15's `batched` regime)

A batch of b products (m, k) @ (k, n) is a grouped GEMM with b groups of m
rows each: lhs is the batch's A as (b * m, k), the weights are B as
(b, k, n), and every group has m rows. Where K is one or two pipeline steps
(attention scores, k = 64 or 128), the output is most of the bytes.
- cuBLAS writes it at 3.1-3.5 of the H200's 4.3 TB/s
  (`experiments/results/nvidia_h200/wide/results.json`, the batched rows).
- `mosaic/ws_persistent` stayed at or under cuBLAS with every config
  (`experiments/results/nvidia_h200/config_ab/README.md`): its two
  consumers share every tile, so each store waits for both.
- The grouped GEMM's consumers take turns at whole tiles
  (`RaggedConfig.ping_pong`), so that one's output store overlaps the
  other's wgmmas.

The group sizes are a constant of the jitted call, but XLA does not fold
the kernel's work list from them (on a CPU a few fusions and gathers stay).
So the timed call includes those few small kernels, as a user's call
would.

    PYTHONPATH=. python3 experiments/lab/dense_via_turns.py \
        [--shapes "32x2944x2944x128;16x1344x1344x128"] \
        [--config ping_pong=true,tile_m=128,tile_n=128] [--versus ...] \
        [--iters 20]

Each shape is BxMxNxK. Every config is first checked against float64 on
sampled rows of the first and last batch entries. Then it is timed with
CUPTI, interleaved with jnp.matmul of the same operands (ABBA rounds,
operand sets rotated past L2; `experiments/bench/timers`). The script
prints the time over jnp.matmul's (below 1 is faster) and the bytes per
second. The default shapes are the wide suite's attention-score products.
On a CPU it runs one tiny shape in interpret mode, checked only.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

_ROOT = pathlib.Path(__file__).resolve().parents[2]
if str(_ROOT) not in sys.path:
  sys.path.insert(0, str(_ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import pallas_gemm  # noqa: E402
from experiments.bench import timers  # noqa: E402
from experiments.lab.ragged_profile_case import config_with_fields  # noqa: E402
from pallas_gemm import numerics, shapes, timing  # noqa: E402
from pallas_gemm.problem import GemmProblem  # noqa: E402
from pallas_gemm.ragged_dot import configs  # noqa: E402
from pallas_gemm.ragged_dot.problem import RaggedProblem  # noqa: E402

#: The turn-taking tile the grouped GEMM's heuristic runs for experts of a
#: few row items, over its config for the shape (the ring then as deep as
#: fits: `ragged_profile_case.config_with_fields`).
TURNS = ("ping_pong=true,tile_m=128,tile_n=128,split_rows=false,"
         "halve_last_round=false")
#: The interpret-mode shape on a CPU (BxMxNxK) and its small tile.
CPU_SHAPE = (2, 80, 128, 64)
CPU_TURNS = ("ping_pong=true,tile_m=64,tile_n=64,split_rows=false,"
             "halve_last_round=false")
#: Rows checked per checked batch entry.
CHECKED_ROWS = 64


def default_shapes() -> list[tuple[int, int, int, int]]:
  """The wide suite's attention-score products: (b, m, n, k) with k of
  one or two pipeline steps and a square (seq x seq) output."""
  return [(p.batch, p.m, p.n, p.k) for p in shapes.WIDE
          if p.regime == "batched" and p.k <= 128 and p.m == p.n]


def parse_shapes(text: str) -> list[tuple[int, int, int, int]]:
  out = []
  for item in filter(None, (s.strip() for s in text.split(";"))):
    parts = item.lower().split("x")
    if len(parts) != 4 or not all(p.isdigit() and int(p) > 0 for p in parts):
      raise SystemExit(f"--shapes: {item!r} is not BxMxNxK with positive "
                       "sizes")
    out.append(tuple(int(p) for p in parts))
  return out


def grouped_problem(b: int, m: int, n: int, k: int) -> RaggedProblem:
  return RaggedProblem("rows", b * m, k, n, b, "bfloat16", "bfloat16")


def turns_call(b: int, m: int, config: configs.RaggedConfig):
  """fn(a (b, m, k), w (b, k, n)) -> (b, m, n) through the grouped GEMM,
  the group sizes a constant of the call."""
  sizes = np.full((b,), m, np.int32)

  def fn(a, w):
    out = pallas_gemm.ragged_dot(a.reshape(b * m, a.shape[2]), w,
                                 jnp.asarray(sizes), kernel="mosaic",
                                 config=config)
    return out.reshape(b, m, w.shape[2])
  return fn


def check(fn, a, w) -> float:
  """Relative error of fn(a, w) against float64 on sampled rows of the
  first and last batch entries."""
  out = jax.block_until_ready(jax.jit(fn)(a, w))
  f64 = lambda x: np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)
  got, ref = [], []
  for entry in sorted({0, a.shape[0] - 1}):
    rows = np.unique(np.linspace(0, a.shape[1] - 1, min(
        a.shape[1], CHECKED_ROWS)).astype(np.int64))
    got.append(f64(out[entry])[rows])
    ref.append(f64(a[entry])[rows] @ f64(w[entry]))
  return numerics.relative_error(np.concatenate(got), np.concatenate(ref))


def operand_sets(b, m, n, k, count):
  key = numerics.fresh_key(0)
  sets = []
  for i in range(count):
    k1, k2 = jax.random.split(jax.random.fold_in(key, i))
    sets.append((numerics.random_normal(k1, (b, m, k), "bfloat16"),
                 numerics.random_normal(k2, (b, k, n), "bfloat16")))
  return sets


def run_shape(shape, config_texts, iters: int, on_gpu: bool) -> None:
  b, m, n, k = shape
  problem = grouped_problem(b, m, n, k)
  label = "x".join(map(str, shape))
  bytes_moved = 2 * b * (m * k + k * n + m * n)
  count = timing.operand_set_count(
      GemmProblem(b, m, n, k, "bfloat16", "bfloat16"), on_gpu)
  sets = operand_sets(b, m, n, k, count)
  tolerance = numerics.tolerance("bfloat16", "default", "bfloat16")
  for text in config_texts:
    config = config_with_fields(problem, text)
    fn = turns_call(b, m, config)
    error = check(fn, *sets[0])
    verdict = "ok" if error <= tolerance else "WRONG"
    print(f"{label} [{text}]: {config}", flush=True)
    print(f"{label} [{text}]: relative error {error:.1e} ({verdict})",
          flush=True)
    if not on_gpu or verdict != "ok":
      continue
    baseline = timers.RotatingCall(jnp.matmul, sets, on_gpu=True)
    call = timers.RotatingCall(fn, sets, on_gpu=True)
    base_t, call_t = timers.time_paired_on_gpu(baseline, call, iters=iters,
                                               warmup=1, cap_s=0)
    base_us, call_us = base_t.median_us, call_t.median_us
    print(f"{label} [{text}]: jnp.matmul {base_us:.1f} us "
          f"({bytes_moved / base_us / 1e6:.2f} TB/s), turns {call_us:.1f} us "
          f"({bytes_moved / call_us / 1e6:.2f} TB/s), time / jnp.matmul = "
          f"{call_us / base_us:.3f}", flush=True)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--shapes", default="", help=(
      "BxMxNxK;... (default: the wide suite's attention-score products)"))
  parser.add_argument("--config", default="", help=(
      f"RaggedConfig fields over the grouped GEMM heuristic's (default "
      f"{TURNS!r})"))
  parser.add_argument("--versus", default="", help=(
      "a second set of fields, checked and timed the same way"))
  parser.add_argument("--iters", type=int, default=20)
  args = parser.parse_args(argv)
  if args.iters < 1:
    raise SystemExit(f"--iters={args.iters} must be >= 1")
  on_gpu = jax.default_backend() == "gpu"
  if on_gpu:
    shape_list = parse_shapes(args.shapes) if args.shapes else default_shapes()
    texts = [args.config or TURNS]
  else:
    # Interpret mode: one tiny shape, checked only.
    shape_list = [CPU_SHAPE]
    texts = [args.config or CPU_TURNS]
  if args.versus:
    texts.append(args.versus)
  for i, shape in enumerate(shape_list):
    print(f"[{i + 1}/{len(shape_list)}] {'x'.join(map(str, shape))}",
          flush=True)
    run_shape(shape, texts, args.iters, on_gpu)


if __name__ == "__main__":
  main()
