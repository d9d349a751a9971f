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
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from jspec.models.cache import KVCache
from jspec.models.config import Config
from jspec.models.llama import Params, forward
from jspec.sampling.processing import SamplingParams, processed_logprobs
from jspec.spec.vocab_trim import check_keep_ids, to_full_vocab

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


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ModelDrafterState:
  cache: KVCache


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
    token, probs = sample_with_probs(key, logits, sampling)
    if self.keep_ids is None:
      return token, probs
    return to_full_vocab(token, probs, self.keep_ids, self.cfg.vocab_size)

  def init(self, prompt: Array, prompt_lengths: Array, cache_size: int) -> ModelDrafterState:
    B, P = prompt.shape
    cache = KVCache.init(self.cfg, B, cache_size, self.params.embed.dtype)
    positions = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, P))
    # Only the cache matters here; logits at one position keep the LM head cheap.
    _, _, cache = forward(self.params, self.cfg, prompt, positions, cache,
                          logits_indices=(prompt_lengths - 1)[:, None])
    return ModelDrafterState(cache=cache.with_lengths(prompt_lengths))

  def propose(self, state: ModelDrafterState, last2: Array, seq_len: Array, key: Array,
              sampling: SamplingParams, gamma: int):
    B = last2.shape[0]
    V = self.cfg.vocab_size
    keys = jax.random.split(key, gamma)
    start = seq_len - 2
    cache = state.cache.with_lengths(start)
    positions = start[:, None] + jnp.arange(2, dtype=jnp.int32)  # [B, 2]
    logits, _, cache = forward(self.params, self.cfg, last2, positions, cache,
                               logits_indices=jnp.ones((B, 1), jnp.int32))
    cache = cache.commit(2)
    token, probs = self._sample(keys[0], logits[:, 0], sampling)
    tokens = jnp.zeros((B, gamma), jnp.int32).at[:, 0].set(token)
    all_probs = jnp.zeros((B, gamma, V), jnp.float32).at[:, 0].set(probs)

    def step(i, carry):
      tokens, all_probs, cache = carry
      prev = jax.lax.dynamic_slice_in_dim(tokens, i - 1, 1, axis=1)  # [B, 1]
      logits, _, cache = forward(self.params, self.cfg, prev, cache.lengths[:, None], cache)
      token, probs = self._sample(keys[i], logits[:, 0], sampling)
      tokens = jax.lax.dynamic_update_slice_in_dim(tokens, token[:, None], i, axis=1)
      all_probs = jax.lax.dynamic_update_slice_in_dim(all_probs, probs[:, None], i, axis=1)
      return tokens, all_probs, cache.commit(1)

    tokens, all_probs, cache = jax.lax.fori_loop(1, gamma, step, (tokens, all_probs, cache))
    return tokens, all_probs, ModelDrafterState(cache=cache)

  def update(self, state: ModelDrafterState, seq_len: Array) -> ModelDrafterState:
    return state  # the next propose() sets the cache length from seq_len


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
