"""Compiles the CUDA sources on first use and registers their FFI handlers.

Nothing here runs at import: `load_library()` compiles (or finds in the
cache) `libpallas_gemm_ffi.so`, loads it with ctypes and registers every
handler with XLA. The kernels' Python wrappers call it while they are being
lowered, so `import pallas_gemm` never needs nvcc or a GPU.

Cache: `$PALLAS_GEMM_CACHE_DIR`, else `$XDG_CACHE_HOME/pallas_gemm/ffi`, else
`~/.cache/pallas_gemm/ffi`. Each build lives in a folder named by a hash of
the sources, the nvcc version, the GPU architecture, the jaxlib version and
the flags, so a change in any of them rebuilds, and is compiled in a
temporary folder and renamed into place atomically (two processes building
at once both succeed; one result wins).

Environment switches:
  PALLAS_GEMM_CUDA_ARCH=90a   target this architecture instead of the GPU's
  PALLAS_GEMM_KEEP_PTX=1      keep PTX (nvcc --keep) and write sass.txt
                              (cuobjdump --dump-sass) next to the library
  NVCC=/path/to/nvcc          which nvcc to use (also $CUDA_HOME/bin/nvcc)
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import dataclasses
import hashlib
import os
import pathlib
import shutil
import subprocess
import tempfile
import threading

CSRC_DIR = pathlib.Path(__file__).resolve().parent / "csrc"
LIBRARY_NAME = "libpallas_gemm_ffi.so"
# A standalone program that runs every launcher on small ragged shapes and
# checks it against a CPU reference: the target for compute-sanitizer.
DRIVER_SOURCE = "sanitizer_driver.cu"
# The tuning sweep (`python -m pallas_gemm.ffi sweep`): the kernel sources
# again, compiled with -DPALLAS_GEMM_SWEEP so their sweep-only candidates
# (csrc/sweep.cuh) exist, linked with this driver into one program.
SWEEP_SOURCE = "sweep_driver.cu"
SWEEP_PROGRAM = "ffi_sweep"

#: FFI target name -> exported handler symbol in the library.
HANDLERS = {
    "pallas_gemm_sgemm_01_naive": "PallasGemmSgemm01Naive",
    "pallas_gemm_sgemm_02_coalesced": "PallasGemmSgemm02Coalesced",
    "pallas_gemm_sgemm_03_smem_tiled": "PallasGemmSgemm03SmemTiled",
    "pallas_gemm_sgemm_04_conflict_free": "PallasGemmSgemm04ConflictFree",
    "pallas_gemm_sgemm_05_vectorized_1d": "PallasGemmSgemm05Vectorized1d",
    "pallas_gemm_sgemm_06_register_2d": "PallasGemmSgemm06Register2d",
    "pallas_gemm_sgemm_07_double_buffered": "PallasGemmSgemm07DoubleBuffered",
    "pallas_gemm_sgemm_08_warptile": "PallasGemmSgemm08Warptile",
    "pallas_gemm_sgemm_09_two_blocks_per_sm": "PallasGemmSgemm09TwoBlocksPerSm",
    "pallas_gemm_sgemm_10_pipelined": "PallasGemmSgemm10Pipelined",
    "pallas_gemm_mma_sync_bn128": "PallasGemmMmaSyncBn128",
    "pallas_gemm_mma_sync_bn256": "PallasGemmMmaSyncBn256",
    "pallas_gemm_mma_sync_bn256_bk64": "PallasGemmMmaSyncBn256Bk64",
    "pallas_gemm_mma_sync_bn128_w4": "PallasGemmMmaSyncBn128W4",
    "pallas_gemm_mma_pipe_128x256x32": "PallasGemmMmaPipe128X256X32",
    "pallas_gemm_mma_pipe_256x128x32": "PallasGemmMmaPipe256X128X32",
    "pallas_gemm_mma_pipe_128x256x64": "PallasGemmMmaPipe128X256X64",
    "pallas_gemm_mma_pipe_128x128x32": "PallasGemmMmaPipe128X128X32",
    "pallas_gemm_mma_pipe_128x128x64": "PallasGemmMmaPipe128X128X64",
    "pallas_gemm_mma_pipe_128x256x64_tma": "PallasGemmMmaPipe128X256X64Tma",
}

_NVCC_MISSING = (
    "pallas_gemm's ffi/* kernels compile CUDA C++ on first use and need "
    "nvcc, the CUDA toolkit compiler, which was not found. Install the CUDA "
    "toolkit (12.4 or newer; e.g. `apt install cuda-toolkit-13-0` or the "
    "installer from developer.nvidia.com), then put nvcc on PATH or set "
    "CUDA_HOME or NVCC. Searched: {searched}")


class NvccNotFoundError(RuntimeError):
  """No nvcc in any of the places `find_nvcc` looks."""


class BuildError(RuntimeError):
  """nvcc failed; the message holds its output."""


def find_nvcc() -> str:
  """nvcc from $CUDA_HOME/bin, $NVCC, PATH, then /usr/local/cuda/bin."""
  candidates = []
  cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
  if cuda_home:
    candidates.append(os.path.join(cuda_home, "bin", "nvcc"))
  if os.environ.get("NVCC"):
    candidates.append(os.environ["NVCC"])
  on_path = shutil.which("nvcc")
  if on_path:
    candidates.append(on_path)
  candidates.append("/usr/local/cuda/bin/nvcc")
  for candidate in candidates:
    if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
      return candidate
  raise NvccNotFoundError(_NVCC_MISSING.format(searched=candidates or "none"))


def nvcc_version(nvcc: str) -> str:
  result = subprocess.run([nvcc, "--version"], capture_output=True, text=True,
                          check=True)
  return result.stdout.strip().splitlines()[-1]


def default_arch() -> str:
  """The architecture to build for: the GPU's, with `a` on Hopper (wgmma-era
  features need sm_90a); sm_90a when there is no GPU to ask."""
  override = os.environ.get("PALLAS_GEMM_CUDA_ARCH")
  if override:
    return override.removeprefix("sm_").removeprefix("compute_")
  from pallas_gemm.devices import device_info
  try:
    info = device_info()
  except Exception:  # noqa: BLE001 - no backend at all: build for Hopper
    info = None
  if info is None or info.compute_capability is None:
    return "90a"
  major, minor = info.compute_capability
  return f"{major}{minor}a" if major == 9 else f"{major}{minor}"


def cache_root() -> pathlib.Path:
  override = os.environ.get("PALLAS_GEMM_CACHE_DIR")
  if override:
    return pathlib.Path(override)
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(
      os.path.expanduser("~"), ".cache")
  return pathlib.Path(base) / "pallas_gemm" / "ffi"


def kernel_sources() -> list[pathlib.Path]:
  return sorted(p for p in CSRC_DIR.glob("*.cu")
                if p.name not in (DRIVER_SOURCE, SWEEP_SOURCE))


def _flags(arch: str) -> list[str]:
  import jax
  return [
      "-O3", "-std=c++17", f"-gencode=arch=compute_{arch},code=sm_{arch}",
      "-Xcompiler", "-fPIC", "-I", str(CSRC_DIR), "-I", jax.ffi.include_dir(),
      # The FFI headers trip harmless warnings in nvcc's front end.
      "-diag-suppress", "940,2473", "-Xcompiler", "-Wno-return-type",
  ]


@dataclasses.dataclass(frozen=True)
class BuildPlan:
  nvcc: str
  arch: str
  key: str
  folder: pathlib.Path

  @property
  def library(self) -> pathlib.Path:
    return self.folder / LIBRARY_NAME


def plan_build(arch: str | None = None) -> BuildPlan:
  import jaxlib
  nvcc = find_nvcc()
  arch = arch or default_arch()
  digest = hashlib.sha256()
  for path in sorted(CSRC_DIR.iterdir()):
    if path.suffix in (".cu", ".cuh", ".h"):
      digest.update(path.name.encode())
      digest.update(path.read_bytes())
  digest.update(nvcc_version(nvcc).encode())
  digest.update(arch.encode())
  digest.update(jaxlib.__version__.encode())
  digest.update(" ".join(_flags(arch)).encode())
  digest.update(os.environ.get("PALLAS_GEMM_KEEP_PTX", "").encode())
  key = f"sm_{arch}-{digest.hexdigest()[:16]}"
  return BuildPlan(nvcc=nvcc, arch=arch, key=key, folder=cache_root() / key)


def _run(command: list[str], cwd: pathlib.Path) -> str:
  result = subprocess.run(command, cwd=cwd, capture_output=True, text=True)
  output = result.stdout + result.stderr
  if result.returncode != 0:
    raise BuildError(f"command failed ({result.returncode}): "
                     f"{' '.join(command)}\n{output}")
  return output


def _compile_objects(plan: BuildPlan, flags, sources, tmp: pathlib.Path, *,
                     jobs: int | None, keep: bool = False) -> list[str]:
  """nvcc -c each source into `tmp` in parallel; the ptxas reports go to
  tmp/ptxas.log. Returns the object paths."""

  def compile_one(source: pathlib.Path) -> str:
    obj = tmp / (source.stem + ".o")
    extra = ["--keep", "--keep-dir", str(tmp)] if keep else []
    output = _run([plan.nvcc, *flags, "-Xptxas", "-v", *extra, "-c",
                   str(source), "-o", str(obj)], tmp)
    return f"==== {source.name}\n{output}"

  jobs = jobs or max(1, min(len(sources), os.cpu_count() or 1))
  with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
    logs = list(pool.map(compile_one, sources))
  (tmp / "ptxas.log").write_text("".join(logs))
  return [str(tmp / (s.stem + ".o")) for s in sources]


def _publish(tmp: pathlib.Path, folder: pathlib.Path) -> bool:
  """Renames the finished build `tmp` to `folder`; False when another
  process got there first (its build is identical)."""
  os.chmod(tmp, 0o755)
  if folder.exists():
    return False
  try:
    os.rename(tmp, folder)
  except OSError:
    if not folder.exists():
      raise
    return False
  # The renamed folder must not be deleted by TemporaryDirectory's cleanup.
  tmp.mkdir(exist_ok=True)
  return True


def compile_library(arch: str | None = None, *, jobs: int | None = None,
                    with_driver: bool = False, verbose: bool = False
                    ) -> BuildPlan:
  """Builds the shared library (and optionally the sanitizer driver) into the
  cache unless it is there already. Returns where it lives."""
  plan = plan_build(arch)
  driver = plan.folder / "sanitizer_driver"
  if plan.library.exists() and (not with_driver or driver.exists()):
    return plan
  plan.folder.parent.mkdir(parents=True, exist_ok=True)
  keep = os.environ.get("PALLAS_GEMM_KEEP_PTX") == "1"
  flags = _flags(plan.arch)
  with tempfile.TemporaryDirectory(dir=plan.folder.parent,
                                   prefix=f".{plan.key}-") as tmp_name:
    tmp = pathlib.Path(tmp_name)
    objects = _compile_objects(plan, flags, kernel_sources(), tmp, jobs=jobs,
                               keep=keep)
    _run([plan.nvcc, "-shared", f"-gencode=arch=compute_{plan.arch},"
          f"code=sm_{plan.arch}", "-o", str(tmp / LIBRARY_NAME), *objects], tmp)
    if with_driver:
      _build_driver(plan, flags, tmp, objects)
    if keep:
      sass = _run([_cuobjdump(plan.nvcc), "--dump-sass",
                   str(tmp / LIBRARY_NAME)], tmp)
      (tmp / "sass.txt").write_text(sass)
    if verbose:
      print((tmp / "ptxas.log").read_text())
    if not _publish(tmp, plan.folder):
      # Only the driver may be missing from the build that won.
      if with_driver and not driver.exists():
        shutil.copy2(tmp / "sanitizer_driver", driver)
  return plan


def _build_driver(plan: BuildPlan, flags, tmp: pathlib.Path, objects) -> None:
  driver_obj = tmp / "sanitizer_driver.o"
  _run([plan.nvcc, *flags, "-c", str(CSRC_DIR / DRIVER_SOURCE), "-o",
        str(driver_obj)], tmp)
  _run([plan.nvcc, f"-gencode=arch=compute_{plan.arch},code=sm_{plan.arch}",
        "-o", str(tmp / "sanitizer_driver"), str(driver_obj), *objects], tmp)


def compile_sweep(arch: str | None = None, *, jobs: int | None = None
                  ) -> pathlib.Path:
  """Builds the sweep program next to the library's cache folder (same key,
  suffix `-sweep`), atomically like the library. Returns its path."""
  plan = plan_build(arch)
  folder = plan.folder.with_name(plan.key + "-sweep")
  program = folder / SWEEP_PROGRAM
  if program.exists():
    return program
  folder.parent.mkdir(parents=True, exist_ok=True)
  flags = [*_flags(plan.arch), "-DPALLAS_GEMM_SWEEP"]
  with tempfile.TemporaryDirectory(dir=folder.parent,
                                   prefix=f".{folder.name}-") as tmp_name:
    tmp = pathlib.Path(tmp_name)
    objects = _compile_objects(
        plan, flags, [*kernel_sources(), CSRC_DIR / SWEEP_SOURCE], tmp,
        jobs=jobs)
    _run([plan.nvcc, f"-gencode=arch=compute_{plan.arch},code=sm_{plan.arch}",
          "-o", str(tmp / SWEEP_PROGRAM), *objects], tmp)
    _publish(tmp, folder)
  return program


def _cuobjdump(nvcc: str) -> str:
  sibling = os.path.join(os.path.dirname(nvcc), "cuobjdump")
  return sibling if os.path.exists(sibling) else "cuobjdump"


_lock = threading.Lock()
_library: ctypes.CDLL | None = None


def load_library() -> ctypes.CDLL:
  """Compiles if needed, loads the library and registers every handler with
  XLA (platform CUDA). Idempotent and thread-safe."""
  global _library
  with _lock:
    if _library is not None:
      return _library
    import jax
    plan = compile_library()
    library = ctypes.cdll.LoadLibrary(str(plan.library))
    for target, symbol in HANDLERS.items():
      jax.ffi.register_ffi_target(
          target, jax.ffi.pycapsule(getattr(library, symbol)),
          platform="CUDA")
    _library = library
    return library
