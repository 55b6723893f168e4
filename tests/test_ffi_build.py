"""The ffi build cache and the nvcc search, on CPU with a fake nvcc.

A shell script stands in for nvcc: it answers `--version` and writes a
small ELF-looking file to every `-o` target, so the whole build path runs
(planning, compiling in a temporary folder, the manifest, publishing,
validating) without a CUDA toolkit. Corrupt builds must be detected before
dlopen and rebuilt; a bogus NVCC, a hanging nvcc and an unusable cache
must each give one clear error or a clear fallback, never a traceback from
deep inside.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import time

import pytest

from pallas_gemm.ffi import __main__ as ffi_cli
from pallas_gemm.ffi import build, toolchain

REPO = pathlib.Path(__file__).resolve().parents[1]

FAKE_NVCC = r"""#!/bin/sh
if [ "$1" = "--version" ]; then
  echo "nvcc: NVIDIA (R) Cuda compiler driver"
  echo "Cuda compilation tools, release 13.0, V13.0.88"
  exit 0
fi
{sleep}
out=""
while [ $# -gt 0 ]; do
  if [ "$1" = "-o" ]; then out="$2"; shift; fi
  shift
done
if [ -n "$out" ]; then
  printf '\177ELF' > "$out"
  head -c 2048 /dev/zero >> "$out"
fi
echo "ptxas info    : 0 bytes spill stores, 0 bytes spill loads"
"""


def _script(path: pathlib.Path, text: str, mode: int = 0o755) -> str:
  path.write_text(text)
  path.chmod(mode)
  return str(path)


@pytest.fixture(autouse=True)
def _fresh_toolchain(monkeypatch):
  monkeypatch.delenv("PALLAS_GEMM_KEEP_PTX", raising=False)
  monkeypatch.delenv("PALLAS_GEMM_NVCC_TIMEOUT", raising=False)
  toolchain.clear_cache()
  yield
  toolchain.clear_cache()


@pytest.fixture
def fake_nvcc(tmp_path, monkeypatch):
  """NVCC is a fake compiler and the cache an empty temporary folder."""
  nvcc = _script(tmp_path / "nvcc", FAKE_NVCC.format(sleep=""))
  monkeypatch.setenv("NVCC", nvcc)
  monkeypatch.setenv("PALLAS_GEMM_CACHE_DIR", str(tmp_path / "cache"))
  monkeypatch.setattr(build, "_fallback_root", lambda: tmp_path / "fallback")
  return nvcc


def _temps(root: pathlib.Path) -> list[str]:
  return sorted(p.name for p in root.glob(build.TEMP_PREFIX + "*"))


# ------------------------------------------------------------- the cache ---


def test_build_goes_to_its_own_folder_with_a_manifest(fake_nvcc, tmp_path):
  plan = build.compile_library("90a")
  assert plan.folder.parent == tmp_path / "cache" / "build"
  assert build.build_root() == tmp_path / "cache" / "build"
  assert build.build_problem(plan.folder) is None
  assert (plan.folder / build.MANIFEST_NAME).is_file()
  assert plan.toolkit.origin == "NVCC"
  assert _temps(plan.folder.parent) == []
  # A second call finds the build and compiles nothing.
  mtime = plan.library.stat().st_mtime_ns
  assert build.compile_library("90a").library.stat().st_mtime_ns == mtime


def _truncate(path):
  data = path.read_bytes()
  path.write_bytes(data[:len(data) // 2])


def _empty(path):
  path.write_bytes(b"")


def _garbage(path):
  path.write_bytes(os.urandom(path.stat().st_size))


def _flipped_byte(path):
  data = bytearray(path.read_bytes())
  data[-1] ^= 0xFF
  path.write_bytes(bytes(data))


def _no_manifest(path):
  (path.parent / build.MANIFEST_NAME).unlink()


def _deleted(path):
  path.unlink()


@pytest.mark.parametrize("damage", [_truncate, _empty, _garbage,
                                    _flipped_byte, _no_manifest, _deleted])
def test_corrupt_library_is_detected_and_rebuilt(fake_nvcc, damage):
  plan = build.compile_library("90a")
  damage(plan.library)
  assert build.build_problem(plan.folder) is not None
  with pytest.warns(UserWarning, match="invalid .*rebuilding"):
    again = build.compile_library("90a")
  assert again.folder == plan.folder
  assert build.build_problem(again.folder) is None
  assert _temps(plan.folder.parent) == []


def test_load_never_dlopens_an_invalid_library(fake_nvcc, monkeypatch):
  plan = build.compile_library("90a")
  monkeypatch.setattr(build, "compile_library", lambda: plan)
  _truncate(plan.library)

  def dlopen(path):
    raise AssertionError(f"dlopen of an invalid library {path}")

  monkeypatch.setattr(build.ctypes.cdll, "LoadLibrary", dlopen)
  monkeypatch.setattr(build, "_library", None)
  with pytest.raises(build.BuildError, match="is invalid"):
    build.load_library()


def test_cli_build_rebuilds_and_exits_zero(fake_nvcc, capsys):
  plan = build.compile_library("90a")
  _truncate(plan.library)
  assert ffi_cli.main(["build", "--arch", "90a"]) == 0
  captured = capsys.readouterr()
  assert "rebuilding" in captured.err
  assert captured.out.strip() == str(plan.folder)
  assert build.build_problem(plan.folder) is None


def test_cli_build_exits_nonzero_when_the_result_is_invalid(
    fake_nvcc, monkeypatch, capsys):
  plan = build.compile_library("90a")
  _empty(plan.library)
  monkeypatch.setattr(build, "compile_library", lambda arch: plan)
  assert ffi_cli.main(["build", "--arch", "90a"]) == 1
  assert "invalid after the build" in capsys.readouterr().err


def test_nvcc_that_writes_no_elf_is_a_build_error(tmp_path, monkeypatch):
  script = FAKE_NVCC.format(sleep="").replace(r"printf '\177ELF'",
                                              "printf 'text'")
  monkeypatch.setenv("NVCC", _script(tmp_path / "nvcc", script))
  monkeypatch.setenv("PALLAS_GEMM_CACHE_DIR", str(tmp_path / "cache"))
  with pytest.raises(build.BuildError, match="not an ELF file"):
    build.compile_library("90a")
  root = tmp_path / "cache" / "build"
  assert _temps(root) == [] and not list(root.glob("sm_*"))


def test_stale_temp_folders_are_removed(fake_nvcc, tmp_path):
  root = tmp_path / "cache" / "build"
  root.mkdir(parents=True)
  stale = root / f"{build.TEMP_PREFIX}sm_90a-killed"
  fresh = root / f"{build.TEMP_PREFIX}sm_90a-running"
  for folder in (stale, fresh):
    folder.mkdir()
    (folder / "a.o").write_bytes(b"x")
  old = time.time() - build.STALE_TEMP_SECONDS - 60
  os.utime(stale, (old, old))
  build.compile_library("90a")
  assert not stale.exists() and fresh.exists()


def test_concurrent_builds_both_succeed(fake_nvcc, tmp_path):
  env = dict(os.environ, PYTHONPATH=str(REPO))
  command = [sys.executable, "-m", "pallas_gemm.ffi", "build", "--arch",
             "90a"]
  processes = [subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
               for _ in range(2)]
  results = [p.communicate(timeout=240) for p in processes]
  assert [p.returncode for p in processes] == [0, 0], results
  folders = {out.strip() for out, _ in results}
  assert len(folders) == 1
  folder = pathlib.Path(folders.pop())
  assert build.build_problem(folder) is None
  assert _temps(folder.parent) == []


# ------------------------------------------- unusable cache locations ---


def test_cache_path_that_is_a_file_builds_elsewhere(fake_nvcc, tmp_path,
                                                    monkeypatch):
  blocker = tmp_path / "blocker"
  blocker.write_text("not a folder")
  monkeypatch.setenv("PALLAS_GEMM_CACHE_DIR", str(blocker))
  with pytest.warns(UserWarning, match="is not a folder.*building in"):
    plan = build.compile_library("90a")
  assert plan.folder.parent == tmp_path / "fallback"
  assert build.build_problem(plan.folder) is None


def test_cache_that_cannot_be_created_builds_elsewhere(fake_nvcc, tmp_path,
                                                       monkeypatch):
  # Nothing, not even root, can create folders under /proc.
  monkeypatch.setenv("PALLAS_GEMM_CACHE_DIR", "/proc/pallas_gemm_cache")
  with pytest.warns(UserWarning, match="cannot create"):
    plan = build.compile_library("90a")
  assert plan.folder.parent == tmp_path / "fallback"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes read-only folders")
def test_read_only_cache_builds_elsewhere(fake_nvcc, tmp_path, monkeypatch):
  cache = tmp_path / "cache"
  (cache / "build").mkdir(parents=True)
  (cache / "build").chmod(0o555)
  try:
    with pytest.warns(UserWarning, match="not writable"):
      plan = build.compile_library("90a")
    assert plan.folder.parent == tmp_path / "fallback"
  finally:
    (cache / "build").chmod(0o755)


def test_read_only_cache_with_a_good_build_is_used(fake_nvcc, monkeypatch):
  plan = build.compile_library("90a")
  monkeypatch.setattr(build, "_usable_root", lambda root: "read-only")
  assert build.compile_library("90a").folder == plan.folder


def test_no_writable_location_is_one_clear_error(fake_nvcc, monkeypatch,
                                                 capsys):
  monkeypatch.setattr(build, "_usable_root", lambda root: "read-only")
  with pytest.raises(build.BuildError, match="PALLAS_GEMM_CACHE_DIR"):
    build.compile_library("90a")
  assert ffi_cli.main(["build", "--arch", "90a"]) == 1
  assert "PALLAS_GEMM_CACHE_DIR" in capsys.readouterr().err


# ------------------------------------------------------- a bogus NVCC ---

BOGUS_NVCC = {
    "missing": None,
    "folder": "folder",
    "not_executable": ("#!/bin/sh\necho 'release 13.0'\n", 0o644),
    "garbage": ("#!/bin/sh\necho 'hello, I am not a compiler'\n", 0o755),
    "exits_nonzero": ("#!/bin/sh\necho 'boom' >&2\nexit 3\n", 0o755),
    "non_utf8": ("#!/bin/sh\nprintf '\\377\\376 release \\377'\nexit 0\n",
                 0o755),
    "non_utf8_failing": ("#!/bin/sh\nprintf '\\377\\376'\nexit 1\n", 0o755),
    "empty": ("", 0o755),
}


@pytest.mark.parametrize("kind", sorted(BOGUS_NVCC))
def test_bogus_nvcc_is_a_clear_error_naming_it(kind, tmp_path, monkeypatch,
                                               capsys):
  spec = BOGUS_NVCC[kind]
  path = tmp_path / "nvcc"
  if spec == "folder":
    path.mkdir()
  elif spec is not None:
    _script(path, *spec)
  monkeypatch.setenv("NVCC", str(path))
  monkeypatch.setenv("PALLAS_GEMM_CACHE_DIR", str(tmp_path / "cache"))
  # A working nvcc elsewhere must not stand in for the one NVCC names.
  good = tmp_path / "bin"
  good.mkdir()
  _script(good / "nvcc", FAKE_NVCC.format(sleep=""))
  monkeypatch.setenv("PATH", f"{good}:{os.environ['PATH']}")
  with pytest.raises(build.NvccNotFoundError, match=r"^NVCC: ") as error:
    build.find_toolkit()
  assert str(path) in str(error.value)
  assert ffi_cli.main(["build", "--arch", "90a"]) == 1
  err = capsys.readouterr().err
  assert "NVCC" in err and "Traceback" not in err


def test_empty_nvcc_variable_is_an_error(monkeypatch):
  monkeypatch.setenv("NVCC", " ")
  with pytest.raises(build.NvccNotFoundError, match="NVCC is set but empty"):
    build.find_toolkit()


def _no_nvcc_anywhere(monkeypatch, tmp_path, site_packages):
  """No NVCC, CUDA_HOME, nvcc on PATH or system toolkit; sys.path is
  `site_packages` alone."""
  for name in ("NVCC", "CUDA_HOME", "CUDA_PATH"):
    monkeypatch.delenv(name, raising=False)
  monkeypatch.setenv("PATH", str(tmp_path))
  monkeypatch.setattr(toolchain, "_SYSTEM_NVCC", str(tmp_path / "none"))
  monkeypatch.setattr(toolchain.sys, "path", [str(site_packages)])


def test_missing_nvcc_is_one_clear_error(monkeypatch, tmp_path):
  _no_nvcc_anywhere(monkeypatch, tmp_path, site_packages=tmp_path)
  with pytest.raises(build.NvccNotFoundError, match="nvcc.*not found"):
    build.find_nvcc()


def test_hanging_nvcc_times_out_and_leaves_no_temp(tmp_path, monkeypatch):
  script = FAKE_NVCC.format(sleep="sleep 30")
  monkeypatch.setenv("NVCC", _script(tmp_path / "nvcc", script))
  monkeypatch.setenv("PALLAS_GEMM_CACHE_DIR", str(tmp_path / "cache"))
  monkeypatch.setenv("PALLAS_GEMM_NVCC_TIMEOUT", "1")
  start = time.monotonic()
  with pytest.raises(build.BuildError, match="did not finish within 1 s"):
    build.compile_library("90a", jobs=2)
  assert time.monotonic() - start < 20
  root = tmp_path / "cache" / "build"
  assert _temps(root) == [] and not list(root.glob("sm_*"))


@pytest.mark.parametrize("value", ["0", "-3", "soon"])
def test_bad_nvcc_timeout_is_named(value, fake_nvcc, monkeypatch):
  monkeypatch.setenv("PALLAS_GEMM_NVCC_TIMEOUT", value)
  with pytest.raises(build.BuildError, match="PALLAS_GEMM_NVCC_TIMEOUT"):
    build.compile_library("90a")


def test_compile_failure_shows_the_output(tmp_path, monkeypatch):
  script = FAKE_NVCC.format(sleep="echo 'error: bad kernel' >&2; exit 2")
  monkeypatch.setenv("NVCC", _script(tmp_path / "nvcc", script))
  monkeypatch.setenv("PALLAS_GEMM_CACHE_DIR", str(tmp_path / "cache"))
  with pytest.raises(build.BuildError, match="(?s)exit code 2.*bad kernel"):
    build.compile_library("90a", jobs=1)
  assert _temps(tmp_path / "cache" / "build") == []


# ------------------------------------------- nvcc from NVIDIA pip wheels ---


def _wheel_site(tmp_path: pathlib.Path, layout: str) -> pathlib.Path:
  """A fake site-packages holding the NVIDIA wheels' files."""
  site = tmp_path / f"site-{layout}"
  nvidia = site / "nvidia"
  if layout == "cu13":
    prefix = nvidia / "cu13"
    for sub in ("bin", "include/cccl/nv", "lib"):
      (prefix / sub).mkdir(parents=True)
    _script(prefix / "bin" / "nvcc", FAKE_NVCC.format(sleep=""))
    (prefix / "include" / "cuda_runtime.h").write_text("")
    (prefix / "include" / "cccl" / "nv" / "target").write_text("")
  else:
    for package in ("cuda_nvcc/bin", "cuda_nvcc/include",
                    "cuda_runtime/include", "cuda_runtime/lib",
                    "cuda_cccl/include/nv"):
      (nvidia / package).mkdir(parents=True)
    _script(nvidia / "cuda_nvcc" / "bin" / "nvcc",
            FAKE_NVCC.format(sleep=""))
    (nvidia / "cuda_runtime/include/cuda_runtime.h").write_text("")
    (nvidia / "cuda_cccl/include/nv/target").write_text("")
  return site


def test_wheel_layouts_are_found(tmp_path):
  cu13 = _wheel_site(tmp_path, "cu13")
  cu12 = _wheel_site(tmp_path, "cu12")
  (nvcc, includes, libraries), = toolchain.wheel_toolkit_dirs([13], [cu13])
  prefix = cu13 / "nvidia" / "cu13"
  assert nvcc == str(prefix / "bin" / "nvcc")
  assert includes == (str(prefix / "include"), str(prefix / "include/cccl"))
  assert libraries == (str(prefix / "lib"),)
  (nvcc, includes, _), = toolchain.wheel_toolkit_dirs([12], [cu12])
  assert nvcc.endswith("nvidia/cuda_nvcc/bin/nvcc")
  assert includes == (str(cu12 / "nvidia/cuda_nvcc/include"),
                      str(cu12 / "nvidia/cuda_runtime/include"),
                      str(cu12 / "nvidia/cuda_cccl/include"))
  # The other major's wheels are not taken.
  assert toolchain.wheel_toolkit_dirs([12], [cu13]) == []
  assert toolchain.wheel_toolkit_dirs([13], [cu12]) == []
  # A CUDA 12 nvcc wheel with ptxas only (as 12.9 ships) is no toolkit.
  (cu12 / "nvidia/cuda_nvcc/bin/nvcc").unlink()
  assert toolchain.wheel_toolkit_dirs([12], [cu12]) == []


def test_wheels_come_before_path_and_nvcc_before_wheels(tmp_path,
                                                        monkeypatch):
  site = _wheel_site(tmp_path, "cu13")
  on_path = tmp_path / "bin"
  on_path.mkdir()
  _script(on_path / "nvcc", FAKE_NVCC.format(sleep=""))
  monkeypatch.delenv("NVCC", raising=False)
  monkeypatch.delenv("CUDA_HOME", raising=False)
  monkeypatch.delenv("CUDA_PATH", raising=False)
  monkeypatch.setenv("PATH", f"{on_path}:{os.environ['PATH']}")
  monkeypatch.setattr(toolchain.sys, "path", [str(site), *sys.path])
  monkeypatch.setattr(toolchain, "jax_cuda_majors", lambda: [13])
  toolkit = build.find_toolkit()
  assert toolkit.origin == "pip wheels" and toolkit.release == (13, 0)
  assert toolkit.nvcc == str(site / "nvidia/cu13/bin/nvcc")
  flags = build._flags(toolkit, "90a")
  assert str(site / "nvidia/cu13/include") in flags
  assert str(site / "nvidia/cu13/include/cccl") in flags
  # The wheels of another CUDA major than jax's are skipped.
  monkeypatch.setattr(toolchain, "jax_cuda_majors", lambda: [12])
  toolchain.clear_cache()
  assert build.find_toolkit().origin == "PATH"
  # An explicit NVCC wins over the wheels.
  monkeypatch.setattr(toolchain, "jax_cuda_majors", lambda: [13])
  monkeypatch.setenv("NVCC", str(on_path / "nvcc"))
  toolchain.clear_cache()
  assert build.find_toolkit().origin == "NVCC"


def test_wheel_toolkit_builds_with_its_headers(tmp_path, monkeypatch):
  site = _wheel_site(tmp_path, "cu13")
  log = tmp_path / "calls.txt"
  nvcc = site / "nvidia/cu13/bin/nvcc"
  _script(nvcc, FAKE_NVCC.format(sleep=f'echo "$@" >> "{log}"'))
  monkeypatch.delenv("NVCC", raising=False)
  monkeypatch.setattr(toolchain.sys, "path", [str(site), *sys.path])
  monkeypatch.setattr(toolchain, "jax_cuda_majors", lambda: [13])
  monkeypatch.setenv("PALLAS_GEMM_CACHE_DIR", str(tmp_path / "cache"))
  plan = build.compile_library("90a", jobs=1)
  assert plan.toolkit.origin == "pip wheels"
  calls = log.read_text().splitlines()
  compiles = [c for c in calls if " -c " in c]
  assert compiles and all(f"-I {site}/nvidia/cu13/include" in c
                          for c in compiles)
  assert any("-shared" in c and f"-L {site}/nvidia/cu13/lib" in c
             for c in calls)


def test_jax_cuda_majors_reads_installed_plugins(monkeypatch):
  installed = {"jax-cuda12-plugin"}

  def version(name):
    if name not in installed:
      raise toolchain.importlib.metadata.PackageNotFoundError(name)
    return "0.11.2"

  monkeypatch.setattr(toolchain.importlib.metadata, "version", version)
  assert toolchain.jax_cuda_majors() == [12]
  installed.add("jax-cuda13-plugin")
  assert toolchain.jax_cuda_majors() == [13, 12]


def test_keep_ptx_without_cuobjdump_still_builds(fake_nvcc, monkeypatch):
  monkeypatch.setenv("PALLAS_GEMM_KEEP_PTX", "1")
  monkeypatch.setattr(toolchain, "_tool", lambda toolkit, name: (
      toolkit.nvcc if name == "nvcc" else "/nonexistent/cuobjdump"))
  with pytest.warns(UserWarning, match="cuobjdump"):
    plan = build.compile_library("90a")
  assert build.build_problem(plan.folder) is None
  assert "no SASS" in (plan.folder / "sass.txt").read_text()


def test_wheels_without_headers_are_skipped_and_named(tmp_path, monkeypatch):
  """jax[cuda13] alone installs nvcc and the runtime but not CCCL, whose
  <nv/target> the fp16 headers include: such a wheel set is no toolkit."""
  site = _wheel_site(tmp_path, "cu13")
  (site / "nvidia/cu13/include/cccl/nv/target").unlink()
  notes = []
  assert toolchain.wheel_toolkit_dirs([13], [site], notes) == []
  assert notes == [f"{site}/nvidia/cu13/bin/nvcc lacks nv/target"]
  _no_nvcc_anywhere(monkeypatch, tmp_path, site_packages=site)
  with pytest.raises(build.NvccNotFoundError,
                     match="nvidia-cuda-cccl.*lacks nv/target"):
    build.find_toolkit()


@pytest.mark.parametrize("given, bare", [("90a", "90a"), ("sm_90a", "90a"),
                                         ("compute_80", "80"), ("89", "89")])
def test_arch_spellings_normalise(given, bare):
  assert build.normalize_arch(given) == bare


@pytest.mark.parametrize("given", ["hopper", "sm90", "9", "sm_90b1", ""])
def test_a_bad_arch_is_an_error_naming_the_option(given, capsys):
  assert ffi_cli.main(["build", "--arch", given or " "]) == 1
  assert "--arch=" in capsys.readouterr().err
