"""Grouped GEMM for mixture-of-experts: `pallas_gemm.ragged_dot`.

    out = pallas_gemm.ragged_dot(tokens, expert_weights, group_sizes)
    pallas_gemm.ragged_dot.explain(tokens, expert_weights, group_sizes)
"""

from pallas_gemm.ragged_dot.api import explain, ragged_dot, ragged_dot_general
from pallas_gemm.ragged_dot.implementations import Resolution, resolve
from pallas_gemm.ragged_dot.primitive import ragged_dot_p
from pallas_gemm.ragged_dot.problem import RaggedProblem, reference
from pallas_gemm.ragged_dot.sharded import sharded_ragged_dot

__all__ = ["RaggedProblem", "Resolution", "explain", "ragged_dot",
           "ragged_dot_general", "ragged_dot_p", "reference", "resolve",
           "sharded_ragged_dot"]

# `pallas_gemm.ragged_dot` is the function (as `jax.lax.ragged_dot` is); the
# helpers stay reachable from it under the names this package documents.
ragged_dot.explain = explain
ragged_dot.ragged_dot_general = ragged_dot_general
ragged_dot.sharded_ragged_dot = sharded_ragged_dot
ragged_dot.resolve = resolve
