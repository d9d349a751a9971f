"""Tree speculative decoding as one XLA program.

Prefill target and drafter, then one `lax.while_loop` whose body drafts a token tree of N nodes
below each row's last known token (one drafter forward per depth, jspec.tree.draft schedules),
verifies it with ONE target forward over [root, node_1 .. node_N] under the tree-attention mask
(jspec.sampling.tree_verify), emits the accepted path plus the target's next token, and compacts
the accepted path's KV entries of both caches into consecutive slots (the rest is dropped by
setting lengths). Greedy output equals the target's greedy decoding; sampled output is distributed
exactly as the target's.

Tree shapes (`parse_tree` reads the CLI strings):

  chain:D            a chain of D drafts verified in the tree engine (one child per depth), for
                     comparisons at equal node budget
  fixed:4-2-2-1      branching per depth; top-k children at temperature 0, i.i.d. children
                     (SpecInfer, 2305.09781) when sampling
  specinfer:4-2-2-1  i.i.d. children at every temperature
  rsd-c:4-2-2-1      Gumbel-Top-k children, drawn without replacement (RSD-C, 2402.14160)
  rsd-s:W,D          stochastic beam search, beam W, depth D (RSD-S)
  dynamic:N          EAGLE-2 (2406.16858): expand the best `beam` nodes per depth by their top_k
                     children, keep the N best by cumulative draft probability. `dynamic:N` picks
                     depth = clip(ceil(log2 N), 2, 8) and beam = top_k = clip(round(sqrt N), 2, 10)
                     (N = 60: depth 6, beam = top_k = 8, near the paper's 6 / 10 / 60);
                     `dynamic:N,D,B,K` sets depth D, beam B and top_k K.

Slot layout of a round, for a row that knows seq_len tokens (the target cache holds seq_len - 1):
the target writes the root (the last known token) at slot seq_len - 1 and node n at slot
seq_len + n; the drafter re-feeds the last two known tokens at seq_len - 2, seq_len - 1 and writes
the nodes it expands at seq_len + 0, 1, ... After verification accepting path[0 .. n-1], slot
seq_len + j receives the entry of path[j] in both caches.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import jax
import jax.numpy as jnp

from jspec.generate import prepare_batch
from jspec.models.cache import move_kv
from jspec.models.config import Config
from jspec.models.llama import Params, forward
from jspec.sampling.processing import GREEDY, SamplingParams
from jspec.sampling.tree_verify import emitted_tokens, verify_tree
from jspec.spec.engine import SpecOutput, SpecState, advance, check_vocab, initial_state
from jspec.tree.draft import draft_dynamic, draft_fixed, draft_stochastic_beam, fixed_tree_size
from jspec.tree.structure import Siblings, Tree, ancestor_mask
from jspec.tree.structure import positions as node_positions

Array = jax.Array


# ------------------------------------------------------------------------------------------------
# Tree shapes: static and hashable. Each has `method`, `num_nodes` (N), `max_depth` (D), `fed_nodes`
# (nodes the drafter feeds per round: those it expands), `widest` (most distinct children asked of
# one node), `greedy_variant` (drafts differently at temperature 0), `reindexes` (nodes are
# re-indexed after drafting) and `draft(key, next_logits, batch, vocab, sampling, *, greedy)`,
# one jspec.tree.draft schedule.


def _positive_ints(name: str, values: tuple) -> None:
  if not values or any(not isinstance(v, int) or isinstance(v, bool) or v < 1 for v in values):
    raise ValueError(f"{name} must be integers >= 1, got {values!r}")


_BRANCHING_SIBLINGS = {"fixed": Siblings.IID, "specinfer": Siblings.IID,
                       "rsd-c": Siblings.WITHOUT_REPLACEMENT, "chain": Siblings.IID}


@dataclasses.dataclass(frozen=True)
class BranchingTree:
  """Every node at depth d - 1 gets branching[d - 1] children ("fixed", "specinfer", "rsd-c";
  "chain" is branching 1 at every depth, the chain as a tree of the same budget)."""

  method: str
  branching: tuple[int, ...]
  reindexes = False  # the n-th node is the n-th the drafter feeds

  def __post_init__(self):
    if self.method not in _BRANCHING_SIBLINGS:
      raise ValueError(f"a branching tree's method must be one of {sorted(_BRANCHING_SIBLINGS)}, "
                       f"got {self.method!r}")
    object.__setattr__(self, "branching", tuple(self.branching))
    _positive_ints(f"{self.method} branching factors", self.branching)
    if self.method == "chain" and set(self.branching) != {1}:
      raise ValueError(f"a chain has one child per depth, got branching {self.branching}; "
                       f"write chain:D or a tree method (specinfer:, rsd-c:)")

  @property
  def num_nodes(self) -> int:
    return fixed_tree_size(self.branching)

  @property
  def max_depth(self) -> int:
    return len(self.branching)

  @property
  def fed_nodes(self) -> int:
    return fixed_tree_size(self.branching[:-1])  # all but the deepest layer

  @property
  def widest(self) -> int:
    return max(self.branching)

  @property
  def greedy_variant(self) -> bool:
    return self.method == "fixed"  # top-k children at temperature 0

  def draft(self, key, next_logits, batch, vocab, sampling, *, greedy: bool) -> Tree:
    siblings = _BRANCHING_SIBLINGS[self.method]
    tree = draft_fixed(key, next_logits, batch, vocab, self.branching, sampling,
                       Siblings.FIXED if greedy else siblings)
    return dataclasses.replace(tree, siblings=siblings)  # greedy verification ignores the label

  def __str__(self) -> str:
    if self.method == "chain":
      return f"chain:{len(self.branching)}"
    return f"{self.method}:" + "-".join(map(str, self.branching))


@dataclasses.dataclass(frozen=True)
class BeamTree:
  """RSD-S: stochastic beam search, `beam` sequences drafted without replacement to `depth`."""

  beam: int
  depth: int
  method = "rsd-s"
  greedy_variant = False
  reindexes = False  # layer d holds nodes [(d-1) * beam, d * beam), fed in that order

  def __post_init__(self):
    _positive_ints("rsd-s beam and depth", (self.beam, self.depth))

  @property
  def num_nodes(self) -> int:
    return self.beam * self.depth

  @property
  def max_depth(self) -> int:
    return self.depth

  @property
  def fed_nodes(self) -> int:
    return self.beam * (self.depth - 1)

  @property
  def widest(self) -> int:
    return self.beam

  def draft(self, key, next_logits, batch, vocab, sampling, *, greedy: bool) -> Tree:
    return draft_stochastic_beam(key, next_logits, batch, vocab, depth=self.depth, beam=self.beam,
                                 sampling=sampling)

  def __str__(self) -> str:
    return f"rsd-s:{self.beam},{self.depth}"


@dataclasses.dataclass(frozen=True)
class DynamicTree:
  """EAGLE-2: per depth expand the `beam` best newest nodes by `top_k` children each, then keep
  the `budget` best nodes by cumulative draft log-probability."""

  budget: int
  depth: int
  beam: int
  top_k: int
  method = "dynamic"
  greedy_variant = False
  reindexes = True  # pruned to the budget after drafting

  def __post_init__(self):
    _positive_ints("dynamic budget, depth, beam and top_k",
                   (self.budget, self.depth, self.beam, self.top_k))
    drafted = sum(self._layer_sizes())
    if self.budget > drafted:
      raise ValueError(f"dynamic tree budget {self.budget} exceeds the {drafted} nodes that "
                       f"depth {self.depth}, beam {self.beam}, top_k {self.top_k} draft")

  @classmethod
  def from_budget(cls, budget: int) -> "DynamicTree":
    """Defaults from the budget N: depth clip(ceil(log2 N), 2, 8), beam = top_k =
    clip(round(sqrt N), 2, 10)."""
    _positive_ints("dynamic budget", (budget,))
    width = min(10, max(2, round(math.sqrt(budget))))
    return cls(budget, min(8, max(2, math.ceil(math.log2(budget)))), width, width)

  def _layer_sizes(self) -> list[int]:
    sizes = [self.top_k]  # as jspec.tree.draft.draft_dynamic lays them out
    for _ in range(self.depth - 1):
      sizes.append(min(self.beam, sizes[-1]) * self.top_k)
    return sizes

  @property
  def num_nodes(self) -> int:
    return self.budget

  @property
  def max_depth(self) -> int:
    return self.depth

  @property
  def fed_nodes(self) -> int:
    return sum(min(self.beam, s) for s in self._layer_sizes()[:-1])

  @property
  def widest(self) -> int:
    return self.top_k

  def draft(self, key, next_logits, batch, vocab, sampling, *, greedy: bool) -> Tree:
    return draft_dynamic(next_logits, batch, vocab, depth=self.depth, beam=self.beam,
                         top_k=self.top_k, budget=self.budget, sampling=sampling)

  def __str__(self) -> str:
    return f"dynamic:{self.budget},{self.depth},{self.beam},{self.top_k}"


TreeShape = BranchingTree | BeamTree | DynamicTree
TREE_HELP = ("chain:D, fixed:B1-B2-..., specinfer:B1-B2-..., rsd-c:B1-B2-... (children per depth), "
             "rsd-s:W,D (beam, depth), dynamic:N or dynamic:N,DEPTH,BEAM,TOP_K (node budget)")


def parse_tree(spec: str) -> TreeShape:
  """A tree shape from its CLI string, e.g. "fixed:4-2-2-1", "rsd-s:4,4", "dynamic:60"."""
  method, sep, args = str(spec).strip().partition(":")
  method = method.lower()

  def ints(sep_char: str) -> tuple[int, ...]:
    parts = args.split(sep_char)
    if not all(p.strip().isdigit() for p in parts):
      raise ValueError(f"tree {spec!r}: expected integers separated by {sep_char!r} after "
                       f"'{method}:', got {args!r}; tree specs: {TREE_HELP}")
    return tuple(int(p) for p in parts)

  if not sep or not args:
    raise ValueError(f"tree {spec!r} has no shape; expected one of: {TREE_HELP}")
  if method == "chain":
    depth = ints(",")
    if len(depth) != 1:
      raise ValueError(f"tree {spec!r}: chain takes one depth D, e.g. chain:4")
    return BranchingTree("chain", (1,) * depth[0])
  if method in _BRANCHING_SIBLINGS:
    return BranchingTree(method, ints("-"))
  if method == "rsd-s":
    shape = ints(",")
    if len(shape) != 2:
      raise ValueError(f"tree {spec!r}: rsd-s takes W,D (beam width, depth), e.g. rsd-s:4,4")
    return BeamTree(*shape)
  if method == "dynamic":
    shape = ints(",")
    if len(shape) == 1:
      return DynamicTree.from_budget(shape[0])
    if len(shape) != 4:
      raise ValueError(f"tree {spec!r}: dynamic takes N or N,DEPTH,BEAM,TOP_K, e.g. dynamic:60")
    return DynamicTree(*shape)
  raise ValueError(f"unknown tree method {method!r} in {spec!r}; expected one of: {TREE_HELP}")


def parse_trees(text: str) -> list[TreeShape]:
  """Tree shapes from a comma-separated list; a part without ':' continues the previous spec, so
  "fixed:4-2-2-1,rsd-s:4,4,dynamic:60" holds three trees."""
  specs: list[str] = []
  for part in str(text).split(","):
    if ":" in part or not specs:
      specs.append(part)
    else:
      specs[-1] += "," + part
  return [parse_tree(s) for s in specs]


@dataclasses.dataclass(frozen=True)
class TreeSpecConfig:
  """Static settings of a tree speculative run; `tree` is a shape or its string (parse_tree)."""

  tree: TreeShape | str
  max_new_tokens: int
  stop_ids: tuple[int, ...] = ()

  def __post_init__(self):
    if isinstance(self.tree, str):
      object.__setattr__(self, "tree", parse_tree(self.tree))
    if not isinstance(self.tree, (BranchingTree, BeamTree, DynamicTree)):
      raise ValueError(f"tree must be a tree spec string ({TREE_HELP}) or a shape from "
                       f"parse_tree, got {self.tree!r}")
    if int(self.max_new_tokens) != self.max_new_tokens or self.max_new_tokens < 1:
      raise ValueError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens}")
    object.__setattr__(self, "stop_ids", tuple(int(s) for s in self.stop_ids))

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


# ------------------------------------------------------------------------------------------------
# The engine.


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TreeSpecOutput(SpecOutput):
  """SpecOutput of a tree run: accept_hist [D + 1] counts rounds by accepted depth, accepted_at
  [D] how often depth d + 1 was reached; `draft_calls` holds (one drafter forward per depth)."""

  tree_nodes: int = dataclasses.field(metadata=dict(static=True))  # N + 1, static


def verification_mask(tree: Tree) -> Array:
  """[B, N + 1, N + 1] bool over [root, nodes]: everyone sees the root, nodes their ancestors."""
  B, N = tree.tokens.shape
  mask = jnp.zeros((B, N + 1, N + 1), bool).at[:, :, 0].set(True)
  return mask.at[:, 1:, 1:].set(ancestor_mask(tree))


def tree_round(params: Params, cfg: Config, drafter, s: SpecState, k_draft: Array,
               k_verify: Array, sampling: SamplingParams, shape: TreeShape):
  """One round's draft and verification from loop state `s`, nothing advanced: returns the tree,
  the drafter's round state, the target cache holding the tree's KV, the accepted path [B, D],
  its length n_acc [B] and the target's next token [B]."""
  tree, drafted = drafter.draft_tree(s.draft, s.last2, s.seq_len, k_draft, sampling, shape)
  # Verify [root, node_1 .. node_N] in one forward; the cache holds everything before the root.
  block = jnp.concatenate([s.last2[:, 1:], tree.tokens], axis=1)  # [B, N + 1]
  start = s.seq_len - 1
  positions = jnp.concatenate([start[:, None], node_positions(tree, s.seq_len)], axis=1)
  target_logits, _, cache = forward(params, cfg, block, positions, s.cache.with_lengths(start),
                                    verification_mask(tree))  # [B, N + 1, V]
  path, n_acc, nxt = verify_tree(k_verify, tree, target_logits, sampling)  # [B, D], [B], [B]
  return tree, drafted, cache, path, n_acc, nxt


def tree_speculative_loop(params: Params, cfg: Config, drafter, prompt: Array,
                          prompt_lengths: Array, key: Array, sampling: SamplingParams = GREEDY,
                          *, spec: TreeSpecConfig, cache_size: int) -> SpecState:
  """The whole run, returning the final loop state (caches included); see the module docstring."""
  shape = spec.tree
  state = initial_state(params, cfg, drafter, prompt, prompt_lengths, key, sampling, spec,
                        cache_size, max_accepted=shape.max_depth)

  def body(s: SpecState) -> SpecState:
    key, k_draft, k_verify = jax.random.split(s.key, 3)
    tree, drafted, cache, path, n_acc, nxt = tree_round(params, cfg, drafter, s, k_draft,
                                                        k_verify, sampling, shape)

    # Emitted this round: the accepted path, then the target's token.
    emitted = emitted_tokens(tree, path, n_acc, nxt)  # [B, D + 1], valid up to index n_acc
    # The accepted path's KV into consecutive slots: node path[j] (slot seq_len + path[j]) moves
    # to seq_len + j. A row cut short by a stop or the budget is done: its cache no longer matters.
    cache = move_kv(cache, s.seq_len, path, n_acc)
    return advance(s, emitted, n_acc, spec, key=key, cache=cache,
                   draft=lambda _: drafter.accept_tree(drafted, path, n_acc, s.seq_len))

  return jax.lax.while_loop(lambda s: ~jnp.all(s.done), body, state)


def tree_speculative_generate_tokens(params: Params, cfg: Config, drafter, prompt: Array,
                                     prompt_lengths: Array, key: Array,
                                     sampling: SamplingParams = GREEDY, *, spec: TreeSpecConfig,
                                     cache_size: int) -> TreeSpecOutput:
  """Pure, jit-friendly tree speculative generation; `cfg`, `spec` and `cache_size` are static.

  prompt [B, P] int32 right-padded, prompt_lengths [B]; the drafter implements draft_tree /
  accept_tree (ModelDrafter). Needs cache_size >= max(prompt_lengths) + max_new_tokens +
  spec.reserve.
  """
  s = tree_speculative_loop(params, cfg, drafter, prompt, prompt_lengths, key, sampling,
                            spec=spec, cache_size=cache_size)
  return TreeSpecOutput(
      tokens=s.tokens[:, :spec.max_new_tokens], lengths=s.lengths, rounds=s.rounds,
      round_tokens=s.round_tokens, row_rounds=s.row_rounds, accept_hist=s.accept_hist,
      accepted_at=s.accepted_at, tree_nodes=spec.tree_nodes)


_tree_jit = jax.jit(tree_speculative_generate_tokens, static_argnums=(1,),
                    static_argnames=("spec", "cache_size"))


def check_tree_run(cfg: Config, drafter, spec: TreeSpecConfig) -> None:
  """Host-side checks of a tree run's drafter and shape against the target config."""
  if not isinstance(spec, TreeSpecConfig):
    raise ValueError(f"spec must be a TreeSpecConfig, got {type(spec).__name__}")
  if not (hasattr(drafter, "draft_tree") and hasattr(drafter, "accept_tree")):
    raise ValueError(f"tree speculative decoding needs a drafter with draft_tree/accept_tree "
                     f"(a ModelDrafter), got {type(drafter).__name__}")
  check_vocab(cfg, drafter)
  if spec.tree.widest > cfg.vocab_size:
    raise ValueError(f"tree {spec.tree} asks for {spec.tree.widest} distinct children of a node "
                     f"but the vocabulary has {cfg.vocab_size} tokens")


def tree_speculative_generate(params: Params, cfg: Config, drafter,
                              prompts: Sequence[Sequence[int]], *, spec: TreeSpecConfig,
                              sampling: SamplingParams = GREEDY, key: Array | int = 0,
                              cache_size: int | None = None) -> TreeSpecOutput:
  """Validated, bucketed, jitted tree speculative generation from token-id prompts.

  Example:
    drafter = ModelDrafter(draft_params, draft_cfg)
    out = tree_speculative_generate(params, cfg, drafter, [[1, 2, 3]],
                                    spec=TreeSpecConfig("fixed:4-2-2-1", max_new_tokens=64))
    out.sequences(), out.block_efficiency, out.tree_nodes
  """
  check_tree_run(cfg, drafter, spec)
  b = prepare_batch(cfg, prompts, max_new_tokens=spec.max_new_tokens, sampling=sampling, key=key,
                    stop_ids=spec.stop_ids, cache_size=cache_size, reserve=spec.reserve,
                    reserve_for=f"tree_nodes (the root and the {spec.num_nodes} draft nodes "
                                f"of {spec.tree} verified per round)")
  return _tree_jit(params, cfg, drafter, b.tokens, b.lengths, b.key, b.sampling, spec=spec,
                   cache_size=b.cache_size)
