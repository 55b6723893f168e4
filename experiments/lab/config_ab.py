"""Interleaved A/B timing of kernel configs against xla, on the problems a
config rule decides, through the dispatch builder's timing (CUPTI kernel
time, median, operands rotated past L2).

Studies (`--study`):
  small_m_model  `mosaic/small_m` with the shipped heuristic's config
                 against the config of the model before it (`--old_share`,
                 `--old_ring_fill`: `heuristics.small_m_cost`'s constants),
                 on every decode problem of the `decode` suite, the `wide`
                 suite's decode regime and `--problems`, where the two
                 choose differently.
  ws_small_k     `mosaic/ws_persistent` on output-bound problems (K of one
                 or two pipeline steps): the heuristic's config against
                 consumer tiles, epilogue sub-tiles and ring depths around
                 it, to see whether any beats cuBLAS there.

Each problem runs `--rounds` rounds; in each, xla and every variant are
timed in turn, and a variant's speed over xla is the median over rounds of
its round's xla time over its own. One line per variant, then the geomean.

  PYTHONPATH=. python3 experiments/lab/config_ab.py --study small_m_model
      [--problems 1x8192x8192,...] [--rounds 2] [--budget_s 200]   (GPU)
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import pathlib
import statistics
import sys
import time

_REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(_REPO_ROOT))

import pallas_gemm  # noqa: E402
from experiments.build_dispatch_table import time_kernel  # noqa: E402
from pallas_gemm import shapes  # noqa: E402
from pallas_gemm.mosaic_backend.config import Dim  # noqa: E402
from pallas_gemm.mosaic_backend.heuristics import (  # noqa: E402
    small_m_heuristic, ws_heuristic)
from pallas_gemm.problem import GemmProblem  # noqa: E402

#: Attention-like batched products and K-of-one-step shapes of the dispatch
#: training sets (experiments/results/nvidia_h200/dispatch), where the
#: output write is most of the traffic.
SMALL_K_PROBLEMS = ("32x2176x3456x128", "16x1152x2304x128",
                    "16x3264x1024x192", "64x1280x384x64", "8x4096x4096x128")


def parse_problem(text: str) -> GemmProblem:
  """'MxNxK' or 'BxMxNxK', bf16 in and out."""
  dims = [int(v) for v in text.lower().split("x")]
  if len(dims) == 3:
    dims = [1, *dims]
  if len(dims) != 4 or min(dims) < 1:
    raise ValueError(f"problem {text!r} is not MxNxK or BxMxNxK")
  return GemmProblem(*dims, "bfloat16", "bfloat16")


def small_m_variants(problem, num_sms, args):
  new = small_m_heuristic(problem, num_sms)
  old = small_m_heuristic(problem, num_sms, saturating_share=args.old_share,
                          ring_fill=args.old_ring_fill)
  if new == old:
    return []
  return [("mosaic/small_m", "old model", old),
          ("mosaic/small_m", "shipped", new)]


def ws_small_k_variants(problem, num_sms, args):
  del args
  base = ws_heuristic(problem, num_sms)
  out = [("mosaic/ws_persistent", "heuristic", base)]
  for tile_m, tile_n, wg_dim in ((64, 256, Dim.M), (128, 128, Dim.N),
                                 (128, 128, Dim.M)):
    for epi_n in (64, 128, tile_n):
      for stages in (2, 4):
        config = dataclasses.replace(
            base, tile_m=tile_m, tile_n=tile_n, wg_dimension=wg_dim,
            epi_tile_n=min(epi_n, tile_n), max_concurrent_steps=stages)
        label = (f"{tile_m}x{tile_n}/{wg_dim.name} epi {config.epi_tile_m}x"
                 f"{config.epi_tile_n} stages {stages}")
        if config.fits(problem) and config != base and all(
            config != c for _, _, c in out):
          out.append(("mosaic/ws_persistent", label, config))
  return out


def default_problems(study: str) -> list[str]:
  if study == "ws_small_k":
    return list(SMALL_K_PROBLEMS)
  seen, out = set(), []
  decode = [(m, n, k) for m, n, k in shapes.DECODE] + [
      (p.m, p.n, p.k) for p in shapes.WIDE if p.regime == "decode"]
  for m, n, k in decode:
    if (m, n, k) not in seen:
      seen.add((m, n, k))
      out.append(f"{m}x{n}x{k}")
  return out


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--study", choices=("small_m_model", "ws_small_k"),
                      required=True)
  parser.add_argument("--problems", default="",
                      help="comma-separated MxNxK or BxMxNxK (added to the "
                      "study's defaults)")
  parser.add_argument("--only", action="store_true",
                      help="time only --problems, not the study's defaults")
  parser.add_argument("--rounds", type=int, default=2)
  parser.add_argument("--iters", type=int, default=10)
  parser.add_argument("--budget_s", type=float, default=200.0)
  parser.add_argument("--old_share", type=float, default=0.75)
  parser.add_argument("--old_ring_fill", type=float, default=0.0)
  args = parser.parse_args(argv)
  if args.rounds < 1:
    parser.error(f"--rounds={args.rounds} must be >= 1")
  texts = [] if args.only else default_problems(args.study)
  texts += [t.strip() for t in args.problems.split(",") if t.strip()]
  if not texts:
    parser.error("--only needs --problems")
  try:
    problems = [parse_problem(t) for t in texts]
  except ValueError as err:
    parser.error(f"--problems: {err}")
  variants_for = (small_m_variants if args.study == "small_m_model"
                  else ws_small_k_variants)
  device = pallas_gemm.device_info()
  if not device.is_gpu:
    parser.error("times Hopper kernels against cuBLAS: needs a GPU")
  print(f"device: {device.device_kind}, {device.num_sms} SMs; study "
        f"{args.study}, {len(problems)} problems", flush=True)
  start = time.monotonic()
  summary: dict[str, list[float]] = {}
  for number, problem in enumerate(problems, 1):
    name = problem.describe().split(" ")[0]
    if time.monotonic() - start > args.budget_s:
      print(f"[{number}/{len(problems)}] {name}: budget spent, skipped",
            flush=True)
      continue
    variants = variants_for(problem, device.num_sms, args)
    if not variants:
      print(f"[{number}/{len(problems)}] {name}: one config, nothing to "
            "compare", flush=True)
      continue
    ratios: dict[str, list[float]] = {label: [] for _, label, _ in variants}
    for _ in range(args.rounds):
      xla_ms, _ = time_kernel(problem, "xla", device, args.iters)
      for kernel, label, config in variants:
        try:
          ms, _ = time_kernel(problem, kernel, device, args.iters,
                              config=config)
        except Exception as e:  # noqa: BLE001 - report and go on
          print(f"  {label}: {type(e).__name__}: {e}"[:200], flush=True)
          ratios.pop(label, None)
          continue
        if label in ratios:
          ratios[label].append(xla_ms / ms)
    best = 0.0
    for kernel, label, config in variants:
      if label not in ratios:
        continue
      ratio = statistics.median(ratios[label])
      best = max(best, ratio)
      if args.study == "small_m_model" or label == "heuristic":
        summary.setdefault(label, []).append(ratio)
      print(f"[{number}/{len(problems)}] {name:<18} {label:<36} "
            f"{ratio:6.3f}x xla  {config}", flush=True)
    if args.study == "ws_small_k" and best:
      summary.setdefault("best variant", []).append(best)
  for label, values in summary.items():
    geomean = math.exp(sum(map(math.log, values)) / len(values))
    print(f"{label}: geomean {geomean:.3f}x xla over {len(values)} problems",
          flush=True)


if __name__ == "__main__":
  main()
