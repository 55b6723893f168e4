"""Choosing a kernel config: cached measurements first, a heuristic otherwise.

How a config is found for a call that passes none (`config=None`), in order:

1. the user's tuning cache, a JSON file per device in
   `$PALLAS_GEMM_CACHE_DIR`, else `$XDG_CACHE_HOME/pallas_gemm`, else
   `~/.cache/pallas_gemm`;
2. the defaults shipped with the package, `pallas_gemm/tuned/<device>.json`,
   measured by `experiments/triton_sweep.py` on that device (nearest shape
   bucket if the exact one is missing);
3. the kernel's own heuristic.

A first call never waits on a sweep. Tuning is opt-in, two ways:

  * explicitly: `pallas_gemm.autotune.tune(problem, "triton/06_tuned")`
    times the kernel's search space (or the candidates you pass) on the
    current GPU with CUPTI, stores the winner in the cache and returns it;
    later calls in any process pick it up in step 1;
  * implicitly: with `PALLAS_GEMM_AUTOTUNE=1` in the environment, a cache
    miss on a GPU tunes that problem once, at trace time, before step 3.

Entries are keyed by device, kernel, input dtype, layout, precision and a
shape bucket (each of batch, M, N, K rounded up to a power of two), so one
measurement serves the shapes near it. Any backend can use this module: it
needs only a frozen-dataclass config class and, to tune without explicit
candidates, a search space registered with `register_search_space`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import statistics
import tempfile
import threading
import time
from typing import Any, Callable, Iterable, Sequence

import jax
import jax.numpy as jnp

from pallas_gemm import numerics, registry
from pallas_gemm.devices import DeviceInfo, device_info
from pallas_gemm.problem import GemmProblem

CACHE_DIR_ENV = "PALLAS_GEMM_CACHE_DIR"
AUTOTUNE_ENV = "PALLAS_GEMM_AUTOTUNE"
CACHE_FORMAT_VERSION = 1
SHIPPED_DIR = pathlib.Path(__file__).parent / "tuned"
# A shipped entry stands in for a missing bucket only this close (sum over
# batch, M, N, K of |log2 ratio|): 8192³ may serve 4096x8192x8192, not 1x8192².
NEAREST_BUCKET_DISTANCE = 2

SearchSpace = Callable[[GemmProblem, DeviceInfo], Sequence[Any]]
_SEARCH_SPACES: dict[str, SearchSpace] = {}
_lock = threading.Lock()


def shape_bucket(size: int) -> int:
  """`size` rounded up to a power of two (1 stays 1)."""
  if size < 1:
    raise ValueError(f"size={size} must be >= 1")
  return 1 << (size - 1).bit_length()


@dataclasses.dataclass(frozen=True)
class CacheKey:
  device: str
  kernel: str
  in_dtype: str
  layout: str
  precision: str
  batch: int
  m: int
  n: int
  k: int

  @classmethod
  def for_problem(cls, problem: GemmProblem, kernel: str,
                  device: DeviceInfo) -> CacheKey:
    return cls(device=device.key, kernel=kernel, in_dtype=problem.in_dtype,
               layout=problem.layout, precision=problem.precision,
               batch=shape_bucket(problem.batch), m=shape_bucket(problem.m),
               n=shape_bucket(problem.n), k=shape_bucket(problem.k))

  @property
  def entry_name(self) -> str:
    """The key inside a device's file (the device names the file)."""
    return (f"{self.kernel}|{self.in_dtype}|{self.layout}|{self.precision}|"
            f"{self.batch}x{self.m}x{self.n}x{self.k}")

  @classmethod
  def parse(cls, device: str, entry_name: str) -> CacheKey:
    kernel, in_dtype, layout, precision, dims = entry_name.split("|")
    batch, m, n, k = (int(d) for d in dims.split("x"))
    return cls(device, kernel, in_dtype, layout, precision, batch, m, n, k)

  def bucket_distance(self, other: CacheKey) -> float:
    return sum(abs(math.log2(x) - math.log2(y)) for x, y in (
        (self.batch, other.batch), (self.m, other.m), (self.n, other.n),
        (self.k, other.k)))


def cache_dir() -> pathlib.Path:
  override = os.environ.get(CACHE_DIR_ENV)
  if override:
    return pathlib.Path(override).expanduser()
  xdg = os.environ.get("XDG_CACHE_HOME")
  base = pathlib.Path(xdg).expanduser() if xdg else (
      pathlib.Path.home() / ".cache")
  return base / "pallas_gemm"


def cache_path(device_key: str) -> pathlib.Path:
  return cache_dir() / f"{device_key}.json"


def shipped_path(device_key: str) -> pathlib.Path:
  return SHIPPED_DIR / f"{device_key}.json"


def read_entries(path: pathlib.Path) -> dict[str, dict]:
  """The entries of one cache file; {} if it is missing or unreadable (a
  corrupt cache must never break a matmul)."""
  try:
    with open(path) as f:
      data = json.load(f)
  except (OSError, ValueError):
    return {}
  if not isinstance(data, dict) or data.get("version") != CACHE_FORMAT_VERSION:
    return {}
  entries = data.get("entries")
  return entries if isinstance(entries, dict) else {}


def write_entries(path: pathlib.Path, entries: dict[str, dict]) -> None:
  """Writes the file atomically: readers see the old or the new file, never
  half of one, even if this process dies mid-write."""
  path.parent.mkdir(parents=True, exist_ok=True)
  payload = {"version": CACHE_FORMAT_VERSION, "entries": entries}
  fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp",
                                  dir=path.parent)
  try:
    with os.fdopen(fd, "w") as f:
      json.dump(payload, f, indent=1, sort_keys=True)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp_name, path)
  except BaseException:
    try:
      os.unlink(tmp_name)
    except OSError:
      pass
    raise


def config_to_json(config) -> dict:
  if not dataclasses.is_dataclass(config) or isinstance(config, type):
    raise TypeError(f"config must be a dataclass instance, got {config!r}")
  return dataclasses.asdict(config)


def config_from_json(config_cls: type, fields: dict):
  """The config, or None when the entry no longer fits the class (a field
  was renamed or a value is out of range): stale entries are skipped."""
  try:
    return config_cls(**fields)
  except (TypeError, ValueError):
    return None


def store(problem: GemmProblem, kernel: str, config, *, device: DeviceInfo,
          time_ms: float | None = None, path: pathlib.Path | None = None):
  """Records `config` as the best for this problem's bucket."""
  key = CacheKey.for_problem(problem, kernel, device)
  path = path or cache_path(device.key)
  record = {"config": config_to_json(config),
            "config_cls": type(config).__name__,
            "problem": problem.describe()}
  if time_ms is not None:
    record["time_ms"] = time_ms
    record["tflops"] = problem.flops / (time_ms * 1e-3) / 1e12
  with _lock:
    # Merge with what is on disk now, so two processes tuning different
    # shapes keep each other's entries (last writer wins per entry).
    entries = read_entries(path)
    entries[key.entry_name] = record
    write_entries(path, entries)
  return key


def _config_in(entries, key: CacheKey, config_cls, *, nearest: bool):
  record = entries.get(key.entry_name)
  if record is not None:
    return config_from_json(config_cls, record.get("config", {}))
  if not nearest:
    return None
  best, best_distance = None, NEAREST_BUCKET_DISTANCE + 1e-9
  for name, record in entries.items():
    try:
      other = CacheKey.parse(key.device, name)
    except ValueError:
      continue
    if (other.kernel, other.in_dtype, other.layout, other.precision) != (
        key.kernel, key.in_dtype, key.layout, key.precision):
      continue
    distance = key.bucket_distance(other)
    if distance < best_distance:
      config = config_from_json(config_cls, record.get("config", {}))
      if config is not None:
        best, best_distance = config, distance
  return best


def lookup(problem: GemmProblem, kernel: str, device: DeviceInfo,
           config_cls: type):
  """A measured config for this problem's bucket, or None (steps 1-2)."""
  key = CacheKey.for_problem(problem, kernel, device)
  config = _config_in(read_entries(cache_path(device.key)), key, config_cls,
                      nearest=False)
  if config is None:
    config = _config_in(read_entries(shipped_path(device.key)), key,
                        config_cls, nearest=True)
  return config


def register_search_space(kernel: str, space: SearchSpace) -> None:
  _SEARCH_SPACES[kernel] = space


def search_space(problem: GemmProblem, kernel: str,
                 device: DeviceInfo) -> list:
  if kernel not in _SEARCH_SPACES:
    raise ValueError(f"kernel={kernel!r} has no registered search space; "
                     f"pass candidates= to tune()")
  return list(_SEARCH_SPACES[kernel](problem, device))


def fits_device(config, problem: GemmProblem, device: DeviceInfo) -> bool:
  """False if the config's shared memory exceeds the device's per-block
  limit: such configs fail to compile, and compiling them costs seconds."""
  smem_bytes = getattr(config, "smem_bytes", None)
  if smem_bytes is None or not device.smem_per_block:
    return True
  return smem_bytes(problem.in_dtype) <= device.smem_per_block


def autotune_enabled() -> bool:
  return os.environ.get(AUTOTUNE_ENV, "").lower() in ("1", "true", "yes")


@dataclasses.dataclass(frozen=True)
class TuneResult:
  best: Any
  best_time_ms: float
  # (config, median ms or None when it failed to compile or run), in the
  # order tried; configs skipped for shared memory are not listed.
  timings: tuple
  skipped_for_smem: tuple


#: Timing must not find a problem's operands in L2 from the previous call
#: (50 MiB on the H100/H200; a margin on top), as a model's GEMMs seldom do.
L2_BYTES = 60 * 2**20
#: At most this many operand sets are rotated through.
MAX_OPERAND_SETS = 16


def operand_set_count(problem: GemmProblem, on_gpu: bool) -> int:
  """How many operand sets to rotate through so that together they are
  twice L2's size (one on a host, where L2 does not matter)."""
  if not on_gpu:
    return 1
  in_size = jnp.dtype(problem.in_dtype).itemsize
  set_bytes = (problem.m + problem.n) * problem.k * in_size * problem.batch
  return max(1, min(MAX_OPERAND_SETS, -(-2 * L2_BYTES // max(set_bytes, 1))))


def random_operands(problem: GemmProblem, seed: int = 0):
  """Normal-distributed canonical operands for timing `problem`."""
  key = numerics.fresh_key(seed)
  keys = jax.random.split(key, 4)
  a_shape = ((problem.batch, problem.k, problem.m) if problem.transpose_a
             else (problem.batch, problem.m, problem.k))
  b_shape = ((problem.batch, problem.n, problem.k) if problem.transpose_b
             else (problem.batch, problem.k, problem.n))
  a = numerics.random_normal(keys[0], a_shape, problem.in_dtype)
  b = numerics.random_normal(keys[1], b_shape, problem.in_dtype)
  c = bias = None
  if problem.epilogue.has_c:
    c = numerics.random_normal(keys[2], (problem.batch, problem.m, problem.n),
                               problem.c_dtype or problem.out_dtype)
  if problem.epilogue.has_bias:
    bias = numerics.random_normal(keys[3], (problem.n,), problem.out_dtype)
  return a, b, c, bias


def median_time_ms(fn, args, *, iterations: int, on_gpu: bool) -> float:
  """Median per-call time of `fn(*args)`: CUPTI kernel time on a GPU (sum of
  the kernels one call launches), wall clock elsewhere (tests only)."""
  if on_gpu:
    from jax.experimental.mosaic.gpu import profiler
    _, times = profiler.measure(fn, iterations=iterations)(*args)
    if times is None:
      raise RuntimeError("CUPTI recorded no kernels")
    return float(statistics.median(times))
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(iterations):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append((time.perf_counter() - start) * 1e3)
  return float(statistics.median(times))


def tune(problem: GemmProblem, kernel: str,
         candidates: Iterable[Any] | None = None, *,
         device: DeviceInfo | None = None, iterations: int = 20,
         save: bool = True, verbose: bool = False) -> TuneResult:
  """Times each candidate config of `kernel` on `problem`; stores the best.

  Candidates whose shared memory exceeds the device limit are skipped
  before compiling; ones that fail to compile or run are recorded with a
  time of None. Raises RuntimeError if no candidate ran.
  """
  device = device or device_info()
  entry = registry.get_kernel(kernel)
  if candidates is None:
    candidates = search_space(problem, kernel, device)
  candidates = list(candidates)
  if not candidates:
    raise ValueError("candidates must not be empty")
  if iterations < 1:
    raise ValueError(f"iterations={iterations} must be >= 1")
  interpret = not device.is_gpu
  # Small problems fit in L2: one call per operand set, all sets in one
  # jitted function, so the time is that of cold operands as in the
  # benchmark (a hot-L2 timing once picked a config 6 % slower cold).
  count = operand_set_count(problem, device.is_gpu)
  operand_sets = tuple(random_operands(problem, seed=i) for i in range(count))
  timings, skipped = [], []
  for config in candidates:
    if entry.config_cls is not None and not isinstance(config,
                                                       entry.config_cls):
      raise TypeError(f"candidate {config!r} is not a "
                      f"{entry.config_cls.__name__}")
    if not fits_device(config, problem, device):
      skipped.append(config)
      continue
    fn = jax.jit(lambda sets, config=config: tuple(entry.fn(
        *operands, problem=problem, config=config, interpret=interpret)
        for operands in sets))
    try:
      ms = median_time_ms(fn, (operand_sets,), iterations=iterations,
                          on_gpu=device.is_gpu) / count
    except Exception as err:  # A config that does not compile is no winner.
      if verbose:
        print(f"  {config}: failed: {type(err).__name__}: {err}"[:300])
      ms = None
    if verbose and ms is not None:
      print(f"  {config}: {ms:.4f} ms "
            f"{problem.flops / ms / 1e9:.1f} TFLOP/s")
    timings.append((config, ms))
  ran = [(config, ms) for config, ms in timings if ms is not None]
  if not ran:
    raise RuntimeError(f"no candidate of {kernel} ran {problem.describe()}")
  best, best_ms = min(ran, key=lambda item: item[1])
  if save:
    store(problem, kernel, best, device=device, time_ms=best_ms)
  return TuneResult(best, best_ms, tuple(timings), tuple(skipped))


def config_for(problem: GemmProblem, kernel: str, device: DeviceInfo,
               config_cls: type, heuristic: Callable[[], Any]):
  """Cache, shipped defaults, opt-in tuning, then `heuristic()`."""
  config = lookup(problem, kernel, device, config_cls)
  if config is not None and fits_device(config, problem, device):
    return config
  if autotune_enabled() and device.is_gpu and kernel in _SEARCH_SPACES:
    try:
      return tune(problem, kernel, device=device).best
    except RuntimeError:
      pass
  return heuristic()
