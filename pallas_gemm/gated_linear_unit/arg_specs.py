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


#: The shape that stands for each token count in a run cut short by its
#: budget: the issue's two quoted shapes, and Llama-3 8B's FFN elsewhere.
REPRESENTATIVE = {4096: ("llama2_7b", 11008, 4096)}
DEFAULT_REPRESENTATIVE = ("llama3_8b/mistral_7b", 14336, 4096)


def glu_suite() -> list[tuple[str, int, int, int]]:
  """Every (model, m, n, k) of the suite: first one shape per token count
  (so that a run stopped by its time budget has measured every M class,
  the shapes the issue quotes, 8192 x 14336 x 4096 and 4096 x 11008 x 4096,
  among them), then the other models."""
  cases = [(name, m, n, k) for m in GLU_TOKENS for name, k, n in GLU_MODELS]

  def is_representative(case):
    name, m, n, k = case
    return (name, n, k) == REPRESENTATIVE.get(m, DEFAULT_REPRESENTATIVE)

  return ([c for c in cases if is_representative(c)]
          + [c for c in cases if not is_representative(c)])


#: Small shapes for a CPU (interpret-mode) smoke run of the benchmark.
GLU_SMOKE = (("smoke", 128, 128, 64), ("smoke_ragged", 72, 192, 64))
