"""The ConFu drafter (arXiv 2603.08899; the network's parts and how they are read:
jspec.models.confu): an EAGLE-3 drafter (jspec.drafting.feature) that also reads the target's
taps at a contemplate token after the last accepted token.

The engines run the contemplate tokens as probe masks (`probe_masks` = 1, each with its own
input embedding from the MoE: `probe_inputs`) plus the soft prompt (`soft_tokens`), in the
verification forward itself: no extra target call. `Features.probe_hidden` then holds the taps
at the contemplate after the last accepted token (at prefill: after the last prompt token); its
contemplate feature c goes into that token's pair and into every draft the next round feeds.
Verification is the engines' own, so the output is the target's at every temperature.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jspec.drafting.base import Features
from jspec.drafting.feature import EagleDrafter, EagleState, eagle3_drafter
from jspec.models.cache import KVCache
from jspec.models.config import Config
from jspec.models.confu import (ContemplateParams, check_contemplate, contemplate_embeddings,
                                contemplate_feature, soft_embeddings)
from jspec.models.eagle3 import Eagle3Params

Array = jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ConFuState(EagleState):
  contemplate: Array  # [B, E] c of the last accepted token: fed with every draft of the round


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ConFuDrafter(EagleDrafter):
  """EAGLE-3 params, the target's input table, and ConFu's `contemplate` weights."""

  contemplate: ContemplateParams = None

  @property
  def probe_masks(self) -> int:
    return 1

  @property
  def soft_tokens(self) -> int:
    return self.contemplate.soft_tokens

  def probe_inputs(self, state: ConFuState, block: Array) -> Array:
    """[B, T + P, E]: a contemplate token after each block token, then the soft prompt."""
    emb = contemplate_embeddings(self.contemplate, self.cfg, self.embed, block)  # [B, T, E]
    return jnp.concatenate([emb, soft_embeddings(self.contemplate, block.shape[0])], axis=1)

  def prompt_probe_inputs(self, prompt: Array, prompt_lengths: Array) -> Array:
    last = jnp.take_along_axis(prompt, (prompt_lengths - 1)[:, None], axis=1)  # [B, 1]
    return self.probe_inputs(None, last)

  def _fed(self, state: ConFuState, feats: Array) -> Array:
    return feats + state.contemplate[:, None].astype(feats.dtype)

  def _empty(self, cache: KVCache, B: int) -> ConFuState:
    E = self.cfg.hidden_size
    zeros = jnp.zeros((B, E), self.params.fc.dtype)
    return ConFuState(cache=cache, next_feat=zeros, contemplate=zeros)

  def _pairs(self, state: ConFuState, features: Features, known: Array,
             add: Array | None = None) -> ConFuState:
    """EAGLE-3's pairs, the last kept one (the last accepted token's) with its contemplate
    feature added; that feature is kept for the round's drafts."""
    if features.probe_hidden is None:
      raise ValueError("ConFu needs the contemplate tokens' taps (Features.probe_hidden is "
                       "None): run it through jspec's engines (speculative_generate, "
                       "tree_speculative_generate), which run them beside every verification")
    c = contemplate_feature(self.contemplate, self.params, self.cfg,
                            features.probe_hidden[:, 0])  # [B, E]
    W = features.tokens.shape[1]
    last = (jnp.arange(W)[None, :] == (known - 1)[:, None])[..., None]  # [B, W, 1]
    new = super()._pairs(state, features, known, add=jnp.where(last, c[:, None], 0.0))
    return dataclasses.replace(new, contemplate=jnp.where((known > 0)[:, None],
                                                          c.astype(state.contemplate.dtype),
                                                          state.contemplate))


def confu_drafter(params: Eagle3Params, contemplate: ContemplateParams, cfg: Config,
                  keep_ids=None, embed: Array | None = None, target_params=None) -> ConFuDrafter:
  """A ConFu drafter over the target's input table (`embed`, or `target_params.embed`); the
  EAGLE-3 part as `eagle3_drafter` makes it."""
  check_contemplate(contemplate, params, cfg)
  base = eagle3_drafter(params, cfg, keep_ids, embed=embed, target_params=target_params)
  fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
  return ConFuDrafter(**fields, contemplate=jax.tree.map(
      lambda x: jnp.asarray(x, params.fc.dtype), contemplate))
