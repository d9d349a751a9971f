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
from jspec.kv.scores import slot_scores
from jspec.models.cache import KVCache

Array = jax.Array


def keep_scores(policy: KVPolicy, cache: KVCache) -> Array:
  """[L, B, S, K] scores with the sinks and the recent window at +inf, empty slots at -inf."""
  scores = slot_scores(cache, policy)
  slot = jnp.arange(cache.size)[None, :]  # [1, S]
  lengths = cache.lengths[:, None]  # [B, 1]
  protected = (slot < policy.sinks) | (slot >= lengths - policy.window)  # [B, S]
  valid = slot < lengths
  scores = jnp.where(protected[None, :, :, None], jnp.inf, scores)
  return jnp.where(valid[None, :, :, None], scores, -jnp.inf)


def compact(cache: KVCache, scores: Array, budget: int, due: Array | None = None) -> KVCache:
  """Move the `budget` highest-scoring slots of each layer, row and KV head to slots
  [0, budget) in their original order; lengths become min(lengths, budget). With `due` [B] bool,
  only those rows: the others keep every slot where it is (their first `budget` slots gathered
  onto themselves), so no pass over the old cache merges them back."""
  _, keep = jax.lax.top_k(jnp.moveaxis(scores, 2, -1), budget)  # [L, B, K, budget]
  keep = jnp.sort(keep, axis=-1)
  lengths = jnp.minimum(cache.lengths, budget)
  if due is not None:
    keep = jnp.where(due[None, :, None, None], keep, jnp.arange(budget))
    lengths = jnp.where(due, lengths, cache.lengths)
  keep = jnp.moveaxis(keep, -1, 2)[..., None]  # [L, B, budget, K, 1]

  def gather(x):  # [L, B, S, K, D] → same, slots [0, budget) replaced
    kept = jnp.take_along_axis(x, keep, axis=2)
    return jnp.concatenate([kept, x[:, :, budget:]], axis=2)

  mass = cache.mass
  if mass is not None:  # [L, B, S, K]: the same moves
    mass = jnp.concatenate([jnp.take_along_axis(mass, keep[..., 0], axis=2),
                            mass[:, :, budget:]], axis=2)
  return dataclasses.replace(cache, k=gather(cache.k), v=gather(cache.v), mass=mass,
                             lengths=lengths)


def mass_weights(policy: KVPolicy, n_new: Array, T: int) -> Array:
  """[B, T] float32 weights of a block's queries in the attention mass: every committed one (H2O),
  the newest (TOVA) or the last snap_window (SnapKV); n_new [B] of the T tokens are committed."""
  t = jnp.arange(T)[None, :]
  n = n_new[:, None]
  if policy.base == "h2o":
    keep = t < n
  elif policy.base == "tova":
    keep = t == n - 1
  else:
    keep = (t < n) & (t >= n - policy.snap_window)
  return keep.astype(jnp.float32)


def reset_mass(policy: KVPolicy, cache: KVCache, n_new: Array) -> KVCache:
  """Before a forward that records attention mass: empty slots start at zero; TOVA and SnapKV
  score by the newest block alone, so rows that commit queries in it start from zero too."""
  slot = jnp.arange(cache.size)[None, :, None]  # [1, S, 1]
  keep = slot < cache.lengths[:, None, None]  # [B, S, 1]
  if policy.base != "h2o":
    keep = keep & (n_new[:, None, None] == 0)
  return dataclasses.replace(cache, mass=jnp.where(keep[None], cache.mass, 0.0))


def with_mass(policy: KVPolicy, cache: KVCache) -> KVCache:
  """A fresh cache with the attention-mass array the policy scores by (if it needs one)."""
  if not policy.needs_attention:
    return cache
  L, B, S, K, _ = cache.k.shape
  return dataclasses.replace(cache, mass=jnp.zeros((L, B, S, K), jnp.float32))


def before_forward(policy: KVPolicy, cache: KVCache, n_new: Array,
                   T: int) -> tuple[KVCache, Array | None]:
  """(cache, mass_weights for `forward`) for a block of T tokens of which n_new [B] will be
  committed: what attention-score policies record; (cache, None) for the others."""
  if not policy.needs_attention:
    return cache, None
  return reset_mass(policy, cache, n_new), mass_weights(policy, n_new, T)


def block_mass(cache: KVCache, T: int) -> tuple[KVCache, Array]:
  """For a verification block of T tokens whose committed count is known only afterwards: the
  cache with a zero [L, B, S, K, T] mass (one column per query) and the [B, T, T] identity
  weights that make the forward fill it; `fold_block_mass` then keeps the committed queries'."""
  L, B, S, K, _ = cache.k.shape
  eye = jnp.broadcast_to(jnp.eye(T, dtype=jnp.float32), (B, T, T))
  return dataclasses.replace(cache, mass=jnp.zeros((L, B, S, K, T), jnp.float32)), eye


def fold_block_mass(policy: KVPolicy, before: KVCache, after: KVCache, n_new: Array) -> KVCache:
  """`after` (a forward's output over `before`, with `block_mass`'s per-query columns) with the
  mass that decoding the first n_new [B] block tokens one at a time would have left: every one of
  them for H2O, the newest for TOVA and SnapKV (one token per block while decoding)."""
  T = after.mass.shape[-1]
  reset = reset_mass(policy, before, n_new)
  t = jnp.arange(T)[None, :]
  weights = t < n_new[:, None] if policy.base == "h2o" else t == n_new[:, None] - 1
  added = jnp.einsum("lbskt,bt->lbsk", after.mass, weights.astype(jnp.float32))
  return dataclasses.replace(after, mass=reset.mass + added)


def evict(policy: KVPolicy, cache: KVCache, due: Array | None = None) -> tuple[KVCache, Array]:
  """(cache evicted down to the budget, [B] entries dropped per row); with `due` [B] bool, only
  those rows are evicted (the others are returned as they were)."""
  evicted = compact(cache, keep_scores(policy, cache), policy.budget, due)
  return evicted, cache.lengths - evicted.lengths


def evict_when_full(policy: KVPolicy, cache: KVCache) -> tuple[KVCache, Array]:
  """Decoding's schedule, the same in every engine: a row is evicted down to the budget once it
  holds budget + evict_every entries, so each token is scored over the same cache whether it was
  decoded alone or verified in a block."""
  due = cache.lengths >= policy.budget + policy.evict_every
  return jax.lax.cond(jnp.any(due), lambda c: evict(policy, c, due),
                      lambda c: (c, jnp.zeros_like(c.lengths)), cache)
