"""The token after the prompt, drawn as every later one is: from the prefill's last logits under
the penalties (whose history of the text starts here), with its log-probability when asked. The
autoregressive and the speculative loops both begin with it."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jspec.sampling.logprobs import processed_for, token_logprobs
from jspec.sampling.penalties import History, penalize, start_history
from jspec.sampling.processing import SamplingParams, sample

Array = jax.Array


def first_token(key: Array, logits: Array, prompt: Array, prompt_lengths: Array, vocab_size: int,
                sampling: SamplingParams, logprobs: str | None
                ) -> tuple[Array, Array, History | None, Array | None]:
  """(the loop's next key, first token [B], the history after it (None when the program needs
  none), its log-probability [B] of kind `logprobs` (None when not asked)) from logits [B, V] at
  each prompt's last position (prompt [B, P] right-padded to prompt_lengths [B])."""
  B = prompt.shape[0]
  key, sub = jax.random.split(key)
  history = start_history(sampling, prompt, prompt_lengths, vocab_size)
  penalized = penalize(logits, history, sampling)
  processed = processed_for(logprobs, penalized, sampling)  # shared with the report
  first = sample(sub, penalized, sampling, processed)  # [B]
  if history is not None:
    history = history.add(first[:, None], jnp.ones((B, 1), bool))
  lp = token_logprobs(logits, first, logprobs, sampling, processed) if logprobs else None
  return key, first, history, lp
