"""Shared pytest set-up: the repo on sys.path, warning filters, GPU markers,
the random inputs' seed (`PALLAS_GEMM_TEST_SEED`), and parametrization of
kernel test classes from their class attributes."""

from __future__ import annotations

import os
import sys
import warnings
import zlib

# pytest -n 2 runs two processes on one GPU: each takes memory as it needs
# it instead of JAX's default 75 % of the device up front.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

# The Pallas-Triton lowering is deprecated since JAX 0.11; we keep using it.
warnings.filterwarnings("ignore", category=DeprecationWarning,
                        message=".*[Tt]riton.*")

import jax  # noqa: E402
import pytest  # noqa: E402

ON_GPU = jax.default_backend() == "gpu"

#: The environment variable that fixes the tests' random inputs: each test
#: draws its keys (`numerics.fresh_key`) from this seed and its own node id,
#: so that a test reruns on the same inputs however the tests are spread
#: over workers. Unset, every run draws a new seed; the header and each
#: failure report it.
TEST_SEED_ENV = "PALLAS_GEMM_TEST_SEED"
_SEED_KEY = pytest.StashKey[int]()
_WORKER_SEED = "pallas_gemm_test_seed"


def _run_seed(config) -> int:
  workerinput = getattr(config, "workerinput", None)
  if workerinput is not None and _WORKER_SEED in workerinput:
    return workerinput[_WORKER_SEED]  # an xdist worker: the run's seed
  text = os.environ.get(TEST_SEED_ENV, "").strip()
  if not text:
    import numpy as np
    return int(np.random.SeedSequence().generate_state(1)[0])
  try:
    return int(text)
  except ValueError:
    raise pytest.UsageError(f"{TEST_SEED_ENV}={text!r} must be a whole "
                            f"number") from None


def pytest_configure(config):
  config.stash[_SEED_KEY] = _run_seed(config)
  # Tests that rerun a case in a child pytest (the interpreter's cluster
  # cases) hand it the same seed.
  os.environ[TEST_SEED_ENV] = str(config.stash[_SEED_KEY])


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
  """pytest-xdist: every worker draws from the controller's seed."""
  node.workerinput[_WORKER_SEED] = node.config.stash[_SEED_KEY]


def pytest_report_header(config):
  seed = config.stash[_SEED_KEY]
  return f"random inputs: {TEST_SEED_ENV}={seed} reruns them"


def _test_seed(item) -> int:
  return item.config.stash[_SEED_KEY] ^ zlib.crc32(item.nodeid.encode())


@pytest.fixture(autouse=True)
def _seeded_inputs(request):
  """Each test's `numerics.fresh_key()` keys come from the run's seed and
  the test's node id."""
  from pallas_gemm import numerics
  numerics.seed_fresh_keys(_test_seed(request.node))
  yield
  numerics.seed_fresh_keys(None)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
  outcome = yield
  report = outcome.get_result()
  if report.failed:
    seed = item.config.stash[_SEED_KEY]
    report.sections.append((
        "random inputs",
        f"rerun on the same inputs with {TEST_SEED_ENV}={seed} pytest "
        f"'{item.nodeid}'"))


def pytest_collection_modifyitems(config, items):
  skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
  for item in items:
    if "gpu" in item.keywords and not ON_GPU:
      item.add_marker(skip_gpu)
    if "hopper" in item.keywords:
      from pallas_gemm.devices import device_info
      if not (ON_GPU and device_info().is_hopper):
        item.add_marker(pytest.mark.skip(reason="needs an sm_90 (Hopper) GPU"))


# Kernel test classes (see kernel_test_base.py) list what to cover in class
# attributes; each test argument below is parametrized from the attribute of
# the same name in upper case.
_CLASS_PARAMS = {
    "kernel": "KERNELS",
    "shape": "SHAPES",
    "dtype": "DTYPES",
    "layout": "LAYOUTS",
    "activation": "ACTIVATIONS",
}


def pytest_generate_tests(metafunc):
  cls = metafunc.cls
  if cls is None:
    return
  for arg, attr in _CLASS_PARAMS.items():
    if arg in metafunc.fixturenames and hasattr(cls, attr):
      values = list(getattr(cls, attr))
      ids = [_id(v) for v in values]
      metafunc.parametrize(arg, values, ids=ids)


def _id(value):
  if isinstance(value, tuple):
    return "x".join(str(v) for v in value)
  return str(value).replace("/", "-")


@pytest.fixture
def isolated_cache(tmp_path, monkeypatch):
  """An empty user tuning cache and an empty shipped folder, with the
  resolver's memo cleared before and after: tests see no real tuning or
  dispatch entries. Yields the temporary folder."""
  from pallas_gemm import autotune, dispatch
  monkeypatch.setenv(autotune.CACHE_DIR_ENV, str(tmp_path / "cache"))
  monkeypatch.delenv(autotune.AUTOTUNE_ENV, raising=False)
  monkeypatch.setattr(autotune, "SHIPPED_DIR", tmp_path / "shipped")
  dispatch.clear_cache()
  yield tmp_path
  dispatch.clear_cache()
