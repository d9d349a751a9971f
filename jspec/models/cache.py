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
from jspec.sharding import ArraySpec


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
  k: jax.Array  # [L, B, S, K, D]
  v: jax.Array  # [L, B, S, K, D]
  lengths: jax.Array  # [B] int32, committed entries per row

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

  def commit(self, n: jax.Array | int) -> "KVCache":
    """Keep `n` ([B] or scalar) more of the entries the last forward wrote."""
    return dataclasses.replace(self, lengths=self.lengths + jnp.asarray(n, jnp.int32))

  def with_lengths(self, lengths: jax.Array) -> "KVCache":
    return dataclasses.replace(self, lengths=jnp.asarray(lengths, jnp.int32))


def cache_layout(cfg: Config, batch: int, size: int) -> KVCache:
  """Logical axes of the cache arrays, for sharding (see jspec.sharding)."""
  kv = ArraySpec((cfg.num_layers, batch, size, cfg.num_kv_heads, cfg.head_dim),
                 ("layers", "batch", "seq", "kv_heads", "head_dim"), "zeros")
  return KVCache(k=kv, v=kv, lengths=ArraySpec((batch,), ("batch",), "zeros"))
