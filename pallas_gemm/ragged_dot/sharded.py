"""Expert parallelism: the experts' weights sharded over a mesh axis.

Each device holds `groups / devices` consecutive experts and computes, for
every token row, its own experts' products (`group_offset` names its first
expert; rows of other experts come out zero). A `psum` over the expert axis
then gives every device the full output: each row belongs to exactly one
expert, so exactly one device contributes it.

The tokens are replicated here. A model that shards them too routes rows to
their expert's device (an all-to-all) and calls `ragged_dot` with the same
`group_offset` inside its own `shard_map`; this helper is that recipe's core.
"""

from __future__ import annotations

import jax
from jax.sharding import Mesh, PartitionSpec

from pallas_gemm.ragged_dot.api import ragged_dot


def sharded_ragged_dot(lhs, rhs, group_sizes, *, mesh: Mesh, expert_axis: str,
                       **ragged_dot_kwargs):
  """`ragged_dot(lhs, rhs, group_sizes, ...)` with rhs (groups, k, n) split
  along groups over `mesh`'s `expert_axis`; lhs and group_sizes replicated.
  Returns the full (m, n) output, replicated."""
  if "group_offset" in ragged_dot_kwargs:
    raise ValueError("group_offset is set by sharded_ragged_dot itself")
  if expert_axis not in mesh.shape:
    raise ValueError(f"expert_axis={expert_axis!r} is not an axis of the mesh "
                     f"{dict(mesh.shape)}")
  devices = mesh.shape[expert_axis]
  groups = rhs.shape[0]
  if groups % devices:
    raise ValueError(f"rhs.shape={rhs.shape}: {groups} groups do not split "
                     f"evenly over {devices} devices of axis {expert_axis!r}")
  local_groups = groups // devices

  def per_device(lhs, local_rhs, group_sizes):
    first = jax.lax.axis_index(expert_axis) * local_groups
    out = ragged_dot(lhs, local_rhs, group_sizes, group_offset=first,
                     **ragged_dot_kwargs)
    return jax.lax.psum(out, expert_axis)

  return jax.shard_map(
      per_device, mesh=mesh,
      in_specs=(PartitionSpec(), PartitionSpec(expert_axis), PartitionSpec()),
      out_specs=PartitionSpec())(lhs, rhs, group_sizes)
