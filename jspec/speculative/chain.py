"""Speculative generation with a chain of drafts, as one XLA program.

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

from jspec.decode import is_int, on_mesh, prepare_batch, stop_id_tuple
from jspec.drafting import debug
from jspec.drafting.base import (Drafter, Features, check_proposal, penalty_kwargs, place_drafter,
                                 valid_drafts)
from jspec.drafting.probe import check_probe_round
from jspec.kv.evict import block_mass, evict_when_full, fold_block_mass
from jspec.kv.policy import KVPolicy, check_kv
from jspec.models.config import Config
from jspec.models.llama import Params, forward
from jspec.models.numerics import engine_jit
from jspec.sampling.logprobs import check_logprobs, processed_for
from jspec.sampling.penalties import chain_paths, penalize
from jspec.sampling.processing import GREEDY, SamplingParams, sample
from jspec.sampling.verify import verify
from jspec.sharding import Mesh, Placement, traced_under_placement
from jspec.speculative.loop import (SpecOutput, SpecState, advance, budgeted_slots,
                                    chain_reserve, check_drafter, check_extra_positions_target,
                                    check_shared_cache, eviction_cut, going, initial_state,
                                    run_or_segment)
from jspec.speculative.probing import probe_hidden, verification_inputs, verification_width
from jspec.streaming import TokenStream, stream_program, view

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class SpecConfig:
  """Static settings of a speculative run."""

  gamma: int  # draft tokens per round
  max_new_tokens: int
  stop_ids: tuple[int, ...] = ()
  logprobs: str | None = None  # "model" or "sampled": report each token's (jspec.sampling.logprobs)

  def __post_init__(self):
    check_logprobs(self.logprobs)
    if not is_int(self.gamma) or self.gamma < 1:
      raise ValueError(f"gamma (draft tokens per round) must be an integer >= 1, got "
                       f"{self.gamma!r}")
    if not is_int(self.max_new_tokens) or self.max_new_tokens < 1:
      raise ValueError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
    object.__setattr__(self, "gamma", int(self.gamma))  # NumPy integers: one hash a value
    object.__setattr__(self, "max_new_tokens", int(self.max_new_tokens))
    object.__setattr__(self, "stop_ids", stop_id_tuple(self.stop_ids))


@traced_under_placement
def speculative_start(params: Params, cfg: Config, drafter: Drafter, prompt: Array,
                      prompt_lengths: Array, key: Array, sampling: SamplingParams = GREEDY, *,
                      spec: SpecConfig, cache_size: int, kv: KVPolicy | None = None,
                      placement: Placement | None = None) -> SpecState:
  """Prefill target and drafter and sample the first token: the loop state before round one."""
  return initial_state(params, cfg, drafter, prompt, prompt_lengths, key, sampling, spec,
                       cache_size, max_accepted=spec.gamma,
                       reserve=chain_reserve(drafter, spec.gamma), kv=kv,
                       target_slots=budgeted_slots(kv, drafter, spec.gamma + 1),
                       placement=placement)


def speculative_loop(params: Params, cfg: Config, drafter: Drafter, prompt: Array,
                     prompt_lengths: Array, key: Array, sampling: SamplingParams = GREEDY, *,
                     spec: SpecConfig, cache_size: int, kv: KVPolicy | None = None,
                     placement: Placement | None = None, state: SpecState | None = None,
                     until: Array | None = None) -> SpecState:
  """The whole run, returning the final loop state (caches and drafter state included); see
  `speculative_generate_tokens`. Streaming: from `state` (the prompt arguments unused) and only
  until `until` ([] int32) rounds have run."""
  G = spec.gamma
  k = drafter.probe_masks  # mask positions after every block token (probing drafters)
  check_probe_round(drafter, gamma=G)
  check_shared_cache(drafter, tree=False)
  if state is None:
    state = speculative_start(params, cfg, drafter, prompt, prompt_lengths, key, sampling,
                              spec=spec, cache_size=cache_size, kv=kv, placement=placement)

  def body(s: SpecState) -> SpecState:
    if kv is None and not drafter.stops_early:
      key, k_draft, k_verify = jax.random.split(s.key, 3)
    else:  # one more key, for the fresh draw at a cut
      key, k_draft, k_verify, k_cut = jax.random.split(s.key, 4)
    target_cache = s.cache
    # Penalties on: drafters that can propose under them get the text's counts.
    penalties = penalty_kwargs(drafter, s.history)
    if drafter.shares_target_cache:  # a layer-skip draft writes past the committed entries
      drafts, q, draft, target_cache = drafter.propose_shared(s.draft, s.cache, s.last2,
                                                              s.seq_len, k_draft, sampling, G,
                                                              **penalties)
    else:
      drafts, q, draft = drafter.propose(s.draft, s.last2, s.seq_len, k_draft, sampling, G,
                                         **penalties)
    check_proposal(drafter, "propose", drafts, q, s.last2.shape[0], G, cfg.vocab_size)
    if debug.ENABLED:  # JSPEC_CHECK_DRAFTS=1: q must be the drafts' distributions
      verified = ~s.done[:, None] & (jnp.cumprod(drafts >= 0, axis=1) > 0)
      debug.check_law(f"{type(drafter).__name__}.propose", drafts, q, verified)
    cut = None  # [B]: verify only the first `cut` drafts (the rest are not the target's to judge)
    if drafter.stops_early:
      drafts, cut = valid_drafts(drafts)
    # Verify [last token, d_1 .. d_G] in one forward; the cache holds everything before it.
    block = jnp.concatenate([s.last2[:, 1:], drafts], axis=1)  # [B, G + 1]
    start = s.seq_len - 1
    positions = start[:, None] + jnp.arange(G + 1, dtype=jnp.int32)
    # A probing drafter's masks after each block token, or a lookahead window after the root.
    tokens_in, mask, positions, masks, heads = verification_inputs(drafter, draft, block, None,
                                                                   positions)
    X = drafter.window_size
    cache_in, weights = target_cache.with_lengths(start), None
    if kv is not None:
      cache_in = target_cache
      if kv.needs_attention:  # per-query mass now; the committed queries' once n_acc is known
        cache_in, weights = block_mass(target_cache, G + 1,
                                       verification_width(drafter, G + 1) - (G + 1))
    taps = drafter.feature_layers
    wide = lambda: forward(params, cfg, tokens_in, positions, cache_in, mask, mass_weights=weights,
                           appended=masks, logits_indices=heads, taps=taps)
    if cut is not None and weights is None and not k and not X:
      # No row drafted anything: a one-token step (outputs padded to the block) costs what
      # autoregressive decoding does instead of a (G + 1)-token forward.
      def narrow():
        logits, hidden, cache = forward(params, cfg, block[:, :1], positions[:, :1], cache_in,
                                        taps=taps)
        pad = lambda x: jnp.pad(x, ((0, 0), (0, G), (0, 0)))
        return pad(logits), pad(hidden), cache
      target_logits, hidden, cache = jax.lax.cond(jnp.all(cut == 0), narrow, wide)
    else:
      target_logits, hidden, cache = wide()
    model_logits = target_logits  # before any penalty: "model" logprobs
    # Position i's law follows d_1 .. d_i too (jspec.sampling.penalties).
    target_logits = penalize(target_logits, s.history, sampling, chain_paths(drafts))
    processed = processed_for(spec.logprobs, target_logits, sampling)  # shared with verify
    n_acc, nxt = verify(k_verify, drafts, q, target_logits, sampling, processed)  # [B], [B]
    if kv is not None:
      kv_cut = eviction_cut(kv, s.cache.lengths)  # [B]
      cut = kv_cut if cut is None else jnp.minimum(cut, kv_cut)
    if cut is not None:
      # Past the cut, stop: d_1 .. d_cut stand and the next token is drawn afresh from the target
      # at `cut` (the event n_acc >= cut depends on the first cut draws alone, and the cut on
      # nothing the target computed, so this keeps the output law exact).
      at_cut = jnp.take_along_axis(target_logits, jnp.clip(cut, 0, G)[:, None, None], axis=1)
      stopped = n_acc >= cut
      nxt = jnp.where(stopped, sample(k_cut, at_cut[:, 0], sampling), nxt)
      n_acc = jnp.minimum(n_acc, cut)

    # Emitted this round: d_1 .. d_n, then the target's token.
    idx = jnp.arange(G + 1)
    emitted = jnp.where(idx[None] < n_acc[:, None], jnp.pad(drafts, ((0, 0), (0, 1))),
                        nxt[:, None])  # [B, G + 1], valid up to index n_acc
    new = advance(s, emitted, n_acc, spec, key=key, cache=cache,
                  reserve=chain_reserve(drafter, G), logits=model_logits,
                  sampling=sampling, processed=processed)
    if kv is not None:
      cache = new.cache
      if kv.needs_attention:
        cache = fold_block_mass(kv, s.cache, cache, new.seq_len - s.seq_len)
      # The cut above leaves a due row exactly evict_every entries over the budget.
      cache, dropped = evict_when_full(kv, cache, new.evicted, max_drop=kv.evict_every)
      new = dataclasses.replace(new, cache=cache, evicted=new.evicted + dropped)
    probes = probe_hidden(hidden, G + 1, k, n_acc) if k else None  # after the last accepted
    return dataclasses.replace(new, draft=drafter.update(
        draft, new.seq_len, Features(hidden=hidden[:, :G + 1], tokens=emitted, start=start,
                                     probe_hidden=probes,
                                     window_hidden=hidden[:, G + 1:] if X else None)))

  return jax.lax.while_loop(lambda s: going(s, until), body, state)


@traced_under_placement
def speculative_segment(params: Params, cfg: Config, drafter: Drafter, state: SpecState,
                        every: Array, sampling: SamplingParams = GREEDY, *, spec: SpecConfig,
                        cache_size: int, kv: KVPolicy | None = None,
                        placement: Placement | None = None) -> tuple[SpecState, tuple]:
  """Streaming: `every` more rounds from `state` (or until every row is done), and the view the
  host reads of the result (jspec.streaming)."""
  state = speculative_loop(params, cfg, drafter, None, None, None, sampling, spec=spec,
                           cache_size=cache_size, kv=kv, placement=placement, state=state,
                           until=state.rounds + every)
  return state, view(state)


def spec_output(s: SpecState, spec: SpecConfig) -> SpecOutput:
  return SpecOutput(
      tokens=s.tokens[:, :spec.max_new_tokens], lengths=s.lengths, rounds=s.rounds,
      round_tokens=s.round_tokens, row_rounds=s.row_rounds, accept_hist=s.accept_hist,
      accepted_at=s.accepted_at,
      logprobs=None if s.logprobs is None else s.logprobs[:, :spec.max_new_tokens])


@traced_under_placement
def speculative_generate_tokens(params: Params, cfg: Config, drafter: Drafter, prompt: Array,
                                prompt_lengths: Array, key: Array,
                                sampling: SamplingParams = GREEDY, *, spec: SpecConfig,
                                cache_size: int, kv: KVPolicy | None = None,
                                placement: Placement | None = None) -> SpecOutput:
  """Pure, jit-friendly speculative generation; `cfg`, `spec`, `cache_size` and `kv` are static.

  kv: a KV budget for the target (any policy; attention-score ones count the committed tokens'
  queries only, as decoding them one at a time would). Verification then stays exact with respect
  to the target as it runs under that budget: a round uses the target's scores only up to the
  token after which autoregressive decoding would have evicted (`evict_when_full`), then evicts as
  it would, so greedy output equals greedy autoregressive output under the same policy.

  placement: a mesh (jspec.sharding; static): the target cache pinned to it, outputs replicated;
  params, drafter and prompts placed beforehand (`speculative_generate` does it)."""
  s = speculative_loop(params, cfg, drafter, prompt, prompt_lengths, key, sampling, spec=spec,
                       cache_size=cache_size, kv=kv, placement=placement)
  out = spec_output(s, spec)
  return out if placement is None else placement.replicated(out)


_STATICS = dict(static_argnums=(1,), keyed_by_class=(2,),
                static_argnames=("spec", "cache_size", "kv", "placement"))
_spec_jit = engine_jit(speculative_generate_tokens, **_STATICS)
_start_jit = engine_jit(stream_program(speculative_start), **_STATICS)
_resume_jit = engine_jit(stream_program(speculative_segment), donate_argnums=(3,),
                         **_STATICS)


def speculative_generate(params: Params, cfg: Config, drafter: Drafter,
                         prompts: Sequence[Sequence[int]], *, spec: SpecConfig,
                         sampling: SamplingParams = GREEDY, key: Array | int = 0,
                         cache_size: int | None = None, precision: str = "fast",
                         kv: KVPolicy | None = None,
                         draft_kv: KVPolicy | None = None, mesh: Mesh | None = None,
                         _stream: bool = False) -> SpecOutput:
  """Validated, bucketed, jitted speculative generation from token-id prompts.

  Example:
    drafter = ModelDrafter(draft_params, draft_cfg)
    out = speculative_generate(params, cfg, drafter, [[1, 2, 3]], spec=SpecConfig(gamma=4,
                               max_new_tokens=64), sampling=SamplingParams(temperature=1.0))
    out.sequences(), out.block_efficiency

  precision="exact": full float32 matmuls, for token-identical greedy output on accelerators (see
  jspec.models.numerics). kv: a KV budget for the target (`jspec.kv.policy.KVPolicy`): greedy
  output equals `generate(..., kv=kv)`'s. draft_kv: a key-scored KV budget for the drafter's own
  cache (model drafters, `Drafter.with_kv`; it changes acceptance, never the output); None: the
  drafter keeps a full cache. mesh: a ("dp", "tp") mesh (as for `generate`): the target sharded,
  a draft model replicated, the batch split over dp.
  cache_size: the cache's slots (default: sized for the prompts, max_new_tokens and a round's
  reserve); under kv the target holds kv.slots instead (fewer where the run cannot fill them,
  `KVPolicy.within`), and cache_size sizes only a drafter's own full cache (`generate`, which
  has no drafter, refuses cache_size with kv).
  """
  if not isinstance(spec, SpecConfig):
    raise TypeError(f"spec must be a SpecConfig, got {type(spec).__name__}. Fix: "
                    f"spec=SpecConfig(gamma=..., max_new_tokens=...); token trees run with "
                    f"tree_speculative_generate and a TreeSpecConfig.")
  check_drafter(cfg, drafter)
  check_kv(cfg, kv)
  check_kv(cfg, draft_kv, "draft_kv")
  check_extra_positions_target(params, drafter)
  check_probe_round(drafter, gamma=spec.gamma)
  check_shared_cache(drafter, tree=False)
  # Verification writes up to gamma + 1 entries past the last kept one (and k masks after each).
  b = prepare_batch(cfg, prompts, max_new_tokens=spec.max_new_tokens, sampling=sampling, key=key,
                    stop_ids=spec.stop_ids, cache_size=cache_size,
                    reserve=chain_reserve(drafter, spec.gamma),
                    reserve_for="gamma + 1 (the draft block"
                                + (f" and its {drafter.probe_masks} masks a token"
                                   if drafter.probe_masks else "")
                                + (f" and a lookahead window of {drafter.window_size}"
                                   if drafter.window_size else "") + ")",
                    reserve_fix="lower gamma")
  placed, b, placement = on_mesh(params, cfg, b, mesh)
  # No row commits more than its prompt, max_new_tokens and a round's reserve.
  entries = b.tokens.shape[1] + spec.max_new_tokens + chain_reserve(drafter, spec.gamma)
  kv = None if kv is None else kv.within(entries)
  if draft_kv is not None:
    # A round feeds the last two known tokens and gamma - 1 drafts to the drafter.
    drafter = drafter.with_kv(draft_kv.within(entries), spec.gamma + 1)
  drafter = place_drafter(drafter, placement, params, placed)
  static = dict(spec=spec, cache_size=b.cache_size, precision=precision, kv=kv,
                placement=placement)
  return run_or_segment((_spec_jit, _start_jit, _resume_jit), placed, cfg, drafter, b, static,
                        lambda state: spec_output(state, spec), _stream)


def speculative_generate_stream(params: Params, cfg: Config, drafter: Drafter,
                                prompts: Sequence[Sequence[int]], *, every: int = 1,
                                **kwargs) -> TokenStream:
  """`speculative_generate`, streamed: iterate for each row's new token ids every `every`
  rounds; the stream's `output` is then what `speculative_generate` returns, the same tokens
  (jspec.streaming). Takes `speculative_generate`'s arguments, checked here."""
  run, owners = speculative_generate(params, cfg, drafter, prompts, _stream=True, **kwargs)
  return TokenStream(run, every, owners=owners)
