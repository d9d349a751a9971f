"""Verification of a token tree (jspec.tree.structure.Tree): greedy path matching and lossless
multi-draft recursive rejection sampling (SpecInfer 2305.09781; RSD 2402.14160).

Layout: target_logits [B, N + 1, V] per context slot like the tree's q: slot 0 is the root's
context (it predicts the root's children), slot n + 1 the context ending at node n. Every verifier
returns `(path [B, D] int32, n_accepted [B] int32, next_token [B] int32)`: the accepted root-to-node
path (node indices, -1 padded, D = tree.max_depth), its length, and the target's token after it
(the correction after a rejection, or the bonus token after a leaf). All functions are pure and
jit/vmap-friendly; N, D and the sibling rule (tree.siblings) are static.

Sampled verification walks the nodes once in index order (topological, siblings in draw order).
At the current node it tests each child x_i against the current target distribution p_i with the
proposal q_i the child was drawn from: accept with probability min(1, p_i(x_i) / q_i(x_i)) and
descend (p becomes the target's distribution at the child); on rejection
p_{i+1} = normalize(max(p_i - q_i, 0)). When no child is accepted the next token is drawn from the
final p (the residual, or the plain target distribution at a leaf). The output is distributed as
the target's whenever each x_i ~ q_i given the earlier siblings, which is what the proposals are:

  IID                  q_i = q (SpecInfer).
  WITHOUT_REPLACEMENT  q_i = q with x_1..x_{i-1} removed, renormalised (RSD-C and RSD-S).
  FIXED                q_i = one-hot(x_i): accept with probability p_i(x_i) (top-k / EAGLE-2).

The recursion (RSD, Theorem 3.1) holds for any number of children, including a random one, as long
as the decision to draw child i + 1 does not depend on which token child i + 1 is. RSD-S meets it:
a parent's children are the head of its own Gumbel-Top-k sequence, cut where their perturbed values
fall below the other beams' ones; in the exponential-race view of the Gumbels the value of the
i-th draw depends on the identities of draws 1..i-1 only, never on the identity of draw i.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jspec.sampling.processing import SamplingParams, argmax, processed_logprobs, switch
from jspec.sampling.verify import accept_draw, in_vocabulary, residual_distribution
from jspec.sharding import get_rows
from jspec.tree.structure import Siblings, Tree, ancestor_mask, path_to, path_tokens, take

Array = jax.Array


def check_tree_logits(tree: Tree, target_logits: Array,
                      target_logprobs: Array | None = None) -> None:
  """Host-side: the target's logits (and log-probabilities) hold the root's context and each
  node's, [B, N + 1, V], as the tree's q does (a missing slot was clipped onto another node's
  context: a plausible wrong path, no error)."""
  B, N = tree.tokens.shape
  for name, x in (("target_logits", target_logits), ("target_logprobs", target_logprobs)):
    if x is not None and (x.ndim != 3 or x.shape[:2] != (B, N + 1)):
      raise ValueError(f"{name} must be [B, N + 1, V] = [{B}, {N + 1}, V] for a tree of {N} "
                       f"nodes (the root's context first, then each node's), got {x.shape}")
  if tree.q.shape[:2] != (B, N + 1) or tree.q.shape[-1] != target_logits.shape[-1]:
    raise ValueError(f"the tree's q must be [B, N + 1, V] like target_logits "
                     f"{target_logits.shape}, got {tree.q.shape}")


def verify_tree_greedy(tree: Tree, target_logits: Array) -> tuple[Array, Array, Array]:
  """Accept the deepest path whose every token is the target's argmax at its parent's context.

  Ties between equally deep paths (duplicate siblings) go to the lowest node index.
  """
  check_tree_logits(tree, target_logits)
  best = argmax(target_logits)  # [B, N+1]
  ok = tree.valid & (tree.tokens == take(best, tree.parents + 1))  # [B, N]
  path_ok = tree.valid & jnp.all(~ancestor_mask(tree) | ok[:, None, :], axis=-1)  # [B, N]
  deepest = jnp.argmax(jnp.where(path_ok, tree.depth, 0), axis=-1).astype(jnp.int32)
  node = jnp.where(jnp.any(path_ok, axis=-1), deepest, -1)
  path, n_accepted = path_to(tree, node)
  return path, n_accepted, take(best, node + 1)


def _proposal_iid(q: Array, excluded: Array, x: Array) -> Array:
  return q


def _proposal_without_replacement(q: Array, excluded: Array, x: Array) -> Array:
  rest = jnp.where(excluded, 0.0, q)
  total = jnp.sum(rest, axis=-1, keepdims=True)
  return rest / jnp.where(total > 0, total, 1.0)


def _proposal_fixed(q: Array, excluded: Array, x: Array) -> Array:
  return jax.nn.one_hot(x, q.shape[-1], dtype=q.dtype)


# (q at the parent [B, V], earlier siblings' tokens [B, V] bool, child token [B]) -> q_i [B, V]
PROPOSALS = {Siblings.IID: _proposal_iid, Siblings.FIXED: _proposal_fixed,
             Siblings.WITHOUT_REPLACEMENT: _proposal_without_replacement}


def verify_tree_sampled(key: Array, tree: Tree, target_logits: Array, sampling: SamplingParams,
                        target_logprobs: Array | None = None) -> tuple[Array, Array, Array]:
  """Lossless multi-draft recursive rejection; the rule for siblings comes from tree.siblings.

  target_logits [B, N + 1, V] are processed here with `sampling`, as the tree's q was drafted
  (target_logprobs: processed already, when the caller has them).
  """
  check_tree_logits(tree, target_logits, target_logprobs)
  B, N = tree.tokens.shape
  k_accept, k_next = jax.random.split(key)
  proposal = PROPOSALS[tree.siblings]
  if target_logprobs is None:
    target_logprobs = processed_logprobs(target_logits, sampling)
  p = jnp.exp(target_logprobs)  # [B, N+1, V]
  u = jax.random.uniform(k_accept, (B, N), jnp.float32)
  at = lambda x, i: jax.lax.dynamic_index_in_dim(x, i, axis=1, keepdims=False)

  def step(carry, n):
    cur, target, q_cur, excluded = carry  # [B], [B, V] (normalised p_i), [B, V], [B, V] bool
    x = at(tree.tokens, n)  # [B]
    child = at(tree.valid, n) & (at(tree.parents, n) == cur) & in_vocabulary(x, p.shape[-1])
    q_i = proposal(q_cur, excluded, x)  # [B, V]
    of_x = lambda dist: get_rows(dist, x[:, None])[:, 0]  # dist[b, x[b]]
    accept = child & accept_draw(at(u, n), of_x(target), of_x(q_i))
    reject = child & ~accept
    residual = residual_distribution(target, q_i)
    residual = residual / jnp.sum(residual, axis=-1, keepdims=True)
    target = jnp.where(accept[:, None], at(p, n + 1),
                       jnp.where(reject[:, None], residual, target))
    q_cur = jnp.where(accept[:, None], at(tree.q, n + 1), q_cur)
    excluded = jnp.where(accept[:, None], False, excluded | (reject[:, None] & (
        jnp.arange(excluded.shape[-1]) == x[:, None])))
    return (jnp.where(accept, n, cur), target, q_cur, excluded), None

  init = (jnp.full((B,), -1, jnp.int32), p[:, 0], tree.q[:, 0], jnp.zeros(p[:, 0].shape, bool))
  (node, target, _, _), _ = jax.lax.scan(step, init, jnp.arange(N, dtype=jnp.int32))
  path, n_accepted = path_to(tree, node)
  # log(0) = -inf drops a token from the categorical; the residual keeps a positive entry.
  next_token = jax.random.categorical(k_next, jnp.log(target), axis=-1).astype(jnp.int32)
  return path, n_accepted, next_token


def verify_tree(key: Array, tree: Tree, target_logits: Array, sampling: SamplingParams,
                target_logprobs: Array | None = None) -> tuple[Array, Array, Array]:
  """Greedy tree verification at temperature 0, recursive rejection otherwise; one program.
  target_logprobs: the target's processed log-probabilities, when the caller has them."""
  return switch(
      sampling.is_greedy,
      lambda: verify_tree_greedy(tree, target_logits),
      lambda: verify_tree_sampled(key, tree, target_logits, sampling, target_logprobs),
      rows=True)


def emitted_tokens(tree: Tree, path: Array, n_accepted: Array, next_token: Array) -> Array:
  """[B, D + 1] tokens a round emits: the accepted path, then next_token; -1 after it."""
  tokens = jnp.pad(path_tokens(tree, path), ((0, 0), (0, 1)), constant_values=-1)
  return jnp.where(jnp.arange(tokens.shape[1]) == n_accepted[:, None], next_token[:, None], tokens)
