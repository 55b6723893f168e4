#!/usr/bin/env bash
# Prints the Python interpreter that `make bench` and `make test` run, after
# making sure pallas_gemm and what it needs are installed there.
#
# Two cases, chosen automatically (or forced with PALLAS_GEMM_ENV):
#
#   current  An interpreter that already holds a CUDA build of jax (a cluster
#            module, a container, a GPU machine without network): the project
#            alone is installed into it, with no network
#            (pip install --no-deps --no-build-isolation -e .).
#   venv     Otherwise: a .venv made from a Python >= 3.12, with jax pinned by
#            constraints.txt and, where an NVIDIA driver is found, the jax CUDA
#            extra that matches it (driver >= 580: cuda13, >= 525: cuda12).
#            PALLAS_GEMM_DEVICE=cpu|cuda12|cuda13 overrides the detection.
#
# Progress goes to stderr; stdout is the interpreter's path alone.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
say() { echo "setup: $*" >&2; }

has_cuda_jax() {  # has_cuda_jax PYTHON: a jax that can see a CUDA plugin
  "$1" - <<'PY' 2>/dev/null
import importlib.util, sys
if sys.version_info < (3, 12) or importlib.util.find_spec("jax") is None:
    sys.exit(1)
names = ("jax_cuda13_plugin", "jax_cuda12_plugin", "jax_plugins.xla_cuda13",
         "jax_plugins.xla_cuda12")
def found(name):
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False
sys.exit(0 if any(found(n) for n in names) else 1)
PY
}

installed_here() {  # the project importable from this checkout
  "$1" -c 'import pathlib, sys, pallas_gemm; sys.exit(0 if pathlib.Path(pallas_gemm.__file__).resolve().parents[1] == pathlib.Path.cwd().resolve() else 1)' 2>/dev/null
}

mode=${PALLAS_GEMM_ENV:-auto}
case "$mode" in auto|current|venv) ;; *)
  echo "error: PALLAS_GEMM_ENV=$mode must be auto, current or venv" >&2; exit 2;;
esac
current=${PYTHON:-$(command -v python3 || true)}
if [ "$mode" = auto ]; then
  if [ -n "$current" ] && has_cuda_jax "$current"; then mode=current; else mode=venv; fi
fi

if [ "$mode" = current ]; then
  [ -n "$current" ] || { echo "error: no python3 found; set PYTHON=" >&2; exit 1; }
  if ! installed_here "$current"; then
    say "installing pallas_gemm into $current (no dependencies, no network)"
    # An older setuptools there may not build it; the checkout is importable
    # all the same (make puts it on PYTHONPATH), so that is a warning.
    "$current" -m pip install -q --no-deps --no-build-isolation -e . >&2 \
      || say "warning: pip could not install the project here; using the checkout on PYTHONPATH"
  fi
  echo "$current"
  exit 0
fi

device=${PALLAS_GEMM_DEVICE:-}
if [ -z "$device" ]; then
  driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n 1 || true)
  major=${driver%%.*}
  if [[ "$major" =~ ^[0-9]+$ ]] && [ "$major" -ge 580 ]; then device=cuda13
  elif [[ "$major" =~ ^[0-9]+$ ]] && [ "$major" -ge 525 ]; then device=cuda12
  else device=cpu; fi
fi
case "$device" in cpu) extras="test,bench";; cuda12|cuda13) extras="test,bench,$device";; *)
  echo "error: PALLAS_GEMM_DEVICE=$device must be cpu, cuda12 or cuda13" >&2; exit 2;;
esac
stamp="$VENV/.installed-$device"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ constraints.txt -nt "$stamp" ]; then
  if [ ! -x "$VENV/bin/python" ]; then
    base=$(scripts/find_python.sh)
    say "creating $VENV with $base"
    "$base" -m venv "$VENV"
  fi
  say "installing pallas_gemm[$extras] into $VENV (jax pinned by constraints.txt)"
  "$VENV/bin/python" -m pip install -q --upgrade pip >&2
  "$VENV/bin/python" -m pip install -q -c constraints.txt -e ".[$extras]" >&2
  rm -f "$VENV"/.installed-*
  touch "$stamp"
fi
echo "$VENV/bin/python"
