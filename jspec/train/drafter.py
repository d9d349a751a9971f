"""Draft-model architecture and initialisation for a given target.

A drafter is a small Llama-family decoder with the target's tokenizer (same vocabulary), so it runs
through the same `forward` and `ModelDrafter`. Two initialisations:

  "target": embeddings, final norm and LM head from the target; when the drafter has the target's
            width its layers are copies of target layers spread over the depth (first, ..., last),
            otherwise the embedding is the target's projected onto its top principal directions
            and the layers are random. Distillation then starts from something that already
            speaks the target's language (the early-exit drafter is the untrained special case).
  "random": every weight random: the "tiny random draft" baseline, no knowledge of the target.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jspec.models.config import Config
from jspec.models.llama import Params, init_params

INITS = ("target", "random")


def drafter_config(target: Config, num_layers: int, hidden_size: int | None = None,
                   intermediate_size: int | None = None, num_heads: int | None = None,
                   num_kv_heads: int | None = None) -> Config:
  """A plain Llama config for a drafter of the target's vocabulary; sizes default to the target's
  (head_dim is the target's; heads follow the width)."""
  hidden = hidden_size or target.hidden_size
  if hidden % target.head_dim:
    raise ValueError(f"drafter width {hidden} must be a multiple of the head dim {target.head_dim}")
  heads = num_heads or hidden // target.head_dim
  kv = num_kv_heads or max(1, heads * target.num_kv_heads // target.num_heads)
  if heads % kv:
    raise ValueError(f"drafter heads ({heads}) must be a multiple of its kv heads ({kv})")
  if num_layers < 1:
    raise ValueError(f"a drafter needs at least one layer, got num_layers={num_layers}")
  intermediate = intermediate_size or max(64, round(target.intermediate_size * hidden
                                                    / target.hidden_size / 64) * 64)
  return Config(arch="llama", vocab_size=target.vocab_size, hidden_size=hidden,
                intermediate_size=intermediate, num_layers=num_layers, num_heads=heads,
                num_kv_heads=kv, head_dim=target.head_dim, rms_norm_eps=target.rms_norm_eps,
                rope_theta=target.rope_theta, rope_scaling=target.rope_scaling,
                max_position_embeddings=target.max_position_embeddings, tie_embeddings=True)


def spread_layers(num_target: int, num_draft: int) -> list[int]:
  """Target layer indices copied into the drafter: evenly spread, first and last included."""
  if num_draft == 1:
    return [0]
  return [round(i * (num_target - 1) / (num_draft - 1)) for i in range(num_draft)]


def layers_copyable(cfg: Config, target_cfg: Config) -> bool:
  """Can target layers be copied into a drafter of `cfg`? Shaped alike (the caller checks the
  width) and free of extras a plain Llama layer cannot hold."""
  return (cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size) == (
      target_cfg.num_heads, target_cfg.num_kv_heads, target_cfg.intermediate_size) and not (
      target_cfg.qkv_bias or target_cfg.o_bias or target_cfg.qk_norm or target_cfg.mlp_bias)


def init_drafter(target_params: Params, target_cfg: Config, cfg: Config, key: jax.Array,
                 init: str = "target") -> Params:
  """Drafter parameters for `cfg` (from `drafter_config`), float32."""
  if init not in INITS:
    raise ValueError(f"init must be one of {INITS}, got {init!r}")
  if cfg.vocab_size != target_cfg.vocab_size:
    raise ValueError(f"drafter vocabulary {cfg.vocab_size} != target's {target_cfg.vocab_size}")
  params = init_params(cfg, key, jnp.float32)
  if init == "random":
    return params
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  # Tied drafter head: the target's output matrix is the better start when the target is untied.
  table = f32(target_params.embed if target_params.lm_head is None else target_params.lm_head.T)
  same_width = cfg.hidden_size == target_cfg.hidden_size
  if same_width:
    # Target layers fit only when shaped alike and free of extras a plain Llama cannot hold.
    layers = params.layers
    if layers_copyable(cfg, target_cfg):
      picked = spread_layers(target_cfg.num_layers, cfg.num_layers)
      layers = tuple(jax.tree.map(f32, target_params.layers[i]) for i in picked)
    return dataclasses.replace(params, embed=table, layers=layers,
                               final_norm=f32(target_params.final_norm))
  # Narrower: project the vocabulary table onto its top principal directions.
  centered = np.asarray(table) - np.asarray(table).mean(axis=0)
  _, _, vt = np.linalg.svd(centered, full_matrices=False)  # vt [E_target, E_target]
  projected = np.asarray(table) @ vt[: cfg.hidden_size].T  # [V, E]
  projected *= np.sqrt(cfg.hidden_size) / np.linalg.norm(projected, axis=1, keepdims=True).mean()
  return dataclasses.replace(params, embed=jnp.asarray(projected, jnp.float32))
