"""Benchmark of the mixture-of-experts grouped GEMM (`pallas_gemm.ragged_dot`).

For every case of the `moe` suite (pallas_gemm/ragged_dot/arg_specs.py:
layer x group-size distribution x forward/dlhs/drhs) and every target:

  auto     pallas_gemm.ragged_dot / ragged_dot_general, automatic choice
  mosaic   the same with kernel="mosaic"
  xla      jax.lax.ragged_dot_general itself
  dense    jnp.dot of an (m, k) x (k, n) product: the same flops, no groups
  tokamax  tokamax.ragged_dot_general, when tokamax is importable
  batched  XLA's dense products for a routing known in advance, to show
           what the vendor library reaches on the same work: the even
           routing as a batched jnp.einsum, every group ceil(m / groups)
           rows (its roofline fraction scales the case's roofline by its
           flops over the case's, at most 1 % more); the one-hot weight
           gradient as one jnp.dot written into a zeroed (groups, k, n)
           output. Not run on the other cases

it reports the CUPTI median kernel time (pallas_gemm/timing.py, rotated
operand sets), TFLOP/s, the roofline time and the fraction of it reached,
and the error against float64 (rows and groups subsampled for big shapes).

Roofline time = max(flops / rate of the dense product at the same flops,
bytes of lhs + rhs + out / copy bandwidth), both measured in this process.

    python experiments/bench_moe.py --output_dir=experiments/results/nvidia_h200/moe
    python experiments/bench_moe.py --shapes=g8_,deepseek --directions=forward

On a CPU it runs the `moe_small` suite in interpret mode, as a smoke test.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import pallas_gemm  # noqa: E402
from pallas_gemm import numerics, timing  # noqa: E402
from pallas_gemm.devices import device_info  # noqa: E402
from pallas_gemm.ragged_dot import arg_specs, implementations  # noqa: E402
from pallas_gemm.ragged_dot.problem import group_bounds  # noqa: E402
from experiments.bench import output  # noqa: E402
from experiments.bench.options import add_iters_flag, op_bench_iters  # noqa: E402

TARGETS = ("auto", "mosaic", "xla", "dense", "tokamax", "batched")
#: Rows (and groups) the float64 check looks at in a big case.
_CHECKED_ROWS, _CHECKED_GROUPS = 256, 4


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--suite", choices=sorted(arg_specs.SUITES), default=None,
                      help="default: moe on a GPU, moe_small on a CPU")
  parser.add_argument("--kernels", default=",".join(TARGETS))
  parser.add_argument("--shapes", default="",
                      help="comma-separated substrings of layer names (each "
                      "must match a layer of the suite)")
  parser.add_argument("--distributions", default=",".join(arg_specs.DISTRIBUTIONS))
  parser.add_argument("--directions", default=",".join(arg_specs.DIRECTIONS))
  parser.add_argument("--dtype", default="bfloat16",
                      choices=("bfloat16", "float16", "float32"),
                      help="operands and output; float32 runs at the default "
                      "precision (TF32 allowed), as jnp.dot does")
  add_iters_flag(parser)
  parser.add_argument("--max_seconds", type=float, default=0.0,
                      help="stop starting new cases after this long (0: none)")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--output_dir", default=None)
  args = parser.parse_args(argv)
  args.kernels = _split(args.kernels, TARGETS, "--kernels")
  args.distributions = _split(args.distributions, arg_specs.DISTRIBUTIONS,
                              "--distributions")
  args.directions = _split(args.directions, arg_specs.DIRECTIONS, "--directions")
  return args


def _split(value, allowed, flag):
  items = [v for v in value.split(",") if v]
  unknown = sorted(set(items) - set(allowed))
  if unknown:
    raise SystemExit(f"{flag}: unknown {unknown}, choose from {allowed}")
  return items


def ordered_cases(args, on_gpu):
  """The issue's table first, forward before backward, then the models."""
  suite = args.suite or ("moe" if on_gpu else "moe_small")
  # A CPU run is a smoke test of the pipeline: one small layer by default.
  shapes = args.shapes or ("" if on_gpu else "small_g8_odd")
  names = [s for s in shapes.split(",") if s]
  unmatched = [s for s in names
               if not any(s in l.name for l in arg_specs.SUITES[suite])]
  if unmatched:
    raise SystemExit(
        f"--shapes: {unmatched} match no layer of the {suite!r} suite "
        f"({', '.join(l.name for l in arg_specs.SUITES[suite])}); pass "
        f"--suite for another suite's layers")
  layers = [l for l in arg_specs.SUITES[suite]
            if not names or any(s in l.name for s in names)]
  cases = arg_specs.cases(layers, args.distributions, args.directions,
                          dtype=args.dtype, seed=args.seed)
  table = {l.name for l in arg_specs.MOE_LAYERS[:3]}
  return suite, sorted(cases, key=lambda c: (
      c.layer.name not in table, c.direction != "forward",
      layers.index(c.layer), arg_specs.DIRECTIONS.index(c.direction),
      arg_specs.DISTRIBUTIONS.index(c.distribution)))


# ---------------------------------------------------------------- targets ---


@functools.lru_cache(maxsize=None)
def target_call(name, problem):
  """fn(lhs, rhs, group_sizes) for a target, or raises with why not. One
  function per (target, problem): the distributions of a layer share its
  compiled executable, as the sizes are runtime data."""
  numbers, out_dtype = problem.dimension_numbers, jnp.dtype(problem.out_dtype)
  if name in ("auto", "mosaic"):
    kernel = None if name == "auto" else "mosaic"
    return lambda l, r, s: pallas_gemm.ragged_dot_general(
        l, r, s, numbers, preferred_element_type=out_dtype, kernel=kernel)
  if name == "xla":
    return lambda l, r, s: jax.lax.ragged_dot_general(
        l, r, s, numbers, preferred_element_type=out_dtype)
  if name == "tokamax":
    import tokamax  # noqa: PLC0415 - optional
    return lambda l, r, s: tokamax.ragged_dot_general(
        l, r, s, numbers, preferred_element_type=out_dtype)
  raise ValueError(name)


def batched_rows(problem) -> int:
  """Rows per group of the `batched` target: the even routing's largest."""
  return -(-problem.m // max(problem.groups, 1))


def batched_applies(distribution, direction) -> bool:
  """Whether the `batched` target has a product for this routing."""
  return distribution == "even" or (distribution == "one_hot"
                                    and direction == "drhs")


def batched_shapes(problem, distribution):
  """(lhs, rhs) shapes of the `batched` target's operands."""
  if distribution == "one_hot":
    return problem.lhs_shape, problem.rhs_shape
  g, r = problem.groups, batched_rows(problem)
  if problem.mode == "contracting":
    return (g, r, problem.k), (g, r, problem.n)
  return (g, r, problem.k), problem.rhs_shape


@functools.lru_cache(maxsize=None)
def batched_call(problem, distribution):
  """fn(lhs, rhs) of the `batched` target: one batched product per group
  (even), or the one group's product in a zeroed output (one-hot drhs)."""
  out_dtype = jnp.dtype(problem.out_dtype)
  if distribution == "one_hot":
    return lambda l, r: jnp.zeros(problem.out_shape, out_dtype).at[0].set(
        jnp.dot(l.T, r, preferred_element_type=out_dtype))
  spec = ("grk,grn->gkn" if problem.mode == "contracting" else
          "grk,gnk->grn" if problem.transpose_rhs else "grk,gkn->grn")
  return lambda l, r: jnp.einsum(spec, l, r, preferred_element_type=out_dtype)


def batched_error(problem, distribution, lhs, rhs, out) -> float:
  """Relative error of the first group's product against float64 (columns
  subsampled for big shapes)."""
  f64 = lambda x: np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)
  if distribution == "one_hot":
    cols = slice(0, _CHECKED_ROWS)
    return numerics.relative_error(
        f64(out[0][:, cols]), f64(lhs).T @ f64(rhs[:, cols]))
  a, b = f64(lhs[0]), f64(rhs[0])
  ref = (a.T @ b if problem.mode == "contracting" else
         a @ (b.T if problem.transpose_rhs else b))
  return numerics.relative_error(f64(out[0]), ref)


def operand_sets(problem, group_sizes, count, seed):
  key = jax.random.key(seed)
  sets = []
  for i in range(count):
    k1, k2 = jax.random.split(jax.random.fold_in(key, i))
    sets.append((numerics.random_normal(k1, problem.lhs_shape, problem.in_dtype),
                 numerics.random_normal(k2, problem.rhs_shape, problem.in_dtype),
                 jnp.asarray(group_sizes)))
  return sets


def set_count(problem, on_gpu):
  if not on_gpu:
    return 1
  return max(1, min(timing.MAX_OPERAND_SETS,
                    math.ceil(2 * timing.L2_BYTES / max(problem.min_bytes, 1))))


# ------------------------------------------------------------------ check ---


def check_error(problem, lhs, rhs, sizes, out) -> float:
  """Relative error against float64 on a sample: a few non-empty groups
  (first, last and the largest), strided rows of each (rows mode) or strided
  columns of each group's (k, n) block (contracting mode), plus rows in no
  group, which must be zero. Small cases are checked whole."""
  starts, ends = group_bounds(sizes, problem.m)
  f64 = lambda x: np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)
  nonempty = np.flatnonzero(ends > starts)
  picked = sorted(set(nonempty[[0, -1]].tolist() + [int(np.argmax(sizes))])
                  ) if nonempty.size else []
  picked = picked[:_CHECKED_GROUPS]
  got, ref = [], []
  if problem.mode == "rows":
    for g in picked:
      rows = np.unique(np.linspace(starts[g], ends[g] - 1, min(
          ends[g] - starts[g], _CHECKED_ROWS)).astype(np.int64))
      w = f64(rhs[g])
      got.append(f64(jnp.asarray(out)[rows]))
      ref.append(f64(jnp.asarray(lhs)[rows]) @ (w.T if problem.transpose_rhs
                                                else w))
    outside = np.setdiff1d(np.arange(problem.m), np.arange(
        starts.min(initial=0), ends.max(initial=0)))[:_CHECKED_ROWS]
    got.append(f64(jnp.asarray(out)[outside]))
    ref.append(np.zeros((outside.size, problem.n)))
    return numerics.relative_error(np.concatenate(got), np.concatenate(ref))
  ks = np.unique(np.linspace(0, problem.k - 1, min(problem.k, _CHECKED_ROWS)
                             ).astype(np.int64))
  ns = np.unique(np.linspace(0, problem.n - 1, min(problem.n, _CHECKED_ROWS)
                             ).astype(np.int64))
  for g in picked:
    rows = slice(int(starts[g]), int(ends[g]))
    got.append(f64(jnp.asarray(out)[g][ks][:, ns]))
    ref.append(f64(jnp.asarray(lhs)[rows][:, ks]).T
               @ f64(jnp.asarray(rhs)[rows][:, ns]))
  if not picked:
    return numerics.relative_error(out, np.zeros(out.shape))
  return numerics.relative_error(np.stack(got), np.stack(ref))


# -------------------------------------------------------------------- run ---


def copy_bandwidth_tbs(on_gpu):
  """(TB/s, how): a timed copy in this process."""
  if on_gpu:
    measured = output.measure_copy_bandwidth_tbs()
    if measured is not None:
      return measured, "elementwise copy (1 GiB read + 1 GiB write), CUPTI"
    known = [v for k, v in output.KNOWN_BANDWIDTH_TBS.items()
             if k in device_info().device_kind]
    return (known[0], "known device copy rate (measuring failed)") if known else (
        None, "unknown")
  x = jnp.ones((2**22,), jnp.float32)
  ms = timing.median_time_ms(jax.jit(lambda v: v * 2), (x,), iterations=3,
                             on_gpu=False)
  return 2 * x.nbytes / (ms * 1e-3) / 1e12, "host copy, wall clock"


def measure(args):
  on_gpu = jax.default_backend() == "gpu"
  iters = op_bench_iters(args.iters, on_gpu)
  device = device_info()
  suite, cases = ordered_cases(args, on_gpu)
  out_dir = pathlib.Path(args.output_dir) if args.output_dir else (
      output._REPO_ROOT / ("experiments/results/" + device.key if on_gpu  # noqa: SLF001
                           else "build/bench") / suite)
  bandwidth, bandwidth_how = copy_bandwidth_tbs(on_gpu)
  implementations.names()  # imports the optional kernels, keeping errors
  for name, why in implementations.UNAVAILABLE.items():
    print(f"moe: implementation {name!r} unavailable: {why}", flush=True)
  metadata = {
      "command_line": " ".join(sys.argv), "device": device.device_kind,
      "device_key": device.key, "jax_version": jax.__version__,
      "git": output.git_revision(), "driver_version": output.driver_version(),
      "suite": suite, "iters": iters, "dtype": args.dtype,
      "timing": "CUPTI median" if on_gpu else "host wall clock, interpret mode "
                "(not meaningful)",
      "copy_bandwidth_tbs": bandwidth, "copy_bandwidth_how": bandwidth_how,
      "unavailable_implementations": dict(implementations.UNAVAILABLE),
      "complete": False,
      "cases_planned": len(cases),
  }
  print(f"moe: {len(cases)} cases x {args.kernels} on {device.device_kind}, "
        f"copy bandwidth {bandwidth} TB/s ({bandwidth_how})", flush=True)
  start, rows, dense_ms = time.monotonic(), [], {}
  for index, case in enumerate(cases):
    if args.max_seconds and time.monotonic() - start > args.max_seconds:
      print(f"moe: --max_seconds={args.max_seconds} reached after {index} "
            f"cases", flush=True)
      metadata["not_run"] = [c.label for c in cases[index:]]
      break
    rows.extend(run_case(case, args, iters, on_gpu, bandwidth, dense_ms))
    write(out_dir, metadata, rows)
  else:
    metadata["complete"] = True
  write(out_dir, metadata, rows)
  return rows


def run_case(case, args, iters, on_gpu, bandwidth, dense_ms):
  problem, sizes = case.problem, case.group_sizes()
  sets = operand_sets(problem, sizes, set_count(problem, on_gpu), args.seed)
  dense_key = (problem.m, problem.k, problem.n, problem.in_dtype)
  # The compute roof: timed even when "dense" is not a listed target.
  if dense_key not in dense_ms:
    dense_ms[dense_key] = time_dense(problem, on_gpu, iters, args.seed)
  roof_compute = dense_ms.get(dense_key)
  roof_memory = (problem.min_bytes / (bandwidth * 1e12) * 1e3
                 if bandwidth else None)
  roofline = max(x for x in (roof_compute, roof_memory, 0.0) if x is not None)
  results = []
  for name in args.kernels:
    if name == "batched" and not batched_applies(case.distribution,
                                                 case.direction):
      continue  # documented: no vendor product for this routing
    row = dict(case=case.label, layer=case.layer.name,
               distribution=case.distribution, direction=case.direction,
               kernel=name, m=problem.m, k=problem.k, n=problem.n,
               groups=problem.groups, flops=problem.flops,
               bytes=problem.min_bytes, roofline_ms=roofline or None,
               bound=("memory" if (roof_memory or 0) > (roof_compute or 0)
                      else "compute"))
    try:
      if name == "dense":
        ms, error = dense_ms[dense_key], None
      elif name == "batched":
        ms, error, work = time_batched(problem, case.distribution, on_gpu,
                                       iters, args.seed)
        row.update(flops=work, batched_rows=batched_rows(problem),
                   roofline_ms=(roofline * work / problem.flops
                                if roofline and problem.flops else None))
      else:
        if name == "mosaic" or name == "auto":
          chosen = pallas_gemm.ragged_dot.explain(
              *sets[0], problem.dimension_numbers, kernel=None if name == "auto"
              else "mosaic", preferred_element_type=problem.out_dtype)
          row["implementation"] = chosen.implementation
          row["why"] = chosen.reason
        call = target_call(name, problem)
        out = jax.block_until_ready(jax.jit(call)(*sets[0]))
        error = check_error(problem, sets[0][0], sets[0][1], sizes, out)
        del out
        ms = timing.time_over_sets(call, sets, iterations=iters, on_gpu=on_gpu)
    except Exception as e:  # noqa: BLE001 - recorded per target, run goes on
      row.update(status="error", error_message=f"{type(e).__name__}: "
                 f"{str(e).splitlines()[0][:300] if str(e) else ''}")
      print(f"  {case.label:48s} {name:8s} ERROR {row['error_message']}",
            flush=True)
      results.append(row)
      continue
    tolerance = numerics.tolerance(
        problem.in_dtype, "tf32" if problem.in_dtype == "float32" else "default",
        problem.out_dtype)
    target = roofline_target(case.distribution, case.direction)
    fraction = (row["roofline_ms"] / ms) if row["roofline_ms"] else None
    row.update(status="ok", time_ms=ms, tflops=row["flops"] / (ms * 1e-3) / 1e12,
               roofline_fraction=fraction, roofline_target=target,
               meets_target=None if fraction is None else fraction >= target,
               rel_error=error, tolerance=tolerance,
               correct=None if error is None else bool(error <= tolerance))
    print(f"  {case.label:48s} {name:8s} {ms * 1e3:10.1f} us "
          f"{row['tflops']:8.1f} TFLOP/s  roofline "
          f"{'n/a' if fraction is None else f'{fraction:.2f}'}  err "
          f"{'-' if error is None else f'{error:.1e}'}", flush=True)
    results.append(row)
  del sets
  return results


def roofline_target(distribution: str, direction: str) -> float:
  """Issue 18's bar: the fraction of the roofline a case's time must reach
  (the forward of even and one-hot routings 0.85, of Zipf 0.75; the
  backward products 0.75)."""
  if direction == "forward" and distribution != "zipf":
    return 0.85
  return 0.75


def _normal_pairs(key, lhs_shape, rhs_shape, dtype, count):
  """`count` (lhs, rhs) operand sets of normal values drawn from `key`."""
  return [(numerics.random_normal(jax.random.fold_in(key, 2 * i), lhs_shape,
                                  dtype),
           numerics.random_normal(jax.random.fold_in(key, 2 * i + 1),
                                  rhs_shape, dtype))
          for i in range(count)]


def time_batched(problem, distribution, on_gpu, iters, seed):
  """(ms, relative error, flops) of the `batched` target."""
  sets = _normal_pairs(jax.random.key(seed + 2),
                       *batched_shapes(problem, distribution),
                       problem.in_dtype, set_count(problem, on_gpu))
  call = batched_call(problem, distribution)
  out = jax.block_until_ready(jax.jit(call)(*sets[0]))
  error = batched_error(problem, distribution, *sets[0], out)
  del out
  ms = timing.time_over_sets(call, sets, iterations=iters, on_gpu=on_gpu)
  rows = (problem.m if distribution == "one_hot"
          else problem.groups * batched_rows(problem))
  work = 2 * rows * problem.k * problem.n
  return ms, error, work


def time_dense(problem, on_gpu, iters, seed):
  """ms of jnp.dot (m, k) x (k, n): the compute roof at these flops."""
  sets = _normal_pairs(jax.random.key(seed + 1), (problem.m, problem.k),
                       (problem.k, problem.n), problem.in_dtype,
                       set_count(problem, on_gpu))
  out_dtype = jnp.dtype(problem.out_dtype)
  return timing.time_over_sets(
      lambda a, b: jnp.dot(a, b, preferred_element_type=out_dtype), sets,
      iterations=iters, on_gpu=on_gpu)


# ----------------------------------------------------------------- output ---


def write(out_dir, metadata, rows):
  out_dir.mkdir(parents=True, exist_ok=True)
  (out_dir / "results.json").write_text(json.dumps(
      {"metadata": metadata, "results": rows}, indent=1, default=str) + "\n")
  header = ("| case | kernel | runs | time (us) | TFLOP/s | roofline (us) | "
            "bound | fraction of roofline | target | rel. error |")
  lines = [f"# moe grouped GEMM: {metadata['device']}", "",
           f"jax {metadata['jax_version']}, git {metadata['git']}, "
           f"{metadata['timing']}, copy bandwidth "
           f"{metadata['copy_bandwidth_tbs']} TB/s; "
           f"`{metadata['command_line']}`", "",
           *run_status(metadata, rows), *target_summary(rows), header,
           "|" + "---|" * 10]
  for r in rows:
    if r.get("status") != "ok":
      lines.append(f"| {r['case']} | {r['kernel']} | error: "
                   f"{r.get('error_message', '')[:120]} | | | | | | | |")
      continue
    fraction = r["roofline_fraction"]
    roof = r["roofline_ms"]
    lines.append(
        f"| {r['case']} | {r['kernel']} | {r.get('implementation', '')} | "
        f"{r['time_ms'] * 1e3:.1f} | {r['tflops']:.1f} | "
        f"{'' if not roof else f'{roof * 1e3:.1f}'} | {r['bound']} | "
        f"{'' if fraction is None else f'{fraction:.2f}'} | "
        f"{_target_cell(r)} | "
        f"{'' if r['rel_error'] is None else f'{r['rel_error']:.1e}'} |")
  (out_dir / "README.md").write_text("\n".join(lines) + "\n")


def run_status(metadata, rows) -> list[str]:
  """README lines for a run that did not time every case it planned: how
  many it did and, where --max_seconds stopped it, the cases left (to run
  again with --shapes, --distributions and --directions)."""
  planned = metadata.get("cases_planned")
  if metadata.get("complete") or planned is None:
    return []
  done = len(dict.fromkeys(r["case"] for r in rows))
  not_run = metadata.get("not_run")
  if not_run:
    return [f"**Stopped by --max_seconds after {done} of {planned} cases**; "
            f"not run: {', '.join(not_run)}.", ""]
  return [f"**Incomplete:** {done} of {planned} cases so far.", ""]


def _target_cell(row) -> str:
  """The target column: the bar, and "miss" where the case falls short."""
  met = row.get("meets_target")
  if met is None:
    return ""
  return f"{row['roofline_target']:.2f}" + ("" if met else " miss")


#: A case whose fraction of the roofline lies within this share of its
#: target is "near the line": the spread between machines of one kind, and
#: of the roofline's own anchors between runs, can move it across.
NEAR_LINE = 0.03


def target_summary(rows) -> list[str]:
  """README lines: per kernel, how many timed cases reach issue 18's
  roofline target, in all and per direction, and how many of them sit
  near the line (NEAR_LINE), where a pass count moves between runs."""
  lines = []
  for kernel in dict.fromkeys(r["kernel"] for r in rows):
    timed = [r for r in rows if r["kernel"] == kernel
             and r.get("meets_target") is not None]
    if not timed:
      continue
    counts = []
    for direction in dict.fromkeys(r["direction"] for r in timed):
      cases = [r for r in timed if r["direction"] == direction]
      counts.append(f"{direction} {sum(r['meets_target'] for r in cases)} "
                    f"of {len(cases)}")
    per_direction = ", ".join(counts)
    near = [r for r in timed
            if abs(r["roofline_fraction"] / r["roofline_target"] - 1)
            <= NEAR_LINE]
    lines.append(f"- `{kernel}`: {sum(r['meets_target'] for r in timed)} of "
                 f"{len(timed)} cases reach issue 18's roofline target "
                 f"({per_direction}); {len(near)} lie within "
                 f"{NEAR_LINE:.0%} of their target "
                 f"({sum(r['meets_target'] for r in near)} of them passing)")
  return lines + [""] if lines else []


def main(argv=None):
  rows = measure(parse_args(argv))
  failed = [r for r in rows if r.get("correct") is False]
  if failed:
    print(f"moe: {len(failed)} results outside tolerance", flush=True)
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
