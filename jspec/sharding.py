"""Logical-axis sharding: every array names its axes once; one rules table maps them to a mesh.

A mesh has two axes: `dp` (data: the batch) and `tp` (tensor parallel: attention heads, KV heads,
MLP columns, vocabulary; Megatron's split, so a layer needs two all-reduces of [B, T, E] and a
decode step's logits stay sharded over the vocabulary: greedy picks and sampling reduce them
shard by shard). `Placement` carries a mesh and its rules as one static, hashable value: it puts
params, caches and inputs on the mesh and pins shardings inside the jitted engines, which XLA's
SPMD partitioner then turns into one program per device.

KV heads fewer than `tp`: where tp is a multiple of them, `jspec.model.load(..., mesh=)` repeats
each KV head tp / K times (`llama.repeat_kv_heads`: the same numbers), so every device holds the
one KV head its query heads read and the cache still splits tp ways. Otherwise (tp not a multiple
of K, or a cfg passed to the pure functions as it is) the K/V projections and the cache are
replicated over tp: every device holds every KV head. Sharding the cache's other axes instead
(sequence, head_dim) would put a collective inside every attention; replicating costs memory (the
cache divided by dp only), never a collective.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import re
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("dp", "tp")


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
  """Logical axis → mesh axis (None: replicated). Default: tensor parallel over `tp`, data over
  `dp`."""

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


def parse_mesh(text: str) -> dict[str, int]:
  """"dp=2,tp=4" → {"dp": 2, "tp": 4} (an axis left out has size 1)."""
  sizes = {"dp": 1, "tp": 1}
  seen = set()
  for part in [p.strip() for p in str(text).split(",") if p.strip()]:
    m = re.fullmatch(r"(\w+)\s*=\s*(\d+)", part)
    if not m or m.group(1) not in sizes or m.group(1) in seen or int(m.group(2)) < 1:
      raise ValueError(f"mesh {text!r}: expected axes dp and/or tp with positive sizes, e.g. "
                       f"'dp=2,tp=4' or 'tp=8' (got {part!r})")
    seen.add(m.group(1))
    sizes[m.group(1)] = int(m.group(2))
  if not seen:
    raise ValueError(f"mesh {text!r} names no axis: e.g. 'dp=2,tp=4'")
  return sizes


def make_mesh(dp: int = 1, tp: int = 1, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A ("dp", "tp") mesh over the first dp * tp devices (default: jax.devices(), every process's
  devices under jax.distributed). `tp` runs along consecutive devices: on a GPU host or TPU slice
  those are the ones joined by the fastest links, where the per-layer all-reduces go."""
  devices = list(jax.devices() if devices is None else devices)
  if dp * tp > len(devices):
    raise ValueError(f"mesh dp={dp} x tp={tp} needs {dp * tp} devices, but {len(devices)} are "
                     f"visible ({devices[0].platform}). Fix: a smaller mesh, or on CPU set "
                     f"XLA_FLAGS=--xla_force_host_platform_device_count={dp * tp} before JAX "
                     f"starts.")
  return Mesh(np.array(devices[:dp * tp]).reshape(dp, tp), MESH_AXES)


def mesh_from(spec: str | Mesh | None) -> Mesh | None:
  """A Mesh from "dp=2,tp=4", a Mesh (as is) or None (no mesh)."""
  if spec is None or isinstance(spec, Mesh):
    return spec
  return make_mesh(**parse_mesh(spec))


def default_mesh(batch: int) -> Mesh | None:
  """All local devices on `dp` when the batch divides over them; None (one device) otherwise."""
  n = jax.local_device_count()
  if n > 1 and batch % n == 0 and jax.process_count() == 1:
    return make_mesh(dp=n)
  return None


def _axis_size(mesh: Mesh, name: str) -> int:
  return mesh.shape[name] if name in mesh.axis_names else 1


@dataclasses.dataclass(frozen=True)
class Placement:
  """A mesh and the rules for one model on it: static (hashable), so engines take it as a static
  argument and pin their caches with it."""

  mesh: Mesh
  rules: ShardingRules = ShardingRules()

  @property
  def dp(self) -> int:
    return _axis_size(self.mesh, "dp")

  @property
  def tp(self) -> int:
    return _axis_size(self.mesh, "tp")

  def put(self, tree: Any, layout: Any) -> Any:
    return jax.device_put(tree, shardings(layout, self.mesh, self.rules))

  def constrain(self, tree: Any, layout: Any) -> Any:
    """Inside jit: pin `tree`'s shardings to its layout."""
    return jax.lax.with_sharding_constraint(tree, shardings(layout, self.mesh, self.rules))

  def batch_sharding(self, ndim: int) -> NamedSharding:
    """Axis 0 over the batch rule, the rest replicated."""
    return NamedSharding(self.mesh, self.rules.spec(("batch",) + (None,) * (ndim - 1), self.mesh))

  def put_batch(self, x: Any) -> jax.Array:
    """A host array whose axis 0 is the batch, placed on the mesh (the same value on every
    process under jax.distributed)."""
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, self.batch_sharding(x.ndim), lambda i: x[i])

  def replicated(self, tree: Any) -> Any:
    """Inside jit: every leaf whole on every device (outputs every process can read)."""
    return jax.lax.with_sharding_constraint(tree, NamedSharding(self.mesh, PartitionSpec()))

  def check_batch(self, batch: int) -> None:
    if batch % self.dp:
      raise ValueError(f"a batch of {batch} prompts does not divide over the mesh's dp={self.dp} "
                       f"devices. Fix: a batch that is a multiple of {self.dp} (pad with copies of "
                       f"a prompt and drop their outputs), or a mesh with dp dividing {batch}.")


def to_host(x: jax.Array) -> np.ndarray:
  """x's whole value as a numpy array, also where x spans devices of other processes
  (jax.distributed: np.asarray refuses those; the value is gathered from every process)."""
  if getattr(x, "is_fully_addressable", True):
    return np.asarray(x)
  from jax.experimental import multihost_utils
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def kv_repeats(cfg, mesh: Mesh) -> int:
  """How many times `llama.repeat_kv_heads` should repeat the KV heads for `mesh`: tp / K where tp
  is a multiple of K > 0 heads fewer than tp, else 1."""
  tp, k = _axis_size(mesh, "tp"), cfg.num_kv_heads
  return tp // k if tp > k and tp % k == 0 and cfg.num_heads % tp == 0 else 1


def model_placement(cfg, mesh: Mesh, rules: ShardingRules | None = None) -> Placement:
  """The placement of a model with config `cfg` on `mesh`, checked: tp must divide the query
  heads, the MLP width and the vocabulary; KV heads it does not divide are replicated (module
  docstring)."""
  unknown = [a for a in mesh.axis_names if a not in MESH_AXES]
  if unknown:
    raise ValueError(f"mesh axes {mesh.axis_names}: jspec shards over {MESH_AXES}; name the mesh "
                     f"axes so (jspec.sharding.make_mesh)")
  rules = rules or ShardingRules()
  tp = _axis_size(mesh, "tp")
  if tp > 1:
    for what, n, rule in (("attention heads", cfg.num_heads, rules.heads),
                          ("MLP width", cfg.intermediate_size, rules.mlp),
                          ("vocabulary", cfg.vocab_size, rules.vocab)):
      if rule == "tp" and n % tp:
        fits = [d for d in range(1, min(n, 64) + 1) if n % d == 0]
        raise ValueError(f"tp={tp} does not divide the model's {what} ({n}): tensor parallelism "
                         f"splits them evenly. Fix: tp in {fits}, the other devices on dp.")
    if rules.kv_heads == "tp" and cfg.num_kv_heads % tp:
      rules = dataclasses.replace(rules, kv_heads=None)
  return Placement(mesh, rules)


# The placement an engine is being traced under (set from its static `placement` argument, so a
# jit cache entry and the value read here always agree). Code far from the engine's signature
# (sampling's top-k/top-p) reads it to line its work up with the vocabulary's shards.
_TRACING: contextvars.ContextVar[Placement | None] = contextvars.ContextVar("placement", default=None)


def traced_under_placement(engine: Callable) -> Callable:
  """Decorator for an engine taking `placement=` (static): its body is traced with that placement
  active (`vocab_split`)."""

  @functools.wraps(engine)
  def run(*args, placement: Placement | None = None, **kwargs):
    token = _TRACING.set(placement)
    try:
      return engine(*args, placement=placement, **kwargs)
    finally:
      _TRACING.reset(token)

  return run


@dataclasses.dataclass(frozen=True)
class VocabSplit:
  """How the engine being traced splits its logits [B, ..., V]: the vocabulary over mesh axis
  `vocab` (`shards` ways), the batch over `batch` (None: not split)."""

  mesh: Mesh
  vocab: str
  shards: int
  batch: str | None


def rows_split() -> bool:
  """Whether the engine being traced (`traced_under_placement`) splits the batch over a mesh axis
  of more than one device: then each device should write its own rows of the cache."""
  placement = _TRACING.get()
  if placement is None:
    return False
  mesh, rules = placement.mesh, placement.rules
  return rules.batch in mesh.axis_names and mesh.shape[rules.batch] > 1


def get_rows(x: jax.Array, idx: jax.Array, axis: int = 0) -> jax.Array:
  """Each row's own entries: x[..., b, idx[b, ...]] for the batch axis `axis` of x (the axis after
  it indexed; idx [B, ...]) -> x.shape[:axis] + idx.shape + x.shape[axis + 2:]. Where the engine
  being traced splits the batch (`rows_split`), a vmap over the rows: the gather names the batch
  as a batching dimension and each device reads its own rows (explicit row indices made XLA's
  partitioner all-gather the indices of a tree round's scatters and gathers, a dozen a round
  under dp=8); otherwise one gather over explicit row indices."""
  lead = (slice(None),) * axis
  if rows_split():
    return jax.vmap(lambda r, i: r[lead + (i,)], in_axes=(axis, 0), out_axes=axis)(x, idx)
  rows = jnp.arange(x.shape[axis]).reshape((-1,) + (1,) * (idx.ndim - 1))
  return x[lead + (rows, idx)]


def set_rows(x: jax.Array, idx: jax.Array, value: Any, axis: int = 0,
             mode: str | None = None) -> jax.Array:
  """x with each row's entries at idx set to value (shaped as `get_rows(x, idx, axis)`, or
  broadcast to it): x[..., b, idx[b, ...]] = value[..., b, ...]; the vmap under a batch split and
  the explicit rows otherwise, as `get_rows`. mode: jnp's scatter mode ("drop": indices past the
  axis are left out)."""
  lead = (slice(None),) * axis
  value = jnp.broadcast_to(jnp.asarray(value, x.dtype),
                           x.shape[:axis] + idx.shape + x.shape[axis + 2:])
  if rows_split():
    return jax.vmap(lambda r, i, v: r.at[lead + (i,)].set(v, mode=mode),
                    in_axes=(axis, 0, axis), out_axes=axis)(x, idx, value)
  rows = jnp.arange(x.shape[axis]).reshape((-1,) + (1,) * (idx.ndim - 1))
  return x.at[lead + (rows, idx)].set(value, mode=mode)


def on_own_shards(fn: Callable, args: tuple, layouts: tuple, out_layouts: Any) -> Any:
  """fn(*args) where each device runs fn on its own shards of the arguments, when the engine
  being traced (`traced_under_placement`) runs on a mesh: a `shard_map` whose specs come from the
  logical axes (`layouts`, `out_layouts`: ArraySpec pytrees matching args and fn's output). For
  work that is independent across the split axes (the batch; KV heads), which XLA's partitioner
  would otherwise carry out on gathered arrays where it cannot see that (top_k, scatters with
  explicit row indices). Off a mesh, fn(*args)."""
  placement = _TRACING.get()
  if placement is None or placement.mesh.size == 1:
    return fn(*args)
  def spec(a: ArraySpec) -> PartitionSpec:
    # An axis the mesh axis does not divide stays whole (a model drafter's fewer KV heads under
    # the target's rules, as `model_placement` replicates KV heads that tp does not divide).
    names = placement.rules.spec(a.axes, placement.mesh)
    return PartitionSpec(*(name if name is None or size % placement.mesh.shape[name] == 0
                           else None for name, size in zip(names, a.shape)))

  specs = lambda tree: jax.tree.map(spec, tree, is_leaf=is_spec)
  in_specs, out_specs = specs(tuple(layouts)), specs(out_layouts)
  # Manual over the mesh axes the layouts split; XLA keeps the others (e.g. tp where the KV heads
  # are not split over it: it may still split the cache there, and pinning it whole would gather
  # the cache every step).
  used = {name for spec in jax.tree.leaves((in_specs, out_specs),
                                           is_leaf=lambda x: isinstance(x, PartitionSpec))
          for name in spec if name is not None}
  if not used:
    return fn(*args)
  return jax.shard_map(fn, mesh=placement.mesh, in_specs=in_specs, out_specs=out_specs,
                       axis_names=frozenset(used), check_vma=False)(*args)


def top_k_by_rows(x: Any, k: int, indices: bool = True,
                  over_vocab: bool = False) -> tuple[Any, Any]:
  """jax.lax.top_k(x, k) of x [B, ..., N] (the indices None unless `indices`), each device on its
  own rows where the engine being traced splits the batch, and, `over_vocab` (N is the
  vocabulary), on its own shard of N where the engine splits the vocabulary (`vocab_split`): there
  only each shard's k best values (and indices) move. (Any other axis N, e.g. a tree's nodes,
  stays whole: taken as split only because tp divided it, it would be moved to be split.)
  XLA's partitioner gathers every row to run a top_k (a tree round under dp=8 gathered the
  drafter's [B, W, V] log-probs at each depth) and whole rows of a split axis (under tp=4 a probing
  tree's [B/dp, W, V]). The same values and indices as one device: a shard's candidates come in
  index order, so ties still go to the lower index."""
  split = vocab_split(x.shape[-1]) if over_vocab and x.ndim > 1 else None
  if split is None:
    if x.ndim == 1:
      values, idx = jax.lax.top_k(x, k)
      return values, idx if indices else None
    rows = ArraySpec(x.shape, ("batch",) + (None,) * (x.ndim - 1))
    out = ArraySpec(x.shape[:-1] + (k,), rows.axes)
    values, idx = on_own_shards(lambda a: tuple(jax.lax.top_k(a, k)), (x,), (rows,), (out, out))
    return values, idx if indices else None
  batch = split.batch if x.shape[0] % split.mesh.shape.get(split.batch, 1) == 0 else None
  lead = (batch,) + (None,) * (x.ndim - 2)

  def on_shard(block: jax.Array):  # [b, ..., N/S], one device's shard
    values, idx = jax.lax.top_k(block, min(k, block.shape[-1]))  # [b, ..., k']
    gather = lambda a: jax.lax.all_gather(a, split.vocab, axis=a.ndim - 1, tiled=True)
    best, at = jax.lax.top_k(gather(values), k)  # the same on every shard
    if not indices:
      return best, None
    idx = idx + jax.lax.axis_index(split.vocab) * block.shape[-1]
    return best, jnp.take_along_axis(gather(idx), at, axis=-1)

  out = PartitionSpec(*lead, None)
  return jax.shard_map(on_shard, mesh=split.mesh, in_specs=PartitionSpec(*lead, split.vocab),
                       out_specs=(out, out if indices else None), check_vma=False)(x)


def vocab_split(vocab_size: int) -> VocabSplit | None:
  """The vocabulary split of the engine being traced (`traced_under_placement`); None off a mesh,
  where the vocabulary is not split, or where the split does not divide `vocab_size`."""
  placement = _TRACING.get()
  if placement is None:
    return None
  mesh, rules = placement.mesh, placement.rules
  if rules.vocab not in mesh.axis_names or mesh.shape[rules.vocab] == 1:
    return None
  if vocab_size % mesh.shape[rules.vocab]:
    return None
  batch = rules.batch if rules.batch in mesh.axis_names else None
  return VocabSplit(mesh, rules.vocab, mesh.shape[rules.vocab], batch)
