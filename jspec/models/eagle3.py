"""EAGLE-3's drafter network (arXiv 2503.01840; the reference code: SafeAILab/EAGLE, eagle3).

What the paper's parts are here:
- Multi-layer feature fusion: the target's residual stream entering layers 2, L // 2 and L - 3
  (low, middle, high: `fusion_taps`; the outputs of layers 1, L/2 - 1 and L - 4), concatenated
  low to high, [3E], and fused by `fc` [3E, E] (no bias).
- The drafter layer: the token's embedding and the fused feature are normed apart
  (`attn_norm`, `hidden_norm`), concatenated, [2E], and projected to queries, keys and values;
  the residual stream is the feature, then the usual MLP. One layer, its own KV cache.
- Direct token prediction: the layer's output h (before the final norm) is what the next step
  reads, `norm` then the drafter's own head [E, M] turns it into logits over the draft
  vocabulary (M ids of the target's, VocabTrim's `keep_ids`, as the reference's d2t/t2d map).
  There is no feature regression; training (jspec.train.eagle3) matches token distributions.
- Training-time test: at decode time every draft after the first reads the drafter's own h, not
  fused target features; training unrolls the same (jspec.train.eagle3).

Pair j is (g_j, t_{j+1}) as in EAGLE-1 (jspec.models.eagle): g_j = fc(target taps at j) when
position j's target state is known, else the drafter's own h from pair j - 1; it predicts
t_{j+2}. The token embedding table is the target's (frozen).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jspec.models import quant
from jspec.models.attention import attention_fn, visible_attention
from jspec.models.cache import KVCache
from jspec.models.config import Config
from jspec.models.drafter import drafter_config
from jspec.models.llama import LayerParams, Params, decoder_layer, layer_list, rms_norm, rope_tables

Array = jax.Array


def fusion_taps(num_layers: int) -> tuple[int, int, int]:
  """The target layers whose input residual stream EAGLE-3 fuses: low, middle, high."""
  if num_layers < 4:
    raise ValueError(f"EAGLE-3 fuses three distinct layers (2, L/2, L-3); a target of "
                     f"{num_layers} layers has too few. Fix: a target of >= 4 layers, or the "
                     f"EAGLE-1 feature drafter (eagle)")
  taps = (2, num_layers // 2, num_layers - 3)
  # Short targets (tests' tiny models) where those coincide: spread over the layers instead.
  return taps if taps[0] < taps[1] < taps[2] else (1, num_layers // 2, num_layers - 1)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Eagle3Params:
  """The drafter's own weights (the embedding table is the target's)."""

  fc: Array  # [3E, E] fuses the taps, low to high
  hidden_norm: Array  # [E] the feature's norm before the projections
  layer: LayerParams  # wq/wk/wv read [2E]: [embedding; feature]; attn_norm norms the embedding
  norm: Array  # [E] before the head
  head: Array  # [M, E] the draft vocabulary's output table
  taps: tuple[int, ...] = dataclasses.field(metadata=dict(static=True), default=())


def check_feature_widths(params, width: int, head_rows: int | None = None,
                         where: str = "the feature drafter") -> None:
  """An EAGLE-1 (`EagleParams`) or EAGLE-3 drafter's own weights against the target's width E:
  fc [2E, E] over [embedding; feature], or [3E, E] over three taps (and projections reading
  [2E]); an EAGLE-3 head of `head_rows` draft ids (None: unchecked). A mismatch fails here, not
  as an einsum's label sizes inside a trace."""
  eagle3 = isinstance(params, Eagle3Params)
  if eagle3 and len(params.taps) != 3:
    raise ValueError(f"{where}: EAGLE-3 fuses three target layers, its taps are {params.taps}. "
                     f"Fix: Eagle3Params(..., taps=fusion_taps(num_layers))")
  E = width
  fc_rows, layer_in = (3 * E, 2 * E) if eagle3 else (2 * E, E)
  if tuple(params.fc.shape) != (fc_rows, E) or params.layer.wq.shape[0] != layer_in:
    raise ValueError(f"{where}: fc {tuple(params.fc.shape)} / layer width "
                     f"{params.layer.wq.shape[0]} do not fit the target's width {E} (fc "
                     f"{(fc_rows, E)}, layer {layer_in}). Fix: a drafter trained for this target")
  if eagle3 and head_rows is not None and tuple(params.head.shape) != (head_rows, E):
    raise ValueError(f"{where}: head {tuple(params.head.shape)}, expected {(head_rows, E)} (the "
                     f"draft vocabulary by the target's width)")


def fuse(params: Eagle3Params, taps_hidden: Array) -> Array:
  """Target taps [..., 3E] (low, middle, high) -> the feature g [..., E]."""
  return quant.einsum("...f,fe->...e", taps_hidden.astype(params.fc.dtype), params.fc)


def eagle3_forward(params: Eagle3Params, cfg: Config, embed: Array, tokens: Array, feats: Array,
                   positions: Array, cache: KVCache, slots: Array | None = None,
                   visible: Array | None = None) -> tuple[Array, KVCache]:
  """Pairs (feats g [B, T, E], tokens [B, T]) -> h [B, T, E] (the next step's g; `logits` reads
  it) and the cache with the pairs' K/V at `slots` (default lengths + t, causal; `visible`
  [B, T, S]: each pair sees exactly those slots, as tree drafting needs)."""
  B, T = tokens.shape
  if slots is None:
    slots = cache.lengths[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
  attend = (attention_fn(cfg, cache.lengths, cache.size, None, T) if visible is None
            else visible_attention(visible))
  cos, sin = rope_tables(cfg, positions)
  h, k, v = decoder_layer(cfg, feats, params.layer, 0, cache.k, cache.v, cos, sin, slots, attend,
                          attn_in=attention_input(params, cfg, embed, tokens, feats))
  return h, dataclasses.replace(cache, k=k, v=v)


def attention_input(params: Eagle3Params, cfg: Config, embed: Array, tokens: Array,
                    feats: Array) -> Array:
  """What the layer's projections read: [normed embedding; normed feature] [B, T, 2E]."""
  emb = rms_norm(quant.take_rows(embed, tokens).astype(feats.dtype), params.layer.attn_norm,
                 cfg.rms_norm_eps)
  return jnp.concatenate([emb, rms_norm(feats, params.hidden_norm, cfg.rms_norm_eps)], axis=-1)


def logits(params: Eagle3Params, cfg: Config, h: Array) -> Array:
  """Draft-vocabulary logits [..., M] (float32) from the layer's output h [..., E]."""
  return quant.einsum("...e,me->...m", rms_norm(h, params.norm, cfg.rms_norm_eps), params.head,
                      preferred_element_type=jnp.float32)


def init_eagle3(target_params: Params, target_cfg: Config, key: Array,
                keep_ids: Array | None = None) -> tuple[Eagle3Params, Config]:
  """Fresh drafter params: the layer a copy of the target's last, its projections widened to
  [2E] (the copy reads the embedding, small random weights the feature), fc the mean of the
  three taps, the head the target's output rows of the draft vocabulary, the norms the target's
  final norm."""
  from jspec.models.drafter import layers_copyable
  from jspec.models.llama import init_params
  from jspec.models.vocab_trim import output_table
  cfg = drafter_config(target_cfg, 1)
  E = cfg.hidden_size
  taps = fusion_taps(target_cfg.num_layers)
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  k_layer, k_q, k_k, k_v = jax.random.split(key, 4)
  if layers_copyable(cfg, target_cfg):
    layer = jax.tree.map(f32, layer_list(target_params)[target_cfg.num_layers - 1])
  else:
    layer = jax.tree.map(f32, init_params(cfg, k_layer, jnp.float32).layers[0])
  widen = lambda w, k: jnp.concatenate([w, 0.02 * jax.random.normal(k, w.shape)], axis=0)
  layer = dataclasses.replace(layer, wq=widen(layer.wq, k_q), wk=widen(layer.wk, k_k),
                              wv=widen(layer.wv, k_v))
  fc = jnp.concatenate([jnp.eye(E) / 3.0] * 3, axis=0)
  table = f32(output_table(target_params))
  head = table if keep_ids is None else table[jnp.asarray(keep_ids)]
  norm = f32(target_params.final_norm)
  return Eagle3Params(fc=f32(fc), hidden_norm=norm, layer=layer, norm=norm, head=head,
                      taps=taps), cfg
