"""Sampling parameters and the logits → processed distribution step shared by every sampler.

Speculative verification compares the target's and the draft's *processed* distributions, so the
same function (temperature, then top-k, then top-p) must serve both; it lives here, once.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

Array = jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """temperature 0 means greedy; top_k 0 and top_p 1 switch those filters off.

  The fields are pytree data, not static: changing them does not recompile.
  """

  temperature: float | Array = 0.0
  top_k: int | Array = 0
  top_p: float | Array = 1.0

  def validate(self) -> "SamplingParams":
    """Check concrete values on the host; returns self for chaining."""
    t, k, p = float(self.temperature), self.top_k, float(self.top_p)
    if not math.isfinite(t) or t < 0:
      raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {t}")
    if int(k) != k or int(k) < 0:
      raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {k}")
    if not (0.0 < p <= 1.0):
      raise ValueError(f"top_p must be in (0, 1] (1 = off), got {p}")
    return self

  @property
  def is_greedy(self) -> Array:
    return jnp.asarray(self.temperature) == 0


GREEDY = SamplingParams()


def processed_logprobs(logits: Array, sp: SamplingParams) -> Array:
  """Log-probabilities [..., V] after temperature, top-k and top-p; filtered tokens are -inf.

  Ties at a top-k or top-p threshold are kept (as transformers does). For temperature 0 this
  returns the temperature-1e-6 distribution; callers treat greedy separately with argmax. The
  vocabulary sort the filters need is skipped (lax.cond) when both are off.
  """
  x = logits.astype(jnp.float32) / jnp.maximum(jnp.asarray(sp.temperature, jnp.float32), 1e-6)
  k = jnp.asarray(sp.top_k, jnp.int32)
  top_p = jnp.asarray(sp.top_p, jnp.float32)
  filtered = jax.lax.cond((k > 0) | (top_p < 1), lambda: _top_k_top_p(x, k, top_p), lambda: x)
  return jax.nn.log_softmax(filtered, axis=-1)


def _top_k_top_p(x: Array, k: Array, top_p: Array) -> Array:
  """Mask with -inf what top-k (k > 0) and then top-p keep out of the scaled logits x [..., V]."""
  V = x.shape[-1]
  desc = -jnp.sort(-x, axis=-1)  # [..., V], largest first
  desc = jnp.where((k > 0) & (jnp.arange(V) >= k), -jnp.inf, desc)
  # top-p over what top-k left: keep a token while the mass strictly before it is < top_p.
  probs = jax.nn.softmax(desc, axis=-1)
  mass_before = jnp.cumsum(probs, axis=-1) - probs
  keep = (mass_before < top_p) & (desc > -jnp.inf)
  keep = keep.at[..., 0].set(True)
  n_keep = jnp.sum(keep, axis=-1, keepdims=True)
  threshold = jnp.take_along_axis(desc, n_keep - 1, axis=-1)  # smallest kept value
  return jnp.where(x < threshold, -jnp.inf, x)


def argmax(logits: Array) -> Array:
  """jnp.argmax(logits, axis=-1) as int32 (the first maximum; the first NaN if any), in two
  vectorised passes: XLA:CPU runs argmax's (value, index) reduction ~5x slower over a 150k
  vocabulary (5 rows: 2.0 vs 0.34 ms, beside 8.7 ms for a 1.5B int8 model's LM head)."""
  V = logits.shape[-1]
  top = jnp.max(logits, axis=-1, keepdims=True)
  hit = (logits == top) | jnp.isnan(logits)
  return jnp.min(jnp.where(hit, jnp.arange(V, dtype=jnp.int32), V), axis=-1)


def sample(key: Array, logits: Array, sp: SamplingParams) -> Array:
  """One token per row from logits [B, V]: argmax when greedy, else the processed distribution."""
  return jax.lax.cond(
      sp.is_greedy,
      lambda: argmax(logits),
      lambda: jax.random.categorical(key, processed_logprobs(logits, sp), axis=-1).astype(jnp.int32),
  )
