"""Logical-axis sharding: every array names its axes once; one rules table maps them to a mesh."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec


@dataclasses.dataclass(frozen=True)
class ArraySpec:
  """Shape and logical axis names of one array (a leaf of a layout pytree)."""

  shape: tuple[int, ...]
  axes: tuple[str | None, ...]
  init: str = "normal"  # "normal" | "ones" | "zeros"

  def __post_init__(self):
    assert len(self.shape) == len(self.axes), (self.shape, self.axes)


@dataclasses.dataclass(frozen=True)
class ShardingRules:
  """Logical axis → mesh axis (None: replicated). Default: tensor parallel over `tp`, data over `dp`."""

  batch: str | None = "dp"
  layers: str | None = None
  embed: str | None = None
  vocab: str | None = "tp"
  heads: str | None = "tp"
  kv_heads: str | None = "tp"
  head_dim: str | None = None
  mlp: str | None = "tp"
  seq: str | None = None

  def spec(self, axes: tuple[str | None, ...], mesh: Mesh) -> PartitionSpec:
    """PartitionSpec for logical axes, dropping mesh axes the mesh does not have."""
    names = []
    for axis in axes:
      mesh_axis = getattr(self, axis) if axis is not None else None
      names.append(mesh_axis if mesh_axis in mesh.axis_names else None)
    return PartitionSpec(*names)


def is_spec(x: Any) -> bool:
  return isinstance(x, ArraySpec)


def shardings(layout: Any, mesh: Mesh, rules: ShardingRules = ShardingRules()) -> Any:
  """NamedSharding pytree matching a layout pytree of ArraySpec leaves."""
  return jax.tree.map(lambda s: NamedSharding(mesh, rules.spec(s.axes, mesh)), layout,
                      is_leaf=is_spec)


def shard(tree: Any, layout: Any, mesh: Mesh, rules: ShardingRules = ShardingRules()) -> Any:
  """Place a params/cache pytree on a mesh according to its layout."""
  return jax.device_put(tree, shardings(layout, mesh, rules))
