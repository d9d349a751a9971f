"""Block-wise (chunked) prefill under a KV budget: a prompt of any length in the same memory."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jspec.kv.evict import before_forward, evict, evict_when_full, with_budget_state
from jspec.kv.policy import KVPolicy
from jspec.models.cache import KVCache
from jspec.models.config import Config
from jspec.models.llama import Params, forward
from jspec.sampling.logprobs import token_logprobs
from jspec.sampling.processing import GREEDY
from jspec.sharding import Placement

Array = jax.Array


def chunked_prefill(params: Params, cfg: Config, prompt: Array, prompt_lengths: Array,
                    cache: KVCache, policy: KVPolicy, *, keep_hidden: bool = False,
                    taps: tuple[int, ...] = (), placement: Placement | None = None
                    ) -> tuple[Array, KVCache, Array, Array | None]:
  """Run right-padded prompts [B, P] through an empty cache of `policy.slots` slots, `policy.chunk`
  tokens at a time, evicting down to the budget after each chunk. placement (a
  jspec.sharding.Placement, the engine's): the budget state the cache gains (positions, mass) is
  pinned to it as the cache is, so XLA splits its work by rows too.

  Returns (logits [B, V] at each row's last prompt token, cache, evicted [B]: entries dropped per
  row, so the next token's RoPE position is cache.lengths + evicted, and with keep_hidden the final
  hidden states of every prompt position [B, P, E] (what feature drafters start from; with
  `taps`, those layers' inputs instead, as `forward` gives them), else None).
  """
  B, P = prompt.shape
  C = policy.chunk
  n_chunks = -(-P // C)
  prompt = jnp.pad(prompt, ((0, 0), (0, n_chunks * C - P)))
  last = prompt_lengths - 1  # [B]

  def one_chunk(c, carry):
    cache, evicted, logits, hidden = carry
    start = c * C
    index = jnp.clip(last - start, 0, C - 1)[:, None]  # [B, 1]
    chunk_logits, chunk_hidden, cache, evicted = _prefill_chunk(
        params, cfg, policy, prompt, prompt_lengths, c, cache, evicted, index, taps)
    if keep_hidden:
      hidden = jax.lax.dynamic_update_slice(hidden, chunk_hidden,
                                            (0, start, 0))
    here = (last >= start) & (last < start + C)  # [B]: the row's last prompt token is here
    logits = jnp.where(here[:, None], chunk_logits[:, 0], logits)
    return cache, evicted, logits, hidden

  cache = _empty_budgeted(policy, cache, placement)
  # The head's width: the vocabulary, or a VocabTrim'd drafter's kept ids.
  out_logits, out_hidden = jax.eval_shape(
      lambda: forward(params, cfg, prompt[:, :C], jnp.zeros((B, C), jnp.int32), cache,
                      taps=taps)[:2])
  logits = jnp.zeros((B, out_logits.shape[-1]), jnp.float32)
  hidden_dtype = out_hidden.dtype
  hidden = jnp.zeros((B, n_chunks * C if keep_hidden else 0, out_hidden.shape[-1]), hidden_dtype)
  cache, evicted, logits, hidden = jax.lax.fori_loop(
      0, n_chunks, one_chunk, (cache, jnp.zeros((B,), jnp.int32), logits, hidden))
  return logits, cache, evicted, (hidden[:, :P] if keep_hidden else None)


def _prefill_chunk(params: Params, cfg: Config, policy: KVPolicy, prompt: Array,
                   prompt_lengths: Array, c: Array, cache: KVCache, evicted: Array,
                   logits_indices: Array | None, taps: tuple[int, ...] = ()):
  """Chunk c of a chunked prefill of prompt [B, n C]: its C tokens at their true positions through
  the cache, committed (each row's up to its length), then evicted down to the budget. Returns
  (logits at logits_indices [B, N, V] (None: every position), hidden, cache, evicted)."""
  B, C = prompt.shape[0], policy.chunk
  start = c * C
  tokens = jax.lax.dynamic_slice(prompt, (0, start), (B, C))  # [B, C]
  positions = jnp.broadcast_to(start + jnp.arange(C, dtype=jnp.int32), (B, C))
  n_new = jnp.clip(prompt_lengths - start, 0, C)  # [B]
  cache, weights = before_forward(policy, cache, n_new, C)
  logits, hidden, cache = forward(params, cfg, tokens, positions, cache,
                                  logits_indices=logits_indices, mass_weights=weights, taps=taps)
  cache, dropped = evict(policy, cache.commit(n_new), evicted, max_drop=C)
  return logits, hidden, cache, evicted + dropped


def _empty_budgeted(policy: KVPolicy, cache: KVCache, placement: Placement | None) -> KVCache:
  """The cache emptied, with the budget's state (pinned to `placement`)."""
  B = cache.lengths.shape[0]
  cache = with_budget_state(policy, cache.with_lengths(jnp.zeros((B,), jnp.int32)))
  return cache.placed(placement)


def chunked_scores(params: Params, cfg: Config, tokens: Array, lengths: Array, cache: KVCache,
                   policy: KVPolicy, placement: Placement | None = None) -> Array:
  """[B, P] float32: the model's log-probability of each token of right-padded rows tokens [B, P]
  given those before it, as chunked prefill reads them under `policy` (a chunk's tokens see the
  chunk and what the budget kept of the earlier ones; `KVPolicy.never_full` evicts nothing: the
  model's plain scores). 0 at position 0 (nothing predicts it) and from each row's length on. Logits are
  [B, chunk, V] at a time, never [B, P, V]."""
  B, P = tokens.shape
  C = policy.chunk
  n_chunks = -(-P // C)
  padded = jnp.pad(tokens, ((0, 0), (0, n_chunks * C + 1 - P)))  # and the token after the last

  def one_chunk(c, carry):
    cache, evicted, out = carry
    logits, _, cache, evicted = _prefill_chunk(params, cfg, policy, padded[:, :n_chunks * C],
                                               lengths, c, cache, evicted, None)
    following = jax.lax.dynamic_slice(padded, (0, c * C + 1), (B, C))  # what each position scores
    lps = token_logprobs(logits, following, "model", GREEDY)  # [B, C]
    return cache, evicted, jax.lax.dynamic_update_slice(out, lps, (0, c * C + 1))

  cache = _empty_budgeted(policy, cache, placement)
  out = jnp.zeros((B, n_chunks * C + 1), jnp.float32)
  _, _, out = jax.lax.fori_loop(0, n_chunks, one_chunk,
                                (cache, jnp.zeros((B,), jnp.int32), out))
  return jnp.where(jnp.arange(P) < lengths[:, None], out[:, :P], 0.0)


def budgeted_step(params: Params, cfg: Config, tokens: Array, cache: KVCache, evicted: Array,
                  policy: KVPolicy) -> tuple[Array, KVCache, Array]:
  """One decoding step under a budget: tokens [B, 1] at their true RoPE positions (cache.lengths +
  evicted), committed, then evicted as decoding's schedule says. Returns (logits [B, 1, V],
  cache, evicted)."""
  B = tokens.shape[0]
  cache, weights = before_forward(policy, cache, jnp.ones((B,), jnp.int32), 1)
  positions = (cache.lengths + evicted)[:, None]  # [B, 1]
  logits, _, cache = forward(params, cfg, tokens, positions, cache, mass_weights=weights)
  # One token a step: a row is due with exactly evict_every entries over the budget.
  cache, dropped = evict_when_full(policy, cache.commit(1), evicted, max_drop=policy.evict_every)
  return logits, cache, evicted + dropped
