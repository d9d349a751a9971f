"""VocabTrim: a drafter LM head over only the M tokens the target generates most often.

The drafter's LM head is the largest matrix a small drafter multiplies per token (49k x 576 for
SmolLM2, more than two of its decoder layers), yet most of the vocabulary is almost never what the
target says. Trimming the head to the M most frequently *target-generated* ids (counted on the
distillation data, not on prompts) makes every drafting step cheaper. The drafter still reads any
input id (the embedding is untouched), and its proposals and probabilities q are mapped back into
the full vocabulary, where q is zero off the kept ids: speculative sampling stays exact because the
target's residual max(p - q, 0) carries every token the drafter cannot propose.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jspec.models import quant
from jspec.models.config import Config
from jspec.models.llama import Params

Array = jax.Array


def check_trim_size(size: int, vocab_size: int, always: Sequence[int] = ()) -> list[int]:
  """A trimmed head of `size` ids out of `vocab_size` that keeps `always` (returned sorted, once
  each), or ValueError: run before a recipe spends hours on the data the ids are counted in."""
  V = vocab_size
  if not 0 < size <= V:
    raise ValueError(f"trimmed vocabulary size must be in [1, {V}] (the target's vocabulary), "
                     f"got {size}")
  always = sorted(set(int(i) for i in always))
  if any(not 0 <= i < V for i in always):
    raise ValueError(f"ids to keep must lie in [0, {V}), got {always}")
  if len(always) > size:
    raise ValueError(f"cannot keep {len(always)} required ids in a vocabulary of {size}")
  return always


def most_frequent_ids(counts: np.ndarray, size: int, always: Sequence[int] = ()) -> np.ndarray:
  """The `size` ids with the highest counts [V] (ties: lower id first), always including
  `always` (e.g. the stop tokens); returned sorted ascending as int32 [size]."""
  counts = np.asarray(counts)
  V = counts.shape[0]
  always = check_trim_size(size, V, always)
  score = counts.astype(np.float64)
  score[always] = np.inf
  order = np.lexsort((np.arange(V), -score))  # by count descending, then id ascending
  return np.sort(order[:size]).astype(np.int32)


def full_to_trimmed(keep_ids: np.ndarray, vocab_size: int) -> np.ndarray:
  """[V] int32 map from full ids to trimmed ids, -1 for ids the trimmed head cannot emit."""
  out = np.full(vocab_size, -1, np.int32)
  out[np.asarray(keep_ids)] = np.arange(len(keep_ids), dtype=np.int32)
  return out


def check_keep_ids(keep_ids: np.ndarray, vocab_size: int) -> np.ndarray:
  keep = np.asarray(keep_ids)
  if keep.ndim != 1 or keep.size == 0 or not np.issubdtype(keep.dtype, np.integer):
    raise ValueError(f"kept ids must be a non-empty 1-D integer array, got shape {keep.shape} "
                     f"dtype {keep.dtype}")
  if keep.min() < 0 or keep.max() >= vocab_size:
    raise ValueError(f"kept ids must lie in [0, {vocab_size}), got [{keep.min()}, {keep.max()}]")
  if len(np.unique(keep)) != len(keep):
    raise ValueError("kept ids must be distinct")
  return keep.astype(np.int32)


def output_table(params: Params) -> Array:
  """The head as a [V_head, E] table: the tied embedding, or the untied head transposed (an int8
  or q4 head dequantized: what the drafters borrowing it read)."""
  return params.embed if params.lm_head is None else jnp.asarray(params.lm_head).T


def output_rows(params: Params, ids) -> Array:
  """Rows `ids` of the head's table [M, E], float: a tied int8 table dequantizes those rows
  alone."""
  if params.lm_head is None:
    return quant.take_rows(params.embed, jnp.asarray(ids))
  return jnp.asarray(params.lm_head).T[jnp.asarray(ids)]


def trim_head(params: Params, keep_ids: np.ndarray) -> Params:
  """Params whose LM head [E, M] holds only the kept ids' rows of the current head."""
  keep = check_keep_ids(keep_ids, output_table(params).shape[0])
  return dataclasses.replace(params, lm_head=output_rows(params, keep).T)


def fit_vocab(params: Params, cfg: Config, vocab_size: int
              ) -> tuple[Params, Config, np.ndarray | None]:
  """(params, cfg, keep_ids or None) of a float drafter whose vocabulary is padded to another size
  than the target's `vocab_size` (one tokenizer, two paddings: Qwen2.5-0.5B has 151,936 rows,
  Qwen2.5-7B 152,064). A larger one drops its padding rows; a smaller one keeps its head over its
  own V_d ids (a head of kept ids, as VocabTrim's: it never proposes an id past them) and reads
  the ids past them as zero embeddings. The rows dropped or added are past every token."""
  V_d = cfg.vocab_size
  if V_d == vocab_size:
    return params, cfg, None
  fitted = dataclasses.replace(cfg, vocab_size=vocab_size)
  if V_d > vocab_size:
    head = None if params.lm_head is None else params.lm_head[:, :vocab_size]
    return (dataclasses.replace(params, embed=params.embed[:vocab_size], lm_head=head), fitted,
            None)
  head = output_table(params).T  # [E, V_d]
  pad = jnp.zeros((vocab_size - V_d, params.embed.shape[1]), params.embed.dtype)
  embed = jnp.concatenate([params.embed, pad])  # [V, E]
  return (dataclasses.replace(params, embed=embed, lm_head=head), fitted,
          np.arange(V_d, dtype=np.int32))


def to_full_vocab(tokens: Array, probs: Array, keep_ids: Array, vocab_size: int
                  ) -> tuple[Array, Array]:
  """Trimmed-vocabulary draws and probabilities → full-vocabulary ones.

  tokens [...] int32 trimmed ids; probs [..., M] → (tokens [...] full ids, probs [..., V], zero
  off the kept ids).
  """
  full = jnp.zeros(probs.shape[:-1] + (vocab_size,), probs.dtype)
  return keep_ids[tokens], full.at[..., keep_ids].set(probs)


def full_vocab_logits(logits: Array, keep_ids: Array | None, vocab_size: int) -> Array:
  """Head logits [..., M] in the full vocabulary [..., V]: -inf off the kept ids."""
  if keep_ids is None:
    return logits
  full = jnp.full(logits.shape[:-1] + (vocab_size,), -jnp.inf, logits.dtype)
  return full.at[..., keep_ids].set(logits)
