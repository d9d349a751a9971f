"""Scoring text: the model's log-probability of every token given those before it (perplexity,
the log-likelihood of a continuation, evaluation harnesses), with a full cache or under a KV
budget, as one XLA program.

The rows are read `chunk` tokens at a time (jspec.kv.prefill.chunked_scores): logits are [B, chunk,
V] at a time, never [B, length, V], so a long text scores in the memory of a chunk. Under a KV
budget (`kv=`) the text is read as chunked prefill reads a prompt under that policy (each chunk sees
itself and what the budget kept of the earlier ones): the perplexity of a compressed cache, the
continuous measure of jspec.kv's policies on your own text.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jspec.decode import as_prompt_list, is_int, pad_prompts, prompt_bucket, rows_on_mesh
from jspec.kv.policy import KVPolicy, check_kv
from jspec.kv.prefill import chunked_scores
from jspec.models.attention import attention_slots
from jspec.models.cache import KVCache
from jspec.models.config import Config
from jspec.models.llama import Params
from jspec.models.numerics import engine_jit
from jspec.sharding import Mesh, Placement, traced_under_placement

Array = jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ScoreOutput:
  logprobs: Array  # [B, S] float32: token t's log-probability given tokens < t; 0 at t = 0 and
  # from each row's length on
  lengths: Array  # [B] int32

  def sums(self, starts: Sequence[int] | int = 1) -> np.ndarray:
    """[B] the log-probability of each row's tokens from `starts` (per row, or one for all; 1:
    every token but the first, which nothing predicts) to its end: a continuation's
    log-likelihood given the tokens before it."""
    lps = np.asarray(self.logprobs)
    starts = self._starts(starts)
    cols = np.arange(lps.shape[1])
    return np.where(cols >= starts[:, None], lps, 0.0).sum(axis=1)

  def _starts(self, starts) -> np.ndarray:
    lengths = np.asarray(self.lengths)
    given = np.asarray(starts)
    if given.ndim > 1 or (given.ndim == 1 and given.shape != lengths.shape):
      raise ValueError(f"starts must be one position or one per row ({len(lengths)}), got "
                       f"{given.tolist()!r}")
    starts = np.broadcast_to(given, lengths.shape)
    if np.any(starts < 1) or np.any(starts > lengths):
      raise ValueError(f"starts must lie in [1, length] per row (position 0 is not predicted), "
                       f"got {starts.tolist()} for lengths {lengths.tolist()}")
    return starts

  def perplexity(self, starts: Sequence[int] | int = 1) -> np.ndarray:
    """[B] exp(-mean log-probability) over the tokens `sums` counts (NaN for a row with none)."""
    counts = np.asarray(self.lengths) - self._starts(starts)
    with np.errstate(invalid="ignore", divide="ignore"):
      return np.where(counts > 0, np.exp(-self.sums(starts) / np.maximum(counts, 1)), np.nan)


@traced_under_placement
def score_tokens(params: Params, cfg: Config, tokens: Array, lengths: Array, *, chunk: int,
                 kv: KVPolicy | None = None, placement: Placement | None = None) -> ScoreOutput:
  """Pure and jit-friendly: log-probabilities of right-padded rows tokens [B, S] (lengths [B]),
  read `chunk` tokens at a time with a full cache, or under the budget `kv` (its own chunk).
  cfg, chunk, kv, placement static."""
  B, S = tokens.shape
  policy = kv if kv is not None else KVPolicy.never_full(S, chunk)
  cache = KVCache.init(cfg, B, attention_slots(cfg, policy.slots), params.embed.dtype)
  out = ScoreOutput(chunked_scores(params, cfg, tokens, lengths, cache.placed(placement), policy,
                                   placement), lengths)
  return out if placement is None else placement.replicated(out)


_score_jit = engine_jit(score_tokens, static_argnums=(1,),
                        static_argnames=("chunk", "kv", "placement"))


def score(params: Params, cfg: Config, sequences: Sequence[Sequence[int]], *, chunk: int = 128,
          kv: KVPolicy | None = None, precision: str = "fast",
          mesh: Mesh | None = None) -> ScoreOutput:
  """Validated, bucketed, jitted scoring of token-id rows of any lengths (one program per
  length bucket).

  Example:
    out = score(params, cfg, [context + continuation])
    out.sums(starts=len(context))  # the continuation's log-likelihood given the context
    out.perplexity()

  chunk: tokens read at a time (memory: logits of [B, chunk, V]); kv: a KV budget
  (`jspec.kv.policy.KVPolicy`; its chunk is used): the text scored as read under that policy;
  precision, mesh: as for `jspec.generate.generate`.
  """
  check_kv(cfg, kv)
  if not is_int(chunk) or chunk < 1:
    raise ValueError(f"chunk (tokens read at a time) must be a positive integer, got {chunk!r}")
  rows = as_prompt_list(sequences)
  if not rows or not all(len(r) for r in rows):
    raise ValueError("score takes one or more non-empty rows of token ids (texts to score), got "
                     f"{'none' if not rows else 'an empty row'}")
  longest = max(len(r) for r in rows)
  if longest > cfg.max_position_embeddings:
    raise ValueError(f"a row of {longest} tokens is longer than the model's "
                     f"max_position_embeddings={cfg.max_position_embeddings} positions. Fix: "
                     f"score a shorter window of it")
  bucket = prompt_bucket(longest)
  tokens, lengths = pad_prompts(rows, cfg.vocab_size, bucket)
  params, tokens, lengths, placement = rows_on_mesh(params, cfg, jnp.asarray(tokens),
                                                    jnp.asarray(lengths), mesh)
  kv = None if kv is None else kv.within(bucket)
  return _score_jit(params, cfg, tokens, lengths, chunk=min(int(chunk), bucket), kv=kv,
                    precision=precision, placement=placement)
