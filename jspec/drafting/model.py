"""Model drafters: an independent LM with the target's tokenizer and its own KV cache, and the
drafters built from the target itself (self, early-exit) or with a VocabTrim head."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jspec.drafting.base import (DraftState, Features, HeadDrafter, Pick, check_stop, draft_chain,
                                 unsure)
from jspec.drafting.frontier import KVFrontierFeeder
from jspec.kv.evict import evict_when_full
from jspec.kv.policy import KVPolicy
from jspec.kv.prefill import chunked_prefill
from jspec.models.attention import attention_slots
from jspec.models.cache import KVCache, move_kv
from jspec.models.config import Config
from jspec.models.llama import Params, check_params, first_layers, forward, forward_at
from jspec.models.vocab_trim import check_keep_ids
from jspec.sampling.processing import SamplingParams
from jspec.tree.structure import Tree, take

Array = jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ModelDraftState(DraftState):
  cache: KVCache
  # Under a KV budget: entries evicted per row, so the cache holds seq_len - 2 - evicted entries
  # between rounds and RoPE positions still count from the prompt's start.
  evicted: Array | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ModelTreeState(DraftState):
  """The drafter's cache right after drafting a tree, and where each node's KV went."""

  cache: KVCache  # lengths = seq_len; fed nodes' KV at slots seq_len + kv_slot
  kv_slot: Array  # [B, N] int32 slot offset past seq_len of each node's KV; -1: never fed (leaf)
  evicted: Array | None = None  # as in ModelDraftState


def _evicted(state: ModelDraftState | ModelTreeState) -> Array | int:
  """What to add to a slot count to get a RoPE position: the entries evicted so far (0 without a
  budget)."""
  return 0 if state.evicted is None else state.evicted


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ModelDrafter(HeadDrafter):
  """An independent (smaller) LM sharing the target's tokenizer, with its own KV cache.

  Each round it re-reads the row's last two tokens (the second is new; the first is new when the
  previous block was accepted whole and the draft never saw its last token), then drafts the rest
  one token at a time. Rollback is implicit: the cache length is set from `seq_len` every round.

  `keep_ids` [M] (VocabTrim, build with `trimmed_drafter`): the LM head emits only these ids
  (params.lm_head is [E, M]); draws and probabilities are mapped back to the full vocabulary,
  q = 0 elsewhere.

  `kv` (set with `with_kv`, which the engines call with their `draft_kv`): the drafter's own cache
  under a key-scored KV budget, `kv_slots` slots whatever the prompt length: the prompt is
  prefilled in chunks and the committed entries are evicted between rounds on decoding's schedule
  (`evict_when_full`). The drafter only proposes, so this changes acceptance, never the output.
  """

  params: Params
  cfg: Config = dataclasses.field(metadata=dict(static=True))
  keep_ids: Array | None = None
  kv: KVPolicy | None = dataclasses.field(default=None, metadata=dict(static=True))
  kv_slots: int = dataclasses.field(default=0, metadata=dict(static=True))
  kv_drop: int = dataclasses.field(default=0, metadata=dict(static=True))
  stop_below: float | None = dataclasses.field(default=None, metadata=dict(static=True))
  # Propose under the target's penalties (jspec.sampling.penalties; with_draft_penalties).
  draft_penalties: bool = dataclasses.field(default=False, metadata=dict(static=True))

  def check_weights(self, target_cfg: Config) -> None:
    check_params(self.params, self.cfg, full_head=self.keep_ids is None,
                 what="the draft model's params")

  @property
  def stops_early(self) -> bool:
    return self.stop_below is not None

  def with_stop(self, threshold: float) -> ModelDrafter:
    return dataclasses.replace(self, stop_below=check_stop(threshold))

  def with_kv(self, policy: KVPolicy | None, room: int) -> ModelDrafter:
    if policy is None:
      return dataclasses.replace(self, kv=None, kv_slots=0, kv_drop=0)
    if not isinstance(policy, KVPolicy):
      raise TypeError(f"draft_kv must be a jspec.kv.policy.KVPolicy, got {type(policy).__name__}")
    if policy.needs_attention:
      raise ValueError(f"draft_kv method {policy.method!r} scores by attention, which a drafter's "
                       f"forwards do not record. Fix: draft_kv method 'keydiff' or 'streaming'.")
    # Between rounds at most budget + evict_every - 1 entries stay; a round feeds `room` more: the
    # most an eviction drops (its selection's width; the prefill's chunk may need more slots).
    drop = policy.evict_every - 1 + room
    slots = attention_slots(self.cfg, policy.budget + max(policy.chunk, drop))
    return dataclasses.replace(self, kv=policy, kv_slots=slots, kv_drop=drop)

  def init(self, prompt: Array, prompt_lengths: Array, cache_size: int,
           features: Features) -> ModelDraftState:
    B, P = prompt.shape
    if self.kv is not None:
      # All but the last prompt token: each round re-reads the last two known tokens.
      cache = KVCache.init(self.cfg, B, self.kv_slots, self.params.embed.dtype)
      _, cache, evicted, _ = chunked_prefill(self.params, self.cfg, prompt, prompt_lengths - 1,
                                             cache, self.kv)
      return ModelDraftState(cache=cache, evicted=evicted)
    cache = KVCache.init(self.cfg, B, cache_size, self.params.embed.dtype)
    positions = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, P))
    # Only the cache matters here; logits at one position keep the LM head cheap.
    _, _, cache = forward(self.params, self.cfg, prompt, positions, cache,
                          logits_indices=(prompt_lengths - 1)[:, None])
    return ModelDraftState(cache=cache.with_lengths(prompt_lengths))

  def _feed(self, state: ModelDraftState, tokens: Array, seq_len: Array
            ) -> tuple[Array, KVCache]:
    """Feed tokens [B, W] at positions seq_len - 2 onward: (logits [B, 1, M] after the second,
    the cache holding seq_len - 2 + W (less the evicted) entries)."""
    B, W = tokens.shape
    start = seq_len - 2
    positions = start[:, None] + jnp.arange(W, dtype=jnp.int32)  # [B, W]
    logits, _, cache = forward(self.params, self.cfg, tokens, positions,
                               state.cache.with_lengths(start - _evicted(state)),
                               logits_indices=jnp.ones((B, 1), jnp.int32))
    return logits, cache.commit(W)

  def _read_last2(self, state: ModelDraftState, last2: Array, seq_len: Array
                  ) -> tuple[Array, KVCache]:
    """Feed the last two known tokens at seq_len - 2, seq_len - 1: (logits [B, 1, M] for the next
    token, the cache holding seq_len (less the evicted) entries)."""
    return self._feed(state, last2, seq_len)

  def propose(self, state: ModelDraftState, last2: Array, seq_len: Array, key: Array,
              sampling: SamplingParams, gamma: int, pick: Pick | None = None, *,
              penalty_history=None):
    logits, cache = self._read_last2(state, last2, seq_len)
    offset = _evicted(state)

    def step(cache: KVCache, prev: Array):
      logits, _, cache = forward(self.params, self.cfg, prev[:, None],
                                 (cache.lengths + offset)[:, None], cache)
      return logits[:, 0], cache.commit(1)

    tokens, probs, cache = draft_chain(key, gamma, logits[:, 0], cache, step,
                                       self.sampler(sampling), pick,
                                       None if self.stop_below is None else unsure(self.stop_below),
                                       self.draft_penalty(penalty_history, sampling))
    return tokens, probs, ModelDraftState(cache=cache, evicted=state.evicted)

  catches_up = True

  def catch_up(self, state: ModelDraftState, tokens: Array, seq_len: Array) -> ModelDraftState:
    """One forward over the skipped round's tokens writes the entries its propose would have."""
    _, cache = self._feed(state, tokens, seq_len)
    return ModelDraftState(cache=cache, evicted=state.evicted)

  def _evict_known(self, cache: KVCache, seq_len: Array, evicted: Array) -> ModelDraftState:
    """Under a budget: keep the entries of positions < seq_len - 2 (what the next round does not
    re-read), then evict on decoding's schedule."""
    cache, dropped = evict_when_full(self.kv, cache.with_lengths(seq_len - 2 - evicted), evicted,
                                     max_drop=self.kv_drop)
    return ModelDraftState(cache=cache, evicted=evicted + dropped)

  def update(self, state: ModelDraftState, seq_len: Array, features: Features
             ) -> ModelDraftState:
    if self.kv is None:
      return state  # the next propose() sets the cache length from seq_len
    return self._evict_known(state.cache, seq_len, state.evicted)

  def tree_feeder(self, state: ModelDraftState, last2: Array, seq_len: Array) -> KVFrontierFeeder:
    """The last two known tokens are fed as in `propose`; a frontier at depth d sits at positions
    seq_len - 1 + d, its KV past the seq_len committed slots."""
    logits, cache = self._read_last2(state, last2, seq_len)

    def run(tree: Tree, frontier: Array, slots: Array, visible: Array, cache: KVCache):
      positions = seq_len[:, None] - 1 + take(tree.depth, frontier)  # [B, W]
      logits, cache = forward_at(self.params, self.cfg, take(tree.tokens, frontier), positions,
                                 cache, slots, visible)
      return self.full_logits(logits), cache

    return KVFrontierFeeder(cache, self.full_logits(logits), cache.lengths, run,
                            lambda cache, kv_slot: ModelTreeState(cache=cache, kv_slot=kv_slot,
                                                                  evicted=state.evicted))

  def accept_tree(self, drafted: ModelTreeState, path: Array, n_accepted: Array, seq_len: Array,
                  features: Features) -> ModelDraftState:
    """Keep the accepted path's draft KV: node path[j] moves to slot seq_len + j for j < n - 1
    (the last accepted token and the target's next one are fed next round, as in `propose`)."""
    src = jnp.where(path >= 0, take(drafted.kv_slot, path), -1)  # [B, D]
    base = seq_len - _evicted(drafted)  # the slot after the last known token
    cache = move_kv(drafted.cache, base, src, n_accepted - 1)
    if self.kv is None:
      return ModelDraftState(cache=cache)
    return self._evict_known(cache, seq_len + n_accepted + 1, drafted.evicted)


def self_drafter(params: Params, cfg: Config) -> ModelDrafter:
  """The target as its own draft: the engine's sanity check (greedy accepts every token)."""
  return ModelDrafter(params=params, cfg=cfg, draft_penalties=True)


def early_exit_drafter(params: Params, cfg: Config, num_layers: int) -> ModelDrafter:
  """The target's first `num_layers` layers, final norm and LM head as an independent draft.

  Costs no training and shares the weights (not the KV cache) with the target.
  """
  draft_cfg = dataclasses.replace(cfg, num_layers=num_layers)
  return ModelDrafter(first_layers(params, num_layers), draft_cfg)


def trimmed_drafter(params: Params, cfg: Config, keep_ids) -> ModelDrafter:
  """A ModelDrafter whose head [E, M] emits only `keep_ids` [M] (see jspec.models.vocab_trim)."""
  keep = check_keep_ids(np.asarray(keep_ids), cfg.vocab_size)
  head = params.lm_head
  if head is None or head.shape[-1] != len(keep):
    raise ValueError(f"a trimmed drafter needs an LM head [E, {len(keep)}] for its {len(keep)} "
                     f"kept ids, got {None if head is None else tuple(head.shape)}; build the "
                     f"params with jspec.models.vocab_trim.trim_head")
  return ModelDrafter(params=params, cfg=cfg, keep_ids=jnp.asarray(keep))
