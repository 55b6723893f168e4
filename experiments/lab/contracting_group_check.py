"""Checks every group of a weight gradient (the "contracting" form) against
float64, under the heuristic's config and variants of it, on a GPU: which
groups come back wrong, and of what size. Written for the random sweep's
wrong draw `g37 m65536 k312 n24` (experiments/results/nvidia_h200/
random_ragged); its cases are that draw's variants.

    PYTHONPATH=. python3 experiments/lab/contracting_group_check.py

Each line: m k n groups, the config's pieces / narrow last strip / turns /
largest-first fields, the fields set over the heuristic's, the largest
relative error of a group (an empty group: its largest value), and the
groups over 2e-2 with their sizes.
"""

from __future__ import annotations

import dataclasses
import sys

import jax.numpy as jnp
import numpy as np

from pallas_gemm.devices import device_info
from pallas_gemm.ragged_dot import configs, mosaic
from pallas_gemm.ragged_dot.problem import RaggedProblem

#: The wrong draw's group sizes (seed 3, draw 37).
DRAW_SIZES = (670, 341, 46, 1056, 2376, 1605, 899, 10229, 6518, 253, 789, 176,
              487, 4476, 119, 1508, 1387, 945, 972, 1104, 376, 1611, 1327,
              564, 750, 146, 455, 169, 4268, 843, 3632, 515, 2936, 2249,
              5128, 79, 4532)

#: (m, k, n, groups, fields over the heuristic's, sizes or None: random).
CASES = [
    (65536, 312, 24, 37, {}, DRAW_SIZES),
    (65536, 312, 24, 37, dict(narrow_last_strip=False), DRAW_SIZES),
    (65536, 312, 24, 37, dict(piece_rows=0, largest_first=False), DRAW_SIZES),
    (65536, 312, 24, 37, dict(piece_rows=0, largest_first=False,
                              narrow_last_strip=False), DRAW_SIZES),
    (65536, 320, 24, 37, {}, DRAW_SIZES),
    (65536, 312, 64, 37, {}, DRAW_SIZES),
    (65536, 312, 128, 37, {}, DRAW_SIZES),
    (65536, 312, 24, 37, dict(largest_first=False), DRAW_SIZES),
    (16384, 312, 24, 8, {}, None),
    (16384, 312, 24, 8, dict(piece_rows=4096, largest_first=True), None),
    (16384, 312, 200, 8, dict(piece_rows=4096, largest_first=True), None),
    (16384, 512, 512, 8, dict(piece_rows=4096, largest_first=True), None),
    (8192, 312, 24, 1, {}, None),
]


def check(m, k, n, groups, fields, sizes, device) -> str:
  problem = RaggedProblem("contracting", m=m, k=k, n=n, groups=groups,
                          in_dtype="bfloat16", out_dtype="bfloat16")
  config = dataclasses.replace(configs.heuristic(problem, device), **fields)
  rng = np.random.default_rng(0)
  if sizes is None:
    sizes = rng.multinomial(m, rng.dirichlet(np.ones(groups)))
  sizes = np.asarray(sizes, np.int32)
  lhs = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
  dout = jnp.asarray(rng.standard_normal((m, n)), jnp.bfloat16)
  out = np.asarray(mosaic.ragged_matmul(
      lhs, dout, jnp.asarray(sizes), jnp.zeros((1,), jnp.int32),
      problem=problem, config=config).astype(jnp.float32), np.float64)
  f64 = lambda x: np.asarray(x.astype(jnp.float32), np.float64)
  a, b = f64(lhs), f64(dout)
  ends = np.cumsum(sizes)
  errors = []
  for g, (start, end) in enumerate(zip(ends - sizes, ends)):
    ref = a[start:end].T @ b[start:end]
    errors.append(np.linalg.norm(out[g] - ref) / np.linalg.norm(ref)
                  if end > start else np.abs(out[g]).max())
  errors = np.array(errors)
  bad = np.flatnonzero(errors > 2e-2)
  return (f"{m} {k} {n} {groups} piece_rows={config.piece_rows} "
          f"nls={config.narrow_last_strip} pp={config.ping_pong} "
          f"lf={config.largest_first} {fields} max err {errors.max():.1e} "
          f"bad groups {bad.tolist()[:12]} sizes of bad "
          f"{sizes[bad].tolist()[:12]}")


def main() -> int:
  device = device_info()
  if not device.is_hopper:
    raise SystemExit(f"needs a Hopper GPU (compiled kernels), this is "
                     f"{device.device_kind!r}")
  for case in CASES:
    try:
      print(check(*case, device), flush=True)
    except Exception as error:  # noqa: BLE001 - reported, run goes on
      print(f"{case[:5]} ERROR {type(error).__name__}: {str(error)[:200]}",
            flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
