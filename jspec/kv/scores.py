"""Which cache slots deserve to stay: one pure function per method, the same signature for all.

score(k, v, lengths) → [L, B, S, K] float32, higher = keep; k, v [L, B, S, K, D] the cache (keys
after RoPE), lengths [B] the committed slots per row. Only slots below lengths[b] are read; the
caller (evict.py) protects sinks and the recent window and never keeps an empty slot.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def _valid(lengths: Array, size: int) -> Array:
  return jnp.arange(size)[None, :] < lengths[:, None]  # [B, S]


def keydiff(k: Array, v: Array, lengths: Array) -> Array:
  """KeyDiff: minus the cosine similarity of each key to the mean key of its layer and KV head
  (over the committed slots), so the most dissimilar keys are kept. Needs no attention weights."""
  del v
  valid = _valid(lengths, k.shape[2])[None, :, :, None, None]  # [1, B, S, 1, 1]
  k = k.astype(jnp.float32)
  count = jnp.maximum(lengths, 1).astype(jnp.float32)[None, :, None, None]  # [1, B, 1, 1]
  mean = jnp.where(valid, k, 0.0).sum(axis=2) / count  # [L, B, K, D]
  dot = jnp.einsum("lbskd,lbkd->lbsk", k, mean)
  norms = jnp.linalg.norm(k, axis=-1) * jnp.linalg.norm(mean, axis=-1)[:, :, None, :]
  return -dot / jnp.maximum(norms, 1e-12)


def streaming(k: Array, v: Array, lengths: Array) -> Array:
  """StreamingLLM: recency (with the sinks, which evict.py protects, nothing else is kept)."""
  del v, lengths
  L, B, S, K, _ = k.shape
  return jnp.broadcast_to(jnp.arange(S, dtype=jnp.float32)[None, None, :, None], (L, B, S, K))


SCORES = {"keydiff": keydiff, "streaming": streaming}
