"""Finding nvcc and the CUDA headers, and running them with a time limit.

Where nvcc comes from, first match wins:

  1. `$NVCC`, when set. It must be an executable that answers `--version`;
     anything else is an error naming `NVCC`, never a quiet switch to
     another nvcc.
  2. The NVIDIA pip wheels, for the CUDA major of the installed jax CUDA
     plugin (jax-cuda13-plugin -> 13). CUDA 13 wheels (`nvidia-cuda-nvcc`,
     `nvidia-cuda-runtime`, `nvidia-cuda-crt`, `nvidia-nvvm`,
     `nvidia-cuda-cccl`) share one prefix, `site-packages/nvidia/cu13/`
     with `bin/nvcc`, `include/` (and `include/cccl/`) and `lib/`.
     `jax[cuda13]` installs all but cccl (the project's cuda13 extra adds
     it); a wheel set missing the runtime or CCCL headers is skipped. The
     CUDA 12 wheels use one folder per package (`nvidia/cuda_nvcc/`,
     `nvidia/cuda_runtime/`, `nvidia/cuda_cccl/`), and
     nvidia-cuda-nvcc-cu12 12.9 ships ptxas but no nvcc, so CUDA 12 needs a
     system toolkit unless a wheel with `bin/nvcc` is installed.
  3. `$CUDA_HOME/bin/nvcc` (or `$CUDA_PATH`), PATH, /usr/local/cuda/bin.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import threading

#: Seconds one nvcc call may take; PALLAS_GEMM_NVCC_TIMEOUT overrides.
DEFAULT_NVCC_TIMEOUT_S = 900
_VERSION_TIMEOUT_S = 60
_RELEASE = re.compile(r"release (\d+)\.(\d+)")
_SYSTEM_NVCC = "/usr/local/cuda/bin/nvcc"

_NVCC_MISSING = (
    "pallas_gemm's ffi/* kernels compile CUDA C++ on first use and need "
    "nvcc, the CUDA compiler, which was not found. Install it with the "
    "project's CUDA extra (`pip install pallas_gemm[cuda13]` brings nvcc "
    "and the headers as NVIDIA pip wheels) or a CUDA toolkit (12.4 or "
    "newer), or set NVCC to its path. Searched: {searched}")


class BuildError(RuntimeError):
  """A compile step failed; the message holds the command and its output."""


class NvccNotFoundError(BuildError):
  """No usable nvcc: none found, or the one named is broken."""


@dataclasses.dataclass(frozen=True)
class Toolkit:
  """An nvcc and what a compile with it needs besides."""

  nvcc: str
  origin: str  # where it was found, e.g. "NVCC", "pip wheels", "PATH"
  version: str  # the `release X.Y, VX.Y.Z` line of `nvcc --version`
  include_dirs: tuple[str, ...] = ()  # -I for wheel headers
  library_dirs: tuple[str, ...] = ()  # -L for wheel libraries

  @property
  def release(self) -> tuple[int, int]:
    match = _RELEASE.search(self.version)
    return (int(match.group(1)), int(match.group(2)))


def nvcc_timeout() -> float:
  """PALLAS_GEMM_NVCC_TIMEOUT, validated, or the default."""
  text = os.environ.get("PALLAS_GEMM_NVCC_TIMEOUT")
  if not text:
    return DEFAULT_NVCC_TIMEOUT_S
  try:
    value = float(text)
  except ValueError:
    value = -1.0
  if not value > 0:
    raise BuildError(f"PALLAS_GEMM_NVCC_TIMEOUT={text!r} must be a positive "
                     f"number of seconds")
  return value


def _decode(data: bytes | None) -> str:
  return (data or b"").decode("utf-8", errors="replace")


#: Process groups of the nvcc calls running now (see stop_running).
_running: set[int] = set()
_running_lock = threading.Lock()


def _kill_group(pid: int) -> None:
  try:
    os.killpg(pid, signal.SIGKILL)
  except OSError:
    pass


def stop_running() -> None:
  """Kills every nvcc call (with its cicc/ptxas) still running: they run
  in their own process groups, which Ctrl-C does not reach."""
  with _running_lock:
    groups = list(_running)
  for pid in groups:
    _kill_group(pid)


def _run_process(command: list[str], cwd, timeout: float) -> tuple[int, str]:
  """Runs `command` in its own process group; on timeout the whole group
  (nvcc and the cicc/ptxas it started) is killed. Returns (code, output)."""
  process = subprocess.Popen(command, cwd=cwd, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, start_new_session=True)
  with _running_lock:
    _running.add(process.pid)
  try:
    output, _ = process.communicate(timeout=timeout)
  except BaseException:
    _kill_group(process.pid)
    process.communicate()
    raise
  finally:
    with _running_lock:
      _running.discard(process.pid)
  return process.returncode, _decode(output)


def _run_or_raise(command, cwd, timeout, error_cls, *, what: str,
                  timeout_hint: str, show_output) -> str:
  """`_run_process`, with every way of failing turned into `error_cls`:
  a timeout, a program that cannot be started, a non-zero exit code."""
  try:
    code, output = _run_process(command, cwd, timeout)
  except subprocess.TimeoutExpired:
    raise error_cls(f"{what} {timeout_hint}") from None
  except OSError as error:
    raise error_cls(f"{what} cannot be run ({error.strerror or error})"
                    ) from None
  if code != 0:
    raise error_cls(f"{what} failed with exit code {code}: "
                    f"{show_output(output)}")
  return output


def _check_executable(path: str, origin: str) -> None:
  if not os.path.exists(path):
    raise NvccNotFoundError(f"{origin}: {path} does not exist")
  if not os.path.isfile(path):
    raise NvccNotFoundError(f"{origin}: {path} is not a file")
  if not os.access(path, os.X_OK):
    raise NvccNotFoundError(f"{origin}: {path} is not executable")


def _query_version(nvcc: str, origin: str) -> str:
  """The release line of `nvcc --version`, or an error naming `origin`."""
  _check_executable(nvcc, origin)
  output = _run_or_raise(
      [nvcc, "--version"], None, _VERSION_TIMEOUT_S, NvccNotFoundError,
      what=f"{origin}: `{nvcc} --version`",
      timeout_hint=f"did not answer within {_VERSION_TIMEOUT_S} s",
      show_output=lambda text: repr(text.strip()[:500]))
  for line in output.splitlines():
    if _RELEASE.search(line):
      return line.strip()
  raise NvccNotFoundError(f"{origin}: {nvcc} does not look like nvcc: its "
                          f"--version output has no 'release X.Y' line: "
                          f"{output.strip()[:500]!r}")


def jax_cuda_majors() -> list[int]:
  """CUDA majors of the installed jax CUDA plugins, newest first."""
  majors = []
  for major in (13, 12):
    try:
      importlib.metadata.version(f"jax-cuda{major}-plugin")
    except importlib.metadata.PackageNotFoundError:
      continue
    majors.append(major)
  return majors


def _nvidia_dirs(search_path) -> list[pathlib.Path]:
  found = []
  for entry in search_path:
    candidate = pathlib.Path(entry or ".") / "nvidia"
    if candidate.is_dir() and candidate not in found:
      found.append(candidate)
  return found


#: Headers a build needs beside nvcc: the runtime's and CCCL's (which the
#: fp16/bf16 headers include). A wheel set lacking one is skipped.
_REQUIRED_HEADERS = ("cuda_runtime.h", "nv/target")


def _missing_headers(include_dirs) -> list[str]:
  return [h for h in _REQUIRED_HEADERS
          if not any((pathlib.Path(d) / h).exists() for d in include_dirs)]


def wheel_toolkit_dirs(majors, search_path=None, incomplete=None):
  """(nvcc, include dirs, library dirs) for each complete NVIDIA-wheel
  toolkit under `search_path` (default sys.path), for the given CUDA majors
  in order. Wheel sets with nvcc but without the headers are appended to
  `incomplete` (a list) as "<nvcc> lacks <header>" notes."""
  found = []
  for nvidia in _nvidia_dirs(sys.path if search_path is None else search_path):
    for major in majors:
      layouts = []
      # CUDA 13 and later: every package under one nvidia/cu<major>/.
      prefix = nvidia / f"cu{major}"
      layouts.append((prefix / "bin" / "nvcc",
                      [prefix / "include", prefix / "include" / "cccl"],
                      [prefix / "lib"]))
      if major == 12:  # CUDA 12: one folder per package.
        layouts.append((nvidia / "cuda_nvcc" / "bin" / "nvcc",
                        [nvidia / p / "include" for p in
                         ("cuda_nvcc", "cuda_runtime", "cuda_cccl")],
                        [nvidia / "cuda_runtime" / "lib"]))
      for nvcc, includes, libraries in layouts:
        if not nvcc.is_file():
          continue
        includes = tuple(str(d) for d in includes if d.is_dir())
        missing = _missing_headers(includes)
        if missing:
          if incomplete is not None:
            incomplete.append(f"{nvcc} lacks {', '.join(missing)}")
          continue
        found.append((str(nvcc), includes,
                      tuple(str(d) for d in libraries if d.is_dir())))
  return found


def _candidates(incomplete: list[str]) -> list[tuple[str, str, tuple, tuple]]:
  """(nvcc, origin, include dirs, library dirs) in search order, after
  $NVCC (handled by the caller)."""
  found = [(nvcc, "pip wheels", includes, libraries) for nvcc, includes,
           libraries in wheel_toolkit_dirs(jax_cuda_majors() or [13, 12],
                                           incomplete=incomplete)]
  cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
  if cuda_home:
    found.append((os.path.join(cuda_home, "bin", "nvcc"), "CUDA_HOME", (), ()))
  on_path = shutil.which("nvcc")
  if on_path:
    found.append((on_path, "PATH", (), ()))
  found.append((_SYSTEM_NVCC, "the standard CUDA location", (), ()))
  return found


@functools.cache
def _toolkit(nvcc_env: str | None, candidates: tuple,
             incomplete: tuple[str, ...]) -> Toolkit:
  if nvcc_env is not None:
    return Toolkit(nvcc_env, "NVCC", _query_version(nvcc_env, "NVCC"))
  searched = []
  for nvcc, origin, includes, libraries in candidates:
    searched.append(nvcc)
    if os.path.isfile(nvcc) and os.access(nvcc, os.X_OK):
      version = _query_version(nvcc, f"nvcc from {origin}")
      return Toolkit(nvcc, origin, version, includes, libraries)
  message = _NVCC_MISSING.format(searched=searched)
  if incomplete:
    message += (". NVIDIA wheels without the headers a build needs "
                "(pip install nvidia-cuda-runtime nvidia-cuda-cccl, or the "
                "-cu12 packages, adds them): " + "; ".join(incomplete))
  raise NvccNotFoundError(message)


def find_toolkit() -> Toolkit:
  """The nvcc to compile with (see the module docstring); its version is
  checked once per process and location."""
  nvcc_env = os.environ.get("NVCC")
  if nvcc_env is not None and not nvcc_env.strip():
    raise NvccNotFoundError("NVCC is set but empty; unset it or name nvcc")
  incomplete: list[str] = []
  candidates = tuple(_candidates(incomplete))
  return _toolkit(nvcc_env, candidates, tuple(incomplete))


def clear_cache() -> None:
  """Forget checked toolkits (tests change NVCC and PATH)."""
  _toolkit.cache_clear()


def _tool(toolkit: Toolkit, name: str) -> str:
  if name == "nvcc":
    return toolkit.nvcc
  sibling = os.path.join(os.path.dirname(toolkit.nvcc), name)
  return sibling if os.path.exists(sibling) else name


def run(toolkit: Toolkit, arguments: list[str], cwd, *, tool: str = "nvcc"
        ) -> str:
  """Runs nvcc (or a sibling tool) with `arguments` under the time limit.
  Returns its output; a failure, a timeout or an unrunnable program is a
  BuildError with the command and what it printed."""
  command = [_tool(toolkit, tool), *arguments]
  timeout = nvcc_timeout()
  shown = " ".join(command)
  where = f" ({toolkit.origin})" if tool == "nvcc" else ""
  return _run_or_raise(
      command, cwd, timeout, BuildError, what=f"{tool}{where} ({shown})",
      timeout_hint=(f"did not finish within {timeout:g} s "
                    "(PALLAS_GEMM_NVCC_TIMEOUT) and was stopped"),
      show_output=lambda text: "\n" + text)
