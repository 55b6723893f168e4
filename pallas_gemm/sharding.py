"""Multi-device partitioning of `pallas_gemm_p`, the way XLA partitions a dot.

XLA's SPMD partitioner cannot see inside a Pallas kernel, so by default it
would replicate the call: every device gathers the whole of `a` and `b` and
computes the whole product. Here the primitive's lowering wraps the kernel in
`jax.experimental.custom_partitioning`, with

  * a Shardy sharding rule in einsum form ("b m k, b k n, b m n, n -> b m n"
    for the plain layout, K a reduction factor), which lets sharding
    propagate through the call like through a dot;
  * a `partition` callback that, given the shardings the partitioner settled
    on, picks one consistent layout and returns the per-device program.

Factors and what a sharded factor costs:

  batch, M, N   each device runs the kernel on its own block; no collective.
  K             each device forms a partial product of its K slice with the
                identity epilogue, in float32; the partials are summed with
                `psum` (or `psum_scatter` when the output is asked for sharded
                along M or N over the same mesh axes as K), and only then is
                the epilogue (alpha, beta·c, bias, activation) applied, once.

Several factors may be sharded at once (a 2-D data × model mesh). A mesh
axis can serve only one factor; when the operands disagree, a's sharding wins
for batch, M and K and b's for N, and the partitioner reshards the other
operand. A factor whose size is not a multiple of its shard count is
replicated instead, with a warning (once per pattern).

The K partials travel in float32 (twice the bytes of bf16 partials) so that
the sum is rounded once, like the single-device kernel's accumulator.

Single-device programs and bodies of `shard_map` (where the kernel already
sees local shapes) skip all of this: the lowering calls the kernel directly.

Types. Inside a `shard_map` (check_vma on, the default) operands invariant
over a manual axis are cast to varying before the bind, as for `jnp.dot`, so
the transpose sums a replicated weight's cotangent over devices; the output
varies over the union of the operands' axes. Under an explicit-axes mesh the
output type is sharded as `jnp.dot`'s would be. The kernel itself is always
traced on plain per-device types (`lower_per_device`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import warnings
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
# Private: the lowering context types, and the switches that make the kernel
# trace on plain per-device types. JAX has no public equivalents.
from jax._src import config as jax_config
from jax._src import core as jax_core
from jax._src import mesh as mesh_lib
from jax._src import sharding_impls
from jax.experimental.custom_partitioning import custom_partitioning
from jax.interpreters import mlir
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from pallas_gemm import registry
from pallas_gemm.devices import device_info
from pallas_gemm.problem import Epilogue, GemmProblem, apply_epilogue

_BATCH, _M, _N, _K = "b", "m", "n", "k"
_OUTPUT_FACTORS = (_BATCH, _M, _N)
_LOGGER = logging.getLogger(__name__)
_FACTOR_NAMES = {_BATCH: "batch", _M: "M", _N: "N", _K: "K"}


@dataclasses.dataclass(frozen=True)
class GemmCall:
  """The static part of one `pallas_gemm_p` equation, as the partitioner
  callbacks receive it. `run_kernel(*operands, platform=..., **params)` is
  the primitive's single-device lowering (its `_run_kernel`)."""

  run_kernel: Callable[..., Any]
  platform: str
  rank: int
  kernel: str
  config: Any
  transpose_a: bool
  transpose_b: bool
  precision: str
  epilogue: Epilogue
  out_dtype: str

  @property
  def params(self) -> dict[str, Any]:
    return dict(kernel=self.kernel, config=self.config,
                transpose_a=self.transpose_a, transpose_b=self.transpose_b,
                precision=self.precision, epilogue=self.epilogue,
                out_dtype=self.out_dtype)

  @property
  def out_factors(self) -> tuple[str, ...]:
    return ((_BATCH,) if self.rank == 3 else ()) + (_M, _N)

  @property
  def operand_factors(self) -> list[tuple[str, ...]]:
    """The factor of each dimension of each operand, in operand order."""
    batch = (_BATCH,) if self.rank == 3 else ()
    a = batch + ((_K, _M) if self.transpose_a else (_M, _K))
    b = batch + ((_N, _K) if self.transpose_b else (_K, _N))
    factors = [a, b]
    if self.epilogue.has_c:
      factors.append(self.out_factors)
    if self.epilogue.has_bias:
      factors.append((_N,))
    return factors

  def sharding_rule(self) -> str:
    operands = ", ".join(" ".join(f) for f in self.operand_factors)
    return f"{operands} -> {' '.join(self.out_factors)}"

  def run(self, *operands, **overrides):
    params = dict(self.params, **overrides)
    return self.run_kernel(*operands, platform=self.platform, **params)


def needs_partitioning(ctx) -> bool:
  """True when this lowering is for a multi-device SPMD program.

  False for one device, for fully manual bodies (`shard_map`), and for pmap:
  there the kernel already receives the local shapes.
  """
  axis_context = ctx.module_context.axis_context
  if isinstance(axis_context, sharding_impls.ShardingContext):
    return axis_context.num_devices > 1
  if isinstance(axis_context, sharding_impls.SPMDAxisContext):
    manual = set(axis_context.manual_axes)
    auto = set(axis_context.mesh.axis_names) - manual
    if not auto:
      return False
    if manual:
      # A partially manual shard_map: custom_partitioning cannot see the
      # manual axes' devices, so the kernel runs replicated over the others.
      _warn_once(("partially-manual",),
                 "pallas_gemm: inside a shard_map that leaves mesh axes "
                 f"{sorted(auto)} automatic, the kernel runs replicated over "
                 "those axes")
      return False
    return math.prod(axis_context.mesh.shape.values()) > 1
  return False


def match_varying_axes(operands):
  """Inside a `shard_map` (with its default `check_vma=True`): casts the
  operands that are invariant over some manual mesh axis to varying, as
  `jnp.dot` does. Without the cast, the transpose of a product with an
  invariant operand (a replicated weight) would skip the `psum` of its
  cotangent and return one device's partial gradient."""
  return list(jax_core.auto_insert_reshard(*operands))


def output_type(operands, out_shape, out_dtype, *, transpose_a: bool,
                transpose_b: bool) -> jax_core.ShapedArray:
  """The abstract output: shape and dtype, plus the type-level annotations
  when the operands carry them. Inside a `shard_map` the output varies over
  every manual axis an operand varies over; under an explicit-axes mesh it
  is sharded as `jnp.dot`'s output would be (batch and M as in a, N as in b,
  unless N would reuse an axis of M; a sharded K leaves the type
  replicated, the partitioner still reduces it)."""
  dtype = jnp.dtype(out_dtype)
  varying = frozenset()
  if jax_config._check_vma.value:  # noqa: SLF001
    varying = frozenset().union(*(x.mat.varying for x in operands))
  spec = _explicit_output_spec(operands[0], operands[1], transpose_a,
                               transpose_b)
  if not varying and spec is None:
    return jax_core.ShapedArray(out_shape, dtype)
  mesh = operands[0].sharding.mesh
  if mesh.empty:
    mesh = mesh_lib.get_abstract_mesh()
  return jax_core.ShapedArray(
      out_shape, dtype,
      sharding=NamedSharding(mesh, spec or PartitionSpec()),
      manual_axis_type=jax_core.ManualAxisType(varying=varying))


def _explicit_output_spec(a, b, transpose_a, transpose_b):
  def entries(aval):
    spec = tuple(aval.sharding.spec)
    return spec + (None,) * (aval.ndim - len(spec))

  if a.sharding.mesh.empty and b.sharding.mesh.empty:
    return None
  a_spec, b_spec = entries(a), entries(b)
  if not any(a_spec) and not any(b_spec):
    return None
  m_dim, k_dim_a = (-1, -2) if transpose_a else (-2, -1)
  n_dim, k_dim_b = (-2, -1) if transpose_b else (-1, -2)
  if a_spec[k_dim_a] is not None or b_spec[k_dim_b] is not None:
    return None
  m_entry, n_entry = a_spec[m_dim], b_spec[n_dim]
  batch = (a_spec[0],) if a.ndim == 3 else ()
  if set(_axes_of(n_entry)) & (set(_axes_of(m_entry)) |
                               set(_axes_of(batch[0] if batch else None))):
    n_entry = None
  return PartitionSpec(*batch, m_entry, n_entry)


def lower_per_device(ctx, impl: Callable[..., Any], *args):
  """`mlir.lower_fun(impl)(ctx, *args)`, traced on plain array types.

  The kernel is per-device code. The sharding and manual-axis annotations
  that operand types carry under an explicit-axes mesh or inside a
  `shard_map` describe the surrounding program; left on, Pallas refuses to
  slice the refs (and asks for varying-axis annotations on its outputs).
  """
  plain = [jax_core.ShapedArray(aval.shape, aval.dtype, weak_type=aval.weak_type)
           for aval in ctx.avals_in]
  ctx = ctx.replace(avals_in=plain)
  with jax_config._check_vma(False), mesh_lib.use_abstract_mesh(  # noqa: SLF001
      mesh_lib.empty_abstract_mesh):
    return mlir.lower_fun(impl, multiple_results=False)(ctx, *args)


def partitioned_kernel(call: GemmCall) -> Callable[..., Any]:
  """The function the lowering traces instead of `call.run` when the
  program is partitioned."""
  def run(*operands):
    return _partitioned_gemm(call, *operands)
  return run


# ------------------------------------------------------- factor assignment ---


def _axes_of(entry) -> tuple[str, ...]:
  if entry is None:
    return ()
  if isinstance(entry, str):
    return (entry,)
  return tuple(entry)


def _spec_by_factor(sharding, factors, mesh_shape) -> dict[str, tuple[str, ...]]:
  """{factor: mesh axes} for one array; axes of size 1 are dropped."""
  spec = tuple(sharding.spec) + (None,) * (len(factors) - len(sharding.spec))
  return {factor: tuple(ax for ax in _axes_of(entry) if mesh_shape[ax] > 1)
          for factor, entry in zip(factors, spec)}


def _to_spec_entry(axes: tuple[str, ...]):
  if not axes:
    return None
  return axes[0] if len(axes) == 1 else axes


@dataclasses.dataclass(frozen=True)
class _Plan:
  """One consistent layout: mesh axes per factor, and how K is reduced."""

  axes: dict[str, tuple[str, ...]]
  # The output factor (M or N) that a K reduction scatters over, or None for
  # an all-reduce. The output then carries K's axes after its own.
  scatter: str | None = None

  def out_axes(self, factor: str) -> tuple[str, ...]:
    extra = self.axes[_K] if factor == self.scatter else ()
    return self.axes[factor] + extra

  def spec(self, factors, *, output_layout: bool) -> PartitionSpec:
    get = self.out_axes if output_layout else self.axes.__getitem__
    return PartitionSpec(*(_to_spec_entry(get(f)) for f in factors))


def _factor_sizes(call: GemmCall, shapes) -> dict[str, int]:
  sizes = {}
  for factors, shape in zip(call.operand_factors, shapes):
    for factor, size in zip(factors, shape):
      sizes.setdefault(factor, size)
  sizes.setdefault(_BATCH, 1)
  return sizes


def _plan(call: GemmCall, mesh: Mesh, arg_shapes,
          result_sharding: NamedSharding | None) -> _Plan:
  mesh_shape = dict(mesh.shape)
  factor_lists = call.operand_factors
  operand_specs = [_spec_by_factor(x.sharding, f, mesh_shape)
                   for x, f in zip(arg_shapes, factor_lists)]
  out_spec = _spec_by_factor(
      result_sharding or NamedSharding(mesh, PartitionSpec()),
      call.out_factors, mesh_shape)
  a_spec, b_spec = operand_specs[0], operand_specs[1]
  rest_specs = operand_specs[2:]  # c (output layout) and/or bias (n,)

  used: set[str] = set()
  axes = {f: () for f in (_BATCH, _M, _N, _K)}

  def take(factor, candidates):
    if axes[factor]:
      return
    for candidate in candidates:
      free = tuple(ax for ax in candidate.get(factor, ()) if ax not in used)
      if free:
        axes[factor] = free
        used.update(free)
        return

  # The operands' own shardings first: keeping them avoids moving a and b,
  # the large arrays. Then the output's and c's, which a replicated operand
  # can follow by slicing locally, at no communication cost.
  take(_BATCH, [a_spec, b_spec])
  take(_M, [a_spec])
  take(_N, [b_spec])
  take(_K, [a_spec, b_spec])
  for factor in _OUTPUT_FACTORS:
    take(factor, [out_spec] + rest_specs)

  sizes = _factor_sizes(call, [x.shape for x in arg_shapes])
  uneven = set()
  for factor, factor_axes in axes.items():
    shards = math.prod(mesh_shape[ax] for ax in factor_axes)
    if sizes[factor] % shards:
      _warn_once(("uneven", factor, sizes[factor], factor_axes),
                 f"pallas_gemm: {_FACTOR_NAMES[factor]}={sizes[factor]} is "
                 f"not a multiple of its {shards} shards over mesh axes "
                 f"{factor_axes}; that dimension is replicated instead")
      axes[factor] = ()
      uneven.add(factor)

  # Two factors that want the same mesh axis (say M of a and N of b) cannot
  # both keep it: one operand is resharded, as jnp.dot would reshard it. That
  # is ordinary, so it is logged rather than warned about.
  for operand, spec in (("a", a_spec), ("b", b_spec)):
    for factor, own in spec.items():
      if own and own != axes[factor] and factor not in uneven:
        _LOGGER.debug("pallas_gemm: %s is resharded along %s from mesh axes "
                      "%s to %s", operand, _FACTOR_NAMES[factor], own,
                      axes[factor] or "replicated")

  scatter = None
  if axes[_K]:
    for factor in (_M, _N):
      wanted = axes[factor] + axes[_K]
      shards = math.prod(mesh_shape[ax] for ax in wanted)
      others_match = all(out_spec[f] == axes[f]
                         for f in call.out_factors if f != factor)
      if (out_spec[factor] == wanted and others_match
          and sizes[factor] % shards == 0):
        scatter = factor
        break
  return _Plan(axes, scatter)


# ------------------------------------------------------ partition callbacks ---


_WARNED: set = set()


def _warn_once(key, message):
  if key not in _WARNED:
    _WARNED.add(key)
    warnings.warn(message, RuntimeWarning, stacklevel=3)


def _replicated_fallback(call: GemmCall, arg_shapes, reason: str):
  """Everything replicated on a one-axis mesh of the same devices: always
  correct, costs gathers."""
  _warn_once(("replicated", reason),
             f"pallas_gemm: {reason}; the GEMM runs replicated on every "
             "device")
  devices = arg_shapes[0].sharding._device_assignment  # noqa: SLF001
  mesh = Mesh(np.asarray(devices), ("pallas_gemm_replicas",))
  replicated = NamedSharding(mesh, PartitionSpec())
  return (mesh, lambda *operands: call.run(*operands), replicated,
          tuple(replicated for _ in arg_shapes))


def _local_params(call: GemmCall, local_shapes, dtypes, *, epilogue,
                  out_dtype) -> dict[str, Any]:
  """The kernel and config for one device's block.

  The requested kernel keeps its config when it supports the smaller problem
  (as `rebind` does for derived products); otherwise the automatic order
  chooses, so a shard never fails where the whole problem would not.
  """
  a_shape, b_shape = local_shapes[0], local_shapes[1]
  ta, tb = call.transpose_a, call.transpose_b
  m = a_shape[-1] if ta else a_shape[-2]
  k = a_shape[-2] if ta else a_shape[-1]
  n = b_shape[-2] if tb else b_shape[-1]
  problem = GemmProblem(
      batch=a_shape[0] if call.rank == 3 else 1, m=m, n=n, k=k,
      in_dtype=jnp.dtype(dtypes[0]).name, out_dtype=out_dtype,
      transpose_a=ta, transpose_b=tb, precision=call.precision,
      epilogue=epilogue,
      c_dtype=jnp.dtype(dtypes[2]).name if epilogue.has_c else None)
  device = device_info()
  kernel, config = call.kernel, call.config
  if registry.why_unsupported(registry.get_kernel(kernel), problem,
                              device) is not None:
    kernel, config = None, None
  from pallas_gemm import dispatch
  resolution = dispatch.resolve(problem, device, kernel, config)
  return dict(kernel=resolution.kernel, config=resolution.config,
              epilogue=epilogue, out_dtype=out_dtype)


def _partition(call: GemmCall, mesh: Mesh, arg_shapes, result_shape):
  if not all(isinstance(x.sharding, NamedSharding) for x in arg_shapes) or (
      not isinstance(result_shape.sharding, NamedSharding)):
    return _replicated_fallback(
        call, arg_shapes, "the operand shardings are not expressible on a "
        "named mesh")
  plan = _plan(call, mesh, arg_shapes, result_shape.sharding)
  mesh_shape = dict(mesh.shape)

  in_shardings = []
  for index, factors in enumerate(call.operand_factors):
    # c and bias live in the output's layout, K scatter axes included.
    output_layout = index >= 2
    in_shardings.append(NamedSharding(
        mesh, plan.spec(factors, output_layout=output_layout)))
  out_sharding = NamedSharding(
      mesh, plan.spec(call.out_factors, output_layout=True))

  def local_shape(shape, factors, output_layout):
    get = plan.out_axes if output_layout else plan.axes.__getitem__
    return tuple(size // math.prod(mesh_shape[ax] for ax in get(f))
                 for size, f in zip(shape, factors))

  local_shapes = [local_shape(x.shape, f, i >= 2)
                  for i, (x, f) in enumerate(zip(arg_shapes,
                                                 call.operand_factors))]
  dtypes = [x.dtype for x in arg_shapes]
  k_axes = plan.axes[_K]

  if not k_axes:
    params = _local_params(call, local_shapes, dtypes,
                           epilogue=call.epilogue, out_dtype=call.out_dtype)

    def per_device(*operands):
      return call.run(*operands, **params)
  else:
    partial_params = _local_params(call, local_shapes[:2], dtypes,
                                   epilogue=Epilogue(), out_dtype="float32")
    scatter_dim = (None if plan.scatter is None
                   else call.out_factors.index(plan.scatter))
    epilogue = call.epilogue

    def per_device(a, b, *extras):
      partial = call.run(a, b, **partial_params)
      if scatter_dim is None:
        acc = jax.lax.psum(partial, k_axes)
      else:
        acc = jax.lax.psum_scatter(partial, k_axes,
                                   scatter_dimension=scatter_dim, tiled=True)
      extras = list(extras)
      c = extras.pop(0) if epilogue.has_c else None
      bias = extras.pop(0) if epilogue.has_bias else None
      return apply_epilogue(acc, epilogue, c, bias).astype(call.out_dtype)

  return mesh, per_device, out_sharding, tuple(in_shardings)


def _infer_sharding_from_operands(call: GemmCall, mesh, arg_shapes,
                                  result_shape):
  """For the GSPMD propagation path (Shardy off): the output layout the
  partition callback would choose for these operands."""
  del result_shape
  if not all(isinstance(x.sharding, NamedSharding) for x in arg_shapes):
    devices = arg_shapes[0].sharding._device_assignment  # noqa: SLF001
    return NamedSharding(Mesh(np.asarray(devices), ("pallas_gemm_replicas",)),
                         PartitionSpec())
  plan = _plan(call, mesh, arg_shapes, None)
  return NamedSharding(mesh, plan.spec(call.out_factors, output_layout=True))


def _sharding_rule(call: GemmCall, mesh, operand_types, result_types):
  del mesh, operand_types, result_types
  return call.sharding_rule(), {"reduction_factors": (_K,)}


def _run_unpartitioned(call: GemmCall, *operands):
  return call.run(*operands)


_partitioned_gemm = custom_partitioning(_run_unpartitioned,
                                        static_argnums=(0,))
_partitioned_gemm.def_partition(
    partition=_partition,
    infer_sharding_from_operands=_infer_sharding_from_operands,
    sharding_rule=_sharding_rule,
)
