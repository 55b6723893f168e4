#!/usr/bin/env bash
# Prints a Python >= 3.12 interpreter (JAX 0.11 needs it), preferring 3.12,
# the version the GPU machine runs; fails with advice when there is none.
set -euo pipefail
ok() { "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' 2>/dev/null; }
candidates=("${PYTHON:-}" python3.12)
if command -v pyenv >/dev/null 2>&1; then
  candidates+=($(ls -d "$(pyenv root)"/versions/3.12*/bin/python3 2>/dev/null | sort -V -r))
fi
candidates+=(python3.13 python3.14 python3)
for candidate in "${candidates[@]}"; do
  [ -n "$candidate" ] || continue
  path=$(command -v "$candidate" 2>/dev/null) || continue
  if ok "$path"; then echo "$path"; exit 0; fi
done
echo "error: no Python >= 3.12 found; install one or set PYTHON=/path/to/python3.12" >&2
exit 1
