"""Log-probabilities of the generated tokens, reported beside them by every engine.

Two kinds, chosen statically (`logprobs=` of `generate`, `SpecConfig`, `TreeSpecConfig`):

  "model"    log softmax of the model's logits at temperature 1, no filters: the model's own
             score of the token (perplexity, evaluation, reward models); vLLM's raw logprobs.
  "sampled"  the log-probability under the law the token was drawn from: the penalties,
             temperature, top-k, top-p and min-p applied (`processed_logprobs`), 0 under greedy
             decoding (the argmax is drawn with probability 1). What an importance ratio against
             the sampling policy needs.

Under speculative decoding both are the target's, at the position that emitted the token, read
off the verification forward's logits: speculative output follows the target's law, so the
target's processed distribution is the law each emitted token follows given what came before
(the residual draw at a rejection is a means of sampling it, not another law). Greedy speculative
logprobs equal autoregressive ones up to the last bits the verification forward computes
differently (none with the exact-precision settings that make greedy output token-identical).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jspec.sampling.processing import SamplingParams, per_row, processed_logprobs, switch

Array = jax.Array

LOGPROB_KINDS = ("model", "sampled")


def check_logprobs(kind) -> str | None:
  """Host-side: None (off) or one of LOGPROB_KINDS."""
  if kind is not None and (not isinstance(kind, str) or kind not in LOGPROB_KINDS):
    raise ValueError(f"logprobs must be None (off), 'model' (the model's log-probabilities at "
                     f"temperature 1, no filters) or 'sampled' (under the sampling settings the "
                     f"tokens were drawn with), got {kind!r}")
  return kind


def processed_for(kind: str | None, logits: Array, sampling: SamplingParams) -> Array | None:
  """processed_logprobs(logits, sampling) when reporting "sampled" logprobs of a sampled run,
  for a verifier to use too (it processes the same logits: computed once), else None."""
  if kind != "sampled" or sampling.is_greedy is True:
    return None
  # Greedy decided inside the program (mode=None): no filters computed for a greedy run.
  return switch(sampling.is_greedy, lambda: jnp.zeros(logits.shape, jnp.float32),
                lambda: processed_logprobs(logits, sampling), rows=True)


def token_logprobs(logits: Array, tokens: Array, kind: str, sampling: SamplingParams,
                   processed: Array | None = None) -> Array:
  """[...] float32: the log-probability of `tokens` [...] under `logits` [..., V], of `kind`
  (processed: `processed_for`'s, if computed)."""
  picked = lambda lp: jnp.take_along_axis(lp, tokens[..., None].astype(jnp.int32), axis=-1)[..., 0]
  if kind == "model":
    x = logits.astype(jnp.float32)
    return picked(x) - jax.nn.logsumexp(x, axis=-1)
  if kind != "sampled":
    raise ValueError(f"unknown logprobs kind {kind!r}; one of {LOGPROB_KINDS}")
  greedy = sampling.is_greedy
  if isinstance(greedy, bool) and greedy:  # a static greedy program computes no filters
    return jnp.zeros(tokens.shape, jnp.float32)
  if processed is None:
    processed = processed_logprobs(logits, sampling)
  return jnp.where(per_row(greedy, tokens), 0.0, picked(processed))
