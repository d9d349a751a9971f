"""Tree drafting over a drafter that has its own KV cache (model and feature-level drafters).

The draft schedules (jspec.tree.draft) call the feeder once per depth in a Python loop, so within
one trace it threads the cache through itself. Call 1 (frontier = the root) returns the logits the
drafter already has for the last known token; each later call is ONE drafter forward over the W
frontier nodes, written in call order at slots prefix + 0, 1, ..., each seeing the committed
prefix (slots < prefix) and the slots of its ancestors. `kv_slot` [B, N] records where each fed
node's entry went (-1: never fed, e.g. a leaf).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from jspec.drafting.base import DraftState
from jspec.models.cache import KVCache
from jspec.sharding import set_rows
from jspec.tree.structure import Tree, parent_of, set_node_columns, take

Array = jax.Array
# run(tree, frontier [B, W], slots [B, W], visible [B, W, S], cache) -> (logits [B, W, V], cache)
RunFrontier = Callable[[Tree, Array, Array, Array, KVCache], tuple[Array, KVCache]]
# finish(cache, kv_slot [B, N]) -> the drafter's state holding the drafted tree
Finish = Callable[[KVCache, Array], DraftState]


def match_nodes(old: Tree, new: Tree) -> Array:
  """[B, N_new] index in `old` of each node of `new` with the same root-to-node token path, -1 if
  none (pruning re-indexes a tree; paths are unique in trees whose siblings are distinct)."""
  same = (new.valid[:, :, None] & old.valid[:, None, :]
          & (new.tokens[:, :, None] == old.tokens[:, None, :])
          & (new.depth[:, :, None] == old.depth[:, None, :]))  # [B, N_new, N_old]
  match = jnp.full(new.tokens.shape, -1, jnp.int32)
  for _ in range(new.max_depth):  # iteration t settles the nodes of depth <= t
    parent = jnp.where(new.parents >= 0, take(match, new.parents), -1)  # [B, N_new], in `old`
    cand = same & (old.parents[:, None, :] == parent[:, :, None])
    match = jnp.where(cand.any(-1), jnp.argmax(cand, -1), -1).astype(jnp.int32)
  return match


class KVFrontierFeeder:
  """A TreeFeeder over a drafter cache whose committed prefix is `prefix` [B] slots long.

  `root_logits` [B, 1, V] score the root's children; `run` scores a frontier (the drafter's own
  forward with the given slots and visibility); `finish` wraps the final cache and kv_slot into
  the drafter's state.
  """

  def __init__(self, cache: KVCache, root_logits: Array, prefix: Array, run: RunFrontier,
               finish: Finish):
    self.cache, self.root_logits, self.prefix = cache, root_logits, prefix
    self.run, self.finish = run, finish
    self.kv_slot = None  # [B, N] once the root call has seen the tree's size
    self.fed = 0  # slots used so far (static)
    self.last_tree = None  # the tree at the last forward: every fed node is in it

  def __call__(self, tree: Tree, frontier: Array) -> Array:
    B, W = frontier.shape
    if self.kv_slot is None:
      assert W == 1, "the first next_logits call of a draft schedule is the root's"
      self.kv_slot = jnp.full(tree.tokens.shape, -1, jnp.int32)
      return self.root_logits  # [B, 1, V]
    offset = jnp.broadcast_to(self.fed + jnp.arange(W, dtype=jnp.int32), (B, W))
    self.kv_slot = set_rows(self.kv_slot, frontier, offset)
    S = self.cache.size
    # Slots each frontier node sees: the committed prefix, then its own and its ancestors'.
    line, cur = [frontier], frontier
    for _ in range(tree.max_depth - 1):
      cur = parent_of(tree, cur)
      line.append(cur)
    line = jnp.stack(line, axis=-1)  # [B, W, D] the node and its ancestors, -1 past the root
    slot = jnp.where(line >= 0, take(self.kv_slot, line), -1)  # [B, W, D]
    seen = jnp.where(slot >= 0, self.prefix[:, None, None] + slot, S)  # [B, W, D]
    visible = jnp.broadcast_to((jnp.arange(S) < self.prefix[:, None])[:, None], (B, W, S))
    visible = set_node_columns(visible, seen, True)
    logits, self.cache = self.run(tree, frontier, self.prefix[:, None] + offset, visible,
                                  self.cache)
    self.fed += W
    self.last_tree = tree
    return logits

  def result(self, tree: Tree, reindexed: bool) -> DraftState:
    kv_slot = self.kv_slot
    if reindexed:
      if self.last_tree is None:
        kv_slot = jnp.full(tree.tokens.shape, -1, jnp.int32)
      else:
        old = match_nodes(self.last_tree, tree)
        kv_slot = jnp.where(old >= 0, take(kv_slot, old), -1)
    assert kv_slot.shape == tree.tokens.shape, (kv_slot.shape, tree.tokens.shape)
    return self.finish(self.cache, kv_slot)
