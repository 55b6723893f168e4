"""Measures which kernel is fastest, xla included, and writes the dispatch table.

    PYTHONPATH=. python3 experiments/build_dispatch_table.py \
        --out_dir=experiments/results/nvidia_h100/dispatch --budget_s=240

For each problem of a deterministic training set (`training_problems`, seeded
by `--seed`; deliberately not the `wide` suite the dispatch is judged on), it
times `xla` and every kernel of the device's automatic order that supports the
problem, each with the config `dispatch.resolve` gives it, over rotated
operand sets (CUPTI kernel time, median). Every measurement is appended to
`<out_dir>/measurements.jsonl` at once, so a run that stops (its budget, the
device call's limit) is resumed by running the same command again: measured
problems are skipped. `--chunk=I/N` measures every N-th problem from the
I-th, so that chunks fit separate device calls. `--refresh` also measures
again the problems whose rows are stale (`stale`): a kernel registered
since, or a config that has changed since.

At the end (and with `--table_only`, from the file alone) the measurements are
folded into buckets (`dispatch.DispatchKey`): a bucket's winner is the kernel
with the best geometric-mean speed-up over xla among those that beat xla by
`--min_gain` on every problem measured in the bucket; otherwise xla. The
"dispatch" section of `pallas_gemm/tuned/<gpu>.json` is replaced with these
buckets, with the command, device, jax version and git sha in its "meta".
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import random
import sys
import time

_REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_REPO_ROOT))

import jax  # noqa: E402

import pallas_gemm  # noqa: E402
from pallas_gemm import autotune, dispatch, registry, timing  # noqa: E402
from pallas_gemm.devices import device_key  # noqa: E402
from pallas_gemm.problem import FP8_DTYPES, Epilogue, GemmProblem  # noqa: E402

from experiments.bench import fp8_targets  # noqa: E402
from experiments.bench.output import git_revision  # noqa: E402

FIELDS = ("batch", "m", "n", "k", "in_dtype", "layout", "epilogue")


def _log_uniform(rng: random.Random, low: int, high: int, multiple: int) -> int:
  value = math.exp(rng.uniform(math.log(low), math.log(high)))
  return max(multiple, int(round(value / multiple)) * multiple)


#: The regimes of a training set, in the order they are drawn (new regimes
#: go last, so that a seed's earlier problems stay what was measured).
TRAINING_REGIMES = ("decode", "small", "mid", "large", "llm", "batched",
                    "transposed", "f16", "tf32", "fused", "unaligned",
                    "fp8_decode", "fp8_mid", "fp8_large", "decode_wide",
                    "few_tiles", "attention", "unaligned_wide",
                    "unaligned_layouts", "unaligned_b_or_c",
                    "unaligned_fp8_rows", "unaligned_ub8", "fp8_transposed",
                    "unaligned_ub8_round", "fp8_narrow")
#: The fp8 problems' scales (`experiments/bench/fp8_targets.FP8_SCALINGS`):
#: unscaled, and one scale per tensor, the form fp8 training and serving
#: use most. A spec without "scales" is unscaled.
FP8_TRAINING_SCALINGS = ("none", "tensor")


def training_problems(seed: int = 20261123,
                      regimes: tuple[str, ...] | None = None) -> list[dict]:
  """The problems the table is measured on: each regime a user meets
  (decode, small, mid, large, LLM projections, batched, transposed
  layouts, f16, TF32, fused epilogues, unaligned sizes, attention's
  per-head products), sizes drawn log-uniformly so that they fall between
  any list's round numbers.

  `regimes` keeps only those regimes' problems (default: all). Every regime
  is still drawn, so a problem is the same whichever regimes are kept, and a
  seed's decode problems can be measured on their own (where a kernel's lead
  varies most between neighbouring shapes and more points pay most)."""
  unknown = set(regimes or ()) - set(TRAINING_REGIMES)
  if unknown:
    raise ValueError(f"regimes={sorted(unknown)} not among {TRAINING_REGIMES}")
  rng = random.Random(seed)
  out = []
  regime = ""

  def add(m, n, k, *, batch=1, dtype="bfloat16", layout="NN",
          epilogue="plain", scales=None):
    if regimes is None or regime in regimes:
      spec = dict(batch=batch, m=m, n=n, k=k, in_dtype=dtype,
                  layout=layout, epilogue=epilogue)
      if scales is not None:
        spec["scales"] = scales
      out.append(spec)

  regime = "decode"
  for _ in range(8):
    add(rng.choice((1, 8, 16, 32, 64, 128)), _log_uniform(rng, 2048, 32768, 128),
        _log_uniform(rng, 2048, 16384, 128))
  regime = "small"
  for _ in range(8):
    add(*(_log_uniform(rng, 256, 2048, 64) for _ in range(3)))
  regime = "mid"
  for _ in range(8):
    add(*(_log_uniform(rng, 1024, 6144, 128) for _ in range(3)))
  regime = "large"
  for _ in range(6):
    add(*(_log_uniform(rng, 4096, 16384, 256) for _ in range(3)))
  regime = "llm"  # LLM projections: tokens not a multiple of 128
  for _ in range(10):
    tokens = _log_uniform(rng, 1000, 9000, 8) + rng.choice((0, 8, 24))
    hidden = rng.choice((2048, 3072, 4096, 5120, 8192))
    ffn = rng.choice((5632, 11008, 13824, 14336, 18944, 28672))
    vocab = rng.choice((32000, 65536, 128256, 151936))
    n, k = rng.choice(((ffn, hidden), (hidden, ffn), (3 * hidden, hidden),
                       (vocab, hidden)))
    add(tokens, n, k)
  regime = "batched"
  for _ in range(6):
    add(_log_uniform(rng, 256, 4096, 64), _log_uniform(rng, 64, 4096, 64),
        _log_uniform(rng, 64, 2048, 64), batch=rng.choice((4, 8, 16, 32, 64)))
  regime = "transposed"
  for layout in ("NT", "NT", "NT", "TN", "TN", "NT"):
    add(*(_log_uniform(rng, 1024, 16384, 128) for _ in range(3)), layout=layout)
  regime = "f16"
  for _ in range(4):
    add(*(_log_uniform(rng, 1024, 8192, 128) for _ in range(3)),
        dtype="float16")
  regime = "tf32"
  for _ in range(4):
    add(*(_log_uniform(rng, 1024, 8192, 128) for _ in range(3)),
        dtype="float32")
  regime = "fused"  # bias + gelu
  for _ in range(4):
    add(*(_log_uniform(rng, 1024, 8192, 128) for _ in range(3)),
        epilogue="bias_gelu")
  regime = "unaligned"
  for _ in range(4):
    add(_log_uniform(rng, 1024, 8192, 1) | 1, _log_uniform(rng, 1024, 8192, 1),
        _log_uniform(rng, 1024, 8192, 1) | 1)
  # fp8 (e4m3, bf16 out): both weight layouts, unscaled and per-tensor
  # scales; N and K multiples of 16 (cuBLASLt's fp8 and the TMA need
  # 16-byte rows), M anything.
  for regime, count, m_range, nk_range in (
      ("fp8_decode", 8, (1, 256), (2048, 16384)),
      ("fp8_mid", 8, (512, 6144), (1024, 8192)),
      ("fp8_large", 6, (4096, 16384), (4096, 16384))):
    for _ in range(count):
      m = _log_uniform(rng, *m_range, 1)
      n, k = (_log_uniform(rng, *nk_range, 128) for _ in range(2))
      add(m, n, k, dtype="float8_e4m3fn", layout=rng.choice(("NN", "NT")),
          scales=rng.choice(FP8_TRAINING_SCALINGS))
  # Decode beyond "decode"'s N and K: LM heads (vocabularies to 160k
  # columns) and the down projections of large FFNs (K to 32k), at the
  # batch sizes of serving, where no bucket lay within an octave.
  regime = "decode_wide"
  for _ in range(8):
    add(rng.choice((1, 2, 4, 8, 16, 32, 48, 64, 96, 128)),
        _log_uniform(rng, 2048, 163840, 128), _log_uniform(rng, 4096, 32768, 128))
  # Problems of a few output tiles, below and around "small"'s range (K
  # down to 64, M down to 64, sizes in 16s), a third of them batched: where
  # cuBLAS takes 5-15 us for a few microseconds of work and a kernel that
  # splits K over the idle SMs (`mosaic/split_k`) can win, so that its
  # buckets are not an octave apart.
  regime = "few_tiles"
  for _ in range(12):
    add(*(_log_uniform(rng, 64, 2048, 16) for _ in range(3)),
        batch=rng.choice((1, 1, 1, 1, 2, 4, 8, 16, 32, 64)))
  # Attention's batched products, one per head: scores (queries x head
  # dim) against keys, stored (keys, head dim) as models keep them (NT) or
  # already transposed (NN), and the probabilities times the values
  # (queries x keys) @ (keys x head dim). "batched" draws all three sizes
  # freely; these have one side at a head dimension, sequence lengths in
  # 16s (not just whole tiles) and head counts of real models.
  regime = "attention"
  for i in range(12):
    seq_q, seq_k = (_log_uniform(rng, 128, 4096, 16) for _ in range(2))
    head = rng.choice((64, 64, 80, 96, 128, 128, 256))
    heads = rng.choice((4, 8, 12, 16, 24, 32, 40, 64))
    if i % 2 == 0:
      add(seq_q, seq_k, head, batch=heads, layout=rng.choice(("NN", "NT")))
    else:
      add(seq_q, head, seq_k, batch=heads)
  # Rows that are not 16-byte units away from "unaligned"'s sizes: one to a
  # thousand rows, outputs from 16 columns, and fp8 (whose other regimes
  # keep 16-byte rows). Until measured, the class rule's reach and fp8's
  # aligned twin decide there (`dispatch._below_measured`,
  # `dispatch._aligned_twin`).
  regime = "unaligned_wide"
  for _ in range(8):
    add(rng.choice((1, 4, 16, 64, 256, 1024)),
        _log_uniform(rng, 16, 16384, 1) | 1, _log_uniform(rng, 256, 8192, 8),
        layout=rng.choice(("NN", "NT")))
  for _ in range(8):
    add(_log_uniform(rng, 1, 8192, 1), _log_uniform(rng, 64, 16384, 1) | 1,
        _log_uniform(rng, 512, 8192, 16), dtype="float8_e4m3fn",
        layout=rng.choice(("NN", "NT")),
        scales=rng.choice(FP8_TRAINING_SCALINGS))
  # "unaligned"'s sizes with the other stored layouts: B stored (n, k), as
  # weights are kept (an LM head of an odd vocabulary), and A stored
  # transposed, as weight gradients read it.
  regime = "unaligned_layouts"
  for _ in range(10):
    add(_log_uniform(rng, 512, 8192, 1), _log_uniform(rng, 512, 16384, 1) | 1,
        _log_uniform(rng, 512, 8192, 1), layout=rng.choice(("NT", "TN")))
  # A's rows whole 16-byte units and an odd N: B's rows misaligned (NN,
  # TN; `dispatch.alignment`'s "ub") or only the output's (NT, "uc"), the
  # classes where cuBLAS's speed differs from "ua"'s.
  regime = "unaligned_b_or_c"
  for layout in ("NN", "TN", "NT") * 4:
    m, k = (_log_uniform(rng, 256, 8192, 8) for _ in range(2))
    add(m, _log_uniform(rng, 64, 32768, 1) | 1, k, layout=layout)
  # fp8 of unaligned rows from decode to mid sizes in all three layouts,
  # where mosaic/fp8 with its pads wins or loses by the shape (measure
  # with DISPATCH_KERNELS=mosaic/fp8: the default kernels take no fp8).
  regime = "unaligned_fp8_rows"
  for layout in ("NN", "TN", "NT") * 4:
    add(_log_uniform(rng, 16, 1024, 1), _log_uniform(rng, 64, 16384, 1) | 1,
        _log_uniform(rng, 256, 8192, 16), dtype="float8_e4m3fn",
        layout=layout, scales=rng.choice(FP8_TRAINING_SCALINGS))
  # B's rows at 8-byte units, A's whole 16-byte units (`dispatch.alignment`'s
  # "ub8"), M and K in 8s ("unaligned_ub8_round" draws them in 256s).
  regime = "unaligned_ub8"
  for layout in ("NN", "TN") * 4:
    m, k = (_log_uniform(rng, 256, 8192, 8) for _ in range(2))
    add(m, _log_uniform(rng, 256, 16384, 8) + 4, k, layout=layout)
  # fp8 with A stored transposed (k, m), as a weight gradient reads the
  # activations, rows aligned: cuBLASLt's fp8 GEMM takes A stored (m, k),
  # so XLA transposes A first. Measure with DISPATCH_KERNELS=mosaic/fp8.
  regime = "fp8_transposed"
  for _ in range(10):
    add(_log_uniform(rng, 16, 16384, 16),
        *(_log_uniform(rng, 512, 16384, 128) for _ in range(2)),
        dtype="float8_e4m3fn", layout="TN",
        scales=rng.choice(FP8_TRAINING_SCALINGS))
  # "unaligned_ub8"'s class with M and K in whole 256s, as model widths
  # are: cuBLAS takes another path there than at M and K in 8s.
  regime = "unaligned_ub8_round"
  for layout in ("NN", "TN") * 4:
    m, k = (_log_uniform(rng, 256, 16384, 256) for _ in range(2))
    add(m, _log_uniform(rng, 256, 16384, 8) + 4, k, layout=layout)
  # fp8 with a narrow output (16-512 columns) of many rows in all three
  # layouts, widths drawn freely (aligned or not), as fp8 weight gradients
  # and small heads are: no other fp8 regime draws N below 512 at more
  # than a thousand rows, so the rule's reach stopped short of them. Half
  # the widths are whole 16-byte units.
  regime = "fp8_narrow"
  for layout in ("NN", "TN", "NT") * 4:
    add(_log_uniform(rng, 1024, 16384, 16),
        _log_uniform(rng, 16, 512, rng.choice((1, 16))),
        _log_uniform(rng, 512, 8192, 16), dtype="float8_e4m3fn",
        layout=layout, scales=rng.choice(FP8_TRAINING_SCALINGS))
  return out


def to_problem(spec: dict) -> GemmProblem:
  epilogue = (Epilogue(has_bias=True, activation="gelu")
              if spec["epilogue"] == "bias_gelu" else Epilogue())
  dtype = spec["in_dtype"]
  out_dtype = ("float32" if epilogue.has_bias else
               "bfloat16" if dtype in FP8_DTYPES else dtype)
  problem = GemmProblem(
      spec["batch"], spec["m"], spec["n"], spec["k"], dtype, out_dtype,
      transpose_a=spec["layout"][0] == "T",
      transpose_b=spec["layout"][1] == "T",
      precision="tf32" if dtype == "float32" else "default",
      epilogue=epilogue)
  return fp8_targets.with_scaling(problem, spec.get("scales", "none"))


def spec_id(spec: dict) -> str:
  fields = [str(spec[f]) for f in FIELDS]
  if spec.get("scales", "none") != "none":
    fields.append(f"scales={spec['scales']}")
  return "|".join(fields)


def candidates(problem: GemmProblem, device, only=None) -> list[str]:
  names = ["xla"]
  for name in registry.auto_order(device, problem):
    entry = registry._REGISTRY.get(name)
    if name == "xla" or entry is None or (only and name not in only):
      continue
    if registry.why_unsupported(entry, problem, device) is None:
      names.append(name)
  return names


def time_kernel(problem: GemmProblem, kernel: str, device, iterations: int,
                config=None):
  """Median ms per call of `kernel` with `config`, by default the config a
  call would get."""
  if config is None:
    config = dispatch.resolve(problem, device, kernel).config
  sets = []
  for seed in range(timing.operand_set_count(problem, device.is_gpu)):
    a, b, c, bias = timing.random_operands(problem, seed=seed)
    if problem.batch == 1:
      a, b = a[0], b[0]
    sets.append((a, b, bias))
  kwargs = dict(kernel=kernel, config=config,
                transpose_a=problem.transpose_a,
                transpose_b=problem.transpose_b,
                preferred_element_type=problem.out_dtype,
                activation=problem.epilogue.activation,
                precision=(jax.lax.Precision.DEFAULT
                           if problem.precision == "tf32" else None),
                **fp8_targets.scaled_kwargs(problem))
  ms = timing.time_over_sets(
      lambda a, b, bias: pallas_gemm.matmul(a, b, bias=bias, **kwargs), sets,
      iterations=iterations, on_gpu=device.is_gpu)
  return ms, config


def read_measurements(path: pathlib.Path) -> list[dict]:
  """The rows of a measurements file, the latest per problem and device:
  a row measured again (`--refresh`) replaces the earlier one, which stays
  in the file as history."""
  latest = {}
  for line in path.read_text().splitlines():
    if line.strip():
      row = json.loads(line)
      latest[(row.get("device"), spec_id(row["spec"]))] = row
  return list(latest.values())


def stale(row: dict, device, only=None) -> str | None:
  """Why a measured row no longer says what its problem would run, or
  None: a candidate kernel it never timed (one registered since), or a
  kernel whose config, as `dispatch.resolve` gives it now, differs from
  the one it was timed with (a changed heuristic or tuning entry)."""
  problem = to_problem(row["spec"])
  for kernel in candidates(problem, device, only):
    if kernel not in row["ms"]:
      return f"{kernel} not timed"
    recorded = row.get("configs", {}).get(kernel)
    if recorded is not None and not _same_config(
        recorded, dispatch.resolve(problem, device, kernel).config):
      return f"{kernel}'s config changed"
  return None


def _same_config(recorded: dict, config) -> bool:
  """Whether a config recorded as JSON is `config`. A field the class has
  dropped since is ignored; one it has gained counts as its default."""
  current = autotune.config_to_json(config)
  defaults = autotune.config_to_json(type(config)())
  return all(recorded.get(name, defaults.get(name)) == value
             for name, value in current.items())


def fold(measurements: list[dict], min_gain: float) -> dict[str, dict]:
  """Bucket records from per-problem timings (see the module docstring)."""
  buckets: dict[str, list[dict]] = {}
  for row in measurements:
    key = dispatch.DispatchKey.for_problem(to_problem(row["spec"])).name
    buckets.setdefault(key, []).append(row)
  table = {}
  for key, rows in sorted(buckets.items()):
    kernels = set.intersection(*(set(r["ms"]) for r in rows))
    best, best_score = "xla", 0.0
    ratios = {}
    for kernel in sorted(kernels - {"xla"}):
      per_problem = [r["ms"]["xla"] / r["ms"][kernel] for r in rows]
      ratios[kernel] = per_problem
      geomean = math.exp(sum(map(math.log, per_problem)) / len(per_problem))
      if min(per_problem) >= min_gain and geomean > best_score:
        best, best_score = kernel, geomean
    record = {"kernel": best, "problems": [r["problem"] for r in rows],
              "ratio_to_xla": (min(ratios[best]) if best != "xla" else 1.0),
              "ratios": {k: [round(x, 4) for x in v]
                         for k, v in ratios.items()}}
    if best != "xla":
      # The config each problem was measured with: it serves that problem
      # only (an unmeasured shape gets its kernel's own choice, see
      # dispatch._from_table).
      record["configs"] = {r["problem"]: r["configs"].get(best) for r in rows}
    table[key] = record
  return table


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out_dir", required=True,
                      help="folder for measurements.jsonl (resumable)")
  parser.add_argument("--seed", type=int, default=20261123)
  parser.add_argument("--regimes", default="",
                      help="comma-separated regimes of the training set to "
                      f"measure (default: all of {', '.join(TRAINING_REGIMES)})")
  parser.add_argument("--chunk", default="0/1", help="I/N: every N-th problem")
  parser.add_argument("--budget_s", type=float, default=240.0,
                      help="start no new problem after this many seconds")
  parser.add_argument("--iters", type=int, default=20)
  parser.add_argument("--min_gain", type=float, default=1.01,
                      help="a kernel must beat xla by this on every problem "
                      "of a bucket to win it (timing noise is ~1%%)")
  parser.add_argument("--kernels", default="",
                      help="comma-separated kernels to consider (default: "
                      "the device's automatic order)")
  parser.add_argument("--refresh", action="store_true",
                      help="measure again a problem whose row is stale: a "
                      "candidate kernel it never timed, or a kernel whose "
                      "config has changed since (the newer row replaces "
                      "it; the old one stays in the file)")
  parser.add_argument("--refresh_problems", default="",
                      help="a file of spec ids (one per line, as "
                      "`spec_id` writes them): measure exactly these "
                      "problems again, whatever seed drew them, e.g. the "
                      "ones a kernel change affects")
  parser.add_argument("--table_only", action="store_true",
                      help="measure nothing; rebuild the table from the file")
  parser.add_argument("--allow_cpu", action="store_true",
                      help="measure on a CPU (wall clock, interpret mode): "
                      "for the tests only")
  parser.add_argument("--limit", type=int, default=0,
                      help="measure at most this many problems (0: all)")
  parser.add_argument("--table", default="",
                      help="where to write the table (default: the package's "
                      "pallas_gemm/tuned/<gpu>.json)")
  args = parser.parse_args(argv)
  try:
    index, count = (int(x) for x in args.chunk.split("/"))
    if not 0 <= index < count:
      raise ValueError
  except ValueError:
    parser.error(f"--chunk={args.chunk!r} must be I/N with 0 <= I < N")
  if args.min_gain < 1.0:
    parser.error(f"--min_gain={args.min_gain} must be >= 1.0")
  only = {k.strip() for k in args.kernels.split(",") if k.strip()} or None
  for name in only or ():
    registry.get_kernel(name)

  out_dir = pathlib.Path(args.out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  log_path = out_dir / "measurements.jsonl"
  device = pallas_gemm.device_info()
  done = {}
  if log_path.exists():
    for row in read_measurements(log_path):
      if row.get("device") == device.device_kind or args.table_only:
        done[spec_id(row["spec"])] = row
  regimes = tuple(r.strip() for r in args.regimes.split(",") if r.strip())
  forced = set()
  if not args.refresh_problems:
    try:
      specs = training_problems(args.seed, regimes or None)[index::count]
    except ValueError as err:
      parser.error(f"--regimes={args.regimes!r}: {err}")
  else:
    if regimes:
      parser.error("--regimes picks problems from a seed's training set; "
                   "--refresh_problems lists them itself")
    listed = [line.strip() for line in
              pathlib.Path(args.refresh_problems).read_text().splitlines()
              if line.strip()]
    unknown = [i for i in listed if i not in done]
    if unknown:
      parser.error(f"--refresh_problems: {len(unknown)} ids with no row "
                   f"measured on {device.device_kind}, e.g. {unknown[0]!r}")
    forced = set(listed)
    specs = [done[i]["spec"] for i in listed][index::count]
  start = time.perf_counter()
  if not args.table_only:
    if not device.is_gpu and not args.allow_cpu:
      parser.error("measuring needs a GPU (use --table_only on a CPU)")
    todo = []
    for spec in specs:
      row = done.get(spec_id(spec))
      if spec_id(spec) in forced:
        # Resuming: a row already measured again at this revision is done.
        if row.get("git_sha") != git_revision():
          todo.append(spec)
        continue
      if row is None:
        todo.append(spec)
        continue
      why = stale(row, device, only) if args.refresh else None
      if why:
        print(f"measuring again {row['problem']}: {why}", flush=True)
        todo.append(spec)
    if args.limit:
      todo = todo[:args.limit]
    print(f"{len(specs)} problems in chunk {args.chunk}, {len(todo)} to "
          f"measure on {device.device_kind}", flush=True)
    for number, spec in enumerate(todo, 1):
      if time.perf_counter() - start > args.budget_s:
        print(f"budget of {args.budget_s:.0f}s spent; {len(todo) - number + 1}"
              " problems left: run the same command again to resume",
              flush=True)
        break
      problem = to_problem(spec)
      names = candidates(problem, device, only)
      if names == ["xla"] and candidates(problem, device) != names:
        # --kernels left out every kernel that runs this problem: xla alone
        # would win its bucket unopposed and hide those kernels.
        print(f"[{number}/{len(todo)}] {problem.describe()}: skipped, none "
              f"of --kernels runs it", flush=True)
        continue
      row = {"spec": spec, "problem": problem.describe(),
             "device": device.device_kind, "ms": {}, "configs": {},
             "git_sha": git_revision()}
      for kernel in names:
        try:
          ms, config = time_kernel(problem, kernel, device, args.iters)
        except Exception as err:  # noqa: BLE001 - a failing kernel loses
          print(f"  {kernel}: failed: {type(err).__name__}: {err}"[:300],
                flush=True)
          continue
        row["ms"][kernel] = ms
        row["configs"][kernel] = (None if config is None
                                  else autotune.config_to_json(config))
      if "xla" not in row["ms"]:
        continue
      line = " ".join(f"{k}={row['ms']['xla'] / v:.3f}x"
                      for k, v in row["ms"].items() if k != "xla")
      print(f"[{number}/{len(todo)}] {problem.describe()}: xla "
            f"{row['ms']['xla']:.4f} ms; {line or 'no other kernel'}",
            flush=True)
      with open(log_path, "a") as f:
        f.write(json.dumps(row) + "\n")
      done[spec_id(spec)] = row
  table = fold([r for r in done.values() if r["device"] == device.device_kind
                or args.table_only], args.min_gain)
  command = " ".join(["build_dispatch_table.py", *(argv or sys.argv[1:])])
  if os.environ.get("OUT"):  # the device machine's output folder
    command = command.replace(os.environ["OUT"], "$OUT")
  rows = list(done.values())
  meta = {"command": command,
          "device": ", ".join(sorted({r["device"] for r in rows}))
          or device.device_kind,
          "jax": jax.__version__,
          "git_sha": git_revision(),
          "measured_at_git": sorted({r.get("git_sha", "?") for r in rows}),
          "problems_measured": len(done),
          "min_gain": args.min_gain}
  key = device.key if device.is_gpu else device_key(next(
      (r["device"] for r in done.values()), "cpu"))
  table_path = pathlib.Path(args.table) if args.table else (
      autotune.shipped_path(key))
  autotune.update_section(table_path, "dispatch", table, meta=meta,
                          replace=True)
  wins = sum(1 for r in table.values() if r["kernel"] != "xla")
  print(f"{len(table)} buckets ({wins} won by a pallas_gemm kernel) -> "
        f"{table_path}", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
