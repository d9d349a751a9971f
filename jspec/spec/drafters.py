"""Drafters: anything that proposes a block of candidate tokens with the probabilities it drew them from.

A drafter is a pytree (its weights are data, its configuration static), so every drafter plugs into
the same jitted speculative loop. The protocol is three pure functions:

  init(prompt, prompt_lengths, cache_size) -> state        once, after the target's prefill
  propose(state, last2, seq_len, key, sampling, gamma)      each round
      -> (tokens [B, G] int32, probs [B, G, V] float32, state)
  update(state, seq_len) -> state                           after verification

`last2` holds each row's last two known tokens and `seq_len` how many tokens the row knows (prompt
plus generated). `probs` are the *processed* distributions (temperature, top-k, top-p, exactly as
the verifier processes the target's) each token was sampled from.

Tree drafters (jspec.spec.tree_engine) add two functions, implemented by ModelDrafter:

  draft_tree(state, last2, seq_len, key, sampling, shape) -> (Tree, drafted)    each round
  accept_tree(drafted, path, n_accepted, seq_len) -> state                     after verification
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from jspec.models.cache import KVCache, move_kv
from jspec.models.config import Config
from jspec.models.llama import Params, forward, forward_at
from jspec.sampling.processing import SamplingParams, processed_logprobs
from jspec.spec.vocab_trim import check_keep_ids, to_full_vocab
from jspec.tree.structure import Tree, parent_of, take

Array = jax.Array


class Drafter(Protocol):
  vocab_size: int

  def init(self, prompt: Array, prompt_lengths: Array, cache_size: int) -> Any: ...

  def propose(self, state: Any, last2: Array, seq_len: Array, key: Array,
              sampling: SamplingParams, gamma: int) -> tuple[Array, Array, Any]: ...

  def update(self, state: Any, seq_len: Array) -> Any: ...


def sample_with_probs(key: Array, logits: Array, sampling: SamplingParams) -> tuple[Array, Array]:
  """(token [B], processed probs [B, V]); greedy gives the argmax and a one-hot distribution."""
  def greedy():
    token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return token, jax.nn.one_hot(token, logits.shape[-1], dtype=jnp.float32)

  def sampled():
    logprobs = processed_logprobs(logits, sampling)
    token = jax.random.categorical(key, logprobs, axis=-1).astype(jnp.int32)
    return token, jnp.exp(logprobs)

  return jax.lax.cond(sampling.is_greedy, greedy, sampled)


def sample_full_vocab(key: Array, logits: Array, sampling: SamplingParams, keep_ids: Array | None,
                      vocab_size: int) -> tuple[Array, Array]:
  """sample_with_probs over a head's logits [B, M]; with VocabTrim's `keep_ids` [M] the draw and
  q [B, V] are mapped back to the full vocabulary (q = 0 off the kept ids)."""
  token, probs = sample_with_probs(key, logits, sampling)
  if keep_ids is None:
    return token, probs
  return to_full_vocab(token, probs, keep_ids, vocab_size)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ModelDrafterState:
  cache: KVCache


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TreeDraftState:
  """A ModelDrafter's cache right after drafting a tree, and where each node's KV went."""

  cache: KVCache  # lengths = seq_len; fed nodes' KV at slots seq_len + kv_slot
  kv_slot: Array  # [B, N] int32 slot offset past seq_len of each node's KV; -1: never fed (leaf)


def _match_nodes(old: Tree, new: Tree) -> Array:
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


class _FrontierFeeder:
  """`next_logits(tree, frontier)` (jspec.tree.draft) over a ModelDrafter and its cache.

  The draft schedules call it once per depth in a Python loop, so within one trace it threads the
  cache through itself. Call 1 (frontier = the root) returns the logits the last two known tokens
  gave; each later call is ONE forward over the W frontier tokens at positions seq_len - 1 + depth,
  written in call order at slots seq_len + 0, 1, ..., each seeing the committed prefix and the
  slots of its ancestors. `kv_slot` [B, N] records where each fed node's KV went.
  """

  def __init__(self, drafter: "ModelDrafter", cache: KVCache, root_logits: Array,
               seq_len: Array):
    self.drafter, self.cache, self.root_logits, self.seq_len = drafter, cache, root_logits, seq_len
    self.kv_slot = None  # [B, N] once the root call has seen the tree's size
    self.fed = 0  # slots used so far (static)
    self.last_tree = None  # the tree at the last forward: every fed node is in it

  def __call__(self, tree: Tree, frontier: Array) -> Array:
    B, W = frontier.shape
    if self.kv_slot is None:
      assert W == 1, "the first next_logits call of a draft schedule is the root's"
      self.kv_slot = jnp.full(tree.tokens.shape, -1, jnp.int32)
      return self.root_logits  # [B, 1, V]
    rows = jnp.arange(B)[:, None]
    offset = jnp.broadcast_to(self.fed + jnp.arange(W, dtype=jnp.int32), (B, W))
    self.kv_slot = self.kv_slot.at[rows, frontier].set(offset)
    S = self.cache.size
    # Slots each frontier token sees: the committed prefix, then its own and its ancestors'.
    line, cur = [frontier], frontier
    for _ in range(tree.max_depth - 1):
      cur = parent_of(tree, cur)
      line.append(cur)
    line = jnp.stack(line, axis=-1)  # [B, W, D] the node and its ancestors, -1 past the root
    slot = jnp.where(line >= 0, take(self.kv_slot, line), -1)  # [B, W, D]
    seen = jnp.where(slot >= 0, self.seq_len[:, None, None] + slot, S)  # [B, W, D]
    visible = jnp.broadcast_to((jnp.arange(S) < self.seq_len[:, None])[:, None], (B, W, S))
    visible = visible.at[rows[..., None], jnp.arange(W)[:, None], seen].set(True, mode="drop")
    positions = self.seq_len[:, None] - 1 + take(tree.depth, frontier)  # [B, W]
    logits, self.cache = forward_at(
        self.drafter.params, self.drafter.cfg, take(tree.tokens, frontier), positions, self.cache,
        self.seq_len[:, None] + offset, visible)
    self.fed += W
    self.last_tree = tree
    return self.drafter._full_logits(logits)

  def result(self, tree: Tree, reindexed: bool) -> TreeDraftState:
    """The draft state for the schedule's final `tree` (`reindexed`: pruned after drafting)."""
    kv_slot = self.kv_slot
    if reindexed:
      if self.last_tree is None:
        kv_slot = jnp.full(tree.tokens.shape, -1, jnp.int32)
      else:
        old = _match_nodes(self.last_tree, tree)
        kv_slot = jnp.where(old >= 0, take(kv_slot, old), -1)
    assert kv_slot.shape == tree.tokens.shape, (kv_slot.shape, tree.tokens.shape)
    return TreeDraftState(cache=self.cache, kv_slot=kv_slot)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ModelDrafter:
  """An independent (smaller) LM sharing the target's tokenizer, with its own KV cache.

  Each round it re-reads the row's last two tokens (the second is new; the first is new when the
  previous block was accepted whole and the draft never saw its last token), then drafts the rest
  one token at a time. Rollback is implicit: the cache length is set from `seq_len` every round.

  `keep_ids` [M] (VocabTrim, build with `trimmed_drafter`): the LM head emits only these ids
  (params.lm_head is [E, M]); draws and probabilities are mapped back to the full vocabulary,
  q = 0 elsewhere.
  """

  params: Params
  cfg: Config = dataclasses.field(metadata=dict(static=True))
  keep_ids: Array | None = None

  @property
  def vocab_size(self) -> int:
    return self.cfg.vocab_size

  def _sample(self, key: Array, logits: Array, sampling: SamplingParams) -> tuple[Array, Array]:
    return sample_full_vocab(key, logits, sampling, self.keep_ids, self.cfg.vocab_size)

  def init(self, prompt: Array, prompt_lengths: Array, cache_size: int) -> ModelDrafterState:
    B, P = prompt.shape
    cache = KVCache.init(self.cfg, B, cache_size, self.params.embed.dtype)
    positions = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, P))
    # Only the cache matters here; logits at one position keep the LM head cheap.
    _, _, cache = forward(self.params, self.cfg, prompt, positions, cache,
                          logits_indices=(prompt_lengths - 1)[:, None])
    return ModelDrafterState(cache=cache.with_lengths(prompt_lengths))

  def propose(self, state: ModelDrafterState, last2: Array, seq_len: Array, key: Array,
              sampling: SamplingParams, gamma: int, pick: Callable | None = None):
    """`pick(i, tokens, token, probs) -> (token, probs)` may replace draft i (e.g. by an n-gram
    lookup, jspec.spec.ngram) given the drafts so far `tokens` [B, gamma] (valid below i); the
    drafter then reads the replacement, so its cache follows what is proposed."""
    pick = pick or (lambda i, tokens, token, probs: (token, probs))
    B = last2.shape[0]
    V = self.cfg.vocab_size
    keys = jax.random.split(key, gamma)
    start = seq_len - 2
    cache = state.cache.with_lengths(start)
    positions = start[:, None] + jnp.arange(2, dtype=jnp.int32)  # [B, 2]
    logits, _, cache = forward(self.params, self.cfg, last2, positions, cache,
                               logits_indices=jnp.ones((B, 1), jnp.int32))
    cache = cache.commit(2)
    tokens = jnp.zeros((B, gamma), jnp.int32)
    token, probs = pick(0, tokens, *self._sample(keys[0], logits[:, 0], sampling))
    tokens = tokens.at[:, 0].set(token)
    all_probs = jnp.zeros((B, gamma, V), jnp.float32).at[:, 0].set(probs)

    def step(i, carry):
      tokens, all_probs, cache = carry
      prev = jax.lax.dynamic_slice_in_dim(tokens, i - 1, 1, axis=1)  # [B, 1]
      logits, _, cache = forward(self.params, self.cfg, prev, cache.lengths[:, None], cache)
      token, probs = pick(i, tokens, *self._sample(keys[i], logits[:, 0], sampling))
      tokens = jax.lax.dynamic_update_slice_in_dim(tokens, token[:, None], i, axis=1)
      all_probs = jax.lax.dynamic_update_slice_in_dim(all_probs, probs[:, None], i, axis=1)
      return tokens, all_probs, cache.commit(1)

    tokens, all_probs, cache = jax.lax.fori_loop(1, gamma, step, (tokens, all_probs, cache))
    return tokens, all_probs, ModelDrafterState(cache=cache)

  def update(self, state: ModelDrafterState, seq_len: Array) -> ModelDrafterState:
    return state  # the next propose() sets the cache length from seq_len

  def _full_logits(self, logits: Array) -> Array:
    """Head logits [..., M] in the full vocabulary [..., V]: -inf off the kept ids (VocabTrim)."""
    if self.keep_ids is None:
      return logits
    full = jnp.full(logits.shape[:-1] + (self.cfg.vocab_size,), -jnp.inf, logits.dtype)
    return full.at[..., self.keep_ids].set(logits)

  def draft_tree(self, state: ModelDrafterState, last2: Array, seq_len: Array, key: Array,
                 sampling: SamplingParams, shape) -> tuple[Tree, TreeDraftState]:
    """Draft a token tree below the last known token with `shape.draft` (a jspec.tree.draft
    schedule, see jspec.spec.tree_engine): the last two known tokens are fed as in `propose`,
    then one forward per depth over the frontier (see _FrontierFeeder). Tokens and q are in the
    full vocabulary. When `shape.greedy_variant`, a lax.cond drafts the temperature-0 variant.
    """
    B = last2.shape[0]
    start = seq_len - 2
    positions = start[:, None] + jnp.arange(2, dtype=jnp.int32)  # [B, 2]
    logits, _, cache = forward(self.params, self.cfg, last2, positions,
                               state.cache.with_lengths(start),
                               logits_indices=jnp.ones((B, 1), jnp.int32))
    root_logits = self._full_logits(logits)  # [B, 1, V]

    def run(greedy: bool, cache: KVCache) -> tuple[Tree, TreeDraftState]:
      feeder = _FrontierFeeder(self, cache, root_logits, seq_len)
      tree = shape.draft(key, feeder, B, self.cfg.vocab_size, sampling, greedy=greedy)
      return tree, feeder.result(tree, shape.reindexes)

    cache = cache.commit(2)  # lengths = seq_len: the prefix every node sees
    if shape.greedy_variant:
      return jax.lax.cond(sampling.is_greedy, lambda c: run(True, c), lambda c: run(False, c),
                          cache)
    return run(False, cache)

  def accept_tree(self, drafted: TreeDraftState, path: Array, n_accepted: Array,
                  seq_len: Array) -> ModelDrafterState:
    """Keep the accepted path's draft KV: node path[j] moves to slot seq_len + j for j < n - 1
    (the last accepted token and the target's next one are fed next round, as in `propose`)."""
    src = jnp.where(path >= 0, take(drafted.kv_slot, path), -1)  # [B, D]
    return ModelDrafterState(cache=move_kv(drafted.cache, seq_len, src, n_accepted - 1))


def self_drafter(params: Params, cfg: Config) -> ModelDrafter:
  """The target as its own draft: the engine's sanity check (greedy accepts every token)."""
  return ModelDrafter(params=params, cfg=cfg)


def early_exit_drafter(params: Params, cfg: Config, num_layers: int) -> ModelDrafter:
  """The target's first `num_layers` layers, final norm and LM head as an independent draft.

  Costs no training and shares the weights (not the KV cache) with the target.
  """
  draft_cfg = dataclasses.replace(cfg, num_layers=num_layers)
  return ModelDrafter(dataclasses.replace(params, layers=params.layers[:num_layers]), draft_cfg)


def trimmed_drafter(params: Params, cfg: Config, keep_ids) -> ModelDrafter:
  """A ModelDrafter whose head [E, M] emits only `keep_ids` [M] (see jspec.spec.vocab_trim)."""
  keep = check_keep_ids(np.asarray(keep_ids), cfg.vocab_size)
  head = params.lm_head
  if head is None or head.shape[-1] != len(keep):
    raise ValueError(f"a trimmed drafter needs an LM head [E, {len(keep)}] for its {len(keep)} "
                     f"kept ids, got {None if head is None else tuple(head.shape)}; build the "
                     f"params with jspec.spec.vocab_trim.trim_head")
  return ModelDrafter(params=params, cfg=cfg, keep_ids=jnp.asarray(keep))
