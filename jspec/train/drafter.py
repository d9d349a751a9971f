"""Draft-model initialisation for a given target (the architecture: jspec.models.drafter).

Two initialisations:

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
from jspec.models.drafter import layers_copyable, spread_layers
from jspec.models.llama import Params, init_params, layer_list

INITS = ("target", "random")


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
      target_layers = layer_list(target_params)
      layers = tuple(jax.tree.map(f32, target_layers[i]) for i in picked)
    return dataclasses.replace(params, embed=table, layers=layers,
                               final_norm=f32(target_params.final_norm))
  # Narrower: project the vocabulary table onto its top principal directions.
  centered = np.asarray(table) - np.asarray(table).mean(axis=0)
  _, _, vt = np.linalg.svd(centered, full_matrices=False)  # vt [E_target, E_target]
  projected = np.asarray(table) @ vt[: cfg.hidden_size].T  # [V, E]
  projected *= np.sqrt(cfg.hidden_size) / np.linalg.norm(projected, axis=1, keepdims=True).mean()
  return dataclasses.replace(params, embed=jnp.asarray(projected, jnp.float32))
