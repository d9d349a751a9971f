"""Verification of a linear draft of G tokens per row: greedy matching and lossless speculative
sampling (Leviathan et al. 2211.17192; Chen et al. 2302.01318).

Every function is pure and jit/vmap-friendly; G is read from static shapes. Both verifiers return
`(n_accepted [B] int32, next_token [B] int32)`: the row keeps draft_tokens[:, :n_accepted] and then
appends next_token (the correction after a rejection, or the bonus token when all G are accepted).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jspec.sampling.processing import SamplingParams, argmax, processed_logprobs, switch

Array = jax.Array


def accepted_mask(n_accepted: Array, G: int) -> Array:
  """[B, G] bool, True for the draft positions each row keeps."""
  return jnp.arange(G, dtype=jnp.int32)[None, :] < n_accepted[:, None]


def _prefix_length(ok: Array) -> Array:
  """Length [B] of the leading run of True in ok [B, G]."""
  return jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=-1), axis=-1).astype(jnp.int32)


def verify_greedy(draft_tokens: Array, target_logits: Array) -> tuple[Array, Array]:
  """Accept the longest prefix that matches the target's argmax; next token = argmax after it.

  Args:
    draft_tokens: [B, G] int32.
    target_logits: [B, G+1, V], position i predicts draft token i; position G is the bonus.
  """
  G = draft_tokens.shape[1]
  best = argmax(target_logits)  # [B, G+1]
  n_accepted = _prefix_length(draft_tokens == best[:, :G])
  next_token = jnp.take_along_axis(best, n_accepted[:, None], axis=1)[:, 0]
  return n_accepted, next_token


def in_vocabulary(tokens: Array, V: int) -> Array:
  """tokens in [0, V): the ids a verifier may accept."""
  return (tokens >= 0) & (tokens < V)


def accept_draw(u: Array, p_x: Array, q_x: Array) -> Array:
  """Accept with probability min(1, p/q): u < p/q written as u*q < p, so q == 0 cannot give NaN.

  q(x) == 0 (impossible for a correct drafter) then accepts iff p(x) > 0; p(x) == 0 never accepts.
  """
  return u * q_x < p_x


def residual_distribution(p: Array, q: Array) -> Array:
  """Unnormalised rejection distribution max(p − q, 0) [B, V]; p itself where that is all zero.

  The residual vanishes only when p == q, where rejection has probability 0; falling back to p
  keeps the sample well defined (and q is zero-padded at the bonus position, giving p there).
  """
  r = jnp.maximum(p - q, 0.0)
  return jnp.where(jnp.sum(r, axis=-1, keepdims=True) > 0, r, p)


def verify_sampled(key: Array, draft_tokens: Array, draft_probs: Array, target_logits: Array,
                   sampling: SamplingParams,
                   target_logprobs: Array | None = None) -> tuple[Array, Array]:
  """Lossless speculative sampling: emitted tokens are distributed exactly as the target's.

  Args:
    key: PRNG key; one uniform per draft position, a separate key for the residual/bonus draw.
    draft_tokens: [B, G] int32, draft token i was sampled from draft_probs[:, i].
    draft_probs: [B, G, V], the drafter's *processed* distributions q.
    target_logits: [B, G+1, V], processed here with the same `sampling` to give p.
    sampling: the SamplingParams both drafter and target use.
    target_logprobs: processed_logprobs(target_logits, sampling), when the caller has them.
  """
  B, G = draft_tokens.shape
  k_accept, k_next = jax.random.split(key)
  if target_logprobs is None:
    target_logprobs = processed_logprobs(target_logits, sampling)
  p = jnp.exp(target_logprobs)  # [B, G+1, V]
  q = draft_probs.astype(jnp.float32)  # [B, G, V]
  p_x = jnp.take_along_axis(p[:, :G], draft_tokens[..., None], axis=-1)[..., 0]  # [B, G]
  q_x = jnp.take_along_axis(q, draft_tokens[..., None], axis=-1)[..., 0]  # [B, G]
  u = jax.random.uniform(k_accept, (B, G), jnp.float32)
  # An id outside the vocabulary is never accepted (take_along_axis wraps a negative one to
  # another token's probabilities): a drafter's bug cannot reach the output.
  n_accepted = _prefix_length(accept_draw(u, p_x, q_x) & in_vocabulary(draft_tokens, p.shape[-1]))
  # Zero q at the bonus position so one residual formula covers both cases: max(p_G − 0, 0) = p_G.
  q_pad = jnp.concatenate([q, jnp.zeros_like(q[:, :1])], axis=1)  # [B, G+1, V]
  idx = n_accepted[:, None, None]
  p_j = jnp.take_along_axis(p, idx, axis=1)[:, 0]  # [B, V]
  q_j = jnp.take_along_axis(q_pad, idx, axis=1)[:, 0]  # [B, V]
  # log(0) = -inf drops a token from the categorical; the residual keeps a positive entry.
  residual = residual_distribution(p_j, q_j)
  next_token = jax.random.categorical(k_next, jnp.log(residual), axis=-1)
  return n_accepted, next_token.astype(jnp.int32)


def verify(key: Array, draft_tokens: Array, draft_probs: Array, target_logits: Array,
           sampling: SamplingParams,
           target_logprobs: Array | None = None) -> tuple[Array, Array]:
  """Greedy verification at temperature 0, speculative sampling otherwise; one compiled program.
  target_logprobs: the target's processed log-probabilities, when the caller has them."""
  return switch(
      sampling.is_greedy,
      lambda: verify_greedy(draft_tokens, target_logits),
      lambda: verify_sampled(key, draft_tokens, draft_probs, target_logits, sampling,
                             target_logprobs),
      rows=True)
