"""Choosing a kernel config: cached measurements first, a heuristic otherwise.

How a config is found for a call that passes none (`config=None`), in order:

1. the user's tuning cache, a JSON file per device in the `tuning/`
   folder of `$PALLAS_GEMM_CACHE_DIR`, else `$XDG_CACHE_HOME/pallas_gemm`,
   else `~/.cache/pallas_gemm` (the FFI build cache has its own folder);
2. the defaults shipped with the package, `pallas_gemm/tuned/<device>.json`
   (nearest shape bucket if the exact one is missing), which also hold the
   measured dispatch table that `pallas_gemm.dispatch` reads;
3. the kernel's own heuristic.

`pallas_gemm.dispatch.resolve` walks these steps; this module owns the files.
Reading them never breaks a matmul: a missing, unreadable or corrupt file
counts as empty, an entry that does not fit its kernel's config class is
dropped with one warning per file (and the user's file is rewritten without
it), and anything but a regular file (a FIFO, a folder) is not opened.
Writers take a cross-process lock, so concurrent tuners keep every entry.

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

import contextlib
import dataclasses
import json
import math
import os
import pathlib
import stat
import tempfile
import threading
import warnings
from typing import Any, Callable, Iterable, Sequence

from pallas_gemm import registry
from pallas_gemm.devices import DeviceInfo, device_info
from pallas_gemm.problem import GemmProblem
# The timing harness lives in pallas_gemm.timing; these names stay
# importable from here for older callers.
from pallas_gemm.timing import (L2_BYTES, MAX_OPERAND_SETS,  # noqa: F401
                                median_time_ms, operand_set_count,
                                random_operands, time_over_sets)

CACHE_DIR_ENV = "PALLAS_GEMM_CACHE_DIR"
AUTOTUNE_ENV = "PALLAS_GEMM_AUTOTUNE"
#: Version 2 added the "dispatch" section; version 1 files still read.
CACHE_FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
SHIPPED_DIR = pathlib.Path(__file__).parent / "tuned"
# A shipped entry stands in for a missing bucket only this close (sum over
# batch, M, N, K of |log2 ratio|): 8192³ may serve 4096x8192x8192, not 1x8192².
NEAREST_BUCKET_DISTANCE = 2

SearchSpace = Callable[[GemmProblem, DeviceInfo], Sequence[Any]]
_SEARCH_SPACES: dict[str, SearchSpace] = {}
_lock = threading.RLock()


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


class CacheError(RuntimeError):
  """The tuning cache location cannot be used (named in the message)."""


def cache_dir() -> pathlib.Path:
  """The root of pallas_gemm's caches (tuning JSON and FFI builds live in
  their own subfolders)."""
  override = os.environ.get(CACHE_DIR_ENV)
  if override:
    return pathlib.Path(override).expanduser()
  xdg = os.environ.get("XDG_CACHE_HOME")
  base = pathlib.Path(xdg).expanduser() if xdg else (
      pathlib.Path.home() / ".cache")
  return base / "pallas_gemm"


def tuning_dir() -> pathlib.Path:
  return cache_dir() / "tuning"


def cache_path(device_key: str) -> pathlib.Path:
  return tuning_dir() / f"{device_key}.json"


def shipped_path(device_key: str) -> pathlib.Path:
  return SHIPPED_DIR / f"{device_key}.json"


#: Parsed files by (path, mtime_ns, size): a file is read once per version.
_FILE_MEMO: dict[str, tuple[tuple, dict]] = {}
#: Counters a test reads: JSON files actually opened and parsed.
STATS = {"json_reads": 0}


def _is_regular_file(path: pathlib.Path):
  """The stat of `path` if it is a regular file, else None (missing, a
  folder, a FIFO: opening a FIFO would block every matmul)."""
  try:
    st = os.stat(path)
  except OSError:
    return None
  return st if stat.S_ISREG(st.st_mode) else None


def _read_file(path: pathlib.Path, rewrite_invalid: bool = True) -> dict:
  """The parsed payload of a cache file, {} when it is missing or not a
  readable cache file; memoized per file version."""
  st = _is_regular_file(path)
  if st is None:
    return {}
  stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
  memo = _FILE_MEMO.get(str(path))
  if memo is not None and memo[0] == stamp:
    return memo[1]
  with _lock:
    STATS["json_reads"] += 1
  try:
    with open(path, encoding="utf-8") as f:
      data = json.load(f)
  except (OSError, ValueError):
    data = {}
  if not isinstance(data, dict) or data.get("version") not in (
      READABLE_VERSIONS):
    data = {}
  data = _validated(path, data, rewrite_invalid)
  _FILE_MEMO[str(path)] = (stamp, data)
  return data


def _entry_problem(name: str, record) -> str | None:
  """Why a tuning entry is invalid, or None. Entries of kernels that are
  not registered (a backend that did not import) are kept, unchecked."""
  from pallas_gemm import registry
  try:
    key = CacheKey.parse("any", name)
  except ValueError:
    return f"key {name!r} is malformed"
  if not isinstance(record, dict) or not isinstance(record.get("config"),
                                                    dict):
    return f"{name}: the entry is not a {{'config': {{...}}}} record"
  entry = registry._REGISTRY.get(key.kernel)
  if entry is None or entry.config_cls is None:
    return None
  if config_from_json(entry.config_cls, record["config"]) is None:
    return (f"{name}: {record['config']} is not a valid "
            f"{entry.config_cls.__name__}")
  return None


def _validated(path: pathlib.Path, data: dict, rewrite: bool) -> dict:
  """`data` without invalid tuning entries; warns once per file version and
  rewrites the user's file (never the shipped one) without them."""
  entries = data.get("entries")
  if not isinstance(entries, dict):
    entries = {}
  problems = {name: _entry_problem(name, record)
              for name, record in entries.items()}
  bad = {name: why for name, why in problems.items() if why is not None}
  dispatch = data.get("dispatch")
  data = dict(data, entries={n: r for n, r in entries.items() if n not in bad},
              dispatch=dispatch if isinstance(dispatch, dict) else {})
  if bad:
    first = next(iter(bad.values()))
    warnings.warn(
        f"pallas_gemm: dropped {len(bad)} invalid tuning entr"
        f"{'y' if len(bad) == 1 else 'ies'} from {path} (first: {first})",
        RuntimeWarning, stacklevel=4)
    if rewrite and path.parent != SHIPPED_DIR:
      try:
        with _file_lock(path):
          write_payload(path, data)
      except (OSError, CacheError):
        pass  # read-only: the entries are still ignored
  return data


def read_entries(path: pathlib.Path) -> dict[str, dict]:
  """The valid tuning entries of one cache file; {} if it is missing or
  unreadable (a corrupt cache must never break a matmul)."""
  return read_section(path, "entries")


def read_section(path: pathlib.Path, section: str) -> dict[str, dict]:
  """One section ("entries" or "dispatch") of a cache file, or {}."""
  return dict(_read_file(path).get(section, {}))


@contextlib.contextmanager
def _file_lock(path: pathlib.Path):
  """A cross-process lock beside `path` (filelock), so that read-merge-write
  cycles of concurrent processes do not lose each other's entries."""
  import filelock
  _ensure_dir(path.parent)
  lock = filelock.FileLock(str(path) + ".lock", timeout=60)
  try:
    with lock:
      yield
  except filelock.Timeout:
    raise CacheError(f"timed out waiting for the lock on {path}") from None


def _ensure_dir(folder: pathlib.Path) -> None:
  for parent in (folder, *folder.parents):
    if parent.exists() and not parent.is_dir():
      raise CacheError(
          f"{parent} is a file, so the cache folder {folder} cannot be "
          f"made; point {CACHE_DIR_ENV} at a folder")
  try:
    folder.mkdir(parents=True, exist_ok=True)
  except FileExistsError:
    raise CacheError(
        f"the cache folder {folder} is a file; point {CACHE_DIR_ENV} at a "
        "folder") from None
  except OSError as err:
    raise CacheError(f"cannot create the cache folder {folder}: {err}") from None
  if not folder.is_dir():
    raise CacheError(
        f"the cache folder {folder} is not a folder; point {CACHE_DIR_ENV} "
        "at a folder")


def write_entries(path: pathlib.Path, entries: dict[str, dict]) -> None:
  """Replaces the tuning entries of `path`, keeping its other sections."""
  data = dict(_read_file(path))
  data["entries"] = entries
  write_payload(path, data)


def write_payload(path: pathlib.Path, data: dict) -> None:
  """Writes the file atomically: readers see the old or the new file, never
  half of one, even if this process dies mid-write."""
  _ensure_dir(path.parent)
  payload = {"version": CACHE_FORMAT_VERSION,
             **{k: v for k, v in data.items() if k != "version"}}
  if _is_regular_file(path) is None and path.exists():
    raise CacheError(f"{path} exists and is not a regular file")
  try:
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp",
                                    dir=path.parent)
  except OSError as err:
    raise CacheError(f"cannot write to the cache folder {path.parent}: "
                     f"{err}") from None
  try:
    with os.fdopen(fd, "w", encoding="utf-8") as f:
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
  if not isinstance(fields, dict):
    return None
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
  update_section(path, "entries", {key.entry_name: record})
  return key


def update_section(path: pathlib.Path, section: str,
                   records: dict[str, dict], meta: dict | None = None,
                   replace: bool = False) -> None:
  """Merges `records` into one section of `path` (or, with `replace`,
  replaces the section) under the cross-process lock: last writer wins per
  record, and every writer's records survive."""
  with _lock, _file_lock(path):
    _FILE_MEMO.pop(str(path), None)
    data = dict(_read_file(path, rewrite_invalid=False))
    merged = {} if replace else dict(data.get(section, {}))
    merged.update(records)
    data[section] = merged
    if meta is not None:
      data["meta"] = meta
    write_payload(path, data)
    _FILE_MEMO.pop(str(path), None)
  from pallas_gemm import dispatch
  dispatch.clear_cache()


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


def lookup_user(problem: GemmProblem, kernel: str, device: DeviceInfo,
                config_cls: type):
  """The user's tuned config for this exact bucket, or None."""
  key = CacheKey.for_problem(problem, kernel, device)
  return _config_in(read_entries(cache_path(device.key)), key, config_cls,
                    nearest=False)


def lookup_shipped(problem: GemmProblem, kernel: str, device: DeviceInfo,
                   config_cls: type):
  """The shipped config for this bucket or the nearest one, or None."""
  key = CacheKey.for_problem(problem, kernel, device)
  return _config_in(read_entries(shipped_path(device.key)), key, config_cls,
                    nearest=True)


def lookup(problem: GemmProblem, kernel: str, device: DeviceInfo,
           config_cls: type):
  """A measured config for this problem's bucket, or None."""
  config = lookup_user(problem, kernel, device, config_cls)
  if config is None:
    config = lookup_shipped(problem, kernel, device, config_cls)
  return config


def register_search_space(kernel: str, space: SearchSpace) -> None:
  _SEARCH_SPACES[kernel] = space


def register_tunable(entry: registry.KernelEntry,
                     space: SearchSpace) -> registry.KernelEntry:
  """Registers a kernel together with the configs `tune()` sweeps for it."""
  register_search_space(entry.name, space)
  return registry.register(entry)


def has_search_space(kernel: str) -> bool:
  return kernel in _SEARCH_SPACES


def search_space(problem: GemmProblem, kernel: str,
                 device: DeviceInfo) -> list:
  if kernel not in _SEARCH_SPACES:
    raise ValueError(f"kernel={kernel!r} has no registered search space; "
                     f"pass candidates= to tune()")
  return list(_SEARCH_SPACES[kernel](problem, device))


def fits_device(config, problem: GemmProblem, device: DeviceInfo) -> bool:
  """False if the config's shared memory for `problem` exceeds the device's
  per-block limit: such configs fail to compile, and compiling them costs
  seconds. The problem itself counts, not only its dtype: `small_m` stages
  one or two 64-row groups of A by M, and a C epilogue stages C too."""
  smem_bytes = getattr(config, "smem_bytes", None)
  if smem_bytes is None or not device.smem_per_block:
    return True
  return smem_bytes(problem) <= device.smem_per_block


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
  operand_sets = tuple(random_operands(problem, seed=i) for i in range(
      operand_set_count(problem, device.is_gpu)))
  timings, skipped = [], []
  for config in candidates:
    if entry.config_cls is not None and not isinstance(config,
                                                       entry.config_cls):
      raise TypeError(f"candidate {config!r} is not a "
                      f"{entry.config_cls.__name__}")
    if not fits_device(config, problem, device):
      skipped.append(config)
      continue
    def call(a, b, c, bias, config=config):
      return entry.fn(a, b, c, bias, problem=problem, config=config,
                      interpret=interpret)
    try:
      ms = time_over_sets(call, operand_sets, iterations=iterations,
                          on_gpu=device.is_gpu)
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
    try:
      store(problem, kernel, best, device=device, time_ms=best_ms)
    except (OSError, CacheError) as err:
      # The measurement is still the caller's: warn instead of losing it.
      warnings.warn(f"pallas_gemm: tuning result not saved: {err}",
                    RuntimeWarning, stacklevel=2)
  return TuneResult(best, best_ms, tuple(timings), tuple(skipped))
