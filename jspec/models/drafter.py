"""Drafter architectures derived from a target: the shapes both decoding (loading a drafter
directory) and training (initialising one) need.

A drafter is a small Llama-family decoder with the target's vocabulary, so it runs through the same
`forward`; the feature-level drafter (jspec.models.eagle) is one such layer.
"""

from __future__ import annotations

from jspec.models.config import Config


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
