"""Lookahead decoding (jspec.drafting.lookahead): each window token is one Jacobi step along its
own run of positions and never touches the verified block (a window that sees too much is caught),
a round steps the window and fills the pool as from-scratch forwards say, the pool keeps the G most
recently seen n-grams per first token, shared prefixes are verified once, output stays the
target's (greedy identity, sampled law with a control that must fail), one program, clear errors."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec.decode import prepare_batch
from jspec.drafting.lookahead import (LookaheadDrafter, lookahead_drafter, pool_tree, remember,
                                      window_pattern)
from jspec.drafting.registry import parse_drafter
from jspec.generate import generate
from jspec.models.cache import KVCache
from jspec.models.llama import forward, init_params, lm_head
from jspec.sampling.processing import GREEDY, SamplingParams
from jspec.drafting.ngram import ngram_drafter
from jspec.speculative.chain import SpecConfig, speculative_generate, speculative_loop
from jspec.speculative.probing import causal, window_layout
from jspec.speculative.tree import TreeSpecConfig, tree_speculative_generate, tree_speculative_loop
from jspec.tree.structure import Siblings, path_to, path_tokens
from test_ngram import REPEATING
from test_speculative import (PROMPTS, TARGET, TINY, assert_one_program, chi_square,
                              exact_distribution, own_program, sample_sequences)
from test_tree_engine import sample_codes
from tiny_models import jitted_forward

PROMPT_SET = PROMPTS[:2] + REPEATING[:2]


@pytest.fixture(scope="module")
def target():
  return init_params(TARGET, jax.random.key(0), scale=0.3)


CONTEXT = 32  # _last_logits' contexts, padded (causal: the padding comes after)


@jax.jit
def _causal_logits(params, tokens):
  """A plain causal forward's logits [1, CONTEXT, V] over tokens [1, CONTEXT]: one program for
  every context (op by op, each context length compiled its own ~30 small programs)."""
  return forward(params, TARGET, tokens, jnp.arange(CONTEXT)[None],
                 KVCache.init(TARGET, 1, CONTEXT))[0]


def _last_logits(params, context):
  """The target's next-token logits [V] after `context`, from scratch."""
  padded = jnp.asarray([list(context) + [0] * (CONTEXT - len(context))])
  return _causal_logits(params, padded)[0, len(context) - 1]


def _column_context(window, l, j):
  """What window token (l, j) continues: level 0's columns 0..j, then column j of levels 1..l."""
  return list(window[0, :j + 1]) + [window[m, j] for m in range(1, l + 1)]


@pytest.mark.parametrize("tree", [False, True])
def test_window_tokens_step_along_their_column_and_leave_the_block_exact(target, tree):
  """A block after a 5-token prefix with a 3-level x 3-column window laid out as the engines do:
  the block's logits and KV are those of the block alone, and window token (l, j) holds the
  target's logits after prefix + root + its column run. The control lets every window token see
  all of level 0: a stepping window must see only the columns up to its own."""
  prefix, block = [3, 9, 4, 1, 7], [5, 2, 8, 6]
  T, levels, width = 4, 3, 3
  window = np.asarray([[11, 12, 13], [21, 22, 23], [31, 32, 33]])
  if tree:  # root; nodes 1, 2 children of the root; node 3 a child of node 1
    block_mask = jnp.asarray([[[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]], bool)
    positions = 5 + jnp.asarray([[0, 1, 1, 2]])
  else:
    block_mask, positions = causal(1, T), 5 + jnp.arange(T)[None]
  cache = KVCache.init(TARGET, 1, 32)
  _, _, cache = jitted_forward(target, TARGET, jnp.asarray([prefix]), jnp.arange(5)[None], cache)
  cache = cache.commit(5)
  plain, _, plain_cache = jitted_forward(target, TARGET, jnp.asarray([block]), positions, cache,
                                         block_mask)
  visible, offsets = window_pattern(levels, width)

  def run(visible):
    mask, pos = window_layout(block_mask, positions, visible, offsets)
    tokens = jnp.asarray([block + list(window.reshape(-1))])
    return jitted_forward(target, TARGET, tokens, pos, cache, mask,
                          logits_indices=jnp.arange(T)[None])

  logits, hidden, wide_cache = run(visible)
  np.testing.assert_allclose(np.asarray(logits), np.asarray(plain), atol=1e-4)
  np.testing.assert_allclose(np.asarray(wide_cache.k[:, :, :5 + T]),
                             np.asarray(plain_cache.k[:, :, :5 + T]), atol=1e-4)
  got = np.asarray(lm_head(target, hidden[0, T:]))  # [X, V]
  for l in range(levels):
    for j in range(width):
      want = _last_logits(target, prefix + block[:1] + _column_context(window, l, j))
      np.testing.assert_allclose(got[l * width + j], np.asarray(want), atol=2e-4,
                                 err_msg=str((l, j)))
  level = np.repeat(np.arange(levels), width)
  _, leaky, _ = run(visible | (level[None, :] == 0))
  assert np.abs(np.asarray(lm_head(target, leaky[0, T:])) - got).max() > 1e-3


@pytest.mark.parametrize("engine", ["chain", "tree"])
def test_a_round_steps_the_window_and_pools_its_columns(target, engine):
  """One round (a 2-token budget): the window's newest level is the target's argmax along each
  column of the starting window, placed after the prompt and the first token, the oldest level
  is gone, and the pool holds every column with its new token under the column's first token."""
  prompt, levels, width = PROMPTS[0], 2, 3
  drafter = lookahead_drafter(target, TARGET, width=width, ngram=levels + 1, guesses=4)
  b = prepare_batch(TARGET, [prompt], max_new_tokens=2, sampling=GREEDY, key=0, stop_ids=(),
                    cache_size=None, reserve=16, reserve_for="the block")
  start = drafter.init(b.tokens, b.lengths, 32, None).window[0]  # [levels, W]
  first = generate(target, TARGET, [prompt], max_new_tokens=1).sequences()[0]
  if engine == "chain":
    s = jax.jit(lambda d, t, n, key: speculative_loop(
        target, TARGET, d, t, n, key, b.sampling, spec=SpecConfig(gamma=2, max_new_tokens=2),
        cache_size=b.cache_size))(drafter, b.tokens, b.lengths, b.key)
  else:
    s = jax.jit(lambda d, t, n, key: tree_speculative_loop(
        target, TARGET, d, t, n, key, b.sampling,
        spec=TreeSpecConfig(drafter.own_tree, max_new_tokens=2),
        cache_size=b.cache_size))(drafter, b.tokens, b.lengths, b.key)
  assert int(s.rounds) == 1
  start = np.asarray(start)
  newest = [int(np.argmax(_last_logits(target, prompt + first + _column_context(
      start, levels - 1, j)))) for j in range(width)]
  window = np.asarray(s.draft.window[0])
  assert list(window[-1]) == newest
  np.testing.assert_array_equal(window[:-1], start[1:])
  pool, count = np.asarray(s.draft.pool[0]), np.asarray(s.draft.count[0])
  for j in range(width):
    gram = [int(x) for x in start[1:, j]] + [newest[j]]
    key = int(start[0, j])
    assert gram in [list(pool[key, g]) for g in range(count[key])], (j, key, gram)
  assert count.sum() == len({(int(start[0, j]), tuple(start[1:, j]), newest[j])
                             for j in range(width)})


def test_the_pool_keeps_the_most_recently_seen_ngrams_per_first_token():
  """A stream of n-grams over a 6-token vocabulary, two rows, G = 3: each row's pool equals an
  LRU list per first token (seen again: moved to the newest end; full: the oldest dropped)."""
  B, V, G, D = 2, 6, 3, 2
  rng = np.random.default_rng(0)
  pool, count = jnp.zeros((B, V, G, D), jnp.int32), jnp.zeros((B, V), jnp.int32)
  ref = [{} for _ in range(B)]
  step = jax.jit(remember)
  for _ in range(60):
    first = rng.integers(0, 3, B)  # few keys and few grams: repeats and overflows both happen
    rest = rng.integers(0, 2, (B, D))
    pool, count = step(pool, count, jnp.asarray(first, jnp.int32), jnp.asarray(rest, jnp.int32))
    for b in range(B):
      lst = ref[b].setdefault(int(first[b]), [])
      gram = tuple(int(x) for x in rest[b])
      if gram in lst:
        lst.remove(gram)
      elif len(lst) == G:
        lst.pop(0)
      lst.append(gram)
  for b in range(B):
    for key in range(V):
      held = [tuple(int(x) for x in np.asarray(pool[b, key, g])) for g in range(int(count[b, key]))]
      assert held == ref[b].get(key, []), (b, key)


def test_pooled_ngrams_share_their_prefixes_in_the_tree():
  grams = jnp.asarray([[[5, 6, 7], [5, 6, 8], [5, 9, 1], [2, 3, 4]]])
  tree = pool_tree(grams, jnp.asarray([[True, True, True, False]]), vocab=16)
  assert tree.siblings == Siblings.FIXED
  valid = np.asarray(tree.valid[0])
  assert valid.sum() == 6  # 5, 6, 7, 8, 9, 1: the shared 5 and 5-6 once, the invalid n-gram out
  leaves = set()
  for n in np.flatnonzero(valid):
    path, _ = path_to(tree, jnp.asarray([n]))
    leaves.add(tuple(int(t) for t in np.asarray(path_tokens(tree, path)[0]) if t >= 0))
  assert {p for p in leaves if len(p) == 3} == {(5, 6, 7), (5, 6, 8), (5, 9, 1)}


def test_greedy_identical_to_autoregressive(target):
  """Chains and trees, a ragged batch with repeating rows, two window shapes; the pool finds
  n-grams the target then accepts (tau > 1), so acceptance paths ran."""
  ar = generate(target, TARGET, PROMPT_SET, max_new_tokens=24).sequences()
  for width, ngram, guesses in ((4, 3, 4), (3, 4, 2)):
    drafter = lookahead_drafter(target, TARGET, width, ngram, guesses)
    out = tree_speculative_generate(target, TARGET, drafter, PROMPT_SET,
                                    spec=TreeSpecConfig(drafter.own_tree, max_new_tokens=24))
    assert out.sequences() == ar
    assert out.block_efficiency > 1.0
    out = speculative_generate(target, TARGET, drafter, PROMPT_SET,
                               spec=SpecConfig(gamma=ngram - 1, max_new_tokens=24))
    assert out.sequences() == ar


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class _Seeded(LookaheadDrafter):
  """A pool that starts full (G n-grams under every token), so every round verifies a tree of
  G candidates: the law must hold whatever the pool holds."""

  seeded: str = own_program()

  def init(self, prompt, prompt_lengths, cache_size, features):
    state = super().init(prompt, prompt_lengths, cache_size, features)
    B, V, G, D = state.pool.shape
    v, g, d = np.meshgrid(np.arange(V), np.arange(G), np.arange(D), indexing="ij")
    grams = jnp.asarray((3 * v + 5 * g + 7 * d + 1) % V, jnp.int32)
    return dataclasses.replace(state, pool=jnp.broadcast_to(grams, state.pool.shape),
                               count=jnp.full((B, V), G, jnp.int32))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class _DraftsCalledSampled(_Seeded):
  """The negative control: pooled n-grams verified as if they were i.i.d. draws from a q (the
  tree's q holds none), instead of as deterministic drafts."""

  drafts_called_sampled: str = own_program()

  def draft_tree(self, state, last2, seq_len, key, sampling, shape):
    tree, state = super().draft_tree(state, last2, seq_len, key, sampling, shape)
    return dataclasses.replace(tree, siblings=Siblings.IID), state


# The chain at t1 with top-k and top-p went for the suite's time (the tree and the control run it).
@pytest.mark.parametrize("kind", ["tree", "control", "chain-t0.7-minp"])
def test_sampled_lookahead_follows_the_target_distribution(kind):
  target = init_params(TINY, jax.random.key(10), scale=0.8)
  sp = SamplingParams(temperature=1.0, top_k=8, top_p=0.9)
  if kind == "chain-t0.7-minp":  # another temperature: the pool's guesses drawn at 0.7, min-p on
    kind, sp = "chain", SamplingParams(temperature=0.7, min_p=0.05)
  make = _DraftsCalledSampled if kind == "control" else _Seeded
  drafter = make(head=dataclasses.replace(target, layers=()), cfg=TINY, width=3, ngram=3,
                 guesses=4)
  if kind == "chain":
    codes = sample_sequences(target, drafter, sp, gamma=2)
  else:
    codes = sample_codes(target, drafter, "pool:4,2", sp, 41)
  stat, dof, ok = chi_square(codes, exact_distribution(target, sp))
  assert ok == (kind != "control"), (kind, stat, dof)


def test_one_program_no_recompile(target):
  assert_one_program(target, TARGET, lookahead_drafter(target, TARGET, 3, 4, 2))


@pytest.mark.parametrize("make,match", [
    (lambda t: speculative_generate(t, TARGET, lookahead_drafter(t, TARGET, 3, 3, 2),
                                    PROMPTS[:1], spec=SpecConfig(gamma=3, max_new_tokens=4)),
     "a chain of 3 drafts needs n-grams of 4 tokens"),
    (lambda t: tree_speculative_generate(t, TARGET, lookahead_drafter(t, TARGET, 3, 3, 2),
                                         PROMPTS[:1],
                                         spec=TreeSpecConfig("fixed:2-2", max_new_tokens=4)),
     "verifies its pool's n-grams as tree pool:2,2"),
    (lambda t: tree_speculative_generate(t, TARGET, ngram_drafter(TARGET.vocab_size),
                                         PROMPTS[:1],
                                         spec=TreeSpecConfig("pool:2,2", max_new_tokens=4)),
     "only a drafter that keeps one"),
    (lambda t: ngram_drafter(TARGET.vocab_size, fallback=lookahead_drafter(t, TARGET)),
     "cannot front lookahead decoding"),
    (lambda t: lookahead_drafter(t, TARGET, 0, 3, 2), "window W to be an integer >= 1"),
    (lambda t: lookahead_drafter(t, TARGET, 3, 1, 2), "n-gram size N to be an integer >= 2"),
    (lambda t: parse_drafter("lookahead:5,4,5"), "write lookahead:W-N-G"),
    (lambda t: parse_drafter("lookahead:5-12-5"), "2 <= N <= 9"),
])
def test_bad_settings_are_refused(target, make, match):
  with pytest.raises(ValueError, match=match):
    make(target)


@pytest.mark.parametrize("drafter,tree,match", [
    ("lookahead", "fixed:2-2", "verifies its pool's n-grams as tree pool:2,2"),
    ("lookahead", "pool:3,2", "pool:G,2 with G <= 2"),
    ("ngram", "pool:2,2", "only a drafter that keeps one"),
])
def test_tree_shapes_a_drafter_cannot_grow_are_refused_before_tracing(target, drafter, tree,
                                                                       match):
  """The host-side check of a tree run (no trace, no compile) refuses them."""
  from jspec.speculative.tree import check_tree_run
  made = (lookahead_drafter(target, TARGET, 3, 3, 2) if drafter == "lookahead"
          else ngram_drafter(TARGET.vocab_size))
  with pytest.raises(ValueError, match=match):
    check_tree_run(TARGET, made, TreeSpecConfig(tree, max_new_tokens=4))
  check_tree_run(TARGET, made, TreeSpecConfig(
      "pool:2,2" if drafter == "lookahead" else "fixed:2-2", max_new_tokens=4))
