"""The `moe` shape suite: grouped GEMMs of real mixture-of-experts layers.

A case is one expert projection (a `RaggedProblem`) and a token routing
(group sizes). `rows` is the number of lhs rows, tokens × experts per token
(top-k), as a sorted-by-expert MoE layer feeds its experts. Every layer has
its forward product and the two backward ones:

  forward  rows:        (rows, k) x (groups, k, n)           -> (rows, n)
  dlhs     rows, rhs^T: (rows, n) x (groups, k, n) read as kT -> (rows, k)
  drhs     contracting: (rows, k)^T x (rows, n) per group    -> (groups, k, n)

Group sizes are generated deterministically from a seed:
  even     rows split equally (the remainder one row each to the first);
  zipf     sizes proportional to 1/rank, experts ranked in a seeded order;
  one_hot  every row to one (seeded) expert, the others empty.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from pallas_gemm.ragged_dot.problem import RaggedProblem

DISTRIBUTIONS = ("even", "zipf", "one_hot")
DIRECTIONS = ("forward", "dlhs", "drhs")


@dataclasses.dataclass(frozen=True)
class MoeLayer:
  """One expert projection: `groups` experts of (k -> n), fed `rows` rows."""
  name: str
  groups: int
  rows: int
  k: int
  n: int


@dataclasses.dataclass(frozen=True)
class MoeCase:
  layer: MoeLayer
  distribution: str
  direction: str
  dtype: str = "bfloat16"
  out_dtype: str = "bfloat16"
  seed: int = 0

  @property
  def label(self) -> str:
    return f"{self.layer.name} {self.distribution} {self.direction}"

  @property
  def problem(self) -> RaggedProblem:
    layer = self.layer
    common = dict(m=layer.rows, groups=layer.groups, in_dtype=self.dtype,
                  out_dtype=self.out_dtype)
    if self.direction == "forward":
      return RaggedProblem("rows", k=layer.k, n=layer.n, **common)
    if self.direction == "dlhs":
      return RaggedProblem("rows", k=layer.n, n=layer.k, transpose_rhs=True,
                           **common)
    return RaggedProblem("contracting", k=layer.k, n=layer.n, **common)

  def group_sizes(self) -> np.ndarray:
    return group_sizes(self.distribution, self.layer.rows, self.layer.groups,
                       seed=self.seed)


def group_sizes(distribution: str, rows: int, groups: int, *,
                seed: int = 0) -> np.ndarray:
  """int32 (groups,) sizes summing to `rows` (see the module docstring)."""
  if groups < 1:
    raise ValueError(f"groups={groups} must be >= 1")
  rng = np.random.default_rng(seed)
  if distribution == "even":
    sizes = np.full(groups, rows // groups, np.int64)
    sizes[: rows % groups] += 1
  elif distribution == "zipf":
    weights = 1.0 / np.arange(1, groups + 1)
    ideal = rows * weights / weights.sum()
    sizes = np.floor(ideal).astype(np.int64)
    # Largest remainders take the rows the floor left over.
    sizes[np.argsort(ideal - sizes)[::-1][: rows - sizes.sum()]] += 1
    sizes = sizes[rng.permutation(groups)]
  elif distribution == "one_hot":
    sizes = np.zeros(groups, np.int64)
    sizes[rng.integers(groups)] = rows
  else:
    raise ValueError(f"distribution={distribution!r} is not one of "
                     f"{DISTRIBUTIONS}")
  assert sizes.sum() == rows
  return sizes.astype(np.int32)


def _up_and_down(model: str, groups: int, rows: int, hidden: int,
                 ffn: int) -> tuple[MoeLayer, MoeLayer]:
  """A model's two forward expert projections: "up" is hidden -> expert ffn
  (gate and up each), "down" is expert ffn -> hidden."""
  return (MoeLayer(f"{model}_up", groups, rows, hidden, ffn),
          MoeLayer(f"{model}_down", groups, rows, ffn, hidden))


#: The issue's table (rows = the tokens the experts see), then real models.
MOE_LAYERS = (
    MoeLayer("g8_t16384_k4096_n14336", 8, 16384, 4096, 14336),
    MoeLayer("g64_t16384_k2048_n1408", 64, 16384, 2048, 1408),
    MoeLayer("g128_t8192_k7168_n2048", 128, 8192, 7168, 2048),
    # Mixtral 8x7B: 8 experts, top-2, hidden 4096, ffn 14336; 8192 tokens.
    *_up_and_down("mixtral8x7b", 8, 16384, hidden=4096, ffn=14336),
    # DeepSeek-V3: 256 routed experts, top-8, hidden 7168, expert ffn 2048;
    # a 4096-token training step and a 256-token decode batch.
    *_up_and_down("deepseek_v3", 256, 32768, hidden=7168, ffn=2048),
    MoeLayer("deepseek_v3_up_decode", 256, 2048, 7168, 2048),
    # Qwen1.5-MoE-A2.7B: 60 experts, top-4, hidden 2048, ffn 1408; 4096 tokens.
    *_up_and_down("qwen1.5_moe", 60, 16384, hidden=2048, ffn=1408),
    # Qwen3-30B-A3B: 128 experts, top-8, hidden 2048, ffn 768; 4096 tokens.
    *_up_and_down("qwen3_30b_a3b", 128, 32768, hidden=2048, ffn=768),
)

#: Layers no config was chosen on, to check that what holds on the `moe`
#: suite holds elsewhere: other models, and token counts whose rows
#: (tokens x top-k) are not a multiple of 8.
MOE_HOLDOUT_LAYERS = (
    # Phi-3.5-MoE: 16 experts, top-2, hidden 4096, ffn 6400; 4099 tokens.
    *_up_and_down("phi3.5_moe_t4099", 16, 8198, hidden=4096, ffn=6400),
    # DeepSeek-V2-Lite: 64 routed experts, top-6, hidden 2048, expert ffn
    # 1408; 2047 tokens.
    *_up_and_down("deepseek_v2_lite_t2047", 64, 12282, hidden=2048,
                  ffn=1408),
    # OLMoE-1B-7B: 64 experts, top-8, hidden 2048, ffn 1024; 4096 tokens.
    MoeLayer("olmoe_up", 64, 32768, 2048, 1024),
    # gpt-oss-20b: 32 experts, top-4, hidden 2880, ffn 2880; 3000 tokens.
    MoeLayer("gpt_oss_20b_t3000_up", 32, 12000, 2880, 2880),
)

#: Layers added after every rule of the heuristic was set (fortieth
#: session), to check it away from both lists above: other models, token
#: counts from a decode batch to a training step, rows per expert from 16
#: to 4096, and K and N not powers of two.
MOE_UNSEEN_LAYERS = (
    # Mixtral 8x22B: 8 experts, top-2, hidden 6144, ffn 16384; 2048 tokens.
    MoeLayer("mixtral8x22b_t2048_up", 8, 4096, 6144, 16384),
    # DBRX: 16 experts, top-4, hidden 6144, ffn 10752; 3001 tokens.
    MoeLayer("dbrx_t3001_down", 16, 12004, 10752, 6144),
    # Qwen2-57B-A14B: 64 experts, top-8, hidden 3584, ffn 2560; 2048 tokens.
    MoeLayer("qwen2_57b_t2048_up", 64, 16384, 3584, 2560),
    # Llama-4-Scout: 16 experts, top-1, hidden 5120, ffn 8192; 8192 tokens.
    MoeLayer("llama4_scout_t8192_up", 16, 8192, 5120, 8192),
    # DeepSeek-V2: 160 routed experts, top-6, hidden 5120, expert ffn 1536;
    # 1000 tokens.
    MoeLayer("deepseek_v2_t1000_down", 160, 6000, 1536, 5120),
    # Granite-3.0-1B-A400M: 32 experts, top-8, hidden 1024, ffn 512; 4096
    # tokens.
    MoeLayer("granite3_1b_t4096_up", 32, 32768, 1024, 512),
    # Mixtral 8x7B decoding 64 tokens: weights read once for few rows.
    MoeLayer("mixtral8x7b_t64_down", 8, 128, 14336, 4096),
)

#: Edges of the space the model layers leave out, to check that the
#: automatic choice never loses to `jax.lax.ragged_dot` there: one and two
#: experts (where XLA's ragged product is one dense product, or two
#: times the flops), a small product whose fixed costs show, and decode
#: steps of one to four tokens.
MOE_EDGE_LAYERS = (
    MoeLayer("g1_t8192_k4096_n4096", 1, 8192, 4096, 4096),
    MoeLayer("g2_t8192_k4096_n4096", 2, 8192, 4096, 4096),
    MoeLayer("g4_t512_k512_n512", 4, 512, 512, 512),
    # Mixtral 8x7B, one token (top-2).
    MoeLayer("mixtral8x7b_t1_up", 8, 2, 4096, 14336),
    # DeepSeek-V3, one token (top-8).
    MoeLayer("deepseek_v3_t1_up", 256, 8, 7168, 2048),
    # Qwen3-30B-A3B, four tokens (top-8).
    MoeLayer("qwen3_30b_a3b_t4_down", 128, 32, 768, 2048),
)

#: CPU-sized layers (interpret mode): odd sizes, one group, many groups.
MOE_SMALL_LAYERS = (
    MoeLayer("small_g4", 4, 96, 64, 128),
    MoeLayer("small_g8_odd", 8, 77, 48, 40),
    MoeLayer("small_g1", 1, 33, 32, 64),
)


def cases(layers=MOE_LAYERS, distributions=DISTRIBUTIONS,
          directions=DIRECTIONS, *, dtype="bfloat16", seed=0
          ) -> list[MoeCase]:
  """Every (layer, distribution, direction), the issue's table first."""
  return [MoeCase(layer, distribution, direction, dtype=dtype,
                  out_dtype=dtype, seed=seed)
          for layer in layers for direction in directions
          for distribution in distributions]


SUITES = {"moe": MOE_LAYERS, "moe_holdout": MOE_HOLDOUT_LAYERS,
          "moe_unseen": MOE_UNSEEN_LAYERS, "moe_edges": MOE_EDGE_LAYERS,
          "moe_small": MOE_SMALL_LAYERS}
