"""Tree speculative decoding as one XLA program.

Prefill target and drafter, then one `lax.while_loop` whose body drafts a token tree of N nodes
below each row's last known token (one drafter forward per depth, jspec.tree.draft schedules),
verifies it with ONE target forward over [root, node_1 .. node_N] under the tree-attention mask
(jspec.sampling.tree_verify), emits the accepted path plus the target's next token, and compacts
the accepted path's KV entries of both caches into consecutive slots (the rest is dropped by
setting lengths). Greedy output equals the target's greedy decoding; sampled output is distributed
exactly as the target's.

Tree shapes: jspec.tree.shapes.

Slot layout of a round, for a row that knows seq_len tokens (the target cache holds seq_len - 1):
the target writes the root (the last known token) at slot seq_len - 1 and node n at slot
seq_len + n; after verification accepting path[0 .. n-1], slot seq_len + j receives the entry of
path[j]. Each drafter keeps its own cache in step through `accept_tree` (a model drafter moves the
accepted nodes' KV the same way; the feature drafter rewrites the path's pairs from the target's
features; the n-gram lookup writes the accepted tokens into its history).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp

from jspec.decode import is_int, on_mesh, prepare_batch, stop_id_tuple
from jspec.drafting.base import DraftState, Drafter, Features, penalty_kwargs, place_drafter
from jspec.drafting.probe import check_probe_round
from jspec.kv.evict import block_mass, evict_when_full, fold_block_mass
from jspec.kv.policy import KVPolicy, check_kv
from jspec.models.cache import KVCache, move_kv
from jspec.models.config import Config
from jspec.models.llama import Params, forward
from jspec.models.numerics import engine_jit
from jspec.sampling.logprobs import check_logprobs, processed_for
from jspec.sampling.penalties import penalize, tree_paths
from jspec.sampling.processing import GREEDY, SamplingParams, sample
from jspec.sampling.tree_verify import emitted_tokens, verify_tree
from jspec.sharding import Mesh, Placement, traced_under_placement
from jspec.speculative.loop import (SpecOutput, SpecState, advance, budgeted_slots,
                                    check_drafter, check_shared_cache, check_tree_target,
                                    eviction_cut, going, initial_state, run_or_segment)
from jspec.speculative.probing import probe_hidden, verification_inputs, verification_width
from jspec.streaming import TokenStream, stream_program, view
from jspec.tree.shapes import TREE_HELP, TreeShape, parse_tree
from jspec.tree.structure import Tree, ancestor_mask, take
from jspec.tree.structure import positions as node_positions

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class TreeSpecConfig:
  """Static settings of a tree speculative run; `tree` is a shape or its string (parse_tree)."""

  tree: TreeShape | str
  max_new_tokens: int
  stop_ids: tuple[int, ...] = ()
  logprobs: str | None = None  # "model" or "sampled": report each token's (jspec.sampling.logprobs)

  def __post_init__(self):
    check_logprobs(self.logprobs)
    if isinstance(self.tree, str):
      object.__setattr__(self, "tree", parse_tree(self.tree))
    if not isinstance(self.tree, TreeShape):
      raise ValueError(f"tree must be a tree string ({TREE_HELP}) or a shape from "
                       f"parse_tree, got {self.tree!r}")
    if not is_int(self.max_new_tokens) or self.max_new_tokens < 1:
      raise ValueError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
    object.__setattr__(self, "max_new_tokens", int(self.max_new_tokens))  # one hash a value
    object.__setattr__(self, "stop_ids", stop_id_tuple(self.stop_ids))

  @property
  def method(self) -> str:
    return self.tree.method

  @property
  def num_nodes(self) -> int:
    """N, the static node budget (draft tokens per round)."""
    return self.tree.num_nodes

  @property
  def tree_nodes(self) -> int:
    """Tokens per verification call: the root and the N nodes."""
    return self.tree.num_nodes + 1

  @property
  def reserve(self) -> int:
    """Cache slots a round writes past the row's known tokens (target: N + 1; draft: fed + 1)."""
    return max(self.tree.num_nodes, self.tree.fed_nodes) + 1


def tree_reserve(drafter: Drafter, spec: TreeSpecConfig) -> int:
  """Cache slots a tree round writes past the committed entries: the root and the nodes (and
  what rides along with them: probe masks, a lookahead window), or the drafter's fed nodes."""
  return max(spec.reserve, verification_width(drafter, spec.tree_nodes))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(kw_only=True)
class TreeSpecOutput(SpecOutput):
  """SpecOutput of a tree run: accept_hist [D + 1] counts rounds by accepted depth, accepted_at
  [D] how often depth d + 1 was reached."""

  tree_nodes: int = dataclasses.field(metadata=dict(static=True))  # N + 1, static


def verification_mask(tree: Tree) -> Array:
  """[B, N + 1, N + 1] bool over [root, nodes]: everyone sees the root, nodes their ancestors."""
  B, N = tree.tokens.shape
  mask = jnp.zeros((B, N + 1, N + 1), bool).at[:, :, 0].set(True)
  return mask.at[:, 1:, 1:].set(ancestor_mask(tree))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TreeRound:
  """One round's draft and verification, nothing advanced yet."""

  tree: Tree
  drafted: DraftState  # the drafter's state holding the tree
  cache: KVCache  # the target cache holding the root's and the nodes' KV
  hidden: Array  # [B, N + 1, E] the target's hidden states over [root, nodes]
  # Probing drafters: [B, (N + 1)(1 + k), E], the block's and then the k masks of each block token
  probed: Array | None
  window: Array | None  # window drafters: [B, X, E] at the lookahead window's tokens
  path: Array  # [B, D] the accepted path (node indices, -1 padded)
  n_acc: Array  # [B] its length
  next_token: Array  # [B] the target's token after it
  target_logits: Array  # [B, N + 1, V] the target's logits over [root, nodes], penalized
  model_logits: Array  # [B, N + 1, V] the same before any penalty ("model" logprobs)
  processed: Array | None  # [B, N + 1, V] their processed log-probabilities, if computed


def tree_round(params: Params, cfg: Config, drafter: Drafter, s: SpecState, k_draft: Array,
               k_verify: Array, sampling: SamplingParams, shape: TreeShape,
               kv: KVPolicy | None = None, logprobs: str | None = None) -> TreeRound:
  """Draft a tree from loop state `s` and verify it with one target forward (under a KV budget
  `kv` the target cache's lengths already count its entries, and attention-score policies get each
  query's attention mass apart: cache.mass [L, B, S, K, N + 1]). logprobs: the kind reported
  (jspec.sampling.logprobs), so that "sampled" shares the verifier's processed logits."""
  tree, drafted = drafter.draft_tree(s.draft, s.last2, s.seq_len, k_draft, sampling, shape,
                                     **penalty_kwargs(drafter, s.history, tree=True))
  # Verify [root, node_1 .. node_N] in one forward; the cache holds everything before the root.
  block = jnp.concatenate([s.last2[:, 1:], tree.tokens], axis=1)  # [B, N + 1]
  start = s.seq_len - 1
  positions = jnp.concatenate([start[:, None], node_positions(tree, s.seq_len)], axis=1)
  # A probing drafter's masks after the root and every node, or a lookahead window after the root.
  tokens_in, mask, positions, masks, heads = verification_inputs(
      drafter, drafted, block, verification_mask(tree), positions)
  T = block.shape[1]
  k, X = drafter.probe_masks, drafter.window_size
  cache_in, weights = (s.cache.with_lengths(start) if kv is None else s.cache), None
  if kv is not None and kv.needs_attention:
    cache_in, weights = block_mass(s.cache, T, verification_width(drafter, T) - T)
  target_logits, hidden, cache = forward(params, cfg, tokens_in, positions, cache_in, mask,
                                         mass_weights=weights, appended=masks,
                                         logits_indices=heads,
                                         taps=drafter.feature_layers)  # [B, N + 1, V]
  model_logits = target_logits
  # A node's law follows its path's tokens too (jspec.sampling.penalties).
  paths = None if s.history is None else tree_paths(tree)  # no history: penalties off
  target_logits = penalize(target_logits, s.history, sampling, paths)
  processed = processed_for(logprobs, target_logits, sampling)
  path, n_acc, nxt = verify_tree(k_verify, tree, target_logits, sampling,
                                 processed)  # [B, D], [B], [B]
  return TreeRound(tree=tree, drafted=drafted, cache=cache, hidden=hidden[:, :T],
                   probed=hidden if k else None, window=hidden[:, T:] if X else None,
                   path=path, n_acc=n_acc, next_token=nxt,
                   target_logits=target_logits, model_logits=model_logits,
                   processed=processed)


@traced_under_placement
def tree_start(params: Params, cfg: Config, drafter: Drafter, prompt: Array,
               prompt_lengths: Array, key: Array, sampling: SamplingParams = GREEDY, *,
               spec: TreeSpecConfig, cache_size: int, kv: KVPolicy | None = None,
               placement: Placement | None = None) -> SpecState:
  """Prefill target and drafter and sample the first token: the loop state before round one."""
  return initial_state(params, cfg, drafter, prompt, prompt_lengths, key, sampling, spec,
                       cache_size, max_accepted=spec.tree.max_depth,
                       reserve=tree_reserve(drafter, spec), kv=kv,
                       target_slots=budgeted_slots(kv, drafter, spec.num_nodes + 1),
                       placement=placement)


def tree_speculative_loop(params: Params, cfg: Config, drafter: Drafter, prompt: Array,
                          prompt_lengths: Array, key: Array, sampling: SamplingParams = GREEDY,
                          *, spec: TreeSpecConfig, cache_size: int,
                          kv: KVPolicy | None = None, placement: Placement | None = None,
                          state: SpecState | None = None,
                          until: Array | None = None) -> SpecState:
  """The whole run, returning the final loop state (caches included); see the module docstring.
  Streaming: from `state` (the prompt arguments unused) and only until `until` rounds have run.

  kv: a KV budget for the target, exact as in the chain engine: an accepted path is used only to
  the depth after which autoregressive decoding would have evicted. Attention-score policies keep
  the mass of the committed queries only (the root and the accepted path, in decoding order), and
  it moves with the path's KV."""
  shape = spec.tree
  check_probe_round(drafter, depth=shape.max_depth)
  check_shared_cache(drafter, tree=True)
  if state is None:
    state = tree_start(params, cfg, drafter, prompt, prompt_lengths, key, sampling, spec=spec,
                       cache_size=cache_size, kv=kv, placement=placement)

  def body(s: SpecState) -> SpecState:
    if kv is None:
      key, k_draft, k_verify = jax.random.split(s.key, 3)
    else:
      key, k_draft, k_verify, k_cut = jax.random.split(s.key, 4)
    r = tree_round(params, cfg, drafter, s, k_draft, k_verify, sampling, shape, kv,
                   spec.logprobs)
    n_acc, nxt = r.n_acc, r.next_token
    if kv is not None:  # as in the chain engine: depth j <= cut only, a fresh draw at the cut
      cut = eviction_cut(kv, s.cache.lengths)  # [B]
      depth = jnp.clip(cut, 0, r.path.shape[1])
      node = jnp.take_along_axis(r.path, jnp.maximum(depth - 1, 0)[:, None], axis=1)[:, 0]
      at_cut = jnp.where(depth == 0, 0, node + 1)  # block index of the cut's node (root: 0)
      logits = jnp.take_along_axis(r.target_logits, at_cut[:, None, None], axis=1)[:, 0]
      nxt = jnp.where(n_acc >= cut, sample(k_cut, logits, sampling), nxt)
      n_acc = jnp.minimum(n_acc, cut)
    # Emitted this round: the accepted path, then the target's token.
    emitted = emitted_tokens(r.tree, r.path, n_acc, nxt)  # [B, D + 1], to n_acc
    # The accepted path's KV into consecutive slots: node path[j] (slot base + path[j], base the
    # slot after the root) moves to base + j. A row cut short by a stop or the budget is done.
    base = s.seq_len if kv is None else s.cache.lengths + 1
    cache = r.cache
    if kv is not None and kv.needs_attention:
      # The per-query mass columns in decoding order (root, path[0], path[1], ...), folded as
      # decoding n_acc + 1 of them one at a time would have left it, before the path's KV moves.
      order = jnp.concatenate([jnp.zeros_like(r.path[:, :1]), jnp.maximum(r.path, 0) + 1], axis=1)
      cache = dataclasses.replace(cache, mass=jnp.take_along_axis(
          cache.mass, order[None, :, None, None, :], axis=-1))  # [L, B, S, K, D + 1]
      cache = fold_block_mass(kv, s.cache, cache, n_acc + 1)
    cache = move_kv(cache, base, r.path, n_acc)
    # The target's view of the root and the accepted path (node n is entry n + 1 of the block):
    # emitted[:, j] was drawn from the logits at on_path[:, j].
    on_path = jnp.concatenate([jnp.zeros_like(r.path[:, :1]), r.path + 1], axis=1)  # [B, D + 1]
    new = advance(s, emitted, n_acc, spec, key=key, cache=cache,
                  reserve=tree_reserve(drafter, spec), sampling=sampling,
                  logits=take(r.model_logits, on_path) if spec.logprobs else None,
                  processed=None if r.processed is None else take(r.processed, on_path))
    if kv is not None:
      # The cut above leaves a due row exactly evict_every entries over the budget.
      cache, dropped = evict_when_full(kv, new.cache, new.evicted, max_drop=kv.evict_every)
      new = dataclasses.replace(new, cache=cache, evicted=new.evicted + dropped)
    probes = None
    if r.probed is not None:  # the masks after the last accepted token (the root: block index 0)
      end = jnp.take_along_axis(on_path, n_acc[:, None], axis=1)[:, 0]
      probes = probe_hidden(r.probed, spec.tree_nodes, drafter.probe_masks, end)
    features = Features(hidden=take(r.hidden, on_path), tokens=emitted, start=s.seq_len - 1,
                        probe_hidden=probes, window_hidden=r.window)
    return dataclasses.replace(new, draft=drafter.accept_tree(r.drafted, r.path, n_acc,
                                                              s.seq_len, features))

  return jax.lax.while_loop(lambda s: going(s, until), body, state)


@traced_under_placement
def tree_segment(params: Params, cfg: Config, drafter: Drafter, state: SpecState, every: Array,
                 sampling: SamplingParams = GREEDY, *, spec: TreeSpecConfig, cache_size: int,
                 kv: KVPolicy | None = None,
                 placement: Placement | None = None) -> tuple[SpecState, tuple]:
  """Streaming: `every` more rounds from `state` (or until every row is done), and the view the
  host reads of the result (jspec.streaming)."""
  state = tree_speculative_loop(params, cfg, drafter, None, None, None, sampling, spec=spec,
                                cache_size=cache_size, kv=kv, placement=placement, state=state,
                                until=state.rounds + every)
  return state, view(state)


def tree_output(s: SpecState, spec: TreeSpecConfig) -> TreeSpecOutput:
  return TreeSpecOutput(
      tokens=s.tokens[:, :spec.max_new_tokens], lengths=s.lengths, rounds=s.rounds,
      round_tokens=s.round_tokens, row_rounds=s.row_rounds, accept_hist=s.accept_hist,
      accepted_at=s.accepted_at, tree_nodes=spec.tree_nodes,
      logprobs=None if s.logprobs is None else s.logprobs[:, :spec.max_new_tokens])


@traced_under_placement
def tree_speculative_generate_tokens(params: Params, cfg: Config, drafter: Drafter, prompt: Array,
                                     prompt_lengths: Array, key: Array,
                                     sampling: SamplingParams = GREEDY, *, spec: TreeSpecConfig,
                                     cache_size: int, kv: KVPolicy | None = None,
                                     placement: Placement | None = None) -> TreeSpecOutput:
  """Pure, jit-friendly tree speculative generation; `cfg`, `spec`, `cache_size`, `kv` static.

  prompt [B, P] int32 right-padded, prompt_lengths [B]; any drafter (jspec.drafting). Needs
  cache_size >= max(prompt_lengths) + max_new_tokens + tree_reserve(drafter, spec); a row with
  less room ends where its cache does (its length then short of max_new_tokens).
  """
  s = tree_speculative_loop(params, cfg, drafter, prompt, prompt_lengths, key, sampling,
                            spec=spec, cache_size=cache_size, kv=kv, placement=placement)
  out = tree_output(s, spec)
  return out if placement is None else placement.replicated(out)


_STATICS = dict(static_argnums=(1,), keyed_by_class=(2,),
                static_argnames=("spec", "cache_size", "kv", "placement"))
_tree_jit = engine_jit(tree_speculative_generate_tokens, **_STATICS)
_start_jit = engine_jit(stream_program(tree_start), **_STATICS)
_resume_jit = engine_jit(stream_program(tree_segment), donate_argnums=(3,), **_STATICS)


def check_tree_run(cfg: Config, drafter: Drafter, spec: TreeSpecConfig) -> None:
  """Host-side checks of a tree run's drafter and shape against the target config."""
  if not isinstance(spec, TreeSpecConfig):
    raise TypeError(f"spec must be a TreeSpecConfig, got {type(spec).__name__}. Fix: "
                    f"spec=TreeSpecConfig(tree, max_new_tokens=...); chains run with "
                    f"speculative_generate and a SpecConfig.")
  check_drafter(cfg, drafter)
  drafter.check_tree(spec.tree)
  check_probe_round(drafter, depth=spec.tree.max_depth)
  if drafter.stops_early:  # a tree's drafts grow to its shape: nothing would read the stop
    raise ValueError("adaptive draft length (a drafter name ending in @P, with_stop) stops "
                     "chains only; a tree grows to its shape. Fix: drop @P, or drop --tree "
                     "(chains: SpecConfig)")
  if spec.tree.widest > cfg.vocab_size:
    raise ValueError(f"tree {spec.tree} asks for {spec.tree.widest} distinct children of a node "
                     f"but the vocabulary has {cfg.vocab_size} tokens. Fix: at most "
                     f"{cfg.vocab_size} children a node (branching, beam or top-k).")


def tree_speculative_generate(params: Params, cfg: Config, drafter: Drafter,
                              prompts: Sequence[Sequence[int]], *, spec: TreeSpecConfig,
                              sampling: SamplingParams = GREEDY, key: Array | int = 0,
                              cache_size: int | None = None,
                              precision: str = "fast", kv: KVPolicy | None = None,
                              draft_kv: KVPolicy | None = None,
                              mesh: Mesh | None = None, _stream: bool = False) -> TreeSpecOutput:
  """Validated, bucketed, jitted tree speculative generation from token-id prompts.

  Example (any drafter grows trees):
    drafter = jspec.drafting.registry.load_drafter("ngram+default", model)
    out = tree_speculative_generate(params, cfg, drafter, [[1, 2, 3]],
                                    spec=TreeSpecConfig("fixed:4-2-2-1", max_new_tokens=64))
    out.sequences(), out.block_efficiency, out.tree_nodes

  precision="exact": full float32 matmuls, for token-identical greedy output on accelerators (see
  jspec.models.numerics). kv: a KV budget for the target (any policy): greedy output equals
  `generate(..., kv=kv)`'s. draft_kv: a key-scored KV budget for the drafter's own
  cache (model drafters; `Drafter.with_kv`); None: a full drafter cache. mesh: a ("dp", "tp")
  mesh, as for `speculative_generate`.
  cache_size: the cache's slots (default: sized for the prompts, max_new_tokens and a round's
  reserve); under kv the target holds kv.slots instead (fewer where the run cannot fill them,
  `KVPolicy.within`), and cache_size sizes only a drafter's own full cache (`generate`, which
  has no drafter, refuses cache_size with kv).
  """
  check_tree_run(cfg, drafter, spec)
  check_kv(cfg, kv)
  check_kv(cfg, draft_kv, "draft_kv")
  check_tree_target(params)
  check_shared_cache(drafter, tree=True)
  k = drafter.probe_masks  # a probing drafter's masks follow every block token
  b = prepare_batch(cfg, prompts, max_new_tokens=spec.max_new_tokens, sampling=sampling, key=key,
                    stop_ids=spec.stop_ids, cache_size=cache_size,
                    reserve=tree_reserve(drafter, spec),
                    reserve_fix="draft a smaller tree",
                    reserve_for=f"the tree's nodes (the root and the {spec.num_nodes} draft "
                                f"nodes of {spec.tree} verified per round"
                                + (f", {k} masks after each" if k else "")
                                + (f", a lookahead window of {drafter.window_size}"
                                   if drafter.window_size else "") + ")")
  placed, b, placement = on_mesh(params, cfg, b, mesh)
  # No row commits more than its prompt, max_new_tokens and a round's reserve.
  entries = b.tokens.shape[1] + spec.max_new_tokens + tree_reserve(drafter, spec)
  kv = None if kv is None else kv.within(entries)
  if draft_kv is not None:
    # A round feeds the last two known tokens and every node it feeds (reserve - 1) to the drafter.
    drafter = drafter.with_kv(draft_kv.within(entries), spec.reserve + 1)
  drafter = place_drafter(drafter, placement, params, placed)
  static = dict(spec=spec, cache_size=b.cache_size, precision=precision, kv=kv,
                placement=placement)
  return run_or_segment((_tree_jit, _start_jit, _resume_jit), placed, cfg, drafter, b, static,
                        lambda state: tree_output(state, spec), _stream)


def tree_speculative_generate_stream(params: Params, cfg: Config, drafter: Drafter,
                                     prompts: Sequence[Sequence[int]], *, every: int = 1,
                                     **kwargs) -> TokenStream:
  """`tree_speculative_generate`, streamed: iterate for each row's new token ids every `every`
  rounds; the stream's `output` is then what `tree_speculative_generate` returns, the same
  tokens (jspec.streaming). Takes `tree_speculative_generate`'s arguments, checked here."""
  run, owners = tree_speculative_generate(params, cfg, drafter, prompts, _stream=True, **kwargs)
  return TokenStream(run, every, owners=owners)
