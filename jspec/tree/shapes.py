"""Static token-tree shapes: what a tree drafter grows each round.

`parse_tree` reads the CLI strings:

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
  pool:G,D           up to G n-grams of D tokens from a drafter's n-gram pool (lookahead
                     decoding), merged into one tree; only such a drafter grows it

Each shape is static and hashable and has `method`, `num_nodes` (N), `max_depth` (D), `fed_nodes`
(nodes the drafter feeds per round: those it expands), `widest` (most distinct children asked of
one node), `greedy_variant` (drafts differently at temperature 0), `reindexes` (nodes are
re-indexed after drafting) and `draft(key, next_logits, batch, vocab, sampling, *, greedy)`, one
jspec.tree.draft schedule.
"""

from __future__ import annotations

import dataclasses
import math

from jax import Array

from jspec.tree.draft import draft_dynamic, draft_fixed, draft_stochastic_beam, fixed_tree_size
from jspec.tree.structure import Siblings, Tree

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

  def draft(self, key, next_logits, batch, vocab, sampling, *, greedy: bool | Array) -> Tree:
    """greedy: a Python bool, or one per row [B] (greedy rows beside sampled ones)."""
    siblings = _BRANCHING_SIBLINGS[self.method]
    rows = None if isinstance(greedy, bool) else greedy
    tree = draft_fixed(key, next_logits, batch, vocab, self.branching, sampling,
                       Siblings.FIXED if greedy is True else siblings, greedy_rows=rows)
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


@dataclasses.dataclass(frozen=True)
class PoolTree:
  """Up to `candidates` n-grams of `depth` tokens that follow the root, taken from a drafter's
  n-gram pool (lookahead decoding, jspec.drafting.lookahead) and merged into one tree: a drafter
  that keeps such a pool draws it in its own `draft_tree`; no frontier is scored."""

  candidates: int
  depth: int
  method = "pool"
  greedy_variant = False
  reindexes = True  # shared prefixes are merged after the n-grams are laid out

  def __post_init__(self):
    _positive_ints("pool candidates and depth", (self.candidates, self.depth))

  @property
  def num_nodes(self) -> int:
    return self.candidates * self.depth

  @property
  def max_depth(self) -> int:
    return self.depth

  @property
  def fed_nodes(self) -> int:
    return 0

  @property
  def widest(self) -> int:
    return self.candidates

  def draft(self, key, next_logits, batch, vocab, sampling, *, greedy: bool) -> Tree:
    raise ValueError(f"tree {self} holds n-grams from a pool: only a drafter that keeps one "
                     f"(--drafter lookahead) drafts it")

  def __str__(self) -> str:
    return f"pool:{self.candidates},{self.depth}"


TreeShape = BranchingTree | BeamTree | DynamicTree | PoolTree
TREE_HELP = ("chain:D, fixed:B1-B2-..., specinfer:B1-B2-..., rsd-c:B1-B2-... (children per depth), "
             "rsd-s:W,D (beam, depth), dynamic:N or dynamic:N,DEPTH,BEAM,TOP_K (node budget), "
             "pool:G,D (G n-grams of D tokens: --drafter lookahead)")


def parse_tree(text: str) -> TreeShape:
  """A tree shape from its CLI string, e.g. "fixed:4-2-2-1", "rsd-s:4,4", "dynamic:60"."""
  try:
    return _parse_tree(text)
  except ValueError as e:  # a shape's own check names its numbers; say which string gave them
    if repr(str(text)) in str(e):
      raise
    raise ValueError(f"tree {str(text)!r}: {e}") from None


def _parse_tree(text: str) -> TreeShape:
  method, sep, args = str(text).strip().partition(":")
  method = method.lower()

  def ints(sep_char: str) -> tuple[int, ...]:
    parts = args.split(sep_char)
    if not all(p.strip().isdigit() for p in parts):
      raise ValueError(f"tree {text!r}: expected integers separated by {sep_char!r} after "
                       f"'{method}:', got {args!r}; tree shapes: {TREE_HELP}")
    return tuple(int(p) for p in parts)

  if not sep or not args:
    raise ValueError(f"tree {text!r} has no shape; expected one of: {TREE_HELP}")
  if method == "chain":
    depth = ints(",")
    if len(depth) != 1 or depth[0] < 1:
      raise ValueError(f"tree {text!r}: chain takes one depth D >= 1, e.g. chain:4")
    return BranchingTree("chain", (1,) * depth[0])
  if method in _BRANCHING_SIBLINGS:
    return BranchingTree(method, ints("-"))
  if method == "rsd-s":
    shape = ints(",")
    if len(shape) != 2:
      raise ValueError(f"tree {text!r}: rsd-s takes W,D (beam width, depth), e.g. rsd-s:4,4")
    return BeamTree(*shape)
  if method == "dynamic":
    shape = ints(",")
    if len(shape) == 1:
      return DynamicTree.from_budget(shape[0])
    if len(shape) != 4:
      raise ValueError(f"tree {text!r}: dynamic takes N or N,DEPTH,BEAM,TOP_K, e.g. dynamic:60")
    return DynamicTree(*shape)
  if method == "pool":
    shape = ints(",")
    if len(shape) != 2:
      raise ValueError(f"tree {text!r}: pool takes G,D (n-grams, their length), e.g. pool:5,3")
    return PoolTree(*shape)
  raise ValueError(f"unknown tree method {method!r} in {text!r}; expected one of: {TREE_HELP}")


def parse_trees(text: str) -> list[TreeShape]:
  """Tree shapes from a comma-separated list; a part without ':' continues the previous shape, so
  "fixed:4-2-2-1,rsd-s:4,4,dynamic:60" holds three trees."""
  shapes: list[str] = []
  for part in str(text).split(","):
    if ":" in part or not shapes:
      shapes.append(part)
    else:
      shapes[-1] += "," + part
  return [parse_tree(s) for s in shapes]
