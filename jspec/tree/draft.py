"""Drafting token trees from a drafter, one drafter call per depth.

The drafter is a callable `next_logits(tree, frontier) -> logits [B, W, V]`: given the tree built
so far (nodes not yet drafted are invalid) and frontier [B, W] node indices (-1 = the root, i.e.
the context ending at the last committed token), it returns the drafter's next-token logits at
each frontier node's context. The frontier tokens are new to the drafter (drawn from the previous
call's logits; the root on the first call), and their ancestors were fed by earlier calls, so a
model drafter runs ONE forward per call over the W frontier tokens, with the frontier rows of
`ancestor_mask(tree)` (plus its cache) as attention mask and `positions` as positions. Frontier
entries may name invalid nodes (padding); their logits are ignored.

All schedules are static (Python ints and tuples), so every function here traces to one program;
jit them with the schedule, `next_logits` and the batch/vocabulary sizes static. The draft's
distribution q is `processed_logprobs(logits, sampling)` — the verifier processes the target's
logits the same way. At temperature 0 children are ranked by the unprocessed log-softmax.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from jspec.sampling.processing import SamplingParams, per_row, processed_logprobs
from jspec.sharding import set_rows, top_k_by_rows
from jspec.tree.structure import Siblings, Tree, prune_to_budget, take

Array = jax.Array
NextLogits = Callable[[Tree, Array], Array]


def _distributions(logits: Array, sampling: SamplingParams) -> tuple[Array, Array]:
  """(processed log q [..., V], ranking log-probs [..., V]: log-softmax of logits when greedy)."""
  logq = processed_logprobs(logits, sampling)
  # A static mode's Python bool makes this select a constant one: XLA keeps only its side.
  greedy = per_row(sampling.is_greedy, logits)  # one bool, or one per row
  rank = jnp.where(greedy, jax.nn.log_softmax(logits.astype(jnp.float32), -1), logq)
  return logq, rank


def _top_k_children(key, logq, rank, k):
  vals, toks = top_k_by_rows(rank, k, over_vocab=True)
  return toks, vals > -jnp.inf


def _iid_children(key, logq, rank, k):
  toks = jax.random.categorical(key, logq[..., None, :], shape=logq.shape[:-1] + (k,))
  return toks, jnp.ones(toks.shape, bool)


def _gumbel_children(key, logq, rank, k):
  """Gumbel-Top-k: k distinct tokens, in the order of sequential sampling without replacement."""
  vals, toks = top_k_by_rows(logq + jax.random.gumbel(key, logq.shape), k, over_vocab=True)
  return toks, vals > -jnp.inf


# (key, log q [B, W, V], ranking log-probs [B, W, V], k) -> (tokens [B, W, k], valid [B, W, k])
_CHILDREN = {Siblings.FIXED: _top_k_children, Siblings.IID: _iid_children,
             Siblings.WITHOUT_REPLACEMENT: _gumbel_children}


def _set_q(tree: Tree, frontier: Array, logq: Array) -> Tree:
  """Store q at the frontier nodes' context slots."""
  return dataclasses.replace(tree, q=set_rows(tree.q, frontier + 1, jnp.exp(logq)))


def _add_nodes(tree: Tree, start: int, tokens: Array, parents: Array, depth: int,
               valid: Array) -> Tree:
  """Write a block of nodes [B, M] at static offset `start`."""
  sl = slice(start, start + tokens.shape[1])
  return dataclasses.replace(
      tree, tokens=tree.tokens.at[:, sl].set(jnp.where(valid, tokens, 0).astype(jnp.int32)),
      parents=tree.parents.at[:, sl].set(jnp.where(valid, parents, -1).astype(jnp.int32)),
      depth=tree.depth.at[:, sl].set(jnp.where(valid, depth, 0).astype(jnp.int32)),
      valid=tree.valid.at[:, sl].set(valid))


def fixed_tree_size(branching: tuple[int, ...]) -> int:
  """Nodes of a fixed tree: b1 + b1*b2 + ... ."""
  total, width = 0, 1
  for b in branching:
    width *= b
    total += width
  return total


def draft_fixed(key: Array, next_logits: NextLogits, batch: int, vocab: int,
                branching: tuple[int, ...], sampling: SamplingParams,
                siblings: Siblings = Siblings.WITHOUT_REPLACEMENT,
                greedy_rows: Array | None = None) -> Tree:
  """Fixed-shape tree: every node at depth d - 1 gets branching[d - 1] children.

  siblings picks the children: FIXED = top-k of q (greedy trees), IID = i.i.d. draws from q
  (SpecInfer), WITHOUT_REPLACEMENT = Gumbel-Top-k draws (RSD-C). Nodes are laid out depth by
  depth, each parent's children contiguous and in draw order. Size: fixed_tree_size(branching).
  greedy_rows [B] bool (settings per row, greedy rows beside sampled ones): those rows take the
  top-k children whatever `siblings` says (greedy verification reads no sibling rule).
  """
  tree = Tree.empty(batch, fixed_tree_size(branching), vocab, len(branching), siblings)
  frontier = jnp.full((batch, 1), -1, jnp.int32)
  frontier_ok = jnp.ones((batch, 1), bool)
  start = 0
  for d, (k, key_d) in enumerate(zip(branching, jax.random.split(key, len(branching))), 1):
    logq, rank = _distributions(next_logits(tree, frontier), sampling)  # [B, W, V]
    tree = _set_q(tree, frontier, logq)
    toks, ok = _CHILDREN[siblings](key_d, logq, rank, k)  # [B, W, k]
    if greedy_rows is not None and siblings is not Siblings.FIXED:
      greedy = per_row(greedy_rows, toks)
      top, top_ok = _top_k_children(key_d, logq, rank, k)
      toks, ok = jnp.where(greedy, top, toks), jnp.where(greedy, top_ok, ok)
    W = frontier.shape[1]
    valid = (ok & frontier_ok[..., None]).reshape(batch, W * k)
    parents = jnp.repeat(frontier, k, axis=1)
    tree = _add_nodes(tree, start, toks.reshape(batch, W * k), parents, d, valid)
    frontier = jnp.broadcast_to(jnp.arange(start, start + W * k, dtype=jnp.int32), (batch, W * k))
    frontier_ok = valid
    start += W * k
  return tree


def draft_dynamic(next_logits: NextLogits, batch: int, vocab: int, *, depth: int, beam: int,
                  top_k: int, budget: int, sampling: SamplingParams) -> Tree:
  """EAGLE-2 dynamic tree: per depth expand the `beam` nodes of the newest layer with the highest
  cumulative draft log-probability by their top_k children each, then keep the `budget` best
  nodes of everything drafted (prune_to_budget on the cumulative log-probability).

  Children are deterministic (Siblings.FIXED), so sampled verification uses the FIXED rule.
  """
  sizes = [top_k]  # nodes per layer: the root's children, then `beam` (or fewer) parents' each
  for _ in range(depth - 1):
    sizes.append(min(beam, sizes[-1]) * top_k)
  tree = Tree.empty(batch, sum(sizes), vocab, depth, Siblings.FIXED)
  score = jnp.zeros((batch, sum(sizes)), jnp.float32)  # cumulative log q of each node
  frontier = jnp.full((batch, 1), -1, jnp.int32)
  frontier_ok = jnp.ones((batch, 1), bool)
  frontier_score = jnp.zeros((batch, 1), jnp.float32)
  start = 0
  for d, size in enumerate(sizes, 1):
    logq, rank = _distributions(next_logits(tree, frontier), sampling)  # [B, W, V]
    tree = _set_q(tree, frontier, logq)
    vals, toks = top_k_by_rows(rank, top_k, over_vocab=True)  # [B, W, k]
    valid = (frontier_ok[..., None] & (vals > -jnp.inf)).reshape(batch, size)
    cum = jnp.where(valid, (frontier_score[..., None] + vals).reshape(batch, size), -jnp.inf)
    tree = _add_nodes(tree, start, toks.reshape(batch, size),
                      jnp.repeat(frontier, top_k, axis=1), d, valid)
    score = score.at[:, start:start + size].set(cum)
    if d < depth:  # the next frontier: this layer's best `beam` nodes
      width = min(beam, size)
      frontier_score, best = top_k_by_rows(cum, width)
      frontier = (start + best).astype(jnp.int32)
      frontier_ok = frontier_score > -jnp.inf
    start += size
  return prune_to_budget(tree, score, budget)


def _log1mexp(a: Array) -> Array:
  """log(1 - exp(a)) for a <= 0, accurate on both sides of log(1/2)."""
  return jnp.where(a > -0.6931472, jnp.log(-jnp.expm1(a)), jnp.log1p(-jnp.exp(a)))


def truncated_gumbel(g: Array, z: Array, t: Array) -> Array:
  """Gumbels g [..., V] with maximum z [..., 1] conditioned to have maximum t [..., 1]:
  -log(exp(-t) - exp(-z) + exp(-g)), written stably (Kool et al. 2019, appendix)."""
  v = t - g + _log1mexp(jnp.minimum(g - z, 0.0))
  return t - jax.nn.softplus(v)


def draft_stochastic_beam(key: Array, next_logits: NextLogits, batch: int, vocab: int, *,
                          depth: int, beam: int, sampling: SamplingParams) -> Tree:
  """RSD-S: stochastic beam search (Kool et al. 2019) drafting sequences without replacement.

  Each layer keeps the `beam` candidates (over all frontier nodes' children) with the largest
  perturbed cumulative log-probability, a child's Gumbel conditioned on its parent's perturbed
  value; frontier nodes whose children all lose become leaves, so a node has 0..beam children.
  Layer d occupies nodes [(d-1)*beam, d*beam), sorted by perturbed value, which within one parent
  is the Gumbel-Top-k order of its children: Siblings.WITHOUT_REPLACEMENT. Size: depth * beam.
  """
  tree = Tree.empty(batch, depth * beam, vocab, depth, Siblings.WITHOUT_REPLACEMENT)
  frontier = jnp.full((batch, 1), -1, jnp.int32)
  frontier_ok = jnp.ones((batch, 1), bool)
  phi = jnp.zeros((batch, 1), jnp.float32)  # cumulative log q of the frontier nodes
  g = jnp.zeros((batch, 1), jnp.float32)  # their perturbed values (the root's is 0)
  for d, key_d in enumerate(jax.random.split(key, depth), 1):
    logq, _ = _distributions(next_logits(tree, frontier), sampling)  # [B, W, V]
    tree = _set_q(tree, frontier, logq)
    W = frontier.shape[1]
    phi_c = phi[..., None] + logq  # [B, W, V]
    ok = frontier_ok[..., None] & (logq > -jnp.inf)
    g_phi = jnp.where(ok, phi_c + jax.random.gumbel(key_d, phi_c.shape), -jnp.inf)
    z = jnp.max(g_phi, axis=-1, keepdims=True)  # [B, W, 1]
    safe_z = jnp.where(z > -jnp.inf, z, 0.0)
    g_c = jnp.where(ok, truncated_gumbel(jnp.where(ok, g_phi, safe_z), safe_z, g[..., None]),
                    -jnp.inf)
    # The top `beam` of all W x V children, taken as each node's top `beam` (over its vocabulary,
    # shard by shard where tp splits it) and then the top `beam` of those W x beam: the same
    # children in the same order, ties to the lower node and then the lower token.
    g_w, tok_w = top_k_by_rows(g_c, beam, over_vocab=True)  # [B, W, beam]
    g, at = top_k_by_rows(g_w.reshape(batch, W * beam), beam)  # [B, beam]
    valid = g > -jnp.inf
    tokens, parents = take(tok_w.reshape(batch, W * beam), at), at // beam
    # (XLA reads these from a vocabulary split in place: a small all-reduce, no gather.)
    logq_w = jnp.take_along_axis(logq, tok_w, axis=-1).reshape(batch, W * beam)
    phi = take(phi, parents) + take(logq_w, at)  # phi_c at the chosen children
    tree = _add_nodes(tree, (d - 1) * beam, tokens, take(frontier, parents), d, valid)
    frontier = jnp.broadcast_to(jnp.arange((d - 1) * beam, d * beam, dtype=jnp.int32),
                                (batch, beam))
    frontier_ok = valid
    phi, g = jnp.where(valid, phi, 0.0), jnp.where(valid, g, 0.0)
  return tree
