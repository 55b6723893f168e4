"""Every problem shape the tests and the benchmark use, defined once.

A shape is (M, N, K): out[M, N] = A[M, K] @ B[K, N].
"""

from __future__ import annotations

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

# LLM-style projections with batch*sequence rows.
LLM = [
    (4096, 4096, 4096),
    (4096, 14336, 4096),
    (4096, 4096, 14336),
    (4096, 6144, 4096),
    (16384, 4096, 4096),
]

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

# Skinny shapes where split-K pays.
SKINNY = [(m, 8192, 8192) for m in (1, 16, 128)]

# The ladder table: every rung at these sizes.
LADDER = [(4096, 4096, 4096), (8192, 8192, 8192)]

SUITES = {
    "odd": ODD,
    "cpu": CPU_SMALL,
    "square": SQUARE,
    "large": LARGE,
    "llm": LLM,
    "decode": DECODE,
    "odd_large": ODD_LARGE,
    "skinny": SKINNY,
    "ladder": LADDER,
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
