"""Every problem shape the tests and the benchmark use, defined once.

A shape is (M, N, K): out[M, N] = A[M, K] @ B[K, N]. Most suites are lists
of shapes that the benchmark crosses with its --dtypes and --layouts; the
`wide` suite is a list of whole problems (`SuiteProblem`: shape, batch,
dtype, layout and the regime it stands for).
"""

from __future__ import annotations

import dataclasses
import math
import random

from pallas_gemm.config_fields import check_sizes

# Interpret-mode correctness: small, ragged and degenerate shapes that
# exercise every masked edge (M=1, primes, non-multiples of any tile).
ODD = [
    (1, 1, 1),
    (1, 96, 80),       # a single row, like decode
    (1, 37, 53),
    (17, 1, 33),       # a single column
    (31, 29, 37),      # primes
    (97, 61, 131),
    (128, 64, 48),     # tile multiples
    (130, 66, 70),     # just past a tile in every dimension
]

# Small enough to finish in interpret mode on a CPU in seconds.
CPU_SMALL = [(64, 64, 64), (128, 128, 128), (192, 160, 96), (97, 61, 131)]

SQUARE = [(n, n, n) for n in (512, 1024, 2048, 4096, 8192)]

# The acceptance suite for the production kernels.
LARGE = [
    (2048, 2048, 2048),
    (4096, 4096, 4096),
    (8192, 8192, 8192),
    (8192, 4096, 14336),
    (8192, 14336, 4096),
    (16384, 4096, 4096),
    (4096, 8192, 4096),
    (8192, 8192, 4096),
    (6144, 6144, 6144),
    (16384, 16384, 16384),
]

# LLM-style projections with batch*sequence rows: the (N, K) of a
# Llama-3-8B-like layer (attention output, MLP up, MLP down, fused QKV) at
# 4096 rows, and the first at 16384.
LLM_PROJECTIONS = ((4096, 4096), (14336, 4096), (4096, 14336), (6144, 4096))
LLM = [(4096, n, k) for n, k in LLM_PROJECTIONS] + [(16384, 4096, 4096)]

# Decode: a handful of rows against a large weight; bandwidth-bound.
DECODE = [
    (m, n, k)
    for m in (1, 16, 64, 128)
    for (n, k) in ((8192, 8192), (14336, 4096), (4096, 14336))
]

# Not tile multiples, each paired with its nearest divisible shape.
ODD_LARGE = [
    (4095, 4097, 4093),
    (4096, 4096, 4096),
    (8191, 8193, 8190),
    (8192, 8192, 8192),
]

# Rows that are not 16-byte units (every N odd or 1500, one K odd) from one
# row to thousands, narrow and wide: where `kernel=None` must not pay the kernels'
# padding copies for nothing (experiments/results/nvidia_h200/dispatch,
# last section). Run in every dtype and layout.
ODD_WIDTHS = [
    (1, 4093, 4096),
    (64, 12345, 4096),
    (777, 5461, 4096),
    (1000, 1001, 999),
    (2048, 3001, 2048),
    (3000, 4093, 2000),
    (4096, 1500, 4096),
    (8192, 77, 4096),
]

# Skinny shapes where split-K pays.
SKINNY = [(m, 8192, 8192) for m in (1, 16, 128)]

# The ladder table: every rung at these sizes.
LADDER = [(4096, 4096, 4096), (8192, 8192, 8192)]

#: The benchmark dtype names a suite problem may carry ("tf32": float32
#: inputs at default precision, i.e. TF32 products on a GPU).
SUITE_DTYPES = ("bfloat16", "float16", "tf32")


@dataclasses.dataclass(frozen=True)
class SuiteProblem:
  """One whole benchmark problem. `dtype` is a benchmark dtype name:
  bfloat16, float16 or tf32 (float32 at default precision)."""

  m: int
  n: int
  k: int
  batch: int = 1
  dtype: str = "bfloat16"
  layout: str = "NN"
  regime: str = ""

  def __post_init__(self):
    check_sizes(self, ("m", "n", "k", "batch"), minimum=1)
    if self.dtype not in SUITE_DTYPES:
      raise ValueError(f"SuiteProblem.dtype={self.dtype!r} must be one of "
                       f"{SUITE_DTYPES}")
    if self.layout not in ("NN", "NT", "TN", "TT"):
      raise ValueError(f"SuiteProblem.layout={self.layout!r} must be one of "
                       "NN, NT, TN, TT")
    if self.regime and self.regime not in WIDE_REGIMES:
      raise ValueError(f"SuiteProblem.regime={self.regime!r} must be empty "
                       f"or one of {WIDE_REGIMES}")

  @property
  def shape(self) -> tuple[int, int, int]:
    return (self.m, self.n, self.k)


#: The seed of the `wide` suite. Changing it draws another suite; results
#: files record the suite they measured, so keep it unless a suite is wanted
#: that no table was measured against.
WIDE_SEED = 20261124
WIDE_PER_REGIME = 13
WIDE_REGIMES = ("small", "mid", "large", "llm", "decode", "batched",
                "transposed", "f16_tf32")


def _log_uniform(rng: random.Random, low: int, high: int, multiple: int) -> int:
  value = math.exp(rng.uniform(math.log(low), math.log(high)))
  return max(multiple, int(round(value / multiple)) * multiple)


def _llm_projection(rng: random.Random, tokens: int) -> tuple[int, int, int]:
  hidden = rng.choice((2048, 3072, 4096, 5120, 6144, 8192))
  ffn = rng.choice((5632, 8192, 11008, 13824, 14336, 18944, 28672))
  vocab = rng.choice((32000, 32768, 64000, 128256, 151936))
  n, k = rng.choice(((3 * hidden, hidden), (ffn, hidden), (hidden, ffn),
                     (hidden, hidden), (vocab, hidden)))
  return tokens, n, k


def wide_suite(seed: int = WIDE_SEED) -> list[SuiteProblem]:
  """`WIDE_PER_REGIME` problems in each of `WIDE_REGIMES`, drawn
  deterministically from `seed`: sizes log-uniform between each regime's
  bounds, so they fall between any tuned list's round numbers. At most one
  problem in ten has a K whose rows are not 16-byte aligned (cuBLAS's slow
  path, where pallas_gemm wins easily), so those cannot carry the mean."""
  rng = random.Random(seed)
  out: list[SuiteProblem] = []

  def add(regime, m, n, k, **kwargs):
    out.append(SuiteProblem(m, n, k, regime=regime, **kwargs))

  for i in range(WIDE_PER_REGIME):
    add("small", *(_log_uniform(rng, 128, 2048, 16) for _ in range(3)))
    add("mid", *(_log_uniform(rng, 2048, 6144, 64) for _ in range(3)))
    add("large", *(_log_uniform(rng, 6144, 16384, 256) for _ in range(3)))
    tokens = _log_uniform(rng, 1000, 9000, 8)
    if tokens % 128 == 0:
      tokens += 8
    m, n, k = _llm_projection(rng, tokens)
    if i in (3, 9):  # unaligned K: a ragged head dimension
      k += rng.choice((1, 3, 5))
    add("llm", m, n, k)
    m, n, k = _llm_projection(rng, rng.choice((1, 2, 8, 16, 32, 64, 96, 128)))
    add("decode", m, n, k)
    seq = _log_uniform(rng, 256, 4096, 64)
    head = rng.choice((64, 128))
    heads = rng.choice((8, 16, 32, 64))
    if i % 2 == 0:  # attention scores: (seq x head) @ (head x seq)
      add("batched", seq, seq, head, batch=heads)
    else:  # attention times values: (seq x seq) @ (seq x head)
      add("batched", seq, head, seq, batch=heads)
    m, n, k = (_log_uniform(rng, 1024, 12288, 64) for _ in range(3))
    add("transposed", m, n, k, layout="NT" if i % 3 else "TN")
    m, n, k = (_log_uniform(rng, 1024, 8192, 64) for _ in range(3))
    add("f16_tf32", m, n, k, dtype="float16" if i % 2 else "tf32")
  return out


WIDE = wide_suite()

#: fp8 acceptance shapes: the cubes and the LLM projections of LARGE, plus
#: token counts that are not multiples of the tile (a suite is only a sample).
FP8 = [(4096, 4096, 4096), (8192, 8192, 8192)] + [
    shape for shape in LARGE if shape[0] != shape[1] or shape[1] != shape[2]
][:4] + [(5000, 6144, 4096), (3000, 14336, 4096)]

SUITES = {
    "odd": ODD,
    "cpu": CPU_SMALL,
    "square": SQUARE,
    "large": LARGE,
    "llm": LLM,
    "decode": DECODE,
    "odd_large": ODD_LARGE,
    "odd_widths": ODD_WIDTHS,
    "skinny": SKINNY,
    "ladder": LADDER,
    "wide": WIDE,
    "fp8": FP8,
}


def parse_shapes(text: str) -> list[tuple[int, int, int]]:
  """Parses "MxNxK,MxNxK"; raises ValueError naming the bad entry."""
  shapes = []
  for item in filter(None, (s.strip() for s in text.split(","))):
    parts = item.lower().split("x")
    if len(parts) != 3:
      raise ValueError(f"shape {item!r} must look like MxNxK")
    try:
      m, n, k = (int(p) for p in parts)
    except ValueError:
      raise ValueError(f"shape {item!r} has a non-integer size") from None
    if min(m, n, k) < 1:
      raise ValueError(f"shape {item!r} must have sizes >= 1")
    shapes.append((m, n, k))
  return shapes
