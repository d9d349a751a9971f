"""Eviction: keep the `budget` best committed slots of every layer and KV head, compacted.

Keys are cached after RoPE, so a kept entry carries its original position wherever it moves, and
attention over a set of slots does not depend on their order; kept slots stay in their original
order anyway (the sinks stay first, the newest last). After eviction every row holds
min(lengths, budget) committed entries; a row at or under the budget is left exactly as it was.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jspec.kv.policy import KVPolicy
from jspec.kv.scores import SCORES
from jspec.models.cache import KVCache

Array = jax.Array


def keep_scores(policy: KVPolicy, cache: KVCache) -> Array:
  """[L, B, S, K] scores with the sinks and the recent window at +inf, empty slots at -inf."""
  scores = SCORES[policy.method](cache.k, cache.v, cache.lengths)
  slot = jnp.arange(cache.size)[None, :]  # [1, S]
  lengths = cache.lengths[:, None]  # [B, 1]
  protected = (slot < policy.sinks) | (slot >= lengths - policy.window)  # [B, S]
  valid = slot < lengths
  scores = jnp.where(protected[None, :, :, None], jnp.inf, scores)
  return jnp.where(valid[None, :, :, None], scores, -jnp.inf)


def compact(cache: KVCache, scores: Array, budget: int) -> KVCache:
  """Move the `budget` highest-scoring slots of each layer, row and KV head to slots
  [0, budget) in their original order; lengths become min(lengths, budget)."""
  _, keep = jax.lax.top_k(jnp.moveaxis(scores, 2, -1), budget)  # [L, B, K, budget]
  keep = jnp.moveaxis(jnp.sort(keep, axis=-1), -1, 2)[..., None]  # [L, B, budget, K, 1]

  def gather(x):  # [L, B, S, K, D] → same, slots [0, budget) replaced
    kept = jnp.take_along_axis(x, keep, axis=2)
    return jnp.concatenate([kept, x[:, :, budget:]], axis=2)

  return dataclasses.replace(cache, k=gather(cache.k), v=gather(cache.v),
                             lengths=jnp.minimum(cache.lengths, budget))


def evict(policy: KVPolicy, cache: KVCache) -> tuple[KVCache, Array]:
  """(cache evicted down to the budget, [B] entries dropped per row)."""
  evicted = compact(cache, keep_scores(policy, cache), policy.budget)
  return evicted, cache.lengths - evicted.lengths
