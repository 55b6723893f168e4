"""What the kernels need to know about the device they will run on."""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import shutil

import jax


@dataclasses.dataclass(frozen=True)
class DeviceInfo:
  platform: str  # "cpu" or "gpu" (CUDA); other platforms are "other"
  device_kind: str  # e.g. "NVIDIA H200", "cpu"
  compute_capability: tuple[int, int] | None = None
  num_sms: int = 1
  # Opt-in shared memory per block, in bytes: what a config may use at most.
  smem_per_block: int = 0

  @property
  def is_gpu(self) -> bool:
    return self.platform == "gpu"

  @property
  def planning_sms(self) -> int:
    """The SM count heuristics plan for: the GPU's own, or on a host (Pallas
    interpret mode) a nominal Hopper's, so that CPU tests exercise the
    decisions a GPU run makes."""
    if self.is_gpu and self.num_sms > 1:
      return self.num_sms
    return NOMINAL_INTERPRET_SMS

  @property
  def is_hopper(self) -> bool:
    return self.compute_capability is not None and self.compute_capability[0] == 9

  @property
  def key(self) -> str:
    """A filesystem- and cache-friendly name of the GPU model, e.g.
    "nvidia_h200"; memory and form-factor suffixes are dropped, so that
    "NVIDIA H100 80GB HBM3" and "NVIDIA H100" share "nvidia_h100"."""
    return device_key(self.device_kind)


#: The SM count of an H100/H200 SXM, used to plan work in interpret mode.
NOMINAL_INTERPRET_SMS = 132

def device_key(device_kind: str) -> str:
  """See `DeviceInfo.key`."""
  name = "".join(ch if ch.isalnum() else "_" for ch in device_kind.lower())
  model = re.match(r"(nvidia_[a-z]{1,2}\d{2,4})(_|$)", name)
  return model.group(1) if model else name


# Opt-in shared memory per block by compute capability (CUDA programming guide
# table "Technical Specifications per Compute Capability").
_SMEM_PER_BLOCK = {
    (8, 0): 163 * 1024, (8, 6): 99 * 1024, (8, 7): 163 * 1024,
    (8, 9): 99 * 1024, (9, 0): 227 * 1024, (10, 0): 227 * 1024,
    (12, 0): 99 * 1024,
}


def _parse_compute_capability(device) -> tuple[int, int] | None:
  value = getattr(device, "compute_capability", None)
  if not value:
    return None
  major, _, minor = str(value).partition(".")
  try:
    return int(major), int(minor or 0)
  except ValueError:
    return None


@functools.cache
def _info_for(platform: str, device_kind: str, cc, num_sms: int) -> DeviceInfo:
  smem = _SMEM_PER_BLOCK.get(cc, 48 * 1024) if cc else 0
  return DeviceInfo(platform, device_kind, cc, num_sms, smem)


def device_info(device=None) -> DeviceInfo:
  """Describes `device`, or JAX's default device."""
  if device is None:
    device = jax.devices()[0]
  platform = device.platform
  if platform in ("gpu", "cuda"):
    cc = _parse_compute_capability(device)
    num_sms = int(getattr(device, "core_count", 0) or 1)
    return _info_for("gpu", device.device_kind, cc, num_sms)
  if platform == "cpu":
    return _info_for("cpu", "cpu", None, 1)
  return _info_for("other", str(device.device_kind), None, 1)


# Dense peak rates in TFLOP/s from the vendors' datasheets (SXM parts), used only
# to print "% of peak" in benchmarks. Keys are substrings of device_kind.
PEAK_TFLOPS = {
    "H200": {"bfloat16": 989.0, "float16": 989.0, "tf32": 495.0,
             "float32": 67.0, "float8_e4m3fn": 1979.0, "float8_e5m2": 1979.0},
    "H100": {"bfloat16": 989.0, "float16": 989.0, "tf32": 495.0,
             "float32": 67.0, "float8_e4m3fn": 1979.0, "float8_e5m2": 1979.0},
    "A100": {"bfloat16": 312.0, "float16": 312.0, "tf32": 156.0,
             "float32": 19.5},
}


def peak_tflops(device_kind: str, dtype: str, precision: str = "default"):
  """The datasheet peak for this dtype, or None when we do not know it."""
  key = "tf32" if dtype == "float32" and precision == "tf32" else dtype
  for name, table in PEAK_TFLOPS.items():
    if name in device_kind:
      return table.get(key)
  return None


#: Device-to-device copy bandwidth in TB/s, measured with CUPTI on the GPU
#: machines (`copy_bandwidth_tbs` in experiments/results/<gpu>/moe*/
#: results.json): what a pass over memory costs in the cost models that
#: choose between implementations. Keys as above.
COPY_TB_PER_S = {"H200": 4.3, "H100": 3.0}


def copy_tb_per_s(device_kind: str) -> float:
  """The measured copy bandwidth, or the lowest known for a device not in
  the table (a cost model then errs towards the cheaper memory pass)."""
  for name, value in COPY_TB_PER_S.items():
    if name in device_kind:
      return value
  return min(COPY_TB_PER_S.values())


def _cuda_plugin_installed() -> bool:
  import importlib.util
  for name in ("jax_cuda13_plugin", "jax_cuda12_plugin",
               "jax_plugins.xla_cuda13", "jax_plugins.xla_cuda12"):
    try:
      if importlib.util.find_spec(name) is not None:
        return True
    except ModuleNotFoundError:
      continue
  return False


def unused_nvidia_gpu() -> str | None:
  """Why the benchmark must not run here, or None: an NVIDIA GPU is present
  but the installed jax has no CUDA backend, so every kernel would silently
  run in interpret mode on the host."""
  if jax.default_backend() == "gpu" or _cuda_plugin_installed():
    return None  # a CUDA jax, even if JAX_PLATFORMS keeps it off on purpose
  if not (os.path.exists("/proc/driver/nvidia/version")
          or shutil.which("nvidia-smi")):
    return None
  return ("this machine has an NVIDIA GPU, but the jax installed here has no "
          "CUDA backend, so every kernel would run in interpret mode on the "
          "CPU. Fix: `make clean && make bench` (the set-up installs the jax "
          "CUDA extra that matches the driver; PALLAS_GEMM_DEVICE=cuda13 or "
          "cuda12 forces one), or `pip install -c constraints.txt "
          "'jax[cuda13]'` into this environment. To benchmark interpret mode "
          "on purpose, set PALLAS_GEMM_ALLOW_CPU=1.")
