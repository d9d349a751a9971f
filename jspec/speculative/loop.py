"""What the chain and tree engines share: the loop state, the first step (prefill target and
drafter), and the bookkeeping after a verification round (emit, cut at stops and the budget,
counters, the target cache's rollback by lengths).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from jspec.decode import (PAD, cache_full, check_cache_width, check_padded_prompts, is_stop,
                          prefill, trimmed_rows)
from jspec.drafting import debug
from jspec.drafting.base import Drafter, DraftState, Features
from jspec.kv.policy import KVPolicy
from jspec.kv.prefill import chunked_prefill
from jspec.models import quant
from jspec.models.attention import attention_slots
from jspec.models.cache import KVCache
from jspec.models.config import Config
from jspec.models.llama import Params, forward
from jspec.sampling.first_token import first_token
from jspec.sampling.logprobs import token_logprobs
from jspec.sampling.penalties import History
from jspec.sampling.processing import SamplingParams
from jspec.sharding import Placement, set_rows
from jspec.speculative.probing import prefill_layout, verification_width
from jspec.streaming import Segmented

Array = jax.Array


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
  # With spec.logprobs: each generated token's log-probability under the target (model or
  # sampled, jspec.sampling.logprobs), 0 after each row's length.
  logprobs: Array | None = None  # [B, N] float32

  @property
  def target_calls(self) -> Array:
    """Target forwards: the prefill and one verification per round."""
    return self.rounds + 1

  @property
  def block_efficiency(self) -> float:
    """τ: tokens emitted per target verification call (γ + 1 at most); NaN when no round ran
    (max_new_tokens 1, or every row's first token a stop id): τ is at least 1 when defined."""
    rounds = int(self.row_rounds)
    return float(self.round_tokens) / rounds if rounds else math.nan

  @property
  def acceptance_rate(self) -> np.ndarray:
    """Per draft position i, the fraction of rounds (of active rows) whose accepted prefix covers
    position i: P(more than i drafts accepted). A position a round did not draft or verify (past
    an adaptive drafter's stop or a KV budget's eviction cut) counts as not accepted. NaN when
    no round ran."""
    rounds = int(self.row_rounds)
    accepted = np.asarray(self.accepted_at)
    return accepted / rounds if rounds else np.full(accepted.shape, np.nan)

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
  draft: DraftState
  rounds: Array
  round_tokens: Array
  row_rounds: Array
  accept_hist: Array
  accepted_at: Array
  # Under a KV budget: target entries evicted per row, so the target cache holds
  # seq_len - 1 - evicted entries and RoPE positions still count from the prompt's start.
  evicted: Array | None = None
  logprobs: Array | None = None  # [B, N + G + 1] float32 beside tokens, when reporting them
  history: History | None = None  # the text's tokens, when penalties may be on


def initial_state(params: Params, cfg: Config, drafter: Drafter, prompt: Array,
                  prompt_lengths: Array, key: Array, sampling: SamplingParams, spec,
                  cache_size: int, *, max_accepted: int, reserve: int,
                  kv: KVPolicy | None = None, target_slots: int | None = None,
                  placement: Placement | None = None) -> SpecState:
  """Prefill target and drafter, sample the first token: the loop state before round one.

  `max_accepted`: most draft tokens one round can accept (gamma for a chain, the tree depth);
  `reserve`: cache slots a round writes past the committed entries (`chain_reserve`,
  `tree_reserve`): without a budget, a row with less room left is done (`cache_full`).
  kv: a KV budget for the target (chunked prefill into `target_slots`, default kv.slots, slots);
  the drafter sizes its own cache (`cache_size` slots, or its own budget: `Drafter.with_kv`).
  placement: the target cache pinned to a mesh (jspec.sharding); the drafter's follows its inputs.
  """
  check_padded_prompts(prompt, prompt_lengths, spec.max_new_tokens)
  B, P = prompt.shape
  N = spec.max_new_tokens
  evicted = None
  probed = None
  if kv is None:  # a probing prefill writes its masks (and soft tokens) after the padded prompts
    extra = drafter.probe_masks + drafter.soft_tokens if drafter.probe_masks else 0
    check_cache_width(P + extra, cache_size)
  if kv is None and drafter.probe_masks:
    # k masks after each prompt's last token: the first round's drafts (jspec.drafting.probe).
    k = drafter.probe_masks
    cache = KVCache.init(cfg, B, cache_size, params.embed.dtype).placed(placement)
    mask, positions = prefill_layout(prompt_lengths, P, k, drafter.soft_tokens)
    logits, hidden, cache = forward(params, cfg, prompt, positions, cache, mask,
                                    logits_indices=(prompt_lengths - 1)[:, None],
                                    appended=drafter.prompt_probe_inputs(prompt, prompt_lengths),
                                    taps=drafter.feature_layers)
    logits, hidden, probed = logits[:, 0], hidden[:, :P], hidden[:, P:P + k]
    cache = cache.with_lengths(prompt_lengths)
  elif kv is None:
    cache = KVCache.init(cfg, B, cache_size, params.embed.dtype).placed(placement)
    logits, hidden, cache = prefill(params, cfg, prompt, prompt_lengths, cache,
                                    taps=drafter.feature_layers)
  else:
    slots = attention_slots(cfg, target_slots or kv.slots)
    cache = KVCache.init(cfg, B, slots, params.embed.dtype).placed(placement)
    logits, cache, evicted, hidden = chunked_prefill(params, cfg, prompt, prompt_lengths, cache,
                                                     kv, keep_hidden=True,
                                                     taps=drafter.feature_layers,
                                                     placement=placement)
    if drafter.probe_masks:
      probed = probe_budgeted_prompt(params, cfg, drafter, prompt, prompt_lengths, cache, evicted)
  key, first, history, first_lp = first_token(key, logits, prompt, prompt_lengths,
                                               cfg.vocab_size, sampling, spec.logprobs)
  # The token after each prompt position: the prompt shifted by one, then the first sample.
  following = jnp.concatenate([prompt[:, 1:], jnp.zeros((B, 1), prompt.dtype)], axis=1)
  following = set_rows(following, prompt_lengths[:, None] - 1, first[:, None])  # [B, P]
  draft_state = drafter.init(prompt, prompt_lengths, cache_size, Features(
      hidden=hidden, tokens=following, start=jnp.zeros((B,), jnp.int32), probe_hidden=probed))
  prev = jnp.take_along_axis(prompt, (prompt_lengths - 1)[:, None], axis=1)[:, 0]
  zeros = lambda n: jnp.zeros((n,), jnp.int32)
  token_lps = None
  if spec.logprobs:
    token_lps = jnp.zeros((B, N + max_accepted + 1), jnp.float32).at[:, 0].set(first_lp)
  done = is_stop(first, spec.stop_ids) | (N <= 1)
  if kv is None:
    done = done | cache_full(prompt_lengths, reserve, cache_size)
  return SpecState(
      done=done,
      tokens=jnp.full((B, N + max_accepted + 1), PAD, jnp.int32).at[:, 0].set(first),
      lengths=jnp.ones((B,), jnp.int32), seq_len=prompt_lengths + 1,
      last2=jnp.stack([prev, first], axis=1), key=key, cache=cache, draft=draft_state,
      rounds=jnp.int32(0), round_tokens=jnp.int32(0), row_rounds=jnp.int32(0),
      accept_hist=zeros(max_accepted + 1), accepted_at=zeros(max_accepted), evicted=evicted,
      logprobs=token_lps, history=history)


def going(s: SpecState, until: Array | None) -> Array:
  """The speculative loops' condition: a row still generating (and, streaming, rounds to go)."""
  rows = ~jnp.all(s.done)
  return rows if until is None else rows & (s.rounds < until)


def run_or_segment(programs: tuple, placed: Params, cfg: Config, drafter: Drafter, b, static: dict,
                   finish, stream: bool):
  """The validated wrappers' last step: the whole program (programs[0]) on the batch `b`, or, to
  stream, the run split at its loop (jspec.streaming: start programs[1], segments programs[2])
  and the arrays its donated state must not share."""
  whole, start, segment = programs
  checked = debug.run_checked  # JSPEC_CHECK_DRAFTS=1: a drafter's bad q as DraftLawError
  if not stream:
    return checked(lambda: whole(placed, cfg, drafter, b.tokens, b.lengths, b.key, b.sampling,
                                 **static))
  return Segmented(
      start=lambda: checked(lambda: start(placed, cfg, drafter, b.tokens, b.lengths, b.key,
                                          b.sampling, **static)),
      resume=lambda state, every: checked(lambda: segment(placed, cfg, drafter, state, every,
                                                          b.sampling, **static)),
      finish=finish, max_new_tokens=static["spec"].max_new_tokens), (placed, drafter)


def chain_reserve(drafter: Drafter, gamma: int) -> int:
  """Cache slots a chain round writes past the committed entries: the draft block of gamma + 1
  tokens and what rides along with it (probe masks, soft tokens, a lookahead window)."""
  return verification_width(drafter, gamma + 1)


def budgeted_slots(kv: KVPolicy | None, drafter: Drafter, block: int) -> int | None:
  """Target cache slots under a budget (None without one): a full cache (budget + evict_every - 1
  entries) plus a verification block of `block` tokens and what the drafter runs beside it (k
  masks a token, soft tokens), so none of their KV falls off the end."""
  if kv is None:
    return None
  return max(kv.slots, kv.full_row + verification_width(drafter, block))


def eviction_cut(kv: KVPolicy, lengths: Array) -> Array:
  """[B] drafts a round may use under a budget: block token j is scored over the same cache as
  autoregressive decoding only while no eviction would have come between (j <= cut). >= 0 while
  each eviction drops what it is due (the clamp keeps a round sound if not)."""
  return jnp.maximum(kv.full_row - lengths, 0)


def probe_budgeted_prompt(params: Params, cfg: Config, drafter: Drafter, prompt: Array,
                          prompt_lengths: Array, cache: KVCache, evicted: Array) -> Array:
  """[B, k, E]: the hidden states of k masks after each prompt's last token (then the drafter's
  soft tokens), run over the prompt's budgeted cache (its entries committed, `evicted` [B]
  dropped) in a forward of their own: chunked prefill ends ragged rows in different chunks, so
  the masks cannot ride along as they do in `prefill_layout`'s single forward. Their KV entries
  go past the committed ones, which no round counts; RoPE positions count the evicted ones too.
  Only what the first round drafts depends on it, never what it emits."""
  B = prompt.shape[0]
  k = drafter.probe_masks
  appended = drafter.prompt_probe_inputs(prompt, prompt_lengths)  # [B, k + S, E]
  mask, positions = prefill_layout(cache.lengths + evicted, 0, k, drafter.soft_tokens)
  _, hidden, _ = forward(params, cfg, prompt[:, :0], positions, cache, mask,
                         logits_indices=jnp.zeros((B, 1), jnp.int32), appended=appended,
                         taps=drafter.feature_layers)
  return hidden[:, :k]


def advance(s: SpecState, emitted: Array, n_acc: Array, spec, *, key: Array,
            cache: KVCache, reserve: int, logits: Array | None = None,
            sampling: SamplingParams | None = None,
            processed: Array | None = None) -> SpecState:
  """The loop state after a verification round that emitted `emitted` [B, G + 1] (valid up to
  index n_acc [B]): cut at a stop id or the token budget, written to the output buffer, the last
  two tokens and counters updated; `cache` gets lengths seq_len - 1 (less what was evicted). The
  drafter state is left as it was: the caller updates it from the new seq_len. Without a budget
  a row is done once the next round's `reserve` slots would not fit its cache. With
  spec.logprobs, `logits` [B, G + 1, V] are the target's at each emitted token (emitted[:, j]
  drawn from logits[:, j]; the model's own, before any penalty) and `sampling` what it drew with
  (processed: `processed_for` of the penalized logits, which "sampled" logprobs need)."""
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
  tokens = set_rows(s.tokens, cols, emitted, mode="drop")
  token_lps = s.logprobs
  if spec.logprobs:
    token_lps = set_rows(token_lps, cols, token_logprobs(logits, emitted, spec.logprobs, sampling,
                                                         processed), mode="drop")
  lengths = s.lengths + count
  history = None if s.history is None else s.history.add(emitted, idx[None] < count[:, None])
  done = s.done | (first_stop < count) | (lengths >= N)
  seq_len = s.seq_len + count
  if s.evicted is None:  # the next round writes from slot seq_len - 1 on
    done = done | cache_full(seq_len - 1, reserve, cache.size)
  # The last two known tokens: from [previous last, emitted...] at offsets count - 1, count.
  ext = jnp.concatenate([s.last2[:, 1:], emitted], axis=1)  # [B, W + 1]
  last2 = jnp.stack([jnp.take_along_axis(ext, jnp.maximum(count - 1, 0)[:, None], 1)[:, 0],
                     jnp.take_along_axis(ext, count[:, None], 1)[:, 0]], axis=1)
  last2 = jnp.where(count[:, None] > 0, last2, s.last2)
  act = active.astype(jnp.int32)
  return SpecState(
      done=done, tokens=tokens, lengths=lengths, seq_len=seq_len, last2=last2, key=key,
      cache=cache.with_lengths(seq_len - 1 - (0 if s.evicted is None else s.evicted)),
      draft=s.draft, evicted=s.evicted, logprobs=token_lps, history=history,
      rounds=s.rounds + 1, round_tokens=s.round_tokens + jnp.sum(count),
      row_rounds=s.row_rounds + jnp.sum(act),
      accept_hist=s.accept_hist + jnp.sum(jax.nn.one_hot(n_acc, W, dtype=jnp.int32)
                                          * act[:, None], axis=0),
      accepted_at=s.accepted_at + jnp.sum((idx[None, :W - 1] < n_acc[:, None]) * act[:, None], 0))


def _int8_on_xla(params) -> bool:
  """int8 weights whose attention is XLA's (`int8-xla`), not jspec's fixed-order CPU kernel."""
  return quant.is_quantized(params) and quant.attention_kernel(params) != "native"


def check_tree_target(params) -> None:
  """Host-side: a target whose tree verification scores tokens exactly as one-token steps do.

  int8 weights on XLA's kernel ("int8-xla") do not: a tree's verification reads each node's
  ancestors at the tree's cache slots, not at consecutive ones, and XLA's per-token attention sums
  over all slots by halving (zeros at the invisible ones), so the ancestors' terms group
  differently than in a one-token step; re-quantizing activations to int8 turns such last-bit
  differences into different greedy tokens. jspec's CPU kernels ("int8", "q4") sum over the
  visible slots alone, in slot order, which is the same order for a tree node and for the chain of
  its ancestors (`tests/test_quant.py`), so their trees are token-identical.
  """
  if _int8_on_xla(params):
    raise ValueError(
        "tree speculative decoding with an int8 target on XLA's kernel (int8-xla) is not "
        "token-identical to autoregressive decoding (its attention sums over a tree's slots in "
        "another order), so jspec refuses it. Fix: on CPU load the target with --weights int8 "
        "(load(..., dtype='int8'): jspec's CPU kernels, whose trees are token-identical), "
        "draft chains (--gamma N without --tree), or load it as float32 or bfloat16.")


def check_extra_positions_target(params, drafter: Drafter) -> None:
  """Host-side: a drafter that runs positions beside the verification block (probe masks, ConFu's
  soft tokens, a lookahead window) needs a target whose block tokens keep their bits with those
  rows present. jspec's CPU kernels do (int8 scales make every dequantized product exact,
  `quant.exact_product_scale`; attention sums only visible slots); int8 on XLA's kernel does not
  (a one-layer difference at 5e-7 measured), so it is refused, not left to drift."""
  extra = drafter.probe_masks or drafter.soft_tokens or drafter.window_size
  if extra and _int8_on_xla(params):
    raise ValueError(
        f"{type(drafter).__name__} runs extra positions beside the verification block, with "
        "which an int8 target on XLA's kernel (int8-xla) scores the block's tokens with other "
        "bits than one-token steps: not token-identical to autoregressive decoding, so jspec "
        "refuses it. Fix: on CPU load the target with --weights int8 "
        "(load(..., dtype='int8'): jspec's CPU kernels), or as float32 or bfloat16.")


def _shape(cfg: Config) -> tuple[int, ...]:
  return (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.num_heads,
          cfg.num_kv_heads, cfg.head_dim)


def _describe(cfg: Config) -> str:
  return (f"{cfg.arch}, {cfg.num_layers} layers of hidden {cfg.hidden_size}, {cfg.num_heads} "
          f"heads, {cfg.num_kv_heads} KV heads")


def check_drafter(cfg: Config, drafter: Drafter) -> None:
  """Host-side: a drafter implementing the protocol, in the target's vocabulary."""
  if not isinstance(drafter, Drafter):
    raise ValueError(f"the drafter must implement jspec.drafting.base.Drafter (init, propose, "
                     f"update, tree_feeder, accept_tree), got {type(drafter).__name__}")
  if drafter.vocab_size != cfg.vocab_size:
    raise ValueError(
        f"draft vocabulary ({drafter.vocab_size} tokens) differs from the target's "
        f"({cfg.vocab_size}): speculative decoding needs a drafter with the target's tokenizer")
  drafter.check_weights(cfg)
  built_for = drafter.target_cfg
  if built_for is not None and _shape(built_for) != _shape(cfg):
    raise ValueError(f"the drafter runs the target's own weights but was built for another "
                     f"target ({_describe(built_for)}; this one: {_describe(cfg)}). Fix: build it "
                     f"for this model: load_drafter(name, model)")
  taps = drafter.feature_layers
  if taps and not all(0 <= i < cfg.num_layers for i in taps):
    raise ValueError(f"the drafter reads the target's layers {taps}, but the target has "
                     f"{cfg.num_layers}: it was made for another target model")
  if drafter.window_size and (taps or drafter.probe_masks):
    raise ValueError("a drafter with a lookahead window cannot also read tapped layers or probe "
                     "with mask positions: the verification forward runs one kind of extra "
                     "positions")


def check_shared_cache(drafter: Drafter, tree: bool) -> None:
  """Host-side: a drafter that drafts in the target's KV cache (layer skipping) drafts chains."""
  if drafter.shares_target_cache and tree:
    raise ValueError("layer-skip drafts (--drafter skip:N) draft chains only. Fix: drop --tree / "
                     "tree=.")

