"""Speculative generation as one XLA program.

Prefill target and drafter, then one `lax.while_loop` whose body drafts G tokens, verifies them
with ONE target forward over G + 1 positions, accepts a prefix plus one target token, writes the
accepted tokens, and rolls back rejected KV entries of both caches by setting lengths (no copies).
Rows accept different numbers of tokens; everything is expressed with per-row lengths.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jspec.generate import PAD, is_stop, prefill, prepare_batch, trimmed_rows
from jspec.models.cache import KVCache
from jspec.models.config import Config
from jspec.models.llama import Params, forward
from jspec.sampling.processing import GREEDY, SamplingParams, sample
from jspec.sampling.verify import verify
from jspec.spec.drafters import Drafter

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class SpecConfig:
  """Static settings of a speculative run."""

  gamma: int  # draft tokens per round
  max_new_tokens: int
  stop_ids: tuple[int, ...] = ()

  def __post_init__(self):
    if int(self.gamma) != self.gamma or self.gamma < 1:
      raise ValueError(f"gamma (draft tokens per round) must be an integer >= 1, got {self.gamma}")
    if int(self.max_new_tokens) != self.max_new_tokens or self.max_new_tokens < 1:
      raise ValueError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens}")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SpecOutput:
  tokens: Array  # [B, N] int32, PAD after each row's length
  lengths: Array  # [B] int32
  rounds: Array  # [] int32
  round_tokens: Array  # [] int32: tokens emitted by verification rounds, summed over rows
  row_rounds: Array  # [] int32: (row, round) pairs in which the row was still generating
  accept_hist: Array  # [G + 1] int32: rounds (per row) that accepted k draft tokens
  accepted_at: Array  # [G] int32: how often draft position i was accepted

  @property
  def target_calls(self) -> Array:
    """Target forwards: the prefill and one verification per round."""
    return self.rounds + 1

  @property
  def draft_calls(self) -> Array:
    """Drafter forwards: the prefill and gamma per round."""
    return 1 + self.accepted_at.shape[0] * self.rounds

  @property
  def block_efficiency(self) -> float:
    """τ: tokens emitted per target verification call (γ + 1 at most)."""
    return float(self.round_tokens) / max(int(self.row_rounds), 1)

  @property
  def acceptance_rate(self) -> np.ndarray:
    """Per draft position, the fraction of verified drafts accepted (every active row verifies
    every position each round)."""
    return np.asarray(self.accepted_at) / max(int(self.row_rounds), 1)

  def sequences(self) -> list[list[int]]:
    """Generated ids per row, trimmed to each row's length (host-side)."""
    return trimmed_rows(self.tokens, self.lengths)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SpecState:
  done: Array  # [B] bool
  tokens: Array  # [B, N + G + 1] output buffer
  lengths: Array  # [B] generated so far
  seq_len: Array  # [B] prompt + generated
  last2: Array  # [B, 2] the last two known tokens
  key: Array
  cache: KVCache  # target cache: holds every known token but the last
  draft: object  # drafter state
  rounds: Array
  round_tokens: Array
  row_rounds: Array
  accept_hist: Array
  accepted_at: Array


def reads_features(drafter) -> bool:
  """Does the drafter read the target's hidden states (jspec.spec.eagle)?"""
  return bool(getattr(drafter, "reads_features", False))


def initial_state(params: Params, cfg: Config, drafter, prompt: Array, prompt_lengths: Array,
                  key: Array, sampling: SamplingParams, spec, cache_size: int, *,
                  max_accepted: int) -> SpecState:
  """Prefill target and drafter, sample the first token: the loop state before round one.

  `max_accepted`: most draft tokens one round can accept (gamma for a chain, the tree depth).
  Shared by the chain and tree engines.
  """
  B = prompt.shape[0]
  N = spec.max_new_tokens
  cache = KVCache.init(cfg, B, cache_size, params.embed.dtype)
  logits, hidden, cache = prefill(params, cfg, prompt, prompt_lengths, cache)
  key, sub = jax.random.split(key)
  first = sample(sub, logits, sampling)  # [B]
  if reads_features(drafter):
    draft_state = drafter.init_features(prompt, prompt_lengths, cache_size, hidden, first)
  else:
    draft_state = drafter.init(prompt, prompt_lengths, cache_size)
  prev = jnp.take_along_axis(prompt, (prompt_lengths - 1)[:, None], axis=1)[:, 0]
  zeros = lambda n: jnp.zeros((n,), jnp.int32)
  return SpecState(
      done=is_stop(first, spec.stop_ids) | (N <= 1),
      tokens=jnp.full((B, N + max_accepted + 1), PAD, jnp.int32).at[:, 0].set(first),
      lengths=jnp.ones((B,), jnp.int32), seq_len=prompt_lengths + 1,
      last2=jnp.stack([prev, first], axis=1), key=key, cache=cache, draft=draft_state,
      rounds=jnp.int32(0), round_tokens=jnp.int32(0), row_rounds=jnp.int32(0),
      accept_hist=zeros(max_accepted + 1), accepted_at=zeros(max_accepted))


def speculative_generate_tokens(params: Params, cfg: Config, drafter: Drafter, prompt: Array,
                                prompt_lengths: Array, key: Array,
                                sampling: SamplingParams = GREEDY, *, spec: SpecConfig,
                                cache_size: int) -> SpecOutput:
  """Pure, jit-friendly speculative generation; `cfg`, `spec` and `cache_size` are static."""
  G, N = spec.gamma, spec.max_new_tokens
  state = initial_state(params, cfg, drafter, prompt, prompt_lengths, key, sampling, spec,
                        cache_size, max_accepted=G)

  def cond(s: SpecState):
    return ~jnp.all(s.done)

  def body(s: SpecState) -> SpecState:
    key, k_draft, k_verify = jax.random.split(s.key, 3)
    drafts, q, draft = drafter.propose(s.draft, s.last2, s.seq_len, k_draft, sampling, G)
    # Verify [last token, d_1 .. d_G] in one forward; the cache holds everything before it.
    block = jnp.concatenate([s.last2[:, 1:], drafts], axis=1)  # [B, G + 1]
    start = s.seq_len - 1
    positions = start[:, None] + jnp.arange(G + 1, dtype=jnp.int32)
    target_logits, hidden, cache = forward(params, cfg, block, positions,
                                           s.cache.with_lengths(start))
    n_acc, nxt = verify(k_verify, drafts, q, target_logits, sampling)  # [B], [B]

    # Emitted this round: d_1 .. d_n, then the target's token.
    idx = jnp.arange(G + 1)
    emitted = jnp.where(idx[None] < n_acc[:, None], jnp.pad(drafts, ((0, 0), (0, 1))),
                        nxt[:, None])  # [B, G + 1], valid up to index n_acc
    if reads_features(drafter):  # the verified block's hidden states feed the drafter
      new_draft = lambda seq_len: drafter.absorb(draft, start, seq_len, hidden, emitted)
    else:
      new_draft = lambda seq_len: drafter.update(draft, seq_len)
    return advance(s, emitted, n_acc, spec, key=key, cache=cache, draft=new_draft)

  s = jax.lax.while_loop(cond, body, state)
  return SpecOutput(
      tokens=s.tokens[:, :N], lengths=s.lengths, rounds=s.rounds, round_tokens=s.round_tokens,
      row_rounds=s.row_rounds, accept_hist=s.accept_hist, accepted_at=s.accepted_at)


def advance(s: SpecState, emitted: Array, n_acc: Array, spec, *, key: Array, cache: KVCache,
            draft) -> SpecState:
  """The loop state after a verification round that emitted `emitted` [B, G + 1] (valid up to
  index n_acc [B]): cut at a stop id or the token budget, written to the output buffer, the last
  two tokens and counters updated; `cache` gets lengths seq_len - 1, `draft(seq_len)` is the new
  drafter state. Shared by the chain and tree engines."""
  B, W = emitted.shape  # W = G + 1 (chain) or D + 1 (tree)
  N = spec.max_new_tokens
  active = ~s.done
  idx = jnp.arange(W)
  valid = idx[None] <= n_acc[:, None]
  stops = is_stop(emitted, spec.stop_ids) & valid
  first_stop = jnp.where(stops.any(axis=1), jnp.argmax(stops, axis=1), W)
  count = jnp.minimum(jnp.minimum(n_acc + 1, first_stop + 1), N - s.lengths)
  count = jnp.where(active, count, 0)
  cols = jnp.where(idx[None] < count[:, None], s.lengths[:, None] + idx[None], s.tokens.shape[1])
  tokens = s.tokens.at[jnp.arange(B)[:, None], cols].set(emitted, mode="drop")
  lengths = s.lengths + count
  done = s.done | (first_stop < count) | (lengths >= N)
  # The last two known tokens: from [previous last, emitted...] at offsets count - 1, count.
  ext = jnp.concatenate([s.last2[:, 1:], emitted], axis=1)  # [B, W + 1]
  last2 = jnp.stack([jnp.take_along_axis(ext, jnp.maximum(count - 1, 0)[:, None], 1)[:, 0],
                     jnp.take_along_axis(ext, count[:, None], 1)[:, 0]], axis=1)
  last2 = jnp.where(count[:, None] > 0, last2, s.last2)
  seq_len = s.seq_len + count
  act = active.astype(jnp.int32)
  return SpecState(
      done=done, tokens=tokens, lengths=lengths, seq_len=seq_len, last2=last2, key=key,
      cache=cache.with_lengths(seq_len - 1), draft=draft(seq_len),
      rounds=s.rounds + 1, round_tokens=s.round_tokens + jnp.sum(count),
      row_rounds=s.row_rounds + jnp.sum(act),
      accept_hist=s.accept_hist + jnp.sum(jax.nn.one_hot(n_acc, W, dtype=jnp.int32)
                                          * act[:, None], axis=0),
      accepted_at=s.accepted_at + jnp.sum((idx[None, :W - 1] < n_acc[:, None]) * act[:, None], 0))


_spec_jit = jax.jit(speculative_generate_tokens, static_argnums=(1,),
                    static_argnames=("spec", "cache_size"))


def check_vocab(cfg: Config, drafter: Drafter) -> None:
  if drafter.vocab_size != cfg.vocab_size:
    raise ValueError(
        f"draft vocabulary ({drafter.vocab_size} tokens) differs from the target's "
        f"({cfg.vocab_size}): speculative decoding needs a drafter with the target's tokenizer")


def speculative_generate(params: Params, cfg: Config, drafter: Drafter,
                         prompts: Sequence[Sequence[int]], *, spec: SpecConfig,
                         sampling: SamplingParams = GREEDY, key: Array | int = 0,
                         cache_size: int | None = None) -> SpecOutput:
  """Validated, bucketed, jitted speculative generation from token-id prompts.

  Example:
    drafter = ModelDrafter(draft_params, draft_cfg)
    out = speculative_generate(params, cfg, drafter, [[1, 2, 3]], spec=SpecConfig(gamma=4,
                               max_new_tokens=64), sampling=SamplingParams(temperature=1.0))
    out.sequences(), out.block_efficiency
  """
  check_vocab(cfg, drafter)
  # Verification writes up to gamma + 1 entries past the last kept one.
  b = prepare_batch(cfg, prompts, max_new_tokens=spec.max_new_tokens, sampling=sampling, key=key,
                    stop_ids=spec.stop_ids, cache_size=cache_size, reserve=spec.gamma + 1,
                    reserve_for="gamma + 1 (the draft block)")
  return _spec_jit(params, cfg, drafter, b.tokens, b.lengths, b.key, b.sampling, spec=spec,
                   cache_size=b.cache_size)
