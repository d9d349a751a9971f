"""Drafters for the tiny random models the tests build."""

import jax

from jspec.drafting.model import ModelDrafter
from jspec.models.llama import init_params


def perturbed_drafter(params, cfg, amount: float) -> ModelDrafter:
  """The target's weights plus `amount` times another random model's (matrices only): a drafter
  that agrees with the target often, not always."""
  noise = init_params(cfg, jax.random.key(1), scale=0.3)
  return ModelDrafter(jax.tree.map(lambda a, b: a + amount * b if a.ndim > 1 else a, params,
                                   noise), cfg)
