"""Paired block efficiency: every tree shape measured on the same contexts.

`jspec bench` decodes each prompt with each tree; at temperature 1 the texts diverge after the
first round, so two trees' tau differ by the method AND by the contexts they happened to visit
(standard error ~0.04 at a few hundred rounds, as large as the effects being compared). Here the
contexts are fixed: the target's own sampled responses to the prompts, cut after every `stride`-th
token. Each context is prefilled once per tree, then `rounds` independent draft + verify rounds run
from it (nothing advanced), so every shape is scored on identical contexts and their difference is
measured pairwise, context by context.

The quantity is the expected tokens per round, E[accepted + 1], averaged over the positions of
the target's own text (uniformly: every `stride`-th context weighs alike). The engine's tau is
another average of the same per-round law: generated tokens over rounds, where a round that
accepts much covers many positions and starts few rounds, so contexts weigh by how often a round
starts there (about a harmonic mean). Differences between shapes measured here are valid; a
bench-tau number next to a `jspec bench` block efficiency is not a like-for-like comparison.
A context whose first sampled token is a stop id starts no round in the engine: it is left out
(its per-context tau is None), so the rounds scored are rounds decoding would run.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from jspec.decode import is_stop, pad_prompts, plan_cache, stop_id_tuple
from jspec.kv.policy import KVPolicy
from jspec.model import Model
from jspec.models.config import Config
from jspec.models.llama import Params
from jspec.sampling.processing import SamplingParams
from jspec.speculative.loop import budgeted_slots, eviction_cut, initial_state
from jspec.speculative.tree import TreeSpecConfig, check_tree_run, tree_reserve, tree_round
from jspec.tree.shapes import TreeShape

Array = jax.Array


def round_acceptance(params: Params, cfg: Config, drafter, prompt: Array, prompt_lengths: Array,
                     key: Array, sampling: SamplingParams, *, shape: TreeShape, cache_size: int,
                     rounds: int, kv: KVPolicy | None = None,
                     stop_ids: tuple[int, ...] = ()) -> Array:
  """Accepted drafts [rounds, B] of `rounds` independent rounds of `shape` from each prompt;
  -1 in every round of a row whose first token is one of `stop_ids` (the engine ends there).

  Target and drafter prefill the prompt and the target samples one token (as the engine's first
  step, from `key`'s first split: equal keys give equal contexts across shapes); every round then
  drafts and verifies from that same state with its own key.

  kv: the target under a KV budget, as the tree engine runs it (chunked prefill evicting to the
  budget, attention-score policies fed by the verification's committed queries). A round counts
  what the engine would emit: drafts past the next eviction are not used (the engine's cut), so a
  cadence below the tree's depth caps a round at it from a prompt that filled the budget.
  """
  spec = TreeSpecConfig(shape, max_new_tokens=1)
  k_start, k_rounds = jax.random.split(key)
  state = initial_state(params, cfg, drafter, prompt, prompt_lengths, k_start, sampling, spec,
                        cache_size, max_accepted=shape.max_depth,
                        reserve=tree_reserve(drafter, spec), kv=kv,
                        target_slots=budgeted_slots(kv, drafter, spec.num_nodes + 1))

  def one_round(k: Array) -> Array:
    k_draft, k_verify = jax.random.split(k)
    n_acc = tree_round(params, cfg, drafter, state, k_draft, k_verify, sampling, shape, kv).n_acc
    if kv is None:
      return n_acc
    return jnp.minimum(n_acc, eviction_cut(kv, state.cache.lengths))

  n_acc = jax.lax.map(one_round, jax.random.split(k_rounds, rounds))  # [rounds, B]
  return jnp.where(is_stop(state.tokens[:, 0], stop_ids)[None], -1, n_acc)


_round_acceptance_jit = jax.jit(round_acceptance, static_argnums=(1,),
                                static_argnames=("shape", "cache_size", "rounds", "kv",
                                                 "stop_ids"))


def contexts_from_responses(prompts: Sequence[Sequence[int]],
                            responses: Sequence[Sequence[int]], stride: int) -> list[list[int]]:
  """prompt + response[:t] for t = 0, stride, 2 * stride, ... < len(response), every prompt."""
  if len(prompts) != len(responses):
    raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
  return [list(prompts[i]) + list(responses[i][:t]) for i, t in _cuts(responses, stride)]


def context_groups(responses: Sequence[Sequence[int]], stride: int) -> list[int]:
  """The response (prompt) index of each of `contexts_from_responses`' contexts, in its order:
  contexts cut from one response are correlated, so standard errors cluster by it."""
  return [i for i, _ in _cuts(responses, stride)]


def _cuts(responses: Sequence[Sequence[int]], stride: int) -> list[tuple[int, int]]:
  """(response index, tokens of it kept) of every context, in order."""
  if stride < 1:
    raise ValueError(f"stride must be a positive integer, got {stride}")
  return [(i, t) for i, r in enumerate(responses) for t in range(0, max(len(r), 1), stride)]


def clustered_se(v: np.ndarray, groups: np.ndarray) -> float:
  """Standard error of v's mean with values of one group correlated (the cluster-robust
  estimator, G / (G - 1) small-sample factor): var(ddof=1) / n when every value is its own group."""
  labels, index = np.unique(groups, return_inverse=True)
  G = len(labels)
  if G < 2:
    return 0.0
  sums = np.bincount(index, weights=v - v.mean(), minlength=G)
  return float(math.sqrt(G / (G - 1) * (sums ** 2).sum()) / len(v))


@dataclasses.dataclass
class PairedResult:
  """Accepted drafts per (shape, context, round): n_acc [S, C, R]; -1 for a context that starts
  no round (its first token a stop id: the same contexts for every shape, the target's token)."""

  shapes: list[TreeShape]
  n_acc: np.ndarray  # [S, C, R]
  groups: np.ndarray | None = None  # [C]: the response each context was cut from (default: its own)

  @property
  def scored(self) -> np.ndarray:
    """Contexts a round starts from, [C] bool."""
    return (self.n_acc >= 0).all(axis=(0, 2))

  def per_context_tau(self) -> np.ndarray:
    """[S, C]; NaN where no round starts."""
    return np.where(self.scored, self.n_acc.mean(axis=2) + 1.0, np.nan)

  def records(self) -> list[dict]:
    """One record per shape (tau with its standard error over contexts, clustered by response),
    then one per pair of shapes with the same node budget (the paired difference of their tau
    and its error)."""
    full = self.per_context_tau()
    keep = self.scored
    x = full[:, keep]
    C = x.shape[1]
    groups = (np.arange(full.shape[1]) if self.groups is None else np.asarray(self.groups))[keep]
    se = lambda v: clustered_se(v, groups)
    out = []
    for s, shape in enumerate(self.shapes):
      D = shape.max_depth
      hist = np.bincount(self.n_acc[s][keep].ravel(), minlength=D + 1)[:D + 1]
      out.append({"kind": "paired_tau", "tree": str(shape), "method": shape.method,
                  "tree_nodes": shape.num_nodes + 1, "num_nodes": shape.num_nodes,
                  "tau": float(x[s].mean()) if C else None, "tau_se": se(x[s]),
                  "contexts": C, "contexts_at_stop": int((~keep).sum()),
                  "responses": int(len(np.unique(groups))),
                  "rounds_per_context": int(self.n_acc.shape[2]),
                  "accept_hist": hist.tolist(),
                  # per context, in order: two runs on the same contexts (another budget, say)
                  # pair context by context from their records
                  "per_context_tau": [None if np.isnan(t) else round(float(t), 4)
                                      for t in full[s]]})
    for a in range(len(self.shapes)):
      for b in range(a + 1, len(self.shapes)):
        if self.shapes[a].num_nodes != self.shapes[b].num_nodes:
          continue
        d = x[a] - x[b]
        out.append({"kind": "paired_difference", "tree_a": str(self.shapes[a]),
                    "tree_b": str(self.shapes[b]), "num_nodes": self.shapes[a].num_nodes,
                    "tau_a_minus_b": float(d.mean()) if C else None, "se": se(d),
                    "z": float(d.mean() / se(d)) if C and se(d) > 0 else None})
    return out


def paired_tau(params: Params, cfg: Config, drafter, contexts: Sequence[Sequence[int]],
               shapes: Sequence[TreeShape], *, sampling: SamplingParams, seed: int = 0,
               rounds: int = 8, batch: int = 16, progress: bool = True,
               kv: KVPolicy | None = None, draft_kv: KVPolicy | None = None,
               stop_ids: Sequence[int] = (),
               groups: Sequence[int] | None = None) -> PairedResult:
  """Score every shape on the same contexts: n_acc [S, C, R].

  All contexts are padded to one prompt bucket (one compiled program per shape); batches of
  `batch` contexts, the last one padded with repeats of the first context (dropped after).
  kv: the target under this KV budget (`round_acceptance`); draft_kv: a model drafter's own
  cache under this one (`Drafter.with_kv`). The same contexts and keys with and without them, so
  runs that differ only in the budget are paired too.
  stop_ids: the ids that end decoding (the chat's): a context whose first sampled token is one
  starts no round in the engine, and is left out of every shape's score.
  groups: the response each context was cut from (`context_groups`), for the standard errors.
  """
  if not shapes:
    raise ValueError("paired_tau needs at least one tree shape")
  if not contexts:
    raise ValueError("paired_tau needs at least one context")
  if groups is not None and len(groups) != len(contexts):
    raise ValueError(f"{len(groups)} groups for {len(contexts)} contexts: give one per context")
  if int(rounds) != rounds or rounds < 1 or int(batch) != batch or batch < 1:
    raise ValueError(f"rounds and batch must be positive integers, got {rounds}, {batch}")
  if drafter.window_size:  # its pool starts empty in every context's first round: tau 1 always
    raise ValueError("bench-tau scores rounds from a prefill, where lookahead's n-gram pool is "
                     "still empty (every tree empty, tau exactly 1). Fix: measure lookahead "
                     "with jspec bench")
  sampling.require_uniform("jspec bench-tau").validate()
  if float(sampling.presence_penalty) or float(sampling.frequency_penalty):
    raise ValueError("bench-tau scores rounds from contexts of prompt + response prefix, all read "
                     "as prompt, while presence and frequency penalties count generated tokens "
                     "only: its target would not be the one decoding runs. Fix: drop them here "
                     "(repetition_penalty, which counts the prompt too, is fine), or measure tau "
                     "with jspec bench")
  reserve = max(tree_reserve(drafter, TreeSpecConfig(s, max_new_tokens=1)) for s in shapes)
  longest = max(len(c) for c in contexts)
  if longest + 1 + reserve > cfg.max_position_embeddings:
    # The engines commit no draft past max_new_tokens; a round here counts every node it accepts.
    raise ValueError(f"a context of {longest} tokens + 1 + {reserve} slots reserved for the "
                     f"largest tree's nodes reaches past the model's max_position_embeddings="
                     f"{cfg.max_position_embeddings}, and bench-tau counts every node's "
                     f"acceptance. Fix: shorter contexts, or draft a smaller tree.")
  if draft_kv is not None:
    if kv is None:
      raise ValueError("draft_kv budgets the drafter beside a budgeted target: give kv too")
    drafter = drafter.with_kv(draft_kv, reserve + 1)
  for s in shapes:
    check_tree_run(cfg, drafter, TreeSpecConfig(s, max_new_tokens=1))
  bucket, cache_size = plan_cache(cfg, [len(c) for c in contexts], 1, None, reserve,
                                  "the largest tree's nodes", "draft a smaller tree")
  C = len(contexts)
  padded = list(contexts) + [contexts[0]] * (-C % batch)
  tokens, lengths = pad_prompts(padded, cfg.vocab_size, bucket)
  sampling_arrays = sampling.as_arrays()
  stops = stop_id_tuple(stop_ids)
  base = jax.random.key(seed)
  n_acc = np.zeros((len(shapes), len(padded), rounds), np.int32)
  bar = tqdm(total=len(shapes) * len(padded) // batch, desc="paired tau", disable=not progress)
  for s, shape in enumerate(shapes):
    for i in range(0, len(padded), batch):
      key = jax.random.fold_in(base, i)  # the same contexts and keys for every shape
      out = _round_acceptance_jit(params, cfg, drafter, jnp.asarray(tokens[i:i + batch]),
                                  jnp.asarray(lengths[i:i + batch]), key, sampling_arrays,
                                  shape=shape, cache_size=cache_size, rounds=rounds, kv=kv,
                                  stop_ids=stops)
      n_acc[s, i:i + batch] = np.asarray(out).T
      bar.update(1)
    jax.clear_caches()  # one program per shape: drop it (LLVM memory maps, see jspec bench)
  bar.close()
  return PairedResult(list(shapes), n_acc[:, :C],
                      None if groups is None else np.asarray(groups, np.int64))


def target_responses(model: Model, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
                     sampling: SamplingParams, seed: int) -> list[list[int]]:
  """The target's own responses (autoregressive, stop at the chat's stop ids), one per prompt."""
  return [model.generate_ids([p], max_new_tokens=max_new_tokens, sampling=sampling,
                             key=seed + i).sequences()[0] for i, p in enumerate(prompts)]
