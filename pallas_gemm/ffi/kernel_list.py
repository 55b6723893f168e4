"""The ffi/* kernels as listed in csrc/kernels.def, read for Python.

csrc/kernels.def is the one list: the C++ side expands it into the FFI
handlers and the standalone drivers, and this module parses the same lines
into the registry's SIMT rungs and ffi/mma_sync's compiled tilings.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
import re

CSRC_DIR = pathlib.Path(__file__).resolve().parent / "csrc"
KERNELS_DEF = CSRC_DIR / "kernels.def"

_ENTRY = re.compile(r"^PALLAS_GEMM_(SGEMM|MMA)\((.*)\)\s*$")
_DESCRIPTION = r'"((?:[^"\\]|\\.)*)"'  # a C string literal, captured
_FP8_ENTRY = re.compile(rf"^PALLAS_GEMM_FP8\((\w+),\s*{_DESCRIPTION}\)\s*$")
_SGEMM_ARGS = re.compile(rf"^(\w+),\s*(\d+),\s*{_DESCRIPTION}$")
_MMA_FIELDS = ("block_m", "block_n", "block_k", "num_warps", "stages",
               "pipelined", "tma", "workspace")


@dataclasses.dataclass(frozen=True)
class SgemmRung:
  """PALLAS_GEMM_SGEMM(id, align, description): an exact-f32 SIMT rung."""

  id: str
  align: int
  description: str


@dataclasses.dataclass(frozen=True)
class Fp8Kernel:
  """PALLAS_GEMM_FP8(id, description): an fp8 kernel with its own handler."""

  id: str
  description: str


@dataclasses.dataclass(frozen=True)
class MmaTiling:
  """PALLAS_GEMM_MMA(id, ...): one compiled tiling of ffi/mma_sync."""

  id: str
  block_m: int
  block_n: int
  block_k: int
  num_warps: int
  stages: int
  pipelined: bool
  tma: bool
  workspace: bool


def ffi_target(kernel_id: str) -> str:
  """The name the handler of `kernel_id` is registered under with XLA."""
  return f"pallas_gemm_{kernel_id}"


def handler_symbol(kernel_id: str) -> str:
  """The exported C symbol ffi_handlers.cu defines for `kernel_id`."""
  return f"pallas_gemm_ffi_handler_{kernel_id}"


def parse(text: str) -> tuple[tuple[SgemmRung, ...], tuple[MmaTiling, ...]]:
  """The entries of a kernels.def text, in order. Lines that are not an
  entry (comments, the default macro definitions) are skipped; an entry
  that does not parse is an error naming its line."""
  rungs, tilings = [], []
  for number, line in enumerate(text.splitlines(), 1):
    match = _ENTRY.match(line.strip())
    if match is None:
      continue
    kind, args = match.groups()
    if kind == "SGEMM":
      fields = _SGEMM_ARGS.match(args.strip())
      if fields is None:
        raise ValueError(f"kernels.def line {number}: expected "
                         f"PALLAS_GEMM_SGEMM(id, align, \"description\"), "
                         f"got {line.strip()!r}")
      rungs.append(SgemmRung(fields.group(1), int(fields.group(2)),
                             fields.group(3)))
      continue
    values = [v.strip() for v in args.split(",")]
    if (len(values) != 1 + len(_MMA_FIELDS) or not values[0].isidentifier()
        or not all(v.isdigit() for v in values[1:])):
      raise ValueError(f"kernels.def line {number}: expected "
                       f"PALLAS_GEMM_MMA(id, {', '.join(_MMA_FIELDS)}) with "
                       f"integer fields, got {line.strip()!r}")
    numbers = dict(zip(_MMA_FIELDS, map(int, values[1:])))
    for flag in ("pipelined", "tma", "workspace"):
      numbers[flag] = bool(numbers[flag])
    tilings.append(MmaTiling(values[0], **numbers))
  ids = [entry.id for entry in (*rungs, *tilings)]
  duplicates = sorted({i for i in ids if ids.count(i) > 1})
  if duplicates:
    raise ValueError(f"kernels.def lists {duplicates} more than once")
  return tuple(rungs), tuple(tilings)


@functools.cache
def entries() -> tuple[tuple[SgemmRung, ...], tuple[MmaTiling, ...]]:
  """The parsed csrc/kernels.def of this package."""
  return parse(KERNELS_DEF.read_text())


def parse_fp8(text: str) -> tuple[Fp8Kernel, ...]:
  """The PALLAS_GEMM_FP8 entries of a kernels.def text, in order; one that
  does not parse is an error naming its line."""
  kernels = []
  for number, line in enumerate(text.splitlines(), 1):
    stripped = line.strip()
    if not stripped.startswith("PALLAS_GEMM_FP8("):
      continue
    match = _FP8_ENTRY.match(stripped)
    if match is None:
      raise ValueError(f"kernels.def line {number}: expected "
                       f"PALLAS_GEMM_FP8(id, \"description\"), got "
                       f"{stripped!r}")
    kernels.append(Fp8Kernel(match.group(1), match.group(2)))
  return tuple(kernels)


@functools.cache
def fp8_entries() -> tuple[Fp8Kernel, ...]:
  """The fp8 kernels of this package's csrc/kernels.def."""
  return parse_fp8(KERNELS_DEF.read_text())


def handlers() -> dict[str, str]:
  """FFI target name -> exported handler symbol, for every kernel."""
  rungs, tilings = entries()
  return {ffi_target(e.id): handler_symbol(e.id)
          for e in (*rungs, *tilings, *fp8_entries())}
