"""How well would `heuristics.small_m_cost`, with other constants, have picked
among the configs `small_m_sweep.py` measured? (No GPU: it reads sweeps.)

For each saturating SM share and per-CTA ring fill (in rings of bytes) it
has `small_m_heuristic` pick a config per problem with those constants, and
scores the pick by its measured speed over the best measured config: the
geomean and the worst over every problem of every sweep file given.

  PYTHONPATH=. python3 experiments/lab/small_m_model_fit.py \
      experiments/results/nvidia_h200/small_m_sweep/sweep.txt \
      experiments/results/nvidia_h100/small_m_sweep/sweep.txt
"""

from __future__ import annotations

import itertools
import math
import re
import sys

from pallas_gemm.mosaic_backend.heuristics import small_m_heuristic
from pallas_gemm.problem import GemmProblem

LINE = re.compile(r"(\d+x\d+x\d+)\s+tile_n=(\d+)\s+k_splits=(\d+) "
                  r"stages=(\d+) ctas=\d+\s+([\d.]+)x xla")


def read_sweeps(paths):
  """{(file, problem): {(tile_n, k_splits, stages): speed over xla}}."""
  data = {}
  for path in paths:
    with open(path) as f:
      for line in f:
        match = LINE.match(line)
        if match:
          key = (int(match.group(2)), int(match.group(3)),
                 int(match.group(4)))
          data.setdefault((path, match.group(1)), {})[key] = float(
              match.group(5))
  return data


def pick(problem, share, ring_fill, num_sms=132):
  """The package's own choice with these constants."""
  return small_m_heuristic(problem, num_sms, saturating_share=share,
                           ring_fill=ring_fill)


def main(paths):
  if not paths:
    print(__doc__)
    return 2
  data = read_sweeps(paths)
  print(f"{len(data)} problems from {len(paths)} sweep(s)")
  print("| saturating SM share | ring fill (rings) | geomean of pick / best "
        "| worst | picks not measured |")
  print("|---|---|---|---|---|")
  for share, ring_fill in itertools.product((0.75, 0.5, 0.4, 0.3),
                                            (0.0, 0.5, 1.0, 2.0)):
    logs, missing = [], 0
    for (_, text), measured in data.items():
      m, n, k = (int(v) for v in text.split("x"))
      config = pick(GemmProblem(1, m, n, k, "bfloat16", "bfloat16"), share,
                    ring_fill)
      speed = measured.get((config.tile_n, config.k_splits,
                            config.max_concurrent_steps))
      if speed is None:
        missing += 1
        continue
      logs.append(math.log(speed / max(measured.values())))
    print(f"| {share} | {ring_fill} | {math.exp(sum(logs) / len(logs)):.3f} "
          f"| {math.exp(min(logs)):.3f} | {missing} |")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
