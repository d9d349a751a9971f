"""Static-shape token trees: a padded, batch-first tree of at most N draft nodes below a root.

The root is the last committed token and is not a node. Nodes are in topological order (a parent's
index is below its children's), so one pass over node indices meets every parent before its
children, and siblings are ordered by index: samplers add them in the order they were drawn, which
the without-replacement verifier relies on.

Context slots: slot 0 is the root's context, slot n + 1 the context ending at node n. The draft's
distributions `q` and the target's logits are both laid out per slot, [B, N + 1, V]. The draft
distribution is stored per parent (per slot), not per node, because all children of a node are
drawn from the one distribution at that node: it is stored once however many children there are,
it is exactly what a drafter computes (one distribution per expanded node), and it lines up with
the target's forward over [root, nodes...] so that p and q at a node's parent share an index.
Slots of nodes that were never expanded hold zeros, or (fed as padding by a drafter) values no
valid node reads: only a slot with a valid child is read.
"""

from __future__ import annotations

import dataclasses
import enum

import jax
import jax.numpy as jnp

from jspec.sharding import set_rows, top_k_by_rows

Array = jax.Array


class Siblings(enum.Enum):
  """How the children of a node were drawn from its q; it selects the lossless sampled rule."""

  IID = "iid"  # independently from q (SpecInfer)
  WITHOUT_REPLACEMENT = "without_replacement"  # in index order, each from q minus earlier siblings
  FIXED = "fixed"  # chosen without sampling from q (top-k, EAGLE-2, pruned or merged trees)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Tree:
  """A padded token tree; `max_depth` and `siblings` are static, the arrays are pytree data."""

  tokens: Array  # [B, N] int32
  parents: Array  # [B, N] int32, -1 for a child of the root; parents[n] < n
  depth: Array  # [B, N] int32, 1 for a child of the root (the first drafted token)
  valid: Array  # [B, N] bool; a valid node's ancestors are valid; invalid nodes are padding
  q: Array  # [B, N + 1, V] float32, the draft's processed distribution per context slot
  max_depth: int = dataclasses.field(metadata=dict(static=True))
  siblings: Siblings = dataclasses.field(metadata=dict(static=True))

  @property
  def num_nodes(self) -> int:
    return self.tokens.shape[1]

  @classmethod
  def empty(cls, batch: int, num_nodes: int, vocab: int, max_depth: int,
            siblings: Siblings) -> "Tree":
    """A tree with no valid node (invalid nodes: token 0, parent -1, depth 0)."""
    zeros = jnp.zeros((batch, num_nodes), jnp.int32)
    return cls(tokens=zeros, parents=zeros - 1, depth=zeros,
               valid=jnp.zeros((batch, num_nodes), bool),
               q=jnp.zeros((batch, num_nodes + 1, vocab), jnp.float32),
               max_depth=max_depth, siblings=siblings)


def take(x: Array, idx: Array) -> Array:
  """x[b, idx[b, ...]] for x [B, N, ...] and idx [B, ...] (indices clipped into range)."""
  flat = idx.reshape(idx.shape[0], -1)
  out = jnp.take_along_axis(x, jnp.clip(flat, 0, x.shape[1] - 1).reshape(
      flat.shape + (1,) * (x.ndim - 2)), axis=1)
  return out.reshape(idx.shape + x.shape[2:])


def set_node_columns(x: Array, cols: Array, value) -> Array:
  """x [B, W, L] with x[b, w, cols[b, w, ...]] = value (shaped as cols, or broadcast); columns
  outside [0, L) are dropped. One scatter over each row's flattened [W L] (`set_rows`), so a
  mesh's devices each write their own rows."""
  B, W, L = x.shape
  w = jnp.arange(W).reshape((1, W) + (1,) * (cols.ndim - 2))
  flat = jnp.where((cols >= 0) & (cols < L), w * L + cols, W * L).reshape(B, -1)
  value = jnp.broadcast_to(value, cols.shape).reshape(B, -1)
  return set_rows(x.reshape(B, W * L), flat, value, mode="drop").reshape(B, W, L)


def parent_of(tree: Tree, node: Array) -> Array:
  """Parent index of each entry of node [B, ...] (-1 stays -1: the root has no parent)."""
  return jnp.where(node >= 0, take(tree.parents, node), -1)


def ancestor_mask(tree: Tree) -> Array:
  """[B, N, N] bool: node i sees node j iff j is i or an ancestor of i (tree attention mask).

  Invalid nodes see only themselves, so every row of an attention mask keeps one entry.
  """
  N = tree.num_nodes
  ids = jnp.arange(N, dtype=jnp.int32)
  mask = jnp.broadcast_to(ids[:, None] == ids[None, :], tree.tokens.shape + (N,))
  cur = jnp.where(tree.valid, tree.parents, -1)  # [B, N]
  for _ in range(tree.max_depth - 1):  # a node at depth d has d - 1 ancestors
    mask = mask | (cur[..., None] == ids)
    cur = parent_of(tree, cur)
  return mask


def positions(tree: Tree, lengths: Array) -> Array:
  """[B, N] sequence positions of the nodes when the root sits at position lengths - 1."""
  return lengths[:, None] + tree.depth - 1


def path_to(tree: Tree, node: Array) -> tuple[Array, Array]:
  """Root-to-node path of node [B] (-1 = the root: empty path).

  Returns (path [B, max_depth] node indices, root child first, -1 padded; length [B] int32).
  """
  D = tree.max_depth
  length = jnp.where(node >= 0, take(tree.depth, node), 0)  # [B]
  slots = jnp.arange(D, dtype=jnp.int32)
  path = jnp.full((node.shape[0], D), -1, jnp.int32)
  cur = node
  for k in range(D):  # walk up: the node k steps above `node` sits at path index length - 1 - k
    path = jnp.where((slots == (length - 1 - k)[:, None]) & (cur >= 0)[:, None], cur[:, None], path)
    cur = parent_of(tree, cur)
  return path, length.astype(jnp.int32)


def path_tokens(tree: Tree, path: Array) -> Array:
  """Tokens [B, D] of a padded node path [B, D] (-1 where the path is padding)."""
  return jnp.where(path >= 0, take(tree.tokens, path), -1)


def _compact(tree: Tree, keep: Array, parent: Array, size: int, siblings: Siblings) -> Tree:
  """The kept nodes, in index order, re-indexed into `size` slots; the rest is padding.

  keep [B, N] must be closed under `parent` [B, N] (the new parent of each node, an old index).
  """
  B, N = keep.shape
  order = jnp.argsort(~keep, axis=1, stable=True)[:, :size]  # [B, size], kept nodes first
  valid = take(keep, order)  # [B, size]
  new_id = jnp.where(valid, jnp.arange(size, dtype=jnp.int32), -1)
  new_of_old = set_rows(jnp.full((B, N), -1, jnp.int32), order, new_id)  # [B, N]
  old_parent = take(parent, order)  # [B, size]
  parents = jnp.where(valid & (old_parent >= 0), take(new_of_old, old_parent), -1)
  slot_q = jnp.concatenate([tree.q[:, :1], take(tree.q[:, 1:], order)], axis=1)  # [B, size+1, V]
  return Tree(tokens=jnp.where(valid, take(tree.tokens, order), 0), parents=parents,
              depth=jnp.where(valid, take(tree.depth, order), 0), valid=valid,
              q=jnp.where(jnp.concatenate([jnp.ones((B, 1), bool), valid], 1)[..., None],
                          slot_q, 0.0),
              max_depth=tree.max_depth, siblings=siblings)


def prune_to_budget(tree: Tree, scores: Array, budget: int) -> Tree:
  """Keep the `budget` best-scored valid nodes whose ancestors are all kept (static size budget).

  A node ranks by the minimum score on its root path (so it never outranks an ancestor; for
  cumulative log-probabilities that is its own score), ties broken towards lower indices, i.e.
  ancestors first. The result keeps the topological order and is re-indexed. It is labelled
  Siblings.FIXED: choosing sampled nodes by score changes their law, and the FIXED rule is
  lossless for any tree chosen from draft-side information only.
  """
  anc = ancestor_mask(tree)  # [B, N, N]
  s = jnp.where(tree.valid, scores.astype(jnp.float32), -jnp.inf)
  eff = jnp.min(jnp.where(anc, s[:, None, :], jnp.inf), axis=-1)  # [B, N]
  _, best = top_k_by_rows(eff, budget)  # ties: lower index first
  keep = set_rows(jnp.zeros(eff.shape, bool), best, take(eff, best) > -jnp.inf)
  return _compact(tree, keep, tree.parents, budget, Siblings.FIXED)


def merge(a: Tree, b: Tree) -> Tree:
  """Union of two trees over the same root, each distinct root-to-node token path once.

  The result has a.N + b.N slots (valid nodes first, in topological order, a's before b's) and
  the root q of `a`; a path present in both keeps a's node and q. Labelled Siblings.FIXED.
  """
  Na = a.num_nodes
  cat = Tree(tokens=jnp.concatenate([a.tokens, b.tokens], 1),
             parents=jnp.concatenate([a.parents, jnp.where(b.parents >= 0, b.parents + Na, -1)], 1),
             depth=jnp.concatenate([a.depth, b.depth], 1),
             valid=jnp.concatenate([a.valid, b.valid], 1),
             q=jnp.concatenate([a.q, b.q[:, 1:]], 1), max_depth=max(a.max_depth, b.max_depth),
             siblings=Siblings.FIXED)
  return dedupe(cat)


def dedupe(tree: Tree) -> Tree:
  """Each distinct root-to-node token path once: a node whose path an earlier node already has
  is dropped and its children hang below that earlier node. The result keeps N slots (valid
  nodes first, in topological order) and is labelled Siblings.FIXED."""
  tokens, parents, depth, valid = tree.tokens, tree.parents, tree.depth, tree.valid
  M = tokens.shape[1]
  same = (valid[:, :, None] & valid[:, None, :] & (tokens[:, :, None] == tokens[:, None, :])
          & (depth[:, :, None] == depth[:, None, :]))  # [B, M, M]
  # canon[i]: the lowest node with i's token path. Iteration t settles the nodes of depth <= t.
  canon = jnp.where(valid, jnp.arange(M, dtype=jnp.int32), -1)
  for _ in range(tree.max_depth):
    cpar = jnp.where(valid & (parents >= 0), take(canon, parents), -1)  # [B, M]
    canon = jnp.where(valid, jnp.argmax(same & (cpar[:, :, None] == cpar[:, None, :]), axis=-1),
                      -1).astype(jnp.int32)
  cpar = jnp.where(valid & (parents >= 0), take(canon, parents), -1)
  keep = valid & (canon == jnp.arange(M))
  return _compact(tree, keep, cpar, M, Siblings.FIXED)
