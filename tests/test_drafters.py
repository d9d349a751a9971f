"""Every drafter kind through the one protocol (jspec.drafting.base): chain and tree modes give
greedy output identical to autoregressive decoding; a greedy tree's top-1 path is the drafter's
greedy chain, so each kind's tree feeder scores every node in that node's own context; sampled
trees of the kinds new to trees stay distributed exactly as the target."""

import itertools

import jax
import numpy as np
import pytest

from jspec.decode import prepare_batch
from jspec.drafting.base import Drafter
from jspec.drafting.model import early_exit_drafter, trimmed_drafter
from jspec.drafting.ngram import ngram_drafter
from jspec.generate import generate
from jspec.models.llama import init_params
from jspec.models.vocab_trim import trim_head
from jspec.sampling.processing import GREEDY, SamplingParams
from jspec.speculative.chain import SpecConfig, speculative_generate
from jspec.speculative.loop import initial_state
from jspec.speculative.tree import TreeSpecConfig, tree_speculative_generate
from jspec.tree.shapes import BranchingTree
from test_datastore import rest_drafter
from test_eagle import noisy_eagle
from test_ngram import REPEATING, TINY_REPEATING
from test_speculative import (PROMPTS, TARGET, TINY, chi_square, exact_distribution,
                              noised_drafter)
from test_tree_engine import sample_codes

KEEP = np.arange(0, TARGET.vocab_size, 2)
KINDS = {  # every kind of drafter the registry builds
    "model": lambda t: noised_drafter(t, 0.5),
    "early-exit": lambda t: early_exit_drafter(t, TARGET, 1),
    "trimmed": lambda t: trimmed_drafter(trim_head(noised_drafter(t, 0.5).params, KEEP), TARGET,
                                         KEEP),
    "feature": lambda t: noisy_eagle(t, TARGET, amount=0.1),
    "trimmed-feature": lambda t: noisy_eagle(t, TARGET, amount=0.1, keep_ids=KEEP),
    "ngram": lambda t: ngram_drafter(TARGET.vocab_size),
    "ngram+model": lambda t: ngram_drafter(TARGET.vocab_size, fallback=noised_drafter(t, 0.5)),
    "ngram+feature": lambda t: ngram_drafter(TARGET.vocab_size,
                                             fallback=noisy_eagle(t, TARGET, amount=0.1)),
    # The store knows the first prompt's continuation (2- and 3-token contexts): elsewhere the
    # model drafts.
    "rest+model": lambda t: rest_drafter(t, fallback=noised_drafter(t, 0.5),
                                         prompts=PROMPT_SET[:1], n_min=2),
}
PROMPT_SET = PROMPTS[:1] + REPEATING[:2]  # the repeating ones give the lookup matches
# test_speculative and test_tree_engine run the model and trimmed kinds through every chain
# length and tree method; here every other kind runs a chain and EAGLE-2's pruned tree.
NEW_KINDS = [k for k in KINDS if k not in ("model", "trimmed")]


@pytest.fixture(scope="module")
def target():
  return init_params(TARGET, jax.random.key(0), scale=0.3)


@pytest.fixture(scope="module")
def autoregressive(target):
  return generate(target, TARGET, PROMPT_SET, max_new_tokens=12).sequences()


@pytest.mark.parametrize("kind", NEW_KINDS)
def test_chain_and_tree_greedy_identical_to_autoregressive(target, autoregressive, kind):
  drafter = KINDS[kind](target)
  assert isinstance(drafter, Drafter)
  out = speculative_generate(target, TARGET, drafter, PROMPT_SET,
                             spec=SpecConfig(gamma=3, max_new_tokens=12))
  assert out.sequences() == autoregressive, kind
  out = tree_speculative_generate(target, TARGET, drafter, PROMPT_SET,
                                  spec=TreeSpecConfig("dynamic:8", max_new_tokens=12))
  assert out.sequences() == autoregressive, kind
  hist = np.asarray(out.accept_hist)
  assert hist[1:].sum() > 0, kind  # drafts were accepted: the tree path was exercised


def test_no_two_drafter_kinds_share_a_pytree_structure(target):
  """jit keys its programs by the arguments' treedefs, and jaxlib 0.10.2's treedef equality
  ignores a register_dataclass node's class and field names: two drafter classes that flatten
  alike (same leaves, same static values) could be handed each other's compiled loop. Every
  built-in kind over one target, and some as an n-gram lookup's fallback, must compare unequal
  to every other kind."""
  from jspec.drafting.lookahead import lookahead_drafter
  from jspec.drafting.model import self_drafter
  from jspec.drafting.probe import probe_drafter
  from jspec.drafting.skip import skip_drafter
  kinds = {k: make(target) for k, make in KINDS.items()}
  kinds |= {"self": self_drafter(target, TARGET), "skip": skip_drafter(target, TARGET, (0,)),
            "mtp": probe_drafter(target, TARGET, 2), "lookahead": lookahead_drafter(target, TARGET)}
  kinds |= {f"ngram+{k}": ngram_drafter(TARGET.vocab_size, fallback=d) for k, d in kinds.items()
            if k in ("self", "skip", "mtp", "early-exit", "trimmed")}
  structures = {k: jax.tree.structure(d) for k, d in kinds.items()}
  for (a, sa), (b, sb) in itertools.combinations(structures.items(), 2):
    # A treedef's text names each node's class: equal texts are one kind with other weights.
    assert sa != sb or str(sa) == str(sb), (a, b)


@pytest.mark.parametrize("kind", list(KINDS))
def test_greedy_tree_top_path_is_the_greedy_chain(target, kind):
  """In a fixed:3-2-2 tree at temperature 0 a node's first child is its argmax child, so nodes
  0, 3 and 9 (the first children down the first branch) must be the chain's greedy drafts."""
  drafter = KINDS[kind](target)
  prompts = [REPEATING[0], PROMPTS[2]]  # two rows of different lengths
  shape = BranchingTree("fixed", (3, 2, 2))
  spec = TreeSpecConfig(shape, max_new_tokens=8)
  b = prepare_batch(TARGET, prompts, max_new_tokens=8, sampling=GREEDY, key=0, stop_ids=(),
                    cache_size=None, reserve=spec.reserve, reserve_for="the tree")

  @jax.jit
  def both(drafter, tokens, lengths, key):
    s = initial_state(target, TARGET, drafter, tokens, lengths, key, b.sampling, spec,
                      b.cache_size, max_accepted=shape.max_depth, reserve=spec.reserve)
    chain, _, _ = drafter.propose(s.draft, s.last2, s.seq_len, key, b.sampling, 3)
    tree, _ = drafter.draft_tree(s.draft, s.last2, s.seq_len, key, b.sampling, shape)
    return chain, tree

  chain, tree = both(drafter, b.tokens, b.lengths, b.key)
  top_path = np.asarray(tree.tokens)[:, [0, 3, 9]]
  np.testing.assert_array_equal(top_path, np.asarray(chain), err_msg=kind)
  assert np.asarray(tree.valid)[:, [0, 3, 9]].all()


def test_sampled_lookup_and_feature_tree_is_lossless():
  """The lookup's one-hot override and the feature drafter's tree feeding, sampled together."""
  target = init_params(TINY, jax.random.key(10), scale=0.8)
  drafter = ngram_drafter(TINY.vocab_size, fallback=noisy_eagle(target, TINY, amount=0.8))
  sp = SamplingParams(temperature=1.0)
  codes = sample_codes(target, drafter, "specinfer:2-2", sp, 21, prompt=tuple(TINY_REPEATING))
  stat, dof, ok = chi_square(codes, exact_distribution(target, sp, prompt=TINY_REPEATING))
  assert ok, (stat, dof)
