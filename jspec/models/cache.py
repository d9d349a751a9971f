"""Static-shape KV cache with per-row lengths.

`lengths[b]` counts the committed entries of row b. A forward writes its T new entries at slots
`lengths[b] .. lengths[b] + T - 1` without committing them; the caller commits what it keeps with
`commit`. Rolling back rejected speculative tokens is therefore free: commit fewer.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jspec.models.config import Config
from jspec.sharding import ArraySpec, get_rows, set_rows

Array = jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
  k: jax.Array  # [L, B, S, K, D]
  v: jax.Array  # [L, B, S, K, D]
  lengths: jax.Array  # [B] int32, committed entries per row
  # Under a KV budget whose policy scores slots by attention (jspec.kv): attention mass each slot
  # received, accumulated by the forwards given `mass_weights`; moves with its slot on eviction.
  mass: jax.Array | None = None  # [L, B, S, K] float32
  # Under a KV budget: each slot's RoPE position, -1 where eviction has not recorded one yet
  # (jspec.kv.evict records the entries committed since the last eviction). Eviction moves the
  # newest entries into the slots it frees, so slot order is not position order there.
  positions: jax.Array | None = None  # [L, B, S, K] int32

  @property
  def size(self) -> int:
    """Slots per row (static)."""
    return self.k.shape[2]

  @property
  def batch(self) -> int:
    return self.k.shape[1]

  @classmethod
  def init(cls, cfg: Config, batch: int, size: int, dtype=jnp.float32) -> "KVCache":
    shape = (cfg.num_layers, batch, size, cfg.num_kv_heads, cfg.head_dim)
    return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
               lengths=jnp.zeros((batch,), jnp.int32))

  def committed(self) -> jax.Array:
    """[B, S] bool: the slots holding committed entries."""
    return jnp.arange(self.size)[None, :] < self.lengths[:, None]

  def commit(self, n: jax.Array | int) -> "KVCache":
    """Keep `n` ([B] or scalar) more of the entries the last forward wrote."""
    return dataclasses.replace(self, lengths=self.lengths + jnp.asarray(n, jnp.int32))

  def with_lengths(self, lengths: jax.Array) -> "KVCache":
    return dataclasses.replace(self, lengths=jnp.asarray(lengths, jnp.int32))

  def layout(self) -> "KVCache":
    """Logical axes of this cache's arrays (jspec.sharding)."""
    kv = ArraySpec(self.k.shape, ("layers", "batch", "seq", "kv_heads", "head_dim"), "zeros")
    mass = None if self.mass is None else ArraySpec(
        self.mass.shape, ("layers", "batch", "seq", "kv_heads") + (None,) * (self.mass.ndim - 4))
    positions = None if self.positions is None else ArraySpec(
        self.positions.shape, ("layers", "batch", "seq", "kv_heads"))
    return KVCache(k=kv, v=kv, lengths=ArraySpec(self.lengths.shape, ("batch",)), mass=mass,
                   positions=positions)

  def placed(self, placement) -> "KVCache":
    """Inside jit: this cache pinned to `placement` (a jspec.sharding.Placement; None: as is).
    Engines pin the caches they create, so XLA partitions the loop around them, not around
    whatever sharding it would infer."""
    return self if placement is None else placement.constrain(self, self.layout())


def cache_layout(cfg: Config, batch: int, size: int) -> KVCache:
  """Logical axes of the cache arrays, for sharding (see jspec.sharding)."""
  return jax.eval_shape(lambda: KVCache.init(cfg, batch, size)).layout()


def move_kv(cache: KVCache, base: Array, src: Array, n: Array) -> KVCache:
  """Compact KV entries in every layer: slot base + j <- slot base + src[:, j] for j < n.

  base [B], src [B, D] slot offsets (-1: leave slot base + j alone), n [B]. Everything is gathered
  before anything is written, so overlapping moves are safe; the [L, B, S, K, D] arrays are
  updated in place inside a loop. Used for the accepted path of a token tree (target and draft).
  Attention mass recorded for the slots (cache.mass [L, B, S, K, ...], attention-score KV
  policies) moves with them; KV-budget positions need not (slots past the committed entries have
  none recorded).
  """
  D = src.shape[1]
  j = jnp.arange(D, dtype=jnp.int32)
  src_slot = base[:, None] + jnp.maximum(src, 0)  # [B, D]
  dst_slot = jnp.where((j < n[:, None]) & (src >= 0), base[:, None] + j, cache.size)  # [B, D]
  move = lambda x: set_rows(x, dst_slot, get_rows(x, src_slot, axis=1), axis=1, mode="drop")
  mass = None if cache.mass is None else move(cache.mass)
  return dataclasses.replace(cache, k=move(cache.k), v=move(cache.v), mass=mass)
