"""The small random model most test files build: a 2-layer Llama over a 97-token vocabulary (a
prime, so no shape lines up with another by chance), GQA 4 query / 2 KV heads; and the
teacher-forced reference logits the tests compare decoding with."""

import dataclasses

import jax
import jax.numpy as jnp

from jspec.models.config import Config
from jspec.models.llama import forward, forward_rows

SMALL = Config(arch="llama", vocab_size=97, hidden_size=64, intermediate_size=128, num_layers=2,
               num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=256)
SMALL_512 = dataclasses.replace(SMALL, max_position_embeddings=512)  # long-prompt tests

# The model functions tests call outside any engine, compiled once a shape: run eagerly, each of
# their operations compiled apart for every new shape (one test compiled 509 programs).
jitted_forward = jax.jit(forward, static_argnums=1, static_argnames=("taps",))
teacher_forced_rows = jax.jit(forward_rows, static_argnums=1)  # (logits, hidden) of whole rows


def causal_logits(params, cfg: Config, row, width: int = 32) -> jax.Array:
  """The logits [len(row), V] of one causal forward over the token ids `row`, padded to a multiple
  of `width` (no position sees the padding after it): one compiled program for rows of many
  lengths."""
  ids = jnp.asarray([list(row) + [0] * (-len(row) % width)], jnp.int32)
  return teacher_forced_rows(params, cfg, ids)[0][0, :len(row)]
