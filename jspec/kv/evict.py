"""Eviction: keep the `budget` best committed slots of every layer and KV head, with no holes.

Keys are cached after RoPE, so a kept entry carries its original position wherever it sits, and
attention over a set of slots does not depend on their order. Eviction therefore moves as little
as it can: the kept entries among the newest (slots past the new length) fill the slots the
dropped ones free below it, and nothing else moves, so evicting one entry per decoded token costs
a few small copies rather than a pass over the cache. Slot order is then no longer position
order, so the cache records each slot's position (`KVCache.positions`), and the sinks, the recent
window, StreamingLLM's recency and SnapKV's pooling read positions, not slots. After eviction a
row holds min(lengths, budget) committed entries in slots [0, that) (a row more than `max_drop`
over keeps the rest until the next eviction); a row at or under the budget keeps every entry
where it was.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jspec.kv.policy import KVPolicy
from jspec.kv.scores import slot_scores
from jspec.models.cache import KVCache
from jspec.sharding import ArraySpec, on_own_shards

Array = jax.Array


def record_positions(cache: KVCache, evicted: Array) -> KVCache:
  """The cache with every committed slot's position recorded. The entries committed since the
  last eviction (position -1; a cache without positions has had none) were appended in slot
  order after it, at RoPE positions that count the evicted [B] entries: slot s holds position
  s + evicted[b]. This needs committed entries never to be rolled back past the last eviction,
  which no engine does to a row that goes on decoding (a model drafter's cache in a row the tree
  engine has finished may be: that row's output is final)."""
  L, B, S, K, _ = cache.k.shape
  positions = cache.positions
  if positions is None:
    positions = jnp.full((L, B, S, K), -1, jnp.int32)
  slot = jnp.arange(S, dtype=jnp.int32)[None, :]  # [1, S]
  fresh = cache.committed()[None, :, :, None] & (positions < 0)  # [L, B, S, K]
  appended = (slot + evicted[:, None])[None, :, :, None]  # [1, B, S, 1]
  return dataclasses.replace(cache, positions=jnp.where(fresh, appended, positions))


def keep_scores(policy: KVPolicy, cache: KVCache, evicted: Array) -> Array:
  """[L, B, S, K] scores with the sinks and the recent window at +inf, empty slots at -inf, of a
  cache whose positions are recorded (`record_positions` with the same evicted [B])."""
  scores = slot_scores(cache, policy)
  newest = (cache.lengths + evicted - 1)[None, :, None, None]  # [1, B, 1, 1]
  protected = (cache.positions < policy.sinks) | (cache.positions > newest - policy.recent)
  valid = cache.committed()[None, :, :, None]  # [1, B, S, 1]
  scores = jnp.where(protected, jnp.inf, scores)
  return jnp.where(valid, scores, -jnp.inf)


def compact(cache: KVCache, scores: Array, budget: int, max_drop: int,
            due: Array | None = None) -> KVCache:
  """Drop the n = min(lengths - budget, max_drop) lowest-scoring committed slots of each layer,
  row and KV head (`max_drop` static: a row further over keeps the rest until the next eviction)
  and move the kept entries of slots [lengths - n, lengths) into the freed slots below
  lengths - n, lowest first; lengths become lengths - n. With `due` [B] bool, only those rows:
  the others keep every slot where it is. Positions and attention mass (if the cache has them)
  move with their entries; freed slots get position -1."""
  L, B, S, K, _ = cache.k.shape
  W = min(max(max_drop, 1), S)
  n_drop = jnp.clip(cache.lengths - budget, 0, W)  # [B]; past W it waits for the next eviction
  if due is not None:
    n_drop = jnp.where(due, n_drop, 0)
  new_lengths = cache.lengths - n_drop
  valid = cache.committed()[None, :, :, None]  # [1, B, S, 1]
  lowest = jnp.moveaxis(jnp.where(valid, -scores, -jnp.inf), 2, -1)  # [L, B, K, S]
  _, candidates = jax.lax.top_k(lowest, W)  # [L, B, K, W], lowest score first
  j = jnp.arange(W)
  n = n_drop[None, :, None, None]  # [1, B, 1, 1]
  end = new_lengths[None, :, None, None]
  dropped = jnp.where(j < n, candidates, S)  # [L, B, K, W]; S: no slot
  # The freed slots below the new length, and the kept entries at or past it: as many of each.
  holes = jnp.sort(jnp.where(dropped < end, dropped, S), axis=-1)
  tail = jnp.broadcast_to(end + j, dropped.shape)  # [L, B, K, W]: slots new_length + j
  is_dropped = jnp.zeros((L, B, K, S + 1), bool).at[
      jnp.arange(L)[:, None, None, None], jnp.arange(B)[None, :, None, None],
      jnp.arange(K)[None, None, :, None], dropped].set(True)  # slot S: none
  tail_dropped = jnp.take_along_axis(is_dropped, jnp.minimum(tail, S), axis=-1)
  movers = jnp.sort(jnp.where((j < n) & ~tail_dropped, tail, S), axis=-1)
  src = jnp.moveaxis(jnp.minimum(movers, S - 1), -1, 2)  # [L, B, W, K]
  dst = jnp.moveaxis(jnp.where(movers < S, holes, S), -1, 2)  # S: nothing to write
  at = (jnp.arange(L)[:, None, None, None], jnp.arange(B)[None, :, None, None], dst,
        jnp.arange(K)[None, None, None, :])

  def move(x):  # [L, B, S, K, ...]: the movers' entries into the holes
    index = src.reshape(src.shape + (1,) * (x.ndim - 4))
    return x.at[at].set(jnp.take_along_axis(x, index, axis=2), mode="drop")

  mass = None if cache.mass is None else move(cache.mass)
  positions = None
  if cache.positions is not None:
    gone = ~cache.with_lengths(new_lengths).committed()[None, :, :, None]
    positions = jnp.where(gone, -1, move(cache.positions))
  return dataclasses.replace(cache, k=move(cache.k), v=move(cache.v), mass=mass,
                             positions=positions, lengths=new_lengths)


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
  keep = cache.committed()[:, :, None]  # [B, S, 1]
  if policy.base != "h2o":
    keep = keep & (n_new[:, None, None] == 0)
  return dataclasses.replace(cache, mass=jnp.where(keep[None], cache.mass, 0.0))


def with_budget_state(policy: KVPolicy, cache: KVCache) -> KVCache:
  """A fresh cache with what eviction under the policy tracks: every slot's position (none
  recorded yet) and, for attention-score methods, the attention mass each slot received."""
  L, B, S, K, _ = cache.k.shape
  mass = jnp.zeros((L, B, S, K), jnp.float32) if policy.needs_attention else None
  return dataclasses.replace(cache, mass=mass,
                             positions=jnp.full((L, B, S, K), -1, jnp.int32))


def before_forward(policy: KVPolicy, cache: KVCache, n_new: Array,
                   T: int) -> tuple[KVCache, Array | None]:
  """(cache, mass_weights for `forward`) for a block of T tokens of which n_new [B] will be
  committed: what attention-score policies record; (cache, None) for the others."""
  if not policy.needs_attention:
    return cache, None
  return reset_mass(policy, cache, n_new), mass_weights(policy, n_new, T)


def block_mass(cache: KVCache, T: int, riders: int = 0) -> tuple[KVCache, Array]:
  """For a verification block of T tokens whose committed count is known only afterwards: the
  cache with a zero [L, B, S, K, T] mass (one column per query) and the [B, T + riders, T]
  identity weights that make the forward fill it; `fold_block_mass` then keeps the committed
  queries'. riders: positions the forward runs after the block (probe masks), whose attention
  no decoding step would have had: zero weight."""
  L, B, S, K, _ = cache.k.shape
  eye = jnp.eye(T + riders, T, dtype=jnp.float32)
  return (dataclasses.replace(cache, mass=jnp.zeros((L, B, S, K, T), jnp.float32)),
          jnp.broadcast_to(eye, (B, T + riders, T)))


def fold_block_mass(policy: KVPolicy, before: KVCache, after: KVCache, n_new: Array) -> KVCache:
  """`after` (a forward's output over `before`, with `block_mass`'s per-query columns) with the
  mass that decoding the first n_new [B] block tokens one at a time would have left: every one of
  them for H2O, the newest for TOVA and SnapKV (one token per block while decoding)."""
  T = after.mass.shape[-1]
  mass = reset_mass(policy, before, n_new).mass
  t = jnp.arange(T)[None, :]
  weights = t < n_new[:, None] if policy.base == "h2o" else t == n_new[:, None] - 1  # [B, T]
  for j in range(T):  # in token order, as decoding adds them: the same bits as its steps
    mass = mass + jnp.where(weights[None, :, None, None, j], after.mass[..., j], 0.0)
  return dataclasses.replace(after, mass=mass)


def evict(policy: KVPolicy, cache: KVCache, evicted: Array, due: Array | None = None,
          max_drop: int | None = None) -> tuple[KVCache, Array]:
  """(cache evicted down to the budget, [B] entries dropped per row) of a cache whose rows have
  had evicted [B] entries dropped before; with `due` [B] bool, only those rows are evicted (the
  others keep their entries where they are). max_drop (static): the most entries any row can be
  over the budget (default: every slot past it), which sizes the selection."""
  return _evict_recorded(policy, record_positions(cache, evicted), evicted, due, max_drop)


def _evict_recorded(policy: KVPolicy, cache: KVCache, evicted: Array, due: Array | None,
                    max_drop: int | None) -> tuple[KVCache, Array]:
  """`evict` of a cache whose positions are recorded."""
  max_drop = cache.size - policy.budget if max_drop is None else max_drop

  def own_rows(cache: KVCache, evicted: Array, due: Array) -> tuple[KVCache, Array]:
    out = compact(cache, keep_scores(policy, cache, evicted), policy.budget, max_drop, due)
    return out, cache.lengths - out.lengths

  # Every layer, row and KV head evicts on its own, so on a mesh each device evicts its own rows
  # and heads (XLA's partitioner gathered every row's scores and moved entries to every device).
  due = jnp.ones_like(evicted, bool) if due is None else due
  rows = ArraySpec(evicted.shape, ("batch",))
  layout = cache.layout()
  return on_own_shards(own_rows, (cache, evicted, due), (layout, rows, rows), (layout, rows))


def evict_when_full(policy: KVPolicy, cache: KVCache, evicted: Array,
                    max_drop: int | None = None) -> tuple[KVCache, Array]:
  """Decoding's schedule, the same in every engine: a row is evicted down to the budget once it
  holds budget + evict_every entries, so each token is scored over the same cache whether it was
  decoded alone or verified in a block. Engines that stop each round where a row reaches
  budget + evict_every pass max_drop=policy.evict_every (the selection's width)."""
  cache = record_positions(cache, evicted)  # every row, so both branches return the same arrays
  due = cache.lengths >= policy.budget + policy.evict_every
  return jax.lax.cond(jnp.any(due), lambda c: _evict_recorded(policy, c, evicted, due, max_drop),
                      lambda c: (c, jnp.zeros_like(c.lengths)), cache)
