"""Shared pytest set-up: the repo on sys.path, warning filters, GPU markers,
and parametrization of kernel test classes from their class attributes."""

from __future__ import annotations

import os
import sys
import warnings

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
