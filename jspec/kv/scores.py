"""Which cache slots deserve to stay: one pure function per method, the same signature for all.

score(cache, policy) → [L, B, S, K] float32, higher = keep; the cache's keys are stored after
RoPE, `cache.positions` holds each slot's position (eviction refills freed slots, so slot order
is not position order), `cache.mass` the attention mass the forwards accumulated (attention-score
methods).
Only slots below cache.lengths[b] matter; evict.py protects the sinks and the recent window and
never keeps an empty slot. `caote` rescores any attention-score method.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jspec.kv.policy import KVPolicy
from jspec.models.cache import KVCache
from jspec.pallas.key_similarity import block_size, key_similarity, key_similarity_reference

Array = jax.Array


def _valid(cache: KVCache) -> Array:
  """[1, B, S, 1]: the committed slots."""
  return cache.committed()[None, :, :, None]


def keydiff(cache: KVCache, policy: KVPolicy) -> Array:
  """KeyDiff: minus the cosine similarity of each key to the anchor of its layer and KV head (the
  mean of the committed keys after normalising each), so the most distinctive keys are kept.
  Needs no attention weights. policy.score_impl "pallas" / "pallas-interpret" computes it with the
  key-similarity kernel."""
  if policy.score_impl != "xla":
    return key_similarity(cache.k, cache.lengths, block_s=block_size(cache.size),
                          interpret=policy.score_impl == "pallas-interpret")
  return key_similarity_reference(cache.k, cache.lengths)


def streaming(cache: KVCache, policy: KVPolicy) -> Array:
  """StreamingLLM: recency (with the sinks, which evict.py protects, nothing else is kept)."""
  return cache.positions.astype(jnp.float32)


def h2o(cache: KVCache, policy: KVPolicy) -> Array:
  """H2O (heavy hitters): the attention each slot received, summed over every query so far."""
  return cache.mass


def tova(cache: KVCache, policy: KVPolicy) -> Array:
  """TOVA: the attention of the newest query (the mass array holds only that query's)."""
  return cache.mass


def snapkv(cache: KVCache, policy: KVPolicy) -> Array:
  """SnapKV: the attention of the last `snap_window` queries of the latest block, average-pooled
  over `snap_kernel` neighbouring kept positions so a kept token brings its neighbours' context
  (pooled in position order, which eviction does not keep in the slots)."""
  width = policy.snap_kernel
  valid = _valid(cache)
  order = jnp.argsort(jnp.where(valid, cache.positions, jnp.iinfo(jnp.int32).max), axis=2)
  mass = jnp.take_along_axis(jnp.where(valid, cache.mass, 0.0), order, axis=2)  # by position
  pooled = jax.lax.reduce_window(mass, 0.0, jax.lax.add, (1, 1, width, 1), (1, 1, 1, 1),
                                 [(0, 0), (0, 0), (width // 2, (width - 1) // 2), (0, 0)])
  return jnp.put_along_axis(pooled, order, pooled, axis=2, inplace=False) / width


def caote(scores: Array, cache: KVCache) -> Array:
  """CAOTE: evicting slot j, whose normalised attention weight is a_j, changes the attention
  output o = sum_i a_i v_i into (o - a_j v_j) / (1 - a_j), an error of a_j / (1 - a_j) * ||v_j - o||;
  keep the slots whose eviction would cost most. `scores` [L, B, S, K] are the attention-score
  method's (non-negative) masses, normalised here over the committed slots of each layer, row
  and KV head; values are the cache's."""
  mass = jnp.where(_valid(cache), jnp.maximum(scores, 0.0), 0.0)  # [L, B, S, K]
  alpha = mass / jnp.maximum(mass.sum(axis=2, keepdims=True), 1e-30)
  v = cache.v.astype(jnp.float32)  # [L, B, S, K, D]
  out = jnp.einsum("lbsk,lbskd->lbkd", alpha, v)  # [L, B, K, D]
  distance = jnp.linalg.norm(v - out[:, :, None], axis=-1)  # [L, B, S, K]
  return alpha / jnp.maximum(1.0 - alpha, 1e-6) * distance


SCORES = {"keydiff": keydiff, "streaming": streaming, "h2o": h2o, "tova": tova, "snapkv": snapkv}


def slot_scores(cache: KVCache, policy: KVPolicy) -> Array:
  """The policy's scores (CAOTE on top when asked)."""
  scores = SCORES[policy.base](cache, policy)
  return caote(scores, cache) if policy.caote else scores
