"""Repetition, presence and frequency penalties: the next token's law made to depend on the text so
far, and kept exact under speculative decoding.

  repetition_penalty r   (CTRL, Keskar et al. 1909.05858; transformers' RepetitionPenalty
                         LogitsProcessor; vLLM) a token that appears in the prompt or the output
                         has its logit divided by r when positive, multiplied by r when not.
  presence_penalty a,    (OpenAI's API; vLLM) a token generated c times so far loses
  frequency_penalty f    a * [c > 0] + f * c from its logit; the prompt does not count.

They change the raw logits, before temperature and the filters (transformers' and vLLM's order).
Greedy decoding takes the argmax of the penalized logits.

Under speculative decoding the law at each verified position depends on the draft tokens before
it: position i of a chain block [last, d_1 .. d_G] follows the committed text and d_1 .. d_i, a tree
node its root-to-node path. `penalize` takes those tokens (`paths`), so the target's distribution
at every position is the one autoregressive decoding would use after that prefix, and greedy and
lossless sampled verification stay exact. Drafters propose without penalties unless asked
(`Drafter.with_draft_penalties`: `chain_draft_penalty` in their chain loop, counting their own
earlier drafts; `tree_draft_penalty` at each tree frontier, counting each node's path; on by
default for the target as its own drafter and for layer skipping): that changes how often they
are accepted, never what is emitted. The history counts text, not cache entries: a KV budget's
evictions do not change it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jspec.sampling.processing import SamplingParams, per_row
from jspec.tree.structure import Tree, parent_of, take

Array = jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class History:
  """What the penalties read of the text so far, per row."""

  in_prompt: Array  # [B, V] bool: the token appears in the prompt
  counts: Array  # [B, V] int32: times the token was generated

  @classmethod
  def of_prompt(cls, prompt: Array, lengths: Array, vocab_size: int) -> "History":
    """The history before the first generated token: prompt [B, P] right-padded to lengths [B]."""
    B, P = prompt.shape
    cols = jnp.where(jnp.arange(P) < lengths[:, None], prompt, vocab_size)  # padding: dropped
    rows = jnp.broadcast_to(jnp.arange(B)[:, None], (B, P))
    in_prompt = jnp.zeros((B, vocab_size), bool).at[rows, cols].set(True, mode="drop")
    return cls(in_prompt=in_prompt, counts=jnp.zeros((B, vocab_size), jnp.int32))

  def add(self, tokens: Array, valid: Array) -> "History":
    """The history after generating tokens [B, W] where valid [B, W] (in any order)."""
    B, W = tokens.shape
    V = self.counts.shape[1]
    cols = jnp.where(valid & (tokens >= 0), tokens, V)
    rows = jnp.broadcast_to(jnp.arange(B)[:, None], (B, W))
    return History(in_prompt=self.in_prompt,
                   counts=self.counts.at[rows, cols].add(1, mode="drop"))


def start_history(sampling: SamplingParams, prompt: Array, lengths: Array,
                  vocab_size: int) -> History | None:
  """The loop state's history, or None when the program needs none (penalties statically off)."""
  return History.of_prompt(prompt, lengths, vocab_size) if sampling.needs_history else None


def _penalized(x: Array, seen: Array, count: Array, sp: SamplingParams) -> Array:
  """x with the penalties of tokens `seen` (prompt or output) and generated `count` times."""
  setting = lambda value: per_row(jnp.asarray(value, jnp.float32), x)  # one, or one per row
  r = setting(sp.repetition_penalty)
  x = jnp.where(seen, jnp.where(x > 0, x / r, x * r), x)
  return x - setting(sp.presence_penalty) * (count > 0) - setting(sp.frequency_penalty) * count


def penalize(logits: Array, history: History | None, sp: SamplingParams,
             paths: Array | None = None) -> Array:
  """logits [B, V] or [B, T, V] penalized for the text so far (float32; as they were, when the
  penalties are statically off).

  paths [B, T, M] int32 (-1 padded): the tokens between the history and each of the T positions,
  in any order (a chain's drafts before the position, a tree node's path): position t's law is the
  one after history + paths[:, t]. Only those M tokens a position differ from the shared part, so
  the cost is one pass over the logits and a gather/scatter of B x T x M entries.
  """
  on = sp.penalized
  if on is False:
    return logits
  if history is None:
    if on is True:
      raise ValueError("penalties are on but there is no History of the text to count: build "
                       "the loop state with start_history (jspec.sampling.penalties)")
    return logits
  # Decided inside the program (mode=None): computed either way, no lax.cond (on a GPU each is a
  # round trip to the host every step); at the defaults (r = 1, a = f = 0) the formula returns
  # every logit exactly as it was (x / 1, x * 1, x - 0).
  return _penalize(logits, history, sp, paths)


def _penalize(logits: Array, history: History, sp: SamplingParams, paths: Array | None) -> Array:
  x = logits.astype(jnp.float32)
  expand = (lambda a: a) if x.ndim == 2 else (lambda a: a[:, None])  # [B, V] against x
  counts = history.counts
  out = _penalized(x, expand(history.in_prompt | (counts > 0)), expand(counts), sp)
  if paths is None:
    return out
  B, T, M = paths.shape
  V = x.shape[-1]
  on = paths >= 0
  tok = jnp.where(on, paths, 0)  # [B, T, M]
  # A path token's count: the history's, plus its occurrences on the path itself.
  repeats = jnp.sum((paths[..., :, None] == paths[..., None, :]) & on[..., None, :], axis=-1)
  flat = tok.reshape(B, T * M)
  count = jnp.take_along_axis(counts, flat, axis=1).reshape(B, T, M) + repeats
  seen = jnp.take_along_axis(history.in_prompt, flat, axis=1).reshape(B, T, M) | (count > 0)
  fixed = _penalized(jnp.take_along_axis(x, tok, axis=-1), seen, count, sp)  # [B, T, M]
  b, t = jnp.broadcast_to(jnp.arange(B)[:, None, None], (B, T, M)), jnp.broadcast_to(
      jnp.arange(T)[None, :, None], (B, T, M))
  # A token twice on one path gets the same value twice; padding goes out of range, dropped.
  return out.at[b, t, jnp.where(on, tok, V)].set(fixed, mode="drop")


def chain_draft_penalty(history: History | None, sp: SamplingParams):
  """For a drafter's chain loop (jspec.drafting.base.draft_chain): penalty(logits [B, V], tokens
  [B, gamma], i) -> draft i's logits penalized for the history and drafts 0 .. i-1; None without a
  history. A drafter that proposes under the target's penalties is accepted more often; the
  output does not depend on it."""
  if history is None:
    return None

  def penalty(logits: Array, tokens: Array, i) -> Array:
    before = jnp.where(jnp.arange(tokens.shape[1]) < i, tokens, -1)  # [B, gamma]
    return penalize(logits[:, None], history, sp, before[:, None])[:, 0]

  return penalty


def chain_paths(drafts: Array) -> Array:
  """[B, G + 1, G] for a chain block [last, d_1 .. d_G] (drafts [B, G]): position i follows
  d_1 .. d_i (the rest -1)."""
  B, G = drafts.shape
  before = jnp.arange(G)[None, :] < jnp.arange(G + 1)[:, None]  # [G + 1, G]
  return jnp.where(before[None], drafts[:, None, :], -1)


def node_paths(tree: Tree, node: Array) -> Array:
  """[B, W, D] for nodes [B, W] of a tree (D = tree.max_depth): each node's path, itself back to
  the root's child (-1 padded; the root, -1, has an empty path)."""
  columns = []
  for _ in range(tree.max_depth):
    columns.append(jnp.where(node >= 0, take(tree.tokens, node), -1))
    node = parent_of(tree, node)
  return jnp.stack(columns, axis=-1).astype(jnp.int32)


def tree_paths(tree: Tree) -> Array:
  """[B, N + 1, D] for a tree block [root, nodes] (D = tree.max_depth): the root follows nothing
  new, node n the tokens of its path (`node_paths`; an invalid node: all -1)."""
  B, N = tree.tokens.shape
  nodes = node_paths(tree, jnp.where(tree.valid, jnp.arange(N, dtype=jnp.int32), -1))
  return jnp.concatenate([jnp.full((B, 1, tree.max_depth), -1, jnp.int32), nodes], axis=1)


def tree_draft_penalty(history: History | None, sp: SamplingParams):
  """For a tree drafter's frontier (jspec.tree.draft's next_logits): penalty(logits [B, W, V],
  tree, frontier [B, W]) -> each frontier node's children's logits penalized for the history and
  the node's path, the law the target verifies them under; None without a history."""
  if history is None:
    return None
  return lambda logits, tree, frontier: penalize(logits, history, sp, node_paths(tree, frontier))
