"""Which `mosaic/small_m` config wins on decode shapes, against the heuristic's
and against xla, with operands rotated past L2 (as the dispatch builder
times them).

For each problem it times xla and every config of `small_m_candidates`
(strip width, K splits, ring depth), printing one line per config with its
speed over xla and whether it is the heuristic's. The default problems are
decode shapes of the dispatch training sets where the heuristic's config
lost to cuBLAS, plus two where it won (experiments/results/nvidia_h200/
dispatch/README.md).

  PYTHONPATH=. python3 experiments/lab/small_m_sweep.py [--problems 8x11136x2048,...]
      [--iters 10] [--budget_s 150]   (GPU)
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

_REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(_REPO_ROOT))

import pallas_gemm  # noqa: E402
from experiments.build_dispatch_table import time_kernel  # noqa: E402
from pallas_gemm.mosaic_backend.heuristics import (  # noqa: E402
    small_m_candidates, small_m_heuristic)
from pallas_gemm.problem import GemmProblem  # noqa: E402

DEFAULT_PROBLEMS = ("8x11136x2048", "8x16128x2176", "1x8704x2944",
                    "32x17024x2688", "64x21760x4608", "1x18560x5376",
                    "8x3456x2176", "32x3072x3328")


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--problems", default=",".join(DEFAULT_PROBLEMS))
  parser.add_argument("--iters", type=int, default=10)
  parser.add_argument("--budget_s", type=float, default=150.0)
  args = parser.parse_args()
  device = pallas_gemm.device_info()
  print(f"device: {device.device_kind}, {device.num_sms} SMs", flush=True)
  start = time.monotonic()
  for text in args.problems.split(","):
    if time.monotonic() - start > args.budget_s:
      print(f"budget spent: skipping {text}", flush=True)
      continue
    m, n, k = (int(v) for v in text.split("x"))
    problem = GemmProblem(1, m, n, k, "bfloat16", "bfloat16")
    xla_ms, _ = time_kernel(problem, "xla", device, args.iters)
    heuristic = small_m_heuristic(problem, device.num_sms)
    rows = []
    for config in small_m_candidates(problem, device.num_sms):
      try:
        ms, _ = time_kernel(problem, "mosaic/small_m", device, args.iters,
                            config=config)
      except Exception as e:  # noqa: BLE001 - report and go on
        print(f"{text} {config}: {type(e).__name__}: {e}"[:200], flush=True)
        continue
      rows.append((ms, config))
      ctas = -(-n // config.tile_n) * config.k_splits
      print(f"{text:<14} tile_n={config.tile_n:<4} k_splits={config.k_splits}"
            f" stages={config.max_concurrent_steps} ctas={ctas:<4} "
            f"{xla_ms / ms:6.3f}x xla"
            f"{'  <- heuristic' if config == heuristic else ''}", flush=True)
    if rows:
      best_ms, best = min(rows, key=lambda r: r[0])
      print(f"{text:<14} best {xla_ms / best_ms:.3f}x xla: tile_n="
            f"{best.tile_n} k_splits={best.k_splits} stages="
            f"{best.max_concurrent_steps}", flush=True)


if __name__ == "__main__":
  main()
