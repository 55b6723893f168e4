"""`pallas_gemm.explain`: which kernel and config a call would run, and why.

It traces the call (nothing runs on the device), finds the `pallas_gemm`
equations it binds, and asks `dispatch.resolve` about each: the answers are
the memoized ones the call itself used.
"""

from __future__ import annotations

import dataclasses

import jax
from jax.extend import core as jex_core

from pallas_gemm import dispatch
from pallas_gemm.devices import device_info
from pallas_gemm.problem import GemmProblem


@dataclasses.dataclass(frozen=True)
class Explanation:
  """One line per GEMM the call binds; `lax` holds why a call (or part of
  one) stays on `jax.lax.dot_general` instead, if it does."""

  calls: tuple[tuple[GemmProblem, dispatch.Resolution], ...]
  lax: tuple[str, ...] = ()

  @property
  def kernels(self) -> tuple[str, ...]:
    return tuple(resolution.kernel for _, resolution in self.calls)

  def __str__(self) -> str:
    lines = [f"{problem.describe()}: {resolution}{_note(problem, resolution)}"
             for problem, resolution in self.calls]
    lines += [f"lax.dot_general: {why}" for why in self.lax]
    if not lines:
      lines = ["no GEMM: the result needs no product (a zero-size or K=0 "
               "problem)"]
    return "\n".join(lines)


def _note(problem: GemmProblem, resolution) -> str:
  from pallas_gemm import registry
  entry = registry._REGISTRY.get(resolution.kernel)
  note = entry.note(problem) if entry is not None and entry.note else None
  return f" [{note}]" if note else ""


def _walk(jaxpr):
  for eqn in jaxpr.eqns:
    yield eqn
    for sub in jex_core.jaxprs_in_params(eqn.params):
      yield from _walk(sub)


def explain(a, b, *, fn=None, kernel=None, config=None, **kwargs
            ) -> Explanation:
  """Explains `pallas_gemm.matmul(a, b, kernel=..., config=..., **kwargs)`.

  `fn` explains another entry point taking (a, b, **kwargs) instead, e.g.
  `fn=pallas_gemm.dot_general` with `dimension_numbers=...`.
  """
  from pallas_gemm import api, primitive
  if fn is None:
    fn = api.matmul
    kwargs = dict(kwargs, kernel=kernel, config=config)
  api.LAX_REASONS.clear()
  closed = jax.make_jaxpr(lambda x, y: fn(x, y, **kwargs))(a, b)
  device = device_info()
  calls = []
  for eqn in _walk(closed.jaxpr):
    if eqn.primitive is not primitive.pallas_gemm_p:
      continue
    problem = primitive.problem_from_params(
        [v.aval for v in eqn.invars], eqn.params)
    requested = kernel if fn is api.matmul else None
    resolution = dispatch.resolve(problem, device, requested,
                                  config if requested else None)
    calls.append((problem, resolution))
  return Explanation(tuple(calls), tuple(api.LAX_REASONS))
