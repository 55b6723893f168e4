"""Runs one case of the `moe` suite through `pallas_gemm.ragged_dot_general`
a few times, checked, so that Nsight Compute can profile the grouped-GEMM
kernel it launches (issue #18: which limit holds the cases below target).

    PYTHONPATH=. python3 experiments/lab/ragged_profile_case.py \
        --case "qwen1.5_moe_up even forward" [--kernel auto] [--calls 2]

    ncu --clock-control none -k regex:mosaic_gpu -s 1 -c 1 \
        --section SpeedOfLight --section MemoryWorkloadAnalysis \
        --section WarpStateStats --section LaunchStats -o case -f \
        python3 experiments/lab/ragged_profile_case.py --case "..."

The first call compiles (and launches the kernel once, which `-s 1` skips);
the rest are what ncu sees. Without ncu, `--time 20` times the call;
with `--versus piece_rows=4096` it also checks and times that config,
interleaved with the first (the heuristic's, or `--config`'s), and with
`--versus_padded_lhs` the first config with its operands padded to whole
8-row tiles (and the forward's output sliced), as before they were read in
place where rows are not a multiple of 8 (`mosaic.lhs_in_place`; in the
weight gradient, lhs and dout: `mosaic_contracting.operands_in_place`). The case is `<layer> <distribution>
<direction>` as `experiments/bench_moe.py` labels it, or a layer of no
suite named `g<experts>_t<rows>_k<K>_n<N>` (e.g. "g64_t8704_k2048_n1408
even forward", 136 rows per expert); `--out_dtype float32` asks for a
float32 output. The output is compared
with float64 on a row sample (`bench_moe.check_error`) so that a profile is
never of a wrong kernel. On a CPU it runs a small layer in interpret mode.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import re
import sys

_ROOT = pathlib.Path(__file__).resolve().parents[2]
if str(_ROOT) not in sys.path:
  sys.path.insert(0, str(_ROOT))

import jax  # noqa: E402

import pallas_gemm  # noqa: E402
from experiments import bench_moe  # noqa: E402
from experiments.bench import timers  # noqa: E402
from pallas_gemm import timing  # noqa: E402
from pallas_gemm.devices import device_info  # noqa: E402
from pallas_gemm.ragged_dot import arg_specs, configs  # noqa: E402


#: A layer of no suite, named by its sizes: g<experts>_t<rows>_k<K>_n<N>.
LAYER_BY_SIZES = re.compile(r"g(\d+)_t(\d+)_k(\d+)_n(\d+)")


def find_case(label: str) -> arg_specs.MoeCase:
  layers = sum(arg_specs.SUITES.values(), ())
  sizes = LAYER_BY_SIZES.fullmatch(label.split(" ")[0])
  if sizes and all(int(size) > 0 for size in sizes.groups()):
    layers += (arg_specs.MoeLayer(sizes.group(0),
                                  *map(int, sizes.groups())),)
  for case in arg_specs.cases(layers):
    if case.label == label:
      return case
  raise SystemExit(f"--case {label!r}: no such case; e.g. "
                   f"{arg_specs.cases(layers)[0].label!r} or "
                   f"'g64_t8704_k2048_n1408 even forward'")


def _at_least_one(text: str) -> int:
  value = int(text)
  if value < 1:
    raise argparse.ArgumentTypeError(f"{value} must be >= 1")
  return value


def config_with_fields(problem, text: str,
                       device=None) -> configs.RaggedConfig:
  """The heuristic's config for `problem` (on `device`, by default this
  machine's) with `text`'s fields replaced (name=value pairs, ints or
  true/false), the ring then made as deep as fits unless `stages` is
  given. A given `out_slots` is kept (the heuristic's own deepening would
  choose the slots again, one where a second costs a stage)."""
  fields = {}
  for pair in text.split(","):
    name, _, value = pair.partition("=")
    lowered = value.strip().lower()
    fields[name.strip()] = (lowered == "true" if lowered in ("true", "false")
                            else int(value))
  config = dataclasses.replace(
      configs.heuristic(problem, device or device_info()), **fields)
  if "stages" in fields:
    return config
  if "out_slots" not in fields:
    return configs._most_stages(config, problem)
  deepest = configs._most_stages(config, problem,
                                 slot_choices=(config.out_slots,))
  # Where no depth fits, _most_stages falls back to other fields.
  if (deepest != dataclasses.replace(config, stages=deepest.stages)
      or not deepest.fits(problem)):
    raise ValueError(f"{text!r}: no ring of at least 2 stages fits beside "
                     f"out_slots={config.out_slots} for {problem}")
  return deepest


def _call(problem, kernel: str, config_text: str):
  """(jitted fn(lhs, rhs, sizes), its name): `kernel` with its own config,
  or the Mosaic kernel with `config_text`'s fields over the heuristic's."""
  if not config_text:
    return jax.jit(bench_moe.target_call(kernel, problem)), kernel
  config = config_with_fields(problem, config_text)
  print(f"config {config_text}: {config}", flush=True)
  numbers = problem.dimension_numbers
  return jax.jit(lambda l, r, s: pallas_gemm.ragged_dot_general(
      l, r, s, numbers, preferred_element_type=problem.out_dtype,
      kernel="mosaic", config=config)), f"mosaic {config_text}"


def _in_place_pair(problem, config_text: str):
  """[(fn, name)] x 2: the Mosaic kernel called directly (the primitive
  decides at lowering, too late for a patch) with the heuristic's config
  (or `config_text`'s fields over it), as is, then with
  `mosaic.lhs_in_place` and `mosaic_contracting.operands_in_place` off
  while it is traced (the operands padded, the forward's output
  sliced)."""
  import jax.numpy as jnp

  from pallas_gemm.ragged_dot import mosaic, mosaic_contracting
  config = (config_with_fields(problem, config_text) if config_text
            else configs.heuristic(problem, device_info()))
  row_offset = jnp.zeros((1,), jnp.int32)

  def direct(lhs, rhs, sizes):
    return mosaic.ragged_matmul(lhs, rhs, sizes, row_offset,
                                problem=problem, config=config,
                                interpret=jax.default_backend() != "gpu")

  # Two functions, not two jits of one: jax.jit caches the trace by the
  # function, so a second jit of `direct` would reuse the first's program
  # and never see the patch below.
  def direct_padded(lhs, rhs, sizes):
    return direct(lhs, rhs, sizes)

  as_is, padded = jax.jit(direct), jax.jit(direct_padded)

  def padded_call(*args):
    patched = ((mosaic, "lhs_in_place"),
               (mosaic_contracting, "operands_in_place"))
    saved = [getattr(module, name) for module, name in patched]
    for module, name in patched:
      setattr(module, name, lambda *_, **__: False)
    try:
      return padded(*args)
    finally:
      for (module, name), value in zip(patched, saved):
        setattr(module, name, value)

  name = f"mosaic {config_text}".strip()
  return [(as_is, name), (padded_call, f"{name} padded lhs")]


def _medians_us(calls, args, iterations: int):
  """CUPTI medians (µs, every kernel of a call) of one or two `calls`; two
  are timed interleaved in ABBA rounds (`experiments/bench/timers`), so
  that clock drift falls on both."""
  rotating = [timers.RotatingCall(fn, [args], on_gpu=True) for fn in calls]
  if len(rotating) == 1:
    timed = [timers.time_on_gpu(rotating[0], iters=iterations, warmup=1,
                                cap_s=0)]
  else:
    timed = timers.time_paired_on_gpu(*rotating, iters=iterations, warmup=1,
                                      cap_s=0)
  return [t.median_us for t in timed]


#: The command line: (flag, argparse keywords).
OPTIONS = (
    ("--case", dict(default="qwen1.5_moe_up even forward")),
    ("--kernel", dict(default="auto", choices=("auto", "mosaic", "xla"))),
    ("--calls", dict(type=_at_least_one, default=2)),
    ("--out_dtype", dict(default="bfloat16", choices=(
        "bfloat16", "float32"), help="the output's dtype")),
    ("--config", dict(default="", help=(
        "RaggedConfig fields over the heuristic's, e.g. "
        "grid_band=16,tile_n=64 (implies --kernel mosaic)"))),
    ("--versus", dict(default="", help=(
        "a second set of RaggedConfig fields over the heuristic's, checked "
        "too and, with --time, timed interleaved with the first"))),
    ("--versus_padded_lhs", dict(action="store_true", help=(
        "the Mosaic kernel (called directly, --config's fields or the "
        "heuristic's) as is and with its operands padded to 8-row tiles "
        "(mosaic.lhs_in_place and mosaic_contracting.operands_in_place "
        "off), checked and timed like --versus; excludes --versus"))),
    ("--breakdown", dict(type=int, default=0, metavar="ITERS", help=(
        "also print each kernel's CUPTI median over ITERS calls (the "
        "work-list ops, the grouped GEMM, a piece merge); GPU only"))),
    ("--time", dict(type=int, default=0, metavar="ITERS", help=(
        "also print the CUPTI median of ITERS calls, every kernel a call "
        "launches (the work list, the grouped GEMM, a piece merge); GPU "
        "only"))),
)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  for flag, keywords in OPTIONS:
    parser.add_argument(flag, **keywords)
  args = parser.parse_args(argv)
  on_gpu = jax.default_backend() == "gpu"
  # On a CPU: a small layer, with the asked-for distribution and direction.
  label = (args.case if on_gpu else
           " ".join(["small_g8_odd"] + args.case.split()[-2:]))
  case = dataclasses.replace(find_case(label), out_dtype=args.out_dtype)
  if args.out_dtype != case.dtype:
    label += f" ({args.out_dtype} output)"
  problem = case.problem
  if args.versus and args.versus_padded_lhs:
    parser.error("--versus and --versus_padded_lhs exclude each other")
  if args.versus_padded_lhs:
    calls = _in_place_pair(problem, args.config)
  else:
    calls = [_call(problem, args.kernel, args.config)]
  if args.versus:
    calls.append(_call(problem, args.kernel, args.versus))
  operands = tuple(bench_moe.operand_sets(problem, case.group_sizes(), 1,
                                          case.seed)[0])
  for fn, name in calls:
    out = None
    for _ in range(args.calls):
      out = jax.block_until_ready(fn(*operands))
    error = bench_moe.check_error(problem, *operands, out)
    print(f"{label}: {name}, {args.calls} calls, relative error "
          f"{error:.1e}", flush=True)
  if args.breakdown and on_gpu:
    for fn, name in calls:
      for kernel, us in timing.kernel_medians_us(
          fn, operands, iterations=args.breakdown):
        print(f"{label}: {name}: kernel {kernel}: {us:.2f} us (CUPTI "
              f"median)", flush=True)
  if args.time and on_gpu:
    medians = _medians_us([fn for fn, _ in calls], operands, args.time)
    for (_, name), us in zip(calls, medians):
      print(f"{label}: {name}: {us:.1f} us (CUPTI median, all kernels)",
            flush=True)
    if len(medians) == 2:
      print(f"{label}: {calls[1][1]} / {calls[0][1]} time = "
            f"{medians[1] / medians[0]:.3f}", flush=True)


if __name__ == "__main__":
  main()
