"""Not a script: what the grouped-GEMM lab scripts that time ways against
each other share (`mixed_precision_grad.py`, `float32_ragged.py`,
`small_ragged_sweep.py`, `random_ragged_sweep.py`, `split_k_check.py`,
and `ragged_cost_fit.py`'s configs): the layer lookup, the run's time
budget, the calls and timing of the ways, the table's header and rows, and
the config the heuristic gave before `split_k`."""

from __future__ import annotations

import dataclasses
import time

import jax

from experiments import bench_moe
from pallas_gemm import timing
from pallas_gemm.ragged_dot import arg_specs, configs


def suite_layer(name: str):
  """The first layer of any suite whose name starts with `name`."""
  layers = [layer for layer in sum(arg_specs.SUITES.values(), ())
            if layer.name.startswith(name)]
  if not layers:
    raise SystemExit(f"--layers: no layer's name starts with {name!r}")
  return layers[0]


def unsplit_config(problem, device):
  """The heuristic's config for `problem` on `device`, or where it splits
  the reduction (`RaggedConfig.split_k`), the one it gave before it did:
  the "rows" heuristic's, with the same work-list choice."""
  config = configs.heuristic(problem, device)
  if config.split_k == 1:
    return config
  return dataclasses.replace(
      configs._rows_heuristic(problem, device),  # noqa: SLF001
      work_list_kernel=config.work_list_kernel)


def way_call(way: str, problem):
  """jitted fn(lhs, rhs, group_sizes) of `problem` by `way`: "lax"
  (`jax.lax.ragged_dot_general`) or "auto" (`pallas_gemm`'s automatic
  choice), as `bench_moe`'s targets call them."""
  return jax.jit(bench_moe.target_call("xla" if way == "lax" else way,
                                       problem))


def print_header(ways, more_columns, iterations: int, *notes) -> bool:
  """Prints the run's line (jax, device, timing) and the table's header:
  a time column per way, then `more_columns`. Returns whether it runs on
  a GPU (CUPTI timing)."""
  on_gpu = jax.default_backend() == "gpu"
  print(f"# jax {jax.__version__}, {jax.devices()[0].device_kind}, "
        f"{'CUPTI' if on_gpu else 'wall clock'} median of {iterations}"
        + "".join(f", {note}" for note in notes), flush=True)
  print("| case | " + " | ".join(f"{w} (us)" for w in ways) + " | "
        + " | ".join(more_columns) + " |")
  print("|---|" + "---|" * (len(ways) + len(more_columns)), flush=True)
  return on_gpu


class Budget:
  """Start no new case once `seconds` have passed (0: no limit)."""

  def __init__(self, seconds: float):
    self.seconds = seconds
    self.start = time.perf_counter()

  def spent(self) -> bool:
    if self.seconds and time.perf_counter() - self.start > self.seconds:
      print(f"# budget of {self.seconds} s spent: stopping", flush=True)
      return True
    return False


def time_ways(calls, operands, *, iterations: int, on_gpu: bool, label: str):
  """({way: µs}, {way: result}) of each call on `operands`; a call that
  fails is reported and left out, and the run goes on."""
  times, results = {}, {}
  for way, fn in calls.items():
    try:
      results[way] = jax.block_until_ready(fn(*operands))
      times[way] = 1e3 * timing.median_time_ms(
          fn, operands, iterations=iterations, on_gpu=on_gpu)
    except Exception as error:  # noqa: BLE001 - reported, run goes on
      print(f"# {label} {way}: {type(error).__name__}: {str(error)[:200]}",
            flush=True)
  return times, results


def print_row(label: str, ways, times, ratios, errors, error_ways,
              more=()) -> None:
  """One table row: a time per way ("-" where none), the time ratios of
  the (a, b) pairs of `ratios`, the errors of `error_ways`, then the
  `more` cells as given."""
  cell = lambda way: f"{times[way]:.1f}" if way in times else "-"
  ratio = lambda a, b: (f"{times[a] / times[b]:.2f}"
                        if a in times and b in times else "-")
  cells = ([cell(w) for w in ways] + [ratio(a, b) for a, b in ratios]
           + [f"{errors[w]:.1e}" if w in errors else "-" for w in error_ways]
           + [str(c) for c in more])
  print(f"| {label} | " + " | ".join(cells) + " |", flush=True)
