"""The feature-level drafter's network (EAGLE, arXiv 2401.15077): one decoder layer over the
target's hidden states.

Pair j is (f_j, t_{j+1}): the target's final-normed hidden state at position j and the token that
followed. The input is fc([embed(t_{j+1}); f_j]) (both [E] -> [E]), one Llama decoder layer with
its own KV cache (pair j at slot j, RoPE position j), and an output RMSNorm; the result f̂_{j+1}
predicts the target's next hidden state, and the target's own output table turns it into logits
for t_{j+2}.
Decoding with it: jspec.drafting.feature; training: jspec.train.eagle.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jspec.models import quant
from jspec.models.attention import attention_fn, visible_attention
from jspec.models.cache import KVCache
from jspec.models.config import Config
from jspec.models.drafter import drafter_config, layers_copyable
from jspec.models.llama import (LayerParams, Params, decoder_layer, init_params, layer_list,
                                lm_head, rms_norm, rope_tables)

Array = jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class EagleParams:
  """The drafter's own weights (the embedding table and the output head are the target's)."""

  fc: Array  # [2E, E] over [embed(token); feature]
  layer: LayerParams
  norm: Array  # [E]


def eagle_forward(params: EagleParams, cfg: Config, embed: Array, tokens: Array, feats: Array,
                  positions: Array, cache: KVCache, slots: Array | None = None,
                  visible: Array | None = None) -> tuple[Array, KVCache]:
  """Pairs (feats [B, T, E], tokens [B, T]) -> predicted next features [B, T, E], the cache with
  the pairs' K/V written at `slots` (default: lengths + t, causal among the new pairs; with
  `visible` [B, T, S], each pair sees exactly those cache slots, as tree drafting needs)."""
  B, T = tokens.shape
  x = jnp.concatenate([quant.take_rows(embed, tokens).astype(feats.dtype), feats],
                      axis=-1)  # [B, T, 2E]
  x = quant.einsum("btf,fe->bte", x, params.fc)  # [B, T, E]
  if slots is None:
    slots = cache.lengths[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
  attend = (attention_fn(cfg, cache.lengths, cache.size, None, T) if visible is None
            else visible_attention(visible))
  cos, sin = rope_tables(cfg, positions)
  x, k, v = decoder_layer(cfg, x, params.layer, 0, cache.k, cache.v, cos, sin, slots, attend)
  return rms_norm(x, params.norm, cfg.rms_norm_eps), dataclasses.replace(cache, k=k, v=v)


def head_logits(head: Array | Params, feats: Array) -> Array:
  """Logits [..., M] of features [..., E] under the output table `head` [M, E], or under the
  target's own head as it stores it (a layerless Params: int8, 4-bit or a CPU kernel's layout,
  read by the target's matmul, not copied to a float table)."""
  if isinstance(head, Params):
    return lm_head(head, feats)
  return jnp.einsum("...e,me->...m", feats, head, preferred_element_type=jnp.float32)


def init_eagle(target_params: Params, target_cfg: Config, key: Array,
               copy_layer: int | None = None) -> tuple[EagleParams, Config]:
  """Fresh drafter params: fc passes the feature through (plus a small random token part), the
  layer is a copy of target layer `copy_layer` (default: the last) and the output norm the
  target's final norm, so training starts near "the next state is like this one"."""
  cfg = drafter_config(target_cfg, 1)
  E = cfg.hidden_size
  k_fc, k_layer = jax.random.split(key)
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  fc = jnp.concatenate([0.02 * jax.random.normal(k_fc, (E, E)), jnp.eye(E)], axis=0)
  if layers_copyable(cfg, target_cfg):
    copied = target_cfg.num_layers - 1 if copy_layer is None else copy_layer
    layer = jax.tree.map(f32, layer_list(target_params)[copied])
  else:
    layer = init_params(cfg, k_layer, jnp.float32).layers[0]
  return EagleParams(fc=f32(fc), layer=layer, norm=f32(target_params.final_norm)), cfg
