"""Metadata and the files a run writes."""

from __future__ import annotations

import csv
import dataclasses
import datetime
import json
import os
import pathlib
import subprocess
import sys
from typing import Sequence

import jax
import jax.numpy as jnp

import pallas_gemm
from pallas_gemm import timing
from pallas_gemm.devices import DeviceInfo
from experiments.bench.cases import (CPU_TIMING_NOTE, FULL_CHECK_VOLUME, KNOWN_BANDWIDTH_TBS, MAX_INPUT_SETS)
from experiments.bench.options import BenchmarkOptions
from experiments.bench.runner import BenchmarkRun, Measurement
from experiments.bench.report import (regime_markdown, TABLE_COLUMNS, format_markdown_table, ladder_markdown, summary_markdown, table_cells)

_REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]


# --------------------------------------------------------------- metadata ---


def _run_quiet(argv, cwd=None) -> str | None:
  try:
    done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True,
                          timeout=20, check=False)
  except (OSError, subprocess.SubprocessError):
    return None
  return done.stdout.strip() if done.returncode == 0 else None


def git_revision() -> str:
  # A copy of the tree shipped to a GPU machine gets the revision from
  # whoever shipped it: its .git, if it has one, may be a stale snapshot.
  shipped = os.environ.get("PALLAS_GEMM_GIT_SHA")
  sha = _run_quiet(["git", "rev-parse", "--short=12", "HEAD"], cwd=_REPO_ROOT)
  dirty = sha and _run_quiet(
      ["git", "status", "--porcelain", "--untracked-files=no"],
      cwd=_REPO_ROOT)
  if shipped:
    if dirty and (sha.startswith(shipped) or shipped.startswith(sha)):
      # `PALLAS_GEMM_GIT_SHA=$(git rev-parse HEAD)` run on the GPU machine
      # reads the copy's stale .git, not the commit that was shipped.
      _warn_once(f"PALLAS_GEMM_GIT_SHA={shipped} names this copy's .git "
                 "HEAD, but the tree differs from it: that .git is probably "
                 "stale; compute the sha where the tree was shipped from")
    return shipped
  if not sha:
    return "n/a"
  if dirty:
    # On a GPU machine this is usually the shipped copy's stale .git, whose
    # sha names an older commit than the tree that ran.
    _warn_once(f"results are labelled git {sha}-dirty: the tree differs from "
               "its .git's HEAD; set PALLAS_GEMM_GIT_SHA to the commit that "
               "was shipped")
  return sha + ("-dirty" if dirty else "")


_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
  if message not in _WARNED:
    _WARNED.add(message)
    print(f"warning: {message}", file=sys.stderr)


def driver_version() -> str:
  out = _run_quiet(["nvidia-smi", "--query-gpu=driver_version",
                    "--format=csv,noheader"])
  return out.splitlines()[0].strip() if out else "n/a"


def collect_metadata(run: BenchmarkRun) -> dict:
  import jaxlib  # noqa: PLC0415
  opts = run.options
  return {
      "device": run.device.device_kind,
      "device_key": run.device.key,
      "platform": "cpu (interpret mode)" if not run.on_gpu else run.device.platform,
      "compute_capability": run.device.compute_capability,
      "num_sms": run.device.num_sms,
      "driver_version": driver_version(),
      "jax_version": jax.__version__,
      "jaxlib_version": getattr(jaxlib, "__version__", None)
      or jaxlib.version.__version__,
      "pallas_gemm_version": pallas_gemm.__version__,
      "git": git_revision(),
      "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(
          timespec="seconds"),
      "input_distribution": (
          "standard normal N(0, 1) from jax.random.normal in float32, cast to "
          f"the input dtype; seed {opts.seed}; timing rotates over several "
          "input sets (2 on a CPU, enough to exceed 2x a 60 MB L2 on a GPU, "
          f"at most {MAX_INPUT_SETS})"),
      "timing": ("CUPTI kernel time, median of the timed iterations"
                 if run.on_gpu else CPU_TIMING_NOTE),
      "check": ("relative Frobenius error against a float64 NumPy reference; "
                f"full when M*N*K <= {FULL_CHECK_VOLUME}, else a strided "
                "sample of rows and columns"),
      "suite": opts.suite,
      "iters": opts.iters,
      "warmup": opts.warmup,
      "autotune": opts.autotune,
      "command_line": opts.command_line,
      "backend_errors": pallas_gemm.backend_errors(),
  }


# ----------------------------------------------------------------- output ---


def default_output_dir(options: BenchmarkOptions, device: DeviceInfo,
                       on_gpu: bool) -> pathlib.Path:
  if on_gpu:
    return _REPO_ROOT / "experiments" / "results" / device.key / options.suite
  return _REPO_ROOT / "build" / "bench" / options.suite


def roofline_bandwidth(device_kind: str, *, measure: bool):
  """The memory roof: the higher of an elementwise copy measured now and the
  device-to-device copy rate known for this GPU type.

  XLA's elementwise copy reads and writes at once and lands below what a
  kernel that only streams reads achieves (3.4 vs 4.1 TB/s on an H200), so a
  roof from it alone would sit under real data points.
  """
  candidates = []
  if measure:
    measured = measure_copy_bandwidth_tbs()
    if measured is not None:
      candidates.append((measured, "elementwise copy measured now"))
  for name, value in KNOWN_BANDWIDTH_TBS.items():
    if name in device_kind:
      candidates.append((value, "device-to-device copy on this GPU type"))
  if not candidates:
    return None, "unknown"
  return max(candidates)


def measure_copy_bandwidth_tbs() -> float | None:
  """Device copy bandwidth, read + write counted: the fastest of a few
  elementwise passes over 1 GiB (bf16 and f32 scaling, a uint32 xor), each
  CUPTI-timed. The fastest is kept because a roofline must not be slower
  than what the memory can do: a single kind of pass can fall short of it
  (a narrow dtype issues more, smaller loads)."""
  passes = (
      (jnp.bfloat16, lambda v: v * 2),
      (jnp.float32, lambda v: v * 2),
      (jnp.uint32, lambda v: v ^ jnp.uint32(0x5A5A5A5A)),
  )
  best = None
  for dtype, fn in passes:
    try:
      x = jnp.ones((2**30 // jnp.dtype(dtype).itemsize,), dtype)
      ms = timing.median_time_ms(jax.jit(fn), (x,), iterations=10, on_gpu=True)
      del x
    except Exception:  # noqa: BLE001 - the roofline falls back to known ceilings
      continue
    rate = 2 * 2**30 / (ms * 1e-3) / 1e12
    best = rate if best is None else max(best, rate)
  return best


class ResumeError(ValueError):
  """--resume found results that this run cannot continue."""


def load_earlier_run(output_dir: pathlib.Path, metadata: dict
                     ) -> tuple[list[Measurement], list[str]]:
  """For --resume: the rows of output_dir's results.json and the dates of
  the runs that measured them (none where there is no such file); a
  ResumeError naming --resume where it was written by another git revision
  or on another device, whose rows would not compare with this run's."""
  path = output_dir / "results.json"
  if not path.exists():
    return [], []
  data = json.loads(path.read_text())
  earlier = data.get("metadata", {})
  for key in ("git", "device", "suite", "jax_version"):
    if earlier.get(key) != metadata.get(key):
      raise ResumeError(
          f"--resume: {path} has {key}={earlier.get(key)!r}, this run "
          f"{metadata.get(key)!r}; its rows would not compare with this "
          "run's (use another --output_dir, or drop --resume)")
  names = {f.name for f in dataclasses.fields(Measurement)}
  rows = [Measurement(**{k: v for k, v in record.items() if k in names})
          for record in data.get("results", [])]
  resumed = earlier.get("resumed") or {}
  dates = list(resumed.get("earlier_dates_utc", [])) + [earlier.get("date_utc")]
  return rows, dates


def write_records(output_dir: pathlib.Path, metadata: dict,
                  rows: Sequence[Measurement]) -> list[pathlib.Path]:
  """results.csv and results.json. Also called after every row, so that a
  run killed half-way (a timeout, a hung kernel) leaves what it measured."""
  output_dir.mkdir(parents=True, exist_ok=True)
  records = [dataclasses.asdict(r) for r in rows]
  csv_path = output_dir / "results.csv"
  with csv_path.open("w", newline="") as f:
    for key in ("device", "driver_version", "jax_version", "jaxlib_version",
                "git", "date_utc", "input_distribution", "timing",
                "command_line", "complete"):
      f.write(f"# {key}: {metadata[key]}\n")
    writer = csv.DictWriter(f, fieldnames=[fl.name for fl in
                                           dataclasses.fields(Measurement)])
    writer.writeheader()
    writer.writerows(records)
  json_path = output_dir / "results.json"
  json_path.write_text(json.dumps({"metadata": metadata, "results": records},
                                  indent=1, default=str) + "\n")
  return [csv_path, json_path]


def write_outputs(run: BenchmarkRun, output_dir: pathlib.Path,
                  metadata: dict) -> list[pathlib.Path]:
  rows = run.rows
  records = [dataclasses.asdict(r) for r in rows]
  written = write_records(output_dir, metadata, rows)

  provenance = (f"{metadata['device']}, jax {metadata['jax_version']}, "
                f"git {metadata['git']}, {metadata['date_utc']}, "
                f"`{metadata['command_line']}`")
  note = "" if run.on_gpu else f"\n\n> {CPU_TIMING_NOTE}"
  body = [table_cells(r) for r in rows]
  md_path = output_dir / "results.md"
  md_path.write_text(f"Results: {provenance}{note}\n\n"
                     + format_markdown_table(TABLE_COLUMNS, body) + "\n")
  written.append(md_path)

  summary_path = output_dir / "summary.md"
  summary_path.write_text(summary_markdown(rows, metadata["device"])
                          + f"\n<sub>{provenance}</sub>{note}\n")
  written.append(summary_path)

  regimes = regime_markdown(rows, metadata["device"])
  if regimes:
    regime_path = output_dir / "regimes.md"
    regime_path.write_text(regimes + f"\n<sub>{provenance}</sub>{note}\n")
    written.append(regime_path)

  if run.options.suite == "ladder":
    ladder_path = output_dir / "ladder.md"
    ladder_path.write_text(ladder_markdown(rows, metadata["device"])
                           + f"\n<sub>{provenance}</sub>{note}\n")
    written.append(ladder_path)

  if run.options.plot:
    from experiments.bench import plotting  # noqa: PLC0415 - matplotlib is optional
    timing_kind = "CUPTI" if run.on_gpu else "interpret mode, not meaningful"
    title = (f"{metadata['device']} — suite {run.options.suite} "
             f"({timing_kind}) — git {metadata['git']}")
    png = output_dir / "tflops.png"
    if plotting.plot_tflops_vs_size(records, str(png), title=title):
      written.append(png)
    if run.options.suite == "decode":
      bandwidth, source = roofline_bandwidth(
          run.device.device_kind, measure=run.on_gpu)
      peaks = {case.label: run._peak(case) for case in run.options.dtype_cases}
      png = output_dir / "roofline.png"
      if plotting.plot_roofline(records, str(png), title="Roofline: " + title,
                                bandwidth_tbs=bandwidth,
                                bandwidth_source=source, peaks=peaks):
        written.append(png)
  return written
