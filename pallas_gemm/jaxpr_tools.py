"""What a traced program holds: counts of primitives, nested jaxprs included.

    counts = pallas_gemm.primitive_counts(jax.make_jaxpr(train_step)(state))
    counts["pallas_gemm"], counts["dot_general"]

Used by the examples to show that a model's GEMMs run on pallas_gemm (and
that no `dot_general` is left behind).
"""

from __future__ import annotations

import collections

from jax.extend import core as jex_core


def equations(jaxpr, *, opaque=()):
  """Every equation of `jaxpr`, then of the jaxprs nested in it, except
  inside equations of the primitives named in `opaque`."""
  for eqn in jaxpr.eqns:
    yield eqn
    if eqn.primitive.name not in opaque:
      for sub in jex_core.jaxprs_in_params(eqn.params):
        yield from equations(sub, opaque=opaque)


def primitive_counts(closed_jaxpr) -> collections.Counter:
  """How many equations of each primitive `closed_jaxpr` holds, counting
  those inside nested jaxprs (jit, scan, custom_vjp, ...)."""
  jaxpr = getattr(closed_jaxpr, "jaxpr", closed_jaxpr)
  return collections.Counter(eqn.primitive.name for eqn in equations(jaxpr))
