"""Mask-token probing: the target drafts for itself, with no drafter model and no extra call.

ESP ("Efficient Training-Free Multi-Token Prediction via Embedding-Space Probing", 2603.17942):
the engine appends k mask positions after every token of each verification block
(jspec.speculative.probing), all with one input embedding m: the mean of the prompt's input
embeddings, then moved toward each committed token's embedding e by m += 0.1 (e - m). Mask 1 after
a token sits where the target's own next token will go, so its logits guess the token after that
one; mask j guesses j tokens further. After a round the k masks that followed the last accepted
token hold the next round's drafts: a chain (mask i's top-1, or a draw from its processed
distribution, for draft i) or a token tree of any jspec.tree shape, every node at depth d scored
by mask d whatever its parent (so `dynamic:N,D,1,K` is ESP's tree: the top-K of each mask below
the best node of the depth above). Verification is the engines' own, lossless at every
temperature. The prefill probes as well (k masks after the last prompt token, with the prompt's
mean embedding), so the first round drafts like every other.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jspec.drafting.base import (DraftState, Drafter, Features, Pick, check_stop, draft_chain,
                                 sample_with_probs, unsure)
from jspec.models import quant
from jspec.models.config import Config
from jspec.models.llama import Params, lm_head
from jspec.sampling.penalties import chain_draft_penalty
from jspec.sampling.processing import SamplingParams
from jspec.tree.structure import Tree, take

Array = jax.Array
EMA_RATE = 0.1  # ESP's lambda: how far each committed token pulls the mask embedding


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ProbeState(DraftState):
  mask: Array  # [B, E] float32: the mask embedding
  logits: Array  # [B, k, V] float32: the target's logits at the masks after the last accepted token


class _ProbeFeeder:
  """Tree frontiers scored by the probe: a node at depth d (the root: 0) gets mask d + 1's
  logits, whoever its parent."""

  def __init__(self, state: ProbeState):
    self.state = state

  def __call__(self, tree: Tree, frontier: Array) -> Array:
    depth = jnp.where(frontier >= 0, take(tree.depth, frontier), 0)  # [B, W]
    return take(self.state.logits, depth)  # [B, W, V]

  def result(self, tree: Tree, reindexed: bool) -> ProbeState:
    return self.state


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ProbeDrafter(Drafter):
  """Mask-token probing of the target `head` (its embedding table and LM head; layers are not
  needed: the engine's verification forward runs the masks). `probe_masks` = k masks after every
  block token: at most k drafts per chain, trees at most k deep."""

  head: Params  # the target's params without layers (embed, final_norm, lm_head)
  cfg: Config = dataclasses.field(metadata=dict(static=True))
  probe_masks: int = dataclasses.field(default=2, metadata=dict(static=True))
  ema_rate: float = dataclasses.field(default=EMA_RATE, metadata=dict(static=True))
  stop_below: float | None = dataclasses.field(default=None, metadata=dict(static=True))
  # Propose under the target's penalties (jspec.sampling.penalties; with_draft_penalties).
  draft_penalties: bool = dataclasses.field(default=False, metadata=dict(static=True))

  def __post_init__(self):
    if not isinstance(self.probe_masks, int) or self.probe_masks < 1:
      raise ValueError(f"mask-token probing needs k >= 1 masks per token, got {self.probe_masks!r}")

  @property
  def vocab_size(self) -> int:
    return self.cfg.vocab_size

  @property
  def target_cfg(self) -> Config:
    return self.cfg

  @property
  def stops_early(self) -> bool:
    return self.stop_below is not None

  def with_stop(self, threshold: float) -> ProbeDrafter:
    return dataclasses.replace(self, stop_below=check_stop(threshold))

  @property
  def drafts_from_masks(self) -> bool:
    return True

  def probe_embedding(self, state: ProbeState) -> Array:
    return state.mask

  def _embed(self, tokens: Array) -> Array:
    return quant.take_rows(self.head.embed, tokens).astype(jnp.float32)  # [B, T, E]

  def prompt_probe_embedding(self, prompt: Array, prompt_lengths: Array) -> Array:
    """The mean of each prompt's input embeddings [B, E] (ESP's initial mask)."""
    P = prompt.shape[1]
    valid = (jnp.arange(P)[None, :] < prompt_lengths[:, None]).astype(jnp.float32)  # [B, P]
    return jnp.einsum("bp,bpe->be", valid, self._embed(prompt)) / prompt_lengths[:, None]

  def init(self, prompt: Array, prompt_lengths: Array, cache_size: int,
           features: Features) -> ProbeState:
    B = prompt.shape[0]
    mean = self.prompt_probe_embedding(prompt, prompt_lengths)
    # The prompt's first sampled token is committed too (features.tokens at prompt_lengths - 1).
    first = jnp.take_along_axis(features.tokens, (prompt_lengths - 1)[:, None], axis=1)
    mask = self._moved(mean, first, jnp.ones((B,), jnp.int32))
    if features.probe_hidden is None:  # no probe at prefill: the first round drafts blind
      logits = jnp.zeros((B, self.probe_masks, self.vocab_size), jnp.float32)
    else:  # the masks after the last prompt token
      logits = lm_head(self.head, features.probe_hidden)
    return ProbeState(mask=mask, logits=logits)

  def _moved(self, mask: Array, tokens: Array, n: Array) -> Array:
    """The mask embedding after committing tokens [B, W] (the first n [B] of each row) in order:
    m <- m + rate (e - m) each, i.e. (1 - rate)^n m + sum_i rate (1 - rate)^(n - 1 - i) e_i."""
    W = tokens.shape[1]
    keep = 1.0 - self.ema_rate
    i = jnp.arange(W)[None, :]
    weights = jnp.where(i < n[:, None], self.ema_rate * keep ** (n[:, None] - 1 - i), 0.0)
    return keep ** n[:, None] * mask + jnp.einsum("bw,bwe->be", weights, self._embed(tokens))

  def _after_round(self, state: ProbeState, features: Features, n: Array) -> ProbeState:
    if features.probe_hidden is None:
      raise ValueError("mask-token probing needs the engine to append mask positions "
                       "(Features.probe_hidden is None): run it through jspec's engines")
    logits = lm_head(self.head, features.probe_hidden)  # [B, k, V]
    return ProbeState(mask=self._moved(state.mask, features.tokens, n), logits=logits)

  def propose(self, state: ProbeState, last2: Array, seq_len: Array, key: Array,
              sampling: SamplingParams, gamma: int, pick: Pick | None = None, *,
              penalty_history=None):
    if gamma > self.probe_masks:
      raise ValueError(f"a chain of {gamma} drafts needs {gamma} masks per token; this probe has "
                       f"{self.probe_masks}. Fix: mtp:{gamma} or gamma <= {self.probe_masks}")
    step = lambda i, prev: (jax.lax.dynamic_index_in_dim(state.logits, i, 1, False), i + 1)
    sample = lambda key, logits: sample_with_probs(key, logits, sampling)
    tokens, probs, _ = draft_chain(key, gamma, state.logits[:, 0], jnp.int32(1), step, sample,
                                   pick, None if self.stop_below is None
                                   else unsure(self.stop_below),
                                   chain_draft_penalty(penalty_history, sampling)
                                   if self.draft_penalties else None)
    return tokens, probs, state

  def update(self, state: ProbeState, seq_len: Array, features: Features) -> ProbeState:
    return self._after_round(state, features, seq_len - features.start - 1)

  def tree_feeder(self, state: ProbeState, last2: Array, seq_len: Array) -> _ProbeFeeder:
    return _ProbeFeeder(state)

  def accept_tree(self, drafted: ProbeState, path: Array, n_accepted: Array, seq_len: Array,
                  features: Features) -> ProbeState:
    return self._after_round(drafted, features, n_accepted + 1)


def probe_drafter(params: Params, cfg: Config, masks: int = 2) -> ProbeDrafter:
  """Mask-token probing of the target (params, cfg) with `masks` masks after every block token."""
  return ProbeDrafter(head=dataclasses.replace(params, layers=()), cfg=cfg, probe_masks=masks)


def check_probe_round(drafter: Drafter, *, gamma: int | None = None,
                      depth: int | None = None) -> None:
  """Host-side: a chain of `gamma` drafts or a tree `depth` deep fits the probe's masks."""
  k = drafter.probe_masks
  if not k:
    return
  if not drafter.drafts_from_masks:  # ConFu: its masks feed a drafter model of any depth
    return
  if gamma is not None and gamma > k:
    raise ValueError(f"gamma {gamma} drafts per round need {gamma} masks per token; the probe has "
                     f"{k}. Fix: --drafter mtp:{gamma} (probe_drafter(..., masks={gamma})), or "
                     f"--gamma {k} (SpecConfig(gamma={k})).")
  if depth is not None and depth > k:
    raise ValueError(f"a tree {depth} deep needs {depth} masks per token; the probe has {k}. "
                     f"Fix: --drafter mtp:{depth} (probe_drafter(..., masks={depth})), or a tree "
                     f"at most {k} deep.")
