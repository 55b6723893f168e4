"""The ffi/* CUDA kernels: build, registration, and (on a GPU) correctness.

On a CPU machine: the CUDA sources compile with nvcc when it is installed
(skipped otherwise), csrc/kernels.def agrees with the sources, handlers and
registry, every kernel is registered, and supports() explains what it
declines. The build cache and the toolchain search are tested with a fake
nvcc in tests/test_ffi_build.py. On a GPU (marked `gpu`):
every kernel against float64 on odd and large ragged shapes, the shared
kernel suite for the best rungs, jit/vmap/grad through pallas_gemm.matmul,
and the FFI handler rejecting bad buffers with an error instead of a crash.
"""

from __future__ import annotations

import os
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_gemm
from pallas_gemm import shapes
from pallas_gemm import numerics, registry
from pallas_gemm.devices import DeviceInfo
from pallas_gemm.ffi import build, kernel_list, kernels
from pallas_gemm.problem import GemmProblem
from tests.kernel_test_base import KernelTestBase, check_matmul

ON_GPU = jax.default_backend() == "gpu"
SGEMM_NAMES = tuple(k.registry_name for k in kernels.SGEMM_LADDER)
ALL_NAMES = SGEMM_NAMES + ("ffi/mma_sync",)
HOPPER = DeviceInfo("gpu", "NVIDIA H200", (9, 0), 132, 227 * 1024)
REPO = pathlib.Path(__file__).resolve().parents[1]
LAB_FFI = REPO / "experiments" / "lab" / "ffi"
PIPELINED_VARIANTS = sorted(v for v in kernels.MMA_SYNC_VARIANTS
                            if kernels.MmaSyncConfig(*v).pipelined)


def _has_nvcc() -> bool:
  try:
    build.find_nvcc()
    return True
  except build.NvccNotFoundError:
    return False


# ------------------------------------------------------------ CPU tests ---


@pytest.fixture(scope="session")
def built_library(tmp_path_factory):
  """The library, built once per session: into the normal cache on a GPU,
  into a temporary cache for sm_90a elsewhere. Under pytest-xdist that
  cache is the run's, shared by its workers: the build's file lock lets
  one worker compile (on every core) while the others wait and reuse it,
  instead of each compiling the same sources at once."""
  if not _has_nvcc():
    pytest.skip("nvcc not found: cannot compile the CUDA sources here")
  if ON_GPU:
    build.load_library()
    return build.plan_build()
  base = tmp_path_factory.getbasetemp()
  cache = (base.parent / "ffi_shared" if os.environ.get("PYTEST_XDIST_WORKER")
           else base / "ffi")
  cache.mkdir(exist_ok=True)
  old = os.environ.get("PALLAS_GEMM_CACHE_DIR")
  os.environ["PALLAS_GEMM_CACHE_DIR"] = str(cache)
  try:
    return build.compile_library("90a")
  finally:
    if old is None:
      del os.environ["PALLAS_GEMM_CACHE_DIR"]
    else:
      os.environ["PALLAS_GEMM_CACHE_DIR"] = old


def test_sources_compile(built_library):
  assert built_library.library.exists()
  log = (built_library.folder / "ptxas.log").read_text()
  assert "mma_sync.cu" in log and "sgemm_08_warptile.cu" in log
  assert "mma_sync_pipelined.cu" in log and "sgemm_10_pipelined.cu" in log
  # No kernel may spill registers to local memory.
  spills = [line for line in log.splitlines() if "spill" in line
            and not line.strip().startswith("0 bytes spill")]
  assert all(" 0 bytes spill stores, 0 bytes spill loads" in line
             for line in spills), spills


def test_sweep_program_compiles(built_library, monkeypatch):
  """The sweep-only candidates compile (and never spill) even though the
  library never instantiates them; a broken one would otherwise surface
  only on a GPU machine."""
  monkeypatch.setenv("PALLAS_GEMM_CACHE_DIR",
                     str(built_library.folder.parent.parent))
  program = build.compile_program(
      "ffi_sweep", [LAB_FFI / "sweep_driver.cu"], arch=built_library.arch,
      defines=("PALLAS_GEMM_SWEEP",))
  assert build.build_problem(program.parent, "ffi_sweep") is None
  log = (program.parent / "ptxas.log").read_text()
  assert "sweep_driver.cu" in log and "sgemm_10_pipelined.cu" in log
  spills = [line for line in log.splitlines() if "spill" in line]
  assert spills and all(" 0 bytes spill stores, 0 bytes spill loads" in line
                        for line in spills), spills


def test_sanitizer_driver_links_against_the_library(built_library,
                                                    monkeypatch):
  monkeypatch.setenv("PALLAS_GEMM_CACHE_DIR",
                     str(built_library.folder.parent.parent))
  program = build.compile_program(
      "sanitizer_driver", [LAB_FFI / "sanitizer_driver.cu"],
      arch=built_library.arch)
  assert build.build_problem(program.parent, "sanitizer_driver") is None


def test_library_exports_every_handler(built_library):
  import ctypes
  library = ctypes.CDLL(str(built_library.library))
  for symbol in build.HANDLERS.values():
    assert hasattr(library, symbol), symbol


def test_every_kernel_registered():
  names = pallas_gemm.list_kernels("ffi/*")
  assert set(ALL_NAMES) <= set(names)
  for name in ALL_NAMES:
    assert not registry.get_kernel(name).runs_on_cpu


def _problem(in_dtype="float32", precision="ieee", **kwargs):
  fields = dict(batch=1, m=33, n=17, k=29, in_dtype=in_dtype,
                out_dtype=in_dtype, precision=precision)
  fields.update(kwargs)
  return GemmProblem(**fields)


@pytest.mark.parametrize("name", SGEMM_NAMES)
def test_sgemm_supports(name):
  supports = registry.get_kernel(name).supports
  assert supports(_problem(), HOPPER) is None
  assert "Precision.HIGHEST" in supports(_problem(precision="tf32"), HOPPER)
  assert "float32" in supports(_problem("bfloat16", "default"), HOPPER)
  assert "CUDA GPU" in supports(_problem(), DeviceInfo("cpu", "cpu"))


def test_mma_sync_supports():
  supports = registry.get_kernel("ffi/mma_sync").supports
  for dtype in ("bfloat16", "float16"):
    assert supports(_problem(dtype, "default"), HOPPER) is None
  assert "bfloat16 or float16" in supports(_problem(), HOPPER)
  turing = DeviceInfo("gpu", "Tesla T4", (7, 5), 40, 64 * 1024)
  assert "compute capability" in supports(_problem("bfloat16", "default"),
                                          turing)
  assert "batch" in supports(_problem("bfloat16", "default", batch=70000),
                             HOPPER)


def test_mma_sync_config_validates():
  with pytest.raises(ValueError, match="block_n"):
    kernels.MmaSyncConfig(block_n=64)
  with pytest.raises(ValueError, match="compiled variant"):
    kernels.MmaSyncConfig(block_n=128, block_k=64)
  with pytest.raises(ValueError, match="compiled variant"):
    kernels.MmaSyncConfig(block_n=256, block_k=32, num_warps=8, stages=3,
                          pipelined=True)
  for variant, target in kernels.MMA_SYNC_VARIANTS.items():
    config = kernels.MmaSyncConfig(*variant)
    assert config.key == variant and config.target == target
    assert target in build.HANDLERS


def test_mma_sync_config_fields_are_typed():
  with pytest.raises(TypeError, match=r"MmaSyncConfig.block_n=256.0"):
    kernels.MmaSyncConfig(block_n=256.0)
  with pytest.raises(TypeError, match=r"MmaSyncConfig.pipelined=1"):
    kernels.MmaSyncConfig(pipelined=1)


def test_mma_sync_heuristic_is_pipelined():
  heuristic = registry.get_kernel("ffi/mma_sync").heuristic
  big = heuristic(_problem("bfloat16", "default", m=8192, n=8192, k=8192),
                  HOPPER)
  small = heuristic(_problem("bfloat16", "default", m=256, n=256, k=4096),
                    HOPPER)
  assert big == kernels.MMA_SYNC_DEFAULT_LARGE and big.pipelined
  assert small == kernels.MMA_SYNC_DEFAULT_SMALL and small.pipelined
  # A host plans for a nominal GPU's SM count, as every heuristic does.
  assert heuristic(_problem("bfloat16", "default"),
                   DeviceInfo("cpu", "cpu")) == small


# ------------------------------------------------------- the kernel list ---

CSRC = kernel_list.CSRC_DIR
RUNGS, TILINGS = kernel_list.entries()


def test_every_simt_rung_source_is_listed():
  """Each csrc/sgemm_*.cu is a rung of kernels.def and defines its
  launcher; each listed rung has its file."""
  files = {p.stem for p in CSRC.glob("sgemm_*.cu")}
  assert files == {rung.id for rung in RUNGS}
  for rung in RUNGS:
    text = (CSRC / f"{rung.id}.cu").read_text()
    assert f"pallas_gemm_launch_{rung.id}(" in text, rung.id
    assert rung.align in (1, 4) and rung.description


def test_every_mma_tiling_has_its_launcher():
  basic = (CSRC / "mma_sync.cu").read_text()
  pipelined = (CSRC / "mma_sync_pipelined.cu").read_text()
  instantiated = set(re.findall(r"^PALLAS_GEMM_PIPELINED_LAUNCHER\((\w+),",
                                pipelined, re.M))
  defined = set(re.findall(r"pallas_gemm_launch_(\w+)\(", basic))
  assert instantiated == {t.id for t in TILINGS if t.pipelined}
  assert defined == {t.id for t in TILINGS if not t.pipelined}
  for tiling in TILINGS:
    # The pipelined launcher macro defines a workspace sizer; the basic
    # kernels have none.
    assert tiling.workspace == tiling.pipelined, tiling
    assert tiling.tma <= tiling.pipelined, tiling


FP8_KERNELS = kernel_list.fp8_entries()


def test_every_fp8_kernel_has_its_launcher():
  assert FP8_KERNELS, "kernels.def lists no PALLAS_GEMM_FP8 entry"
  sources = "".join(path.read_text() for path in CSRC.glob("*.cu"))
  for kernel in FP8_KERNELS:
    assert re.search(rf"pallas_gemm_launch_{kernel.id}\(\s*"
                     r"const pallas_gemm::Fp8Params&", sources), kernel.id
    assert kernel.description


def test_fp8_entries_that_do_not_parse_name_their_line():
  with pytest.raises(ValueError, match="line 2"):
    kernel_list.parse_fp8('// fine\nPALLAS_GEMM_FP8(fp8_x, no quotes)\n')


def test_every_entry_is_a_handler_and_a_registered_kernel():
  assert set(build.HANDLERS) == {kernel_list.ffi_target(e.id)
                                 for e in (*RUNGS, *TILINGS, *FP8_KERNELS)}
  assert set(kernels.MMA_SYNC_VARIANTS.values()) == {
      kernel_list.ffi_target(t.id) for t in TILINGS}
  registered = set(pallas_gemm.list_kernels("ffi/*"))
  assert registered == ({f"ffi/{rung.id}" for rung in RUNGS}
                        | {"ffi/mma_sync"}
                        | {f"ffi/{k.id}" for k in FP8_KERNELS})
  for tiling in TILINGS:
    config = kernels.MmaSyncConfig(
        block_n=tiling.block_n, block_k=tiling.block_k,
        num_warps=tiling.num_warps, block_m=tiling.block_m,
        stages=tiling.stages, pipelined=tiling.pipelined, tma=tiling.tma)
    assert config.target == kernel_list.ffi_target(tiling.id)


@pytest.mark.parametrize("path", [
    CSRC / "ffi_handlers.cu", LAB_FFI / "sanitizer_driver.cu",
    LAB_FFI / "sweep_driver.cu"], ids=lambda p: p.name)
def test_tables_expand_the_list_instead_of_naming_kernels(path):
  text = path.read_text()
  assert '#include "kernels.def"' in text
  named = [e.id for e in (*RUNGS, *TILINGS)
           if re.search(rf"\b{e.id}\b", text)]
  assert not named, f"{path.name} names kernels by hand: {named}"


def test_kernel_list_parse_errors_name_the_line():
  with pytest.raises(ValueError, match="line 2"):
    kernel_list.parse('// ok\nPALLAS_GEMM_SGEMM(sgemm_x, four, "d")\n')
  with pytest.raises(ValueError, match="line 1"):
    kernel_list.parse("PALLAS_GEMM_MMA(mma_x, 128, 128, 32, 8, 4, 1, 0)\n")
  with pytest.raises(ValueError, match="more than once"):
    kernel_list.parse('PALLAS_GEMM_SGEMM(a, 1, "x")\n'
                      'PALLAS_GEMM_SGEMM(a, 4, "y")\n')
  rungs, tilings = kernel_list.parse(
      'PALLAS_GEMM_SGEMM(sgemm_x, 4, "a, \\"quoted\\" text")\n'
      "PALLAS_GEMM_MMA(mma_x, 128, 256, 64, 8, 3, 1, 1, 1)\n")
  assert rungs[0].align == 4 and "quoted" in rungs[0].description
  assert tilings[0].tma is True and tilings[0].block_n == 256


@pytest.mark.skipif(ON_GPU, reason="checks the CPU behaviour")
def test_requesting_ffi_kernel_on_cpu_is_a_clear_error():
  a = jnp.ones((8, 8), jnp.float32)
  with pytest.raises(ValueError, match="needs a CUDA GPU"):
    pallas_gemm.matmul(a, a, kernel="ffi/sgemm_08_warptile")


# ------------------------------------------------------------ GPU tests ---


def _operands(shape, dtype, batch=None):
  m, n, k = shape
  ka, kb = jax.random.split(numerics.fresh_key())
  lead = (batch,) if batch else ()
  return (numerics.random_normal(ka, lead + (m, k), dtype),
          numerics.random_normal(kb, lead + (k, n), dtype))


def _precision(dtype):
  return jax.lax.Precision.HIGHEST if dtype == "float32" else None


def _check_odd_shape(name, dtype, shape, *, config, precision, label):
  """One compiled call on poisoned output memory, against float64."""
  a, b = _operands(shape, dtype)
  numerics.poison_allocator(shape[:2], dtype)
  out = jax.jit(lambda a, b: pallas_gemm.matmul(
      a, b, kernel=name, config=config, precision=precision))(a, b)
  err = numerics.relative_error(out, numerics.reference_matmul(a, b))
  tol = numerics.tolerance(dtype, "ieee" if dtype == "float32" else "default",
                           dtype)
  assert err <= tol, f"{label} {shape} {dtype}: {err:.3g} > {tol:.3g}"


def _cases():
  for name in ALL_NAMES:
    dtypes = ("bfloat16", "float16") if name == "ffi/mma_sync" else ("float32",)
    for dtype in dtypes:
      for shape in shapes.ODD + [(4095, 4097, 4093)]:
        yield pytest.param(name, dtype, shape,
                           id=f"{name}-{dtype}-{'x'.join(map(str, shape))}")


@pytest.mark.gpu
@pytest.mark.parametrize("name,dtype,shape", list(_cases()))
def test_odd_shapes_match_float64(name, dtype, shape):
  _check_odd_shape(name, dtype, shape, config=None,
                   precision=_precision(dtype), label=name)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", sorted(kernels.MMA_SYNC_VARIANTS))
@pytest.mark.parametrize("out_dtype", ["float32", "bfloat16"])
def test_mma_sync_configs_and_outputs(variant, out_dtype):
  shape = (300, 520, 264)
  a, b = _operands(shape, "bfloat16", batch=2)
  out = jax.jit(lambda a, b: pallas_gemm.matmul(
      a, b, kernel="ffi/mma_sync", config=kernels.MmaSyncConfig(*variant),
      preferred_element_type=out_dtype))(a, b)
  assert out.dtype == jnp.dtype(out_dtype)
  err = numerics.relative_error(out, numerics.reference_matmul(a, b))
  assert err <= numerics.tolerance("bfloat16", "default", out_dtype)


def _pipelined_cases():
  for variant in PIPELINED_VARIANTS:
    label = kernels.MmaSyncConfig(*variant).label.replace(" ", "_")
    for dtype in ("bfloat16", "float16"):
      for shape in shapes.ODD + [(4095, 4097, 4093)]:
        if dtype == "float16" and shape != (4095, 4097, 4093):
          continue  # the dtype only changes the mma instruction
        yield pytest.param(variant, dtype, shape,
                           id=f"{label}-{dtype}-{'x'.join(map(str, shape))}")


@pytest.mark.gpu
@pytest.mark.parametrize("variant,dtype,shape", list(_pipelined_cases()))
def test_pipelined_variants_on_odd_shapes(variant, dtype, shape):
  config = kernels.MmaSyncConfig(*variant)
  _check_odd_shape("ffi/mma_sync", dtype, shape, config=config,
                   precision=None, label=config.label)


@pytest.mark.gpu
def test_stream_k_tail_is_deterministic():
  """4095x4097x4093 leaves a partial wave of 128x256 tiles, so the cp.async
  128x256x64 kernel shares its last 16 tiles between all SMs (up to ten
  partial sums per tile). The sums are added in a fixed order: repeated
  calls must agree bit for bit, whichever block finished last."""
  shape = (4095, 4097, 4093)
  a, b = _operands(shape, "bfloat16")
  config = kernels.MmaSyncConfig(block_n=256, block_k=64, num_warps=8,
                                 block_m=128, stages=3, pipelined=True)
  fn = jax.jit(lambda a, b: pallas_gemm.matmul(
      a, b, kernel="ffi/mma_sync", config=config))
  first = np.asarray(fn(a, b).astype(jnp.float32))
  err = numerics.relative_error(first, numerics.reference_matmul(a, b))
  assert err <= numerics.tolerance("bfloat16", "default", "bfloat16")
  for _ in range(3):
    again = np.asarray(fn(a, b).astype(jnp.float32))
    np.testing.assert_array_equal(again, first)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["ffi/sgemm_03_smem_tiled",
                                  "ffi/sgemm_08_warptile", "ffi/mma_sync"])
def test_blas_epilogue_in_kernel(name):
  dtype = "bfloat16" if name == "ffi/mma_sync" else "float32"
  check_matmul(name, (67, 45, 31), dtype, precision=_precision(dtype),
               out_dtype="float32", alpha=0.5, beta=-1.5, with_c=True,
               batch=2)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["ffi/sgemm_05_vectorized_1d",
                                  "ffi/sgemm_08_warptile", "ffi/mma_sync"])
def test_jit_vmap_grad(name):
  dtype = "bfloat16" if name == "ffi/mma_sync" else "float32"
  precision = _precision(dtype)
  tol = numerics.tolerance(dtype, "ieee" if dtype == "float32" else "default",
                           dtype)
  a, b = _operands((19, 23, 29), dtype, batch=3)

  def matmul(a, b):
    return pallas_gemm.matmul(a, b, kernel=name, precision=precision)

  out = jax.jit(jax.vmap(matmul))(a, b)
  ref = numerics.reference_matmul(a, b)
  assert numerics.relative_error(out, ref) <= tol

  def loss(a, b):
    return jnp.sum(jax.vmap(matmul)(a, b).astype(jnp.float32) ** 2)

  da, db = jax.jit(jax.grad(loss, argnums=(0, 1)))(a, b)
  a64 = np.asarray(a.astype(jnp.float32), np.float64)
  b64 = np.asarray(b.astype(jnp.float32), np.float64)
  out64 = np.asarray(out.astype(jnp.float32), np.float64)
  da_ref = 2 * out64 @ np.swapaxes(b64, 1, 2)
  db_ref = 2 * np.swapaxes(a64, 1, 2) @ out64
  assert numerics.relative_error(da, da_ref) <= 4 * tol
  assert numerics.relative_error(db, db_ref) <= 4 * tol


@pytest.mark.gpu
def test_handler_rejects_bad_buffers_without_crashing():
  build.load_library()
  a = jnp.ones((1, 8, 6), jnp.float32)
  b = jnp.ones((1, 5, 8), jnp.float32)  # k mismatch: 6 vs 5
  call = jax.ffi.ffi_call("pallas_gemm_sgemm_02_coalesced",
                          jax.ShapeDtypeStruct((1, 8, 8), jnp.float32))
  with pytest.raises(Exception, match="pallas_gemm ffi/sgemm_02_coalesced"):
    jax.block_until_ready(call(a, b, alpha=np.float32(1), beta=np.float32(0)))
  unaligned = jax.ffi.ffi_call("pallas_gemm_mma_sync_bn128",
                               jax.ShapeDtypeStruct((1, 8, 9), jnp.bfloat16))
  with pytest.raises(Exception, match="multiple of 8"):
    jax.block_until_ready(unaligned(
        jnp.ones((1, 8, 8), jnp.bfloat16), jnp.ones((1, 8, 9), jnp.bfloat16),
        alpha=np.float32(1), beta=np.float32(0)))
  # The process and the library still work afterwards.
  good = pallas_gemm.matmul(jnp.ones((4, 4)), jnp.ones((4, 4)),
                            kernel="ffi/sgemm_02_coalesced",
                            precision=jax.lax.Precision.HIGHEST)
  np.testing.assert_allclose(np.asarray(good), 4.0)


@pytest.mark.gpu
class TestFfiSuite(KernelTestBase):
  """The shared suite (layouts, epilogues, batch, dtypes) on the fastest
  rungs; the others are covered by test_odd_shapes_match_float64."""

  KERNELS = ("ffi/sgemm_08_warptile", "ffi/mma_sync")
  SHAPES = tuple(shapes.ODD[:4])
