"""Which is faster on a 16-bit grouped GEMM, the Mosaic kernels or XLA's
ragged product? A cost model for the automatic choice
(`implementations.resolve`), from the problem's shapes alone (the group
sizes are runtime data).

On model layers the kernels win by far (experiments/results/nvidia_h200/
moe). Where they lose is where fixed costs decide: a call of a few
microseconds (the kernels' work-list ops and persistent launch against
XLA's one fusion), and shapes whose rows of weights or output are not whole
64-column spans, which the kernels pad and cut (`copies`: each a launch and
a pass over an operand or the output).

Each way's time is a sum of terms, in microseconds:

  mosaic  fixed + per copy launched + per copied MB + per GFLOP + per MB of
          the operands and output (each read or written once);
  xla     per form (forward, rhs read transposed, weight gradient): fixed +
          per group + per GFLOP done for every group (XLA's product
          multiplies every row by each group's weights) + per MB of the
          lhs, of the output rows (the weight gradient: of its second
          operand) and of the weights (its output), each once per group,
          + per group-GFLOP again where k or n is not a multiple of 8.

`experiments/lab/ragged_cost_fit.py` fits the terms (least squares on
relative error, no term negative) to H200 draws of
`experiments/lab/random_ragged_sweep.py` and grids of
`small_ragged_sweep.py`, and replays the choice on draws held out
(experiments/results/nvidia_h200/random_ragged). Bytes are H200 bytes: on
another GPU the per-MB terms scale with its copy bandwidth. XLA is chosen
only where the model puts it XLA_MARGIN times faster, so that its error
decides nothing close, except on calls it expects XLA to finish in under
SMALL_CALL_US, which are mostly fixed costs (`xla_chosen`).

The choice also holds the kernels' estimate of a weight gradient to a
floor the linear terms cannot see (`chain_floor_us`): where a few output
tiles meet a long reduction, one CTA's steps through its group's rows
are the time, however few the flops. XLA's product is short of tiles
there too, and its estimate is raised to match (`choice_estimates`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_gemm import jaxpr_tools
from pallas_gemm.devices import DeviceInfo, copy_tb_per_s
from pallas_gemm.problem import itemsize
from pallas_gemm.ragged_dot import configs
from pallas_gemm.ragged_dot.problem import RaggedProblem

#: The GPU whose bandwidth the per-MB terms were fitted at.
FITTED_ON = "NVIDIA H200"

#: Mosaic terms: fixed µs, µs per copy launched, per copied MB, per GFLOP,
#: per MB moved once.
MOSAIC_TERMS = (4.85, 1.57, 0.363, 1.18, 0.131)

#: XLA terms per form: fixed µs, per group, per GFLOP x groups, per MB of
#: lhs x groups, of output rows (or, in the weight gradient, of the second
#: operand) x groups, of weights (output) x groups, per GFLOP x groups
#: where k or n is not a multiple of 8.
XLA_TERMS = {
    "forward": (2.75, 0.148, 0.844, 0.574, 0.0123, 0.571, 2.43),
    "transposed": (4.31, 0.177, 0.981, 0.528, 0.0124, 0.908, 3.26),
    "gradient": (3.77, 0.0, 0.72, 0.755, 0.722, 0.223, 3.54),
}

#: XLA must be expected this many times faster to be chosen ...
XLA_MARGIN = 1.3
#: ... except on calls XLA is expected to finish in fewer µs than this,
#: where being expected faster is enough: those are mostly fixed costs
#: (the kernels' work list, pads, persistent launch and cut against XLA's
#: one fusion), which the kernels' estimate undercounts.
SMALL_CALL_US = 5.0


def xla_chosen(mosaic_us: float, xla_us: float,
               margin: float = XLA_MARGIN) -> bool:
  """Whether estimates of `mosaic_us` and `xla_us` choose XLA."""
  return margin * xla_us < mosaic_us or (xla_us < SMALL_CALL_US
                                         and xla_us < mosaic_us)

#: µs one CTA takes per `tile_k`-row step of a weight gradient's
#: reduction where its output tile's steps are the critical path (a few
#: output tiles meet a long reduction): a little under what the small
#: sweep's one-hot weight gradients of 2048 rows took per step
#: (experiments/results/nvidia_h200/random_ragged, section 10).
CHAIN_STEP_US = 0.25
#: Where a weight gradient's chain stands for the kernels' estimate, XLA's
#: is multiplied by this: a little under how low its terms put lax's
#: measured time on such draws (the median draw's), against about right
#: elsewhere (same notes, section 11).
CHAIN_XLA_FACTOR = 1.15
#: A chain of fewer steps is a call's fixed costs, which the terms weigh.
CHAIN_MIN_STEPS = 4

#: 16-bit inputs only: the draws were bfloat16 (float32 and fp8 operands
#: have their own model, `bfloat16_split`).
INPUT_DTYPES = ("bfloat16", "float16")


def form(problem: RaggedProblem) -> str:
  if problem.mode == "contracting":
    return "gradient"
  return "transposed" if problem.transpose_rhs else "forward"


def copies(problem: RaggedProblem, implementation,
           config) -> tuple[int, int]:
  """(launches, bytes) of the copies the path of `implementation` (a
  registered module with `ragged_matmul`) under `config` makes outside its
  kernels for `problem`: its pads of the operands, cuts of the output and
  sums of split_k's partial sums, each a launch that reads and writes its
  bytes once. Read from the traced program itself (every `pad`, `slice`,
  `reduce_sum` and CUT_KERNELS kernel of COPY_MIN_BYTES or more), so it
  follows the kernels' own rules of what they read in place."""
  return _copies(problem, implementation, config)


#: Smaller pads and slices (of the group sizes, the work list) are part of
#: the fixed cost.
COPY_MIN_BYTES = 2**16
#: Pallas kernels that stand for a slice of the output (misaligned rows cut
#: compiled: `tma.unpad_output`), counted as the slice they replace: the
#: terms were fitted with XLA's.
CUT_KERNELS = ("unpad_output",)


@functools.lru_cache(maxsize=1024)
def _copies(problem: RaggedProblem, implementation, config) -> tuple[int, int]:
  spec = jax.ShapeDtypeStruct
  jaxpr = jax.make_jaxpr(
      lambda lhs, rhs, sizes, offset: implementation.ragged_matmul(
          lhs, rhs, sizes, offset, problem=problem, config=config))(
              spec(problem.lhs_shape, problem.in_dtype),
              spec(problem.rhs_shape, problem.in_dtype),
              spec((problem.groups,), jnp.int32), spec((1,), jnp.int32))
  return _copies_in(jaxpr.jaxpr)


def _copies_in(jaxpr) -> tuple[int, int]:
  launches = total = 0
  # A Pallas kernel's own slices are of values in registers.
  for eqn in jaxpr_tools.equations(jaxpr, opaque=("pallas_call",)):
    if eqn.primitive.name in ("pad", "slice", "reduce_sum") or (
        eqn.primitive.name == "pallas_call"
        and eqn.params.get("name") in CUT_KERNELS):
      out = sum(v.aval.size * v.aval.dtype.itemsize for v in eqn.outvars)
      read = (sum(v.aval.size * v.aval.dtype.itemsize for v in eqn.invars)
              if eqn.primitive.name == "reduce_sum" else out)
      if read >= COPY_MIN_BYTES:
        launches, total = launches + 1, total + read + out
  return launches, total


def copies_us(problem: RaggedProblem, implementation, config,
              device: DeviceInfo, mosaic_terms=MOSAIC_TERMS) -> float:
  """µs the `copies` of `implementation` under `config` take on `device`,
  at the shipped per-launch and per-MB terms (or a fit's): what a model of
  the kernels alone (`bfloat16_split.estimated_seconds`) leaves out."""
  launches, copied = copies(problem, implementation, config)
  return mosaic_terms[1] * launches + mosaic_terms[2] * _mb(device) * copied


def mosaic_features(problem: RaggedProblem, implementation, config,
                    device: DeviceInfo) -> tuple[float, ...]:
  """The quantities MOSAIC_TERMS weigh for `implementation` (the Mosaic
  kernels' module) under `config`: 1, copies (launches), copied MB, GFLOP,
  MB moved once (MB at the fitted GPU's bandwidth)."""
  mb = _mb(device)
  launches, copied = copies(problem, implementation, config)
  return (1.0, float(launches), mb * copied, 1e-9 * problem.flops,
          mb * problem.min_bytes)


def xla_features(problem: RaggedProblem,
                 device: DeviceInfo) -> tuple[float, ...]:
  """The quantities XLA_TERMS[form] weigh: 1, groups, GFLOP x groups, MB of
  lhs x groups, MB of the (m, n) operand or output x groups, MB of the
  weights or weight gradient x groups, GFLOP x groups where k or n is not
  a multiple of 8."""
  mb = _mb(device)
  in_size, out_size = itemsize(problem.in_dtype), itemsize(problem.out_dtype)
  g, m, k, n = problem.groups, problem.m, problem.k, problem.n
  contracting = problem.mode == "contracting"
  group_gflop = 1e-9 * g * problem.flops
  return (1.0, float(g), group_gflop, mb * g * m * k * in_size,
          mb * g * m * n * (in_size if contracting else out_size),
          mb * g * k * n * (out_size if contracting else in_size),
          group_gflop * (k % 8 != 0 or n % 8 != 0))


def _mb(device: DeviceInfo) -> float:
  """µs-scaled megabytes: 1e-6, stretched by how much slower `device`
  copies than the GPU the terms were fitted on."""
  return 1e-6 * copy_tb_per_s(FITTED_ON) / copy_tb_per_s(device.device_kind)


def estimated_us(problem: RaggedProblem, implementation, config,
                 device: DeviceInfo, *, mosaic_terms=MOSAIC_TERMS,
                 xla_terms=XLA_TERMS) -> tuple[float, float]:
  """(the Mosaic kernels' `implementation` under `config`, XLA's ragged
  product), in µs, at the shipped terms or others (a fit's)."""
  weigh = lambda terms, values: sum(t * v for t, v in zip(terms, values))
  return (weigh(mosaic_terms, mosaic_features(problem, implementation,
                                              config, device)),
          weigh(xla_terms[form(problem)], xla_features(problem, device)))


def chain_floor_us(problem: RaggedProblem, config,
                   device: DeviceInfo) -> float:
  """A floor under the Mosaic kernels' time of a weight gradient
  ("contracting" mode) under an even routing: one CTA per output tile walks
  its group's rows (or a piece's `piece_rows`, where `config` cuts them)
  `tile_k` rows a step, CHAIN_STEP_US each, in as many waves as the tiles
  of every group fill the SMs; plus the fixed term. The fitted terms
  spread the flops over every SM, so they miss where a few output tiles
  meet a long reduction and the steps are the time. 0 for the "rows"
  mode."""
  if problem.mode != "contracting" or 0 in (problem.m, problem.groups):
    return 0.0
  group_rows = -(-problem.m // problem.groups)
  rows = min(group_rows, config.piece_rows or group_rows)
  tiles = (problem.groups * -(-group_rows // rows)
           * configs.group_output_tiles(problem, config))
  waves = -(-tiles // max(device.planning_sms, 1))
  return MOSAIC_TERMS[0] + waves * CHAIN_STEP_US * -(-rows // config.tile_k)


def _standing_chain_us(problem: RaggedProblem, implementation, config,
                       device: DeviceInfo, mosaic_us: float,
                       mosaic_terms=MOSAIC_TERMS) -> float:
  """The kernels' chain (`chain_floor_us`) after their copies (which run
  before it), where it stands for their estimate `mosaic_us`: it outlasts
  it and is CHAIN_MIN_STEPS steps or more. 0 elsewhere."""
  chain_us = chain_floor_us(problem, config, device)
  if (chain_us <= mosaic_us
      or chain_us - MOSAIC_TERMS[0] < CHAIN_MIN_STEPS * CHAIN_STEP_US):
    return 0.0
  return chain_us + copies_us(problem, implementation, config, device,
                              mosaic_terms)


def _weighed(problem: RaggedProblem, implementation, config,
             device: DeviceInfo, **terms) -> tuple[float, float, bool]:
  """`choice_estimates`, and whether the kernels' chain stands for their
  estimate."""
  mosaic_us, xla_us = estimated_us(problem, implementation, config, device,
                                   **terms)
  chain_us = _standing_chain_us(problem, implementation, config, device,
                                mosaic_us,
                                terms.get("mosaic_terms", MOSAIC_TERMS))
  if chain_us:
    return chain_us, CHAIN_XLA_FACTOR * xla_us, True
  return mosaic_us, xla_us, False


def choice_estimates(problem: RaggedProblem, implementation, config,
                     device: DeviceInfo, **terms) -> tuple[float, float]:
  """`estimated_us` (at the shipped terms or `terms`' others) as the choice
  weighs it. Where the kernels' chain stands for their estimate (it
  outlasts it and is CHAIN_MIN_STEPS steps or more), it replaces it, after
  their copies, and XLA's is raised by CHAIN_XLA_FACTOR: its product then
  also runs few output tiles over a long reduction, which its terms put
  too low."""
  mosaic_us, xla_us, _ = _weighed(problem, implementation, config, device,
                                  **terms)
  return mosaic_us, xla_us


def against_xla(problem: RaggedProblem, implementation, device: DeviceInfo,
                margin: float = XLA_MARGIN) -> tuple[bool, str]:
  """(whether XLA's ragged product is expected `margin` times faster than
  the Mosaic kernels' `implementation` under its heuristic's config, or
  faster on a call under SMALL_CALL_US (`xla_chosen`; an infinite margin
  leaves only that), why: the estimates, for `explain`). Where the
  kernels' chain stands for their estimate (`choice_estimates`) the
  margin is at most XLA_MARGIN: a floor of their steps, not a fit that
  may undercount them.
  False, without a model, outside what it was fitted on: other input
  dtypes, and decode batches that `xla.gathers` (fewer rows than a third
  of the groups)."""
  from pallas_gemm.ragged_dot import xla
  if 0 in (problem.m, problem.k, problem.n, problem.groups):
    return False, "an empty product: the kernels' path launches nothing"
  if problem.in_dtype not in INPUT_DTYPES or xla.gathers(problem):
    return False, "no cost model for this problem"
  config = implementation.heuristic(problem, device)
  mosaic_us, xla_us, chain_stands = _weighed(problem, implementation, config,
                                             device)
  if chain_stands:
    margin = min(margin, XLA_MARGIN)
  return xla_chosen(mosaic_us, xla_us, margin), (
      f"mosaic about {mosaic_us:.0f} us, xla about {xla_us:.0f} us "
      "(estimates)")
