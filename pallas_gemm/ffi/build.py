"""Compiles the CUDA sources on first use and registers their FFI handlers.

Nothing here runs at import: `load_library()` compiles (or finds in the
cache) `libpallas_gemm_ffi.so`, checks it, loads it with ctypes and
registers every handler of csrc/kernels.def with XLA. The kernels' Python
wrappers call it while they are being lowered, so `import pallas_gemm`
never needs nvcc or a GPU.

nvcc, in this order (toolchain.py):
  1. `$NVCC`, when set: that file or a clear error, never another nvcc;
  2. the NVIDIA pip wheels of the installed jax CUDA plugin's major
     (`nvidia-cuda-nvcc`, `nvidia-cuda-runtime`, `nvidia-cuda-cccl`: the
     project's cuda13 extra), with their headers;
  3. `$CUDA_HOME/bin`, PATH, then /usr/local/cuda/bin.

Cache: the `build/` folder of pallas_gemm's cache (`$PALLAS_GEMM_CACHE_DIR`,
else `$XDG_CACHE_HOME/pallas_gemm`, else `~/.cache/pallas_gemm`; tuning data
has its own `tuning/` folder beside it). Each build lives in a folder named
by a hash of the sources, the nvcc version, the GPU architecture, the jaxlib
version and the flags, so a change in any of them rebuilds. It is compiled
in a temporary folder inside the cache (prefix `.tmp-`) and renamed into
place, under a per-build file lock so that concurrent processes build once.
The library's size and sha256 are recorded next to it and checked before
every load: a truncated, empty or foreign file is never handed to dlopen
(a truncated ELF can kill the process), it is reported and rebuilt. An
unusable cache folder (read-only, or a file) makes the build go to a
temporary folder, with a warning saying so.

Environment switches:
  PALLAS_GEMM_CUDA_ARCH=90a      target this architecture instead of the GPU's
  PALLAS_GEMM_KEEP_PTX=1         keep PTX (nvcc --keep) and write sass.txt
                                 (cuobjdump --dump-sass) next to the library
  PALLAS_GEMM_NVCC_TIMEOUT=900   seconds one nvcc call may take
  NVCC=/path/to/nvcc             which nvcc to use
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import dataclasses
import hashlib
import json
import os
import pathlib
import re
import shutil
import tempfile
import threading
import time
import warnings

from pallas_gemm.ffi import kernel_list, toolchain
from pallas_gemm.ffi.toolchain import (BuildError, NvccNotFoundError,
                                       Toolkit, find_toolkit, run)

CSRC_DIR = kernel_list.CSRC_DIR
LIBRARY_NAME = "libpallas_gemm_ffi.so"
MANIFEST_NAME = "manifest.json"
#: Temporary build folders inside the cache start with this; one older than
#: STALE_TEMP_SECONDS belongs to a build that was killed.
TEMP_PREFIX = ".tmp-"
#: A live build writes an object file at least once per nvcc call, which
#: the timeout bounds, so a folder untouched for twice that is abandoned.
STALE_TEMP_SECONDS = 2 * toolchain.DEFAULT_NVCC_TIMEOUT_S

#: FFI target name -> exported handler symbol, one per kernels.def entry.
HANDLERS = kernel_list.handlers()

__all__ = ["BuildError", "BuildPlan", "HANDLERS", "NvccNotFoundError",
           "Toolkit", "build_root", "compile_library", "compile_program",
           "find_nvcc", "find_toolkit", "load_library", "plan_build"]


def find_nvcc() -> str:
  """The nvcc `find_toolkit` chooses (see toolchain.py)."""
  return find_toolkit().nvcc


_ARCH = re.compile(r"\d{2,3}[af]?")


def normalize_arch(arch: str, name: str = "arch") -> str:
  """`sm_90a`, `compute_90a` or `90a` -> `90a`; anything else raises,
  naming where the value came from."""
  bare = arch.strip().removeprefix("sm_").removeprefix("compute_")
  if not _ARCH.fullmatch(bare):
    raise BuildError(f"{name}={arch!r} is not a CUDA architecture such as "
                     "90a, sm_90a, 89 or 80")
  return bare


def default_arch() -> str:
  """The architecture to build for: the GPU's, with `a` on Hopper (wgmma-era
  features need sm_90a); sm_90a when there is no GPU to ask."""
  override = os.environ.get("PALLAS_GEMM_CUDA_ARCH")
  if override:
    return normalize_arch(override, "PALLAS_GEMM_CUDA_ARCH")
  from pallas_gemm.devices import device_info
  try:
    info = device_info()
  except Exception:  # noqa: BLE001 - no backend at all: build for Hopper
    info = None
  if info is None or info.compute_capability is None:
    return "90a"
  major, minor = info.compute_capability
  return f"{major}{minor}a" if major == 9 else f"{major}{minor}"


def build_root() -> pathlib.Path:
  """Where builds are cached: the `build/` folder of pallas_gemm's cache."""
  from pallas_gemm.autotune import cache_dir
  return cache_dir() / "build"


def _fallback_root() -> pathlib.Path:
  return (pathlib.Path(tempfile.gettempdir())
          / f"pallas_gemm-{os.getuid()}" / "build")


def _usable_root(root: pathlib.Path) -> str | None:
  """Why builds cannot be written under `root`, or None."""
  for parent in (root, *root.parents):
    if parent.exists():
      if not parent.is_dir():
        return f"{parent} is not a folder"
      break
  try:
    root.mkdir(parents=True, exist_ok=True)
  except OSError as error:
    return f"cannot create {root}: {error.strerror or error}"
  if not os.access(root, os.W_OK | os.X_OK):
    return f"{root} is not writable"
  return None


def kernel_sources() -> list[pathlib.Path]:
  return sorted(CSRC_DIR.glob("*.cu"))


def _flags(toolkit: Toolkit, arch: str) -> list[str]:
  import jax
  includes = [part for d in toolkit.include_dirs for part in ("-I", d)]
  return [
      "-O3", "-std=c++17", f"-gencode=arch=compute_{arch},code=sm_{arch}",
      "-Xcompiler", "-fPIC", "-I", str(CSRC_DIR), *includes,
      "-I", jax.ffi.include_dir(),
      # The FFI headers trip harmless warnings in nvcc's front end.
      "-diag-suppress", "940,2473", "-Xcompiler", "-Wno-return-type",
  ]


def _link_flags(toolkit: Toolkit, arch: str) -> list[str]:
  libraries = [part for d in toolkit.library_dirs for part in ("-L", d)]
  return [f"-gencode=arch=compute_{arch},code=sm_{arch}", *libraries]


@dataclasses.dataclass(frozen=True)
class BuildPlan:
  toolkit: Toolkit
  arch: str
  key: str
  folder: pathlib.Path

  @property
  def nvcc(self) -> str:
    return self.toolkit.nvcc

  @property
  def library(self) -> pathlib.Path:
    return self.folder / LIBRARY_NAME


def _source_digest(extra: tuple[pathlib.Path, ...] = ()):
  digest = hashlib.sha256()
  for path in [*sorted(CSRC_DIR.iterdir()), *extra]:
    if path.suffix in (".cu", ".cuh", ".h", ".def"):
      digest.update(path.name.encode())
      digest.update(path.read_bytes())
  return digest


def plan_build(arch: str | None = None, *,
               extra_sources: tuple[pathlib.Path, ...] = (),
               extra_flags: tuple[str, ...] = ()) -> BuildPlan:
  """Where the build for this toolkit, architecture and source set lives."""
  import jaxlib
  toolkit = find_toolkit()
  arch = normalize_arch(arch, "arch") if arch else default_arch()
  digest = _source_digest(tuple(extra_sources))
  digest.update(toolkit.version.encode())
  digest.update(arch.encode())
  digest.update(jaxlib.__version__.encode())
  digest.update(" ".join([*_flags(toolkit, arch), *extra_flags]).encode())
  digest.update(os.environ.get("PALLAS_GEMM_KEEP_PTX", "").encode())
  key = f"sm_{arch}-{digest.hexdigest()[:16]}"
  return BuildPlan(toolkit=toolkit, arch=arch, key=key,
                   folder=build_root() / key)


# ------------------------------------------------ validating a build ---


def _sha256(path: pathlib.Path) -> str:
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
      digest.update(block)
  return digest.hexdigest()


def _elf_problem(path: pathlib.Path) -> str | None:
  try:
    size = path.stat().st_size
    with open(path, "rb") as f:
      magic = f.read(4)
  except OSError as error:
    return f"{path.name} cannot be read ({error.strerror or error})"
  if size == 0:
    return f"{path.name} is empty"
  if magic != b"\x7fELF":
    return f"{path.name} is not an ELF file"
  return None


def _write_manifest(folder: pathlib.Path, artefact: str) -> None:
  path = folder / artefact
  problem = _elf_problem(path)
  if problem is not None:
    raise BuildError(f"nvcc reported success but {problem} ({path})")
  manifest = {"artefact": artefact, "size": path.stat().st_size,
              "sha256": _sha256(path)}
  (folder / MANIFEST_NAME).write_text(json.dumps(manifest, indent=1) + "\n")


def build_problem(folder: pathlib.Path, artefact: str = LIBRARY_NAME
                  ) -> str | None:
  """Why the build in `folder` must not be loaded, or None: its artefact
  must be an ELF file whose size and sha256 match the manifest written when
  it was built. Checked before dlopen, which a truncated ELF can crash."""
  path = folder / artefact
  if not path.is_file():
    return f"{artefact} is missing"
  try:
    manifest = json.loads((folder / MANIFEST_NAME).read_text())
    size, sha = int(manifest["size"]), str(manifest["sha256"])
  except (OSError, ValueError, KeyError, TypeError):
    return f"{MANIFEST_NAME} is missing or unreadable"
  problem = _elf_problem(path)
  if problem is not None:
    return problem
  actual = path.stat().st_size
  if actual != size:
    return f"{artefact} has {actual} bytes, {size} were built"
  if _sha256(path) != sha:
    return f"{artefact}'s sha256 differs from the one recorded at build time"
  return None


# ------------------------------------------------------- building ---


def _clean_stale_temps(root: pathlib.Path) -> None:
  """Removes temporary build folders left by killed builds."""
  now = time.time()
  for path in root.glob(TEMP_PREFIX + "*"):
    try:
      if now - path.stat().st_mtime > STALE_TEMP_SECONDS:
        shutil.rmtree(path, ignore_errors=True)
    except OSError:
      pass


def _compile_objects(plan: BuildPlan, flags, sources, tmp: pathlib.Path, *,
                     jobs: int | None, keep: bool = False) -> list[str]:
  """nvcc -c each source into `tmp` in parallel; the ptxas reports go to
  tmp/ptxas.log. Returns the object paths."""

  def compile_one(source: pathlib.Path) -> str:
    obj = tmp / (source.stem + ".o")
    extra = ["--keep", "--keep-dir", str(tmp)] if keep else []
    output = run(plan.toolkit, [*flags, "-Xptxas", "-v", *extra, "-c",
                                str(source), "-o", str(obj)], tmp)
    return f"==== {source.name}\n{output}"

  jobs = jobs or max(1, min(len(sources), os.cpu_count() or 1))
  with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
    futures = [pool.submit(compile_one, source) for source in sources]
    try:
      logs = [future.result() for future in futures]
    except BaseException:
      # One failure (or Ctrl-C) ends the build: queued compiles never start
      # and running ones are stopped, so the temporary folder can go.
      for future in futures:
        future.cancel()
      toolchain.stop_running()
      raise
  (tmp / "ptxas.log").write_text("".join(logs))
  return [str(tmp / (s.stem + ".o")) for s in sources]


def _build_into(plan: BuildPlan, artefact: str, produce) -> None:
  """Builds `plan.folder` (holding `artefact`) unless a valid one is there:
  under a file lock, in a temporary folder beside it that `produce(tmp)`
  fills, then renamed into place. A corrupt build is reported and replaced.
  """
  import filelock
  root = plan.folder.parent
  with filelock.FileLock(str(root / f".{plan.key}.lock")):
    if plan.folder.exists():
      problem = build_problem(plan.folder, artefact)
      if problem is None:
        return
      warnings.warn(f"pallas_gemm: the cached build {plan.folder} is "
                    f"invalid ({problem}); rebuilding it", stacklevel=3)
      doomed = pathlib.Path(tempfile.mkdtemp(dir=root, prefix=TEMP_PREFIX))
      os.rename(plan.folder, doomed / "invalid")
      shutil.rmtree(doomed, ignore_errors=True)
    _clean_stale_temps(root)
    tmp = pathlib.Path(tempfile.mkdtemp(dir=root,
                                        prefix=f"{TEMP_PREFIX}{plan.key}-"))
    try:
      produce(tmp)
      _write_manifest(tmp, artefact)
      os.chmod(tmp, 0o755)
      os.rename(tmp, plan.folder)
    finally:
      shutil.rmtree(tmp, ignore_errors=True)


def _in_usable_root(plan: BuildPlan, artefact: str) -> BuildPlan:
  """`plan` in the user's build cache, or in a temporary folder (with a
  warning) when that cache cannot be written and holds no valid build."""
  reason = _usable_root(plan.folder.parent)
  if reason is None:
    return plan
  if plan.folder.is_dir() and build_problem(plan.folder, artefact) is None:
    return plan  # a read-only cache with a good build: just use it
  fallback = _fallback_root()
  fallback_reason = _usable_root(fallback)
  if fallback_reason is not None:
    raise BuildError(f"pallas_gemm cannot write its FFI build cache "
                     f"({reason}) nor the temporary folder ({fallback_reason});"
                     f" set PALLAS_GEMM_CACHE_DIR to a writable folder")
  warnings.warn(f"pallas_gemm: the FFI build cache is unusable ({reason}); "
                f"building in {fallback} instead (set PALLAS_GEMM_CACHE_DIR "
                f"to a writable folder to keep builds)", stacklevel=3)
  return dataclasses.replace(plan, folder=fallback / plan.folder.name)


def compile_library(arch: str | None = None, *, jobs: int | None = None,
                    verbose: bool = False) -> BuildPlan:
  """Builds the shared library into the cache unless a valid build is
  there already. Returns where it lives."""
  plan = _in_usable_root(plan_build(arch), LIBRARY_NAME)
  keep = os.environ.get("PALLAS_GEMM_KEEP_PTX") == "1"

  def produce(tmp: pathlib.Path) -> None:
    objects = _compile_objects(plan, _flags(plan.toolkit, plan.arch),
                               kernel_sources(), tmp, jobs=jobs, keep=keep)
    run(plan.toolkit, ["-shared", *_link_flags(plan.toolkit, plan.arch),
                       "-o", str(tmp / LIBRARY_NAME), *objects], tmp)
    if keep:
      # SASS is a diagnostic: the pip wheels ship no cuobjdump, and its
      # absence must not fail the build it would only describe.
      try:
        sass = run(plan.toolkit, ["--dump-sass", str(tmp / LIBRARY_NAME)],
                   tmp, tool="cuobjdump")
      except BuildError as error:
        sass = f"no SASS: {error}\n"
        warnings.warn(f"pallas_gemm: PALLAS_GEMM_KEEP_PTX=1 but {error}",
                      stacklevel=2)
      (tmp / "sass.txt").write_text(sass)
    if verbose:
      print((tmp / "ptxas.log").read_text())

  _build_into(plan, LIBRARY_NAME, produce)
  return plan


def compile_program(name: str, sources: list[pathlib.Path], *,
                    arch: str | None = None, defines: tuple[str, ...] = (),
                    jobs: int | None = None) -> pathlib.Path:
  """Builds a standalone program from `sources` (e.g. a developer driver
  outside the package; they may include csrc/ headers and kernels.def)
  into the build cache, checked like the library. Without `defines` it
  links against the library's launchers (building the library first);
  with them, every kernel source is compiled again with `-D<define>` each
  and linked in. Returns the program's path."""
  sources = [pathlib.Path(s).resolve() for s in sources]
  extra_flags = tuple(f"-D{d}" for d in defines)
  library = None if defines else compile_library(arch, jobs=jobs)
  plan = plan_build(arch, extra_sources=tuple(sources),
                    extra_flags=(name, *extra_flags))
  plan = dataclasses.replace(plan, folder=plan.folder.with_name(
      f"{plan.folder.name}-{name}"))
  plan = _in_usable_root(plan, name)

  def produce(tmp: pathlib.Path) -> None:
    flags = [*_flags(plan.toolkit, plan.arch), *extra_flags]
    if library is None:
      objects = _compile_objects(plan, flags, [*kernel_sources(), *sources],
                                 tmp, jobs=jobs)
      linked = []
    else:
      objects = _compile_objects(plan, flags, sources, tmp, jobs=jobs)
      linked = [str(library.library), "-Xlinker",
                f"-rpath={library.folder}"]
    run(plan.toolkit, [*_link_flags(plan.toolkit, plan.arch), "-o",
                       str(tmp / name), *objects, *linked], tmp)

  _build_into(plan, name, produce)
  return plan.folder / name


_lock = threading.Lock()
_library: ctypes.CDLL | None = None


def load_library() -> ctypes.CDLL:
  """Compiles if needed, checks and loads the library and registers every
  handler with XLA (platform CUDA). Idempotent and thread-safe."""
  global _library
  with _lock:
    if _library is not None:
      return _library
    import jax
    plan = compile_library()
    problem = build_problem(plan.folder)
    if problem is not None:  # changed on disk since it was built or checked
      raise BuildError(f"{plan.library} is invalid ({problem}); run "
                       f"`python -m pallas_gemm.ffi build` to rebuild it")
    library = ctypes.cdll.LoadLibrary(str(plan.library))
    for target, symbol in HANDLERS.items():
      jax.ffi.register_ffi_target(
          target, jax.ffi.pycapsule(getattr(library, symbol)),
          platform="CUDA")
    _library = library
    return library
