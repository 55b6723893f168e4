"""Benchmark of `pallas_gemm.gated_linear_unit` on the `glu` suite.

    python experiments/bench_glu.py --output_dir=experiments/results/nvidia_h200/glu

For every shape of `pallas_gemm.gated_linear_unit.arg_specs.glu_suite()`
(LLM FFN gate/up projections at several token counts) and weight layout,
each target runs forward, and forward + backward (jax.vjp with a random
cotangent), bf16 in and out. The default layout is the pair, the form the
issue's XLA baseline is written in (--weights=fused,pair adds the fused
(k, 2, n) array):

  mosaic     gated_linear_unit(kernel="mosaic"): the fused Hopper kernel
  auto       gated_linear_unit(kernel=None): timed only where it resolves to
             something other than the mosaic target
  xla        act(x @ w_gate) * (x @ w_up) written with jnp, jitted, in the
             faster of its two forms: on the pair (w_gate, w_up), and on the
             fused (k, 2, n) array sliced (XLA runs them differently; the
             row's note gives both times), whichever layout the row is for
  two_dots   x @ w_gate and x @ w_up alone (forward only): the GEMM floor
  tokamax    tokamax.gated_linear_unit, when tokamax imports

Timing goes through `pallas_gemm.timing` only (CUPTI kernel time, median,
over operand sets rotated so that together they exceed twice L2). Every
forward output is checked against a float64 reference on a sample of rows
and columns, and every backward's dx on a sample of rows. Results are
written after each row (results.json, README.md, summary.md), so a run
stopped by its budget keeps what it measured. On a CPU the suite is two
tiny shapes in interpret mode (a smoke run: timings mean nothing).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import sys
import time

_ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
  sys.path.insert(0, str(_ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_gemm import numerics, timing  # noqa: E402
from pallas_gemm.devices import device_info  # noqa: E402
from pallas_gemm.shapes import parse_shapes  # noqa: E402
from pallas_gemm.gated_linear_unit import (GLU_ACTIVATIONS,  # noqa: E402
                                           explain, gated_linear_unit)
from pallas_gemm.gated_linear_unit.arg_specs import (GLU_SMOKE,  # noqa: E402
                                                     glu_suite)
from pallas_gemm.gated_linear_unit.problem import np_activation  # noqa: E402

from experiments.bench.cases import CPU_TIMING_NOTE  # noqa: E402
from experiments.bench.checks import _sample_indices  # noqa: E402
from experiments.bench.options import (add_iters_flag, command_line,  # noqa: E402
                                       op_bench_iters)
from experiments.bench.output import (driver_version,  # noqa: E402
                                      git_revision)
from experiments.bench.report import format_markdown_table  # noqa: E402

TARGETS = ("mosaic", "auto", "xla", "two_dots", "tokamax")
MODES = ("fwd", "fwd+bwd")
#: Rows of dx checked against float64 (each costs a row of both GEMMs).
GRAD_CHECK_ROWS = 24
#: Host memory the rotated operand sets may take on the device.
SET_MEMORY_CAP = 8 * 2**30


def _tokamax_activation(name):
  return {"silu": jax.nn.silu,
          "gelu": lambda v: jax.nn.gelu(v, approximate=True),
          "gelu_exact": lambda v: jax.nn.gelu(v, approximate=False),
          "relu": jax.nn.relu, "sigmoid": jax.nn.sigmoid,
          "identity": None}[name]


def _forward_fn(target, activation, fused):
  """The forward as f(x, weights) -> out, or None where it does not apply."""
  act = GLU_ACTIVATIONS[activation]

  def split(w):
    return (w[:, 0], w[:, 1]) if fused else w

  if target in ("mosaic", "auto"):
    kernel = "mosaic" if target == "mosaic" else None
    return lambda x, w: gated_linear_unit(x, w, activation=activation,
                                          kernel=kernel)
  if target == "xla":
    return lambda x, w: act(x @ split(w)[0]) * (x @ split(w)[1])
  if target == "two_dots":
    return lambda x, w: (x @ split(w)[0], x @ split(w)[1])
  if target == "tokamax":
    try:
      import tokamax  # noqa: PLC0415
    except ImportError:
      return None
    return lambda x, w: tokamax.gated_linear_unit(
        x, w, activation=_tokamax_activation(activation))
  raise ValueError(f"unknown target {target!r}")


def _timed_fn(forward, mode):
  if mode == "fwd":
    return lambda x, w, dy: forward(x, w)

  def forward_backward(x, w, dy):
    out, pullback = jax.vjp(forward, x, w)
    return out, pullback(dy.astype(out.dtype))
  return forward_backward


def _operand_sets(m, n, k, fused, count, seed):
  sets = []
  for i in range(count):
    keys = jax.random.split(numerics.fresh_key(seed + i), 3)
    x = numerics.random_normal(keys[0], (m, k), jnp.bfloat16)
    w = (jax.random.normal(keys[1], (k, 2, n), jnp.float32)
         / math.sqrt(k)).astype(jnp.bfloat16)
    dy = numerics.random_normal(keys[2], (m, n), jnp.bfloat16)
    sets.append((x, w if fused else (w[:, 0], w[:, 1]), dy))
  return sets


def _set_count(m, n, k, on_gpu):
  if not on_gpu:
    return 1
  set_bytes = 2 * (m * k + 2 * k * n + m * n)
  count = -(-2 * timing.L2_BYTES // set_bytes)
  return max(1, min(timing.MAX_OPERAND_SETS, count,
                    SET_MEMORY_CAP // (3 * set_bytes)))


def _f64(v):
  return np.asarray(jnp.asarray(v).astype(jnp.float32), np.float64)


def _activation_grad64(name, g64):
  """act'(g) in float64, from JAX's derivative of the activation (on the
  host, with x64 on for this computation only)."""
  with jax.enable_x64(True):
    cpu = jax.devices("cpu")[0]
    g = jax.device_put(jnp.asarray(g64, jnp.float64), cpu)
    _, pullback = jax.vjp(GLU_ACTIVATIONS[name], g)
    (grad,) = pullback(jnp.ones_like(g))
    return np.asarray(grad, np.float64)


def _forward_error(out, x, w_gate, w_up, activation, rows, cols):
  picked = jnp.take(jnp.take(out, rows, axis=0), cols, axis=1)
  x64 = _f64(jnp.take(x, rows, axis=0))
  ref = (np_activation(activation, x64 @ _f64(jnp.take(w_gate, cols, axis=1)))
         * (x64 @ _f64(jnp.take(w_up, cols, axis=1))))
  return numerics.relative_error(picked, ref)


def _dx_error(dx, x, w_gate, w_up, dy, activation, rows):
  x64 = _f64(jnp.take(x, rows, axis=0))
  wg64, wu64 = _f64(w_gate), _f64(w_up)
  gate, up = x64 @ wg64, x64 @ wu64
  dy64 = _f64(jnp.take(dy, rows, axis=0))
  d_gate = dy64 * up * _activation_grad64(activation, gate)
  d_up = dy64 * np_activation(activation, gate)
  ref = d_gate @ wg64.T + d_up @ wu64.T
  return numerics.relative_error(jnp.take(dx, rows, axis=0), ref)


def measure(case, target, mode, *, fused, activation, iters, on_gpu, seed,
            auto_same_as_mosaic):
  """One row of the results."""
  name, m, n, k = case
  row = {"model": name, "m": m, "n": n, "k": k, "target": target,
         "mode": mode, "weights": "fused" if fused else "pair",
         "activation": activation, "time_us": None, "tflops": None,
         "error": None, "status": "ok", "note": "",
         "xla_form": None}  # the xla target's faster form, pair or fused
  if target == "two_dots" and mode != "fwd":
    return None
  if target == "auto" and auto_same_as_mosaic:
    row["status"] = "same as mosaic"
    return row
  forward = _forward_fn(target, activation, fused)
  if forward is None:
    return None
  try:
    count = _set_count(m, n, k, on_gpu)
    sets = _operand_sets(m, n, k, fused, count, seed)
    fn = _timed_fn(forward, mode)
    ms = timing.time_over_sets(fn, sets, iterations=iters, on_gpu=on_gpu)
    if target == "xla":
      # The fair baseline is XLA's faster form, whichever layout the caller
      # holds: time the other form on the same values too.
      other = _timed_fn(_forward_fn("xla", activation, not fused), mode)
      other_ms = timing.time_over_sets(
          other, _operand_sets(m, n, k, not fused, count, seed),
          iterations=iters, on_gpu=on_gpu)
      layout, other_layout = ("fused", "pair") if fused else ("pair", "fused")
      times = {layout: ms, other_layout: other_ms}
      faster = min(times, key=times.get)
      row["xla_form"] = faster
      row["note"] = (f"faster XLA form: {faster} (pair "
                     f"{times['pair'] * 1e3:.1f} us, fused "
                     f"{times['fused'] * 1e3:.1f} us)")
      ms = times[faster]
    row["time_us"] = ms * 1e3
    flops = 4 * m * n * k * (3 if mode == "fwd+bwd" else 1)
    row["tflops"] = flops / (ms * 1e-3) / 1e12
    x, w, dy = sets[0]
    w_gate, w_up = (w[:, 0], w[:, 1]) if fused else w
    out = jax.jit(fn)(x, w, dy)
    rng = np.random.default_rng(seed)
    if target == "two_dots":
      row["note"] = "no gating: no check"
    elif mode == "fwd":
      row["error"] = _forward_error(out, x, w_gate, w_up, activation,
                                    _sample_indices(m, rng),
                                    _sample_indices(n, rng))
    else:
      rows = np.unique(np.concatenate(
          [rng.choice(m, min(m, GRAD_CHECK_ROWS), replace=False), [m - 1]]))
      row["error"] = _dx_error(out[1][0], x, w_gate, w_up, dy, activation,
                               rows)
    tolerance = numerics.tolerance("bfloat16", "default", "bfloat16")
    if row["error"] is not None and not row["error"] <= tolerance:
      row["status"] = f"WRONG (tolerance {tolerance})"
  except Exception as e:  # noqa: BLE001 - recorded in the results
    row["status"] = "error"
    row["note"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
  return row


def pair_with_xla(row, xla_row, case, *, fused, activation, iters, seed):
  """Times the row's target interleaved with XLA's faster form (ABBA rounds,
  `experiments/bench/timers.py`), so that the clock and power drift of a
  long run falls on both: sets row["paired_vs_xla"] and says so in its
  note. fwd+bwd runs a handful of kernels whose separate timings spread by
  a few percent from run to run; paired, their ratio does not."""
  from experiments.bench.timers import RotatingCall, time_paired_on_gpu  # noqa: PLC0415
  _, m, n, k = case
  faster_fused = xla_row["xla_form"] == "fused"
  count = _set_count(m, n, k, True)

  def rotating(target, layout_fused):
    fn = _timed_fn(_forward_fn(target, activation, layout_fused), row["mode"])
    return RotatingCall(fn, _operand_sets(m, n, k, layout_fused, count, seed),
                        on_gpu=True)

  base, timed = time_paired_on_gpu(
      rotating("xla", faster_fused), rotating(row["target"], fused),
      iters=iters, warmup=1, cap_s=10.0)
  row["paired_vs_xla"] = base.median_us / timed.median_us
  row["note"] = (row["note"] + f" paired with xla's "
                 f"{'fused' if faster_fused else 'pair'} form: "
                 f"{row['paired_vs_xla']:.3f}x over {len(timed.samples_us)} "
                 "interleaved samples").strip()


def _pair_earlier_rows(rows, xla_row, case, *, activation, iters, seed):
  """Pairs the mosaic row of xla_row's shape, layout and mode (measured
  before it: mosaic comes first in TARGETS) with xla; a failure to pair
  leaves the unpaired ratio, says why in the row's note and warns on
  stderr, and the summary counts such rows."""
  for row in rows:
    if (row["target"] == "mosaic" and row["time_us"] and xla_row["time_us"]
        and all(row[key] == xla_row[key]
                for key in ("model", "m", "weights", "mode"))):
      try:
        pair_with_xla(row, xla_row, case, fused=row["weights"] == "fused",
                      activation=activation, iters=iters, seed=seed)
      except Exception as e:  # noqa: BLE001 - the unpaired ratio stands
        why = f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"
        row["not_paired"] = why
        row["note"] = (row["note"] + f" (not paired: {why})").strip()
        print(f"WARNING: {case[0]} {row['mode']} not paired with xla "
              f"({why}); its ratio is the unpaired one", file=sys.stderr,
              flush=True)


def _speedups(rows):
  """xla time / target time per case; a row timed interleaved with xla
  (`paired_vs_xla`, paired timing) takes its ratio from those samples."""
  xla = {(r["model"], r["m"], r["weights"], r["mode"]): r["time_us"]
         for r in rows if r["target"] == "xla" and r["time_us"]}
  for r in rows:
    base = xla.get((r["model"], r["m"], r["weights"], r["mode"]))
    r["vs_xla"] = base / r["time_us"] if base and r["time_us"] else None
    if r.get("paired_vs_xla"):
      r["vs_xla"] = r["paired_vs_xla"]


def write_results(output_dir, metadata, rows, complete):
  _speedups(rows)
  output_dir.mkdir(parents=True, exist_ok=True)
  metadata = dict(metadata, complete=complete)
  (output_dir / "results.json").write_text(json.dumps(
      {"metadata": metadata, "results": rows}, indent=1, default=str) + "\n")
  header = ["model", "M", "N", "K", "weights", "mode", "target", "µs",
            "TFLOP/s", "× xla", "error", "status"]

  def fmt(v, spec):
    return "" if v is None else format(v, spec)

  body = [[r["model"], r["m"], r["n"], r["k"], r["weights"], r["mode"],
           r["target"], fmt(r["time_us"], ".1f"), fmt(r["tflops"], ".0f"),
           fmt(r.get("vs_xla"), ".3f"), fmt(r["error"], ".1e"),
           r["status"] + (f" ({r['note']})" if r["note"] else "")]
          for r in rows]
  provenance = (f"{metadata['device']}, jax {metadata['jax_version']}, git "
                f"{metadata['git']}, {metadata['date_utc']}, "
                f"`{metadata['command']}`")
  note = "" if metadata["on_gpu"] else f"\n\n> {CPU_TIMING_NOTE}"
  table = format_markdown_table(header, body)
  status = "" if complete else "\n\n(incomplete: stopped by its budget)"
  (output_dir / "README.md").write_text(
      f"# Gated linear unit: the glu suite\n\n{provenance}{note}{status}\n\n"
      f"Timing: {metadata['timing']}. `× xla`: the xla target's time over "
      "this row's (same shape, weights and mode); the xla target is the "
      "faster of XLA's pair and fused forms (its note gives both); with "
      "paired timing (on a GPU by default) the mosaic row's ratio comes "
      "from samples interleaved with that form's (its note says so). "
      "Error: relative Frobenius "
      "error against float64 on sampled rows/columns (forward) or rows of "
      "dx (fwd+bwd).\n\n" + table + "\n")
  mosaic = [r for r in rows if r["target"] == "mosaic" and r.get("vs_xla")]
  lines = [f"GLU ({metadata['device']}): mosaic vs xla (the faster of "
           "XLA's pair and fused forms), "
           f"{len(mosaic)} rows" + ("" if complete else " (incomplete)"), ""]
  for mode in MODES:
    ratios = [r["vs_xla"] for r in mosaic if r["mode"] == mode]
    if ratios:
      geo = math.exp(sum(map(math.log, ratios)) / len(ratios))
      lines.append(f"- {mode}: geomean {geo:.3f}x, min {min(ratios):.3f}x, "
                   f"max {max(ratios):.3f}x over {len(ratios)} shapes")
  failed = [r for r in rows if r["status"] not in ("ok", "same as mosaic")]
  if failed:
    lines.append(f"- {len(failed)} rows failed or were wrong: " + ", ".join(
        f"{r['target']} {r['m']}x{r['n']}x{r['k']} {r['weights']} "
        f"{r['mode']}: {r['status']} {r['note'][:80]}" for r in failed[:8]))
  unpaired = [r for r in mosaic if r.get("not_paired")]
  if unpaired:
    lines.append(f"- {len(unpaired)} rows could not be paired with xla and "
                 "keep their unpaired ratio: " + unpaired[0]["not_paired"])
  lines += ["", _acceptance_line(mosaic), ""]
  lines.append(format_markdown_table(
      ["model", "M", "N", "K", "weights", "mode", "µs", "× xla", "error"],
      [[r["model"], r["m"], r["n"], r["k"], r["weights"], r["mode"],
        fmt(r["time_us"], ".1f"), fmt(r["vs_xla"], ".3f"),
        fmt(r["error"], ".1e")] for r in mosaic]))
  (output_dir / "summary.md").write_text("\n".join(lines) + "\n")


def _required_speedup(row) -> float:
  """Issue #20's acceptance: forward >= 1.08x XLA from M = 2048 up and
  >= 1.0x below; forward + backward >= 1.03x."""
  if row["mode"] == "fwd+bwd":
    return 1.03
  return 1.08 if row["m"] >= 2048 else 1.0


def _acceptance_line(mosaic_rows) -> str:
  misses = [r for r in mosaic_rows if r["vs_xla"] < _required_speedup(r)]
  text = (f"Acceptance (fwd >= 1.08x xla at M >= 2048, >= 1.0x below; "
          f"fwd+bwd >= 1.03x): {len(mosaic_rows) - len(misses)}/"
          f"{len(mosaic_rows)} rows pass")
  if misses:
    text += "; misses: " + ", ".join(
        f"{r['m']}x{r['n']}x{r['k']} {r['weights']} {r['mode']} "
        f"{r['vs_xla']:.3f}x" for r in misses[:12])
  return text


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--output_dir", default=None)
  parser.add_argument("--targets", default=",".join(TARGETS))
  parser.add_argument("--modes", default=",".join(MODES))
  parser.add_argument("--weights", default="pair",
                      help="weight layouts: pair and/or fused (k, 2, n)")
  parser.add_argument("--activation", default="silu",
                      choices=sorted(GLU_ACTIVATIONS))
  add_iters_flag(parser)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--max_seconds", type=float,
                      default=float(os.environ.get("BUDGET_glu", 200)) - 25,
                      help="stop starting new measurements after this long")
  parser.add_argument("--max_cases", type=int, default=0,
                      help="only the first N shapes (0: all)")
  parser.add_argument("--shapes", default="",
                      help="explicit MxNxK shapes (tokens x intermediate x "
                      "hidden), comma-separated, instead of the suite: e.g. "
                      "decode batches or widths that are not 64-column "
                      "spans")
  parser.add_argument("--paired_timing", default=True,
                      action=argparse.BooleanOptionalAction,
                      help="on a GPU, time the mosaic target again "
                      "interleaved with XLA's faster form (ABBA rounds) and "
                      "take its x xla ratio from those samples")
  args = parser.parse_args(argv)
  targets = [t for t in args.targets.split(",") if t]
  modes = [m for m in args.modes.split(",") if m]
  layouts = [w for w in args.weights.split(",") if w]
  for value, allowed, flag in ((targets, TARGETS, "--targets"),
                               (modes, MODES, "--modes"),
                               (layouts, ("fused", "pair"), "--weights")):
    bad = [v for v in value if v not in allowed]
    if bad:
      parser.error(f"{flag}: {bad} not in {allowed}")
  if args.max_cases < 0:
    parser.error(f"--max_cases={args.max_cases} must be 0 (all) or more")

  device = device_info()
  on_gpu = device.is_gpu
  if args.shapes:
    try:
      cases = [("shapes", m, n, k) for m, n, k in parse_shapes(args.shapes)]
    except ValueError as e:
      parser.error(f"--shapes: {e}")
  else:
    cases = list(glu_suite()) if on_gpu else list(GLU_SMOKE)
  if args.max_cases:
    cases = cases[:args.max_cases]
  iters = op_bench_iters(args.iters, on_gpu)
  if on_gpu:
    default_dir = _ROOT / "experiments" / "results" / device.key / "glu"
  else:
    default_dir = _ROOT / "build" / "bench" / "glu"
  output_dir = pathlib.Path(args.output_dir or default_dir)
  metadata = {
      "command": command_line(sys.argv if argv is None else ["bench_glu.py",
                                                             *argv]),
      "device": device.device_kind, "device_key": device.key,
      "on_gpu": on_gpu, "driver_version": driver_version(),
      "jax_version": jax.__version__, "git": git_revision(),
      "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
      "timing": ("CUPTI kernel time via pallas_gemm.timing, median of "
                 f"{iters} calls over rotated operand sets" if on_gpu
                 else "host clock, interpret mode"),
      "input_distribution": ("x, dy ~ N(0, 1); weights ~ N(0, 1/k) (gate "
                             f"pre-activations O(1)); seed {args.seed}"),
  }
  start = time.monotonic()
  rows = []
  total = len(cases) * len(layouts) * len(modes) * len(targets)
  done = 0
  complete = True
  for case in cases:
    for layout in layouts:
      fused = layout == "fused"
      x_spec = jax.ShapeDtypeStruct((case[1], case[3]), jnp.bfloat16)
      w_spec = (jax.ShapeDtypeStruct((case[3], 2, case[2]), jnp.bfloat16)
                if fused else
                (jax.ShapeDtypeStruct((case[3], case[2]), jnp.bfloat16),) * 2)
      auto = explain(x_spec, w_spec, activation=args.activation)
      for mode in modes:
        for target in targets:
          done += 1
          if time.monotonic() - start > args.max_seconds:
            complete = False
            break
          row = measure(case, target, mode, fused=fused,
                        activation=args.activation, iters=iters,
                        on_gpu=on_gpu, seed=args.seed,
                        auto_same_as_mosaic=(auto.kernel == "mosaic"
                                             and "mosaic" in targets))
          if row is None:
            continue
          if target == "auto":
            row["note"] = (row["note"] + f" auto: {auto.kernel} "
                           f"({auto.reason})").strip()
          rows.append(row)
          if target == "xla" and on_gpu and args.paired_timing:
            _pair_earlier_rows(rows, row, case, activation=args.activation,
                               iters=iters, seed=args.seed)
          time_text = ("" if row["time_us"] is None
                       else f"{row['time_us']:9.1f} us {row['tflops']:6.0f} "
                       "TFLOP/s")
          print(f"[{done}/{total} {time.monotonic() - start:6.0f}s] "
                f"{case[0]} {case[1]}x{case[2]}x{case[3]} {layout} {mode} "
                f"{target}: {time_text} err={row['error']} {row['status']} "
                f"{row['note']}", flush=True)
          write_results(output_dir, metadata, rows, complete=False)
  write_results(output_dir, metadata, rows, complete=complete)
  print(f"wrote {output_dir} ({len(rows)} rows, "
        f"{'complete' if complete else 'stopped by --max_seconds'})")


if __name__ == "__main__":
  main()
