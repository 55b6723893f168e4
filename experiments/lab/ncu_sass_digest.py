"""A short text digest of an Nsight Compute SASS page (`--page source --csv`).

    python3 experiments/lab/ncu_sass_digest.py case1.sass.csv[.gz] ...

For each file: executed warp instructions per opcode, the stall reasons summed
over the kernel's PC samples, the most-sampled instructions with their main
stall reasons, and the tensor-core instruction forms. `triton_ncu.sh` writes
the CSVs; the digest is what the results README quotes.
"""

from __future__ import annotations

import collections
import csv
import gzip
import io
import re
import sys


def _rows(path: str) -> list[list[str]]:
  opener = gzip.open if path.endswith(".gz") else open
  with opener(path, "rt") as f:
    text = f.read()
  rows = list(csv.reader(io.StringIO(text)))
  # Row 0 names the kernel; row 1 is the header.
  if len(rows) < 2 or "Source" not in rows[1]:
    raise ValueError(f"{path}: not an ncu --page source --csv export")
  return rows


def _opcode(source: str) -> str:
  words = source.split()
  if words and words[0].startswith("@"):
    words = words[1:]  # predicate guard
  return words[0].split(".")[0] if words else "?"


def digest(path: str, top: int = 12) -> str:
  rows = _rows(path)
  header, data = rows[1], [r for r in rows[2:] if len(r) == len(rows[1])]
  col = {name: i for i, name in enumerate(header)}
  source_col = col["Source"]
  executed_col = col["Instructions Executed"]
  samples_col = col["Warp Stall Sampling (All Samples)"]
  stall_cols = {name.removeprefix("stall_"): i for name, i in col.items()
                if name.startswith("stall_") and "(" not in name}

  def number(row, i):
    return int(row[i] or 0) if row[i] not in ("", "-") else 0

  executed = collections.Counter()
  stall_totals = collections.Counter()
  for row in data:
    executed[_opcode(row[source_col].strip())] += number(row, executed_col)
    for reason, i in stall_cols.items():
      stall_totals[reason] += number(row, i)
  all_samples = sum(number(r, samples_col) for r in data) or 1
  total_executed = sum(executed.values()) or 1

  lines = [f"== {path.rsplit('/', 1)[-1]}: kernel {rows[0][1] if len(rows[0]) > 1 else '?'}, "
           f"{len(data)} SASS instructions, {total_executed:,} warp "
           f"instructions executed, {all_samples:,} PC samples"]
  lines.append("executed, by opcode (share of all):")
  lines += [f"  {op:<10} {n:>14,}  {100 * n / total_executed:5.1f} %"
            for op, n in executed.most_common(top)]
  lines.append("stall reasons, share of all PC samples:")
  lines += [f"  {reason:<16} {100 * n / all_samples:5.1f} %"
            for reason, n in stall_totals.most_common(8) if n]
  lines.append("most-sampled instructions (share of samples; main reasons):")
  for row in sorted(data, key=lambda r: -number(r, samples_col))[:top]:
    reasons = sorted(((number(row, i), reason)
                      for reason, i in stall_cols.items()), reverse=True)[:2]
    lines.append(
        f"  {100 * number(row, samples_col) / all_samples:5.1f} %  "
        f"{row[source_col].strip()[:64]:<64} "
        + ", ".join(f"{reason} {n}" for n, reason in reasons if n))
  tensor_opcodes = ("HGMMA", "HMMA", "IGMMA", "IMMA", "QGMMA")
  forms = sorted({re.sub(r"\s+", " ", r[source_col].strip())[:72]
                  for r in data
                  if _opcode(r[source_col].strip()) in tensor_opcodes})
  lines.append("tensor-core instruction forms: "
               + ("; ".join(forms[:4]) if forms else "none"))
  return "\n".join(lines)


def main(argv=None) -> int:
  paths = (argv if argv is not None else sys.argv[1:])
  if not paths:
    print(__doc__)
    return 2
  for path in paths:
    print(digest(path))
    print()
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
