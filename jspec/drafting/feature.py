"""The feature-level drafters: one decoder layer that reads the target's hidden states. EAGLE
(arXiv 2401.15077; the network: jspec.models.eagle) reads the final-normed state and predicts the
next one, scored by the target's head; EAGLE-3 (arXiv 2503.01840; jspec.models.eagle3) reads three
layers' states fused into one (`feature_layers`: the engines' verification forward returns them)
and predicts tokens with its own head, feeding its layer's output forward. One drafter class
serves both: only the network functions differ (`_forward`, `_logits`, `_target_feats`).

Its cache holds pair j = (f_j, t_{j+1}) at slot j for every position whose target feature is known
(lengths = seq_len - 1); `next_feat` is f̂ at the last known position, which scores the next token.
Past the verified tokens it feeds its own predictions back: (f̂_{j+1}, draft) -> f̂_{j+2} -> ...
The target's features arrive through the protocol's `features` (the prefill at `init`, each
verified block at `update` / `accept_tree`), which replace the drafted pairs. The drafter's q is
the distribution it sampled from, so the usual verification keeps the output the target's.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jspec.drafting.base import DraftState, Features, HeadDrafter, Pick, draft_chain
from jspec.drafting.frontier import KVFrontierFeeder
from jspec.models.cache import KVCache
from jspec.models.config import Config
from jspec.models import eagle3
from jspec.models.eagle import EagleParams, eagle_forward, head_logits
from jspec.models.eagle3 import Eagle3Params
from jspec.models.llama import Params
from jspec.models.vocab_trim import check_keep_ids, output_rows
from jspec.sampling.processing import SamplingParams
from jspec.tree.structure import Tree, parent_of, take

Array = jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class EagleState(DraftState):
  cache: KVCache  # lengths = seq_len - 1: pairs 0 .. seq_len - 2 hold target features
  next_feat: Array  # [B, E] f̂ of the last known token (position seq_len - 1)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class EagleDrafter(HeadDrafter):
  """Feature-level drafter; see the module docstring. `embed` [V, E] is the target's input table
  as the target stores it, `head` its output head: the target's (a layerless Params, read as
  stored), a float table [M, E] of the rows `keep_ids` when VocabTrim'd, or None for EAGLE-3,
  whose head is its own, in `params`."""

  params: EagleParams | Eagle3Params
  embed: Array  # or the target's int8 / CPU-kernel table (quant.take_rows reads either)
  head: Array | Params | None
  cfg: Config = dataclasses.field(metadata=dict(static=True))
  keep_ids: Array | None = None
  # Propose under the target's penalties (jspec.sampling.penalties; with_draft_penalties).
  draft_penalties: bool = dataclasses.field(default=False, metadata=dict(static=True))

  @property
  def feature_layers(self) -> tuple[int, ...]:
    return self.params.taps if isinstance(self.params, Eagle3Params) else ()

  def check_weights(self, target_cfg: Config) -> None:
    """The pairs read the target's hidden states and its embedding: a drafter trained for a target
    of another width fails here, not in an einsum."""
    want = (target_cfg.vocab_size, target_cfg.hidden_size)
    got = tuple(self.embed.shape)
    if got != want or self.cfg.hidden_size != target_cfg.hidden_size:
      raise ValueError(f"the feature drafter reads a target of hidden size {self.cfg.hidden_size} "
                       f"(its embedding table {got}); this target's is {target_cfg.hidden_size} "
                       f"(table {want}). Fix: a drafter trained for this target (jspec "
                       f"train-eagle --model ...)")
    rows = None if self.keep_ids is None else self.keep_ids.shape[0]
    eagle3.check_feature_widths(self.params, target_cfg.hidden_size,
                                head_rows=target_cfg.vocab_size if rows is None else rows)

  def _forward(self, tokens, feats, positions, cache, slots=None, visible=None):
    """Pairs (feats [B, T, E], tokens [B, T]) -> (the features the next pairs read, cache)."""
    fn = eagle3.eagle3_forward if isinstance(self.params, Eagle3Params) else eagle_forward
    return fn(self.params, self.cfg, self.embed, tokens, feats, positions, cache, slots=slots,
              visible=visible)

  def _logits(self, feats: Array) -> Array:
    """Head logits [..., M] from what `_forward` returned."""
    if isinstance(self.params, Eagle3Params):
      return eagle3.logits(self.params, self.cfg, feats)
    return head_logits(self.head, feats)

  def _target_feats(self, hidden: Array) -> Array:
    """The target's `Features.hidden` as the pairs read it: EAGLE-3 fuses its three layers."""
    if isinstance(self.params, Eagle3Params):
      return eagle3.fuse(self.params, hidden)
    return hidden.astype(self.params.fc.dtype)

  def _fed(self, state: EagleState, feats: Array) -> Array:
    """The drafter's own features [B, W, E] as a round feeds them back (ConFu adds its
    contemplate signal)."""
    return feats

  def _pairs(self, state: EagleState, features: Features, known: Array,
             add: Array | None = None) -> EagleState:
    """Pairs (features.hidden[:, i], features.tokens[:, i]) at positions start + i written over
    the drafted ones; rows keep i < known [B] of them (rows that kept nothing stay as they were).
    `add` [B, W, E]: added to the pairs' target features."""
    W = features.tokens.shape[1]
    start = features.start
    cache = state.cache.with_lengths(start)
    positions = start[:, None] + jnp.arange(W, dtype=jnp.int32)
    feats = self._target_feats(features.hidden)
    if add is not None:
      feats = feats + add.astype(feats.dtype)
    pred, cache = self._forward(features.tokens, feats, positions, cache)
    last = jnp.take_along_axis(pred, jnp.maximum(known - 1, 0)[:, None, None], axis=1)[:, 0]
    kept = known > 0
    return dataclasses.replace(
        state, cache=cache.with_lengths(jnp.where(kept, start + known, state.cache.lengths)),
        next_feat=jnp.where(kept[:, None], last, state.next_feat))

  def _empty(self, cache: KVCache, B: int) -> EagleState:
    return EagleState(cache=cache, next_feat=jnp.zeros((B, self.cfg.hidden_size),
                                                       self.params.fc.dtype))

  def init(self, prompt: Array, prompt_lengths: Array, cache_size: int,
           features: Features) -> EagleState:
    """Ingest pairs (f_j, t_{j+1}) for j < P (t_P = the target's first sampled token)."""
    B = prompt.shape[0]
    cache = KVCache.init(self.cfg, B, cache_size, self.params.fc.dtype)  # K/V read [2E]: same
    empty = self._empty(cache.with_lengths(jnp.zeros((B,), jnp.int32)), B)
    return self._pairs(empty, features, prompt_lengths)

  def propose(self, state: EagleState, last2: Array, seq_len: Array, key: Array,
              sampling: SamplingParams, gamma: int, pick: Pick | None = None, *,
              penalty_history=None):
    cache = state.cache.with_lengths(seq_len - 1)

    def step(carry, prev: Array):
      feat, cache = carry
      pred, cache = self._forward(prev[:, None], self._fed(state, feat[:, None]),
                                  cache.lengths[:, None], cache)
      feat = pred[:, 0]
      return self._logits(feat), (feat, cache.commit(1))

    tokens, probs, (_, cache) = draft_chain(key, gamma, self._logits(state.next_feat),
                                            (state.next_feat, cache), step,
                                            self.sampler(sampling), pick,
                                            penalty=self.draft_penalty(penalty_history, sampling))
    return tokens, probs, dataclasses.replace(state, cache=cache)

  def update(self, state: EagleState, seq_len: Array, features: Features) -> EagleState:
    """The verified block's pairs replace the drafted ones: those of the tokens kept this round
    (accepted drafts and the target's), seq_len - 1 - start of them."""
    return self._pairs(state, features, seq_len - 1 - features.start)

  def tree_feeder(self, state: EagleState, last2: Array, seq_len: Array) -> KVFrontierFeeder:
    """Node n (depth d) is fed as the pair (f̂ of its parent, its token) at position
    seq_len - 2 + d; the root's children are scored by next_feat. The cache's committed prefix is
    seq_len - 1."""
    B = seq_len.shape[0]
    full = lambda feats: self.full_logits(self._logits(feats))
    node_feat = None  # [B, N, E] f̂ of every node once it is fed

    def run(tree: Tree, frontier: Array, slots: Array, visible: Array, cache: KVCache):
      nonlocal node_feat
      if node_feat is None:
        node_feat = jnp.zeros(tree.tokens.shape + (self.cfg.hidden_size,), state.next_feat.dtype)
      parent = parent_of(tree, frontier)  # [B, W]
      feats = self._fed(state, jnp.where((parent >= 0)[..., None], take(node_feat, parent),
                                         state.next_feat[:, None]))  # [B, W, E]
      positions = seq_len[:, None] - 2 + take(tree.depth, frontier)
      pred, cache = self._forward(take(tree.tokens, frontier), feats, positions, cache,
                                  slots=slots, visible=visible)
      rows = jnp.arange(B)[:, None]
      node_feat = node_feat.at[rows, frontier].set(pred, mode="drop")
      return full(pred), cache

    cache = state.cache.with_lengths(seq_len - 1)
    return KVFrontierFeeder(cache, full(state.next_feat)[:, None], seq_len - 1, run,
                            lambda cache, kv_slot: dataclasses.replace(state, cache=cache))

  def accept_tree(self, drafted: EagleState, path: Array, n_accepted: Array, seq_len: Array,
                  features: Features) -> EagleState:
    """The accepted path's target features replace the drafted pairs, as after a chain."""
    return self._pairs(drafted, features, n_accepted + 1)


def eagle_drafter(params: EagleParams, cfg: Config, target_params: Params,
                  keep_ids=None) -> EagleDrafter:
  """The drafter over the target's tables (`keep_ids`: VocabTrim head rows). Both are read as
  the target stores them (int8, 4-bit, a CPU kernel's layout: an 8B target's float32 copy would
  be 2 GB each, and the head's matmul would leave the target's kernel); a VocabTrim head is its
  kept rows as a float table [M, E] in the drafter's dtype."""
  embed = target_params.embed
  if keep_ids is None:
    head = dataclasses.replace(target_params, layers=())  # lm_head reads embed / lm_head
    return EagleDrafter(params=params, embed=embed, head=head, cfg=cfg)
  keep = check_keep_ids(np.asarray(keep_ids), cfg.vocab_size)
  rows = output_rows(target_params, keep).astype(params.fc.dtype)  # [M, E]
  return EagleDrafter(params=params, embed=embed, head=rows, cfg=cfg,
                      keep_ids=jnp.asarray(keep))


def eagle3_drafter(params: Eagle3Params, cfg: Config, keep_ids=None,
                   embed: Array | None = None, target_params: Params | None = None
                   ) -> EagleDrafter:
  """An EAGLE-3 drafter over the target's input table (`embed`, or `target_params.embed`); its head
  is its own, over the draft vocabulary `keep_ids` (None: the target's whole vocabulary)."""
  if embed is None:
    if target_params is None:
      raise ValueError("an EAGLE-3 drafter reads the target's input table: pass embed= (the "
                       "target's embedding) or target_params=")
    embed = target_params.embed
  M = params.head.shape[0]
  if keep_ids is None:
    if M != cfg.vocab_size:
      raise ValueError(f"an EAGLE-3 head of {M} rows needs its keep_ids (the target ids of its "
                       f"draft vocabulary); the target has {cfg.vocab_size}")
    return EagleDrafter(params=params, embed=embed, head=None, cfg=cfg)
  keep = check_keep_ids(np.asarray(keep_ids), cfg.vocab_size)
  if len(keep) != M:
    raise ValueError(f"keep_ids name {len(keep)} ids but the EAGLE-3 head has {M} rows")
  return EagleDrafter(params=params, embed=embed, head=None, cfg=cfg,
                      keep_ids=jnp.asarray(keep))
