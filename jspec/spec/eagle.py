"""A feature-level drafter (EAGLE, arXiv 2401.15077): one decoder layer that reads the target's
hidden states.

The drafter works on pairs: pair j is (f_j, t_{j+1}), the target's final-normed hidden state at
position j and the token that followed. Its input is fc([embed(t_{j+1}); f_j]) (both [E] → [E]),
one Llama decoder layer with its own KV cache (pair j at slot j, RoPE position j), and an output
RMSNorm; the result f̂_{j+1} predicts the target's next hidden state, and the target's own (frozen,
optionally VocabTrim'd) output table turns it into logits for t_{j+2}. Past the tokens the target
has verified the drafter feeds its own predictions back: (f̂_{j+1}, draft) → f̂_{j+2} → ...

Engine contract (jspec.spec.engine): feature drafters set `reads_features = True`; the engine then
calls `init_features(prompt, prompt_lengths, cache_size, hidden, first)` after the target's prefill
(hidden [B, P, E]) and, after each verification, `absorb(state, start, seq_len, hidden, emitted)`
with the target's hidden states [B, W, E] of the verified block (positions start .. start + W - 1)
and the tokens emitted after each. The drafter's q is the distribution it sampled from, so the
usual verification keeps the output exactly the target's (greedy identity, sampled distribution).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jspec.models.cache import KVCache
from jspec.models.config import Config
from jspec.models.llama import LayerParams, _layer, attention_fn, rms_norm, rope_tables
from jspec.sampling.processing import SamplingParams
from jspec.spec.drafters import sample_full_vocab
from jspec.spec.vocab_trim import check_keep_ids

Array = jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class EagleParams:
  """The drafter's own weights (the embedding table and the output head are the target's)."""

  fc: Array  # [2E, E] over [embed(token); feature]
  layer: LayerParams
  norm: Array  # [E]


def eagle_forward(params: EagleParams, cfg: Config, embed: Array, tokens: Array, feats: Array,
                  positions: Array, cache: KVCache, slots: Array | None = None
                  ) -> tuple[Array, KVCache]:
  """Pairs (feats [B, T, E], tokens [B, T]) → predicted next features [B, T, E], the cache with
  the pairs' K/V written at `slots` (default: lengths + t, causal among the new pairs)."""
  B, T = tokens.shape
  x = jnp.concatenate([embed[tokens].astype(feats.dtype), feats], axis=-1)  # [B, T, 2E]
  x = jnp.einsum("btf,fe->bte", x, params.fc.astype(feats.dtype))  # [B, T, E]
  if slots is None:
    slots = cache.lengths[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
  attend = attention_fn(cfg, cache.lengths, cache.size, None, T)
  cos, sin = rope_tables(cfg, positions)
  x, k, v = _layer(cfg, x, params.layer, 0, cache.k, cache.v, cos, sin, slots, attend)
  return rms_norm(x, params.norm, cfg.rms_norm_eps), dataclasses.replace(cache, k=k, v=v)


def head_logits(head: Array, feats: Array) -> Array:
  """Logits [..., M] of features [..., E] under the output table `head` [M, E]."""
  return jnp.einsum("...e,me->...m", feats, head, preferred_element_type=jnp.float32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class EagleState:
  cache: KVCache  # lengths = seq_len - 1: pairs 0 .. seq_len - 2 hold target features
  next_feat: Array  # [B, E] f̂ of the last known token (position seq_len - 1)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class EagleDrafter:
  """Feature-level drafter; see the module docstring. `embed` [V, E] is the target's input table,
  `head` [M or V, E] its output table (rows `keep_ids` when VocabTrim'd)."""

  params: EagleParams
  embed: Array
  head: Array
  cfg: Config = dataclasses.field(metadata=dict(static=True))
  keep_ids: Array | None = None
  reads_features = True  # class constant: the engine hands it the target's hidden states

  @property
  def vocab_size(self) -> int:
    return self.cfg.vocab_size

  def _sample(self, key: Array, feat: Array, sampling: SamplingParams) -> tuple[Array, Array]:
    return sample_full_vocab(key, head_logits(self.head, feat), sampling, self.keep_ids,
                             self.cfg.vocab_size)

  def init(self, *args, **kwargs):
    raise TypeError("a feature drafter needs the target's hidden states: run it through "
                    "jspec's speculative engine (chain); it has no standalone init")

  def init_features(self, prompt: Array, prompt_lengths: Array, cache_size: int, hidden: Array,
                    first: Array) -> EagleState:
    """Ingest pairs (f_j, t_{j+1}) for j < P (t_P = `first`, the target's first sampled token)."""
    B, P = prompt.shape
    nxt = jnp.concatenate([prompt[:, 1:], jnp.zeros((B, 1), prompt.dtype)], axis=1)
    nxt = nxt.at[jnp.arange(B), prompt_lengths - 1].set(first)  # [B, P]
    cache = KVCache.init(self.cfg, B, cache_size, self.params.fc.dtype).with_lengths(
        jnp.zeros((B,), jnp.int32))
    positions = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, P))
    pred, cache = eagle_forward(self.params, self.cfg, self.embed, nxt,
                                hidden.astype(self.params.fc.dtype), positions, cache)
    last = jnp.take_along_axis(pred, (prompt_lengths - 1)[:, None, None], axis=1)[:, 0]
    return EagleState(cache=cache.with_lengths(prompt_lengths), next_feat=last)

  def propose(self, state: EagleState, last2: Array, seq_len: Array, key: Array,
              sampling: SamplingParams, gamma: int):
    B = seq_len.shape[0]
    V = self.cfg.vocab_size
    keys = jax.random.split(key, gamma)
    cache = state.cache.with_lengths(seq_len - 1)
    token, probs = self._sample(keys[0], state.next_feat, sampling)
    tokens = jnp.zeros((B, gamma), jnp.int32).at[:, 0].set(token)
    all_probs = jnp.zeros((B, gamma, V), jnp.float32).at[:, 0].set(probs)

    def step(i, carry):
      tokens, all_probs, feat, cache = carry
      prev = jax.lax.dynamic_slice_in_dim(tokens, i - 1, 1, axis=1)  # [B, 1]
      pred, cache = eagle_forward(self.params, self.cfg, self.embed, prev, feat[:, None],
                                  cache.lengths[:, None], cache)
      feat = pred[:, 0]
      token, probs = self._sample(keys[i], feat, sampling)
      tokens = jax.lax.dynamic_update_slice_in_dim(tokens, token[:, None], i, axis=1)
      all_probs = jax.lax.dynamic_update_slice_in_dim(all_probs, probs[:, None], i, axis=1)
      return tokens, all_probs, feat, cache.commit(1)

    tokens, all_probs, _, cache = jax.lax.fori_loop(
        1, gamma, step, (tokens, all_probs, state.next_feat, cache))
    return tokens, all_probs, EagleState(cache=cache, next_feat=state.next_feat)

  def update(self, state: EagleState, seq_len: Array) -> EagleState:
    raise TypeError("a feature drafter is updated with `absorb` (the target's hidden states)")

  def absorb(self, state: EagleState, start: Array, seq_len: Array, hidden: Array,
             emitted: Array) -> EagleState:
    """After verification: pairs (hidden[:, i], emitted[:, i]) at positions start + i replace the
    drafted ones for i < seq_len - 1 - start + 1 (the tokens kept this round); rows that kept
    nothing (finished) are left as they were."""
    B, W = emitted.shape
    count = seq_len - 1 - start  # [B] pairs that became known (accepted drafts + the target's)
    cache = state.cache.with_lengths(start)
    positions = start[:, None] + jnp.arange(W, dtype=jnp.int32)
    pred, cache = eagle_forward(self.params, self.cfg, self.embed, emitted,
                                hidden.astype(self.params.fc.dtype), positions, cache)
    last = jnp.take_along_axis(pred, jnp.maximum(count - 1, 0)[:, None, None], axis=1)[:, 0]
    kept = count > 0
    return EagleState(cache=cache.with_lengths(jnp.where(kept, seq_len - 1, state.cache.lengths)),
                      next_feat=jnp.where(kept[:, None], last, state.next_feat))


def init_eagle(target_params, target_cfg: Config, key: Array, copy_layer: int | None = None
               ) -> tuple[EagleParams, Config]:
  """Fresh drafter params: fc passes the feature through (plus a small random token part), the
  layer is a copy of target layer `copy_layer` (default: the last) and the output norm the
  target's final norm, so training starts near "the next state is like this one"."""
  from jspec.train.drafter import drafter_config, layers_copyable
  cfg = drafter_config(target_cfg, 1)
  E = cfg.hidden_size
  k_fc, k_layer = jax.random.split(key)
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  fc = jnp.concatenate([0.02 * jax.random.normal(k_fc, (E, E)), jnp.eye(E)], axis=0)
  if layers_copyable(cfg, target_cfg):
    layer = jax.tree.map(f32, target_params.layers[target_cfg.num_layers - 1 if copy_layer is None
                                                   else copy_layer])
  else:
    from jspec.models.llama import init_params
    layer = init_params(cfg, k_layer, jnp.float32).layers[0]
  return EagleParams(fc=f32(fc), layer=layer, norm=f32(target_params.final_norm)), cfg


def eagle_drafter(params: EagleParams, cfg: Config, target_params, keep_ids=None) -> EagleDrafter:
  """The drafter over the target's tables (`keep_ids`: VocabTrim head rows)."""
  from jspec.spec.vocab_trim import output_table
  dtype = params.fc.dtype
  embed = jnp.asarray(target_params.embed, dtype)
  table = jnp.asarray(output_table(target_params), dtype)  # [V, E]
  if keep_ids is None:
    return EagleDrafter(params=params, embed=embed, head=table, cfg=cfg)
  keep = check_keep_ids(np.asarray(keep_ids), cfg.vocab_size)
  return EagleDrafter(params=params, embed=embed, head=table[jnp.asarray(keep)], cfg=cfg,
                      keep_ids=jnp.asarray(keep))
