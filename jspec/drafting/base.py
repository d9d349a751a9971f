"""The drafter protocol: everything the speculative engines know of a drafter.

A drafter is a pytree (weights as data, configuration static) with a typed loop state, so any
drafter runs inside the same jitted `lax.while_loop`. The engines call, and never ask what kind of
drafter they hold:

  init(prompt, prompt_lengths, cache_size, features) -> state       after the target's prefill
  propose(state, last2, seq_len, key, sampling, gamma, pick=None)   each chain round
      -> (tokens [B, G] int32, q [B, G, V] float32, state)
  update(state, seq_len, features) -> state                         after a chain verification
  draft_tree(state, last2, seq_len, key, sampling, shape)           each tree round
      -> (Tree, drafted state)
  accept_tree(drafted, path, n_accepted, seq_len, features) -> state   after a tree verification

`last2` [B, 2] holds each row's last two known tokens, `seq_len` [B] how many tokens the row knows
(prompt plus generated). A chain may end early: drafts of -1 from some index on (drafters with
`stops_early`); those positions are not verified. `q` are the *processed* distributions
(temperature, top-k, top-p, exactly as the verifier processes the target's) the tokens were drawn
from. `features` is what the target
computed for the tokens that just became known (its hidden states); drafters that do not read the
target ignore it. `pick` lets a wrapper replace each draw (the n-gram lookup does); the drafter
then reads the replacement, so its own cache follows what is proposed.

Trees come from one generic adapter: `draft_tree` runs the shape's schedule (jspec.tree.shapes)
over a `TreeFeeder`, which each drafter makes with `tree_feeder`; a drafter only says how it scores
a frontier of tree nodes.
"""

from __future__ import annotations

import abc
import dataclasses
import inspect
from typing import Callable, Protocol

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from jspec.models.vocab_trim import full_vocab_logits, to_full_vocab
from jspec.sampling.penalties import History, chain_draft_penalty, tree_draft_penalty
from jspec.sampling.processing import SamplingParams, argmax, processed_logprobs, switch
from jspec.sharding import Placement
from jspec.tree.structure import Tree

Array = jax.Array
# pick(i, drafts so far [B, G] (valid below i), token [B], q [B, V]) -> (token, q, kept [B]) for
# draft i; kept: the draft stands whatever an adaptive stop says of the drafter's logits (a lookup
# match in `ngram+X@P`).
Pick = Callable[[Array, Array, Array, Array], tuple[Array, Array, Array]]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Features:
  """The target's view of tokens that just became known: `hidden` [B, W, E] (final-normed; or
  [B, W, n E], the drafter's `feature_layers`) at positions start + i, and `tokens` [B, W], the token that follows position start + i. Entries
  i < seq_len - 1 - start are known (seq_len: the row's new length); the rest are padding."""

  hidden: Array  # [B, W, E]
  tokens: Array  # [B, W] int32
  start: Array  # [B] int32
  # Probing drafters (Drafter.probe_masks = k > 0): the target's final-normed hidden states
  # [B, k, E] (or its `feature_layers`, as `hidden`) at the k mask positions that followed the
  # last accepted token (at prefill: the last prompt token, under a KV budget probed after the
  # chunked prefill; None for drafters that do not probe).
  probe_hidden: Array | None = None
  # Drafters with a lookahead window (Drafter.window_size = X > 0): the target's final-normed
  # hidden states [B, X, E] at the window tokens of the round (None at prefill).
  window_hidden: Array | None = None


class DraftState:
  """Base of every drafter's loop state; each drafter's state is a registered-dataclass pytree."""


class TreeFeeder(Protocol):
  """`next_logits(tree, frontier)` of jspec.tree.draft over one drafter, for one round."""

  def __call__(self, tree: Tree, frontier: Array) -> Array:
    """Next-token logits [B, W, V] (full vocabulary) at the frontier nodes' contexts."""

  def result(self, tree: Tree, reindexed: bool) -> DraftState:
    """The drafter's state holding the final `tree` (`reindexed`: pruned after drafting)."""


class Drafter(abc.ABC):
  """The protocol (see the module docstring); `draft_tree` is shared by every drafter."""

  @property
  @abc.abstractmethod
  def vocab_size(self) -> int:
    """The vocabulary the drafter proposes in (it must be the target's)."""

  @abc.abstractmethod
  def init(self, prompt: Array, prompt_lengths: Array, cache_size: int,
           features: Features) -> DraftState:
    """The state after the prompt; features: the target's prefill (start 0, tokens = the prompt
    shifted by one, the target's first sampled token at prompt_lengths - 1)."""

  @abc.abstractmethod
  def propose(self, state: DraftState, last2: Array, seq_len: Array, key: Array,
              sampling: SamplingParams, gamma: int, pick: Pick | None = None, *,
              penalty_history: History | None = None) -> tuple[Array, Array, DraftState]:
    """A chain of `gamma` drafts with their q. penalty_history: the text's counts when penalties
    may be on (jspec.sampling.penalties), passed only then; a drafter that can propose under the
    target's penalties and is asked to (`with_draft_penalties`) does, others ignore it."""

  @abc.abstractmethod
  def update(self, state: DraftState, seq_len: Array, features: Features) -> DraftState:
    """After a chain verification that left each row knowing seq_len tokens."""

  @abc.abstractmethod
  def tree_feeder(self, state: DraftState, last2: Array, seq_len: Array) -> TreeFeeder:
    """A feeder that scores tree frontiers below the last known token for one round."""

  @abc.abstractmethod
  def accept_tree(self, drafted: DraftState, path: Array, n_accepted: Array, seq_len: Array,
                  features: Features) -> DraftState:
    """After a tree verification accepting path [B, D] (n_accepted [B] nodes) from a round that
    started at seq_len; features hold the root and the accepted path."""

  # Mask positions the target's verification forward appends after every block token for this
  # drafter (jspec.drafting.probe): 0 for drafters that run their own model or lookup.
  probe_masks: int = 0
  # Whether each mask's logits are a draft (mask-token probing: chains and trees at most
  # probe_masks deep) rather than a signal a drafter model reads (ConFu).
  drafts_from_masks: bool = False
  # Soft prompt tokens the verification forward runs after the masks (ConFu,
  # jspec.drafting.confu): every mask sees them, no block token does; 0: none.
  soft_tokens: int = 0
  # Tokens the target's verification forward runs after the block for this drafter, all
  # following the root (a lookahead window, jspec.drafting.lookahead): `window_tokens(state)`
  # [B, X] laid out by `window_pattern` (jspec.speculative.probing.window_layout); 0: none.
  window_size: int = 0
  # A tree shape the drafter grows by default (the engines use it when no tree or chain is
  # asked for): a lookahead pool's n-grams.
  own_tree = None
  # The target layers whose input residual stream `Features.hidden` carries, concatenated
  # (EAGLE-3's fused features); () : the final-normed hidden state.
  feature_layers: tuple[int, ...] = ()
  # Adaptive draft length: `propose` may end a row's chain early (drafts -1 from there on); the
  # chain engine then verifies only the drafts before it, and a round with no draft in any row
  # runs a one-token target forward instead of the full block.
  stops_early: bool = False
  # Layer-skip drafts run the target's own layers over the target's KV cache: the chain engine
  # calls propose_shared(state, target cache, ...) -> (tokens, q, state, cache) instead of propose.
  shares_target_cache: bool = False
  # ngram+X: the lookup may leave this drafter out of a chain round it matched in full; the
  # drafter then reads that round's tokens afterwards with `catch_up`.
  catches_up: bool = False
  # Whether it proposes under the target's penalties (`with_draft_penalties`; a field of the
  # drafters that draw from logits).
  draft_penalties: bool = False

  @property
  def target_cfg(self):
    """The target config this drafter was built for when it runs the target's own weights or
    cache (probing, layer skipping, lookahead): it then fits that target's shapes only. None
    for drafters with weights of their own."""
    return None

  def check_weights(self, target_cfg) -> None:
    """Host-side: refuse weights that do not fit the drafter's own config, or the target's
    (`target_cfg`) where they read its features; a drafter with weights of its own says how, the
    rest have nothing to check."""

  def check_tree(self, shape) -> None:
    """Host-side: refuse a tree shape (jspec.tree.shapes) this drafter cannot grow. Any shape but
    a pool of n-grams, which only a drafter that keeps a pool draws (lookahead)."""
    if shape.method == "pool":
      raise ValueError(f"tree {shape} holds n-grams from a pool: only a drafter that keeps one "
                       f"(--drafter lookahead) drafts it. Fix: another tree shape, or --drafter "
                       f"lookahead")

  def catch_up(self, state: DraftState, tokens: Array, seq_len: Array) -> DraftState:
    """The state as if `propose` had run in a round that started at seq_len: `tokens` [B, W]
    are that round's last two known tokens and its first W - 2 drafts (at positions seq_len - 2
    onward; those a later round re-reads or that were rejected may be anything)."""
    raise NotImplementedError(f"{type(self).__name__} cannot catch up on a skipped round")

  def with_stop(self, threshold: float) -> "Drafter":
    """This drafter with adaptive draft length: a chain ends before the first draft whose
    confidence (the drafter's largest next-token probability, before temperature and top-k/p) is
    below `threshold` (an n-gram lookup: before its first miss). Drafters that cannot say how sure
    they are refuse."""
    raise ValueError(f"{type(self).__name__} has no adaptive draft length: drop the stop "
                     f"threshold (the @P of a drafter name NAME@P) for it")

  def with_draft_penalties(self, on: bool = True) -> "Drafter":
    """This drafter proposing under the target's repetition / presence / frequency penalties
    (counting its own earlier drafts) when a run has them, or (on=False) without. The output is
    the same either way; acceptance is not: a drafter whose logits are the target's own (the
    target as its drafter, layer skipping: on by default) gains, a small draft model or probing
    loses (benchmarks/README.md, session 50)."""
    if "draft_penalties" not in {f.name for f in dataclasses.fields(self)}:
      raise ValueError(f"{type(self).__name__} does not draw its drafts from logits (an n-gram "
                       f"lookup without a fallback, lookahead), so it cannot propose under "
                       f"penalties: do not call with_draft_penalties on it (a lookup with a model "
                       f"fallback, ngram+default, passes it on to the fallback)")
    return dataclasses.replace(self, draft_penalties=bool(on))

  def probe_embedding(self, state: DraftState) -> Array:
    """[B, E]: the input embedding of the mask positions (probing drafters only)."""
    raise NotImplementedError(f"{type(self).__name__} appends no mask positions")

  def prompt_probe_embedding(self, prompt: Array, prompt_lengths: Array) -> Array:
    """[B, E]: the mask embedding of the masks the prefill appends (probing drafters only)."""
    raise NotImplementedError(f"{type(self).__name__} appends no mask positions")

  def probe_inputs(self, state: DraftState, block: Array) -> Array:
    """[B, T k + soft_tokens, E]: the input embeddings of the masks after each token of `block`
    [B, T] (owner-major), then of the soft prompt. By default one mask embedding for all."""
    emb = self.probe_embedding(state)  # [B, E]
    B, T = block.shape
    return jnp.broadcast_to(emb[:, None], (B, T * self.probe_masks, emb.shape[1]))

  def prompt_probe_inputs(self, prompt: Array, prompt_lengths: Array) -> Array:
    """[B, k + soft_tokens, E]: the input embeddings of what the prefill appends after each
    prompt's last token. By default the prompt's mask embedding k times."""
    emb = self.prompt_probe_embedding(prompt, prompt_lengths)
    return jnp.broadcast_to(emb[:, None], (emb.shape[0], self.probe_masks, emb.shape[1]))

  def window_tokens(self, state: DraftState) -> Array:
    """[B, X]: the window tokens the next verification forward runs (window drafters only)."""
    raise NotImplementedError(f"{type(self).__name__} has no lookahead window")

  @property
  def window_pattern(self):
    """(visible [X, X] bool, offsets [X] int): which window tokens each sees, and its position
    past the root's (numpy constants; window drafters only)."""
    raise NotImplementedError(f"{type(self).__name__} has no lookahead window")

  def with_kv(self, policy, room: int) -> "Drafter":
    """This drafter with its KV cache under `policy` (a key-scored `jspec.kv.policy.KVPolicy`;
    None: a full cache), sized for rounds that feed at most `room` tokens past the committed ones.
    The engines call it with the `draft_kv` they are given. Drafters without a model KV cache of
    their own (n-gram lookup alone) and feature drafters (one layer) keep their state whole."""
    return self

  def draft_tree(self, state: DraftState, last2: Array, seq_len: Array, key: Array,
                 sampling: SamplingParams, shape, *,
                 penalty_history: History | None = None) -> tuple[Tree, DraftState]:
    """Grow a tree of `shape` (jspec.tree.shapes) below the last known token. Tokens and q are in
    the full vocabulary. When `shape.greedy_variant`, greedy sampling drafts the temperature-0
    variant (settings per row with greedy rows beside sampled ones: those rows alone).
    penalty_history: as `propose`'s; a drafter asked to propose under the penalties scores each
    frontier node's children for the text and the node's path (`tree_draft_penalty`).
    """
    B = last2.shape[0]
    penalty = tree_draft_penalty(penalty_history, sampling) if self.draft_penalties else None

    def run(greedy: bool | Array) -> tuple[Tree, DraftState]:
      feeder = _CheckedFeeder(self, self.tree_feeder(state, last2, seq_len), B)
      if penalty is not None:
        feeder = _PenalizedFeeder(feeder, penalty)
      tree = shape.draft(key, feeder, B, self.vocab_size, sampling, greedy=greedy)
      return tree, feeder.result(tree, shape.reindexes)

    greedy = sampling.is_greedy
    if not shape.greedy_variant:
      return run(False)
    if jnp.ndim(greedy) == 0:
      return switch(greedy, lambda: run(True), lambda: run(False))
    # Greedy rows beside sampled ones (settings per row): one tree, each row drafted its own way
    # (the drafter's state is laid out [L, B, ...]: not a per-row select).
    return run(greedy)


class _CheckedFeeder:
  """A TreeFeeder whose logits are checked against the protocol at trace time (check_proposal)."""

  def __init__(self, drafter: Drafter, feeder: TreeFeeder, batch: int):
    self.drafter, self.feeder, self.batch = drafter, feeder, batch

  def __call__(self, tree: Tree, frontier: Array) -> Array:
    logits = self.feeder(tree, frontier)
    check_proposal(self.drafter, "tree_feeder's feeder", None, logits, self.batch,
                   frontier.shape[1], self.drafter.vocab_size)
    return logits

  def result(self, tree: Tree, reindexed: bool) -> DraftState:
    return self.feeder.result(tree, reindexed)


class _PenalizedFeeder:
  """A TreeFeeder whose frontier logits are penalized (`tree_draft_penalty`): the children of a
  node are drawn from the law the target verifies them under."""

  def __init__(self, feeder: TreeFeeder, penalty: Callable):
    self.feeder, self.penalty = feeder, penalty

  def __call__(self, tree: Tree, frontier: Array) -> Array:
    return self.penalty(self.feeder(tree, frontier), tree, frontier)

  def result(self, tree: Tree, reindexed: bool) -> DraftState:
    return self.feeder.result(tree, reindexed)


class HeadDrafter(Drafter):
  """A drafter that scores tokens with an LM head over the full vocabulary or, with VocabTrim's
  `keep_ids` [M], over M of its ids; subclasses are dataclasses with `cfg` and `keep_ids`."""

  @property
  def vocab_size(self) -> int:
    return self.cfg.vocab_size

  def sampler(self, sampling: SamplingParams) -> Callable:
    """sample(key, head logits [B, M]) -> (token [B], q [B, V]) in the full vocabulary."""
    return lambda key, logits: sample_full_vocab(key, logits, sampling, self.keep_ids,
                                                 self.vocab_size)

  def full_logits(self, logits: Array) -> Array:
    """Head logits [..., M] in the full vocabulary [..., V] (-inf off the kept ids)."""
    return full_vocab_logits(logits, self.keep_ids, self.vocab_size)

  def draft_penalty(self, history: History | None, sampling: SamplingParams):
    """draft_chain's `penalty` for head logits [B, M]: penalized in the full vocabulary (a
    trimmed head's ids mapped there and back); None without a history or when the drafter
    proposes unpenalized (`draft_penalties`, set by `with_draft_penalties`)."""
    penalty = chain_draft_penalty(history, sampling) if self.draft_penalties else None
    if penalty is None or self.keep_ids is None:
      return penalty
    return lambda logits, tokens, i: penalty(self.full_logits(logits), tokens, i)[
        :, self.keep_ids]


def penalty_kwargs(drafter: Drafter, history: History | None, tree: bool = False) -> dict:
  """{"penalty_history": history} for a drafter whose propose (propose_shared, if it drafts in the
  target's cache; draft_tree for a tree) takes it; {} without a history, or for a drafter written
  before penalties (its own signature), which then proposes unpenalized: the output is the same."""
  if history is None:
    return {}
  method = (drafter.draft_tree if tree else
            drafter.propose_shared if drafter.shares_target_cache else drafter.propose)
  takes = "penalty_history" in inspect.signature(method).parameters
  return dict(penalty_history=history) if takes else {}


def sample_with_probs(key: Array, logits: Array, sampling: SamplingParams) -> tuple[Array, Array]:
  """(token [B], processed probs [B, V]); greedy gives the argmax and a one-hot distribution."""
  def greedy():
    token = argmax(logits)
    return token, jax.nn.one_hot(token, logits.shape[-1], dtype=jnp.float32)

  def sampled():
    logprobs = processed_logprobs(logits, sampling)
    token = jax.random.categorical(key, logprobs, axis=-1).astype(jnp.int32)
    return token, jnp.exp(logprobs)

  return switch(sampling.is_greedy, greedy, sampled, rows=True)


def sample_full_vocab(key: Array, logits: Array, sampling: SamplingParams, keep_ids: Array | None,
                      vocab_size: int) -> tuple[Array, Array]:
  """sample_with_probs over a head's logits [B, M]; with VocabTrim's `keep_ids` [M] the draw and
  q [B, V] are mapped back to the full vocabulary (q = 0 off the kept ids)."""
  token, probs = sample_with_probs(key, logits, sampling)
  if keep_ids is None:
    return token, probs
  return to_full_vocab(token, probs, keep_ids, vocab_size)


def keep_draw(i, tokens: Array, token: Array, probs: Array) -> tuple[Array, Array, Array]:
  """The identity `pick`: every draw stands, none against a stop."""
  return token, probs, jnp.zeros(token.shape, bool)


def draft_chain(key: Array, gamma: int, first_logits: Array, carry, step: Callable,
                sample: Callable, pick: Pick | None = None, stop: Callable | None = None,
                penalty: Callable | None = None):
  """The token-by-token draft loop every autoregressive drafter shares.

  first_logits [B, M]: the logits of draft 0; step(carry, token [B]) -> (logits [B, M], carry)
  feeds draft i - 1 and scores draft i; sample(key, logits) -> (token [B], q [B, V]) draws in the
  full vocabulary; `pick` may replace each draw before it is fed. `stop(logits) -> [B] bool`
  (adaptive draft length): a row whose draft i it marks, unless `pick` kept that draft, ends its
  chain before draft i (drafts i.. are -1), and the loop stops feeding once every row has ended.
  `penalty(logits, tokens, i)` (jspec.sampling.penalties.chain_draft_penalty): draft i's logits
  penalized for the text and the drafts before it, before it is drawn. Returns (tokens
  [B, gamma], q [B, gamma, V], carry).
  """
  penalty = penalty or (lambda logits, tokens, i: logits)
  pick = pick or keep_draw
  keys = jax.random.split(key, gamma)
  B = first_logits.shape[0]
  tokens = jnp.full((B, gamma), -1 if stop is not None else 0, jnp.int32)
  first_logits = penalty(first_logits, tokens, 0)
  token, probs, kept = pick(0, tokens, *sample(keys[0], first_logits))
  active = jnp.ones((B,), bool) if stop is None else kept | ~stop(first_logits)
  tokens = tokens.at[:, 0].set(jnp.where(active, token, -1))
  all_probs = jnp.zeros((B, gamma, probs.shape[-1]), jnp.float32).at[:, 0].set(probs)

  def body(i, loop):
    tokens, all_probs, carry, active = loop
    prev = jnp.maximum(jax.lax.dynamic_slice_in_dim(tokens, i - 1, 1, axis=1)[:, 0], 0)  # [B]
    logits, carry = step(carry, prev)
    logits = penalty(logits, tokens, i)
    token, probs, kept = pick(i, tokens, *sample(keys[i], logits))
    if stop is not None:
      active = active & (kept | ~stop(logits))
      token = jnp.where(active, token, -1)
    tokens = jax.lax.dynamic_update_slice_in_dim(tokens, token[:, None], i, axis=1)
    all_probs = jax.lax.dynamic_update_slice_in_dim(all_probs, probs[:, None], i, axis=1)
    return tokens, all_probs, carry, active

  if stop is None:
    tokens, all_probs, carry, _ = jax.lax.fori_loop(1, gamma, body,
                                                    (tokens, all_probs, carry, active))
    return tokens, all_probs, carry
  _, tokens, all_probs, carry, _ = jax.lax.while_loop(
      lambda loop: (loop[0] < gamma) & jnp.any(loop[-1]),
      lambda loop: (loop[0] + 1,) + body(loop[0], loop[1:]),
      (jnp.int32(1), tokens, all_probs, carry, active))
  return tokens, all_probs, carry


def check_stop(threshold) -> float:
  """A draft stop threshold in (0, 1]."""
  if not isinstance(threshold, (int, float)) or isinstance(threshold, bool) or not (
      0.0 < threshold <= 1.0):
    raise ValueError(f"the draft stop threshold is a probability in (0, 1], got {threshold!r}")
  return float(threshold)


def unsure(threshold: float) -> Callable:
  """stop(logits [B, M]) for draft_chain: the largest softmax probability is below threshold."""
  return lambda logits: jnp.max(jax.nn.softmax(logits.astype(jnp.float32), -1), -1) < threshold


def check_proposal(drafter: Drafter, method: str, tokens: Array | None, q: Array | None,
                   batch: int, width: int, vocab: int) -> None:
  """At trace time: what a drafter's `method` returned has the protocol's shapes and dtypes (a
  custom drafter's slip failed deep in the model or the verifier, or only once sampling ran):
  tokens [batch, width] integer, q or logits [batch, width, vocab] floating."""
  name = f"{type(drafter).__name__}.{method}"
  if tokens is not None and (tuple(tokens.shape) != (batch, width)
                             or not jnp.issubdtype(tokens.dtype, jnp.integer)):
    raise TypeError(f"{name} returned tokens of {tokens.dtype}{list(tokens.shape)}; the engine "
                    f"expects an integer [batch, gamma] = [{batch}, {width}]")
  if q is not None and (tuple(q.shape) != (batch, width, vocab)
                        or not jnp.issubdtype(q.dtype, jnp.floating)):
    what = "q" if tokens is not None else "logits"
    raise TypeError(f"{name} returned {what} of {q.dtype}{list(q.shape)}; the engine expects a "
                    f"float [batch, {'gamma' if tokens is not None else 'frontier'}, vocabulary] "
                    f"= [{batch}, {width}, {vocab}] (the full vocabulary)")


def valid_drafts(tokens: Array) -> tuple[Array, Array]:
  """(drafts [B, G] with -1 (a chain that ended early) replaced by 0, n_valid [B]: the drafts
  before each row's first -1)."""
  valid = jnp.cumprod((tokens >= 0).astype(jnp.int32), axis=1)
  return jnp.maximum(tokens, 0), jnp.sum(valid, axis=1).astype(jnp.int32)


def place_drafter(drafter: Drafter, placement: Placement | None, target,
                  placed_target) -> Drafter:
  """Host-side: a drafter's arrays on the target's mesh. Arrays it shares with the target (a
  layer-skip or probing drafter reads the target's own weights) take the target's placed copies;
  arrays already on the mesh stay as they are; the rest (a draft model's weights: small beside
  the target, and read every draft step) are replicated, so drafting needs no collective but the
  batch's own split over dp."""
  if placement is None:
    return drafter
  shared = {id(a): b for a, b in zip(jax.tree.leaves(target), jax.tree.leaves(placed_target))}
  whole = NamedSharding(placement.mesh, PartitionSpec())

  def put(x):
    if id(x) in shared:
      return shared[id(x)]
    if isinstance(x, jax.Array) and getattr(x.sharding, "mesh", None) == placement.mesh:
      return x
    return jax.device_put(x, whole)

  return jax.tree.map(put, drafter)
