"""The dispatch-table builder: a deterministic training set, the fold rule
(a kernel wins a bucket only by beating xla on every problem in it), a
resumable run end to end on a CPU, and the shipped rule's leave-one-out
over the committed measurements."""

from __future__ import annotations

import json

import jax
import pytest

from experiments import build_dispatch_table as builder
import pallas_gemm
from pallas_gemm import autotune, dispatch


def test_training_set_is_deterministic_and_covers_the_regimes():
  first, again = builder.training_problems(), builder.training_problems()
  assert first == again and len(first) >= 60
  assert builder.training_problems(seed=1) != first
  layouts = {s["layout"] for s in first}
  dtypes = {s["in_dtype"] for s in first}
  assert layouts == {"NN", "NT", "TN"}
  assert dtypes == {"bfloat16", "float16", "float32", "float8_e4m3fn"}
  assert any(s["batch"] > 1 for s in first)
  assert any(s["m"] <= 128 for s in first)
  assert any(s["epilogue"] != "plain" for s in first)
  unaligned = builder.training_problems(
      regimes=("unaligned_wide", "unaligned_fp8_rows", "fp8_narrow"))
  fp8 = [builder.to_problem(s) for s in first
         if s["in_dtype"] == "float8_e4m3fn" and s not in unaligned]
  assert {(p.layout, p.a_scale_mode) for p in fp8} == {
      (layout, scales) for layout in ("NN", "NT", "TN")
      for scales in ("none", "tensor")}
  assert all(p.out_dtype == "bfloat16" and p.n % 16 == 0 and p.k % 16 == 0
             for p in fp8)
  # Scaled specs have ids of their own; unscaled ones keep the old form.
  ids = [builder.spec_id(s) for s in first]
  assert len(set(ids)) == len(ids)
  assert sum("scales=tensor" in i for i in ids) == sum(
      builder.to_problem(s).a_scale_mode == "tensor" for s in first)


def test_unaligned_wide_draws_odd_widths_at_few_rows_and_in_fp8():
  """The regime the class rule's reach and fp8's aligned twin stand in for:
  every problem's rows are not 16-byte units, bfloat16 from one row, fp8
  in both layouts."""
  from pallas_gemm import dispatch
  specs = [s for seed in range(20261123, 20261127)
           for s in builder.training_problems(seed,
                                              regimes=("unaligned_wide",))]
  problems = [builder.to_problem(s) for s in specs]
  assert len(problems) == 64
  assert all(dispatch.alignment(p) != "a16" for p in problems)
  assert min(p.m for p in problems if p.in_dtype == "bfloat16") == 1
  assert {p.layout for p in problems if p.in_dtype == "float8_e4m3fn"} == {
      "NN", "NT"}


def test_unaligned_layouts_draws_both_stored_layouts_of_unaligned_rows():
  from pallas_gemm import dispatch
  problems = [builder.to_problem(s) for seed in range(20261123, 20261126)
              for s in builder.training_problems(
                  seed, regimes=("unaligned_layouts",))]
  assert len(problems) == 30
  assert all(dispatch.alignment(p) != "a16" for p in problems)
  assert {p.layout for p in problems} == {"NT", "TN"}
  assert min(p.m for p in problems) >= 512


def test_the_regimes_by_operand_draw_their_alignment_classes():
  from pallas_gemm import dispatch
  draw = lambda regime: [builder.to_problem(s) for s in
                         builder.training_problems(regimes=(regime,))]
  b_or_c = {(p.layout, dispatch.alignment(p))
            for p in draw("unaligned_b_or_c")}
  assert b_or_c == {("NN", "ub"), ("TN", "ub"), ("NT", "uc")}
  assert {dispatch.alignment(p) for p in draw("unaligned_ub8")} == {"ub8"}
  fp8 = draw("unaligned_fp8_rows")
  assert all(p.in_dtype == "float8_e4m3fn" and dispatch.alignment(p) != "a16"
             for p in fp8)
  assert {p.layout for p in fp8} == {"NN", "TN", "NT"}
  assert {dispatch.alignment(p) for p in draw("unaligned_ub8_round")} == {
      "ub8"}
  narrow = [p for seed in range(20261123, 20261126) for p in
            map(builder.to_problem, builder.training_problems(
                seed, regimes=("fp8_narrow",)))]
  assert {p.layout for p in narrow} == {"NN", "TN", "NT"}
  assert "a16" in {dispatch.alignment(p) for p in narrow} != {"a16"}
  assert all(p.n <= 512 and p.m >= 1024 for p in narrow)
  transposed = draw("fp8_transposed")
  assert {(p.in_dtype, p.layout, dispatch.alignment(p))
          for p in transposed} == {("float8_e4m3fn", "TN", "a16")}



def test_new_regimes_leave_the_measured_problems_drawn():
  """Regimes are drawn in TRAINING_REGIMES order and new ones go last, so
  every problem the committed tables measured is still drawn by some seed
  (otherwise resuming would measure a different set)."""
  drawn = {builder.spec_id(s) for seed in range(20261120, 20261151)
           for s in builder.training_problems(seed)}
  for gpu in ("nvidia_h100", "nvidia_h200"):
    log = (autotune.SHIPPED_DIR.parents[1] / "experiments" / "results" / gpu
           / "dispatch" / "measurements.jsonl")
    for line in log.read_text().splitlines():
      assert builder.spec_id(json.loads(line)["spec"]) in drawn, line[:120]


def test_decode_wide_reaches_lm_heads_and_long_reductions():
  specs = [s for seed in range(20261123, 20261127)
           for s in builder.training_problems(seed, regimes=("decode_wide",))]
  assert len(specs) == 32 and all(s["m"] <= 128 for s in specs)
  assert max(s["n"] for s in specs) > 65536
  assert max(s["k"] for s in specs) > 16384


def test_a_regime_of_a_training_set_is_drawn_as_in_the_whole_set():
  whole = builder.training_problems(seed=7)
  decode = builder.training_problems(seed=7, regimes=("decode",))
  assert decode and all(s["m"] <= 128 for s in decode)
  assert all(s in whole for s in decode)
  both = builder.training_problems(seed=7, regimes=("decode", "tf32"))
  assert [s for s in whole if s in both] == both
  assert {s["in_dtype"] for s in both} == {"bfloat16", "float32"}
  with pytest.raises(ValueError, match="regimes"):
    builder.training_problems(seed=7, regimes=("decoding",))
  with pytest.raises(SystemExit):
    builder.main(["--out_dir", "unused", "--regimes", "decoding",
                  "--table_only"])

def _row(spec, **ms):
  problem = builder.to_problem(spec)
  return {"spec": spec, "problem": problem.describe(), "device": "gpu",
          "ms": ms, "configs": {k: None for k in ms}}


def test_fold_needs_a_win_on_every_problem_of_the_bucket():
  spec = dict(batch=1, m=4096, n=4096, k=4096, in_dtype="bfloat16",
              layout="NN", epilogue="plain")
  near = dict(spec, m=4100)  # same half-octave bucket
  other = dict(spec, m=512)
  table = builder.fold([
      _row(spec, xla=1.0, **{"mosaic/ws_persistent": 0.9}),
      _row(near, xla=1.0, **{"mosaic/ws_persistent": 1.05}),
      _row(other, xla=1.0, **{"mosaic/ws_persistent": 0.5}),
  ], min_gain=1.01)
  key = dispatch.DispatchKey.for_problem(builder.to_problem(spec)).name
  assert table[key]["kernel"] == "xla"  # lost on one of its two problems
  other_key = dispatch.DispatchKey.for_problem(builder.to_problem(other)).name
  assert table[other_key]["kernel"] == "mosaic/ws_persistent"
  assert table[other_key]["ratio_to_xla"] == 2.0
  # The winner's config is kept per measured problem.
  other_problem = builder.to_problem(other).describe()
  assert table[other_key]["configs"] == {other_problem: None}


@pytest.mark.skipif(jax.default_backend() != "cpu",
                    reason="times in interpret mode on the host")
def test_cpu_run_resumes_and_writes_the_table(tmp_path, monkeypatch):
  monkeypatch.setenv(autotune.CACHE_DIR_ENV, str(tmp_path / "cache"))
  out, table = tmp_path / "out", tmp_path / "table.json"
  small = [dict(batch=1, m=16, n=24, k=32, in_dtype="float32", layout="NN",
                epilogue="plain"),
           dict(batch=2, m=8, n=16, k=16, in_dtype="bfloat16", layout="NT",
                epilogue="plain")]
  monkeypatch.setattr(builder, "training_problems",
                      lambda seed, regimes=None: small)
  args = [f"--out_dir={out}", f"--table={table}", "--allow_cpu", "--iters=1",
          "--kernels=triton/06_tuned"]
  assert builder.main(args + ["--limit=1"]) == 0
  assert len((out / "measurements.jsonl").read_text().splitlines()) == 1
  assert builder.main(args) == 0  # resumes: measures only the second
  rows = [json.loads(l) for l in
          (out / "measurements.jsonl").read_text().splitlines()]
  assert len(rows) == 2 and all("xla" in r["ms"] for r in rows)
  data = json.loads(table.read_text())
  assert len(data["dispatch"]) == 2
  assert data["meta"]["problems_measured"] == 2


def test_the_shipped_rule_holds_out_on_the_committed_measurements():
  """Leave-one-out over each GPU's committed dispatch measurements
  (experiments/lab/dispatch_holdout.py): with the shipped rule, a problem
  left out of the table is rarely and never badly sent to a kernel slower
  than xla. Not a timing: the measurements are data."""
  import pathlib

  from experiments.lab.dispatch_holdout import (hold_out, hopper_device,
                                                summary)

  results = pathlib.Path(__file__).resolve().parents[1] / "experiments" / (
      "results")
  folders = sorted(results.glob("nvidia_h*/dispatch/measurements.jsonl"))
  assert folders
  for path in folders:
    rows = builder.read_measurements(path)
    device = hopper_device(rows[0]["device"])
    held_out = summary(hold_out(rows, device, min_gain=1.01))
    # The few_tiles regime (problems of a few microseconds, where cuBLAS's
    # and the kernels' times jump between neighbouring shapes: operand
    # padding, tile counts) holds most of the held-out losses
    # (experiments/results/nvidia_h100/dispatch/README.md, last section).
    assert held_out["losses"] <= max(2, 0.015 * held_out["problems"]), (
        path, held_out)
    assert held_out["min"] >= 0.65, (path, held_out)
    assert held_out["geomean"] >= 1.0, (path, held_out)


@pytest.mark.skipif(jax.default_backend() != "cpu",
                    reason="times in interpret mode on the host")
def test_a_problem_none_of_the_kernels_runs_is_skipped_not_given_to_xla(
    tmp_path, monkeypatch, capsys):
  """--kernels naming only kernels that cannot run a problem (fp8 kernels
  for a bf16 problem here; bf16 ones for the fp8 regimes on a GPU) must
  not let xla win its bucket unopposed: it is skipped, nothing recorded."""
  monkeypatch.setenv(autotune.CACHE_DIR_ENV, str(tmp_path / "cache"))
  bf16 = dict(batch=1, m=16, n=32, k=32, in_dtype="bfloat16", layout="NN",
              epilogue="plain")
  monkeypatch.setattr(builder, "training_problems",
                      lambda seed, regimes=None: [bf16])
  out = tmp_path / "out"
  assert builder.main([f"--out_dir={out}", f"--table={tmp_path / 't.json'}",
                       "--allow_cpu", "--iters=1",
                       "--kernels=mosaic/fp8"]) == 0
  assert "skipped, none of --kernels runs it" in capsys.readouterr().out
  log = out / "measurements.jsonl"
  assert not log.exists() or not log.read_text().strip()


def test_a_row_is_stale_when_a_kernel_is_new_or_its_config_changed(
    tmp_path, monkeypatch):
  """--refresh measures again a row that lacks a candidate kernel (one
  registered since it was measured) or recorded another config than the
  kernel now resolves."""
  from pallas_gemm.devices import DeviceInfo
  monkeypatch.setenv(autotune.CACHE_DIR_ENV, str(tmp_path / "cache"))
  hopper = DeviceInfo("gpu", "NVIDIA H100 80GB HBM3", (9, 0), 132,
                      227 * 1024)
  few_tiles = dict(batch=1, m=640, n=320, k=880, in_dtype="bfloat16",
                   layout="NN", epilogue="plain")
  problem = builder.to_problem(few_tiles)
  names = builder.candidates(problem, hopper)
  assert "mosaic/split_k" in names
  configs = {k: None if k == "xla" else autotune.config_to_json(
      dispatch.resolve(problem, hopper, k).config) for k in names}
  row = {"spec": few_tiles, "problem": problem.describe(),
         "ms": {k: 1.0 for k in names}, "configs": configs}
  assert builder.stale(row, hopper) is None
  older = dict(row, ms={k: 1.0 for k in names if k != "mosaic/split_k"})
  assert builder.stale(older, hopper) == "mosaic/split_k not timed"
  changed = json.loads(json.dumps(row))
  changed["configs"]["mosaic/ws_persistent"]["tile_n"] = 64
  assert builder.stale(changed, hopper) == (
      "mosaic/ws_persistent's config changed")


@pytest.mark.skipif(jax.default_backend() != "cpu",
                    reason="times in interpret mode on the host")
def test_refresh_problems_measures_exactly_the_listed_rows_once(
    tmp_path, monkeypatch, capsys):
  """--refresh_problems measures the listed rows again whatever seed drew
  them, once per revision (a rerun resumes), and rejects an id that has no
  row."""
  monkeypatch.setenv(autotune.CACHE_DIR_ENV, str(tmp_path / "cache"))
  monkeypatch.setenv("PALLAS_GEMM_GIT_SHA", "abc123")
  listed = dict(batch=1, m=16, n=32, k=32, in_dtype="bfloat16", layout="NN",
                epilogue="plain")
  other = dict(listed, m=24)
  out = tmp_path / "out"
  out.mkdir()
  log = out / "measurements.jsonl"
  device = pallas_gemm.device_info().device_kind
  log.write_text("".join(json.dumps(
      {"spec": s, "problem": builder.to_problem(s).describe(),
       "device": device, "ms": {"xla": 1.0}, "configs": {"xla": None},
       "git_sha": "old"}) + "\n" for s in (listed, other)))
  ids = tmp_path / "ids.txt"
  ids.write_text(builder.spec_id(listed) + "\n")
  args = [f"--out_dir={out}", f"--table={tmp_path / 't.json'}",
          "--allow_cpu", "--iters=1", "--kernels=triton/06_tuned",
          f"--refresh_problems={ids}"]
  assert builder.main(args) == 0
  rows = [json.loads(line) for line in log.read_text().splitlines()]
  assert len(rows) == 3 and rows[-1]["spec"] == listed
  assert rows[-1]["git_sha"] != "old"
  assert builder.main(args) == 0  # measured at this revision: nothing to do
  assert len(log.read_text().splitlines()) == 3
  with pytest.raises(SystemExit):  # a seed's regimes do not mix with a list
    builder.main(args + ["--regimes=small"])
  assert "--refresh_problems lists them itself" in capsys.readouterr().err
  ids.write_text(builder.spec_id(dict(listed, m=40)) + "\n")
  with pytest.raises(SystemExit):
    builder.main(args)
  assert "no row measured" in capsys.readouterr().err
