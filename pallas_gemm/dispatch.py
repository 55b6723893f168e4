"""The one place where a call's kernel and config are decided.

`resolve(problem, device, kernel, config)` returns a `Resolution`: the
kernel that will run, the config it receives, where that choice came from
and why. Every entry point (`matmul`, derived products under autodiff and
vmap, the sharded lowering, `explain`) goes through it, and it is memoized
per (problem, device, request), so a call resolves once however often JAX
retraces it.

The kernel, when the caller names none (`kernel=None`):

1. On a GPU with a measured dispatch table (`pallas_gemm/tuned/<gpu>.json`,
   section "dispatch", or the same section of the user's tuning cache), the
   problem's bucket decides. A bucket is the problem's dtypes, layout,
   precision, epilogue kind, 16-byte alignment and (fp8 only) B's dtype
   and the scale modes, plus its batch, M, N and K on a half-octave grid.
   (Alignment names the first operand whose rows are not 16-byte units,
   `alignment`.)
   Each bucket records the fastest kernel measured for it, `xla` included,
   and that kernel's speed relative to `xla`.
   - the problem's own bucket, or else the nearest one within
     `NEAREST_BUCKET_DISTANCE` octaves: its winner runs if the problem was
     measured itself, or if the winner beat `xla` there by
     `required_margin(distance, kernel)` (3-10 % within half an octave,
     more further off), lost to `xla` (by more than a tie,
     `VETO_BELOW`) in no bucket within `VETO_DISTANCE` (for an M of the
     streaming row, at an M within `VETO_STREAMING_M_OCTAVES`), for a
     tiled kernel of `NEEDS_A_WAVE` on an aligned shape, has at least a wave of
     CTA tiles, for a kernel of `PADS_OUTPUT_ROWS`, pays no output
     padding copy that the bucket's measured problems did not and, for a
     kernel of `NARROW_SWIZZLE_KERNELS`, takes the slow narrow-swizzle
     path with tall tiles only where the bucket measured it with the same
     tile; else `xla` runs;
   - fp8 of more than `STREAMING_ROWS` rows with no bucket of its class
     in reach: the nearest measured problems of its layout and scales,
     any alignment (`_fp8_neighbour_vote`), where at least
     `FP8_MIN_NEIGHBOURS` lie in reach;
   - no bucket near enough: a kernel that lost to xla on no problem
     measured in the problem's class and beat it by a wide margin nearly
     everywhere there (`class_winner`: e.g. rows that are not 16-byte
     aligned, fp8 with B stored (k, n); not for `NO_CLASS_RULE`), else
     `xla`, the kernel no measurement contradicts;
   - fp8 that none of these decides, of a class the table never measured
     or of rows that are not 16-byte units: a sibling GPU's buckets for
     it (`SIBLING_TABLES`), else, for rows that are not 16-byte units,
     xla at most `STREAMING_ROWS` rows, and xla where the aligned twin's
     decision is xla (`_aligned_twin`), else the order below
     (`_fp8_without_a_bucket_in_reach`).
2. Elsewhere (a CPU, or a GPU without a table) the first kernel of
   `registry.auto_order` whose `supports()` accepts the problem.

The config, for the kernel chosen: the caller's; else the user's tuning
cache for this exact bucket; else the config the dispatch table measured
on this very shape;
else the shipped tuning entries (nearest bucket); else, with
`PALLAS_GEMM_AUTOTUNE=1` on a GPU, a tuning run; else the kernel's
heuristic. A stored config that no longer fits the problem (the kernel's
`check_config` says why) is passed over.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import threading
from typing import Any

from pallas_gemm import autotune, registry
from pallas_gemm.devices import DeviceInfo
from pallas_gemm.problem import FP8_DTYPES, GemmProblem, itemsize

#: How far (in octaves, summed over batch, M, N and K) a dispatch bucket may
#: lie from the problem's and still decide for it.
NEAREST_BUCKET_DISTANCE = 1.0
#: A kernel measured in a neighbouring bucket half an octave away must have
#: beaten xla there by this factor to be trusted with an unmeasured shape;
#: the margin grows by `MARGIN_PER_OCTAVE` for every octave further away.
#: Chosen per kernel by leave-one-out over both GPUs' measurements (the
#: fewest held-out losses at the same geomean; experiments/lab/
#: dispatch_holdout.py, notes in experiments/results/nvidia_h200/dispatch/
#: README.md): a streaming kernel's lead changes slowly with N and K, a
#: tiled kernel's jumps with the tile count, so the latter needs more, and
#: the few-tile kernel most: there cuBLAS's own time jumps between
#: neighbouring shapes (experiments/results/nvidia_h100/dispatch/README.md).
NEAREST_BUCKET_MARGIN = 1.10
MARGIN_PER_OCTAVE = 0.25
KERNEL_MARGINS = {"mosaic/small_m": (1.05, 0.14),
                  "mosaic/split_k": (1.20, 0.25)}
#: Buckets this close (octaves) that measured the winner slower than xla
#: veto it for an unmeasured shape.
VETO_DISTANCE = 1.0
#: ... slower meaning below this ratio: within 1 % of xla is a tie (timing
#: noise, as a bucket's win needs the builder's 1.01), not a loss.
VETO_BELOW = 0.99
#: Within the streaming row (M in 2..`STREAMING_ROWS`, one bucket row) a
#: loss vetoes only for an M within this many octaves of it: a kernel that
#: loses to XLA's matrix-vector path at M = 2 says little of M = 16, where
#: the weight is read for more rows (leave-one-out:
#: experiments/results/nvidia_h100/dispatch/README.md, last section).
VETO_STREAMING_M_OCTAVES = 1.0
#: With no bucket within reach, a kernel that won every measured bucket of
#: the problem's class (at least this many, each by `CLASS_RULE_MARGIN`)
#: runs anyway: a property of the whole class, such as rows that are not
#: 16-byte aligned (cuBLAS's slow path), holds between measured sizes too,
#: and above them, but not far below them (`_below_measured`).
CLASS_RULE_MIN_BUCKETS = 3
CLASS_RULE_MARGIN = 1.10
#: ... in at least this share of the class's buckets, with no problem of
#: the class measured slower than xla (below `VETO_BELOW`; a tie is no
#: loss): one bucket where a kernel only tied xla does not undo a lead it
#: showed everywhere else.
CLASS_RULE_SHARE = 0.9
#: Classes the class rule does not decide: B's rows at 8-byte units, where
#: cuBLAS runs near its aligned speed on some shapes and not on others, so
#: no lead holds for the whole class (experiments/results/nvidia_h200/
#: dispatch/README.md, section "B's rows at 8-byte units"). For fp8 the
#: class rule counts every loss in the class, far below the problem too:
#: XLA's fp8 speed turns with the layout and N (cuBLASLt's fast path with B
#: stored (n, k) at wide N), not only with the pads that smaller problems
#: pay.
NO_CLASS_RULE = ("ub8",)
#: Buckets are this many steps per octave (2: sizes within a factor of
#: sqrt(2) share a bucket).
STEPS_PER_OCTAVE = 2
#: Up to this many rows a GEMM streams its weight and little else: every
#: M from 2 up to it shares one bucket row, so a decode measurement at
#: M = 16 speaks for M = 48 too. M = 1 has a row of its own: there XLA runs
#: a matrix-vector product, and a kernel's lead over it at M = 8 does not
#: carry over (experiments/results/nvidia_h100/wide/NOTES.md).
STREAMING_ROWS = 64

#: GPUs of one architecture and SM count. An fp8 class that a GPU's own
#: table never measured is decided by a sibling's buckets for it where the
#: sibling has some, rather than by the fixed order, which no measurement
#: backs (experiments/results/nvidia_h200/dispatch/README.md, last
#: section).
SIBLING_TABLES = {"nvidia_h200": ("nvidia_h100",),
                  "nvidia_h100": ("nvidia_h200",)}

#: An fp8 problem of more than STREAMING_ROWS rows that no bucket of its
#: class reaches follows the `FP8_NEIGHBOURS` measured problems nearest to
#: it of its layout, dtypes and scales, of any alignment, within
#: `FP8_NEIGHBOUR_REACH` octaves in each of batch, M, N and K
#: (`_fp8_neighbour_vote`); short calls of fewer rows keep the other rules,
#: as decode buckets share one row of the grid. fp8 classes are split
#: by operand alignment, so most have a few scattered buckets, while what
#: decides the race (XLA's transposes and its unscaled path, the kernels'
#: pads) is shared by a layout's alignments. The scales are not shared:
#: XLA takes another path for each.
FP8_NEIGHBOURS = 3
FP8_NEIGHBOUR_REACH = 2.0
#: ... and decides only with at least this many of them in reach.
FP8_MIN_NEIGHBOURS = 2

#: Tiled kernels without a split K: with fewer CTA tiles than SMs their
#: time is one tile's whole K loop while cuBLAS can split K over the idle
#: SMs, so a lead measured on one such shape does not carry to another
#: (leave-one-out: experiments/results/nvidia_h200/dispatch/README.md). On
#: an aligned shape that was not measured itself, they run only with at
#: least one wave of tiles.
NEEDS_A_WAVE = ("mosaic/ws_persistent",)

#: Kernels whose TMA-tiled output needs every row a whole number of
#: 128-byte swizzle spans (`mosaic_backend/tma.py`): otherwise the output is
#: padded and sliced back, and B (stored (k, n)) padded too, each one more
#: copy of a few microseconds, which on a few-microsecond problem decides
#: the race. A lead measured on shapes that paid no such copy is not
#: trusted to an unmeasured shape that pays it. (The one-consumer kernels
#: now read and write rows of 32- and 64-byte multiples with a narrower
#: swizzle instead of padding them: a different path again, and slower
#: wgmma reads on long K loops. Without the rule for them, leave-one-out
#: on the H100 let several more split_k losses through:
#: experiments/results/nvidia_h100/narrow_swizzle/NOTES.md.)
PADS_OUTPUT_ROWS = ("mosaic/ws_persistent", "mosaic/split_k",
                    "mosaic/small_m")
OUTPUT_ROW_SPAN_BYTES = 128

#: One-consumer kernels that read rows of 32- or 64-byte multiples through
#: that narrower swizzle (`small_m.input_swizzle`). With tiles of more than
#: `NARROW_FAST_TILE_M` rows such a K step runs at about half the rate it
#: has through the 128-byte swizzle; with 64-row tiles the narrow swizzle
#: costs little (per-step times of the measured split_k rows, both GPUs:
#: experiments/results/nvidia_h200/dispatch/README.md, section "mosaic/
#: split_k measured on the H200, and narrow swizzles with tall tiles"). So
#: a lead measured on the fast paths is not trusted to an unmeasured shape
#: that takes the slow one.
NARROW_SWIZZLE_KERNELS = ("mosaic/split_k", "mosaic/small_m")
NARROW_FAST_TILE_M = 64

_stats_lock = threading.Lock()
#: Counters a test reads: how many times a resolution was computed (not
#: served from the memo).
STATS = {"resolutions": 0}


@dataclasses.dataclass(frozen=True)
class Resolution:
  kernel: str
  config: Any
  # "explicit", "dispatch table", "nearest bucket", "class rule",
  # "fp8 neighbours", "aligned twin", "order", "fallback"
  kernel_source: str
  # "explicit", "user cache", "dispatch table", "shipped", "autotune",
  # "heuristic", "none"
  config_source: str
  reason: str

  def __str__(self) -> str:
    return (f"kernel={self.kernel} ({self.kernel_source}), "
            f"config={self.config} ({self.config_source}): {self.reason}")


# ------------------------------------------------------------ the buckets ---


def _grid(size: int) -> int:
  return round(STEPS_PER_OCTAVE * math.log2(max(size, 1)))


def _bucket_rows(m: int) -> int:
  """M on the grid, with every M in 2..STREAMING_ROWS on one row."""
  return _grid(m) if m == 1 else _grid(max(m, STREAMING_ROWS))


def epilogue_kind(problem: GemmProblem) -> str:
  return "plain" if problem.epilogue.is_identity else "fused"


def alignment(problem: GemmProblem) -> str:
  """"a16" when every stored row is a multiple of 16 bytes (what the TMA and
  cuBLAS's fast paths need); else the first operand whose rows are not:
  "ua" (A's), "ub" (B's, not a multiple of 8 bytes), "ub8" (B's, a
  multiple of 8 bytes) or "uc" (only the output's, B being stored (n, k)).
  cuBLAS pays for each differently: a slow path with A's rows misaligned
  or B's at 2- or 4-byte units, near its aligned speed with B's at 8-byte
  units or with only the output's misaligned, while the kernels pad alike
  in all four (experiments/results/nvidia_h200/dispatch/README.md,
  section "Unaligned rows by operand")."""
  in_size, out_size = itemsize(problem.in_dtype), itemsize(problem.out_dtype)
  a_row = problem.m if problem.transpose_a else problem.k
  b_row = problem.k if problem.transpose_b else problem.n
  if a_row * in_size % 16:
    return "ua"
  if b_row * in_size % 16:
    return "ub8" if b_row * in_size % 8 == 0 else "ub"
  if problem.n * out_size % 16:
    return "uc"
  return "a16"


def fp8_operands(problem: GemmProblem) -> str:
  """"" for other inputs; for fp8, "<B's dtype>:<A's scales>/<B's scales>":
  the scale modes change what each candidate does (XLA scales its f32
  product in a second pass, a kernel in its epilogue or main loop), so
  a lead measured with one kind of scales says nothing of another."""
  if problem.in_dtype not in FP8_DTYPES:
    return ""
  return (f"{problem.b_dtype or problem.in_dtype}:"
          f"{problem.a_scale_mode}/{problem.b_scale_mode}")


@dataclasses.dataclass(frozen=True)
class DispatchKey:
  in_dtype: str
  out_dtype: str
  layout: str
  precision: str
  epilogue: str
  align: str
  batch: int  # on the half-octave grid
  m: int
  n: int
  k: int
  # `fp8_operands`; empty for 16- and 32-bit inputs, and then left out of
  # the name, so that tables written before fp8 buckets parse unchanged.
  operands: str = ""

  #: The fields that make a bucket's class: buckets of one class differ
  #: only in their sizes.
  CLASS_FIELDS = ("in_dtype", "out_dtype", "layout", "precision", "epilogue",
                  "align", "operands")

  @classmethod
  def for_problem(cls, problem: GemmProblem) -> DispatchKey:
    return cls(problem.in_dtype, problem.out_dtype, problem.layout,
               problem.precision, epilogue_kind(problem), alignment(problem),
               _grid(problem.batch), _bucket_rows(problem.m),
               _grid(problem.n), _grid(problem.k), fp8_operands(problem))

  @property
  def name(self) -> str:
    operands = f"{self.operands}|" if self.operands else ""
    return (f"{self.in_dtype}|{self.out_dtype}|{self.layout}|"
            f"{self.precision}|{self.epilogue}|{self.align}|{operands}"
            f"{self.batch}x{self.m}x{self.n}x{self.k}")

  @classmethod
  def parse(cls, name: str) -> DispatchKey:
    *fields, dims = name.split("|")
    if len(fields) not in (6, 7):
      raise ValueError(f"dispatch key {name!r} has {len(fields)} fields")
    batch, m, n, k = (int(d) for d in dims.split("x"))
    return cls(*fields[:6], batch, m, n, k, *fields[6:])

  def same_class(self, other: DispatchKey) -> bool:
    return all(getattr(self, f) == getattr(other, f)
               for f in self.CLASS_FIELDS)

  def distance(self, other: DispatchKey) -> float:
    """Octaves between the two buckets' sizes, summed over the four dims."""
    return sum(abs(x - y) for x, y in (
        (self.batch, other.batch), (self.m, other.m), (self.n, other.n),
        (self.k, other.k))) / STEPS_PER_OCTAVE


def dispatch_records(device: DeviceInfo) -> dict[str, dict]:
  """The device's measured buckets: the shipped table, overridden entry by
  entry by the user cache's dispatch section."""
  records = dict(autotune.read_section(autotune.shipped_path(device.key),
                                       "dispatch"))
  records.update(autotune.read_section(autotune.cache_path(device.key),
                                       "dispatch"))
  return records


def _valid_record(record) -> bool:
  return (isinstance(record, dict) and isinstance(record.get("kernel"), str)
          and isinstance(record.get("ratio_to_xla", 1.0), (int, float)))


def neighbours(problem: GemmProblem, records: dict[str, dict]):
  """[(distance, record)] of the buckets of the problem's class within
  `NEAREST_BUCKET_DISTANCE`, nearest first."""
  key = DispatchKey.for_problem(problem)
  found = []
  for name, record in sorted(records.items()):
    try:
      other = DispatchKey.parse(name)
    except ValueError:
      continue
    if other.same_class(key) and _valid_record(record):
      distance = key.distance(other)
      if distance <= NEAREST_BUCKET_DISTANCE:
        found.append((distance, record))
  found.sort(key=lambda item: item[0])
  return found


def nearest_record(problem: GemmProblem, records: dict[str, dict]):
  """(record, distance) of the nearest bucket of the problem's class within
  `NEAREST_BUCKET_DISTANCE`, or (None, None)."""
  found = neighbours(problem, records)
  if not found:
    return None, None
  return found[0][1], found[0][0]


def _worst_ratios(record: dict) -> dict[str, float]:
  """kernel -> its worst measured speed-up over xla in this bucket: from
  the per-problem "ratios" the builder keeps for every kernel it timed, or
  (older tables) the winner's "ratio_to_xla" alone."""
  ratios = record.get("ratios")
  if isinstance(ratios, dict) and ratios:
    return {kernel: min(values) for kernel, values in ratios.items()
            if isinstance(values, list) and values
            and all(isinstance(v, (int, float)) for v in values)}
  if record["kernel"] == "xla":
    return {}
  return {record["kernel"]: float(record.get("ratio_to_xla", 1.0))}


def class_winner(key: DispatchKey, keys: list[DispatchKey],
                 buckets: list[dict[str, float]], every_loss_counts=False):
  """(kernel, bucket count, share) when one kernel was measured slower than xla
  (below `VETO_BELOW`) on no problem of any measured bucket of the
  problem's class (`keys`, with `buckets`, their worst ratios per kernel:
  `_class_buckets`) and beat xla by `CLASS_RULE_MARGIN` on every problem
  of at least `CLASS_RULE_SHARE` of those buckets, and the problem's
  bucket `key` is not far below them (`_below_measured`), else None.
  Buckets far below `key` (`_far_below`) where the kernel did not lead by
  the margin are left out, unless `every_loss_counts` (fp8). Of several
  such kernels, the one with the larger share, then the higher worst
  ratio."""
  if len(buckets) < CLASS_RULE_MIN_BUCKETS:
    return None
  candidates = []
  for kernel in set.intersection(*(set(b) for b in buckets)) - {"xla"}:
    # A bucket far below the problem where the kernel did not lead by the
    # margin says nothing of it (`_below_measured`); one where it did is
    # a lower bound on the lead.
    kept = [(other, b[kernel]) for other, b in zip(keys, buckets)
            if b[kernel] >= CLASS_RULE_MARGIN or every_loss_counts
            or not _far_below(other, key)]
    ratios = [ratio for _, ratio in kept]
    if (len(kept) < CLASS_RULE_MIN_BUCKETS
        or _below_measured(key, [other for other, _ in kept])):
      continue
    share = sum(r >= CLASS_RULE_MARGIN for r in ratios) / len(ratios)
    if min(ratios) >= VETO_BELOW and share >= CLASS_RULE_SHARE:
      candidates.append((share, min(ratios), len(ratios), kernel))
  if not candidates:
    return None
  share, _, count, kernel = max(candidates)
  return kernel, count, share


def _class_buckets(problem: GemmProblem, records: dict[str, dict]):
  """([DispatchKey], [worst ratios per kernel]) of the measured buckets of
  the problem's class."""
  key = DispatchKey.for_problem(problem)
  keys, buckets = [], []
  for name, record in records.items():
    try:
      other = DispatchKey.parse(name)
    except ValueError:
      continue
    if other.same_class(key) and _valid_record(record):
      keys.append(other)
      buckets.append(_worst_ratios(record))
  return keys, buckets


_SIZE_DIMS = ("batch", "m", "n", "k")


def _far_below(key: DispatchKey, other: DispatchKey) -> bool:
  """Whether bucket `key` is more than `NEAREST_BUCKET_DISTANCE` octaves
  smaller than bucket `other` in batch, M, N or K."""
  reach = NEAREST_BUCKET_DISTANCE * STEPS_PER_OCTAVE
  return any(getattr(key, dim) + reach < getattr(other, dim)
             for dim in _SIZE_DIMS)


def _below_measured(key: DispatchKey, measured: list[DispatchKey]) -> bool:
  """Whether the bucket `key` is more than `NEAREST_BUCKET_DISTANCE` octaves
  smaller in batch, M, N or K than every bucket `measured`. A class's lead
  holds between and above its measured sizes (the kernels' pads of
  unaligned rows are copies that grow with the operands, the work they
  save faster), and a little below them (leave-one-out loses nothing at an
  octave: experiments/lab/dispatch_holdout.py), not far below: at M = 1 the
  pad of B is most of the call (experiments/results/nvidia_h200/dispatch/
  README.md, last section). For the same reason a loss far below the
  problem says nothing of it (`class_winner` leaves it out): problems of a
  few rows or columns lose on the pads that larger ones of their class
  repay."""
  smallest = dataclasses.replace(measured[0], **{
      dim: min(getattr(other, dim) for other in measured)
      for dim in _SIZE_DIMS})
  return _far_below(key, smallest)


def required_margin(distance: float, kernel: str = "") -> float:
  """The lead over xla `kernel` must have shown in a bucket `distance`
  octaves away."""
  base, per_octave = KERNEL_MARGINS.get(
      kernel, (NEAREST_BUCKET_MARGIN, MARGIN_PER_OCTAVE))
  return base + per_octave * max(0.0, distance - 0.5)


def _lost_nearby(kernel: str, problem: GemmProblem, records) -> int:
  """How many buckets within reach measured `kernel` slower than xla (below
  `VETO_BELOW`) on one of their problems."""
  count = 0
  for distance, record in neighbours(problem, records):
    if distance > VETO_DISTANCE:
      break
    ratios = record.get("ratios", {}).get(kernel)
    if (isinstance(ratios, list) and ratios and min(ratios) < VETO_BELOW
        and _loss_reaches(problem, record.get("problems"), ratios)):
      count += 1
  return count


def _streaming(m: int) -> bool:
  return 1 < m <= STREAMING_ROWS


def _loss_reaches(problem: GemmProblem, described, ratios) -> bool:
  """Whether a bucket's losses (its problems' `ratios` below `VETO_BELOW`)
  speak for `problem`. Outside the streaming row they all do; inside it,
  only a loss at an M within `VETO_STREAMING_M_OCTAVES` of the problem's,
  or one whose M is unknown or outside the row."""
  if (not _streaming(problem.m) or not isinstance(described, list)
      or len(described) != len(ratios)):
    return True
  for description, ratio in zip(described, ratios):
    if ratio >= VETO_BELOW:
      continue
    other = _described_problem(description)
    if (other is None or not _streaming(other.m)
        or abs(math.log2(other.m / problem.m)) <= VETO_STREAMING_M_OCTAVES):
      return True
  return False


# ------------------------------------------------------------ the configs ---


def _usable(entry, config, problem, device) -> bool:
  if config is None or not isinstance(config, entry.config_cls):
    return False
  if not autotune.fits_device(config, problem, device):
    return False
  check = entry.check_config
  return check is None or check(config, problem, device) is None


def _config_for(entry, problem, device, table_config=None):
  """(config, source) for an automatically configured kernel."""
  if entry.config_cls is None:
    return None, "none"
  user = autotune.lookup_user(problem, entry.name, device, entry.config_cls)
  if _usable(entry, user, problem, device):
    return user, "user cache"
  if _usable(entry, table_config, problem, device):
    return table_config, "dispatch table"
  shipped = autotune.lookup_shipped(problem, entry.name, device,
                                    entry.config_cls)
  if _usable(entry, shipped, problem, device):
    return shipped, "shipped"
  if autotune.autotune_enabled() and device.is_gpu and autotune.has_search_space(
      entry.name):
    try:
      tuned = autotune.tune(problem, entry.name, device=device).best
      if _usable(entry, tuned, problem, device):
        return tuned, "autotune"
    except RuntimeError:
      pass
  return entry.heuristic(problem, device), "heuristic"


def _check_config_type(entry, config):
  if entry.config_cls is None:
    raise TypeError(f"kernel={entry.name!r} takes no config, got {config!r}")
  if not isinstance(config, entry.config_cls):
    raise TypeError(
        f"config for kernel={entry.name!r} must be a "
        f"{entry.config_cls.__name__}, got {type(config).__name__}")


# ------------------------------------------------------------- resolution ---


def resolve(problem: GemmProblem, device: DeviceInfo,
            kernel: str | None = None, config=None) -> Resolution:
  """The kernel and config that run `problem` on `device` (see the module
  docstring). Raises ValueError for a named kernel that cannot run the
  problem, TypeError for a config of the wrong class."""
  if kernel is not None and not isinstance(kernel, str):
    raise TypeError(f"kernel must be a str or None, got {type(kernel).__name__}")
  if config is not None:
    if kernel is None:
      raise ValueError(
          f"config={config!r} was given with kernel=None; a config belongs "
          f"to one kernel, so name it too (kernel=...)")
    _check_config_type(registry.get_kernel(kernel), config)
  return _resolve(problem, device, kernel, config)


def clear_cache() -> None:
  """Forgets memoized resolutions (after the tuning cache changed)."""
  _resolve.cache_clear()


@functools.lru_cache(maxsize=8192)
def _resolve(problem, device, kernel, config) -> Resolution:
  with _stats_lock:
    STATS["resolutions"] += 1
  if kernel is not None:
    entry = registry.select_kernel(problem, device, kernel)
    if config is not None:
      return Resolution(entry.name, config, "explicit", "explicit",
                        "the caller named the kernel and its config")
    chosen, source = _config_for(entry, problem, device)
    return Resolution(entry.name, chosen, "explicit", source,
                      "the caller named the kernel")
  if device.is_gpu and problem.flops > 0:
    records = dispatch_records(device)
    chosen = _table_decision(problem, device, records) if records else None
    if chosen is not None:
      return chosen
    if problem.in_dtype not in FP8_DTYPES:
      if records:
        return _no_bucket_in_reach(problem, device, records)
    else:
      chosen = _fp8_without_a_bucket_in_reach(problem, device, records)
      if chosen is not None:
        return chosen
  entry = registry.select_kernel(problem, device)
  chosen, source = _config_for(entry, problem, device)
  reason = (f"first kernel of the {_order_name(device)} order "
            f"({' -> '.join(registry.auto_order(device, problem))}) that "
            f"supports the problem")
  if device.platform == "cpu" and problem.flops > (
      registry.CPU_INTERPRET_FLOP_BUDGET):
    reason += (f"; interpret mode is kept to problems of at most "
               f"{registry.CPU_INTERPRET_FLOP_BUDGET} flops")
  return Resolution(entry.name, chosen, "order", source, reason)


def _fp8_without_a_bucket_in_reach(problem, device, records):
  """The resolution of an fp8 problem that no bucket of this GPU's table
  decides (`_table_decision` gave None), or None for the fixed order.

  A sibling GPU's table decides first (its buckets in reach, neighbours
  or class rule), for an aligned class measured here too: its scattered
  buckets, say of narrow outputs, are no evidence out of their reach,
  while the sibling's may lie near. Then an aligned class falls back to
  xla (the sibling's fallback, where only the sibling measured it), as
  16-bit classes do. Rows that are not 16-byte units (whose few buckets
  say nothing out of reach: falling to xla there lost the kernels' leads
  on every unaligned call out of a bucket's reach) run xla at most
  STREAMING_ROWS rows (there mosaic/fp8 through the order, with its pads,
  lost to XLA on most problems timed), else their aligned twin's xla,
  else the order, not xla for want of a bucket (XLA's fp8 is slow with B
  stored (k, n), with A stored transposed and at unaligned rows); so does
  a class no table measured. Measurements: experiments/results/
  nvidia_h200/dispatch/README.md, the sections from "Odd widths the table
  never measured" on."""
  aligned = alignment(problem) == "a16"
  measured_here = bool(records) and _class_measured(problem, records)
  for sibling in SIBLING_TABLES.get(device.key, ()):
    borrowed = autotune.read_section(autotune.shipped_path(sibling),
                                     "dispatch")
    if not _class_measured(problem, borrowed):
      continue
    chosen = _table_decision(problem, device, borrowed)
    if chosen is None and aligned and not measured_here:
      chosen = _no_bucket_in_reach(problem, device, borrowed)
    if chosen is not None:
      return dataclasses.replace(chosen, reason=(
          f"{chosen.reason} (from the {sibling} table: the {device.key} "
          "table has no bucket of this fp8 class in reach)"))
  if aligned and measured_here:
    return _no_bucket_in_reach(problem, device, records)
  if not aligned and problem.m <= STREAMING_ROWS:
    return Resolution(
        "xla", None, "fallback", "none",
        f"{problem.m} rows (at most {STREAMING_ROWS}) of fp8 with rows that "
        "are not 16-byte units and no bucket in reach: the order's tiled "
        "kernel, with its pads, ran slower than XLA on most such problems "
        "timed")
  twin = _aligned_twin(problem)
  if twin is not None and _resolve(twin, device, None, None).kernel == "xla":
    return Resolution(
        "xla", None, "aligned twin", "none",
        f"no table has a bucket of this fp8 class (rows that are not 16-byte "
        f"units) within {NEAREST_BUCKET_DISTANCE} octaves; at the aligned "
        f"sizes {twin.describe()} xla is chosen, and the kernels' pads of "
        "these rows only add to their time")
  return None


def _octaves_apart(problem: GemmProblem, other: GemmProblem) -> float:
  """The largest distance in octaves between the two problems' batch, M, N
  and K."""
  return max(abs(math.log2(max(getattr(problem, dim), 1))
                 - math.log2(max(getattr(other, dim), 1)))
             for dim in _SIZE_DIMS)


def _fp8_measured_problems(problem: GemmProblem, records):
  """[(distance, {kernel: ratio to xla}, description)] of every problem
  measured in a bucket of the problem's dtypes, scales and layout (any
  alignment) within `FP8_NEIGHBOUR_REACH` octaves, nearest first."""
  found = []
  for name, record in records.items():
    try:
      key = DispatchKey.parse(name)
    except ValueError:
      continue
    if ((key.in_dtype, key.out_dtype, key.layout, key.precision,
         key.epilogue, key.operands) != (
             problem.in_dtype, problem.out_dtype, problem.layout,
             problem.precision, epilogue_kind(problem),
             fp8_operands(problem))
        or not _valid_record(record)):
      continue
    ratios = record.get("ratios")
    ratios = ratios if isinstance(ratios, dict) else {}
    for i, description in enumerate(record.get("problems", ())):
      other = _described_problem(description)
      measured = {kernel: values[i] for kernel, values in ratios.items()
                  if isinstance(values, list) and len(values) > i
                  and isinstance(values[i], (int, float)) and values[i] > 0}
      if other is None or not measured:
        continue  # tables without per-problem ratios say nothing here
      distance = _octaves_apart(problem, other)
      if distance <= FP8_NEIGHBOUR_REACH:
        found.append((distance, measured, description))
  found.sort(key=lambda item: (item[0], item[2]))
  return found


def _fp8_neighbour_vote(problem, device, records) -> Resolution | None:
  """The decision of the nearest measured fp8 problems of the layout and
  scales (`FP8_NEIGHBOURS`, `_fp8_measured_problems`), or None where fewer
  than `FP8_MIN_NEIGHBOURS` lie in reach. A kernel that can run the
  problem runs where it beat xla on every one of them and by
  `CLASS_RULE_MARGIN` on their mean (geometric, weighted towards the
  nearest); otherwise xla. Leave-one-out over both GPUs' fp8
  measurements: experiments/results/nvidia_h200/dispatch/README.md,
  section "fp8 by the layout's nearest problems"."""
  nearest = _fp8_measured_problems(problem, records)[:FP8_NEIGHBOURS]
  if len(nearest) < FP8_MIN_NEIGHBOURS:
    return None
  weights = [1.0 / (distance + 0.25) for distance, _, _ in nearest]
  votes = []
  for kernel in set.intersection(*(set(r) for _, r, _ in nearest)) - {"xla"}:
    ratios = [r[kernel] for _, r, _ in nearest]
    mean = math.exp(sum(w * math.log(r) for w, r in zip(weights, ratios))
                    / sum(weights))
    if (min(ratios) >= 1.0 and mean >= CLASS_RULE_MARGIN
        and _why_not(kernel, problem, device) is None):
      votes.append((mean, kernel))
  where = (f"the {len(nearest)} nearest measured fp8 {problem.layout} "
           f"problems (within {nearest[-1][0]:.1f} octaves, nearest "
           f"{nearest[0][2].split()[0]})")
  if not votes:
    return Resolution("xla", None, "fp8 neighbours", "none",
                      f"no kernel beat xla on every one of {where} by "
                      f"{CLASS_RULE_MARGIN}x on average")
  mean, kernel = max(votes)
  chosen, source = _config_for(registry._REGISTRY[kernel], problem, device)
  return Resolution(kernel, chosen, "fp8 neighbours", source,
                    f"{kernel} beat xla on every one of {where}, "
                    f"{mean:.2f}x on average")


#: The multiple an unaligned problem's row lengths are rounded up to in its
#: aligned twin: rows of any dtype a whole number of 16-byte units.
TWIN_MULTIPLE = 16


def _aligned_twin(problem: GemmProblem) -> GemmProblem | None:
  """The problem with the dims that are rows' lengths (N, K, and M where A
  is stored transposed) rounded up to TWIN_MULTIPLE (rows of whole 16-byte
  units), where it is not aligned itself, else None. An fp8 class of
  unaligned rows that no table measured takes xla where the twin does:
  both ways pay for the misalignment (XLA a slower GEMM path, the kernels
  a padding copy of each misaligned operand and of the output), so the
  twin's decision is the nearest measured evidence; where the twin takes a
  kernel, the order's kernel runs (experiments/results/nvidia_h200/
  dispatch/README.md, last section)."""
  if alignment(problem) == "a16":
    return None
  up = lambda d: -(-d // TWIN_MULTIPLE) * TWIN_MULTIPLE
  return dataclasses.replace(
      problem, m=up(problem.m) if problem.transpose_a else problem.m,
      n=up(problem.n), k=up(problem.k))


def _class_measured(problem: GemmProblem, records: dict[str, dict]) -> bool:
  key = DispatchKey.for_problem(problem)
  for name in records:
    try:
      if DispatchKey.parse(name).same_class(key):
        return True
    except ValueError:
      continue
  return False


def _order_name(device: DeviceInfo) -> str:
  if device.platform == "cpu":
    return "CPU"
  return "Hopper" if device.is_hopper else "GPU"


def _from_table(problem, device, records) -> Resolution:
  """The table's decision (`_table_decision`), else xla."""
  return (_table_decision(problem, device, records)
          or _no_bucket_in_reach(problem, device, records))


def _no_bucket_in_reach(problem, device, records) -> Resolution:
  """xla, for want of a bucket in reach (or of a class rule)."""
  key = DispatchKey.for_problem(problem)
  keys, _ = _class_buckets(problem, records)
  below = (" (its class was measured only at a batch, M, N or K more than "
           f"{NEAREST_BUCKET_DISTANCE} octaves larger, where the kernels' "
           "lead does not reach)"
           if keys and _below_measured(key, keys) else "")
  return Resolution(
      "xla", None, "fallback", "none",
      f"no measured bucket within {NEAREST_BUCKET_DISTANCE} octaves of "
      f"{problem.describe()} in the {device.key} dispatch table{below}")


def _why_not(kernel: str, problem, device) -> str | None:
  """Why the table's `kernel` cannot run `problem` here, or None."""
  entry = registry._REGISTRY.get(kernel)
  if entry is None:
    return f"{kernel} is not registered"
  return registry.why_unsupported(entry, problem, device)


def _table_decision(problem, device, records) -> Resolution | None:
  """The decision of the buckets in reach of `problem` (the nearest one);
  out of their reach, for fp8 above STREAMING_ROWS rows, that of the
  layout's nearest measured problems (`_fp8_neighbour_vote`), then the
  class rule (not for `NO_CLASS_RULE` classes; for fp8 every loss in the
  class counts); or None where none of these decides."""
  record, distance = nearest_record(problem, records)
  fp8 = problem.in_dtype in FP8_DTYPES
  if record is None and fp8 and problem.m > STREAMING_ROWS:
    vote = _fp8_neighbour_vote(problem, device, records)
    if vote is not None:
      return vote
  if record is None and alignment(problem) in NO_CLASS_RULE:
    return None
  if record is None:
    key = DispatchKey.for_problem(problem)
    keys, buckets = _class_buckets(problem, records)
    rule = class_winner(key, keys, buckets, every_loss_counts=fp8)
    if rule is None:
      return None
    name, count, share = rule
    if _why_not(name, problem, device) is not None:
      return None
    chosen, source = _config_for(registry._REGISTRY[name], problem, device)
    return Resolution(
        name, chosen, "class rule", source,
        f"no bucket within {NEAREST_BUCKET_DISTANCE} octaves, but {name} "
        f"beat xla by {CLASS_RULE_MARGIN}x or more in {share:.0%} of the "
        f"{count} measured buckets of this class and lost in none")
  name, ratio = record["kernel"], float(record.get("ratio_to_xla", 1.0))
  where = ("its bucket" if distance == 0 else
           f"the nearest bucket ({distance:g} octaves away)")
  if name == "xla":
    return Resolution("xla", None, "dispatch table" if distance == 0
                      else "nearest bucket", "none",
                      f"xla measured fastest in {where}")
  reason = _why_not(name, problem, device)
  if reason is not None:
    return Resolution("xla", None, "fallback", "none",
                      f"{where} chose {name}, which cannot run this problem "
                      f"({reason})")
  entry = registry._REGISTRY[name]
  # A shape of the bucket that was not itself measured is as unmeasured as
  # one half an octave away (a bucket spans half an octave in each dim): a
  # tiled kernel's lead over a few-microsecond cuBLAS call can turn into a
  # loss within it, so it needs the same margin and no loss nearby.
  measured = problem.describe() in record.get("problems", ())
  margin = required_margin(distance, name)
  source = "dispatch table" if distance == 0 else "nearest bucket"
  if not measured and ratio < margin:
    return Resolution(
        "xla", None, source, "none",
        f"{name} led xla by only {ratio:.3f}x in {where}, under the "
        f"{margin:.3f}x margin for a shape not measured itself")
  lost = 0 if measured else _lost_nearby(name, problem, records)
  if lost:
    return Resolution(
        "xla", None, source, "none",
        f"{name} won {where} but lost to xla in {lost} bucket(s) "
        f"within {VETO_DISTANCE} octaves: an unmeasured shape "
        "between them is not trusted to it")
  if (not measured and name in PADS_OUTPUT_ROWS
      and pads_output_rows(problem.n, problem.out_dtype)
      and _padding_unmeasured(record)):
    return Resolution(
        "xla", None, source, "none",
        f"{name} won {where}, but here its output rows of {problem.n} "
        f"{problem.out_dtype} are not whole {OUTPUT_ROW_SPAN_BYTES}-byte "
        "spans: the output is padded and sliced back, a copy that no "
        "problem measured there paid")
  table_config = None
  measured_config = _measured_config(record, problem)
  if measured_config is not None and entry.config_cls is not None:
    table_config = autotune.config_from_json(entry.config_cls,
                                             measured_config)
  chosen, config_source = _config_for(entry, problem, device, table_config)
  tile = _tile(entry, problem, chosen)
  if (not measured and name in NARROW_SWIZZLE_KERNELS
      and _narrow_tall_tiles(problem, tile)
      and not _narrow_tile_measured(record, tile)):
    return Resolution(
        "xla", None, source, "none",
        f"{name} won {where}, but here it would read rows of "
        f"{_input_swizzle(problem)}-byte swizzle spans with tiles of more "
        f"than {NARROW_FAST_TILE_M} rows, a slower path than any problem "
        "measured there took")
  tiles = _cta_tiles(problem, chosen)
  if (not measured and name in NEEDS_A_WAVE and alignment(problem) == "a16"
      and tiles is not None and tiles < device.num_sms):
    return Resolution(
        "xla", None, source, "none",
        f"{name} won {where}, but here it has {tiles} CTA tiles for "
        f"{device.num_sms} SMs: with less than a wave of tiles its lead "
        "does not carry between shapes")
  return Resolution(name, chosen, source, config_source,
                    f"{name} measured {ratio:.3f}x xla in {where}")


def pads_output_rows(n: int, out_dtype: str) -> bool:
  """Whether an output of n columns of `out_dtype` has rows that are not a
  whole number of swizzle spans (`PADS_OUTPUT_ROWS`)."""
  return n * itemsize(out_dtype) % OUTPUT_ROW_SPAN_BYTES != 0


def _padding_unmeasured(record: dict) -> bool:
  """Whether none of the record's measured problems padded its output
  rows."""
  measured = [_described_problem(d) for d in record.get("problems", ())]
  return all(p is not None and not pads_output_rows(p.n, p.out_dtype)
             for p in measured)


def _input_swizzle(problem: GemmProblem) -> int:
  from pallas_gemm.mosaic_backend import small_m
  return small_m.input_swizzle(problem)


def _tile(entry, problem: GemmProblem, config) -> tuple[int, int] | None:
  """(rows, columns) of the one-consumer kernel's wgmma tile under
  `config` (a config object or its JSON), or None."""
  if isinstance(config, dict):
    tile_m, tile_n = config.get("tile_m"), config.get("tile_n")
  else:
    tile_m = getattr(config, "tile_m", None)
    tile_n = getattr(config, "tile_n", None)
  if tile_m is None and entry.name == "mosaic/small_m":
    from pallas_gemm.mosaic_backend.configs import small_m_tile_m
    tile_m = small_m_tile_m(problem)
  if not isinstance(tile_m, int) or not isinstance(tile_n, int):
    return None
  return tile_m, tile_n


def _narrow_tall_tiles(problem: GemmProblem, tile) -> bool:
  """Whether a one-consumer kernel reads `problem`'s operands through a
  swizzle narrower than 128 bytes with tiles taller than
  `NARROW_FAST_TILE_M` rows (`NARROW_SWIZZLE_KERNELS`)."""
  from pallas_gemm.mosaic_backend import tma
  return (tile is not None and tile[0] > NARROW_FAST_TILE_M
          and _input_swizzle(problem) < tma.SWIZZLE_BYTES)


def _described_problem(description: str) -> GemmProblem | None:
  """The plain GemmProblem a `GemmProblem.describe()` text names (sizes,
  dtypes, layout), or None."""
  try:
    dims, dtypes, layout = description.split()[:3]
    sizes = [int(d) for d in dims.split("x")]
    in_dtype, out_dtype = dtypes.split("->")
    batch = sizes[0] if len(sizes) == 4 else 1
    m, n, k = sizes[-3:]
    return GemmProblem(batch, m, n, k, in_dtype.split("x")[0], out_dtype,
                       transpose_a=layout[0] == "T",
                       transpose_b=layout[1] == "T")
  except (ValueError, IndexError, TypeError):
    return None


def _narrow_tile_measured(record: dict, tile) -> bool:
  """Whether one of the record's problems was measured on the slow path of
  `_narrow_tall_tiles` with this very tile (its winner's config per
  problem, `configs`): a narrow swizzle's cost grows with the tile."""
  configs = record.get("configs")
  entry = registry._REGISTRY.get(record.get("kernel"))
  if not isinstance(configs, dict) or entry is None:
    return False
  for description, config in configs.items():
    problem = _described_problem(description)
    if problem is None:
      continue
    measured_tile = _tile(entry, problem, config)
    if measured_tile == tile and _narrow_tall_tiles(problem, measured_tile):
      return True
  return False


def _measured_config(record: dict, problem: GemmProblem):
  """The config (as JSON) `record`'s winner was measured with on `problem`
  itself, or None. The measured ratio holds for that config on that shape
  only; elsewhere the kernel's own choice (tuning entries, heuristic) for
  the actual shape runs, as it did when each bucket was measured. Tables
  folded before per-problem configs were stored carry one "config", the
  first problem's."""
  configs = record.get("configs")
  if isinstance(configs, dict):
    return configs.get(problem.describe())
  problems = record.get("problems", ())
  if problems and problems[0] == problem.describe():
    return record.get("config")
  return None


def _cta_tiles(problem: GemmProblem, config) -> int | None:
  """How many CTA tiles `config` cuts the problem into (None: not tiled)."""
  cta_m = getattr(config, "cta_tile_m", None)
  cta_n = getattr(config, "cta_tile_n", None)
  if not cta_m or not cta_n:
    return None
  return problem.output_tiles(cta_m, cta_n)
