"""The lab folder (experiments/lab/): its README indexes every script, and the
Triton sweep runs its phases end to end on a CPU (interpret mode, tiny
shapes) over rung 6's one search space."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import subprocess
import sys

import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
LAB = REPO_ROOT / "experiments" / "lab"


def test_lab_readme_indexes_every_lab_script():
  index = (LAB / "README.md").read_text()
  scripts = sorted(p.name for p in LAB.iterdir()
                   if p.suffix in (".py", ".sh") and p.name != "__init__.py")
  assert scripts, "experiments/lab holds no scripts"
  missing = [name for name in scripts if f"[`{name}`]({name})" not in index]
  assert not missing, f"experiments/lab/README.md does not index {missing}"


def test_ragged_pairs_readme_indexes_every_plan():
  """Every plan in experiments/lab/ragged_pairs/ is linked from its README."""
  folder = LAB / "ragged_pairs"
  index = (folder / "README.md").read_text()
  plans = sorted(p.name for p in folder.iterdir() if p.suffix == ".txt")
  assert plans, "experiments/lab/ragged_pairs holds no plans"
  missing = [name for name in plans if f"[`{name}`]({name})" not in index]
  assert not missing, (
      f"experiments/lab/ragged_pairs/README.md does not index {missing}")


def test_triton_sweep_dry_run_times_the_search_space(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             PYTHONPATH=str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
  result = subprocess.run(
      [sys.executable, str(LAB / "triton_sweep.py"), "--dry-run",
       "--phase", "bf16", "--phase", "ladder", "--out", str(tmp_path)],
      cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300,
      check=False)
  assert result.returncode == 0, result.stderr[-2000:]
  results = json.loads((tmp_path / "bf16_ladder_NN.json").read_text())
  from pallas_gemm import autotune, device_info
  from pallas_gemm.problem import GemmProblem
  problem = GemmProblem(1, 64, 64, 128, "bfloat16", "bfloat16")
  space = autotune.search_space(problem, "triton/06_tuned", device_info())
  timed = [r["config"] for r in results["sweep"]]
  assert len(timed) == 2  # --dry-run times the first two configs
  assert timed == [dataclasses.asdict(c) for c in space[:2]]
  assert {r["kernel"] for r in results["ladder"]} >= {"triton/06_tuned"}


def test_small_m_model_fit_replays_the_shipped_choice_and_reads_the_sweeps(
    capsys):
  sys.path.insert(0, str(REPO_ROOT))
  from experiments.lab import small_m_model_fit as fit
  from pallas_gemm.mosaic_backend import heuristics
  from pallas_gemm.problem import GemmProblem
  # With the shipped constants (and no ring fill) the fit picks what the
  # package would, so what it scores is what the package does.
  for m, n, k in ((1, 8704, 2944), (8, 11136, 2048), (64, 4096, 14336)):
    problem = GemmProblem(1, m, n, k, "bfloat16", "bfloat16")
    assert (fit.pick(problem, heuristics.SATURATING_SM_SHARE, 0.0)
            == heuristics.small_m_heuristic(problem, 132))
  sweeps = sorted(str(p) for p in (REPO_ROOT / "experiments" / "results")
                  .glob("nvidia_h*/small_m_sweep/sweep.txt"))
  assert sweeps
  assert fit.main(sweeps) == 0
  assert "16 problems" in capsys.readouterr().out


def test_config_ab_compares_only_what_differs_and_every_variant_fits():
  sys.path.insert(0, str(REPO_ROOT))
  import argparse

  import pytest

  from experiments.lab import config_ab
  with pytest.raises(ValueError, match="12x34"):
    config_ab.parse_problem("12x34")
  assert config_ab.parse_problem("8x64x128x256").batch == 8
  old = argparse.Namespace(old_share=0.75, old_ring_fill=0.0)
  # The same constants as the shipped model: nothing to compare.
  from pallas_gemm.mosaic_backend import heuristics
  same = argparse.Namespace(old_share=heuristics.SATURATING_SM_SHARE,
                            old_ring_fill=0.0)
  problem = config_ab.parse_problem("128x4096x14336")
  assert config_ab.small_m_variants(problem, 132, same) == []
  other = argparse.Namespace(old_share=0.4, old_ring_fill=1.0)
  pair = config_ab.small_m_variants(problem, 132, other)
  assert [label for _, label, _ in pair] == ["old model", "shipped"]
  assert pair[0][2] != pair[1][2]
  for text in config_ab.SMALL_K_PROBLEMS:
    problem = config_ab.parse_problem(text)
    variants = config_ab.ws_small_k_variants(problem, 132, old)
    configs = [c for _, _, c in variants]
    assert variants[0][1] == "heuristic"
    assert len(set(configs)) == len(configs) > 1
    assert all(c.fits(problem) for c in configs)


def test_dense_via_turns_parses_shapes_and_its_configs_fit():
  """The batched-products probe: its shape parser names a bad entry, its
  default shapes are the wide suite's attention-score products, and the
  turn-taking config it times fits each of them (on an H200's SMs)."""
  sys.path.insert(0, str(REPO_ROOT))
  import pytest

  from experiments.lab import dense_via_turns as probe
  from experiments.lab.ragged_profile_case import config_with_fields
  from pallas_gemm.devices import DeviceInfo
  with pytest.raises(SystemExit, match="12x34"):
    probe.parse_shapes("12x34")
  assert probe.parse_shapes("2x64x64x128;4x8x8x64") == [(2, 64, 64, 128),
                                                        (4, 8, 8, 64)]
  shapes = probe.default_shapes()
  assert shapes and all(m == n and k <= 128 for _, m, n, k in shapes)
  hopper = DeviceInfo("gpu", "NVIDIA H200", (9, 0), 132, 227 * 1024)
  for b, m, n, k in shapes:
    problem = probe.grouped_problem(b, m, n, k)
    config = config_with_fields(problem, probe.TURNS, hopper)
    assert config.ping_pong and config.fits(problem)
    assert config.cta_tile("rows") == (128, 128)


def test_wide_choices_reads_the_shipped_tables_and_a_run():
  """The wide suite's picks come from the committed tables alone, and a
  committed run's own picks read back from its results file: each GPU's
  run differs from the shipped rule in at most a few problems."""
  sys.path.insert(0, str(REPO_ROOT))
  from experiments.lab import wide_choices

  for gpu in wide_choices.GPUS:
    picked = wide_choices.choices(gpu)
    assert len(picked) == 104
    assert {r.kernel for r in picked.values()} >= {"xla"}
    ran = wide_choices.run_picks(
        REPO_ROOT / "experiments" / "results" / gpu / "wide" / "results.json")
    assert len(ran) == 104
    labels = {wide_choices.shape_label(d) for d in picked}
    assert labels == set(ran)


def test_ragged_padding_bound_counts_rows_as_the_schedule_cuts_them(capsys):
  sys.path.insert(0, str(REPO_ROOT))
  import numpy as np
  from experiments.lab import ragged_padding_bound as bound
  # 273 rows from row 0: three 128-row items, five 64-row ones. A group
  # that starts 5 rows past a multiple of 8 is counted from there: 64 rows
  # at row 5 take two 64-row items.
  assert bound.padding(np.array([273]), 128) == 384 / 273
  assert bound.padding(np.array([273]), 64) == 320 / 273
  assert bound.padding(np.array([3, 0, 61]), 64) == 128 / 64
  assert bound.padding(np.array([5, 64]), 64) == 192 / 69  # starts at 5
  results = sorted((REPO_ROOT / "experiments" / "results")
                   .glob("nvidia_h*/moe_63cd7b1/results.json"))
  assert results
  assert bound.main([str(results[0]), "--misses"]) == 0
  out = capsys.readouterr().out
  assert "qwen1.5_moe_up even forward" in out
  assert "items of 64: the bound reaches the target" in out


def test_swap_ab_probe_lowers_and_matches_at_token_counts_of_8_rows():
  """The token rows on wgmma's N side: a tile of 8 and of 24 tokens (not a
  multiple of 64) lowers for the GPU and matches float64 in interpret
  mode."""
  sys.path.insert(0, str(REPO_ROOT))
  from experiments.lab import swap_ab_probe
  for tokens in (8, 24):
    assert swap_ab_probe.probe(tokens) < 1e-2


def test_chunk32_probe_lowers_a_32_row_chunk_only_at_the_64_byte_swizzle(
    capsys):
  """The weight gradient's token rows as wgmma's K: a 32-row chunk is
  refused at the 128-byte swizzle and lowers (and matches float64 in
  interpret mode) at the 64-byte one."""
  sys.path.insert(0, str(REPO_ROOT))
  from experiments.lab import chunk32_probe
  assert chunk32_probe.probe(32, 64, 64, 128) < 1e-2
  assert chunk32_probe.main(["--cases", "32:128"]) == 0
  assert "refused: K must be a multiple of 64" in capsys.readouterr().out


def test_versus_padded_lhs_traces_the_padded_call_on_its_own(monkeypatch):
  """`ragged_profile_case --versus_padded_lhs` times two programs: the
  padded one must be traced again with `lhs_in_place` off, not served from
  the first call's trace (jax.jit caches traces by function)."""
  import jax.numpy as jnp

  from experiments.lab import ragged_profile_case as case
  from pallas_gemm.ragged_dot import mosaic
  from pallas_gemm.ragged_dot.problem import RaggedProblem

  problem = RaggedProblem("rows", m=130, k=64, n=128, groups=2,
                          in_dtype="bfloat16", out_dtype="bfloat16")
  seen = []

  def fake_matmul(lhs, rhs, sizes, row_offset, **_):
    seen.append(mosaic.lhs_in_place(None, problem, None))
    return jnp.zeros((lhs.shape[0], rhs.shape[2]), jnp.float32)

  monkeypatch.setattr(mosaic, "ragged_matmul", fake_matmul)
  monkeypatch.setattr(mosaic, "lhs_in_place", lambda *_, **__: True)
  (as_is, _), (padded, _) = case._in_place_pair(problem, "")
  operands = (jnp.ones((130, 64)), jnp.ones((2, 64, 128)),
              jnp.array([65, 65], jnp.int32))
  as_is(*operands)
  padded(*operands)
  assert seen == [True, False]
  # The weight gradient's switch is off for the padded call too.
  from pallas_gemm.ragged_dot import mosaic_contracting
  seen.clear()
  monkeypatch.setattr(mosaic, "ragged_matmul", lambda *args, **_: (
      seen.append(mosaic_contracting.operands_in_place(None, problem, None))
      or args[0]))
  monkeypatch.setattr(mosaic_contracting, "operands_in_place",
                      lambda *_, **__: True)
  (as_is, _), (padded, _) = case._in_place_pair(problem, "")
  as_is(*operands)
  padded(*operands)
  assert seen == [True, False]


def test_ragged_operand_traffic_counts_chunks_tiles_and_stages(capsys):
  """The weight gradient's bytes between L2 and the SMs: chunks as the
  schedule counts them x tiles per group x one stage's lhs and dout
  blocks, and the output once; and the script reads a committed run."""
  sys.path.insert(0, str(REPO_ROOT))
  from experiments.lab import ragged_operand_traffic as traffic
  from experiments.lab.dispatch_holdout import hopper_device
  from experiments.lab.ragged_profile_case import find_case
  from pallas_gemm.ragged_dot import configs
  case = find_case("qwen3_30b_a3b_up even drhs")
  config = configs.heuristic(case.problem, hopper_device("NVIDIA H200"))
  assert config.cta_tile("contracting") == (128, 128)
  operand, out = traffic.traffic(case, config)
  # 128 experts of 256 rows: 4 chunks of 64 each; 16 x 6 tiles of
  # 128 x 128; a stage is (128 + 128) x 64 bf16.
  assert operand == 128 * 4 * (16 * 6) * (256 * 64 * 2)
  assert out == 128 * 2048 * 768 * 2
  results = sorted((REPO_ROOT / "experiments" / "results")
                   .glob("nvidia_h200/moe_a21e353/suite/run_c/results.json"))
  assert results
  assert traffic.main([str(results[0])]) == 0
  out_text = capsys.readouterr().out
  assert "| qwen3_30b_a3b_up even drhs | 128 x 128 | yes | 1.61 |" in out_text
  assert "forward" not in out_text


def test_pair_fields_keep_the_staging_slots_they_name():
  """A pair line that sets `out_slots` gets those slots and the deepest
  ring that fits beside them (the heuristic's deepening would choose the
  slots again: on Qwen3-30B's weight gradient one slot and 6 stages)."""
  sys.path.insert(0, str(REPO_ROOT))
  from experiments.lab.dispatch_holdout import hopper_device
  from experiments.lab.ragged_profile_case import config_with_fields, find_case
  problem = find_case("qwen3_30b_a3b_up even drhs").problem
  h200 = hopper_device("NVIDIA H200")
  base = config_with_fields(problem, "ping_pong=true", h200)
  assert (base.stages, base.out_slots) == (6, 1)
  two = config_with_fields(problem, "out_slots=2", h200)
  assert (two.stages, two.out_slots) == (5, 2) and two.fits(problem)
  assert config_with_fields(problem, "out_slots=2,stages=5", h200) == two


def test_moe_tally_counts_each_case_once_from_the_first_file(tmp_path, capsys):
  sys.path.insert(0, str(REPO_ROOT))
  from experiments.lab import moe_tally

  def row(case, fraction, time_ms, kernel="auto", correct=True):
    layer, distribution, direction = case.split()
    target = 0.85 if direction == "forward" and distribution != "zipf" else 0.75
    return dict(case=case, layer=layer, distribution=distribution,
                direction=direction, kernel=kernel, time_ms=time_ms,
                roofline_fraction=fraction, roofline_target=target,
                meets_target=fraction >= target, correct=correct)

  def write(name, rows):
    path = tmp_path / name
    path.write_text(json.dumps({"metadata": {}, "results": rows}))
    return str(path)

  first = write("a.json", [row("l1 even forward", 0.90, 1.0),
                           row("l1 even forward", 0.10, 9.0, kernel="xla"),
                           row("l1 zipf drhs", 0.70, 2.0)])
  second = write("b.json", [row("l1 zipf drhs", 0.80, 1.8),
                            row("l2 even dlhs", 0.745, 3.0)])
  earlier = write("c.json", [row("l1 even forward", 0.80, 1.1),
                             row("l1 zipf drhs", 0.71, 2.0)])
  assert moe_tally.main([first, second, "--against", earlier]) == 0
  out = capsys.readouterr().out
  # The repeat counts from the first file (0.70, a miss); xla rows never count.
  assert ("**1 of 3** meet their target (forward 1 of 1, drhs 0 of 1, "
          "dlhs 0 of 1)") in out
  assert "l1 zipf drhs: 0.700, 0.800 (the first counts)" in out
  assert "| drhs, zipf (1) | l1 0.700 |" in out
  assert "l2 even dlhs 0.7450 (line 0.75)" in out  # within 1 % of its line
  assert "l1 even forward: 0.800 -> 0.900, now passes" in out
  assert "2 cases in common" in out

  with pytest.raises(SystemExit):
    moe_tally.main([first, "--against", str(tmp_path / "absent.json")])
  assert "--against: no such file" in capsys.readouterr().err
  with pytest.raises(SystemExit):
    moe_tally.main([first, "--moved", "1.5"])
  assert "--moved must lie in [0, 1)" in capsys.readouterr().err


def test_ragged_phase_model_walks_every_tile_and_shares_the_dram():
  sys.path.insert(0, str(REPO_ROOT))
  import numpy as np
  from experiments.lab import ragged_phase_model as model
  from experiments.lab.dispatch_holdout import hopper_device
  from pallas_gemm.ragged_dot import arg_specs

  # Compute alone: each SM runs its round-robin share one tile after another.
  compute = np.array([1.0, 2.0, 3.0, 4.0])
  assert model.fluid_time(compute, [], np.arange(4), sms=2) == 2.0 + 4.0
  # Two SMs whose tiles each need more DRAM than half the bandwidth: the
  # bytes set the time.
  dram = np.array([10.0, 10.0])
  took = model.fluid_time(np.array([1.0, 1.0]), [(dram, 4.0)], np.arange(2),
                          sms=2)
  assert abs(took - 20.0 / 4.0) < 1e-9

  layer = arg_specs.MoeLayer("g4_t1000_k256_n512", 4, 1000, 256, 512)
  case = arg_specs.MoeCase(layer, "zipf", "forward")
  tiles, config = model.walk(case, hopper_device("NVIDIA H200"))
  cta_n = config.cta_tile("rows")[1]
  units = -(-layer.n // cta_n)
  items = len(set(tiles["item"].tolist()))
  assert len(tiles["group"]) == items * units
  # Every (item, column strip) once; the items cover every row once.
  assert len(set(zip(tiles["item"].tolist(), tiles["n_idx"].tolist()))) == (
      items * units)
  assert tiles["rows"][tiles["n_idx"] == 0].sum() == layer.rows
  assert (tiles["width"] >= tiles["rows"]).all()
  _, dram, l2 = model.tile_costs(tiles, case.problem, cta_n, sm_flops=1e12)
  used = len(set(tiles["group"].tolist()))
  # First touches: each used expert's weights and every token row once,
  # and every output byte.
  expected = 2 * (used * layer.k * units * cta_n + layer.rows * layer.k
                  + layer.rows * units * cta_n)
  assert dram.sum() == expected
  assert (l2 >= dram - 2 * layer.k * (cta_n + tiles["rows"])).all()
  order = model.mixed_order(np.ones(len(dram)), dram, 4.28e12, sms=132)
  assert sorted(order.tolist()) == list(range(len(dram)))
  saved = model.strip_shared_by_pairs(
      {"group": np.array([0, 0, 0, 1, 1, 2]),
       "n_idx": np.array([0, 0, 0, 0, 1, 1])}, strip_bytes=10)
  # (0, 1) pair; 2 has no partner left; 3 and 4 differ in strip; 5 alone.
  assert saved.tolist() == [5, 5, 0, 0, 0, 0]


def test_profile_case_traces_a_pair_lines_config_for_each_form():
  """A pair line's fields reach `ragged_dot_general` with the problem's own
  dimension numbers (a refactor once left this call on a removed helper,
  and only the device run found it)."""
  sys.path.insert(0, str(REPO_ROOT))
  import jax
  import jax.numpy as jnp
  from experiments.lab import ragged_profile_case as case
  for label, fields in (("g2_t2048_k256_n256 even drhs", "ping_pong=true"),
                        ("g2_t2048_k256_n256 even forward", "stages=3")):
    problem = case.find_case(label).problem
    fn, name = case._call(problem, "mosaic", fields)
    assert name == f"mosaic {fields}"
    dtype = jnp.dtype(problem.in_dtype)
    jaxpr = jax.make_jaxpr(fn)(
        jax.ShapeDtypeStruct(problem.lhs_shape, dtype),
        jax.ShapeDtypeStruct(problem.rhs_shape, dtype),
        jax.ShapeDtypeStruct((problem.groups,), jnp.int32))
    assert jaxpr.out_avals[0].shape == problem.out_shape


def test_random_ragged_sweep_draws_the_same_cases_and_runs_one(capsys):
  import numpy as np

  from experiments.lab import random_ragged_sweep as sweep
  first = sweep.draw_cases(3, 40, 25.0)
  again = sweep.draw_cases(3, 40, 25.0)
  assert [c[0] for c in first] == [c[0] for c in again]
  for (label, case, sizes), (_, _, same) in zip(first, again):
    np.testing.assert_array_equal(sizes, same)
    assert sizes.shape == (case.layer.groups,) and sizes.dtype == np.int32
    assert sizes.sum() == case.layer.rows and (sizes >= 0).all()
    assert 2 * (case.layer.groups * case.layer.k * case.layer.n
                + case.layer.rows * (case.layer.k + case.layer.n)
                ) <= sweep.MAX_BYTES
  assert {c[0].split()[-1] for c in first} == {"forward", "dlhs", "drhs"}
  wide = sweep.draw_cases(3, 20, 25.0, dims=(512, 1024))
  assert all(512 <= c[1].layer.k <= 1024 and 512 <= c[1].layer.n <= 1024
             for c in wide)
  assert sweep.main(["--seed", "3", "--cases", "2", "--iterations", "1",
                     "--dims", "16,64", "--max_lax_ms", "0.01"]) == 0
  rows = [line for line in capsys.readouterr().out.splitlines()
          if line.startswith("| 0 ") or line.startswith("| 1 ")]
  assert len(rows) == 2 and all("| - |" not in row for row in rows)
  with pytest.raises(SystemExit, match="--dims"):
    sweep.main(["--dims", "64"])
  assert sweep.main(["--seed", "3", "--cases", "1", "--iterations", "1",
                     "--dims", "16,64", "--max_lax_ms", "0.01",
                     "--dtype", "float16", "--out_dtype", "float32"]) == 0
  out = capsys.readouterr().out
  assert "float16 -> float32" in out and "WRONG" not in out
  assert len([l for l in out.splitlines() if l.startswith("| 0 ")]) == 1
  # float32 operands: the TF32 tolerance, and draws sized at 4 bytes.
  assert sweep.main(["--seed", "3", "--cases", "1", "--iterations", "1",
                     "--dims", "16,64", "--max_lax_ms", "0.01",
                     "--dtype", "float32"]) == 0
  out = capsys.readouterr().out
  assert "float32" in out and "WRONG" not in out
  assert all(4 * (c[1].layer.groups * c[1].layer.k * c[1].layer.n
                  + c[1].layer.rows * (c[1].layer.k + c[1].layer.n))
             <= sweep.MAX_BYTES
             for c in sweep.draw_cases(3, 20, 25.0, dtype="float32"))
  assert sweep.main(["--seed", "3", "--cases", "1", "--iterations", "1",
                     "--dims", "16,64", "--max_lax_ms", "0.01",
                     "--dtype", "float8_e4m3fn"]) == 0
  out = capsys.readouterr().out
  assert "float8_e4m3fn -> bfloat16" in out and "WRONG" not in out


def test_random_ragged_sweep_times_the_kernels_too_and_the_fit_reads_them(
    capsys, tmp_path):
  """`--kernels_too` adds a `mosaic` column; `ragged_cost_fit` takes the
  kernels' time from it (not auto's, which may be XLA's), at the config of
  today's heuristic."""
  from experiments.lab import ragged_cost_fit
  from experiments.lab import random_ragged_sweep as sweep
  assert sweep.main(["--seed", "3", "--cases", "1", "--iterations", "1",
                     "--dims", "16,64", "--max_lax_ms", "0.01",
                     "--kernels_too"]) == 0
  out = capsys.readouterr().out
  assert ragged_cost_fit.KERNELS_HEADER in out and "WRONG" not in out
  row = next(l for l in out.splitlines() if l.startswith("| 0 "))
  assert row.count("|") == 10 and "| - |" not in row
  table = tmp_path / "kernels_seed7.txt"
  table.write_text(
      "# jax, GPU, CUPTI median of 20, seed 7, dims 16,8192, bfloat16\n"
      + ragged_cost_fit.KERNELS_HEADER + " auto / lax | lax error | auto "
      "error | mosaic error | auto runs |\n"
      "| 0 g4 m512 k256 n256 even forward | 10.0 | 10.1 | 7.5 | 1.01 | "
      "1e-3 | 1e-3 | 1e-3 | xla |\n")
  (draw,) = ragged_cost_fit.read_draws([str(table)])
  assert (draw.seed, draw.lax_us, draw.auto_us) == (7, 10.0, 7.5)
  assert draw.at_run_config and draw.problem.groups == 4


def test_random_ragged_sweep_times_named_problems(capsys):
  """`--problems` times the labels it is given, in the draws' form, and
  names a malformed one."""
  from experiments.lab import random_ragged_sweep as sweep
  label, case, sizes = sweep.parse_case("g3 m50 k24 n40 zipf drhs", 1)
  assert (label, case.layer.groups, case.layer.rows, case.direction) == (
      "g3 m50 k24 n40 zipf drhs", 3, 50, "drhs") and sizes.sum() == 50
  assert sweep.main(["--problems", "g2 m40 k16 n24 even forward; "
                     "g3 m30 k24 n16 random dlhs", "--iterations",
                     "1"]) == 0
  rows = [line for line in capsys.readouterr().out.splitlines()
          if line.startswith("| 0 g2 m40") or line.startswith("| 1 g3 m30")]
  assert len(rows) == 2 and all("| - |" not in row for row in rows)
  with pytest.raises(SystemExit, match="--problems: 'g2 m40 k16'"):
    sweep.main(["--problems", "g2 m40 k16"])
  with pytest.raises(SystemExit, match="--only"):
    sweep.main(["--problems", "g2 m40 k16 n24 even forward", "--only", "0"])


def test_xla_path_overhead_times_every_way(capsys):
  import jax.numpy as jnp
  import numpy as np

  from experiments.lab import xla_path_overhead as probe
  assert probe.main(["--problems", "g2 m40 k16 n24 even drhs",
                     "--iterations", "1", "--forms"]) == 0
  (row,) = [l for l in capsys.readouterr().out.splitlines()
            if l.startswith("| g2 m40")]
  assert row.count("|") == 9 + len(probe.FORMS) and "| - |" not in row
  sizes = jnp.array([3, -2, 0, 5], jnp.int32)
  for form in probe.FORMS.values():
    np.testing.assert_array_equal(form(sizes), [3, 0, 0, 5])


def test_tiled_partial_span_probe_reports_each_layout_and_width(capsys):
  from experiments.lab import tiled_partial_span_probe as probe
  assert probe.main(["--widths", "128,200"]) == 0
  lines = capsys.readouterr().out.splitlines()
  assert len(lines) == 4 and lines[0] == "tiled N=128: lowers"
  with pytest.raises(SystemExit, match="--widths"):
    probe.main(["--widths", "0"])


def test_split_k_check_times_both_configs_and_skips_unsplit_cases(capsys):
  from experiments.lab import split_k_check
  assert split_k_check.main([
      "--cases", "g2 m20 k2048 n128 zipf forward;g64 m4096 k64 n64 even "
      "forward", "--iterations", "1"]) == 0
  out = capsys.readouterr().out
  rows = [l for l in out.splitlines() if l.startswith("| g2 m20")]
  assert len(rows) == 1 and "| - |" not in rows[0] and "WRONG" not in out
  assert "g64 m4096 k64 n64 even forward: the heuristic does not split it" \
      in out
  with pytest.raises(SystemExit, match="--cases: 'g2 m20 k64 n64 diagonal"):
    split_k_check.main(["--cases", "g2 m20 k64 n64 diagonal forward"])


def _lax_ragged_case(rows, k, n, direction, sizes):
  """(problem, lhs, rhs, XLA's float32 result) of a grouped GEMM of
  `sizes`' groups on random bfloat16 operands."""
  import jax
  import jax.numpy as jnp

  from pallas_gemm.ragged_dot import arg_specs
  layer = arg_specs.MoeLayer("g", len(sizes), rows, k, n)
  problem = arg_specs.MoeCase(layer, "even", direction).problem
  keys = jax.random.split(jax.random.key(1), 2)
  lhs = jax.random.normal(keys[0], problem.lhs_shape, jnp.bfloat16)
  rhs = jax.random.normal(keys[1], problem.rhs_shape, jnp.bfloat16)
  out = jax.lax.ragged_dot_general(lhs, rhs, jnp.asarray(sizes),
                                   problem.dimension_numbers,
                                   preferred_element_type=jnp.float32)
  return problem, lhs, rhs, out


@pytest.mark.parametrize("direction", ["forward", "dlhs", "drhs"])
def test_random_ragged_sweep_check_sees_a_wrong_middle_group(direction):
  import numpy as np

  from experiments.lab import random_ragged_sweep as sweep
  sizes = np.array([20, 0, 30, 15, 0], np.int32)  # 5 rows in no group
  problem, lhs, rhs, out = _lax_ragged_case(70, 24, 40, direction, sizes)
  assert sweep.sampled_error(problem, lhs, rhs, sizes, out) < 1e-6
  wrong = (out.at[30:40].add(1.0) if problem.mode == "rows"
           else out.at[2, 5:9].add(1.0))
  assert sweep.sampled_error(problem, lhs, rhs, sizes, wrong) > 1e-2
  stray = (out.at[68].set(1.0) if problem.mode == "rows"
           else out.at[1].set(1.0))  # a row in no group / an empty group
  assert sweep.sampled_error(problem, lhs, rhs, sizes, stray) > 1e-2


@pytest.mark.parametrize("direction", ["forward", "drhs"])
def test_random_ragged_sweep_check_sees_the_one_hot_group(direction):
  """With more groups than it spreads its check over, the one group with
  rows is checked too, not only the empty ones' zeros."""
  import numpy as np

  from experiments.lab import random_ragged_sweep as sweep
  groups = 2 * sweep.CHECKED_GROUPS
  sizes = np.zeros(groups, np.int32)
  missed = np.setdiff1d(np.arange(groups),
                        sweep._spread(groups, sweep.CHECKED_GROUPS))[0]
  sizes[missed] = 30
  problem, lhs, rhs, out = _lax_ragged_case(30, 16, 24, direction, sizes)
  assert sweep.sampled_error(problem, lhs, rhs, sizes, out) < 1e-6
  assert sweep.sampled_error(problem, lhs, rhs, sizes, out * 2) > 1e-2


def test_ragged_cost_fit_refits_the_shipped_terms_and_replays_them(capsys):
  """The committed H200 draws refit the shipped terms, and on the held-out
  seeds the shipped choice leaves at most one draw in fifteen slower than
  lax and one in twenty switched to XLA where the kernels were faster."""
  import re

  from experiments.lab import ragged_cost_fit
  from pallas_gemm.ragged_dot import cost_model
  assert ragged_cost_fit.main([]) == 0
  out = capsys.readouterr().out
  fitted = re.search(r"fitted MOSAIC_TERMS = \(([^)]*)\)", out).group(1)
  assert [float(v) for v in fitted.split(",")] == pytest.approx(
      cost_model.MOSAIC_TERMS, rel=0.02)
  for form, terms in cost_model.XLA_TERMS.items():
    line = re.search(rf"fitted XLA_TERMS\['{form}'\] = \(([^)]*)\)", out)
    assert [float(v) for v in line.group(1).split(",")] == pytest.approx(
        terms, rel=0.02, abs=1e-3)
  held_out = re.search(r"shipped terms, margin [\d.]+, held out: (\d+) draws"
                       r".*slower than lax by >5 %: (\d+) -> (\d+);.*"
                       r"geometric mean ([\d.]+) -> ([\d.]+); \d+ switched "
                       r"to xla, (\d+) of them wrongly", out)
  draws, before, after, geo_before, geo_after, wrong = held_out.groups()
  assert int(draws) >= 40 and int(before) >= 15
  # As shares: the held-out draws grow with each `--kernels_too` table.
  assert int(after) <= int(draws) / 15 and int(wrong) <= int(draws) / 20
  assert float(geo_after) < float(geo_before)


def test_fp8_holdout_replays_the_whole_rule_over_committed_measurements(
    capsys):
  """Each fp8 problem of a committed measurements file is resolved through
  dispatch._resolve against the table folded without it and scored."""
  sys.path.insert(0, str(REPO_ROOT))
  from experiments.lab import fp8_holdout
  folder = REPO_ROOT / "experiments" / "results" / "nvidia_h100" / "dispatch"
  assert fp8_holdout.main([str(folder), "--details"]) == 0
  out = capsys.readouterr().out
  assert "fp8 problems, leave-one-out through dispatch._resolve" in out
  assert "| scored | geomean | min |" in out
