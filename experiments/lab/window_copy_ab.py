"""How fast can a kernel output be cut, or an operand padded, where its
rows are not whole 16-byte units? `tma.window_copy`'s Pallas-Triton
kernels (tiled blocks, or the output read as one flat run) against XLA's
slice or pad, on the same arrays in one process.

    PYTHONPATH=. python3 experiments/lab/window_copy_ab.py \\
        [--cases "cut 1 4095 4093 4096 4096 bfloat16;..."] [--iterations 20] \\
        [--budget_s 200]

A case is `cut|pad batch rows cols src_rows src_cols dtype [out_dtype]`:
a cut makes (rows, cols) out of (src_rows, src_cols); a pad the reverse
(zeros past the source; with out_dtype, widened as it is copied, as the
grouped kernels widen fp8 operands). `xla` is XLA's slice (or pad and
convert); `xla_aligned` (cuts only) XLA's slice to the columns rounded
down to a multiple of 8, a plain copy of about the same bytes: the ceiling
to aim at. Each kernel is checked equal to XLA's result before it is
timed. TB/s counts the bytes read once and written once.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np

from pallas_gemm import numerics, timing
from pallas_gemm.mosaic_backend import tma

from experiments.lab import ragged_lab_common as common

#: Cuts of grouped outputs of `random_ragged`'s section 13 (2749 and 6313
#: columns), the dense kernels' 4095-square one, other
#: widths, batches and dtypes, and pads of operands whose rows are not
#: whole 16-byte units (bfloat16, and fp8 widened to bfloat16).
DEFAULT_CASES = (
    "cut 1 4095 4093 4096 4096 bfloat16",
    "cut 1 5299 2749 5299 2752 bfloat16",
    "cut 3 7688 6313 7744 6336 bfloat16",
    "cut 1 16384 1001 16384 1024 float16",
    "cut 8 1023 1021 1024 1024 bfloat16",
    "cut 1 3001 3001 3008 3008 float32",
    "cut 1 2000 12345 2000 12352 bfloat16",
    "cut 1 8192 77 8192 128 bfloat16",
    "cut 1 65536 19 65536 64 bfloat16",
    "cut 1 30000 300 30000 320 bfloat16",
    "cut 1 20000 515 20000 576 bfloat16",
    "cut 4 5000 1500 5056 1536 float32",
    "cut 1 40 77 64 128 bfloat16",
    "pad 10 4456 5184 4456 5143 float8_e4m3fn bfloat16",
    "pad 1 8192 128 8192 77 bfloat16",
)

#: The kernels tried besides the shipped rule (`tma.row_tiling`).
COPIES = (
    tma.TiledCut(rows=8, cols=1024, warps=4),  # shipped before the rule
    tma.TiledCut(rows=1, cols=4096, warps=8),
    tma.TiledCut(rows=1, cols=8192, warps=8),
    tma.TiledCut(rows=1, cols=1024, warps=4),
    tma.TiledCut(rows=2, cols=1024, warps=4),
    tma.TiledCut(rows=4, cols=1024, warps=8),
    tma.TiledCut(rows=16, cols=128, warps=4),
    tma.TiledCut(rows=32, cols=128, warps=8),
    tma.TiledCut(rows=4, cols=512, warps=4),
    tma.TiledCut(rows=8, cols=512, warps=8),
    tma.FlatCut(elements=2048, warps=4),
    tma.FlatCut(elements=4096, warps=4),
)


@dataclasses.dataclass(frozen=True)
class Case:
  kind: str
  batch: int
  rows: int
  cols: int
  src_rows: int
  src_cols: int
  dtype: str
  out_dtype: str

  @classmethod
  def parse(cls, text: str) -> "Case":
    words = text.split()
    if len(words) not in (7, 8) or words[0] not in ("cut", "pad"):
      raise ValueError(f"--cases: {text!r} is not 'cut|pad batch rows cols "
                       "src_rows src_cols dtype [out_dtype]'")
    dims = [int(w) for w in words[1:6]]
    case = cls(words[0], *dims, words[6],
               words[7] if len(words) == 8 else words[6])
    smaller = (case.rows <= case.src_rows and case.cols <= case.src_cols)
    if smaller != (case.kind == "cut") or min(dims) < 1:
      raise ValueError(f"--cases: {text!r}: a cut's shape must fit in its "
                       "source's, a pad's source in its shape")
    return case

  @property
  def label(self) -> str:
    dtypes = (self.dtype if self.out_dtype == self.dtype
              else f"{self.dtype}->{self.out_dtype}")
    return (f"{self.kind} {self.batch}x({self.src_rows}, {self.src_cols}) -> "
            f"({self.rows}, {self.cols}) {dtypes}")

  def moved_bytes(self) -> int:
    read = self.batch * min(self.rows, self.src_rows) * min(
        self.cols, self.src_cols) * jnp.dtype(self.dtype).itemsize
    return read + self.batch * self.rows * self.cols * jnp.dtype(
        self.out_dtype).itemsize


def xla_way(case: Case):
  out_dtype = jnp.dtype(case.out_dtype)
  if case.kind == "cut":
    return lambda x: x[:, :case.rows, :case.cols].astype(out_dtype)
  pads = ((0, 0), (0, case.rows - case.src_rows),
          (0, case.cols - case.src_cols))
  return lambda x: jnp.pad(x.astype(out_dtype), pads)


def ways(case: Case):
  found = {"xla": xla_way(case)}
  if case.kind == "cut":
    aligned = case.cols - case.cols % 8 or 8
    found["xla_aligned"] = lambda x: x[:, :case.rows, :aligned]
  shipped = tma.row_tiling(case.cols)
  for copy in dict.fromkeys((shipped, *COPIES)):
    name = ("flat {elements}/{warps}w".format(**dataclasses.asdict(copy))
            if isinstance(copy, tma.FlatCut) else
            "tiled {rows}x{cols}/{warps}w".format(**dataclasses.asdict(copy)))
    if copy == shipped:
      name += " (rule)"
    found[name] = (lambda x, copy=copy: tma.window_copy(
        x, case.rows, case.cols, copy, dtype=case.out_dtype))
  return found


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--cases", default=";".join(DEFAULT_CASES),
                      help="';'-separated cases (module docstring)")
  parser.add_argument("--iterations", type=int, default=20)
  parser.add_argument("--budget_s", type=float, default=0.0,
                      help="stop before a case past this many seconds")
  args = parser.parse_args(argv)
  cases = [Case.parse(c) for c in args.cases.split(";") if c.strip()]
  on_gpu = jax.default_backend() == "gpu"
  if not on_gpu:
    print("window_copy_ab: the Triton kernels need a GPU", file=sys.stderr)
    return 1
  budget = common.Budget(args.budget_s)
  print(f"# jax {jax.__version__}, {jax.devices()[0].device_kind}, CUPTI "
        f"median of {args.iterations}; µs (TB/s of bytes read and written)")
  for number, case in enumerate(cases):
    if budget.spent():
      break
    print(f"## {number} {case.label}", flush=True)
    source = numerics.random_normal(
        jax.random.key(number), (case.batch, case.src_rows, case.src_cols),
        case.dtype)
    found = ways(case)
    want = np.asarray(jax.jit(found["xla"])(source), np.float32)
    for name, fn in found.items():
      call = jax.jit(fn)
      try:
        got = np.asarray(call(source), np.float32)
        if name != "xla_aligned" and not np.array_equal(got, want):
          print(f"| {name} | wrong result |", flush=True)
          continue
        _, samples = timing.cupti_samples_ms(call, (source,),
                                             iterations=args.iterations)
      except Exception as e:  # noqa: BLE001 - a kernel may fail to compile
        print(f"| {name} | failed: {str(e).splitlines()[0][:120]} |",
              flush=True)
        continue
      us = 1e3 * statistics.median(samples)
      print(f"| {name} | {us:.1f} | {case.moved_bytes() / us / 1e6:.2f} |",
            flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
