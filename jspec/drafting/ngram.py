"""N-gram lookup drafting (prompt lookup): draft what followed the last time the context's final
n tokens occurred, on its own or in front of a model drafter.

The drafter keeps each row's token history (prompt, accepted tokens, its own last drafts) in a
static [B, L] buffer, rolled back implicitly like a KV cache: every round writes the two last known
tokens at seq_len - 2 and seq_len - 1, and nothing at or past seq_len is read. A lookup tries the
longest suffix first (n_max down to n_min) and takes the most recent earlier occurrence.

With a `store` (an n-gram datastore built from a corpus, jspec.io.datastore; the `rest` drafter)
a position the history has no match for takes the store's most frequent continuation of its
last n tokens (retrieval drafting, REST: He et al. 2023), before any fallback.

A looked-up draft is deterministic given its prefix, so its q is one-hot and verification stays
exact at any temperature: speculative sampling accepts it with probability p(x) and otherwise
samples the residual. With a `fallback` drafter (any drafter but another lookup) the lookup wins
wherever it finds a match and the fallback's own draw (and q) is used elsewhere; the fallback reads
every proposed token either way (the protocol's `pick`), so its cache stays in step with the
history. A chain round in which the lookup matches every draft of every row leaves the fallback
out (`skip_matched`, for fallbacks that `catches_up`): the drafts and q are what the full round
would have proposed, and after verification the fallback reads the round's tokens in one forward
instead of drafting them one at a time. Trees work the same way: each frontier node's context is
the history plus its path (the fallback always drafts there).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jspec.drafting.base import (DraftState, Drafter, Features, Pick, check_stop, keep_draw,
                                 penalty_kwargs)
from jspec.io.datastore import NgramTable, check_orders, context_hash
from jspec.sampling.processing import SamplingParams
from jspec.sharding import set_rows
from jspec.tree.structure import Tree, parent_of, set_node_columns, take

Array = jax.Array


def lookup(history: Array, length: Array, n_min: int, n_max: int) -> tuple[Array, Array]:
  """(token [B], found [B]): the token after the most recent earlier occurrence of the last n
  tokens of history[b, :length[b]], for the largest n in [n_min, n_max] that occurs."""
  B, L = history.shape
  starts = jnp.arange(L)  # [L] candidate match starts j
  # shifted[k][b, j] = history[b, j + k]; j + k < L wherever a match can hold.
  shifted = [jnp.roll(history, -k, axis=1) for k in range(n_max)]
  token = jnp.zeros((B,), jnp.int32)
  found = jnp.zeros((B,), bool)
  for n in range(n_min, n_max + 1):  # a longer match overrides a shorter one
    suffix = jnp.take_along_axis(
        history, jnp.clip(length[:, None] - n + jnp.arange(n), 0, L - 1), axis=1)  # [B, n]
    match = starts[None] + n < length[:, None]  # [B, L]: an earlier occurrence, not the suffix
    for k in range(n):
      match &= shifted[k] == suffix[:, k:k + 1]
    last = jnp.max(jnp.where(match, starts[None], -1), axis=1)  # [B]
    hit = last >= 0
    after = jnp.take_along_axis(history, jnp.clip(last + n, 0, L - 1)[:, None], axis=1)[:, 0]
    token = jnp.where(hit, after, token)
    found |= hit
  return token, found


def store_lookup(table: NgramTable, history: Array, length: Array) -> tuple[Array, Array]:
  """(token [B], found [B]): the datastore's next token after the last n tokens of
  history[b, :length[b]], for the largest n it holds a context of."""
  B, L = history.shape
  K = table.keys.shape[0]
  token = jnp.zeros((B,), jnp.int32)
  found = jnp.zeros((B,), bool)
  for n in range(table.n_min, table.n_max + 1):  # a longer context overrides a shorter one
    context = jnp.take_along_axis(
        history, jnp.clip(length[:, None] - n + jnp.arange(n), 0, L - 1), axis=1)  # [B, n]
    key = context_hash(jnp, context)  # [B] uint32
    at = jnp.clip(jnp.searchsorted(table.keys, key), 0, K - 1)  # binary search, [B]
    hit = (table.keys[at] == key) & (length >= n)
    token = jnp.where(hit, table.tokens[at], token)
    found |= hit
  return token, found


def write_at(history: Array, start: Array, tokens: Array) -> Array:
  """history [B, L] with tokens [B, W] written at start[b] + 0..W-1 (past the end dropped)."""
  W = tokens.shape[1]
  cols = start[:, None] + jnp.arange(W, dtype=jnp.int32)
  return set_rows(history, cols, tokens, mode="drop")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class NgramState(DraftState):
  history: Array  # [B, L] int32: prompt and known tokens (past them: last round's drafts)
  inner: DraftState | None = None  # the fallback drafter's state
  skipped: Array | None = None  # [] bool: the last chain round left the fallback out


def one_hot_logits(token: Array, vocab: int) -> Array:
  """Logits [..., V] of a point mass on token [...]: 0 there, -inf elsewhere (q stays one-hot
  under any temperature, top-k or top-p)."""
  return jnp.where(jax.nn.one_hot(token, vocab, dtype=bool), 0.0, -jnp.inf)


class _LookupFeeder:
  """A TreeFeeder: each frontier node's next token is looked up on the history followed by the
  node's root-to-node path; the fallback's feeder scores the nodes without a match (without a
  fallback such a node repeats its own token)."""

  def __init__(self, drafter: "NgramDrafter", history: Array, last: Array, seq_len: Array,
               inner):
    self.drafter, self.history, self.last, self.seq_len, self.inner = (drafter, history, last,
                                                                       seq_len, inner)

  def __call__(self, tree: Tree, frontier: Array) -> Array:
    B, W = frontier.shape
    L = self.history.shape[1]
    d = self.drafter
    # Write each frontier node's path (the node and its ancestors) after the known tokens.
    contexts = jnp.broadcast_to(self.history[:, None], (B, W, L))
    node = frontier
    for _ in range(tree.max_depth):
      at = jnp.where(node >= 0, self.seq_len[:, None] + take(tree.depth, node) - 1, L)  # [B, W]
      contexts = set_node_columns(contexts, at, take(tree.tokens, node))
      node = parent_of(tree, node)
    depth = jnp.where(frontier >= 0, take(tree.depth, frontier), 0)  # [B, W]
    guess, found = d.guess(contexts.reshape(B * W, L), (self.seq_len[:, None] + depth).reshape(-1))
    guess, found = guess.reshape(B, W), found.reshape(B, W)
    if self.inner is None:
      own = jnp.where(frontier >= 0, take(tree.tokens, frontier), self.last[:, None])
      return one_hot_logits(jnp.where(found, guess, own), d.vocab_size)
    logits = self.inner(tree, frontier)
    return jnp.where(found[..., None], one_hot_logits(guess, logits.shape[-1]), logits)

  def result(self, tree: Tree, reindexed: bool) -> NgramState:
    inner = None if self.inner is None else self.inner.result(tree, reindexed)
    return NgramState(history=self.history, inner=inner, skipped=jnp.zeros((), bool))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class NgramDrafter(Drafter):
  """Prompt-lookup drafter; `store` (an n-gram datastore, or None) answers where the history has
  no match (retrieval drafting, REST); `fallback` (any drafter but another lookup, or None)
  drafts where neither matches.

  Without a fallback an unmatched position repeats the previous token (a guess that costs
  nothing: verification of the block is paid either way).
  """

  vocab: int = dataclasses.field(metadata=dict(static=True))
  n_min: int = dataclasses.field(default=2, metadata=dict(static=True))
  n_max: int = dataclasses.field(default=4, metadata=dict(static=True))
  fallback: Drafter | None = None
  stop_on_miss: bool = dataclasses.field(default=False, metadata=dict(static=True))
  # Leave the fallback out of chain rounds the lookup matched in full (see the module docstring).
  skip_matched: bool = dataclasses.field(default=True, metadata=dict(static=True))
  store: NgramTable | None = None

  def __post_init__(self):
    if not (isinstance(self.n_min, int) and isinstance(self.n_max, int)
            and 1 <= self.n_min <= self.n_max <= 16):
      raise ValueError(f"n-gram lookup needs integers 1 <= n_min <= n_max <= 16, got "
                       f"n_min={self.n_min!r}, n_max={self.n_max!r}")
    if isinstance(self.fallback, NgramDrafter) or not (
        self.fallback is None or isinstance(self.fallback, Drafter)):
      raise ValueError(f"the n-gram lookup falls back to a drafter that is not itself a lookup "
                       f"(default, self, early-exit:K, model:DIR); got "
                       f"{type(self.fallback).__name__}")
    if not (self.store is None or isinstance(self.store, NgramTable)):
      raise ValueError(f"the n-gram lookup's store is a jspec.io.datastore.NgramTable (load one "
                       f"with load_table), got {type(self.store).__name__}")
    if self.store is not None:
      check_orders(self.store.n_min, self.store.n_max, "the n-gram store")
      if getattr(self.store.keys, "shape", (1,))[0] == 0:  # (placeholder leaves have no shape)
        raise ValueError("the n-gram store is empty (no context occurred min_count times in its "
                         "text). Fix: build it from more text or with a lower min_count, or "
                         "drop the store")
    if self.fallback is not None and self.fallback.window_size:
      raise ValueError("the n-gram lookup cannot front lookahead decoding (its window rides in "
                       "the target's verification forward, and its pool already holds n-grams): "
                       "Fix: lookahead alone (--drafter lookahead, lookahead_drafter).")

  @property
  def vocab_size(self) -> int:
    return self.vocab if self.fallback is None else self.fallback.vocab_size

  @property
  def target_cfg(self):
    return None if self.fallback is None else self.fallback.target_cfg

  def guess(self, history: Array, length: Array) -> tuple[Array, Array]:
    """(token [B], found [B]) after history[b, :length[b]]: the history's own n-gram match, else
    the store's."""
    token, found = lookup(history, length, self.n_min, self.n_max)
    if self.store is None:
      return token, found
    stored, hit = store_lookup(self.store, history, length)
    return jnp.where(found, token, stored), found | hit

  @property
  def stops_early(self) -> bool:
    return self.stop_on_miss or (self.fallback is not None and self.fallback.stops_early)

  def with_stop(self, threshold: float) -> NgramDrafter:
    """Alone: a chain ends at the lookup's first miss. With a fallback: the fallback's own rule
    where the lookup misses (a match always stands)."""
    check_stop(threshold)
    if self.fallback is None:
      return dataclasses.replace(self, stop_on_miss=True)
    return dataclasses.replace(self, fallback=self.fallback.with_stop(threshold))

  def with_draft_penalties(self, on: bool = True) -> NgramDrafter:
    """The fallback's proposals under the penalties (a lookup's are the text's repeats)."""
    if self.fallback is None:
      return super().with_draft_penalties(on)
    return dataclasses.replace(self, fallback=self.fallback.with_draft_penalties(on))

  @property
  def shares_target_cache(self) -> bool:
    return self.fallback is not None and self.fallback.shares_target_cache

  @property
  def draft_penalties(self) -> bool:
    """The fallback's setting: in a tree the lookup's one-token guesses stay what they are under
    any penalty, so the penalty at a frontier (`Drafter.draft_tree`) reaches the fallback's."""
    return self.fallback is not None and self.fallback.draft_penalties

  def propose_shared(self, state: NgramState, cache, last2: Array, seq_len: Array, key: Array,
                     sampling: SamplingParams, gamma: int, pick: Pick | None = None, *,
                     penalty_history=None):
    """`propose` over a fallback that drafts in the target's KV cache (layer skipping)."""
    history, mine = self._lookup_pick(state, last2, seq_len, pick)

    def drafted():
      tokens, probs, inner, shared = self.fallback.propose_shared(
          state.inner, cache, last2, seq_len, key, sampling, gamma, pick=mine,
          **penalty_kwargs(self.fallback, penalty_history))
      return tokens, probs, inner, shared, jnp.zeros((), bool)

    tokens, probs, inner, cache, skipped = self._unless_matched(
        history, seq_len, gamma, pick, drafted, lambda: (state.inner, cache))
    return (tokens, probs, NgramState(history=write_at(history, seq_len, tokens), inner=inner,
                                      skipped=skipped), cache)

  def _unless_matched(self, history: Array, seq_len: Array, gamma: int, pick: Pick | None,
                      drafted, untouched):
    """drafted() -> (tokens, q, *rest, skipped=False) runs the fallback; when the lookup
    matches all `gamma` drafts of every row the round is (lookup tokens, one-hot q,
    *untouched(), skipped=True) instead, without the fallback's work."""
    if not (self.skip_matched and self.fallback.catches_up and pick is None):
      return drafted()
    tokens, found = self._lookup_chain(history, seq_len, gamma)

    def matched():
      q = jax.nn.one_hot(tokens, self.vocab_size, dtype=jnp.float32)
      return (tokens, q) + tuple(untouched()) + (jnp.ones((), bool),)
    return jax.lax.cond(jnp.all(found), matched, drafted)

  def _lookup_chain(self, history: Array, seq_len: Array, gamma: int) -> tuple[Array, Array]:
    """(drafts [B, gamma] by lookup alone, found [B]: every draft of the row matched); stops
    looking at the first draft some row misses."""
    B = history.shape[0]

    def body(loop):
      i, tokens, history, found = loop
      guess, hit = self.guess(history, seq_len + i)
      tokens = jax.lax.dynamic_update_slice_in_dim(tokens, guess[:, None], i, axis=1)
      return i + 1, tokens, write_at(history, seq_len + i, guess[:, None]), found & hit

    _, tokens, _, found = jax.lax.while_loop(
        lambda loop: (loop[0] < gamma) & jnp.all(loop[3]), body,
        (jnp.int32(0), jnp.zeros((B, gamma), jnp.int32), history, jnp.ones((B,), bool)))
    return tokens, found

  @property
  def feature_layers(self) -> tuple[int, ...]:
    return () if self.fallback is None else self.fallback.feature_layers

  @property
  def probe_masks(self) -> int:
    """A probing fallback's masks (the engine appends them whatever the lookup finds)."""
    return 0 if self.fallback is None else self.fallback.probe_masks

  @property
  def drafts_from_masks(self) -> bool:
    return self.fallback is not None and self.fallback.drafts_from_masks

  @property
  def soft_tokens(self) -> int:
    return 0 if self.fallback is None else self.fallback.soft_tokens

  def probe_inputs(self, state: NgramState, block: Array) -> Array:
    return self.fallback.probe_inputs(state.inner, block)

  def prompt_probe_inputs(self, prompt: Array, prompt_lengths: Array) -> Array:
    return self.fallback.prompt_probe_inputs(prompt, prompt_lengths)

  def with_kv(self, policy, room: int) -> NgramDrafter:
    """The fallback's cache under `policy` (the lookup's token history stays whole: 4 bytes a
    token)."""
    if self.fallback is None:
      return self
    return dataclasses.replace(self, fallback=self.fallback.with_kv(policy, room))

  def init(self, prompt: Array, prompt_lengths: Array, cache_size: int,
           features: Features) -> NgramState:
    B, P = prompt.shape
    history = jnp.zeros((B, max(cache_size, P)), jnp.int32)
    history = jax.lax.dynamic_update_slice(history, prompt.astype(jnp.int32), (0, 0))
    inner = None if self.fallback is None else self.fallback.init(prompt, prompt_lengths,
                                                                  cache_size, features)
    return NgramState(history=history, inner=inner, skipped=jnp.zeros((), bool))

  def propose(self, state: NgramState, last2: Array, seq_len: Array, key: Array,
              sampling: SamplingParams, gamma: int, pick: Pick | None = None, *,
              penalty_history=None) -> tuple[Array, Array, NgramState]:
    """The lookup's drafts (not penalized: a lookup proposes what the text repeated), the
    fallback's where it misses (penalized, if the fallback can)."""
    V = self.vocab_size
    history = write_at(state.history, seq_len - 2, last2)

    if self.fallback is None:
      outer = pick or keep_draw

      def step(i, carry):  # draft i reads the history with drafts 0..i-1 written
        tokens, probs, history, active = carry
        at = seq_len + i
        guess, found = self.guess(history, at)
        previous = jnp.take_along_axis(history, (at - 1)[:, None], axis=1)[:, 0]
        token = jnp.where(found, guess, previous)
        token, q, _ = outer(i, tokens, token, jax.nn.one_hot(token, V, dtype=jnp.float32))
        if self.stop_on_miss:  # the chain ends at the first miss (-1 from there on)
          active = active & found
          token = jnp.where(active, token, -1)
        return (jax.lax.dynamic_update_slice_in_dim(tokens, token[:, None], i, axis=1),
                jax.lax.dynamic_update_slice_in_dim(probs, q[:, None], i, axis=1),
                write_at(history, at, token[:, None]), active)
      B = last2.shape[0]
      tokens, probs, history, _ = jax.lax.fori_loop(
          0, gamma, step, (jnp.zeros((B, gamma), jnp.int32),
                           jnp.zeros((B, gamma, V), jnp.float32), history,
                           jnp.ones((B,), bool)))
      return tokens, probs, NgramState(history=history, inner=None, skipped=state.skipped)

    history, mine = self._lookup_pick(state, last2, seq_len, pick)

    def drafted():
      tokens, probs, inner = self.fallback.propose(state.inner, last2, seq_len, key, sampling,
                                                   gamma, pick=mine,
                                                   **penalty_kwargs(self.fallback, penalty_history))
      return tokens, probs, inner, jnp.zeros((), bool)

    tokens, probs, inner, skipped = self._unless_matched(history, seq_len, gamma, pick, drafted,
                                                         lambda: (state.inner,))
    return tokens, probs, NgramState(history=write_at(history, seq_len, tokens), inner=inner,
                                     skipped=skipped)

  def _lookup_pick(self, state: NgramState, last2: Array, seq_len: Array, pick: Pick | None):
    """(the history with the last two known tokens written, the `pick` that puts the lookup's
    match in place of the fallback's draw wherever it finds one, and keeps it against the
    fallback's stop)."""
    V = self.vocab_size
    history = write_at(state.history, seq_len - 2, last2)

    def mine(i, tokens, token, probs):  # draft i, given drafts 0..i-1 in `tokens` [B, G]
      guess, found = self.guess(write_at(history, seq_len, tokens), seq_len + i)
      token, probs = (jnp.where(found, guess, token),
                      jnp.where(found[:, None], jax.nn.one_hot(guess, V, dtype=probs.dtype),
                                probs))
      token, probs, kept = (pick or keep_draw)(i, tokens, token, probs)
      return token, probs, kept | found
    return history, mine

  def update(self, state: NgramState, seq_len: Array, features: Features) -> NgramState:
    if self.fallback is None:
      return state
    inner = state.inner
    if self.skip_matched and self.fallback.catches_up:
      # A skipped round's tokens at round_start - 2 onward: its last two known ones and drafts.
      round_start = features.start + 1
      W = features.tokens.shape[1]  # gamma + 1
      cols = (round_start - 2)[:, None] + jnp.arange(W, dtype=jnp.int32)
      tokens = jnp.take_along_axis(state.history, jnp.clip(cols, 0, state.history.shape[1] - 1),
                                   axis=1)
      inner = jax.lax.cond(state.skipped,
                           lambda: self.fallback.catch_up(inner, tokens, round_start),
                           lambda: inner)
    return dataclasses.replace(state, inner=self.fallback.update(inner, seq_len, features),
                               skipped=jnp.zeros((), bool))

  def tree_feeder(self, state: NgramState, last2: Array, seq_len: Array) -> _LookupFeeder:
    inner = None if self.fallback is None else self.fallback.tree_feeder(state.inner, last2,
                                                                         seq_len)
    return _LookupFeeder(self, write_at(state.history, seq_len - 2, last2), last2[:, 1], seq_len,
                         inner)

  def accept_tree(self, drafted: NgramState, path: Array, n_accepted: Array, seq_len: Array,
                  features: Features) -> NgramState:
    """The accepted path and the target's token follow the known tokens in the history."""
    inner = None if self.fallback is None else self.fallback.accept_tree(
        drafted.inner, path, n_accepted, seq_len, features)
    return NgramState(history=write_at(drafted.history, seq_len, features.tokens), inner=inner,
                      skipped=jnp.zeros((), bool))


def ngram_drafter(vocab_size: int, n_min: int | None = None, n_max: int = 4,
                  fallback: Drafter | None = None, store: NgramTable | None = None
                  ) -> NgramDrafter:
  """n_min defaults to 1 alone (any guess beats none: the block is verified anyway) and to 2 in
  front of another drafter or a store (a one-token match is right less often than a model;
  measured by benchmarks/probe_ngram_hybrid.py; the store's own one-token contexts rank the
  candidates by frequency instead of recency: benchmarks/README.md, "Retrieval drafting")."""
  if n_min is None:
    n_min = 1 if fallback is None and store is None else 2
  return NgramDrafter(vocab=int(vocab_size), n_min=n_min, n_max=n_max, fallback=fallback,
                      store=store)
