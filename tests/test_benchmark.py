"""The benchmark script: flags, a tiny CPU run, the pre-timing check, parsing,
the ladder grouping and the README splicer. CPU only, well under a minute."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from experiments import benchmark, update_readme
from experiments.bench import cases as bench_cases
from experiments.bench import checks as bench_checks
from experiments.bench import options as bench_options
from experiments.bench import report as bench_report
from experiments.bench import runner as bench_runner
from experiments.bench import output as bench_output
from experiments.bench import targets as bench_targets
from experiments.bench import timers as bench_timers
import pallas_gemm
from pallas_gemm import numerics, registry

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = REPO_ROOT / "experiments" / "benchmark.py"
OUR_FLAGS = ("kernels", "skip_kernels", "dtypes", "f32_precisions", "suite", "shapes",
             "layouts", "iters", "warmup", "output_dir", "plot", "autotune",
             "max_candidates", "interpret", "seed", "strict", "time_budget_s",
             "max_seconds_per_measurement")


def _run_script(*args, timeout=240):
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
  return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=REPO_ROOT,
                        env=env, capture_output=True, text=True,
                        timeout=timeout, check=False)


def test_helpfull_lists_every_flag():
  done = _run_script("--helpfull", timeout=120)
  text = done.stdout + done.stderr
  # absl prints the help and exits with status 1 by design.
  assert "Traceback" not in text, text[-2000:]
  for name in OUR_FLAGS:
    assert f"--{name}" in text or f"--[no]{name}" in text, name


def _png_is_not_blank(path: pathlib.Path) -> None:
  import matplotlib.image as mpimg  # noqa: PLC0415
  pixels = mpimg.imread(str(path))
  assert pixels.ndim == 3 and pixels.shape[0] > 100 and pixels.shape[1] > 100
  rgb = pixels[..., :3].reshape(-1, 3)
  assert rgb.std() > 0.05
  # Lines in several colours, not one flat fill with a frame.
  assert len(np.unique(np.round(rgb * 255).astype(np.uint8), axis=0)) > 20


def test_tiny_cpu_run_writes_csv_json_and_png(tmp_path):
  done = _run_script(
      "--kernels=xla,triton/02_k_loop", "--shapes=32x48x40,17x5x33",
      "--dtypes=float32", "--f32_precisions=ieee", "--iters=2", "--warmup=1",
      f"--output_dir={tmp_path}")
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  assert "interpret mode" in done.stdout and "not meaningful" in done.stdout
  for name in ("results.csv", "results.json", "results.md", "summary.md",
               "tflops.png"):
    assert (tmp_path / name).is_file(), name

  data = json.loads((tmp_path / "results.json").read_text())
  meta = data["metadata"]
  for key in ("device", "driver_version", "jax_version", "jaxlib_version",
              "git", "date_utc", "input_distribution", "command_line"):
    assert meta[key], key
  assert "--shapes=32x48x40,17x5x33" in meta["command_line"]
  assert meta["complete"] is True
  rows = data["results"]
  assert {(r["kernel"], r["shape"]) for r in rows} == {
      ("xla", "32x48x40"), ("triton/02_k_loop", "32x48x40"),
      ("xla", "17x5x33"), ("triton/02_k_loop", "17x5x33")}
  for row in rows:
    assert row["status"] == "OK", row
    assert row["us"] > 0 and row["tflops"] > 0
    assert row["rel_error"] <= row["tolerance"]
  xla_rows = [r for r in rows if r["kernel"] == "xla"]
  assert all(r["vs_jnp_dot"] == pytest.approx(1.0) for r in xla_rows)

  csv_lines = [line for line in (tmp_path / "results.csv").read_text().splitlines()
               if not line.startswith("#")]
  assert csv_lines[0].startswith("kernel,shape,")
  assert len(csv_lines) == 1 + len(rows)
  _png_is_not_blank(tmp_path / "tflops.png")


BROKEN_NAME = "test/skips_last_k_tile"
DROPPED_TILE = 32


def _skips_last_k_tile(a, b, c, bias, *, problem, config, interpret):
  """op(a) @ op(b) over all but the last K tile: wrong whenever K is not a
  multiple of the tile plus one."""
  del c, bias, config, interpret
  kept = ((problem.k - 1) // DROPPED_TILE) * DROPPED_TILE
  a_op = jnp.swapaxes(a, 1, 2) if problem.transpose_a else a
  b_op = jnp.swapaxes(b, 1, 2) if problem.transpose_b else b
  acc = jnp.einsum("bmk,bkn->bmn", a_op[:, :, :kept], b_op[:, :kept, :],
                   preferred_element_type=jnp.float32)
  return acc.astype(problem.out_dtype)


@pytest.fixture
def broken_kernel():
  registry.register(registry.KernelEntry(
      name=BROKEN_NAME, fn=_skips_last_k_tile,
      supports=lambda problem, device: None,
      heuristic=lambda problem, device: None,
      runs_on_cpu=True, description="drops the last K tile (test only)"))
  try:
    yield BROKEN_NAME
  finally:
    registry.unregister(BROKEN_NAME)


def test_broken_kernel_is_failed_and_never_timed(broken_kernel, tmp_path):
  options = bench_options.BenchmarkOptions(
      kernels=bench_targets.resolve_kernels([broken_kernel]),
      shapes=((33, 20, 100),), suite="custom",
      dtype_cases=(bench_cases.DtypeCase("float32", "ieee"),),
      layouts=("NN", "TN"), iters=2, warmup=0, output_dir=str(tmp_path),
      plot=False, interpret=True)
  timed = []
  lines = []
  run = benchmark.run_benchmark(
      options, log=lines.append,
      on_timing=lambda kernel, problem: timed.append((kernel, problem.layout)))
  by_kernel = {(r.kernel, r.layout): r for r in run.rows}
  for layout in ("NN", "TN"):
    broken = by_kernel[(broken_kernel, layout)]
    assert broken.status == "FAILED"
    assert "wrong result" in broken.reason
    assert broken.rel_error > broken.tolerance
    assert broken.us is None and broken.tflops is None
    assert by_kernel[("xla", layout)].status == "OK"
  assert timed == [("xla", "NN"), ("xla", "TN")]
  assert any("FAILED" in line and broken_kernel in line for line in lines)


def test_an_interrupted_run_still_writes_what_it_measured(tmp_path):
  options = bench_options.BenchmarkOptions(
      kernels=("xla",), shapes=((8, 8, 8), (16, 8, 8)), suite="custom",
      dtype_cases=(bench_cases.DtypeCase("float32", "ieee"),), iters=1,
      warmup=0, output_dir=str(tmp_path), plot=False, interpret=True)
  timed = []

  def stop_on_second(kernel, problem):
    timed.append(kernel)
    if len(timed) == 2:
      raise SystemExit(143)  # what SIGTERM from `timeout` turns into

  with pytest.raises(SystemExit):
    benchmark.run_benchmark(options, log=lambda line: None,
                            on_timing=stop_on_second)
  data = json.loads((tmp_path / "results.json").read_text())
  assert data["metadata"]["complete"] is False
  assert [r["shape"] for r in data["results"]] == ["8x8x8"]
  assert (tmp_path / "summary.md").is_file()


def test_resume_measures_only_what_an_earlier_run_left(tmp_path):
  """--resume: a run stopped after its first problem, then resumed, times
  only the second and writes both; results from another revision are
  refused, naming the flag."""
  options = bench_options.BenchmarkOptions(
      kernels=("xla",), shapes=((8, 8, 8), (16, 8, 8)), suite="custom",
      dtype_cases=(bench_cases.DtypeCase("float32", "ieee"),), iters=1,
      warmup=0, output_dir=str(tmp_path), plot=False, interpret=True,
      resume=True)
  timed = []

  def stop_on_second(kernel, problem):
    timed.append(problem.m)
    if len(timed) == 2:
      raise SystemExit(143)

  with pytest.raises(SystemExit):
    benchmark.run_benchmark(options, log=lambda line: None,
                            on_timing=stop_on_second)
  timed.clear()
  run = benchmark.run_benchmark(options, log=lambda line: None,
                                on_timing=lambda k, p: timed.append(p.m))
  assert timed == [16]
  assert [(r.shape, r.status) for r in run.rows] == [("8x8x8", "OK"),
                                                     ("16x8x8", "OK")]
  data = json.loads((tmp_path / "results.json").read_text())
  assert data["metadata"]["complete"] is True
  assert data["metadata"]["resumed"]["rows"] == 1
  assert len(data["results"]) == 2
  data["metadata"]["git"] = "0000000"
  (tmp_path / "results.json").write_text(json.dumps(data))
  with pytest.raises(ValueError, match="--resume"):
    benchmark.run_benchmark(options, log=lambda line: None)


def test_unsupported_problem_is_skipped_with_the_kernels_reason(tmp_path):
  options = bench_options.BenchmarkOptions(
      kernels=("xla", "jax_hopper"), shapes=((16, 16, 16),), suite="custom",
      dtype_cases=(bench_cases.DtypeCase("bfloat16", "default"),),
      iters=1, warmup=0, output_dir=str(tmp_path), plot=False, interpret=True)
  run = benchmark.run_benchmark(options, log=lambda line: None)
  hopper = next(r for r in run.rows if r.kernel == "jax_hopper")
  assert hopper.status == "SKIPPED" and "Hopper" in hopper.reason


@pytest.mark.parametrize("entry, bad", [
    ("64x64x64,12x7", "12x7"),
    ("64xAx64", "64xAx64"),
    ("0x4x4", "0x4x4"),
])
def test_shape_parsing_errors_name_the_bad_entry(entry, bad):
  with pytest.raises(ValueError, match=bad):
    bench_cases.parse_shape_list([entry])


def test_shape_parsing_accepts_lists():
  assert bench_cases.parse_shape_list(["1x2x3", "4X5X6"]) == ((1, 2, 3), (4, 5, 6))


def test_other_parsing_errors_name_the_bad_entry():
  with pytest.raises(ValueError, match="int8"):
    bench_cases.parse_dtypes(["bfloat16", "int8"], ["ieee"])
  with pytest.raises(ValueError, match="'NX'"):
    bench_cases.parse_layouts(["NN", "NX"])
  with pytest.raises(ValueError, match="nothing/"):
    bench_targets.resolve_kernels(["nothing/*"])
  with pytest.raises(ValueError, match="nope"):
    bench_cases.suite_shapes("nope")
  kept = bench_targets.resolve_kernels(["all"], ["triton/0[1-4]*", "none/*", "xla"])
  assert kept[0] == "xla" and "jax_hopper" in kept
  assert not any(k.startswith(("triton/01", "triton/04")) for k in kept)
  cases = bench_cases.parse_dtypes(["f32", "bf16", "tf32"], ["ieee", "tf32"])
  assert [c.label for c in cases] == ["float32/ieee", "float32/tf32", "bfloat16"]


def test_sampled_check_covers_edges_and_every_tile():
  rng = np.random.default_rng(0)
  rows = bench_checks._sample_indices(16384, rng)
  assert rows[0] == 0 and rows[-1] == 16383
  assert len(set(rows // 128)) == 16384 // 128
  assert list(bench_checks._sample_indices(100, rng)) == list(range(100))


def test_ladder_groups_and_gains():
  assert bench_report.ladder_group("triton/02_k_loop") == "triton"
  assert bench_report.ladder_group("ffi/sgemm_03_smem_tiled") == "ffi"
  assert bench_report.ladder_group("mosaic/ws_persistent") == "mosaic"

  def row(kernel, tflops):
    return bench_runner.Measurement(
        kernel=kernel, shape="4096x4096x4096", m=4096, n=4096, k=4096,
        dtype="bfloat16", precision="default", dtype_label="bfloat16",
        out_dtype="bfloat16", layout="NN", status="OK", tflops=tflops,
        pct_peak=tflops / 9.89, config="-")
  table = bench_report.ladder_markdown(
      [row("xla", 700.0), row("triton/02_k_loop", 100.0),
       row("triton/01_naive", 10.0), row("triton/03_pipelined", 250.0),
       row("ffi/mma_sync", 300.0), row("ffi/sgemm_02_coalesced", 2.0)],
      "NVIDIA H200")
  lines = [line for line in table.splitlines() if line.startswith("| triton")]
  assert [line.split("|")[1].strip() for line in lines] == [
      "triton/01_naive", "triton/02_k_loop", "triton/03_pipelined"]
  assert "10.00x" in lines[1] and "2.50x" in lines[2]
  assert "jnp.dot (reference)" in table
  ffi = [line.split("|")[1].strip() for line in table.splitlines()
         if line.startswith("| ffi")]
  assert ffi == ["ffi/sgemm_02_coalesced", "ffi/mma_sync"]  # numbered first
  assert table.index("**triton**") < table.index("**ffi**")


def test_update_readme_splices_between_markers(tmp_path):
  results = tmp_path / "results"
  (results / "large").mkdir(parents=True)
  (results / "ladder").mkdir()
  (results / "large" / "summary.md").write_text("| a | b |\n|---|---|\n| 1 | 2 |\n")
  (results / "large" / "results.json").write_text("{}")
  (results / "ladder" / "ladder.md").write_text("ladder table\n")
  # A backend's own notes folder has a summary.md but no benchmark results.
  (results / "mosaic").mkdir()
  (results / "mosaic" / "summary.md").write_text("sweep notes\n")
  readme = tmp_path / "README.md"
  readme.write_text("intro\n<!-- BEGIN:results -->\nold\n<!-- END:results -->\n"
                    "mid\n<!-- BEGIN:ladder -->\nold\n<!-- END:ladder -->\nend\n")
  lines = []
  assert update_readme.update(readme, results, out=_Sink(lines)) == 0
  text = readme.read_text()
  assert "old" not in text and "| 1 | 2 |" in text and "ladder table" in text
  assert text.startswith("intro\n") and text.endswith("end\n")
  assert "Suite `large`" in text and "sweep notes" not in text
  # Running twice gives the same README.
  assert update_readme.update(readme, results, out=_Sink(lines)) == 0
  assert readme.read_text() == text


def test_update_readme_without_markers_prints_and_fails(tmp_path):
  results = tmp_path / "results"
  (results / "large").mkdir(parents=True)
  (results / "large" / "summary.md").write_text("the table\n")
  (results / "large" / "results.json").write_text("{}")
  readme = tmp_path / "README.md"
  readme.write_text("no markers here\n")
  lines = []
  assert update_readme.update(readme, results, out=_Sink(lines)) == 2
  printed = "".join(lines)
  assert "the table" in printed and "BEGIN:results" in printed
  assert readme.read_text() == "no markers here\n"


class _Sink:
  """A file-like object collecting what update_readme prints."""

  def __init__(self, lines):
    self.lines = lines

  def write(self, text):
    self.lines.append(text)

  def flush(self):
    pass


def test_gpu_timing_path_falls_back_to_a_host_clock_without_cupti():
  """The rotated-call/CUPTI path, run on a CPU where CUPTI is missing."""
  problem = bench_checks.make_problem((64, 48, 32),
                                   bench_cases.DtypeCase("float32", "ieee"), "NT")
  sets = bench_checks.make_input_sets(problem, 3, seed=0)
  call = bench_timers.RotatingCall(bench_targets._build_jnp_dot(problem, None), sets,
                                on_gpu=True)
  reference = bench_checks.build_reference(problem, *sets[0], seed=0)
  out = call.first_output()
  assert out.shape == (64, 48)
  assert numerics.relative_error(reference.select(out),
                                           reference.reference) < 1e-5
  timing = bench_timers.time_on_gpu(call, iters=4,
                                 warmup=1, cap_s=5.0)
  assert len(timing.samples_us) == 4 and timing.median_us > 0
  assert timing.method == "cupti" or timing.method.startswith("host-clock")


def _rotating(problem, build, sets):
  return bench_timers.RotatingCall(build(problem, None), sets, on_gpu=True)


def test_paired_timing_interleaves_baseline_and_kernel(monkeypatch):
  """ABBA rounds: both calls get `iters` samples, in alternating order."""
  problem = bench_checks.make_problem((32, 24, 16),
                                      bench_cases.DtypeCase("float32", "ieee"), "NN")
  sets = bench_checks.make_input_sets(problem, 2, seed=0)
  base = _rotating(problem, bench_targets._build_jnp_dot, sets)
  other = _rotating(problem, bench_targets._build_jnp_dot, sets)
  order = []

  def fake_samples(call, iters):
    order.append(("base" if call is base else "other", iters))
    return [1.0 if call is base else 2.0] * iters
  monkeypatch.setattr(bench_timers, "_cupti_samples_us", fake_samples)
  base_t, other_t = bench_timers.time_paired_on_gpu(
      base, other, iters=10, warmup=0, cap_s=0)
  assert len(base_t.samples_us) == len(other_t.samples_us) == 10
  assert base_t.median_us / other_t.median_us == 0.5
  assert [who for who, _ in order] == ["base", "other", "other", "base"] * 2
  assert sum(n for _, n in order) == 20


def test_same_program_finds_jnp_dots_own_program():
  """kernel='xla' compiles to jnp.dot's program; a Pallas kernel does not."""
  problem = bench_checks.make_problem((64, 48, 32),
                                      bench_cases.DtypeCase("bfloat16", "default"), "NN")
  sets = bench_checks.make_input_sets(problem, 2, seed=0)
  base = _rotating(problem, bench_targets._build_jnp_dot, sets)
  xla = bench_timers.RotatingCall(
      lambda a, b: pallas_gemm.matmul(a, b, kernel="xla"), sets, on_gpu=True)
  triton = bench_timers.RotatingCall(
      lambda a, b: pallas_gemm.matmul(a, b, kernel="triton/06_tuned"),
      sets, on_gpu=True)
  assert bench_timers.same_program(base, xla)
  assert not bench_timers.same_program(base, triton)


def test_sampled_reference_catches_a_wrong_edge(monkeypatch):
  monkeypatch.setattr(bench_checks, "FULL_CHECK_VOLUME", 1000)
  problem = bench_checks.make_problem((400, 350, 20),
                                   bench_cases.DtypeCase("float32", "ieee"), "TN")
  (a, b), = bench_checks.make_input_sets(problem, 1, seed=1)
  reference = bench_checks.build_reference(problem, a, b, seed=1)
  assert reference.sampled
  good = bench_targets._build_jnp_dot(problem, None)(a, b)
  error = numerics.relative_error(reference.select(good),
                                            reference.reference)
  assert error < 1e-5
  last_row_lost = good.at[-1, :].set(jnp.nan)
  assert numerics.relative_error(
      reference.select(last_row_lost), reference.reference) == float("inf")


def test_roofline_roof_is_never_below_the_known_copy_rate():
  bandwidth, source = bench_output.roofline_bandwidth("NVIDIA H200", measure=False)
  assert bandwidth == 4.3 and "device-to-device" in source
  assert bench_output.roofline_bandwidth("cpu", measure=False) == (None, "unknown")


def test_replot_redraws_from_results_json(tmp_path):
  import shutil
  from experiments.lab import replot
  source = pathlib.Path(__file__).parents[1] / "experiments/results/nvidia_h200/decode"
  if not (source / "results.json").is_file():
    pytest.skip("no committed decode results")
  shutil.copy(source / "results.json", tmp_path / "results.json")
  written = replot.replot(tmp_path)
  assert {p.name for p in written} == {"tflops.png", "roofline.png"}
  for path in written:
    assert path.stat().st_size > 10_000


def _ncu_csv(rows):
  header = ["Address", "Source", "Warp Stall Sampling (All Samples)",
            "Instructions Executed", "stall_barrier", "stall_dispatch",
            "stall_barrier (Not Issued)"]
  lines = ['"Kernel Name","tuned"', ",".join(f'"{h}"' for h in header)]
  lines += [",".join(f'"{v}"' for v in row) for row in rows]
  return "\n".join(lines) + "\n"


def test_ncu_sass_digest_counts_opcodes_and_stalls(tmp_path):
  import gzip
  from experiments.lab import ncu_sass_digest
  rows = [("0x0", "      FFMA R1, R2, R3, R1", "30", "1000", "0", "20", "0"),
          ("0x10", "      @!PT  LDS RZ, [RZ]", "60", "100", "50", "0", "9"),
          ("0x20", "      HGMMA.64x256x16.F32.BF16 R24, gdesc[UR4], R24",
           "10", "100", "0", "5", "0")]
  path = tmp_path / "case.sass.csv.gz"
  with gzip.open(path, "wt") as f:
    f.write(_ncu_csv(rows))
  text = ncu_sass_digest.digest(str(path))
  assert "kernel tuned, 3 SASS instructions, 1,200 warp instructions" in text
  assert "FFMA" in text and "83.3 %" in text        # 1000 of 1200
  assert any(line.split()[:1] == ["LDS"] for line in text.splitlines())
  assert "barrier           50.0 %" in text          # 50 of 100 samples
  assert "HGMMA.64x256x16.F32.BF16" in text.splitlines()[-1]


def test_ncu_sass_digest_rejects_other_csv(tmp_path):
  from experiments.lab import ncu_sass_digest
  path = tmp_path / "other.csv"
  path.write_text("a,b\n1,2\n")
  with pytest.raises(ValueError, match="other.csv"):
    ncu_sass_digest.digest(str(path))


def test_triton_knobs_config_spec():
  from experiments.lab import triton_knobs
  base = triton_knobs.BF16_CONFIG
  config = triton_knobs.parse_config("128x128x32/w4/s5/p2", base)
  assert (config.block_m, config.block_n, config.block_k) == (128, 128, 32)
  assert (config.num_warps, config.num_stages, config.programs_per_sm) == (
      4, 5, 2)
  assert config.group_m == base.group_m
  for bad in ("128x128/w4", "128x128x32/q4", "128x128x32/w", "axbxc"):
    with pytest.raises(ValueError, match="must look like"):
      triton_knobs.parse_config(bad, base)


# ------------------------------------------------------- wide suite, auto ---


def test_wide_suite_is_seeded_balanced_and_mostly_aligned():
  from pallas_gemm import shapes
  wide = shapes.WIDE
  assert wide == shapes.wide_suite(shapes.WIDE_SEED)
  assert wide != shapes.wide_suite(shapes.WIDE_SEED + 1)
  assert len(wide) >= 100
  counts = {r: sum(p.regime == r for p in wide) for r in shapes.WIDE_REGIMES}
  assert len(counts) == 8 and min(counts.values()) == max(counts.values())
  itemsize = {"bfloat16": 2, "float16": 2, "tf32": 4}
  unaligned = [p for p in wide if p.k * itemsize[p.dtype] % 16]
  assert len(unaligned) <= len(wide) // 10
  assert all(p.m <= 128 for p in wide if p.regime == "decode")
  assert all(max(p.shape) <= 2048 for p in wide if p.regime == "small")
  assert all(p.m % 128 for p in wide if p.regime == "llm")
  assert {p.layout for p in wide if p.regime == "transposed"} == {"NT", "TN"}
  assert all(p.batch > 1 for p in wide if p.regime == "batched")


def test_auto_target_over_whole_problems_reports_regimes(tmp_path):
  from pallas_gemm.shapes import SuiteProblem
  problems = (SuiteProblem(24, 40, 56, regime="small"),
              SuiteProblem(16, 24, 32, batch=3, layout="NT", regime="batched"),
              SuiteProblem(20, 36, 16, dtype="tf32", layout="TN",
                           regime="f16_tf32"))
  options = bench_options.BenchmarkOptions(
      kernels=bench_targets.resolve_kernels(["auto"]),
      shapes=tuple(p.shape for p in problems), suite="wide",
      dtype_cases=(bench_cases.DtypeCase("bfloat16", "default"),),
      iters=2, warmup=0, output_dir=str(tmp_path), plot=False,
      interpret=True, problems=problems)
  run = benchmark.run_benchmark(options, log=lambda line: None)
  assert [r.status for r in run.rows] == ["OK"] * 6, [r.reason for r in run.rows]
  assert {r.kernel for r in run.rows} == {"xla", "auto"}
  assert [r.batch for r in run.rows if r.kernel == "auto"] == [1, 3, 1]
  regimes = (tmp_path / "regimes.md").read_text()
  for regime in ("small", "batched", "f16_tf32", "all"):
    assert f"| {regime} |" in regimes


@pytest.mark.parametrize("args, message", [
    (["--shapes="], "--shapes is given but empty"),
    (["--dtypes="], "--dtypes is given but empty"),
    (["--kernels="], "--kernels is given but empty"),
    (["stray"], "unexpected positional arguments"),
    (["--regimes=small"], "--regimes needs --suite=wide"),
    (["--suite=wide", "--dtypes=bfloat16"], "cannot be combined"),
])
def test_flag_errors_name_the_flag(args, message):
  result = _run_script(*args)
  assert result.returncode == 2 and message in result.stderr, result.stderr


def test_unwritable_output_dir_fails_before_measuring(tmp_path):
  blocker = tmp_path / "file"
  blocker.write_text("x")
  result = _run_script(f"--output_dir={blocker}/sub", "--shapes=16x16x16")
  assert result.returncode == 2 and "not writable" in result.stderr
  assert "OK" not in result.stdout


def test_wide_smoke_run_through_main(tmp_path):
  """`--suite=wide` end to end on a CPU: two problems of one regime, the auto
  target beside jnp.dot, a progress line per measurement, the regime table."""
  result = _run_script("--suite=wide", "--kernels=auto", "--regimes=small",
                       "--problems_per_regime=2", "--allow_large_interpret",
                       "--iters=1", "--warmup=0", "--plot=false",
                       f"--output_dir={tmp_path}")
  assert result.returncode == 0, result.stderr[-2000:]
  for index in (1, 2, 3, 4):
    assert f"[{index}/4]" in result.stdout
  rows = json.loads((tmp_path / "results.json").read_text())["results"]
  assert [(r["kernel"], r["status"], r["regime"]) for r in rows] == [
      ("xla", "OK", "small"), ("auto", "OK", "small")] * 2
  from pallas_gemm import shapes
  small = [p for p in shapes.WIDE if p.regime == "small"][:2]
  assert [(r["m"], r["n"], r["k"]) for r in rows[::2]] == [p.shape for p in small]
  assert all(r["wall_s"] > 0 for r in rows)  # where the time budget goes
  assert "| small | 2 |" in (tmp_path / "regimes.md").read_text()


def test_problems_per_regime_needs_the_wide_suite():
  result = _run_script("--problems_per_regime=1")
  assert result.returncode == 2
  assert "--problems_per_regime needs --suite=wide" in result.stderr


@pytest.mark.parametrize("kwargs, message", [
    (dict(m=0, n=1, k=1), "SuiteProblem.m=0"),
    (dict(m=1, n=2.0, k=1), "SuiteProblem.n=2.0"),
    (dict(m=1, n=1, k=1, batch=0), "SuiteProblem.batch=0"),
    (dict(m=1, n=1, k=1, dtype="float32"), "SuiteProblem.dtype='float32'"),
    (dict(m=1, n=1, k=1, layout="XN"), "SuiteProblem.layout='XN'"),
    (dict(m=1, n=1, k=1, regime="huge"), "SuiteProblem.regime='huge'"),
])
def test_suite_problem_validates_its_fields(kwargs, message):
  from pallas_gemm.shapes import SuiteProblem
  with pytest.raises(ValueError, match=message.replace(".", r"\.")):
    SuiteProblem(**kwargs)


def test_input_sets_depend_on_seed_problem_and_index_only():
  case = bench_cases.DtypeCase("float32", "ieee")
  problem = bench_checks.make_problem((8, 6, 4), case, "NN")
  other = bench_checks.make_problem((8, 6, 5), case, "NN")
  first = bench_checks.make_input_sets(problem, 2, seed=3)
  bench_checks.make_input_sets(other, 3, seed=3)  # other work in between
  again = bench_checks.make_input_sets(problem, 2, seed=3)
  for (a0, b0), (a1, b1) in zip(first, again):
    np.testing.assert_array_equal(a0, a1)
    np.testing.assert_array_equal(b0, b1)
  assert not np.array_equal(first[0][0], first[1][0])  # sets differ
  reseeded = bench_checks.make_input_sets(problem, 1, seed=4)
  assert not np.array_equal(first[0][0], reseeded[0][0])


def test_over_sets_traces_the_call_once_for_every_set():
  from pallas_gemm import timing
  traced = []

  def call(a, b):
    traced.append(a.shape)
    return a @ b

  sets = tuple((jnp.full((4, 4), float(i)), jnp.eye(4)) for i in range(5))
  outs = timing.over_sets(call)(sets)
  assert len(traced) == 1
  for i, out in enumerate(outs):
    np.testing.assert_array_equal(out, np.full((4, 4), float(i)))
  assert timing.time_over_sets(call, sets, iterations=2, on_gpu=False) > 0


def test_cupti_rounds_keep_the_outputs_in_flight_within_memory(monkeypatch):
  """CUPTI keeps every timed call's outputs alive: the harness times in
  rounds of as many calls as fit in its share of the device's memory (a
  first round of one call shows the outputs' size), and still returns
  every sample asked for."""
  import jax
  from jax.experimental.mosaic.gpu import profiler
  from pallas_gemm import timing
  rounds = []

  def fake_measure(fn, aggregate, iterations):
    def run(*args):
      rounds.append(iterations)
      samples = [0.5] * iterations
      return fn(*args), (samples[0] if iterations == 1 else samples)
    return run

  class Device:
    def memory_stats(self):  # room for 3 outputs of 1 MiB in flight
      return {"bytes_limit": int(3 * 2**20 / timing.OUTPUTS_IN_FLIGHT_SHARE)}

  monkeypatch.setattr(profiler, "measure", fake_measure)
  monkeypatch.setattr(jax, "devices", lambda *a: [Device()])
  fn = lambda x: x + 1
  x = jnp.zeros((2**18,), jnp.float32)  # 1 MiB
  _, samples = timing.cupti_samples_ms(fn, (x,), iterations=8, warmup=0)
  assert rounds == [1, 3, 3, 1] and samples == [0.5] * 8
  rounds.clear()
  _, samples = timing.cupti_samples_ms(fn, (x,), iterations=8, warmup=1)
  assert rounds == [3, 3, 2] and len(samples) == 8
  assert timing.calls_in_memory(None, 8) == 8  # size unknown: one round



def test_runner_pairs_kernels_with_jnp_dot_and_spots_its_own_program(
    tmp_path, monkeypatch):
  """The GPU branch of the runner, driven on a CPU with CUPTI faked: a
  Pallas kernel is timed interleaved with jnp.dot, and `auto` resolving to
  xla reuses jnp.dot's samples as one and the same program."""
  paired = []

  def fake_paired(baseline, call, **kwargs):
    paired.append(kwargs["iters"])
    return (bench_timers.Timing((2.0, 2.0), "cupti, paired"),
            bench_timers.Timing((1.0, 1.0), "cupti, paired"))

  def fake_time(call, **kwargs):
    return bench_timers.Timing((3.0, 3.0), "cupti")
  monkeypatch.setattr(bench_runner, "time_paired_on_gpu", fake_paired)
  monkeypatch.setattr(bench_runner, "time_on_gpu", fake_time)
  monkeypatch.setattr(bench_runner, "input_set_count", lambda *a: 2)
  options = bench_options.BenchmarkOptions(
      kernels=bench_targets.resolve_kernels(["auto", "triton/06_tuned"]),
      shapes=((48, 40, 32),), suite="custom",
      dtype_cases=(bench_cases.DtypeCase("float32", "ieee"),),
      iters=2, warmup=0, output_dir=None, plot=False, interpret=True)
  run = bench_runner.BenchmarkRun(options, log=lambda line: None)
  run.on_gpu = True
  original = pallas_gemm.matmul

  def matmul_choosing_xla(*args, kernel=None, **kwargs):
    # On a GPU `auto` resolves to xla wherever cuBLAS measured faster; on a
    # CPU the order gives it to Triton, so the test makes that choice.
    return original(*args, kernel=kernel or "xla", **kwargs)
  monkeypatch.setattr(pallas_gemm, "matmul", matmul_choosing_xla)
  rows = {r.kernel: r for r in run.run()}
  assert all(r.status == "OK" for r in rows.values()), [r.reason for r in rows.values()]
  assert rows["triton/06_tuned"].vs_jnp_dot == 2.0
  assert rows["triton/06_tuned"].paired_baseline_us == 2.0
  assert rows["auto"].same_program_as_baseline
  assert rows["auto"].vs_jnp_dot == 1.0 and rows["auto"].us == 3.0
  assert paired == [2]


def test_paired_timing_without_cupti_falls_back_to_unpaired(monkeypatch):
  """Where CUPTI is missing the paired path raises; the row is then timed
  as time_on_gpu times it (its host-clock fallback), not failed."""
  def no_cupti(*args, **kwargs):
    raise RuntimeError("CUPTI is not available")

  monkeypatch.setattr(bench_runner, "time_paired_on_gpu", no_cupti)
  monkeypatch.setattr(bench_runner, "time_on_gpu",
                      lambda call, **kw: bench_timers.Timing((3.0, 3.0), "host-clock"))
  monkeypatch.setattr(bench_runner, "input_set_count", lambda *a: 2)
  options = bench_options.BenchmarkOptions(
      kernels=bench_targets.resolve_kernels(["triton/06_tuned"]),
      shapes=((48, 40, 32),), suite="custom",
      dtype_cases=(bench_cases.DtypeCase("float32", "ieee"),),
      iters=2, warmup=0, output_dir=None, plot=False, interpret=True)
  run = bench_runner.BenchmarkRun(options, log=lambda line: None)
  run.on_gpu = True
  rows = {r.kernel: r for r in run.run()}
  kernel = rows["triton/06_tuned"]
  assert kernel.status == "OK", kernel.reason
  assert kernel.paired_baseline_us is None and kernel.vs_jnp_dot == 1.0


def test_git_revision_prefers_the_shipped_sha_and_warns_on_a_dirty_tree(
    monkeypatch, capsys):
  monkeypatch.setenv("PALLAS_GEMM_GIT_SHA", "abc1234")
  assert bench_output.git_revision() == "abc1234"
  monkeypatch.delenv("PALLAS_GEMM_GIT_SHA")
  answers = {"rev-parse": "0123456789ab", "status": " M pallas_gemm/api.py"}
  monkeypatch.setattr(bench_output, "_run_quiet",
                      lambda argv, cwd=None: answers[argv[1]])
  monkeypatch.setattr(bench_output, "_WARNED", set())
  assert bench_output.git_revision() == "0123456789ab-dirty"
  assert "PALLAS_GEMM_GIT_SHA" in capsys.readouterr().err
  answers["status"] = ""
  assert bench_output.git_revision() == "0123456789ab"
  # A shipped sha that is the copy's own (stale) HEAD while the tree
  # differs: kept, but warned about.
  answers["status"] = " M pallas_gemm/api.py"
  capsys.readouterr()
  monkeypatch.setenv("PALLAS_GEMM_GIT_SHA", "0123456")
  assert bench_output.git_revision() == "0123456"
  assert "stale" in capsys.readouterr().err
  monkeypatch.setenv("PALLAS_GEMM_GIT_SHA", "fedcba9")
  assert bench_output.git_revision() == "fedcba9"
  assert "stale" not in capsys.readouterr().err
