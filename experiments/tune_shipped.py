"""Tunes kernels over a shape suite on this GPU and updates the shipped defaults.

    PYTHONPATH=. python3 experiments/tune_shipped.py \
        --kernels=mosaic/ws_persistent,triton/06_tuned --suite=large \
        --dtypes=bfloat16 --max_candidates=6 --out=$OUT

For each (kernel, shape, dtype) it times the first `--max_candidates` configs
of the kernel's registered search space with `pallas_gemm.autotune.tune`
(CUPTI, median of `--iters`, normal inputs), then merges the winners into
`pallas_gemm/tuned/<device>.json`, the defaults the package ships. The heuristic
default is always among the candidates, so a shipped entry is never slower
than what a call would get without it (up to timing noise). Entries are
written only from measurements made by this script on this device.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

_REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_REPO_ROOT))

from experiments.bench.output import git_revision  # noqa: E402
from pallas_gemm import shapes  # noqa: E402


def _parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--kernels", default="mosaic/ws_persistent",
                      help="comma-separated registered kernel names")
  parser.add_argument("--suite", default="large", choices=sorted(shapes.SUITES))
  parser.add_argument("--shapes", default="",
                      help="MxNxK,... (overrides --suite)")
  parser.add_argument("--dtypes", default="bfloat16")
  parser.add_argument("--max_candidates", type=int, default=6)
  parser.add_argument("--order", default="diverse",
                      choices=("diverse", "listed"),
                      help="diverse: round-robin over tile shapes first; "
                      "listed: the search space's own order")
  parser.add_argument("--precision", default="default",
                      choices=("default", "ieee"),
                      help="ieee: exact float32 (only for --dtypes=float32)")
  parser.add_argument("--iters", type=int, default=20)
  parser.add_argument("--budget_s", type=float, default=300.0,
                      help="stop starting new problems after this long")
  parser.add_argument("--out", default="build/tune",
                      help="folder for the log JSON and the updated defaults")
  parser.add_argument("--dry_run", action="store_true",
                      help="tune nothing; print the plan (works on a CPU)")
  args = parser.parse_args(argv)
  dtypes = {d.strip() for d in args.dtypes.split(",") if d.strip()}
  if args.precision == "ieee" and dtypes != {"float32"}:
    parser.error(f"--precision=ieee needs --dtypes=float32, got "
                 f"--dtypes={args.dtypes}")
  return args


# Config fields that change the shape of the work; the rest (pipeline depth,
# tile order) are refinements. Few candidates should span the shapes first.
_SHAPE_FIELDS = ("tile_m", "tile_n", "tile_k", "wg_dimension", "block_m",
                 "block_n", "block_k", "num_warps")


def _diverse(candidates):
  """Candidates reordered round-robin over their tile shapes."""
  groups: dict[tuple, list] = {}
  for config in candidates:
    key = tuple(getattr(config, f, None) for f in _SHAPE_FIELDS)
    groups.setdefault(key, []).append(config)
  ordered, queues = [], list(groups.values())
  while queues:
    for queue in queues:
      ordered.append(queue.pop(0))
    queues = [q for q in queues if q]
  return ordered


def main(argv=None) -> int:
  args = _parse_args(argv)
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  # Tuning writes to a private cache; only the merge below touches the
  # shipped file, so a user's own cache is never mixed in.
  os.environ["PALLAS_GEMM_CACHE_DIR"] = str(out / "cache")

  import jax  # noqa: E402  (after the cache override)
  import pallas_gemm  # noqa: E402
  from pallas_gemm import autotune, registry  # noqa: E402
  from pallas_gemm.primitive import problem_from_shapes  # noqa: E402

  device = pallas_gemm.device_info()
  kernels = [k.strip() for k in args.kernels.split(",") if k.strip()]
  for kernel in kernels:
    registry.get_kernel(kernel)  # a clear error for an unknown name
  suite = (shapes.parse_shapes(args.shapes) if args.shapes
           else shapes.SUITES[args.suite])
  dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
  plan = [(kernel, shape, dtype) for kernel in kernels for shape in suite
          for dtype in dtypes]
  print(f"tuning {len(plan)} problems on {device.device_kind}, "
        f"jax {jax.__version__}", flush=True)
  if args.dry_run or not device.is_gpu:
    for item in plan:
      print("  would tune", *item)
    return 0

  log = []
  start = time.monotonic()
  for index, (kernel, (m, n, k), dtype) in enumerate(plan, 1):
    if time.monotonic() - start > args.budget_s:
      print(f"budget of {args.budget_s:.0f}s spent; {len(plan) - index + 1} "
            "problems left untuned", flush=True)
      break
    problem = problem_from_shapes(
        (1, m, k), (1, k, n), in_dtype=dtype, out_dtype=dtype,
        transpose_a=False, transpose_b=False, precision=args.precision,
        epilogue=pallas_gemm.Epilogue())
    entry = registry.get_kernel(kernel)
    reason = registry.why_unsupported(entry, problem, device)
    if reason is not None:
      print(f"[{index}/{len(plan)}] {kernel} {problem.describe()}: skipped: "
            f"{reason}", flush=True)
      continue
    heuristic = entry.default_config(problem, device)
    space = autotune.search_space(problem, kernel, device)
    if args.order == "diverse":
      space = _diverse(space)
    candidates = [heuristic] + [c for c in space if c != heuristic][
        :max(args.max_candidates - 1, 0)]
    result = autotune.tune(problem, kernel, candidates, device=device,
                           iterations=args.iters)
    default_ms = dict(
        (repr(c), ms) for c, ms in result.timings).get(repr(heuristic))
    tflops = problem.flops / (result.best_time_ms * 1e-3) / 1e12
    print(f"[{index}/{len(plan)}] {kernel} {problem.describe()}: best "
          f"{tflops:.1f} TFLOP/s ({result.best_time_ms:.4f} ms; default "
          f"{default_ms if default_ms is None else round(default_ms, 4)} ms) "
          f"{result.best}", flush=True)
    log.append(dict(kernel=kernel, problem=problem.describe(),
                    best=repr(result.best), best_ms=result.best_time_ms,
                    default_ms=default_ms, tflops=tflops,
                    timings=[(repr(c), ms) for c, ms in result.timings]))

  tuned = autotune.read_entries(autotune.cache_path(device.key))
  shipped_file = autotune.shipped_path(device.key)
  shipped = autotune.read_entries(shipped_file)
  shipped.update(tuned)
  autotune.write_entries(shipped_file, shipped)
  autotune.write_entries(out / shipped_file.name, shipped)
  (out / "tune_log.json").write_text(json.dumps(
      dict(device=device.device_kind, jax=jax.__version__,
           git=git_revision(),
           command=" ".join(sys.argv), results=log), indent=1))
  print(f"merged {len(tuned)} entries into {shipped_file} "
        f"(copy in {out / shipped_file.name})", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
