"""The fused gated linear unit, `activation(x @ w_gate) * (x @ w_up)`:
a Mosaic Hopper kernel with an XLA fallback, differentiable."""

from pallas_gemm.gated_linear_unit.api import (GluResolution, explain,
                                               gated_linear_unit, resolve)
from pallas_gemm.gated_linear_unit.configs import GluConfig, glu_heuristic
from pallas_gemm.gated_linear_unit.problem import (GLU_ACTIVATIONS,
                                                   GluProblem, reference_glu)

__all__ = ["GLU_ACTIVATIONS", "GluConfig", "GluProblem", "GluResolution",
           "explain", "gated_linear_unit", "glu_heuristic", "reference_glu",
           "resolve"]
