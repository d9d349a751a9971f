"""ConFu's contemplate machinery ("ConFu: Contemplate the Future for Better Speculative Sampling",
arXiv 2603.08899), on top of the EAGLE-3 drafter (jspec.models.eagle3).

Only the paper's abstract and second-hand summaries could be read from this machine (no code
release), so what follows is jspec's reading of its parts, each a documented choice:

- Contemplate tokens: one extra position after EVERY token of each verification block (and after
  the last prompt token at prefill), run by the target in the same forward that verifies
  (jspec.speculative.probing: the probing layout with k = 1). Contemplate c_i sits at the position
  after block token b_i, sees what b_i sees, b_i and the soft prompt; no block token sees it and
  its KV entry is never committed, so verification is exactly the target's. The target's taps at
  the contemplate after the last accepted token (the same three layers EAGLE-3 fuses) are the
  "future" signal of the next round.
- Soft prompt: P learned input embeddings the target runs after the root (positions root + 1 ..
  root + P), seeing the context and the root; only contemplate tokens see them (prompt tuning of
  the frozen target for the contemplate task).
- Dynamic contemplate tokens with MoE: a contemplate token's input embedding is a mixture of
  `experts` [N, E] picked by a router over the (unit-RMS) embedding of the token it follows: the
  top_k experts' softmax weights, renormalised over those k.
- How the drafter reads it: c = proj(norm(fc(taps at the contemplate))) [E] is added to the
  drafter's feature input wherever a round's chain is fed: the pair of the last accepted token
  (fused target taps + c) and every later draft (the drafter's own h + c). `proj` starts at zero,
  so a fresh ConFu drafter is exactly its EAGLE-3 drafter.
- Training (jspec.train.confu): anchor token sampling (contemplate tokens at a random subset of
  row positions only, each with its own soft prompt copy, through the frozen target with
  gradients into the experts, router and soft prompt) and future prediction replication (one
  anchor's c feeds every training-time-test pass of the chain started there, as decoding feeds
  one c to every draft of a round).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jspec.models import quant
from jspec.models.config import Config
from jspec.models.eagle3 import Eagle3Params, fuse
from jspec.models.llama import Params, rms_norm

Array = jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ContemplateParams:
  """ConFu's weights beside its EAGLE-3 drafter's."""

  experts: Array  # [N, E] contemplate input embeddings, mixed per token
  router: Array  # [E, N] scores the experts from the followed token's embedding
  soft: Array  # [P, E] the soft prompt's input embeddings
  norm: Array  # [E] norms the fused contemplate taps
  proj: Array  # [E, E] into the drafter's feature (zero at init)
  top_k: int = dataclasses.field(metadata=dict(static=True), default=2)

  @property
  def soft_tokens(self) -> int:
    return self.soft.shape[0]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ConFuParams:
  """A ConFu drafter's trained weights: the EAGLE-3 drafter and the contemplate machinery."""

  drafter: Eagle3Params
  contemplate: ContemplateParams



def contemplate_embeddings(cp: ContemplateParams, cfg: Config, embed: Array,
                           tokens: Array) -> Array:
  """[..., E]: the input embedding of the contemplate token after each of `tokens` [...]: its
  router's top_k experts, mixed by their renormalised softmax weights."""
  e = quant.take_rows(embed, tokens).astype(jnp.float32)
  e = rms_norm(e, jnp.ones(e.shape[-1:], jnp.float32), cfg.rms_norm_eps)  # [..., E] unit RMS
  scores = jnp.einsum("...e,en->...n", e, cp.router.astype(jnp.float32))
  # Exactly top_k experts, ties going to the lower index (a threshold at the k-th score would
  # mix every expert tied with it).
  top = jax.lax.top_k(scores, cp.top_k)[1]  # [..., k]
  chosen = jnp.any(top[..., None] == jnp.arange(scores.shape[-1]), axis=-2)  # [..., N]
  weights = jax.nn.softmax(jnp.where(chosen, scores, -jnp.inf), axis=-1)
  return jnp.einsum("...n,ne->...e", weights, cp.experts.astype(jnp.float32))


def soft_embeddings(cp: ContemplateParams, B: int) -> Array:
  """[B, P, E]: the soft prompt for every row."""
  return jnp.broadcast_to(cp.soft.astype(jnp.float32)[None], (B,) + cp.soft.shape)


def contemplate_feature(cp: ContemplateParams, drafter: Eagle3Params, cfg: Config,
                        taps: Array) -> Array:
  """[..., E]: what the drafter adds to its feature input, from the target's taps [..., 3E] at a
  contemplate token (fused by the drafter's own `fc`)."""
  c = rms_norm(fuse(drafter, taps), cp.norm.astype(drafter.fc.dtype), cfg.rms_norm_eps)
  return jnp.einsum("...e,ef->...f", c, cp.proj.astype(c.dtype))


def init_contemplate(target_params: Params, cfg: Config, key: Array, experts: int = 4,
                     soft_tokens: int = 2, top_k: int = 2) -> ContemplateParams:
  """Experts and soft prompt at the target's mean input embedding plus small noise (ESP's mask
  starts at the mean embedding), a small random router, the target's final norm, `proj` zero."""
  if experts < 1 or soft_tokens < 0 or not 1 <= top_k <= experts:
    raise ValueError(f"ConFu needs experts >= 1, 1 <= top_k <= experts and soft_tokens >= 0; got "
                     f"experts={experts}, top_k={top_k}, soft_tokens={soft_tokens}")
  E = cfg.hidden_size
  mean = jnp.mean(jnp.asarray(target_params.embed, jnp.float32), axis=0)  # [E]
  scale = jnp.std(jnp.asarray(target_params.embed, jnp.float32))
  k_e, k_r, k_s = jax.random.split(key, 3)
  return ContemplateParams(
      experts=mean + 0.1 * scale * jax.random.normal(k_e, (experts, E)),
      router=0.02 * jax.random.normal(k_r, (E, experts)),
      soft=mean + 0.1 * scale * jax.random.normal(k_s, (soft_tokens, E)),
      norm=jnp.asarray(target_params.final_norm, jnp.float32),
      proj=jnp.zeros((E, E), jnp.float32), top_k=top_k)


def check_contemplate(cp: ContemplateParams, drafter: Eagle3Params, cfg: Config) -> None:
  """Host-side: shapes that fit the drafter and the target's width."""
  E = cfg.hidden_size
  N = cp.experts.shape[0]
  if cp.experts.shape != (N, E) or cp.router.shape != (E, N) or cp.soft.shape[1:] != (E,) or (
      cp.proj.shape != (E, E) or cp.norm.shape != (E,)):
    raise ValueError(f"ConFu weights do not fit a target of width {E}: experts "
                     f"{cp.experts.shape}, router {cp.router.shape}, soft {cp.soft.shape}, "
                     f"proj {cp.proj.shape}")
  if not 1 <= cp.top_k <= N:
    raise ValueError(f"ConFu mixes top_k of its {N} experts; top_k = {cp.top_k} does not fit")
  if not isinstance(drafter, Eagle3Params):
    raise ValueError("ConFu's contemplate tokens sit on an EAGLE-3 drafter")
