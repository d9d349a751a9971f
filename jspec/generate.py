"""Autoregressive generation as one XLA program: jitted prefill, then a `lax.while_loop` decode.

`generate_tokens` is pure and jit-compatible (users may wrap it in their own `jax.jit`);
`generate` validates host-side inputs, pads prompts to a length bucket (jspec.decode) and calls a
cached jitted `generate_tokens`, so every prompt of a bucket reuses one compiled program.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp

from jspec.decode import (PAD, cache_full, check_cache_width, check_padded_prompts, is_stop,
                          on_mesh, prefill, prepare_batch, trimmed_rows)
from jspec.kv.policy import KVPolicy, check_kv
from jspec.kv.prefill import budgeted_step, chunked_prefill
from jspec.models.attention import attention_slots
from jspec.models.cache import KVCache
from jspec.models.config import Config, is_int
from jspec.models.llama import Params, forward
from jspec.models.numerics import engine_jit
from jspec.sampling.first_token import first_token
from jspec.sampling.logprobs import check_logprobs, processed_for, token_logprobs
from jspec.sampling.penalties import History, penalize
from jspec.sampling.processing import GREEDY, SamplingParams, sample
from jspec.sharding import Mesh, Placement, traced_under_placement
from jspec.streaming import Segmented, TokenStream, stream_program, view

Array = jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class GenerateOutput:
  tokens: Array  # [B, N] int32, PAD after each row's length
  lengths: Array  # [B] int32, generated tokens per row (stop token included)
  target_calls: Array  # [] int32, forwards of the model (prefill counts one)
  steps: Array  # [] int32, decode-loop iterations
  # With record_top_k=K: the model's K most likely tokens and their log-probabilities (temperature
  # 1, before any filter) at every generated position: distillation targets for drafters. Past
  # each row's length, PAD ids with log-probability -inf (as the tokens: PAD).
  top_ids: Array | None = None  # [B, N, K] int32
  top_logprobs: Array | None = None  # [B, N, K] float32
  # With logprobs="model" or "sampled": each generated token's log-probability (jspec.sampling.
  # logprobs), 0 after each row's length, so a row's sum is its continuation's log-probability.
  logprobs: Array | None = None  # [B, N] float32

  def sequences(self) -> list[list[int]]:
    """Generated ids per row, trimmed to each row's length (host-side)."""
    return trimmed_rows(self.tokens, self.lengths)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DecodeState:
  step: Array  # [] int32, tokens generated so far (lockstep over rows)
  done: Array  # [B] bool
  tokens: Array  # [B, N] int32 output buffer
  lengths: Array  # [B] int32
  last: Array  # [B] int32, the token to feed next
  key: Array
  cache: KVCache
  target_calls: Array  # [] int32
  top_ids: Array | None = None  # [B, N, K] when recording
  top_logprobs: Array | None = None
  evicted: Array | None = None  # [B] int32 under a KV budget: entries dropped, so the next
  # token's RoPE position is cache.lengths + evicted
  logprobs: Array | None = None  # [B, N] float32 when reporting them
  history: History | None = None  # the text's tokens, when penalties may be on


def _top_k_logprobs(logits: Array, k: int) -> tuple[Array, Array]:
  """(ids [B, k], log-probabilities [B, k]) of the k most likely tokens of logits [B, V]."""
  logits = logits.astype(jnp.float32)
  values, ids = jax.lax.top_k(logits, k)
  return ids.astype(jnp.int32), values - jax.nn.logsumexp(logits, axis=-1, keepdims=True)


@traced_under_placement
def decode_start(params: Params, cfg: Config, prompt: Array, prompt_lengths: Array, key: Array,
                 sampling: SamplingParams = GREEDY, *, max_new_tokens: int, cache_size: int,
                 stop_ids: tuple[int, ...] = (), cache_dtype=None, record_top_k: int = 0,
                 logprobs: str | None = None, kv: KVPolicy | None = None,
                 placement: Placement | None = None) -> DecodeState:
  """Prefill and sample the first token: the decode loop's state before its first step (see
  `generate_tokens` for the arguments)."""
  check_padded_prompts(prompt, prompt_lengths, max_new_tokens)
  if not is_int(record_top_k) or not 0 <= record_top_k <= cfg.vocab_size:
    raise ValueError(f"record_top_k must be an integer in [0, {cfg.vocab_size}] (0 = off), got "
                     f"{record_top_k!r}")
  B, P = prompt.shape
  evicted = None
  if kv is None:
    check_cache_width(P, cache_size)
    cache = KVCache.init(cfg, B, cache_size, cache_dtype or params.embed.dtype).placed(placement)
    logits, _, cache = prefill(params, cfg, prompt, prompt_lengths, cache)
  else:
    cache = KVCache.init(cfg, B, attention_slots(cfg, kv.slots),
                         cache_dtype or params.embed.dtype).placed(placement)
    logits, cache, evicted, _ = chunked_prefill(params, cfg, prompt, prompt_lengths, cache, kv,
                                                placement=placement)
  key, first, history, first_lp = first_token(key, logits, prompt, prompt_lengths,
                                               cfg.vocab_size, sampling, logprobs)
  tokens = jnp.full((B, max_new_tokens), PAD, jnp.int32).at[:, 0].set(first)
  top_ids = top_logprobs = None
  if record_top_k:
    ids, lps = _top_k_logprobs(logits, record_top_k)
    shape = (B, max_new_tokens, record_top_k)
    top_ids = jnp.full(shape, PAD, jnp.int32).at[:, 0].set(ids)
    top_logprobs = jnp.full(shape, -jnp.inf, jnp.float32).at[:, 0].set(lps)
  token_lps = None
  if logprobs:
    token_lps = jnp.zeros((B, max_new_tokens), jnp.float32).at[:, 0].set(first_lp)
  done = is_stop(first, stop_ids) | (max_new_tokens <= 1)
  if kv is None:  # a cache the prompt fills leaves no slot for the next token's entry
    done = done | cache_full(cache.lengths, 1, cache_size)
  return DecodeState(
      step=jnp.int32(1), done=done, tokens=tokens,
      lengths=jnp.ones((B,), jnp.int32), last=first, key=key, cache=cache,
      target_calls=jnp.int32(1), top_ids=top_ids, top_logprobs=top_logprobs, evicted=evicted,
      logprobs=token_lps, history=history)


@traced_under_placement
def decode_loop(params: Params, cfg: Config, state: DecodeState, until: Array | None = None,
                sampling: SamplingParams = GREEDY, *, max_new_tokens: int,
                stop_ids: tuple[int, ...] = (), record_top_k: int = 0,
                logprobs: str | None = None, kv: KVPolicy | None = None,
                placement: Placement | None = None) -> DecodeState:
  """Decode from `state` until every row is done, or (streaming) until `until` ([] int32)
  tokens have been generated in lockstep."""

  def cond(s: DecodeState):
    going = (s.step < max_new_tokens) & ~jnp.all(s.done)
    return going if until is None else going & (s.step < until)

  def body(s: DecodeState) -> DecodeState:
    evicted = s.evicted
    if kv is None:
      logits, _, cache = forward(params, cfg, s.last[:, None], s.cache.lengths[:, None], s.cache)
      cache = cache.commit(1)
    else:
      logits, cache, evicted = budgeted_step(params, cfg, s.last[:, None], s.cache, s.evicted, kv)
    key, sub = jax.random.split(s.key)
    penalized = penalize(logits[:, 0], s.history, sampling)
    processed = processed_for(logprobs, penalized, sampling)  # shared with the report
    nxt = sample(sub, penalized, sampling, processed)  # [B]
    nxt = jnp.where(s.done, PAD, nxt)
    history = None if s.history is None else s.history.add(nxt[:, None], ~s.done[:, None])
    tokens = jax.lax.dynamic_update_slice(s.tokens, nxt[:, None], (0, s.step))
    lengths = s.lengths + (~s.done).astype(jnp.int32)
    done = s.done | is_stop(nxt, stop_ids) | (lengths >= max_new_tokens)
    if kv is None:  # no slot left for the next step's entry (the wrappers' caches always have one)
      done = done | cache_full(cache.lengths, 1, cache.size)
    top_ids, top_logprobs = s.top_ids, s.top_logprobs
    if record_top_k:
      ids, lps = _top_k_logprobs(logits[:, 0], record_top_k)
      ids = jnp.where(s.done[:, None], PAD, ids)  # a finished row's model still runs: not its text
      lps = jnp.where(s.done[:, None], -jnp.inf, lps)
      top_ids = jax.lax.dynamic_update_slice(top_ids, ids[:, None], (0, s.step, 0))
      top_logprobs = jax.lax.dynamic_update_slice(top_logprobs, lps[:, None], (0, s.step, 0))
    token_lps = s.logprobs
    if logprobs:
      lp = jnp.where(s.done, 0.0, token_logprobs(logits[:, 0], nxt, logprobs, sampling,
                                                 processed))
      token_lps = jax.lax.dynamic_update_slice(token_lps, lp[:, None], (0, s.step))
    return DecodeState(step=s.step + 1, done=done, tokens=tokens, lengths=lengths,
                       last=jnp.where(s.done, s.last, nxt), key=key, cache=cache,
                       target_calls=s.target_calls + 1, top_ids=top_ids,
                       top_logprobs=top_logprobs, evicted=evicted, logprobs=token_lps,
                       history=history)

  return jax.lax.while_loop(cond, body, state)


@traced_under_placement
def decode_segment(params: Params, cfg: Config, state: DecodeState, every: Array,
                   sampling: SamplingParams = GREEDY, **loop) -> tuple[DecodeState, tuple]:
  """Streaming: `every` more tokens from `state` (or until every row is done), and the view the
  host reads of the result (jspec.streaming)."""
  state = decode_loop(params, cfg, state, state.step + every, sampling, **loop)
  return state, view(state)


def decode_output(state: DecodeState) -> GenerateOutput:
  return GenerateOutput(tokens=state.tokens, lengths=state.lengths,
                        target_calls=state.target_calls, steps=state.step - 1,
                        top_ids=state.top_ids, top_logprobs=state.top_logprobs,
                        logprobs=state.logprobs)


@traced_under_placement
def generate_tokens(params: Params, cfg: Config, prompt: Array, prompt_lengths: Array, key: Array,
                    sampling: SamplingParams = GREEDY, *, max_new_tokens: int, cache_size: int,
                    stop_ids: tuple[int, ...] = (), cache_dtype=None,
                    record_top_k: int = 0, logprobs: str | None = None,
                    kv: KVPolicy | None = None,
                    placement: Placement | None = None) -> GenerateOutput:
  """Generate up to `max_new_tokens` per row; pure and jit-friendly.

  Args:
    prompt: [B, P] int32, right-padded prompts; prompt_lengths: [B] int32 (>= 1).
    cfg, max_new_tokens, cache_size, stop_ids, cache_dtype, record_top_k, logprobs, kv: static.
    record_top_k: if > 0, also return the model's top-k tokens and log-probs at every position.
    logprobs: "model" or "sampled": also return each generated token's log-probability
      (jspec.sampling.logprobs); None: not computed.
    kv: a KV budget (jspec.kv): the cache holds kv.slots slots whatever the prompt length
      (rounded up to the attention kernel's blocks under Pallas attention: `attention_slots`;
      cache_size is ignored); the prompt is prefilled in chunks and decoding evicts as it goes.
    placement: a mesh and its rules (jspec.sharding; static): the cache is pinned to it and the
      outputs are replicated; params and prompts should already be placed (`generate` does it).
  """
  loop = dict(max_new_tokens=max_new_tokens, stop_ids=stop_ids, record_top_k=record_top_k,
              logprobs=logprobs, kv=kv, placement=placement)
  state = decode_start(params, cfg, prompt, prompt_lengths, key, sampling, cache_size=cache_size,
                       cache_dtype=cache_dtype, **loop)
  out = decode_output(decode_loop(params, cfg, state, None, sampling, **loop))
  return out if placement is None else placement.replicated(out)


_LOOP_STATICS = ("max_new_tokens", "stop_ids", "record_top_k", "logprobs", "kv", "placement")
_generate_jit = engine_jit(generate_tokens, static_argnums=(1,),
                           static_argnames=_LOOP_STATICS + ("cache_size", "cache_dtype"))
_start_jit = engine_jit(stream_program(decode_start), static_argnums=(1,),
                        static_argnames=_LOOP_STATICS + ("cache_size", "cache_dtype"))
_resume_jit = engine_jit(stream_program(decode_segment), static_argnums=(1,),
                         static_argnames=_LOOP_STATICS, donate_argnums=(2,))


def generate(params: Params, cfg: Config, prompts: Sequence[Sequence[int]], *,
             max_new_tokens: int, sampling: SamplingParams = GREEDY, key: Array | int = 0,
             stop_ids: Sequence[int] = (), cache_size: int | None = None,
             record_top_k: int = 0, logprobs: str | None = None, precision: str = "fast",
             kv: KVPolicy | None = None, mesh: Mesh | None = None,
             _stream: bool = False) -> GenerateOutput:
  """Generate from a batch of token-id prompts of any lengths (validated, bucketed, jitted).

  Example:
    out = generate(params, cfg, [[1, 2, 3], [4, 5]], max_new_tokens=32,
                   sampling=SamplingParams(temperature=0.7, top_p=0.9), key=0)
    out.sequences()  # [[...], [...]]

  precision: "fast" (the backend's default matmuls) or "exact" (full float32 matmuls; see
  jspec.models.numerics): what greedy identity with speculative decoding on an accelerator needs.
  kv: a KV budget (`jspec.kv.policy.KVPolicy`): prompts of any length run in kv.slots cache slots
  per row (chunked prefill, eviction by kv.method; fewer where the run cannot fill them,
  `KVPolicy.within`); exclusive with cache_size.
  mesh: a ("dp", "tp") `jax.sharding.Mesh` (jspec.sharding.make_mesh) or its text, "dp=2,tp=4"
  (as `jspec.model.load` takes): the batch split over dp, heads, MLP and vocabulary over tp, one
  program for all devices; the same tokens as one device.
  logprobs: "model" or "sampled" (jspec.sampling.logprobs): out.logprobs [B, N], each generated
  token's log-probability, the model's own or under the sampling settings.
  """
  check_logprobs(logprobs)
  if int(record_top_k) != record_top_k or not 0 <= record_top_k <= cfg.vocab_size:
    raise ValueError(f"record_top_k must be an integer in [0, {cfg.vocab_size}] (0 = off), got "
                     f"{record_top_k}")
  check_kv(cfg, kv)
  if kv is not None and cache_size is not None:
    raise ValueError(f"cache_size={cache_size} and kv= are exclusive: under a KV budget the cache "
                     f"holds kv.slots={kv.slots} slots. Fix: drop cache_size.")
  b = prepare_batch(cfg, prompts, max_new_tokens=max_new_tokens, sampling=sampling, key=key,
                    stop_ids=stop_ids, cache_size=cache_size)
  params, b, placement = on_mesh(params, cfg, b, mesh)
  if kv is not None:  # no row commits more than its prompt and max_new_tokens
    kv = kv.within(b.tokens.shape[1] + int(max_new_tokens))
  loop = dict(max_new_tokens=int(max_new_tokens), stop_ids=b.stop_ids,
              record_top_k=int(record_top_k), logprobs=logprobs, precision=precision, kv=kv,
              placement=placement)
  cache_size = b.cache_size if kv is None else kv.slots
  if not _stream:
    return _generate_jit(params, cfg, b.tokens, b.lengths, b.key, b.sampling,
                         cache_size=cache_size, **loop)
  return Segmented(
      start=lambda: _start_jit(params, cfg, b.tokens, b.lengths, b.key, b.sampling,
                               cache_size=cache_size, **loop),
      resume=lambda state, every: _resume_jit(params, cfg, state, every, b.sampling, **loop),
      finish=decode_output, max_new_tokens=int(max_new_tokens)), params


def generate_stream(params: Params, cfg: Config, prompts: Sequence[Sequence[int]], *,
                    every: int = 1, **kwargs) -> TokenStream:
  """`generate`, streamed: iterate for each row's new token ids every `every` tokens; the stream's
  `output` is then what `generate` returns, the same tokens (jspec.streaming). Takes `generate`'s
  arguments; the checks run here, the programs when iterated."""
  run, placed = generate(params, cfg, prompts, _stream=True, **kwargs)
  return TokenStream(run, every, owners=placed)
