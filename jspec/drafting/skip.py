"""Layer-skip self-speculation: the target drafts with a subset of its own layers, sharing its KV
cache for the layers it runs (SWIFT, Kangaroo and DEL; PAPERS.md).

The draft feeds the last known token and then each draft through the kept layers only, reading
the target's committed KV entries of those layers (computed by the full model) and writing its own
entries after them; the verification forward then writes the whole block over those slots, so
nothing of the draft survives a round. The skipped set comes from a short calibration on the
target's own outputs, no training: the layers that change the residual stream least over text the
target generated (one minus the mean cosine similarity of a layer's input and output, ShortGPT's
block influence) are skipped; the first and last layers always run.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jspec.decode import prompt_bucket
from jspec.drafting.base import (DraftState, Features, HeadDrafter, Pick, check_stop, draft_chain,
                                 unsure)
from jspec.models.cache import KVCache
from jspec.models.config import Config
from jspec.models.llama import Params, forward, forward_layers, num_layers
from jspec.sampling.processing import SamplingParams

Array = jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SkipState(DraftState):
  """Nothing of its own: the draft's KV lives in the target's cache during a round."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SkipDrafter(HeadDrafter):
  """The target (`params`, `cfg`) running only the decoder layers `layers` (ascending), with the
  target's KV cache (`shares_target_cache`: the chain engine passes it to `propose_shared`)."""

  params: Params
  cfg: Config = dataclasses.field(metadata=dict(static=True))
  layers: tuple[int, ...] = dataclasses.field(default=(), metadata=dict(static=True))
  stop_below: float | None = dataclasses.field(default=None, metadata=dict(static=True))
  # Propose under the target's penalties (jspec.sampling.penalties; with_draft_penalties): on, as
  # its logits are the target's own layers' (tau 1.51 -> 1.72 at repetition 1.2, session 50).
  draft_penalties: bool = dataclasses.field(default=True, metadata=dict(static=True))
  keep_ids = None  # the target's full head
  shares_target_cache = True

  def __post_init__(self):
    L = self.cfg.num_layers
    layers = tuple(self.layers)
    if not layers or list(layers) != sorted(set(layers)) or layers[0] < 0 or layers[-1] >= L:
      raise ValueError(f"a layer-skip draft runs a non-empty ascending set of distinct layers "
                       f"of the target's 0 .. {L - 1}, got {layers!r} (skipping every layer "
                       f"leaves nothing to draft with)")
    if len(layers) == L:
      raise ValueError(f"a layer-skip draft that runs all {L} layers is the target itself: "
                       f"skip at least one (or draft with the target itself: "
                       f"--drafter self, self_drafter).")

  @property
  def stops_early(self) -> bool:
    return self.stop_below is not None

  @property
  def target_cfg(self) -> Config:
    return self.cfg

  def with_stop(self, threshold: float) -> SkipDrafter:
    return dataclasses.replace(self, stop_below=check_stop(threshold))

  def init(self, prompt: Array, prompt_lengths: Array, cache_size: int,
           features: Features) -> SkipState:
    return SkipState()

  def propose(self, state, last2, seq_len, key, sampling, gamma, pick=None, *,
              penalty_history=None):
    raise ValueError("a layer-skip draft reads the target's KV cache: the chain engine calls "
                     "propose_shared (trees are not drafted by layer skipping yet)")

  def propose_shared(self, state: SkipState, cache: KVCache, last2: Array, seq_len: Array,
                     key: Array, sampling: SamplingParams, gamma: int, pick: Pick | None = None,
                     *, penalty_history=None):
    """A chain drafted over the target's `cache` (its lengths: the committed entries, seq_len - 1
    less any a KV budget evicted) → (tokens, q, state, the cache with the draft's entries past
    its length, length unchanged). RoPE positions count the evicted entries too."""
    evicted = seq_len - 1 - cache.lengths  # [B]
    run = lambda tokens, cache: forward_layers(self.params, self.cfg, tokens,
                                               (cache.lengths + evicted)[:, None], cache,
                                               self.layers)
    logits, shared = run(last2[:, 1:], cache)

    def step(cache: KVCache, prev: Array):
      logits, cache = run(prev[:, None], cache)
      return logits[:, 0], cache.commit(1)

    tokens, probs, shared = draft_chain(
        key, gamma, logits[:, 0], shared.commit(1), step, self.sampler(sampling), pick,
        None if self.stop_below is None else unsure(self.stop_below),
        self.draft_penalty(penalty_history, sampling))
    return tokens, probs, state, shared.with_lengths(cache.lengths)

  catches_up = True

  def catch_up(self, state: SkipState, tokens: Array, seq_len: Array) -> SkipState:
    """Nothing to catch up: the target's verification writes every entry the draft reads."""
    return state

  def update(self, state: SkipState, seq_len: Array, features: Features) -> SkipState:
    return state

  def tree_feeder(self, state, last2, seq_len):
    raise ValueError("layer-skip drafts chains only (trees would need the target's cache in "
                     "the tree feeder). Fix: drop --tree / tree=.")

  def accept_tree(self, drafted, path, n_accepted, seq_len, features):
    raise ValueError("layer-skip drafts chains only")


def layer_influence(params: Params, cfg: Config, tokens: Sequence[int]) -> np.ndarray:
  """[L]: 1 - the mean cosine similarity between each layer's input and output residual stream
  over `tokens` (ShortGPT's block influence): how much the layer changes what flows through.
  The model's own forward (one lax.scan over stacked layers), padded to a prompt bucket so that
  calibration texts of similar length share one compiled program."""
  n = len(tokens)
  T = prompt_bucket(n)
  # Padding after the text: causal attention lets no real token see it; the mean leaves it out.
  ids = jnp.asarray([list(tokens) + [0] * (T - n)], jnp.int32)
  return np.asarray(_influence(params, cfg, ids, jnp.int32(n)))


@functools.partial(jax.jit, static_argnums=(1,))
def _influence(params: Params, cfg: Config, ids: Array, n: Array) -> Array:
  T = ids.shape[1]
  L = num_layers(params)
  cache = KVCache.init(cfg, 1, T, jnp.float32)
  _, streams, _ = forward(params, cfg, ids, jnp.arange(T)[None], cache,
                          logits_indices=jnp.zeros((1, 1), jnp.int32), taps=tuple(range(L + 1)))
  x = streams[0].reshape(T, L + 1, -1).astype(jnp.float32)  # [T, L + 1, E]: layer i's input
  x_in, x_out = x[:, :-1], x[:, 1:]  # and output (tap L: the last layer's, before the norm)
  sim = jnp.sum(x_in * x_out, -1) / (jnp.linalg.norm(x_in, axis=-1)
                                     * jnp.linalg.norm(x_out, axis=-1))  # [T, L]
  real = (jnp.arange(T) < n)[:, None]
  return 1.0 - jnp.sum(jnp.where(real, sim, 0.0), axis=0) / n


def calibrated_layers(influence: np.ndarray, n_skip: int) -> tuple[int, ...]:
  """The layers to run when the `n_skip` of least influence are skipped (never the first or the
  last: they map tokens into and out of the residual stream)."""
  L = len(influence)
  if not 1 <= n_skip <= L - 2:
    raise ValueError(f"skip:N skips 1 .. {L - 2} of the target's {L} layers (the first and last "
                     f"always run), got N = {n_skip}")
  middle = sorted(range(1, L - 1), key=lambda i: float(influence[i]))
  return tuple(sorted(set(range(L)) - set(middle[:n_skip])))


def skip_drafter(params: Params, cfg: Config, layers: Sequence[int]) -> SkipDrafter:
  """The target running only `layers` as its own draft, sharing its KV cache."""
  return SkipDrafter(params=params, cfg=cfg, layers=tuple(int(i) for i in layers))
