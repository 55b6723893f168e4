"""The `glu` shape suite: the FFN gate/up projections of common LLMs at
several token counts, as (name, m, n, k) = (model, tokens, intermediate
size, hidden size)."""

from __future__ import annotations

#: (model, hidden size k, intermediate size n). Mistral 7B's FFN has the
#: shape of Llama-3 8B's, and Llama-2 70B's that of Llama-3 70B's: each
#: shape is listed once, under both names.
GLU_MODELS = (
    ("llama3_8b/mistral_7b", 4096, 14336),
    ("llama2_7b", 4096, 11008),
    ("qwen2_7b", 3584, 18944),
    ("llama2_70b/llama3_70b", 8192, 28672),
)

#: Token counts (rows of x): prefill-sized first, then small batches, then
#: counts that are not multiples of 128 (ragged last tiles).
GLU_TOKENS = (8192, 4096, 2048, 512, 128, 3000, 1000)


def glu_suite() -> list[tuple[str, int, int, int]]:
  """Every (model, m, n, k) of the suite, the shapes the issue quotes
  (8192 x 14336 x 4096 and 4096 x 11008 x 4096) first, so that a run cut
  short by its time budget still measures them."""
  cases = [(name, m, n, k) for m in GLU_TOKENS for name, k, n in GLU_MODELS]
  first = [(8192, 14336, 4096), (4096, 11008, 4096)]
  return sorted(cases, key=lambda c: (c[1:] not in first,
                                      first.index(c[1:]) if c[1:] in first
                                      else 0))


#: Small shapes for a CPU (interpret-mode) smoke run of the benchmark.
GLU_SMOKE = (("smoke", 128, 128, 64), ("smoke_ragged", 72, 192, 64))
