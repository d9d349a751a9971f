"""Where a speculative round's time goes: each piece of its model work jitted and timed alone.

A chain round is gamma drafter steps (decoder layers, then the head and a draw over the
vocabulary), one target forward over gamma + 1 tokens (layers, then the head at every position),
then acceptance and cache bookkeeping. The pieces are timed as programs of their own, back to
back in a `fori_loop` like the engine runs them, so what the real round costs beyond their sum is
the engine's own work (acceptance, cache moves, the loop). Only shapes matter, not token values.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jspec.bench.profiling import best_seconds
from jspec.drafting.base import HeadDrafter
from jspec.models.cache import KVCache
from jspec.models.config import Config
from jspec.models.llama import Params, forward, lm_head
from jspec.models.numerics import engine_jit
from jspec.sampling.processing import GREEDY, SamplingParams, argmax


def _layers_s(params: Params, cfg: Config, tokens: int, cache_size: int, context: int,
              repeats: int) -> float:
  """One forward of `tokens` new tokens without the LM head (logits at no position)."""
  cache = KVCache.init(cfg, 1, cache_size, params.embed.dtype).with_lengths(
      jnp.asarray([context], jnp.int32))
  positions = context + jnp.arange(tokens, dtype=jnp.int32)[None]
  none = jnp.zeros((1, 0), jnp.int32)

  @engine_jit
  def run(params, cache):
    def one(i, carry):
      cache, acc = carry
      block = jnp.full((1, tokens), i, jnp.int32)
      _, hidden, cache = forward(params, cfg, block, positions, cache, logits_indices=none)
      return cache, acc + hidden[0, -1, 0]
    return jax.lax.fori_loop(0, repeats, one, (cache, jnp.float32(0)))

  return best_seconds(run, params, cache, repeats=repeats)


def _head_s(params: Params, cfg: Config, tokens: int, sample, repeats: int) -> float:
  """The LM head at `tokens` positions, each followed by `sample(key, logits [1, V])`."""
  @engine_jit
  def run(params, key):
    def one(i, acc):
      hidden = jnp.full((1, tokens, cfg.hidden_size), i, params.embed.dtype) * 1e-3
      logits = lm_head(params, hidden)  # [1, tokens, V]
      for t in range(tokens):
        token, probs = sample(jax.random.fold_in(key, i * tokens + t), logits[:, t])
        acc = acc + token[0] + probs[0, 0].astype(jnp.int32)
      return acc
    return jax.lax.fori_loop(0, repeats, one, jnp.int32(0))

  return best_seconds(run, params, jax.random.key(0), repeats=repeats)


def _greedy_pick(key, logits):
  return argmax(logits), logits


def round_split_s(target_params: Params, target_cfg: Config, drafter: HeadDrafter, gamma: int,
                  sampling: SamplingParams = GREEDY, context: int = 128, cache_size: int = 512,
                  repeats: int = 8) -> dict[str, float]:
  """Seconds per round of each piece, for a model drafter (one with params, cfg and a head):

  draft_layers: gamma one-token drafter forwards without the head; draft_head: gamma drafter
  heads + draws (`sampling`, VocabTrim'd if the drafter is); verify_layers: the target's forward
  of gamma + 1 tokens without the head; verify_head: the target's head at gamma + 1 positions;
  ar_step: one autoregressive target step (1-token forward + head), the baseline's cost a token.
  """
  sample = drafter.sampler(sampling)
  return {
      "draft_layers": gamma * _layers_s(drafter.params, drafter.cfg, 1, cache_size, context,
                                        repeats),
      "draft_head": gamma * _head_s(drafter.params, drafter.cfg, 1, sample, repeats),
      "verify_layers": _layers_s(target_params, target_cfg, gamma + 1, cache_size, context,
                                 repeats),
      "verify_head": _head_s(target_params, target_cfg, gamma + 1, _greedy_pick, repeats),
      "ar_step": (_layers_s(target_params, target_cfg, 1, cache_size, context, repeats)
                  + _head_s(target_params, target_cfg, 1, _greedy_pick, repeats)),
  }


def forward_width_s(params: Params, cfg: Config, widths: tuple[int, ...], context: int = 200,
                    cache_size: int = 512, repeats: int = 20) -> dict[int, dict[str, float]]:
  """Seconds of one target forward of T new tokens (layers, then the head and a greedy pick at
  every position) for each T in `widths`: what a verification block costs against a one-token
  step, the ratio speculation has to beat."""
  out = {}
  for T in widths:
    layers = _layers_s(params, cfg, T, cache_size, context, repeats)
    head = _head_s(params, cfg, T, _greedy_pick, repeats)
    out[T] = {"layers_s": layers, "head_s": head, "total_s": layers + head}
  return out
